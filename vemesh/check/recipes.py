"""The recipes ``vemesh check`` tries for a fused projection split as torch splits a Linear, and the hint it gives.

A Linear whose rows look like fused parts (the one-process forward cut its output into parts along its last dim:
``Recorder.read_parts``; else ``c_attn``, ``qkv``, ``gate_up`` in its name, or ``3C`` or ``2C`` rows over ``C``
inputs: :func:`fused_parts`), split over TP in plain blocks as torch's ``ColwiseParallel`` splits them,
is the likeliest cause when a module after it in its scope differs, or the forward raised there
(:func:`candidates`). Its name and shape alone cannot tell ``[q|k|v]`` from a head-major ``[q_h k_h v_h]`` (GPT-NeoX's
and Bloom's ``query_key_value``, whose rows ``ColwiseParallel`` shards exactly by heads), so the check does not guess: it runs the
parallel run again with each recipe in the style's place (:class:`Swap`, applied in each rank by :func:`swapped`
while the user's parallelize function runs), and the hint says which one made the check exact, or that none did.

The recipes, tried in this order on the Linear and its alike (every split Linear of the same last name and shape):

* ``local``: ``FusedColwiseParallel(N)``, for a forward that reads its output as this rank's heads;
* ``local-heads``: the same, with the head counts of the module that reads it set to this rank's (MPT's ``Wqkv``,
  chunked into q, k and v and viewed by ``self.n_heads``: :mod:`vemesh.check.heads`), where that module counts heads;
* ``global``: ``FusedColwiseParallel(N, use_local_output=False)``, for one written with global sizes;
* ``gathered``: ``ColwiseParallel(output_layouts=Replicate())`` with ``RowwiseParallel(input_layouts=Replicate())``
  on the RowwiseParallel Linears of its scope (the projection after it), for a forward that also mixes the parts
  with plain tensors (HF's Phi-3: rotary embeddings); tried only where the plan puts a RowwiseParallel in that
  scope (the run records where each style went: :func:`swapped`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from vemesh.check.compare import ran_before
from vemesh.check.record import plain_name
from vemesh.check.sequence import gathered_sequence
from vemesh.check.watches import input_watch, on_tp
from vemesh.parallel.fused import FusedColwiseParallel

__all__ = ["RECIPES", "Candidate", "Swap", "candidates", "fused_parts", "hint", "near", "refused_hint", "swapped",
           "width_candidates", "width_hint"]

#: what a Linear's own name says its rows hold, looked for in that order: fused parts, and how many
_FUSED_NAMES = (("qkv", 3), ("c_attn", 3), ("in_proj", 3), ("query_key_value", 3), ("gate_up", 2), ("w13", 2),
                ("w1w3", 2), ("kv", 2))

#: the recipes, in the order they are tried
RECIPES = ("local", "global", "gathered")


def fused_parts(name: str, out_features: int, in_features: int) -> int | None:
    """How many fused parts a Linear's rows seem to hold, by its name (``c_attn``, ``qkv``, ``gate_up``...), else by
    its shape (``3 C`` or ``2 C`` rows over ``C`` inputs); None where neither says so."""
    last = name.rpartition(".")[2].lower()
    parts = next((n for marker, n in _FUSED_NAMES if marker in last), None)
    if parts is None and out_features in (2 * in_features, 3 * in_features):
        parts = out_features // in_features
    return parts if parts is not None and out_features % parts == 0 else None


def near(first: str, name: str) -> bool:
    """Module ``first`` is in the scope of Linear ``name`` (its parent's), under it, or holds it ("" is the root)."""
    scope = name.rpartition(".")[0]
    return not first or name.startswith(first + ".") or first == scope or first.startswith(scope + ".")


def all_stages(records: list[dict], grads: dict[str, Any]) -> tuple[list[tuple[str, int, int, int]], dict]:
    """Under PP, the split Linears and where the plan's styles went (``split`` and ``went`` of the ranks'
    ``records``) on every stage: each rank records its own stages' modules, and a rank whose stage raised may be the
    only one to record anything. Merged over ``records``, then each split Linear's alike in the model as built
    (``grads``: the one-process run's gradients by name; the same last name and weight shape) counted as split, and as
    ColwiseParallel where it is, so that a recipe goes to every stage's layers and not to this stage's alone."""
    split = list(dict.fromkeys(tuple(s) for r in records for s in r["split"]))
    own = ("whole_input", "part_input", "colwise_part", "whole")  # a rank's own record, not names to merge
    went = {k: list(dict.fromkeys(n for r in records for n in r["went"].get(k, ()))) for k in records[0]["went"]
            if k not in own}
    went.update({k: next(r["went"][k] for r in records if k in r["went"]) for k in own
                 if any(k in r["went"] for r in records)})
    held = {n for n, *_ in split}
    for name, out_features, in_features, tp in list(split):
        last = name.rpartition(".")[2]
        for other, g in grads.items():
            module, _, kind = other.rpartition(".")
            if kind == "weight" and module not in held and module.rpartition(".")[2] == last and g is not None \
                    and tuple(g.shape) == (out_features, in_features):
                split.append((module, out_features, in_features, tp))
                held.add(module)
                went["colwise"] += [module] if name in went.get("colwise", ()) else []
    return split, went


@dataclass(frozen=True)
class Candidate:
    """A Linear that may be a fused projection split in plain blocks, and its alike (the split Linears of the same
    last name and shape, as every layer's ``c_attn``), which a recipe replaces together."""

    name: str
    names: tuple[str, ...]
    parts: int
    in_features: int
    out_features: int
    tp: int
    #: named as fused parts (``qkv_proj``) that its rows do not divide into equally: GQA's ``[q|k|v]`` with fewer KV
    #: heads, which no fused style cuts (the gathered recipe alone; ``parts`` 1)
    unequal: int = 0


def candidates(first: str, split: list[tuple[str, int, int, int]], before: set[str] | None = None,
               done: set[str] = frozenset(), ref: dict | None = None) -> list[Candidate]:
    """The Linears of ``split`` (:func:`vemesh.check.record.column_split_linears`) whose rows seem to be fused parts
    (:func:`fused_parts`) and whose scope holds module ``first`` (the first that differs, or the one whose forward
    raised), or which are in it, with their own output matched (``before``: the modules whose outputs came before
    ``first``'s; None where nothing was compared, as when the forward raised). ``done``: names already replaced.
    ``ref``, the one-process run: the parts its forward cut each Linear's output into (``Recorder.read_parts``)
    outrank a Linear's name and shape (ModernBERT's ``Wi``, ``[input|gate]`` of 1.5 C rows each, is ``3 C`` rows);
    where the forward raised, a Linear that ran after ``first`` in it is no candidate (:func:`ran_before`: an
    ``nn.TransformerEncoderLayer``'s ``linear1`` after the attention that raised), though it is another's alike."""
    read = (ref or {}).get("parts") or {}
    ran = ran_before(ref["outputs"], first) if before is None and ref and ref.get("outputs") else None
    found: list[Candidate] = []
    for name, out_features, in_features, tp in split:
        if ran is not None and name not in ran:
            continue
        parts, unequal = read.get(name) or fused_parts(name, out_features, in_features), 0
        if parts is None:  # named as fused, of unequal parts: the gathered recipe alone
            unequal = next((n for marker, n in _FUSED_NAMES if marker in name.rpartition(".")[2].lower()), 0)
            parts = 1 if unequal else None
        if parts is None or name in done or not near(first, name) or (before is not None and name not in before):
            continue
        if any(name in c.names for c in found):
            continue
        last = name.rpartition(".")[2]
        alike = tuple(n for n, o, i, _ in split if n.rpartition(".")[2] == last and (o, i) == (out_features,
                                                                                               in_features))
        found.append(Candidate(name, alike, parts, in_features, out_features, tp, unequal))
    return found


def width_candidates(first: str, split: list[tuple[str, int, int, int]], widths: set[int],
                     before: set[str] | None = None, done: set[str] = frozenset()) -> list[Candidate]:
    """Where module ``first`` (the first that differs, or the one whose forward raised) holds parameters of the whole
    output width of a Linear in its scope that TP split by rows (``widths``: the sizes of ``first``'s own 1-D
    parameters; a norm over the whole projected width, as OLMo 2's ``q_norm`` and ``k_norm`` before the heads'
    view): that Linear, with every split Linear of its scope (q, k and v together) and their alike, for the gathered
    recipe alone (``parts`` 1). The Linear's own output must have matched (``before``, as in :func:`candidates`)."""
    for name, out_features, in_features, tp in split:
        if out_features not in widths or name in done or not near(first, name) or first == name or \
                (before is not None and name not in before):
            continue
        scope = name.rpartition(".")[0]
        lasts = {(n.rpartition(".")[2], o, i) for n, o, i, _ in split if n.rpartition(".")[0] == scope}
        names = tuple(n for n, o, i, _ in split if (n.rpartition(".")[2], o, i) in lasts)
        return [Candidate(name, names, 1, in_features, out_features, tp)]
    return []


@dataclass(frozen=True)
class Swap:
    """A recipe (:data:`RECIPES`) for the ``ColwiseParallel`` of Linears ``linears``, whose rows hold ``parts``."""

    linears: tuple[str, ...]
    parts: int
    recipe: str

    def style(self) -> str:
        return {"local": f"FusedColwiseParallel({self.parts})",
                "local-heads": f"FusedColwiseParallel({self.parts}) with its reader's head counts set to this rank's",
                "global": f"FusedColwiseParallel({self.parts}, use_local_output=False)",
                "gathered": "ColwiseParallel(output_layouts=Replicate())"}[self.recipe]

    def scopes(self) -> set[str]:
        return {n.rpartition(".")[0] for n in self.linears}


@contextlib.contextmanager
def swapped(swaps: tuple[Swap, ...], model: nn.Module) -> Iterator[dict[str, list[str]]]:
    """While active, torch's ``ColwiseParallel`` and ``RowwiseParallel`` as the user's parallelize function applies
    them to ``model``'s modules, with ``swaps``' recipes in their place; yields where each style went, by the
    modules' names in ``model`` (``{"colwise": [...], "rowwise": [...], "swapped": [...]}``, and ``"sequence"``: the
    RowwiseParallel ones whose output is sharded, sequence parallelism's; ``"gathers"``: the modules whose style takes
    a sharded input and makes it whole, a ``PrepareModuleInput`` or a ``ColwiseParallel``): a recipe tried says which
    Linears it replaced, and the plan's own run says which scopes have a RowwiseParallel. Where torch's style
    refuses a module (not an ``nn.Linear`` or ``nn.Embedding``), ``"refused"`` is its name, its class and the
    style's (:func:`refused_hint`)."""
    names = {id(m): plain_name(n) for n, m in model.named_modules()}
    modules = {plain_name(n): m for n, m in model.named_modules()}
    colwise = {n: s for s in swaps if s.recipe in RECIPES or s.recipe == "local-heads" for n in s.linears}
    gathered = {scope for s in swaps if s.recipe == "gathered" for scope in s.scopes()}
    added = [n for s in swaps if s.recipe == "added" for n in s.linears]  # whole Linears split by columns
    rows_added = [n for s in swaps if s.recipe == "rows-added" for n in s.linears]  # and by rows
    as_col = {n for s in swaps if s.recipe == "as-colwise" for n in s.linears}  # the plan's styles swapped
    as_row = {n for s in swaps if s.recipe == "as-rowwise" for n in s.linears}
    replicated = {n for s in swaps if s.recipe == "replicated" for n in s.linears}  # RowwiseParallel of whole input
    gather_into = [n for s in swaps if s.recipe == "sequence-gathered" for n in s.linears]  # the sequence whole in
    sequence_norms = [n for s in swaps if s.recipe == "sequence-norms" for n in s.linears]  # and kept a part in
    went: dict[str, list[str]] = {"colwise": [], "rowwise": [], "swapped": []}
    col_apply, row_apply, prepare_apply = ColwiseParallel._apply, RowwiseParallel._apply, PrepareModuleInput._apply
    meshes: list[Any] = []  # the TP mesh the user's function gave torch's styles

    def col(self: ColwiseParallel, module: nn.Module, device_mesh) -> nn.Module:  # type: ignore[no-untyped-def]
        name = names.get(id(module))
        if type(self) is not ColwiseParallel or name is None:  # FusedColwiseParallel's own call, or a new module
            return col_apply(self, module, device_mesh)
        went["colwise"].append(name)
        meshes.append(device_mesh)
        if isinstance(self.input_layouts[0], Shard):
            went.setdefault("gathers", []).append(name)
        if self.use_local_output and isinstance(self.output_layouts[0], Shard):  # a plain tensor of this rank's part
            went.setdefault("local_out", []).append(name)
        if isinstance(module, nn.Embedding):
            went.setdefault("col_embeddings", []).append(name)
        if name in as_row:  # an Embedding's ids whole on every rank, as torchtitan's plan gives them
            went["swapped"].append(name)
            embedding = isinstance(module, nn.Embedding)
            return row_apply(RowwiseParallel(input_layouts=Replicate()) if embedding else RowwiseParallel(), module,
                             device_mesh)
        swap = colwise.get(name)
        if swap is None:
            out = col_apply(self, module, device_mesh)
            if isinstance(module, nn.Linear) and not isinstance(self.input_layouts[0], Shard):  # takes it whole
                module.register_forward_pre_hook(input_watch(name, "colwise_part", module.in_features,
                                                             device_mesh.size(), went), prepend=True)
            return out
        went["swapped"].append(name)
        if swap.recipe == "gathered":
            style = ColwiseParallel(input_layouts=self.input_layouts[0], output_layouts=Replicate())
            style.src_data_rank = self.src_data_rank
            return col_apply(style, module, device_mesh)
        fused = FusedColwiseParallel(swap.parts, input_layouts=self.input_layouts[0],
                                     use_local_output=swap.recipe != "global")
        fused.src_data_rank = self.src_data_rank
        return fused._apply(module, device_mesh)  # its own call of ColwiseParallel._apply goes to torch's

    def row(self: RowwiseParallel, module: nn.Module, device_mesh) -> nn.Module:  # type: ignore[no-untyped-def]
        name = names.get(id(module))
        if type(self) is not RowwiseParallel or name is None:
            return row_apply(self, module, device_mesh)
        went["rowwise"].append(name)
        meshes.append(device_mesh)
        if isinstance(module, nn.Embedding) and isinstance(self.input_layouts[0], Shard) and name not in replicated:
            went.setdefault("sharded_ids", []).append(name)  # torch's default: the ids taken as this rank's part
        if name in as_col:
            went["swapped"].append(name)
            return col_apply(ColwiseParallel(), module, device_mesh)
        if isinstance(self.output_layouts[0], Shard):  # sequence parallelism: its output is a part of the sequence
            went.setdefault("sequence", []).append(name)
            went["sequence_dim"] = [self.output_layouts[0].dim]
        if name.rpartition(".")[0] not in gathered and name not in replicated:
            out = row_apply(self, module, device_mesh)
            if isinstance(self.input_layouts[0], Shard) and isinstance(module, nn.Linear):
                module.register_forward_pre_hook(input_watch(name, "whole_input", module.in_features,
                                                              device_mesh.size(), went), prepend=True)
            return out
        went["swapped"].append(name)
        style = RowwiseParallel(input_layouts=Replicate(), output_layouts=self.output_layouts[0],
                                use_local_output=self.use_local_output)
        style.src_data_rank = self.src_data_rank
        return row_apply(style, module, device_mesh)

    def prepare(self: PrepareModuleInput, module: nn.Module, device_mesh) -> nn.Module:  # type: ignore[no-untyped-def]
        pairs = [*zip(self.input_layouts or (), self.desired_input_layouts or ()),
                 *((v, self.desired_input_kwarg_layouts.get(k)) for k, v in self.input_kwarg_layouts.items())]
        name = names.get(id(module))
        if name is not None and any(isinstance(a, Shard) and isinstance(b, Replicate) for a, b in pairs):
            went.setdefault("gathers", []).append(name)
        return prepare_apply(self, module, device_mesh)

    def refused(apply):  # type: ignore[no-untyped-def]
        def wrapped(self, module: nn.Module, device_mesh) -> nn.Module:  # type: ignore[no-untyped-def]
            try:
                out = apply(self, module, device_mesh)
            except NotImplementedError:  # torch's "only support nn.Linear and nn.Embedding": GPT-2's Conv1D
                went["refused"] = [names.get(id(module), "?"), type(module).__name__, type(self).__name__]
                raise
            scope = names.get(id(module), "").rpartition(".")[0]
            for name in [n for n in pending if n.rpartition(".")[0] == scope]:  # a Linear a recipe adds, styled
                pending.remove(name)  # with its scope's first, before the user's FSDP2 can shard it
                add(name, device_mesh)
            return out
        return wrapped

    def add(name: str, device_mesh) -> None:  # type: ignore[no-untyped-def]
        if isinstance(modules.get(name), nn.Linear) and not on_tp(modules[name].weight):
            (col_apply if name in added else row_apply)(
                ColwiseParallel() if name in added else RowwiseParallel(), modules[name], device_mesh)
            went["swapped"].append(name)

    pending = [*added, *rows_added]

    ColwiseParallel._apply, RowwiseParallel._apply = refused(col), refused(row)  # type: ignore[method-assign]
    PrepareModuleInput._apply = prepare  # type: ignore[method-assign]
    try:
        yield went
    finally:
        ColwiseParallel._apply, RowwiseParallel._apply = col_apply, row_apply  # type: ignore[method-assign]
        PrepareModuleInput._apply = prepare_apply  # type: ignore[method-assign]
    if not meshes:  # no torch style applied: nothing for the recipes here
        return
    for name in pending:  # no style in their scope: after the user's function, on the mesh it gave torch's styles
        add(name, meshes[0])
    if went.get("sequence"):  # the norms a sequence-parallel plan may leave whole (check.positions)
        went["norms"] = [n for n, m in modules.items() if "Norm" in type(m).__name__ and
                         any(True for _ in m.parameters(recurse=False)) and not on_tp(next(m.parameters()))]
    for name in [*sequence_norms, *gather_into]:
        if name in sequence_norms:
            style = SequenceParallel(sequence_dim=went["sequence_dim"][0], use_local_output=True)  # a plain part out
            style._apply(modules[name], meshes[0])
        else:
            modules[name].register_forward_pre_hook(gathered_sequence(meshes[0], went["sequence_dim"][0]),
                                                    with_kwargs=True)
        went["swapped"].append(name)
    whole = [(n, m) for n, m in modules.items() if isinstance(m, nn.Linear) and not on_tp(m.weight)]
    went["whole"] = [[n, m.in_features] for n, m in whole]  # what TP left whole (whole_input.siblings)
    tp = meshes[0].size()
    for name, module in whole:
        if tp > 1 and module.in_features % tp == 0:
            module.register_forward_pre_hook(input_watch(name, "part_input", module.in_features, tp, went),
                                             prepend=True)


def hint(candidate: Candidate, raised: bool, tried: list[tuple[Swap, list[str], str]], fixed: bool,
         copied: bool = False) -> str:
    """The hint for ``candidate``: ``tried`` is each recipe run, the modules it replaced, and what the check said then
    (``""``: exact; else where it still differed or raised); none where the plan split it with a style of its own
    (not torch's ColwiseParallel), which no recipe can take the place of. ``fixed``: the last one tried cleared the
    Linear's scope (exact, or the first difference is now elsewhere: another cause, with its own hint); ``copied``:
    with a copy of a TP style's output, which the next hint names (:mod:`vemesh.check.clones`)."""
    c = candidate
    what = "[q|k|v]" if c.parts == 3 else "[gate|up] or [k|v]"
    alike = f" and its {len(c.names) - 1} alike" if len(c.names) > 1 else ""
    head = (f"{c.name} (Linear {c.in_features} -> {c.out_features}){alike} split by rows in {c.tp} plain blocks, as "
            "torch's ColwiseParallel splits them, and " + ("what reads its output raised" if raised else
                                                           "its output matches but what reads it differs") + ". ")
    if not tried:
        return (head.replace("as torch's ColwiseParallel splits them", "by a style other than torch's ColwiseParallel")
                + f"The check tries the fused recipes only in the place of torch's ColwiseParallel, so it did not. If "
                f"its rows are {c.parts} fused parts ({what}) of {c.out_features // c.parts} rows each, TP rank 0 "
                f"holds its first {c.out_features // c.tp} rows, not its share of each part: "
                f"vemesh.parallel.FusedColwiseParallel({c.parts}) shards each part (docs/checking.md: a fused "
                "[q|k|v] or [gate|up] projection)")
    if fixed:
        swap, replaced, outcome = tried[-1]
        rows = [n for n in replaced if swap.recipe == "gathered" and n not in swap.linears
                and n.rpartition(".")[0] in swap.scopes()]  # the RowwiseParallel it replaced, not a kept recipe's
        withs = ([f"RowwiseParallel(input_layouts=Replicate()) on {_names(rows)}"] if rows else []) + \
            ["the copy of the next hint"] * copied
        extra = f", with {' and '.join(withs)}," if withs else ""
        then = "makes the check exact" if not outcome else f"clears its scope (the check then {outcome})"
        if swap.recipe == "gathered":  # the fused styles did not clear it: the rows' layout is not proven
            return (head + f"Tried: {swap.style()} in its place{extra} {then}: every TP rank then computes the whole "
                    "of what reads its output. The fused styles did not clear it: its rows are fused parts that the "
                    "forward mixes with plain tensors (Phi-3's rotary embedding), or parts of unequal sizes "
                    "(Falcon-7B's multi-query [q|k|v], one k and one v head), or heads that the forward needs all of "
                    "(a bias of every head it is handed: docs/checking.md's per-head inputs): use that "
                    "(docs/checking.md: a fused [q|k|v] or [gate|up] projection)")
        return (head + f"Tried: {swap.style()} in its place{extra} {then}. Its rows are {c.parts} fused parts "
                f"({what}) of {c.out_features // c.parts} rows each, and TP rank 0 held its first "
                f"{c.out_features // c.tp} rows, not its share of each part: use that (docs/checking.md: a fused "
                "[q|k|v] or [gate|up] projection)")
    said = "; ".join(f"{s.style()}: {outcome}" for s, _, outcome in tried)
    return (head + f"Tried in its place: {said}. None cleared it, so how its rows are split is not the cause, or not "
            "the only one: look at where the tries still went wrong (a head-major [q_h k_h v_h] Linear, as GPT-NeoX "
            "ships, is exact under ColwiseParallel where its forward views it by -1 heads)")


def width_hint(candidate: Candidate, first: str, tried: list[tuple[Swap, list[str], str]], fixed: bool) -> str:
    """The hint for a :func:`width_candidates` Linear, whose output's whole width module ``first`` needs; ``tried``
    and ``fixed`` as :func:`hint` takes them (the gathered recipe alone)."""
    c = candidate
    scope = {n for n in c.names if n.rpartition(".")[0] == c.name.rpartition(".")[0]}
    head = (f"{first or 'the root'} holds parameters of {c.name}'s whole output width ({c.out_features}), but TP "
            f"splits {c.name} by rows, so each TP rank hands it {c.out_features // c.tp} (a norm over the whole "
            f"projected width, as OLMo 2's q_norm and k_norm). ")
    if c.unequal:
        head = (f"{c.name} (Linear {c.in_features} -> {c.out_features}) is named as {c.unequal} fused parts that its "
                f"{c.out_features} rows hold unequally (GQA's [q|k|v] with fewer KV heads, as Phi-3-medium's and "
                "Phi-4's qkv_proj), which no fused style cuts over TP, and TP split it in plain blocks of rows. ")
    swap, replaced, outcome = tried[-1]
    rows = [n for n in replaced if n not in swap.linears and n.rpartition(".")[0] in swap.scopes()]
    style = (f"ColwiseParallel(output_layouts=Replicate()) on {', '.join(sorted(scope))}"
             + (f" (and their {len(c.names) - len(scope)} alike)" if len(c.names) > len(scope) else "")
             + (f", with RowwiseParallel(input_layouts=Replicate()) on {_names(rows)}" if rows else ""))
    if fixed and not outcome:
        return (head + f"Tried: {style}, makes the check exact: every TP rank then runs the whole of "
                f"{c.name.rpartition('.')[0] or 'the root'} on the gathered projections, as HF's own plan for such a "
                "model does (colwise_gather_output, "
                "rowwise_split_input) (docs/checking.md: a norm over the whole projected width)")
    if fixed:
        return head + f"Tried: {style}, clears its scope (the check then {outcome})"
    return head + f"Tried: {style}: {outcome}. None cleared it, so the width is not the cause, or not the only one"


def refused_hint(name: str, kind: str, style: str) -> str:
    """The hint where torch's ``style`` refused module ``name`` of class ``kind``."""
    text = (f"{name} is a {kind}: torch's {style} shards an nn.Linear or an nn.Embedding only. ")
    if kind == "Conv1D":
        return text + ("transformers' Conv1D (GPT-2's c_attn, c_proj, c_fc) is a Linear that stores its weight as "
                       "[in, out]: build the model with an nn.Linear in place of each (its weight the Conv1D's "
                       "transposed) in the factory, so that both runs have the same parameters, then c_attn is a "
                       "fused [q|k|v] (docs/checking.md: GPT-2's Conv1D)")
    return text + "Shard its inner Linears, or give it a ParallelStyle of its own"


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} and its {len(names) - 1} alike"

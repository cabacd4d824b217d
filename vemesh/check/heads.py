"""The recipe ``vemesh check`` tries where an attention reads the whole model's head counts under TP.

torch's ``ColwiseParallel`` shards a projection's weight; it never changes the attributes of the module that reads the
projection's output. Many attentions reshape by their own head count (``view(B, T, self.num_heads, head_dim)``: HF's
Falcon, Bloom, GPT-J, OPT, StableLM, GPTBigCode): under TP each rank holds ``num_heads / TP`` heads of rows, so the
view raises (``shape '[2, 16, 4, 3, 16]' is invalid``) or, where a ``-1`` takes the rest, silently folds heads into
the sequence (OPT's ``view(bsz, -1, self.num_heads, head_dim)``). Megatron keeps ``num_attention_heads_per_partition``
for this; torchtitan's attention views by ``-1`` heads. The fix in the user's parallelize function is one line per
attribute: ``module.num_heads //= tp``.

Each rank records, for the module that holds each Linear split by rows over TP (the projection's scope), its integer
attributes that count heads (:func:`head_counts`: a name with ``head`` in it, not a size, a dim or a group count,
divisible by TP) and that the user's parallelize function left as the model was built (a count it set already is
this rank's). Where the run went wrong in such a scope, the check runs again with those attributes divided by TP
on that module and its alike (every layer's: the same class and the same counts), set after the user's parallelize
function returns (:func:`set_heads`), and :func:`hint` says whether that made the check exact. The check decides:
a layout the divided counts misread (CodeGen's ``mp_num`` groups) still differs, and is not offered.

Some attentions also hold a table with a column per head: T5's ``relative_attention_bias``, an ``nn.Embedding`` of
``(buckets, n_heads)`` whose rows are added to the attention's scores. Under TP its output still has every head, and
the sum with this rank's scores raises (``size of tensor a (2) must match ... (4)``). GPT-OSS keeps ``sinks``, a
parameter of one logit per head, and concatenates it to the scores, which raises the same way. Each rank records, of
the model as built, the Embeddings whose width is a head count of the module that holds them, and that module's own
parameters with a dim of that many (:func:`head_tables`; a module that counts no heads in an attribute counts its
projections' output over its ``head_dim``). The recipe shards those of its modules over TP on their heads, before the
user's parallelize function, so that a data-parallel wrapper sees the sharded weight: torch's ``ColwiseParallel`` on
an Embedding, :class:`vemesh.parallel.HeadwiseParallel` on the module holding a parameter; with the counts set where
the module has them, alone where it has none. StableLM's ``qk_layernorm`` keeps a ModuleList of one LayerNorm per
head, which its forward zips with the heads it is handed, so that this rank's heads meet the first heads' norms,
silently; such a list (of a head count of alike modules) is taken per head in the recipe
(``HeadwiseParallel(modules=...)``: each rank runs its own heads' modules, their weights replicated over TP).

Some attentions are handed a tensor of every head rather than holding one: HF's Bloom builds its ALiBi bias in the
model, ``(batch * n_head, 1, seq)``, and hands it to each attention, whose scores are this rank's heads under TP. Each
rank records, at the first forward of each module that counts heads, the shapes of the tensors it is handed
(:func:`watch_inputs`); an input other than the first (the hidden states, whose first dim is the batch) whose first
dim holds one of the module's head counts, once or once per sequence of the batch, is sliced to this rank's heads in
the recipe (:class:`vemesh.parallel.HeadwiseParallel` with ``inputs``), with the counts.

A TP degree that does not divide a split projection's heads (GQA's few KV heads: 2 of them over TP 4) leaves a rank
part of a head, and the attention's view raises. No recipe helps: :func:`vemesh.parallel.tp_split.uneven_hint` names
the projection, its heads and the TP degrees that divide them.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from vemesh.check.clones import layer_pattern
from vemesh.parallel.headwise import HeadwiseParallel, counts_heads, own_head_counts
from vemesh.parallel.tp_split import parts, plain_name

__all__ = ["LocalHeads", "candidate", "counts_of", "head_counts", "head_tables", "head_widths", "hint", "set_heads",
           "shard_tables", "unsharded", "watch_inputs"]

def counts_of(model: nn.Module) -> dict[str, tuple[str, dict[str, int]]]:
    """Every module's class and integer attributes that count heads (a name with ``head`` in it, not a size, a dim
    or a group count), and the widths they make (:func:`head_widths`), by the module's name. Taken before the user's
    parallelize function too, to tell the whole model's counts from counts the function set already."""
    found = {}
    for name, module in (nm for part, _ in parts(model) for nm in part.named_modules()):
        counts = own_head_counts(module)
        if counts:
            found[plain_name(name)] = (type(module).__qualname__, {**counts, **head_widths(module, counts)})
    return found


#: an attribute named with one of these may hold a width (``embed_dim``, ``hidden_size``, ``all_head_size``)
_WIDTHS = ("dim", "size", "width")


def head_widths(module: nn.Module, counts: dict[str, int]) -> dict[str, int]:
    """The module's own integer attributes, named as a width (``_WIDTHS``), worth one of its head ``counts`` times
    its integer ``head_dim``, that its class's code reads past ``__init__``: the width of its heads, whole, which TP
    divides with them (XGLM's attention reshapes its heads' output by ``self.embed_dim``, GPT-2's splits its fused
    projection by ``self.split_size``). Where that code cannot be read, none."""
    dim = vars(module).get("head_dim")
    if type(dim) is not int or dim < 1:
        return {}
    made = {c * dim for c in counts.values()}
    widths = {k: v for k, v in vars(module).items() if type(v) is int and v in made and k != "head_dim"
              and k not in counts and any(w in k.lower() for w in _WIDTHS)}
    return {k: v for k, v in widths.items() if k in _read_past_init(type(module))}


@functools.lru_cache(maxsize=256)
def _read_past_init(cls: type) -> frozenset[str]:
    """The attributes ``self.NAME`` that the methods of ``cls`` and its bases but ``__init__`` read, from their source
    (torch's ``nn.Module`` and what it derives from left out)."""
    names: set[str] = set()
    for name, fn in ((n, f) for c in cls.__mro__ if c not in nn.Module.__mro__ for n, f in vars(c).items()):
        if name != "__init__" and inspect.isfunction(fn):
            try:
                names.update(re.findall(r"\bself\.(\w+)", inspect.getsource(fn)))
            except (OSError, TypeError):  # no source (built in a REPL, or compiled): nothing read that we can see
                pass
    return frozenset(names)


def head_counts(model: nn.Module, split: list[tuple[str, int, int, int]],
                built: dict[str, tuple[str, dict[str, int]]]) -> dict[str, tuple[str, dict[str, int], dict[str, int]]]:
    """For the module that holds each Linear of ``split`` (:func:`vemesh.check.record.column_split_linears`): its
    class, its head counts (:func:`counts_of`) that are still the model's as built (``built``, :func:`counts_of` of it)
    and that the Linear's TP degree divides, and the model's counts as built of those and of the ones the user's
    function set to this rank's already (the heads of what its forward is handed: :func:`per_head_inputs`), by the
    module's name."""
    degree = {n.rpartition(".")[0]: tp for n, _, _, tp in split}
    found: dict[str, tuple[str, dict[str, int], dict[str, int]]] = {}
    modules = {plain_name(n): m for part, _ in parts(model) for n, m in part.named_modules()}
    for name, (kind, counts) in counts_of(model).items():
        tp, whole = degree.get(name), built.get(name, ("", {}))[1]
        # its widths as built, as they are now (the counts the user's function divided no longer make them)
        now = vars(modules[name])
        counts = {**counts, **{k: now[k] for k in whole if not counts_heads(k) and type(now.get(k)) is int}}
        kept = {k: v for k, v in counts.items() if tp and v % tp == 0 and whole.get(k) == v}
        done = {k: v for k, v in whole.items() if tp and v % tp == 0 and counts.get(k) == v // tp}
        if kept or done:
            found[name] = (kind, kept, {**done, **kept})
    return found


#: the heads "dim" (:func:`head_tables`) of an Embedding with a column per head, of a ModuleList of one module per
#: head, and of a Linear with an output per head; a parameter's is its own dim, 0 or more
PER_HEAD_COLUMNS, PER_HEAD_MODULES, PER_HEAD_OUTPUTS = -1, -2, -3


def head_tables(model: nn.Module, built: dict[str, tuple[str, dict[str, int]]]) -> dict[str, tuple[str, int]]:
    """What ``model`` as built holds with a value per head beside its projections, by name, with the name of the
    module that holds it and the dim of the heads: the Embeddings whose width is a head count of that module (T5's
    ``relative_attention_bias``; dim :data:`PER_HEAD_COLUMNS`), that module's own parameters with a dim of
    that many (GPT-OSS's ``sinks``), and those of 2 dims or more of its children that hold no module (Cohere's
    ``q_norm``, a LayerNorm of ``(heads, head_dim)``; a norm's one weight per feature is not one); and the ModuleLists
    of a head count of alike modules with parameters, its own or its children's (StableLM's ``q_layernorm.norms``, a
    LayerNorm per head: dim :data:`PER_HEAD_MODULES`); and its child Linears of an output per head (a gate per head,
    as Laguna's ``g_proj``: dim :data:`PER_HEAD_OUTPUTS`). A module's head counts are its integer counts (``built``:
    :func:`counts_of` of the model) and, where it has an integer ``head_dim``, its child Linears' output features
    over it."""
    found: dict[str, tuple[str, int]] = {}
    for scope, module in model.named_modules():
        heads = {v for k, v in built.get(scope, ("", {}))[1].items() if counts_heads(k)}  # not its widths
        width = getattr(module, "head_dim", None)
        if type(width) is int and width > 0:
            heads |= {c.out_features // width for c in module.children() if isinstance(c, nn.Linear)
                      and c.out_features % width == 0 and c.out_features > width}
        prefix = scope + "." if scope else ""
        own = list(module.named_parameters(recurse=False))
        for name, child in module.named_children():
            if isinstance(child, nn.Embedding) and child.embedding_dim in heads:
                found[prefix + name] = (scope, PER_HEAD_COLUMNS)
            elif isinstance(child, nn.Linear) and child.out_features in heads:
                found[prefix + name] = (scope, PER_HEAD_OUTPUTS)
            elif not isinstance(child, nn.Linear) and next(child.children(), None) is None:
                own += [(f"{name}.{n}", p) for n, p in child.named_parameters(recurse=False) if p.dim() > 1]
            lists = [(name, child)] + [(f"{name}.{n}", c) for n, c in child.named_children()]
            for n, c in lists:  # the outermost scope's: the attention's, whose recipe it joins
                if _per_head(c, heads):
                    found.setdefault(prefix + n, (scope, PER_HEAD_MODULES))
        for name, p in own:
            dim = next((d for d, n in enumerate(p.shape) if n in heads), None)
            if dim is not None:
                found[prefix + name] = (scope, dim)
    return found


def _per_head(child: nn.Module, heads: set[int]) -> bool:
    """``child`` is a ModuleList of a head count of alike modules, each with parameters of its own."""
    if not isinstance(child, nn.ModuleList) or len(child) < 2 or len(child) not in heads:
        return False
    kinds = {tuple((n, tuple(p.shape)) for n, p in c.named_parameters(recurse=False)) for c in child}
    return len(kinds) == 1 and bool(next(iter(kinds)))


def unsharded(tables: dict[str, tuple[str, int]], params: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """Of ``tables`` (:func:`head_tables`), those whose parameter (``params``: the parallelized model's, by name as
    built) the user's parallelize function left unsharded over TP: a DTensor on a mesh with a TP dim is sharded
    already (FSDP2's over the data dims alone is not)."""
    def on_tp(p: Any) -> bool:
        return isinstance(p, DTensor) and "TP" in (p.device_mesh.mesh_dim_names or ())

    def held(name: str, dim: int) -> Any:
        if dim == PER_HEAD_MODULES:  # its first module's first parameter
            return next((p for k, p in params.items() if k.startswith(name + ".")), None)
        return params.get(name + ".weight" if dim in (PER_HEAD_COLUMNS, PER_HEAD_OUTPUTS) else name)

    return {n: v for n, v in tables.items() if not on_tp(held(n, v[1]))}


@dataclass(frozen=True)
class LocalHeads:
    """The recipe: on each of ``modules``, each of ``counts`` (attribute, the whole model's value) set to the value
    divided by ``tp``; and each of ``tables`` (:func:`head_tables` of those modules: name, heads dim) sharded over TP
    on its heads."""

    modules: tuple[str, ...]
    counts: tuple[tuple[str, int], ...]
    tp: int
    tables: tuple[tuple[str, int], ...] = ()
    #: the inputs of their forward sliced to this rank's heads: (argument name, heads dim, the whole model's heads)
    inputs: tuple[tuple[str, int, int], ...] = ()


def watch_inputs(heads: dict[str, Any], model: nn.Module) -> dict[str, list]:
    """The tensors handed to each module of ``heads`` (:func:`head_counts`) at its first forward, in order, as
    ``[argument name, shape]``, by the module's name: filled as the step runs."""
    seen: dict[str, list] = {}
    for name, module in (nm for part, _ in parts(model) for nm in part.named_modules()):
        if plain_name(name) not in heads:
            continue
        try:
            names = list(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            names = []

        def record(_: nn.Module, args: tuple, kwargs: dict, name: str = plain_name(name), names: list = names) -> None:
            if name not in seen:  # the first forward's alone: later calls pay a lookup
                given = [*zip(names, args), *kwargs.items()]
                seen[name] = [[n, list(t.shape)] for n, t in given if isinstance(t, torch.Tensor)]

        module.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def per_head_inputs(handed: list, counts: dict[str, int]) -> tuple[tuple[str, int, int], ...]:
    """Of the tensors a module was handed (:func:`watch_inputs`), those of one of its head counts ``counts`` (of
    :func:`counts_of`, its widths left out):
    ``(name, dim, heads)``. The first, the hidden states, gives the batch. Its first dim holds the heads once, or
    once per sequence (Bloom's ALiBi, ``(batch * heads, 1, seq)``), and is not the batch's own (a mask, positions);
    or its first dim is the batch's (or 1) and its second the heads (Falcon's, ``(batch, heads, 1, seq)``)."""
    if not handed:
        return ()
    batch, found = handed[0][1][0] if handed[0][1] else None, []
    for name, shape in handed[1:]:
        for heads in sorted({v for k, v in counts.items() if counts_heads(k)}, reverse=True):  # not its widths
            if shape and shape[0] != batch and shape[0] in (heads, heads * (batch or 0)):
                found.append((name, 0, heads))
            elif len(shape) > 1 and shape[0] in (batch, 1) and shape[1] == heads:
                found.append((name, 1, heads))
            else:
                continue
            break
    return tuple(found)


def candidate(first: str, split: list[tuple[str, int, int, int]], colwise: list[str],
              heads: dict[str, tuple[str, dict[str, int], dict[str, int]]],
              tables: dict[str, tuple[str, int]] | None = None,
              handed: dict[str, list] | None = None) -> LocalHeads | None:
    """The recipe for where the run went wrong (module ``first``: the one whose forward raised, or the first that
    differs): the scope of a Linear that torch's ColwiseParallel split (``colwise``: where the plan's style went), if
    that scope counts heads (``heads``: :func:`head_counts`), with its alike, their per-head tables (``tables``:
    :func:`head_tables`) and the per-head inputs it was handed (``handed``: :func:`watch_inputs`,
    :func:`per_head_inputs`); None where there is none."""
    tables, handed = tables or {}, handed or {}
    for name, _, _, tp in split:
        scope = name.rpartition(".")[0]
        holds = any(s == scope for s, _ in tables.values())
        kind, own, whole = heads.get(scope, ("", {}, {}))
        inputs = per_head_inputs(handed.get(scope, []), whole)
        # the counts set already: what it holds or is handed per head is the likelier cause than a width alone
        # (Bloom's hidden_size, which it does not read unless pretraining_tp > 1)
        counts = {} if (inputs or holds) and not any(counts_heads(k) for k in own) else own
        if not (counts or inputs or holds) or name not in colwise or not (
                not first or first == scope or first.startswith(scope + ".") or scope.startswith(first + ".")):
            continue
        if scope in heads:
            others = {s for s, (k, c, w) in heads.items() if (k, c, w) == (kind, own, whole)}
        else:  # no counts: its alike are the other layers' modules holding the same
            others = {s for s, _ in tables.values() if layer_pattern(s) == layer_pattern(scope)}
        alike = (scope, *sorted(others - {scope}))  # where the run went wrong first: the hint names it
        held = tuple(sorted(((t, d) for t, (s, d) in tables.items() if s in alike), key=lambda t: (
            tables[t[0]][0] != scope, t)))
        return LocalHeads(alike, tuple(sorted(counts.items())), tp, held, inputs)
    return None


def set_heads(recipes: tuple[LocalHeads, ...], model: nn.Module, mesh: Any) -> None:
    """Each recipe's counts set to this rank's on its modules of ``model`` (after the user's parallelize function),
    and the inputs it names sliced to this rank's heads (:class:`~vemesh.parallel.HeadwiseParallel` on each, over
    ``mesh["TP"]``)."""
    for name, module in (nm for part, _ in parts(model) for nm in part.named_modules()):
        for recipe in recipes:
            if plain_name(name) in recipe.modules:
                for attr, whole in recipe.counts:
                    setattr(module, attr, whole // recipe.tp)
                for heads in sorted({h for _, _, h in recipe.inputs}):
                    named = {n: d for n, d, h in recipe.inputs if h == heads}
                    parallelize_module(module, mesh["TP"], HeadwiseParallel(inputs=named, heads=heads))


def shard_tables(recipes: tuple[LocalHeads, ...], model: nn.Module, mesh: Any) -> None:
    """Each recipe's per-head tables of ``model`` (as built, before the user's parallelize function) sharded over
    ``mesh["TP"]`` on their heads: torch's ``ColwiseParallel`` on each Embedding (its weight ``Shard(1)``, its output
    this rank's heads), :class:`~vemesh.parallel.HeadwiseParallel` on the module holding each parameter."""
    params: dict[tuple[str, int], list[str]] = {}
    for name, dim in (t for recipe in recipes for t in recipe.tables):
        scope, _, attr = name.rpartition(".")
        if dim in (PER_HEAD_COLUMNS, PER_HEAD_OUTPUTS):  # torch's ColwiseParallel splits either
            parallelize_module(model.get_submodule(name), mesh["TP"], ColwiseParallel())
        else:
            params.setdefault((scope, dim), []).append(attr)
    for (scope, dim), names in params.items():
        style = HeadwiseParallel(modules=tuple(names)) if dim == PER_HEAD_MODULES else \
            HeadwiseParallel(tuple(names), dim)
        parallelize_module(model.get_submodule(scope), mesh["TP"], style)


def _held(tables: tuple[tuple[str, int], ...], modules: tuple[str, ...] = ()) -> str:
    """What sharding ``tables`` (a recipe's, of its ``modules``) means, in the hint's words."""
    def named(names: list[str]) -> str:
        return names[0] + (f" (and its {len(names) - 1} alike)" if len(names) > 1 else "")

    embeddings, params = [n for n, d in tables if d == PER_HEAD_COLUMNS], [(n, d) for n, d in tables if d >= 0]
    lists = [n for n, d in tables if d == PER_HEAD_MODULES]
    outputs = [n for n, d in tables if d == PER_HEAD_OUTPUTS]
    said = []
    if outputs:
        said.append(f"the Linears with an output per head that they hold, {named(outputs)}, split over TP on their "
                    "heads (ColwiseParallel() on each, in your TP plan)")
    if embeddings:
        said.append(f"the tables with a column per head that they hold, {named(embeddings)}, sharded over TP on their "
                    "heads (ColwiseParallel() on each, in the TP plan of the module that holds it)")
    if lists:  # each named from its attention: every one of them needs the style
        attrs = tuple(sorted({n.rpartition(".")[2] for n in lists}))
        relative = sorted({next((n[len(m) + 1:] for m in modules if n.startswith(m + ".")), n) for n in lists})
        said.append(f"their ModuleLists of a module per head ({', '.join(relative)} of each, {len(lists)} in all), "
                    f"each rank running its own heads' modules (vemesh.parallel.HeadwiseParallel(modules={attrs!r}) "
                    "on each module that holds one, in your TP plan)")
    if params:
        attrs = tuple(sorted({n.rpartition(".")[2] for n, _ in params}))
        dim = f", dim={params[0][1]}" if params[0][1] else ""
        said.append(f"their parameters with a value per head, {named([n for n, _ in params])}, sharded over TP on "
                    f"their heads (vemesh.parallel.HeadwiseParallel({attrs!r}{dim}) on the module that holds them, in "
                    "your TP plan)")
    return " and ".join(said)


def _handed(inputs: tuple[tuple[str, int, int], ...]) -> str:
    """What slicing ``inputs`` (a recipe's) means, in the hint's words."""
    styles = [f"HeadwiseParallel(inputs={ {n: d for n, d, h in inputs if h == heads}!r}, heads={heads})"
              for heads in sorted({h for _, _, h in inputs})]
    names = ", ".join(n for n, _, _ in inputs)
    return (f"the input{'s' * (len(inputs) > 1)} of every head that its forward is handed, {names}, sliced to this "
            f"rank's heads (vemesh.parallel.{' and '.join(styles)} on the module, in your TP plan)")


def hint(recipe: LocalHeads, raised: bool, outcome: str, cleared: bool = False, fused: str = "") -> str:
    """The hint for ``recipe``, tried: ``outcome`` is ``""`` where it made the check exact, else where the run still
    went wrong; ``cleared``: past the recipe's modules, where another recipe then made it exact (the next hint);
    ``fused``: the fused style it was tried with (the hint before)."""
    r = recipe
    first = r.modules[0]
    alike = f" (and its {len(r.modules) - 1} alike)" if len(r.modules) > 1 else ""
    where = "the forward raised there. " if raised else "the run differs from there on. "
    if not r.counts:  # what it holds or is handed per head alone (its counts are this rank's, or it has none)
        attrs = ", ".join(sorted({next((n[len(m) + 1:] for m in r.modules if n.startswith(m + ".")),
                                       n.rpartition(".")[2]) for n, _ in r.tables}))  # named from their attention
        kept = {"a module" if d == PER_HEAD_MODULES else "an output" if d == PER_HEAD_OUTPUTS else "a value"
                for _, d in r.tables}
        what = ([f"keeps {' or '.join(sorted(kept, reverse=True))} per head in {attrs}"] if r.tables else []) + (
            [f"is handed {', '.join(n for n, _, _ in r.inputs)} with a value for every head"] if r.inputs else [])
        head = (f"{first}{alike} {' and '.join(what)}, whole, while TP {r.tp} gives each rank 1/{r.tp} "
                f"of the heads of its projections; " + where)
        sharded = ([_held(r.tables, r.modules)] if r.tables else []) + ([_handed(r.inputs)] if r.inputs else [])
        tried = "Tried: " + " and ".join(sharded)
        if not outcome:
            return head + tried + ", which makes the check exact (docs/checking.md: an attention that reads its head counts)"
        return head + tried + f": the check then {outcome}, so that is not the cause, or not the only one"
    counts = ", ".join(f"{a} = {v}" for a, v in r.counts)
    widths = [a for a, _ in r.counts if not counts_heads(a)]  # XGLM's embed_dim
    said = "the width of its heads" if len(widths) == len(r.counts) else "its head counts and their width" \
        if widths else "its head counts"  # the width alone: the user's function set the counts
    head = (f"{first}{alike} reads {said} from its own attributes ({counts}), the whole model's, "
            f"while TP {r.tp} gives each rank 1/{r.tp} of the heads of the projections it reads; " + where)
    tried = f"Tried: those set to this rank's ({'; '.join(f'module.{a} //= tp' for a, _ in r.counts)}, with tp = " \
            f"mesh['TP'].size(), {r.tp} here) on " \
            f"{first}{alike} after your parallelize function" + \
        (f", and {_held(r.tables, r.modules)}" if r.tables else "") + (f", and {_handed(r.inputs)}" if r.inputs else "")
    fix = ("Do that in your parallelize function (torch's TP styles shard the weights, never a module's attributes; "
           "a view by -1 heads needs none) (docs/checking.md: an attention that reads its head counts)")
    if not outcome:
        return head + tried + (f", with {fused} in its projection's place (the hint before)" if fused else "") + \
            ", which makes the check exact. " + fix
    if cleared:
        return head + tried + f": that clears it, and the check then {outcome}, which the next hint makes exact. " + fix
    return head + tried + f": the check then {outcome}, so its head counts are not the cause, or not the only one"

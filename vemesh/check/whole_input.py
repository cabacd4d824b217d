"""A RowwiseParallel Linear handed its whole input: what ``vemesh check`` says, and the recipes it tries.

torch's ``RowwiseParallel`` splits a Linear's weight by its input features and, by default
(``input_layouts=Shard(-1)``), takes the plain tensor it is handed as this TP rank's part of the input. A plan that
splits ``o_proj`` or ``down_proj`` by rows and leaves the Linears that make their input whole hands each of them the
whole input on every rank; torch reads it as a part of an input TP times as wide, and the forward raises in its
sharding propagation ("a and b must have same reduction dim, but got [2, 128] X [64, 16]"), naming a width the user
never wrote. Each rank records the first such Linear, with the Linears of its scope that TP left whole
(``recipes._whole_input``), and the check runs the parallel run again with, in turn:

* ``ColwiseParallel()`` on those whole Linears, and their alike (every layer's): each TP rank then computes its own
  part of the input, as a Megatron-style plan does (``up_proj`` by columns, ``down_proj`` by rows);
* ``RowwiseParallel(input_layouts=Replicate())`` in the place of the Linear's style, and its alike: each rank then
  takes its part of the whole input it computed, exact where every TP rank computes the same input (the work before
  it stays whole on every rank).

The hint names the Linear, the widths, and what each try did. Two more plans that leave a Linear out, each tried
with the style it lacks (applied with the first TP style of its scope, before a data-parallel wrapper of the user's
such as FSDP2 shards it: :func:`vemesh.check.recipes.swapped`):

* a Linear that TP left whole handed this rank's part of its input (``o_proj`` left out after a split attention:
  "mat1 and mat2 shapes cannot be multiplied"): ``RowwiseParallel()`` on it (:func:`raised`);
* a Linear left whole beside one of its input width that the plan splits by columns, in the module that went wrong
  or the one holding it (``up_proj`` beside ``gate_proj``, ``v_proj`` beside ``k_proj``): ``ColwiseParallel()`` on
  it, said where that makes the check exact (:func:`siblings`).

A plan that splits every Linear by columns hands the second of a pair (an MLP's ``fc2``) this rank's part of its
input, where ``ColwiseParallel`` takes it whole: ``RowwiseParallel()`` in its place is tried. And the two ends of a
language model: a head under plain ``ColwiseParallel()``, whose output the loss reads whole
(``ColwiseParallel(output_layouts=Replicate())`` tried), and an embedding under ``RowwiseParallel()`` with torch's
default input layout, which takes the ids as a part of the sequence (``RowwiseParallel(input_layouts=Replicate())``
tried), and one under ``ColwiseParallel()``, whose output is a part of its features (the same tried in its place).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vemesh.check.recipes import Swap
from vemesh.check.result import went_wrong

__all__ = ["Tries", "WholeInput", "candidate", "diagnose", "raised", "siblings"]


@dataclass(frozen=True)
class Tries:
    """How the check runs a recipe: ``run(swaps)`` gives the run's result, its ranks' records and errors, and where it
    went wrong; at most ``left`` runs; ``gradients(swaps, trial, ranks, hints)`` adds the gradients' recipes' hints
    with ``swaps`` kept and gives (its runs, whether one was exact); ``order``: the modules as the one-process run
    made their outputs."""

    run: Callable[[tuple[Swap, ...]], tuple]
    left: int
    gradients: Callable[[tuple[Swap, ...], Any, list, list], tuple[int, bool]]
    order: list[str]


def raised(failed: dict, grads: dict[str, Any], tries: Tries) -> tuple[list[str], int] | None:
    """Where the forward raised (``failed``: a rank's error record) in a RowwiseParallel Linear handed its whole input
    (:func:`diagnose`); under a plan that gives an ``nn.Embedding`` ``RowwiseParallel()`` with torch's default
    ``Shard(-1)`` input (``RowwiseParallel(input_layouts=Replicate())`` tried); after the model, its last module a
    plain ``ColwiseParallel`` (its output gathered tried); or in a Linear TP left whole handed this rank's part of
    its input (``RowwiseParallel()`` on it tried, said where it makes the check exact), or a ColwiseParallel one
    handed its part (``RowwiseParallel()`` in its place: :func:`_colwise_part`): the hints and the runs made; else
    None."""
    if (fed := candidate(failed, grads, tries.order)) is not None:
        return diagnose(fed, tries)
    went = failed.get("went", {})
    if went.get("sharded_ids"):  # an Embedding under RowwiseParallel() with torch's default input layout
        swap = Swap(_alike(tuple(went["sharded_ids"]), grads), 1, "replicated")
        trial, _, _, now = tries.run((swap,))
        return [f"{_on(swap.linears)} is an nn.Embedding under RowwiseParallel() with torch's default input layout, "
                "Shard(-1): it takes the token ids it is handed as this TP rank's part of a sequence TP times as "
                "long, and the run went wrong. Tried: RowwiseParallel(input_layouts=Replicate()) on it (the ids whole "
                "on every rank, as torchtitan's plan gives them): "
                + ("makes the check exact" if trial.exact else went_wrong(trial, now))], 1
    head = next((n for n in reversed(tries.order) if n), None)
    # the model's output split by columns, read whole by the root's own code or the step's (its loss)
    if failed.get("module") in ("", None) and not failed.get("before_step") and failed.get("kind") == "user" and \
            head in went.get("local_out", ()):
        swap = Swap((head,), 1, "gathered")
        trial, _, _, now = tries.run((swap,))
        return [f"{head} is split by columns (torch's ColwiseParallel), so the model returns this TP rank's part of "
                "its output features, and what reads the output (the loss) takes them all: the run raised there. "
                f"Tried: ColwiseParallel(output_layouts=Replicate()) on {head} (each rank gathers the whole output): "
                + ("makes the check exact" if trial.exact else went_wrong(trial, now))
                + ". To keep a vocabulary's logits split, compute the loss under torch's loss_parallel() with "
                "ColwiseParallel(use_local_output=False) on it"], 1
    by_columns = tuple(n for n in went.get("col_embeddings", ()) if n in went.get("local_out", ()))
    if by_columns and failed.get("module") and not failed.get("before_step"):
        if (said := _embedding_by_columns(by_columns, failed["module"], grads, tries)) is not None:
            return said
    if (seen := went.get("colwise_part")) and seen[0] == failed.get("module"):
        return _colwise_part(*seen, grads, tries)
    seen = went.get("part_input")
    if not seen or seen[0] != failed.get("module"):
        return None
    name, width, given = seen
    swap = Swap(_alike((name,), grads), 1, "rows-added")
    if not tries.run((swap,))[0].exact:  # not the Linear left out: the check's other recipes follow (a per-head
        return None  # table made from the heads' values, as Doge's dt_proj)
    return [f"{name} is split by no TP style, but it was handed this TP rank's part of its input ({given} of its "
            f"{width} features: what makes it is split by columns), and the forward raised. Tried: RowwiseParallel() "
            f"on {_on(swap.linears)}: makes the check exact (docs/checking.md: a RowwiseParallel Linear handed its "
            "whole input)"], 1


def _colwise_part(name: str, width: int, given: int, grads: dict[str, Any],
                  tries: Tries) -> tuple[list[str], int] | None:
    """A ColwiseParallel Linear (its input whole on every rank, torch's default) handed this TP rank's part of its
    input, as a plan that splits every Linear by columns hands an MLP's second: ``RowwiseParallel()`` in its place
    (and its alike) tried; its hint where that makes the check exact, else None (the check's other recipes follow)."""
    swap = Swap(_alike((name,), grads), 1, "as-rowwise")
    if not tries.run((swap,))[0].exact:
        return None
    return [f"{name} is split by columns (torch's ColwiseParallel, which takes its input whole on every TP rank), but "
            f"it was handed this rank's part of its input ({given} of its {width} features: what makes it is split by "
            f"columns too), and the forward raised. Tried: RowwiseParallel() on {_on(swap.linears)}: makes the check "
            "exact: a Linear that reads a column-split one's output is split by rows, as Megatron pairs them "
            "(docs/checking.md: a RowwiseParallel Linear handed its whole input)"], 1


def _embedding_by_columns(names: tuple[str, ...], where: str, grads: dict[str, Any],
                          tries: Tries) -> tuple[list[str], int] | None:
    """An ``nn.Embedding`` under plain ``ColwiseParallel()``: its output is this TP rank's part of the embedding's
    features, which module ``where`` read as the whole width and raised. Tried in turn: the vocabulary split instead,
    ``RowwiseParallel(input_layouts=Replicate())`` (torchtitan's and Megatron's), then the features gathered,
    ``ColwiseParallel(output_layouts=Replicate())``; the hint where one makes the check exact, else None (not the
    only cause: the check's other recipes follow)."""
    tried, alike = [], _alike(names, grads)
    for recipe, style in (("as-rowwise", "RowwiseParallel(input_layouts=Replicate()) in its place (the vocabulary "
                                         "split over TP, the ids whole on every rank, as torchtitan and Megatron "
                                         "split an embedding)"),
                          ("gathered", "ColwiseParallel(output_layouts=Replicate()) (each rank gathers the whole "
                                       "width)")):
        trial, _, _, now = tries.run((Swap(alike, 1, recipe),))
        tried.append(f"{style}: {'makes the check exact' if trial.exact else went_wrong(trial, now)}")
        if trial.exact:
            break
    else:
        return None
    return [f"{_on(alike)} is an nn.Embedding under ColwiseParallel(), which splits its embedding dim: "
            f"each TP rank's output is a plain tensor of its part of the features, and {where} read it as the whole "
            f"width and raised. Tried: {'; then '.join(tried)}"], len(tried)


def siblings(where: str | None, went: dict, split: list, grads: dict[str, Any], tries: Tries) -> list[str] | None:
    """Where module ``where`` went wrong and the Linears of it, or of the module holding it, include one that TP left
    whole beside one of the same input width split by columns (``went``, ``split``: a rank's record), the run with
    ``ColwiseParallel()`` on those whole Linears (and their alike); its hint where that made the check exact, else
    None (the check's other recipes follow)."""
    if where is None or tries.left < 1:
        return None
    whole = {n: width for n, width in went.get("whole", ())}
    cols = {(n.rpartition(".")[0], i) for n, _, i, _ in split if n in went.get("colwise", ())}
    scopes = {where, where.rpartition(".")[0]}
    found = tuple(n for n, width in whole.items() if n.rpartition(".")[0] in scopes
                  and (n.rpartition(".")[0], width) in cols)
    if not found:
        return None
    swap = Swap(_alike(found, grads), 1, "added")
    trial, *_ = tries.run((swap,))
    if not trial.exact:
        return None
    beside = sorted({n for n, _, i, _ in split if (n.rpartition(".")[0], i) in {(f.rpartition(".")[0], whole[f])
                                                                               for f in found}})
    return [f"{', '.join(found[:2])}{' and more' if len(found) > 2 else ''} {'is' if len(found) == 1 else 'are'} "
            f"split by no TP style, beside {', '.join(beside[:3])} of the same input width, which the plan splits "
            f"by columns, and the run went wrong at {where}. Tried: ColwiseParallel() on {_on(swap.linears)}: makes "
            "the check exact (the Linear left out of the plan)"]


def _alike(names: tuple[str, ...], grads: dict[str, Any]) -> tuple[str, ...]:
    """``names`` and every Linear of the same last name and weight shape (``grads``: the one-process run's)."""
    shapes = {n.rpartition(".")[0]: tuple(g.shape) for n, g in grads.items() if n.endswith(".weight") and g is not None}
    alike = [m for w in names for m, shape in shapes.items()
             if m.rpartition(".")[2] == w.rpartition(".")[2] and shape == shapes.get(w)]
    return tuple(dict.fromkeys([*names, *alike]))


@dataclass(frozen=True)
class WholeInput:
    """RowwiseParallel Linear ``name`` handed a plain tensor of its whole input width."""

    name: str
    width: int  #: its input features
    local: int  #: those this TP rank holds
    rows: tuple[str, ...]  #: it and its alike: the RowwiseParallel Linears of the same last name
    whole: tuple[str, ...]  #: the Linears of its scope that TP left whole, and their alike
    #: the styles swapped, where Linears of its scope after it are split by columns (an MLP's gate and up by rows,
    #: its down by columns): (the RowwiseParallel ones before those, the ColwiseParallel ones), with their alike
    swapped: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())


def candidate(failed: dict, grads: dict[str, Any], order: list[str] | tuple = ()) -> WholeInput | None:
    """The Linear whose forward raised (``failed``: a rank's error record), where the rank saw it handed its whole
    input and no Linear of its scope that runs before it (``order``: the one-process run's modules, in the order of
    their outputs) is split by columns; ``grads`` (the one-process run's, by name) gives the whole Linears' alike:
    the same last name and shape."""
    seen = failed.get("went", {}).get("whole_input")
    if not seen or seen[0] != failed.get("module"):
        return None
    name, width, local = seen
    order = list(order)
    scope, at = name.rpartition(".")[0], order.index(name) if name in order else len(order)
    if any(s[0].rpartition(".")[0] == scope and (s[0] not in order or order.index(s[0]) < at)
           for s in failed.get("split", ())):  # split by columns before it: the input's width comes from how the
        return None  # forward reads those (a fused [q|k|v]: recipes.candidates)
    last = name.rpartition(".")[2]
    went = failed["went"]
    whole = [n for n, _ in went.get("whole", ()) if n.rpartition(".")[0] == scope]
    rows = tuple(n for n in went.get("rowwise", ()) if n.rpartition(".")[2] == last) or (name,)
    after = tuple(n for n in went.get("colwise", ()) if n.rpartition(".")[0] == scope and n in order)
    first = min((order.index(n) for n in after), default=0)
    before = tuple(n for n in went.get("rowwise", ()) if n.rpartition(".")[0] == scope and n in order
                   and order.index(n) < first)
    return WholeInput(name, width, local, rows, _alike(tuple(whole), grads),
                      (_alike(before, grads), _alike(after, grads)) if after and before else ((), ()))


def diagnose(fed: WholeInput, tries: Tries) -> tuple[list[str], int]:
    """The recipes tried in turn (each a parallel run), up to the first that makes the check exact: the hints, and
    the runs made.

    Where ``ColwiseParallel()`` on the whole Linears goes wrong in a module of their scope, the Linear among them
    whose output came last before it went wrong (in the order the one-process run made their outputs; of a run that
    raised, its own) is left whole, with its alike, and the rest tried again: a norm over a
    low-rank projection's whole width (MLA's ``q_a_proj`` into ``q_a_layernorm``, as DeepSeek's and Mistral 4's
    attention) stays whole, and the projections into the heads (``q_b_proj``, ``kv_b_proj``) are split. Where the
    forward then matches and gradients differ, the check's recipes for gradients follow, with the split kept."""
    tried: list[tuple[Swap, str]] = []
    added, run, tries_left = fed.whole, tries.run, tries.left
    if fed.swapped[0]:  # the styles swapped: ColwiseParallel first, RowwiseParallel after
        swaps = (Swap(fed.swapped[0], 1, "as-colwise"), Swap(fed.swapped[1], 1, "as-rowwise"))
        trial, _, _, now = run(swaps)
        tried.append((swaps[0], "" if trial.exact else went_wrong(trial, now)))
        if trial.exact:
            return [hint(fed, tried)], 1
    while added and len(tried) < tries_left - 1:
        swap = Swap(added, 1, "added")
        trial, ranks, failed, now = run((swap,))
        tried.append((swap, "" if trial.exact else went_wrong(trial, now)))
        if trial.exact:
            return [hint(fed, tried)], len(tried)
        if ranks and trial.first_module is None and not trial.error and trial.gradients:  # the forward matched
            more: list[str] = []
            runs, exact = tries.gradients((swap,), trial, ranks, more)
            if exact:
                return [hint(fed, tried, gradients=True), *more], len(tried) + runs
            break
        made = list(failed[0].get("shapes", {})) if failed else tries.order  # the outputs made up to the raise
        last = _made_last(added, now[0] if now else None, made, fed.name.rpartition(".")[0])
        if last is None:
            break
        added = tuple(n for n in added if n.rpartition(".")[2] != last.rpartition(".")[2])
    if len(tried) < tries_left:
        swap = Swap(fed.rows, 1, "replicated")
        trial, _, _, now = run((swap,))
        tried.append((swap, "" if trial.exact else went_wrong(trial, now)))
    return [hint(fed, tried)], len(tried)


def _made_last(added: tuple[str, ...], where: str | None, order: list[str], scope: str) -> str | None:
    """Of ``added``, the Linear whose output came last in ``order`` before module ``where``'s (all of ``order`` where
    ``where`` has none in it: the forward raised in it), where ``where`` is ``scope`` or in it; None where it is not,
    or no Linear of ``added`` came before it."""
    if where is None or not (where == scope or where.startswith(scope + ".")):
        return None
    before = order[:order.index(where)] if where in order else order
    return next((n for n in reversed(before) if n in added), None)


def _on(names: tuple[str, ...]) -> str:
    """``names`` as a hint gives them: each last name's first, and how many alike."""
    first = list({n.rpartition(".")[2]: n for n in reversed(names)}.values())[::-1]
    alike = len(names) - len(first)
    return (first[0] if len(first) == 1 else f"{', '.join(first[:-1])} and {first[-1]}") + \
        (f" (and {'its' if len(first) == 1 else 'their'} {alike} alike)" if alike else "")


def _style(swap: Swap) -> str:
    on = _on(swap.linears)
    if swap.recipe == "as-colwise":
        return f"the styles swapped, ColwiseParallel() on {on} and RowwiseParallel() on the Linears after them"
    if swap.recipe == "added":
        return f"ColwiseParallel() on {on}"
    return f"RowwiseParallel(input_layouts=Replicate()) on {on}"


def hint(fed: WholeInput, tried: list[tuple[Swap, str]], gradients: bool = False) -> str:
    """What the check says of ``fed``: ``tried`` is each recipe run and what the check said then (``""``: exact);
    ``gradients``: the last one's forward matched, and the next hints make its gradients exact."""
    alike = f" (and its {len(fed.rows) - 1} alike)" if len(fed.rows) > 1 else ""
    scope = fed.name.rpartition(".")[0] or "the root"
    head = (f"{fed.name}{alike} is split by rows (torch's RowwiseParallel: each TP rank holds {fed.local} of its "
            f"{fed.width} input features and takes its input as that rank's part), but it was handed its whole "
            f"input ({fed.width} features on each rank, as one process computes it), so torch read that as a part of "
            f"an input {fed.width * (fed.width // fed.local)} wide and the forward raised. ")
    made = (f"The Linears of {scope} that TP left whole, which may make that input: "
            f"{', '.join(n for n in fed.whole if n.rpartition('.')[0] == scope)}. " if fed.whole else
            f"No Linear of {scope} is left whole: what makes its input is elsewhere. ")
    said = "; then ".join(f"{_style(s)}: {outcome or 'makes the check exact'}" for s, outcome in tried)
    swap, outcome = tried[-1] if tried else (None, "not tried")
    if gradients:
        return (head + made + f"Tried: {said}: its forward then matches, each TP rank computing its own {fed.local} "
                f"features of {fed.name}'s input; the next hint makes the gradients exact with it kept "
                "(docs/checking.md: a RowwiseParallel Linear handed its whole input)")
    if swap is not None and not outcome and swap.recipe == "as-colwise":
        return (head + f"Tried: {said} ({_on(fed.swapped[1])}): the plan had them the wrong way round "
                "(docs/checking.md: a RowwiseParallel Linear handed its whole input)")
    if swap is not None and not outcome and swap.recipe == "added":
        return (head + made + f"Tried: {said}: each TP rank then computes its own {fed.local} features of "
                f"{fed.name}'s input, as a Megatron-style plan splits the Linear before a RowwiseParallel one by "
                "columns (docs/checking.md: a RowwiseParallel Linear handed its whole input)")
    if swap is not None and not outcome:
        return (head + made + f"Tried: {said}: each TP rank then takes its part of the whole input it computed, and "
                f"computes all of what makes it (the same on every rank). To split that work too, split by columns the "
                f"Linears that make {fed.name}'s input, in the layout that {scope}'s forward reads them in "
                "(docs/checking.md: a RowwiseParallel Linear handed its whole input)")
    return (head + made + f"Tried: {said}. None made the check exact: the whole input is not the only cause "
            "(docs/checking.md: a RowwiseParallel Linear handed its whole input)")

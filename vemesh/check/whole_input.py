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

The hint names the Linear, the widths, and what each try did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vemesh.check.recipes import Swap
from vemesh.check.result import went_wrong

__all__ = ["WholeInput", "candidate", "diagnose"]


@dataclass(frozen=True)
class WholeInput:
    """RowwiseParallel Linear ``name`` handed a plain tensor of its whole input width."""

    name: str
    width: int  #: its input features
    local: int  #: those this TP rank holds
    rows: tuple[str, ...]  #: it and its alike: the RowwiseParallel Linears of the same last name
    whole: tuple[str, ...]  #: the Linears of its scope that TP left whole, and their alike


def candidate(failed: dict, grads: dict[str, Any]) -> WholeInput | None:
    """The Linear whose forward raised (``failed``: a rank's error record), where the rank saw it handed its whole
    input and no Linear of its scope is split by columns; ``grads`` (the one-process run's, by name) gives the whole
    Linears' alike: the same last name and shape."""
    seen = failed.get("went", {}).get("whole_input")
    if not seen or seen[0] != failed.get("module"):
        return None
    name, width, local, whole = seen
    scope = name.rpartition(".")[0]
    if any(s[0].rpartition(".")[0] == scope for s in failed.get("split", ())):  # its scope splits by columns: the
        return None  # input's width comes from how the forward reads those (a fused [q|k|v]: recipes.candidates)
    last = name.rpartition(".")[2]
    rows = tuple(n for n in failed["went"].get("rowwise", ()) if n.rpartition(".")[2] == last) or (name,)
    shapes = {n.rpartition(".")[0]: tuple(g.shape) for n, g in grads.items() if n.endswith(".weight") and g is not None}
    alike = [m for w in whole for m, shape in shapes.items()
             if m.rpartition(".")[2] == w.rpartition(".")[2] and shape == shapes.get(w)]
    return WholeInput(name, width, local, rows, tuple(dict.fromkeys([*whole, *alike])))


def diagnose(fed: WholeInput, run: Callable[[tuple[Swap, ...]], tuple], order: list[str], tries_left: int,
             gradients: Callable[[Swap, Any, list, int], tuple[list[str], int, bool]]) -> tuple[list[str], int]:
    """The recipes tried in turn (each a parallel run: ``run(swaps)`` returns the run's result, its ranks' records and
    errors, and where it went wrong), up to the first that makes the check exact: the hints, and the runs made.

    Where ``ColwiseParallel()`` on the whole Linears goes wrong in a module of their scope, the Linear among them
    whose output came last before it went wrong (``order``: the modules in the order the one-process run made their
    outputs; of a run that raised, its own) is left whole, with its alike, and the rest tried again: a norm over a
    low-rank projection's whole width (MLA's ``q_a_proj`` into ``q_a_layernorm``, as DeepSeek's and Mistral 4's
    attention) stays whole, and the projections into the heads (``q_b_proj``, ``kv_b_proj``) are split. Where the
    forward then matches and gradients differ, ``gradients(swap, trial, ranks, tries_left)`` (the check's recipes for
    gradients, with the split kept) says why and what it tried: its hints, its runs, and whether one was exact."""
    tried: list[tuple[Swap, str]] = []
    added = fed.whole
    while added and len(tried) < tries_left - 1:
        swap = Swap(added, 1, "added")
        trial, ranks, failed, now = run((swap,))
        tried.append((swap, "" if trial.exact else went_wrong(trial, now)))
        if trial.exact:
            return [hint(fed, tried)], len(tried)
        if ranks and trial.first_module is None and not trial.error and trial.gradients:  # the forward matched
            more, runs, exact = gradients(swap, trial, ranks, tries_left - len(tried))
            if exact:
                return [hint(fed, tried, gradients=True), *more], len(tried) + runs
            break
        made = list(failed[0].get("shapes", {})) if failed else order  # the outputs made up to the raise
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


def _style(swap: Swap) -> str:
    first = list({n.rpartition(".")[2]: n for n in reversed(swap.linears)}.values())[::-1]  # each last name's first
    alike = len(swap.linears) - len(first)
    on = (first[0] if len(first) == 1 else f"{', '.join(first[:-1])} and {first[-1]}") + \
        (f" (and {'its' if len(first) == 1 else 'their'} {alike} alike)" if alike else "")
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

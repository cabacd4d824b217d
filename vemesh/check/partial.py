"""The hints of ``vemesh check`` where every output matches and gradients differ.

Two causes give that verdict, and the check tells them apart:

* **DP's average is missing.** With DP above 1, each DP rank steps its own batch; the one-process run averages the
  DP ranks' gradients, as DDP and FSDP do. A parallelize function that wraps no data-parallel module leaves each
  rank with its own batch's gradients, and then *every* gradient differs (:func:`dp_hint`).
* **A module with replicated parameters runs on this TP rank's part of its input.** A norm over each head's
  features (HF Qwen3's and Gemma 3's ``q_norm`` and ``k_norm``, after a ``ColwiseParallel`` q or k projection) sees
  only this rank's heads, so its weight's gradient is this rank's part of the sum: it differs from one process, and
  the TP ranks' copies drift apart as they train. The check finds those modules from the run itself (its own
  parameters' gradients differ, and its output is a plain tensor split over TP along one dim: :func:`candidates`)
  and runs the parallel run again with torch's ``SequenceParallel(sequence_dim=d, use_local_output=True)`` on them
  (:class:`ShardedInput`, applied to the model as built, before the user's parallelize function): their weights
  become DTensors replicated over TP, their input this rank's shard along ``d``, and torch sums the weights'
  gradients over TP in the backward. torchtitan's Qwen3 plan does the same (``SequenceParallel(sequence_dim=2)``
  on its DTensor q and k). The hint says whether that made the check exact (:func:`hint`).
* **A replicated module's output reaches this rank's heads outside torch's styles.** DeepSeek-V3's
  ``kv_a_proj_with_mqa`` returns ``[compressed_kv | k_pe]``: ``compressed_kv`` enters ``kv_b_proj`` (ColwiseParallel,
  which sums its input's gradient over TP), but ``k_pe``, the rotary key every head shares, is expanded to this rank's
  heads directly, so its gradient is this rank's heads' share, and every parameter before it trains on a partial
  gradient. The sign in the run: the rows of that Linear's weight gradient for those features differ from one process
  and the other rows match (:func:`row_candidates`). The check runs again with
  :class:`vemesh.parallel.SumGradOverTP` on those features of that Linear and its alike (:class:`SummedFeatures`,
  after the user's parallelize function) and says whether that made it exact (:func:`summed_hint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from vemesh.check.clones import layer_pattern
from vemesh.check.record import parts, plain_name
from vemesh.parallel.schedules import ZERO_BUBBLE
from vemesh.parallel.summed_grad import SumGradOverTP

__all__ = ["ShardedInput", "SummedFeatures", "apply", "candidates", "dp_hint", "first_shapes", "hint",
           "outside_fsdp_hint", "row_candidates", "scale_hint", "sum_features", "summed_hint", "twice_hint",
           "unsynced_hint", "zero_bubble_hint"]


@dataclass(frozen=True)
class ShardedInput:
    """torch's ``SequenceParallel(sequence_dim=dim, use_local_output=True)`` on ``modules`` (names in the model as
    built): their input is this TP rank's shard along ``dim``, their parameters replicated over TP."""

    modules: tuple[str, ...]
    dim: int

    def style(self) -> str:
        return f"SequenceParallel(sequence_dim={self.dim}, use_local_output=True)"


def apply(recipes: tuple[ShardedInput, ...], model: nn.Module, tp_mesh: Any) -> None:
    """Each recipe's style on its modules of ``model`` (as built, before the user's parallelize function)."""
    for recipe in recipes:
        for name in recipe.modules:
            parallelize_module(model.get_submodule(name), tp_mesh,
                               SequenceParallel(sequence_dim=recipe.dim, use_local_output=True))


def dp_hint(degrees: dict[str, int], differing: int, compared: int, wrapped: bool,
            zero: Sequence[str] = ()) -> str | None:
    """The hint where every gradient differs with DP or CP above 1 (the dims a data-parallel wrapper averages the
    gradients over) and the parallelize function wrapped no data-parallel module the check knows (``wrapped``:
    :func:`vemesh.check.record.data_parallel`), else None. ``zero``: the compared gradients that match because one
    process's are zero (:func:`vemesh.check.compare.vanishing`: a key bias's), which no average changes."""
    data = {d: degrees.get(d, 1) for d in ("DP", "CP") if degrees.get(d, 1) > 1}
    if not data or not compared or differing + len(zero) < compared or differing == 0 or wrapped:
        return None
    named = " x ".join(f"{d} {n}" for d, n in data.items())
    said = f"every gradient differs ({differing} of {compared}"
    if zero:
        said += f"; the other {len(zero)}, {_listed(zero)}, {'is' if len(zero) == 1 else 'are'} zero in one process"
    said += (f") and every output matches, with {named}, and --parallelize wrapped no data-parallel module (DDP, "
             "FSDP2): ")
    if "CP" not in data:
        return (said + "each DP rank kept its own batch's gradients, and one process averages the DP ranks' (as DDP "
                "and FSDP do). Wrap the model in --parallelize (vemesh.ddp.DistributedDataParallel, "
                "vemesh.parallel.fully_shard, or torch's), or check the TP plan alone at DP 1 (--world-size equal to "
                "TP x CP)")
    return (said + "each CP rank kept the gradients of its own part of the sequence"
            + (" of its DP rank's batch" if "DP" in data else "") + ", where one process has "
            f"the whole's. A data-parallel wrapper averages them over {' x '.join(data)} (each CP rank's loss is a "
            "mean over its part): wrap the model in --parallelize (vemesh.ddp.DistributedDataParallel or "
            "vemesh.parallel.fully_shard, which take the mesh's data dims, DP and CP)")


def _listed(names: Sequence[str], most: int = 3) -> str:
    """Up to ``most`` names, and how many more."""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


@dataclass(frozen=True)
class SummedFeatures:
    """:class:`~vemesh.parallel.summed_grad.SumGradOverTP` on the output features ``start:stop`` (of ``width``) of
    ``modules`` (names in the model as built), applied after the user's parallelize function."""

    modules: tuple[str, ...]
    start: int
    stop: int
    width: int
    seen: str = ""  #: the module whose gradient showed the block of rows (the last layer's)

    def style(self) -> str:
        return f"SumGradOverTP(start={self.start}" + (f", stop={self.stop})" if self.stop < self.width else ")")


def sum_features(recipes: tuple[SummedFeatures, ...], model: Any, mesh: Any) -> None:
    """Each recipe's style on its modules of ``model`` (after the user's parallelize function), over ``mesh["TP"]``."""
    for name, module in (nm for part, _ in parts(model) for nm in part.named_modules()):
        for recipe in recipes:
            if plain_name(name) in recipe.modules:
                SumGradOverTP(recipe.start, recipe.stop)._apply(module, mesh["TP"])


def _row_blocks(params: list[str], ref: dict, ranks: list[dict], went: dict,
                tol: float) -> Iterator[tuple[str, int, int, int, float | None]]:
    """Of the Linears (2-D weights) among ``params`` (those whose gradients differ) that no TP style split (``went``:
    where the plan's ColwiseParallel and RowwiseParallel went), each whose weight gradient on some rank differs from
    one process's in one block of rows and matches in the others: ``(module, start, stop, width, times)``, where
    ``times`` is None when its TP peers hold other values in those rows (each its own heads' share), else how many
    times one process's those rows are (the same on every TP rank: summed over TP once too often)."""
    styled = set(went.get("colwise", [])) | set(went.get("rowwise", []))
    for name in params:
        module, _, leaf = name.rpartition(".")
        want = ref["grads"].get(name)
        if leaf != "weight" or module in styled or module in ref.get("embeddings", ()) or want is None or \
                want.dim() != 2 or want.shape[0] < 2:  # an Embedding's rows are tokens: those a batch used differ
            continue
        scale = max(want.abs().max().item(), 1e-30)
        for r in ranks:
            got = r["grads"].get(name)
            if got is None or got.shape != want.shape:
                continue
            rows = ((got.double() - want.double()).abs().amax(dim=1) > tol * scale).nonzero().flatten().tolist()
            if not rows or len(rows) == want.shape[0] or rows != list(range(rows[0], rows[-1] + 1)):
                continue
            block = slice(rows[0], rows[-1] + 1)
            peers = [q["grads"].get(name) for q in ranks if q["data_rank"] == r["data_rank"]
                     and q["coords"].get("CP", 0) == r["coords"].get("CP", 0)]
            if any(g is not None and not torch.allclose(g[block], got[block], rtol=tol, atol=tol * scale) for g in peers):
                yield module, block.start, block.stop, want.shape[0], None
            else:
                yield module, block.start, block.stop, want.shape[0], \
                    float((got[block].double() * want[block]).sum() / want[block].double().square().sum().clamp_min(1e-300))
            break


def row_candidates(params: list[str], ref: dict, ranks: list[dict], went: dict, tol: float) -> list[SummedFeatures]:
    """Of :func:`_row_blocks`, those whose TP peers hold each its own share: the recipe for those features, each with
    its alike (the same name in the other layers, of the same shape). Only the last layer shows the block: the layers
    before it get its partial gradient too, in every row."""
    found: dict[tuple[str, int, int, int], set[str]] = {}
    for module, start, stop, width, times in _row_blocks(params, ref, ranks, went, tol):
        if times is None:
            found.setdefault((layer_pattern(module), start, stop, width), set()).add(module)
    alike = {key: {n.rpartition(".")[0] for n, g in ref["grads"].items() if n.endswith(".weight") and g is not None
                   and layer_pattern(n.rpartition(".")[0]) == key[0] and g.dim() == 2 and g.shape[0] == key[3]}
             for key in found}
    return [SummedFeatures(tuple(sorted(alike[key] | seen)), key[1], key[2], key[3], min(seen))
            for key, seen in sorted(found.items())]


def twice_hint(params: list[str], ref: dict, ranks: list[dict], went: dict, tol: float, tp: int) -> str | None:
    """The hint where an unsplit Linear's block of gradient rows is ``tp`` times one process's on every TP rank: those
    features' gradient was summed over TP where torch's styles sum it already (a SumGradOverTP, or an all-reduce of
    the user's own, over too many features); None where there is none."""
    for module, start, stop, width, times in _row_blocks(params, ref, ranks, went, tol):
        if times is not None and abs(times - tp) < 0.01 * tp:
            return (f"on {module} (split by no TP style) the rows {start} to {stop - 1} of its weight's gradient are "
                    f"{tp} times one process's on every TP rank, its other rows match: features {start}:{stop} of its "
                    f"output (of {width}) have their gradient summed over TP where torch's styles sum it already. If "
                    "your plan has vemesh.parallel.SumGradOverTP (or an all-reduce of your own) on it, keep it to the "
                    "features only this rank's heads read outside torch's styles (docs/checking.md: an output every "
                    "head reads)")
    return None


def summed_hint(recipe: SummedFeatures, outcome: str) -> str:
    """The hint for ``recipe``, tried: ``outcome`` is ``""`` where the check was then exact, else where it still went
    wrong."""
    mods = recipe.modules
    named = mods[0] + (f" (and its {len(mods) - 1} alike)" if len(mods) > 1 else "")
    head = (f"{named} is split by no TP style, and on {recipe.seen} the rows {recipe.start} to {recipe.stop - 1} of "
            "its weight's gradient differ from one process while its other rows match: features "
            f"{recipe.start}:{recipe.stop} of its output (of {recipe.width}) reach this rank's heads outside torch's TP "
            "styles (a key every head shares, as DeepSeek-V3's k_pe), so each TP rank's backward gives them its own "
            "heads' share of the gradient, and every parameter before them trains on a part of its gradient. ")
    tried = (f"Tried: vemesh.parallel.{recipe.style()} on it, in your TP plan (the features' gradient summed over "
             "TP in the backward)")
    if not outcome:
        return head + tried + ", which makes the check exact (docs/checking.md: an output every head reads)"
    return head + tried + f": the check then {outcome}, so that is not the cause, or not the only one"


def stage_scales(ref: dict, ranks: list[dict], tol: float) -> dict[int, float]:
    """Under PP, the factor by which each PP rank's gradients are one process's, ``{PP rank: factor}`` (a clip by each
    stage's own norm scales them so), or ``{}`` where some gradient is not its rank's factor times one process's
    (within ``tol`` of the largest)."""
    scales: dict[int, float] = {}
    for r in ranks:
        pairs = [(g.double(), ref["grads"][n].double()) for n, g in r["grads"].items()
                 if g is not None and ref["grads"].get(n) is not None and g.shape == ref["grads"][n].shape]
        whole = sum(float((w * w).sum()) for _, w in pairs)
        if not whole:
            continue
        factor = sum(float((g * w).sum()) for g, w in pairs) / whole
        pp, largest = r["coords"].get("PP", 0), max(float((factor * w).abs().max()) for _, w in pairs)
        if any(float((g - factor * w).abs().max()) > tol * largest for g, w in pairs) or \
                abs(scales.get(pp, factor) - factor) > tol * abs(factor):
            return {}
        scales[pp] = factor
    return dict(sorted(scales.items()))


def unsynced_hint(ranks: list[dict]) -> str | None:
    """The hint where a rank's step ended with gradients its data-parallel wrapper had not averaged
    (:func:`vemesh.check.record.unsynced`), else None."""
    said = next((r["unsynced"] for r in ranks if r.get("unsynced")), "")
    if not said:
        return None
    return (f"the step's last backward left gradients that DP did not average ({said}), so each DP rank kept its own "
            "batch's, where one process averages the DP ranks': run the last micro-batch's backward with the sync on "
            "(outside no_sync(), or after set_requires_gradient_sync(True)), or call finish_grad_sync() after it "
            "(vemesh DDP)")


def outside_fsdp_hint(degrees: dict[str, int], differing: list[str], ranks: list[dict]) -> str | None:
    """Where DP (or CP) is above 1 and every gradient that differs is of a parameter under no FSDP2 unit, where FSDP2
    shards others (:func:`vemesh.check.record.outside_fsdp`: ``fully_shard`` on the blocks, not the root), the hint
    that says so; else None."""
    outside = set(ranks[0].get("outside_fsdp", ())) if ranks else set()
    data = [d for d in ("DP", "CP") if degrees.get(d, 1) > 1]
    if not data or not differing or not set(differing) <= outside:
        return None
    return (f"the gradients that differ ({_listed(differing)}) are each of a parameter under no FSDP2 unit: "
            "--parallelize applied fully_shard to modules that do not hold them (and not to the root), so each "
            f"{' x '.join(data)} rank keeps its own batch's gradient of them, never averaged. Call fully_shard on the "
            "root too, after its blocks (fully_shard(model, mesh=mesh['DP']), as torchtitan does; "
            "vemesh.parallel.fully_shard(model) takes the mesh's data dims)")


def scale_hint(result: Any, ref: dict, ranks: list[dict], tol: float) -> str | None:
    """The hint where every gradient is one factor (not 1, not 0) of one process's (one PP rank's
    :func:`stage_scales`) and every output matches, else None: where the step's own collectives couple the DP ranks'
    batches (``result.coupled``, run together in one process: :mod:`vemesh.check.reference`), a loss that is each
    rank's part of the whole batch's, averaged once more by the wrapper; else a loss the step scales by the world
    size or DP (``dist.get_world_size()`` is 1 in one process), or gradients summed over DP, not averaged."""
    coupled, dp, world = result.coupled, result.degrees["DP"], result.world_size
    if coupled[1] or len(scales := stage_scales(ref, ranks, tol)) != 1:
        return None
    factor = next(iter(scales.values()))
    if abs(factor - 1) <= tol or abs(factor) <= tol:
        return None
    said = f"every gradient is {factor:.3g} x one process's" + (
        f" on the DP ranks' batches together, with every output matching; the step's collectives couple the DP ranks "
        f"({coupled[0]})" if coupled[0] else ", with every output matching")
    if coupled[0] and abs(factor * dp - 1) < 1e-3:
        return (said + ": each DP rank's loss is its part of the whole batch's (a sum divided by a count over every "
                f"DP rank), and the data-parallel wrapper averages the ranks' gradients, dividing by DP {dp} once "
                "more. Multiply the loss by the DP degree (VESCALE_DEVICE_MESH['DP'].size()) before its backward, as "
                "Megatron does for a per-token loss")
    for size, what in ((world, f"the world size {world} (dist.get_world_size(), 1 in one process)"), (dp, f"DP {dp}")):
        if not coupled[0] and size > 1 and abs(factor * size - 1) < 1e-3:
            return (said + f": 1 / {size}, so the step divides its loss (or its gradients) by {what}"
                    + (", where the data-parallel wrapper already averages the DP ranks' gradients" if dp > 1 else "")
                    + ": drop the division")
    if not coupled[0] and dp > 1 and abs(factor - dp) < 1e-3 * dp:
        return (said + f": DP {dp} times, so the DP ranks' gradients are summed, not averaged (an all-reduce of your "
                "own with its default sum, or a loss multiplied by DP): divide by DP, or leave the average to the "
                "data-parallel wrapper")
    return said + f": scale the step's loss by {1 / factor:.3g} before its backward, or check what the step does to it"


def zero_bubble_hint(schedule: str, dp: int, wrapped: bool) -> str | None:
    """The hint where every output matches and gradients differ under a schedule that splits the backward, with DP
    above 1 and a data-parallel wrapper (``wrapped``), else None."""
    if schedule not in ZERO_BUBBLE or dp < 2 or not wrapped:
        return None
    return (f"--pp-schedule {schedule} splits each backward, and torch's weight pass adds the weights' gradients by "
            "hand, where no data-parallel wrapper's gradient hook sees them: they were not averaged over DP. With "
            "vemesh's DDP call finish_grad_sync(force=True) on each stage's wrapper after schedule.step() in the "
            "step, or step through vemesh.parallel.schedules.run_schedule(schedule, name, wrappers, ...); torch's "
            "DDP and FSDP2 have nothing to call (use gpipe, 1f1b or interleaved-1f1b with them)")


def _split_dim(got: Any, want: Any, tp: int) -> int | None:
    """The one dim along which shape ``got`` (a TP rank's plain output) is ``1 / tp`` of shape ``want`` (one
    process's)."""
    if got is None or want is None or len(got) != len(want):
        return None
    dims = [i for i in range(len(want)) if got[i] != want[i]]
    if len(dims) != 1 or got[dims[0]] * tp != want[dims[0]]:
        return None
    return dims[0]


def first_shapes(ranks: list[dict]) -> dict[str, list[int]]:
    """The shape of each module's first output on the first TP rank of DP rank 0 (the other dims' coordinates 0), on
    every PP rank: each holds its own stages' modules."""
    shapes: dict[str, list[int]] = {}
    for pp in sorted({r["coords"].get("PP", 0) for r in ranks}):
        first = min((r for r in ranks if r["data_rank"] == 0 and r["coords"].get("PP", 0) == pp),
                    key=lambda r: tuple(sorted(r["coords"].items())), default=None)
        if first is not None:
            shapes |= {k[0]: list(v.shape) for k, v in first["outputs"].items() if k[1:] == (0, 0)}
    return shapes


def on_every_stage(params: list[str], shapes: dict[str, list[int]], ref: dict) -> tuple[list[str], dict]:
    """Under PP, where one stage's rank alone said which replicas' gradients differ over TP (the backward raised on
    the last stage first, and the others were stopped): ``params`` with each one's alike in the model as built (the
    one-process run's gradients, by :func:`~vemesh.check.clones.layer_pattern`), and ``shapes`` with each alike
    module's output shape taken as its own's."""
    patterns = {layer_pattern(n): n for n in params}
    more = [n for n in ref["grads"] if n not in params and layer_pattern(n) in patterns]
    shapes = dict(shapes)
    for name in more:
        module, known = name.rpartition(".")[0], patterns[layer_pattern(name)].rpartition(".")[0]
        if module not in shapes and known in shapes:
            shapes[module] = shapes[known]
    return list(params) + more, shapes


def candidates(params: list[str], ref: dict, shapes: dict[str, list[int]], tp: int) -> list[ShardedInput]:
    """The modules that own parameters ``params`` (those whose gradients differ) and whose output on a TP rank
    (``shapes``: :func:`first_shapes`, or what a failed rank recorded) is a plain tensor split over TP along one dim,
    grouped by that dim."""
    if tp < 2:
        return []
    want = {k[0]: list(v.shape) for k, v in ref["outputs"][0].items() if k[1:] == (0, 0)}
    by_dim: dict[int, set[str]] = {}
    for name in params:
        module = name.rpartition(".")[0]
        dim = _split_dim(shapes.get(module), want.get(module), tp) if module else None
        if dim is not None:
            by_dim.setdefault(dim, set()).add(module)
    return [ShardedInput(tuple(sorted(modules)), dim) for dim, modules in sorted(by_dim.items())]


def hint(recipe: ShardedInput, outcome: str, still: list[str], kept: int = 0) -> str:
    """The hint for ``recipe``, tried: ``outcome`` is ``""`` where the check was then exact, else where it still went
    wrong; ``still`` the recipe's modules whose parameters' gradients still differed; ``kept``: the recipes of the
    hints before it that made their own gradients match, tried with it."""
    mods = recipe.modules
    named = mods[0] if len(mods) == 1 else f"{mods[0]} and {len(mods) - 1} more"
    head = (f"{named} hold parameters replicated over TP and run on this TP rank's part of their input (split on dim "
            f"{recipe.dim}: this rank's heads, or its part of a sequence-parallel region), so each TP rank's gradient "
            "of their weights is its own part's only, and the TP ranks' copies drift apart as they train. ")
    before = "" if not kept else ", with the hint before's style," if kept == 1 else f", with the {kept} hints before's,"
    tried = f"Tried: {recipe.style()} on them{before}"
    if not outcome:
        return (head + f"{tried} makes the check exact: their weights become DTensors replicated over TP, whose "
                "gradients torch sums over TP (docs/checking.md: a norm over this rank's heads)")
    if not still:
        return head + f"{tried} makes their gradients match (the check then {outcome}): use it, and see what still " \
            "differs"
    return (head + f"{tried}; their gradients still differ ({', '.join(still[:3])}), so that is not the cause, or not "
            f"the only one (the check then {outcome})")

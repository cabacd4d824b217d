"""How ``vemesh check`` compares the two runs: each module's outputs in forward order, each gradient by name."""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from vemesh.check.result import CheckResult

__all__ = ["FLOOR", "compare", "modules_before", "ran_before", "tolerance", "vanishing", "widths_of"]


def tolerance(rtol: float | None, dtypes: set[torch.dtype]) -> float:
    if rtol is not None:
        return rtol
    return 2e-2 if dtypes & {torch.bfloat16, torch.float16} else 1e-4


#: a tensor is measured against its own largest value, but never against less than this share of the median
#: tensor's largest value: a gradient that is zero in exact arithmetic (the key bias's: softmax ignores a constant
#: per query) is rounding in both runs, and its "relative" difference would be 1
FLOOR = 1e-2


def _difference(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``max |a - b| / max(max |b|, floor)`` in fp64 (``inf`` when one has non-finite values the other has not)."""
    a, b = a.double(), b.double()
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return math.inf
    a, b = torch.nan_to_num(a), torch.nan_to_num(b)
    scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / max(scale, floor, 1e-30) if b.numel() else 0.0


#: each row is matched to the nearest among this many neighbours either side in an order both sides share
#: (:func:`_difference_of_rows`)
NEIGHBOURS = 8


def _difference_of_rows(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """:func:`_difference` of ``a``'s rows (its first dim) against the rows of ``b`` nearest to each, when that pairs
    them one to one (else ``inf``): the same rows in another order. Under CP, a MoE's experts run each rank's tokens
    sorted by expert, so the rows of a module inside them are one process's rows in another order, and no join of
    the ranks' parts puts them back in it. Both sides are sorted by a fixed random projection of their rows, which
    puts a row and its rounding-near copy within a few places of each other, and each row is matched among its
    :data:`NEIGHBOURS` either side: linear in the rows, where all pairs' distances would be quadratic."""
    if a.dim() == 0 or a.shape != b.shape or a.shape[0] < 2:
        return math.inf
    rows_a, rows_b = a.reshape(a.shape[0], -1).double(), b.reshape(b.shape[0], -1).double()
    if not (torch.isfinite(rows_a).all() and torch.isfinite(rows_b).all()):
        return math.inf
    direction = torch.randn(rows_a.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rows_a, rows_b = rows_a[torch.argsort(rows_a @ direction)], rows_b[torch.argsort(rows_b @ direction)]
    n = rows_a.shape[0]
    here = torch.arange(n)
    best, pick = torch.full((n,), math.inf, dtype=torch.float64), here.clone()
    for offset in range(-NEIGHBOURS, NEIGHBOURS + 1):
        there = (here + offset).clamp(0, n - 1)
        distance = (rows_a - rows_b[there]).abs().amax(dim=1)
        closer = distance < best
        best, pick = torch.where(closer, distance, best), torch.where(closer, there, pick)
    if pick.unique().numel() != n:
        return math.inf
    return _difference(rows_a, rows_b[pick], floor)


def _floor(tensors: list[torch.Tensor]) -> float:
    """:data:`FLOOR` times the median of the tensors' largest absolute values."""
    peaks = sorted(t.detach().abs().max().item() for t in tensors if t is not None and t.numel())
    return FLOOR * peaks[len(peaks) // 2] if peaks else 0.0


def vanishing(grads: dict[str, torch.Tensor | None]) -> set[str]:
    """The gradients of one process that are zero in exact arithmetic, as :data:`FLOOR` reads them: none of their
    values above the floor (the key bias's, which softmax ignores). A data-parallel average leaves them as they are."""
    floor = _floor(list(grads.values()))
    return {n for n, g in grads.items() if g is not None and (not g.numel() or g.detach().abs().max().item() <= floor)}


def _times_along(got: list[torch.Tensor], shape: torch.Size, tp: int) -> int | None:
    """The one dim past the batch's along which every tensor of ``got`` is ``tp`` times ``shape`` (its other dims
    equal), or None. Not the first dim: a MoE's experts take the tokens routed to them, flattened, however many."""
    if tp < 2 or not got or any(g.dim() != len(shape) for g in got):
        return None
    dims = {tuple(i for i in range(len(shape)) if g.shape[i] != shape[i]) for g in got}
    if len(dims) != 1 or len(dims := next(iter(dims))) != 1 or dims[0] == 0:
        return None
    return dims[0] if all(g.shape[dims[0]] == tp * shape[dims[0]] for g in got) else None


def _joined(values: list[torch.Tensor], shape: torch.Size) -> torch.Tensor | None:
    """Shards joined along the one dim where they add up to ``shape``, or None."""
    first = values[0]
    if any(v.dim() != len(shape) for v in values):
        return None
    dims = [i for i in range(len(shape)) if first.shape[i] != shape[i]]
    if len(dims) != 1:
        return None
    joined = torch.cat(values, dim=dims[0])
    return joined if joined.shape == shape else None


def _cp_joins(values: list[torch.Tensor], shape: torch.Size, batch: int = 1) -> list[torch.Tensor]:
    """The CP ranks' sequence shards (in CP order) joined both ways torch's ``context_parallel`` cuts a sequence:
    in order, and load-balanced (rank ``r`` holds chunks ``r`` and ``2 x CP - 1 - r`` of ``2 x CP``). Shards that
    differ on their first dim may hold the ``batch`` sequences' tokens flattened (a MoE router's ``(B x T, E)``):
    they are joined as ``(B, T, ...)`` too."""
    plain = _joined(values, shape)
    if plain is None:
        return []
    dim = next(i for i in range(len(shape)) if values[0].shape[i] != shape[i])
    halves = [v.chunk(2, dim=dim) for v in values]
    if any(len(h) != 2 for h in halves):
        return [plain]
    balanced = torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)
    joins = [plain, balanced]
    if dim == 0 and batch > 1 and shape[0] % batch == 0 and all(v.shape[0] % batch == 0 for v in values):
        tokens = [v.reshape(batch, v.shape[0] // batch, *v.shape[1:]) for v in values]
        joins += [j.reshape(shape) for j in _cp_joins(tokens, torch.Size((batch, shape[0] // batch, *shape[1:])))]
    return joins


def _tp_views(values: list[torch.Tensor], shape: torch.Size, equal_shards: bool = False) -> list[torch.Tensor]:
    """What the TP peers' outputs (in TP order) can stand for on their CP rank: one value when they are replicas
    (bitwise equal, as a replicated DTensor's local values are on every TP rank), else the first rank's and the shards
    joined along each dim where TP of them fit ``shape``. ``equal_shards``: equal values joined too (asked only where
    nothing else explains the output: shards of zeros, as T5's cross-attention's position bias over a rank's heads)."""
    first = values[0]
    if len(values) == 1 or (not equal_shards and all(v.shape == first.shape and torch.equal(v, first)
                                                     for v in values[1:])):
        return [first]
    if any(v.shape != first.shape or v.dim() != len(shape) for v in values):
        return [first]
    n = len(values)
    return [first] + [torch.cat(values, dim=d) for d in range(first.dim())
                      if first.shape[d] * n <= shape[d] and shape[d] % (first.shape[d] * n) == 0]


def _full_views(ranks: list[dict], key: Any, shape: torch.Size, batch: int = 1,
                equal_shards: bool = False) -> list[torch.Tensor]:
    """The one-process-shaped values one data rank's ranks' outputs under ``key`` can make: over TP, the peers of each
    CP rank as :func:`_tp_views` reads them; over CP, those joined in CP order both ways ``context_parallel`` cuts a
    sequence (:func:`_cp_joins`, ``batch`` sequences a micro-batch). TP is read first on each CP rank (sequence
    parallelism shards a CP rank's part of the sequence again): read the other way, TP peers that each hold their CP
    rank's part whole, joined, can have the shape of the whole sequence when TP equals CP, and would be compared as
    if they were it."""
    by_cp: dict[int, list[dict]] = {}
    for r in ranks:  # one data rank's: they differ only in their TP and CP coordinates (HSDP's dims are its data rank)
        by_cp.setdefault(r["coords"].get("CP", 0), []).append(r)
    views = []
    for c in sorted(by_cp):
        values = [r["outputs"].get(key) for r in sorted(by_cp[c], key=lambda r: r["coords"].get("TP", 0))]
        if any(v is None for v in values):
            return []
        views.append(_tp_views(values, shape, equal_shards))
    if not views:
        return []
    out = []
    for k in range(min(map(len, views))):
        parts = [v[k] for v in views]
        out += [parts[0]] if len(parts) == 1 or parts[0].shape == shape else _cp_joins(parts, shape, batch)
    return [o for o in out if o.shape == shape]


#: a module called more times than this in a step is compared call by call, never reordered
MAX_REORDERED = 6


def _in_call_order(want: dict, got: dict, floor: float, tol: float) -> dict:
    """A rank's outputs ``got`` with each module's calls renumbered as one process's ``want`` made them, where this
    rank called the module in another order. Hugging Face's decoders with two kinds of layers compute one rotary
    table per kind, ``for layer_type in set(config.layer_types)`` (Gemma 3, OLMo 3, ModernBERT): a set of strings
    iterates in the order of its hashes, which Python seeds afresh in each process, so the one-process run and each
    rank may call ``rotary_emb`` in either order, and call 0 against call 0 differed where nothing did. A module's
    calls are renumbered only where, taken as they come, one differs, and some order of 2 to
    :data:`MAX_REORDERED` calls makes every output of each (of one process's shape) match one process's."""
    calls: dict[str, list[int]] = {}
    for key in want:  # (module, call, index)
        if key[1] not in calls.setdefault(key[0], []):
            calls[key[0]].append(key[1])
    out = got
    for name, order in calls.items():
        if not 1 < len(order) <= MAX_REORDERED:
            continue
        if all(_calls_match(want, got, name, c, c, floor, tol) for c in order):
            continue
        close = {(a, b): _calls_match(want, got, name, a, b, floor, tol) for a in order for b in order}
        found = next((p for p in itertools.permutations(order) if all(close[a, b] for a, b in zip(p, order))), None)
        if found is None:
            continue
        out = dict(got) if out is got else out
        for a, b in zip(found, order):
            out.update({(name, b, *k[2:]): got[k] for k in got if k[0] == name and k[1] == a})
    return out


def _calls_match(want: dict, got: dict, name: str, a: int, b: int, floor: float, tol: float) -> bool:
    """Every output of the rank's call ``a`` of module ``name`` has one process's shape and value of its call ``b``."""
    keys = [k for k in want if k[0] == name and k[1] == b]
    return all((g := got.get((name, a, *k[2:]))) is not None and g.shape == want[k].shape
               and _difference(g, want[k], floor) <= tol for k in keys)


def _cp_mean(ranks: list[dict], key: Any) -> torch.Tensor | None:
    """A scalar output under CP (a loss the model computes, HF's ``labels=``), as the mean of the CP ranks' values:
    each is the mean over its rank's part of the sequence, and the gradients average over CP as this mean does (with
    as many tokens counted on each rank, it is one process's loss; with other counts, the gradients differ too).
    None without CP, or where a CP rank's TP peers disagree."""
    by_cp: dict[int, list[torch.Tensor]] = {}
    for r in ranks:
        if (v := r["outputs"].get(key)) is not None:
            by_cp.setdefault(r["coords"].get("CP", 0), []).append(v)
    if len(by_cp) < 2 or any(not torch.equal(v, vs[0]) for vs in by_cp.values() for v in vs):
        return None
    return torch.stack([vs[0].double() for vs in by_cp.values()]).mean()


def _cut_over_cp(ranks: list[dict], key: Any, shape: torch.Size) -> bool:
    """The output under ``key`` is a part of the sequence on CP rank 0: no view of its TP peers' outputs has the
    one-process shape (so only a join over CP makes it)."""
    first = sorted((r for r in ranks if r["coords"].get("CP", 0) == 0), key=lambda r: r["coords"].get("TP", 0))
    values = [r["outputs"].get(key) for r in first]
    return bool(values) and all(v is not None for v in values) and \
        all(v.shape != shape for v in _tp_views(values, shape))


def compare(result: CheckResult, ref: dict, ranks: list[dict], tol: float) -> None:
    """``ranks``' records against one process's ``ref`` into ``result``, within ``tol``."""
    result.lowered = sorted({d for r in ranks for d in r.get("lowered", ())})
    worst = (0.0, "")
    cut = False  # under CP, some module's output was a part of the sequence

    def seen(diff: float, where: str) -> None:
        nonlocal worst
        if diff > worst[0]:
            worst = (diff, where)

    piped, tp = result.degrees.get("PP", 1) > 1, result.degrees.get("TP", 1)
    result.outputs_partial = len({n for r in ranks for n in r.get("partial", ())})
    # module outputs, in the one-process run's forward order, DP rank by DP rank
    for d, ref_out in enumerate(ref["outputs"]):
        floor = _floor(list(ref_out.values()))
        ranks_of_d = [dict(r, outputs=_in_call_order(ref_out, r["outputs"], floor, tol)) for r in ranks
                      if r["data_rank"] == d]
        matched: list[str] = []
        for key, want in ref_out.items():
            # under PP, the ranks whose stages ran that module of the model (each rank recorded only those)
            mine = [r for r in ranks_of_d if key in r["outputs"]] if piped else ranks_of_d
            got = [r["outputs"].get(key) for r in mine]
            got = [g for g in got if g is not None]
            if not got:
                continue
            same = [g for g in got if g.shape == want.shape]
            if same:
                diff = max(_difference(g, want, floor) for g in same)
                if diff > tol and want.dim() == 0 and (mean := _cp_mean(mine, key)) is not None:
                    diff = _difference(mean, want, floor)
            else:
                joined = _full_views(mine, key, want.shape, result.micro_batch_size) or \
                    _full_views(mine, key, want.shape, result.micro_batch_size, equal_shards=True)
                if not joined:
                    result.outputs_not_comparable += 1
                    if result.repeated is None and (dim := _times_along(got, want.shape, tp)) is not None:
                        result.repeated = {"module": key[0], "dim": dim, "length": want.shape[dim]}
                    continue
                diff = min(_difference(j, want, floor) for j in joined)
                cut = cut or (result.degrees.get("CP", 1) > 1 and _cut_over_cp(mine, key, want.shape))
                if diff > tol and len({r["coords"].get("CP", 0) for r in mine}) > 1:
                    diff = min(diff, *(_difference_of_rows(j, want, floor) for j in joined))
            result.outputs_compared += 1
            seen(diff, f"{key[0] or 'the root'}'s output")
            if diff > tol and result.first_module is None:
                result.first_module = {"module": key[0], "call": key[1], "dp_rank": d, "difference": diff,
                                       "scalar": want.dim() == 0}
                result.matched_before = matched[-3:]
            elif diff <= tol and (not matched or matched[-1] != key[0]):
                matched.append(key[0] or "(the root)")
    # gradients, by name, on every rank
    bad = []
    floor = _floor(list(ref["grads"].values()))
    for name, want in ref["grads"].items():
        diffs = []
        for r in ranks:
            if name not in r["grads"]:
                continue
            got = r["grads"][name]
            if (got is None) != (want is None):
                diffs.append(math.inf)
            elif got is not None and want is not None:
                diffs.append(_difference(got, want, floor) if got.shape == want.shape else math.inf)
        if not diffs:
            if want is not None and piped:  # a parameter no stage holds: the cut drops it
                result.unheld.append(name)
            continue
        result.gradients_compared += 1
        diff = max(diffs)
        seen(diff, f"{name}'s gradient")
        if diff > tol:
            bad.append((name, diff))
    if piped:  # a stage's parameter the model as built has under no such name: it cannot be paired
        result.unknown = sorted({n for r in ranks for n in r["grads"]} - set(ref["grads"]))
        result.split_ties = sorted({tuple(group) for r in ranks for group in r.get("apart", ())})
    result.gradients = sorted(bad, key=lambda x: -x[1])
    result.tp_whole_model = result.degrees["TP"] > 1 and not any(r["on_tp"] for r in ranks) and all(
        g is None or ref["grads"].get(n) is None or g.shape == ref["grads"][n].shape  # none sliced by hand
        for r in ranks for n, g in r["grads"].items())
    outputs = ref["outputs"]
    result.dp_same_batch = len(outputs) > 1 and bool(outputs[0]) and all(_equal(o, outputs[0]) for o in outputs[1:])
    result.dp_batch_by_rank = result.dp_same_batch and not piped and _peers_differ(ranks, ref, tol)
    result.largest, result.largest_at = worst
    # outputs that no join explains might be the cut ones: then it cannot tell
    result.cp_whole_sequence = (result.degrees.get("CP", 1) > 1 and result.outputs_compared > 0 and not cut
                                and not result.outputs_not_comparable)


def _peers_differ(ranks: list[dict], ref: dict, tol: float) -> bool:
    """Whether the parallel run's DP peers (other DP ranks at rank 0's TP and CP coordinates) gave another output of
    the first module that both ran with one process's shape, while rank 0's is one process's there: from the same
    weights, only other inputs do that (where one process's DP ranks drew the same batch, the step chose its batch
    by its rank). Rank 0 other than one process's there (its weights differ: a rank's own initialization) is not
    this, and stays a difference."""
    def view(r: dict) -> tuple:
        return tuple(r["coords"].get(d, 0) for d in ("TP", "CP"))

    first, want = (ranks[0], ref["outputs"][0]) if ranks and ref.get("outputs") else (None, {})
    key = next((k for k, t in (first or {}).get("outputs", {}).items() if k in want and want[k].shape == t.shape), None)
    if key is None or _difference(first["outputs"][key], want[key]) > tol:
        return False
    return any(view(r) == view(first) and r.get("data_rank") != first.get("data_rank") and key in r["outputs"]
               and not torch.equal(r["outputs"][key], first["outputs"][key]) for r in ranks[1:])


def _equal(a: dict, b: dict) -> bool:
    """Two DP ranks' module outputs in one process (:attr:`CheckResult.dp_same_batch`) are the same, to the bit."""
    return a.keys() == b.keys() and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
                                        for x, y in ((a[k], b[k]) for k in a))


def ran_before(ref_outputs: list[dict], module: str) -> set[str] | None:
    """The modules whose forward ended before ``module``'s last call ended in the one-process run (None where it
    recorded no output of ``module``): where the parallel run raised in ``module``, a Linear that runs after it cannot
    have made what it raised on (an ``nn.TransformerEncoderLayer``'s ``linear1``, after its attention)."""
    keys = list(ref_outputs[0]) if ref_outputs else []
    last = max((i for i, k in enumerate(keys) if k[0] == module), default=None)
    return None if last is None else {k[0] for k in keys[:last]}


def modules_before(ref_outputs: list[dict], first_module: dict) -> set[str]:
    """The modules whose outputs the one-process run made before ``first_module``'s (:attr:`CheckResult.first_module`)."""
    keys = list(ref_outputs[first_module["dp_rank"]])
    at = next((i for i, k in enumerate(keys) if k[0] == first_module["module"] and k[1] == first_module["call"]),
              len(keys))
    return {k[0] for k in keys[:at]}


def widths_of(ref: dict, module: str) -> set[int]:
    """The sizes of ``module``'s own 1-D parameters, from the one-process run's gradients."""
    return {g.numel() for n, g in ref.get("grads", {}).items()
            if n.rpartition(".")[0] == module and g is not None and g.dim() == 1}


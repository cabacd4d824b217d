"""How ``vemesh check`` compares the two runs: each module's outputs in forward order, each gradient by name."""

from __future__ import annotations

import math

import torch

from vemesh.check.result import CheckResult

__all__ = ["FLOOR", "compare", "modules_before", "tolerance"]


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


def _floor(tensors: list[torch.Tensor]) -> float:
    """:data:`FLOOR` times the median of the tensors' largest absolute values."""
    peaks = sorted(t.detach().abs().max().item() for t in tensors if t is not None and t.numel())
    return FLOOR * peaks[len(peaks) // 2] if peaks else 0.0


def _joined(values: list[torch.Tensor], shape: torch.Size) -> torch.Tensor | None:
    """The TP peers' shards joined along the one dim where they add up to ``shape``, or None."""
    first = values[0]
    if any(v.dim() != len(shape) for v in values):
        return None
    dims = [i for i in range(len(shape)) if first.shape[i] != shape[i]]
    if len(dims) != 1:
        return None
    joined = torch.cat(values, dim=dims[0])
    return joined if joined.shape == shape else None


def _cp_joins(values: list[torch.Tensor], shape: torch.Size) -> list[torch.Tensor]:
    """The CP ranks' sequence shards (in CP order) joined both ways torch's ``context_parallel`` cuts a sequence:
    in order, and load-balanced (rank ``r`` holds chunks ``r`` and ``2 x CP - 1 - r`` of ``2 x CP``)."""
    plain = _joined(values, shape)
    if plain is None:
        return []
    dim = next(i for i in range(len(shape)) if values[0].shape[i] != shape[i])
    halves = [v.chunk(2, dim=dim) for v in values]
    if any(len(h) != 2 for h in halves):
        return [plain]
    balanced = torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)
    return [plain, balanced]


def compare(result: CheckResult, ref: dict, ranks: list[dict], tol: float) -> None:
    worst = (0.0, "")

    def seen(diff: float, where: str) -> None:
        nonlocal worst
        if diff > worst[0]:
            worst = (diff, where)

    # module outputs, in the one-process run's forward order, DP rank by DP rank
    for d, ref_out in enumerate(ref["outputs"]):
        floor = _floor(list(ref_out.values()))
        mine = [r for r in ranks if r["data_rank"] == d]
        first_group = [r for r in mine if all(r["coords"].get(k, 0) == 0 for k in r["coords"] if k not in ("TP", "DP"))]
        first_group.sort(key=lambda r: r["coords"].get("TP", 0))
        cp_group = sorted((r for r in mine if r["coords"].get("TP", 0) == 0), key=lambda r: r["coords"].get("CP", 0))
        matched: list[str] = []
        for key, want in ref_out.items():
            got = [r["outputs"].get(key) for r in mine]
            got = [g for g in got if g is not None]
            if not got:
                continue
            same = [g for g in got if g.shape == want.shape]
            if same:
                diff = max(_difference(g, want, floor) for g in same)
            else:
                peers = [r["outputs"].get(key) for r in first_group]
                joined = [_joined(peers, want.shape)] if all(p is not None for p in peers) else []
                seq = [r["outputs"].get(key) for r in cp_group]
                if joined == [None] and len(cp_group) > 1 and all(p is not None for p in seq):
                    joined = _cp_joins(seq, want.shape)
                joined = [j for j in joined if j is not None]
                if not joined:
                    result.outputs_not_comparable += 1
                    continue
                diff = min(_difference(j, want, floor) for j in joined)
            result.outputs_compared += 1
            seen(diff, f"{key[0] or 'the root'}'s output")
            if diff > tol and result.first_module is None:
                result.first_module = {"module": key[0], "call": key[1], "dp_rank": d, "difference": diff}
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
            continue
        result.gradients_compared += 1
        diff = max(diffs)
        seen(diff, f"{name}'s gradient")
        if diff > tol:
            bad.append((name, diff))
    result.gradients = sorted(bad, key=lambda x: -x[1])
    result.largest, result.largest_at = worst


def modules_before(ref_outputs: list[dict], first_module: dict) -> set[str]:
    """The modules whose outputs the one-process run made before ``first_module``'s (:attr:`CheckResult.first_module`)."""
    keys = list(ref_outputs[first_module["dp_rank"]])
    at = next((i for i, k in enumerate(keys) if k[0] == first_module["module"] and k[1] == first_module["call"]),
              len(keys))
    return {k[0] for k in keys[:at]}

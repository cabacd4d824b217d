"""What the data-parallel wrapper adds to each micro-batch of a pipeline stage and to a step's end, per element.

A search's estimate of a PP mesh (:mod:`vemesh.planning.pipeline_estimate`) traces one micro-batch through a stage
without its data-parallel wrapper (:func:`vemesh.planning.activations.trace_stage`). The traced plan runs the
wrapper, and its work is elementwise over the parameters and gradients:

* vemesh DDP (and ZeRO-1) folds each low-precision gradient into its fp32 ``main_grad`` and refreshes the ``.grad``
  the user sees at every backward (torch's contract: ``.grad`` holds the sum after each backward); autograd adds
  into that ``.grad`` from the second micro-batch on; the last backward averages the buffers;
* FSDP2, as torch's pipeline stages drive it (no gradient sync and no reshard after each backward, the reduction
  once at the end), gathers the parameters in forward and again in backward (the copy into the all-gather's input
  is of the shard, the copy out of the whole), adds each micro-batch's unsharded gradients, and at the end casts them
  to fp32 and reduce-scatters them;
* the example clips the gradients before ``optimizer.step()``.

So their bytes are a number per element of the rank's parameters (as TP leaves them) plus, for what touches FSDP2's
shards, a number per element of the shard, and their ops a number per parameter tensor. :func:`wrapper_costs`
traces them once per DP mode and dtype on the GPT preset's own model and parallelize function
(:func:`vemesh.models.gpt.parallelize`), with 1 and then 2 blocks (the difference is per block, whatever the
embeddings), on a fake world of 2 ranks and, for FSDP2, of 4 (the difference is the shard's part); what it keeps
is the wrapped run over the plain stage's one backward from cleared gradients, which the stage trace counts.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from vemesh.mesh.manager import VeDeviceMesh
from vemesh.models.gpt import model as model_module
from vemesh.models.gpt.parallelize import parallelize
from vemesh.optim import clip_grad_norm_
from vemesh.planning.fake_world import real_mesh_tensors
from vemesh.planning.fusion import step_counters
from vemesh.planning.step_tracker import StepTracker

__all__ = ["WrapperCosts", "build_gpt", "wrapper_costs"]


@dataclass(frozen=True)
class WrapperCosts:
    """Memory-bound bytes and ops that the wrapper, autograd's accumulation and the example's clipping add to a
    stage's step over one plain backward per micro-batch: each part as (bytes per element, bytes per element of the
    shard, that is per element / DP, ops per parameter tensor)."""

    first: tuple[float, float, float]  #: the first micro-batch of a step, gradients not synchronised
    later: tuple[float, float, float]  #: each later one but the last (they add to the gradients)
    last: tuple[float, float, float]  #: the last one, which synchronises the gradients
    only: tuple[float, float, float]  #: a step's only micro-batch (first and last at once)
    end: tuple[float, float, float]  #: the example's ``clip_grad_norm_`` before ``optimizer.step()``
    #: (bytes per element, per element / DP) held from a step's first backward to its end, besides the parameters'
    #: shards: under FSDP2 the unsharded parameters and the unsharded gradients, which it accumulates in fp32 (the
    #: reduce dtype) without gradient sync; 0 under vemesh DDP, whose buffers are the static gradients
    held: tuple[float, float] = (0.0, 0.0)

    def step(self, passes: int, elements: int, tensors: int, dp: int) -> tuple[int, int]:
        """(bytes, ops) they add to a step of ``passes`` micro-batches over ``elements`` parameter elements in
        ``tensors`` parameter tensors, sharded over ``dp`` ranks under FSDP2."""
        parts = [self.only] if passes == 1 else [self.first, *[self.later] * (passes - 2), self.last]
        parts.append(self.end)
        return (round(sum(elements * whole + elements / dp * shard for whole, shard, _ in parts)),
                round(tensors * sum(ops for _, _, ops in parts)))


@functools.lru_cache(maxsize=8)
def wrapper_costs(mode: str, dtype: str) -> WrapperCosts:
    """:class:`WrapperCosts` of ``mode`` (ddp, zero1: vemesh DDP; fsdp: FSDP2 with the example's mixed precision)
    training in ``dtype`` (bf16 or fp32), traced (see the module docstring)."""
    if mode not in ("ddp", "zero1", "fsdp"):
        raise ValueError(f"mode must be ddp, zero1 or fsdp; got {mode!r}")
    sizes = (2, 4) if mode == "fsdp" else (2,)
    runs = {(blocks, dp): _run(mode, dtype, blocks, dp) for blocks in (1, 2) for dp in sizes}
    elements = runs[2, 2][0] - runs[1, 2][0]
    tensors = runs[2, 2][1] - runs[1, 2][1]

    def per_block(dp: int, pick: int) -> tuple[float, float]:
        """Pass ``pick`` (4: the clipping) of the wrapped run over the plain run's first, per block."""
        def extra(blocks: int) -> list[int]:
            _, _, plain, wrapped, _ = runs[blocks, dp]
            return [w - (p if pick < 4 else 0) for w, p in zip(wrapped[pick], plain)]
        one, two = extra(1), extra(2)
        return (two[0] - one[0]) / elements, (two[1] - one[1]) / tensors

    def part(pick: int) -> tuple[float, float, float]:
        (bytes2, ops), (bytes4, _) = per_block(2, pick), per_block(sizes[-1], pick)
        shard = 4 * (bytes2 - bytes4)  # bytes = whole + shard / dp: measured at DP 2 and 4
        return bytes2 - shard / 2, shard, ops

    def held() -> tuple[float, float]:
        if mode != "fsdp":  # vemesh DDP's buffers are the static gradients, made before the first step
            return 0.0, 0.0
        at = {dp: (runs[2, dp][4] - runs[1, dp][4]) / elements for dp in sizes}
        shard = 4 * (at[2] - at[sizes[-1]])
        return at[2] - shard / 2, shard

    return WrapperCosts(first=part(0), later=part(1), last=part(2), only=part(3), end=part(4), held=held())


def _run(mode: str, dtype: str, blocks: int, dp: int) -> tuple[int, int, tuple[int, int], list[tuple[int, int]], int]:
    """(parameter elements, parameter tensors, (bytes, ops) of one plain backward, [(bytes, ops) of each wrapped
    pass], bytes held after the second) of a tiny GPT of ``blocks`` blocks on a fake world of ``dp`` ranks. The
    wrapped passes: a step of three micro-batches (the first two without gradient sync), a step of one, then the
    clipping; the bytes held are what the first two left (the step's tensors, not the model's own)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore


    if dist.is_initialized():
        raise RuntimeError("the planner traces the data-parallel wrappers on torch's fake backend, in a world of its "
                           "own; call it before init_process_group (or in another process)")
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    fsdp = mode == "fsdp"
    cfg = model_module.GPTConfig(n_layer=blocks, n_embd=64, n_head=2, vocab_size=128, block_size=16, dropout=0.0)
    dist.init_process_group("fake", rank=0, world_size=dp, store=FakeStore())
    try:
        mesh = VeDeviceMesh()
        mesh.init_device_mesh("cpu", (dp,), mesh_dim_names=("DP",))
        with FakeTensorMode(allow_non_fake_inputs=True), real_mesh_tensors():
            def micro_batch(model: torch.nn.Module) -> tuple[int, int]:
                x, y = (torch.randint(0, cfg.vocab_size, (1, cfg.block_size)) for _ in range(2))
                with step_counters(True) as (_, counted):
                    F.cross_entropy(model(x).float().view(-1, cfg.vocab_size), y.view(-1)).backward()
                return counted.bytes, counted.ops

            plain = micro_batch(build_gpt(cfg, compute))  # what the stage trace counts: the model in the compute dtype
            model = build_gpt(cfg, torch.float32 if fsdp else compute)
            elements, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
            options = dict(data_parallel="fsdp", mp_policy=MixedPrecisionPolicy(param_dtype=compute,
                           reduce_dtype=torch.float32)) if fsdp else dict(data_parallel="ddp")
            model = parallelize(model, mesh, **options)
            wrapped, tracker, held = [], StepTracker(module_hooks=False), 0
            # a step of one micro-batch first, not counted: the traced plan counts its second step, past FSDP2's lazy
            # init; then a step of three micro-batches (the first two without gradient sync), and one of one
            for index, sync in enumerate((True, False, False, True, True)):
                if index in (1, 4):  # a new step: the gradients cleared (and FSDP2 resharded, as torch's stage does)
                    if fsdp:
                        model.reshard()
                    model.zero_grad(set_to_none=True)
                if index == 1:
                    tracker.__enter__()  # what the micro-batches leave: FSDP2's unsharded parameters and gradients
                if index == 3:
                    held = sum(c["Total"] for c in _named(tracker.get_tracker_snapshot("current")).values())
                    tracker.__exit__(None, None, None)
                if fsdp:  # as torch's pipeline stage drives FSDP2 (a synchronising backward stands for its final one)
                    model.set_is_last_backward(sync)
                    model.set_reshard_after_backward(sync)
                    model.set_requires_gradient_sync(sync)
                    syncing = contextlib.nullcontext()
                else:
                    syncing = contextlib.nullcontext() if sync else model.no_sync()
                with syncing:
                    counted = micro_batch(model)
                if index:
                    wrapped.append(counted)
            with step_counters(True) as (_, counted):
                clip_grad_norm_(list(model.parameters()), 1.0)
            wrapped.append((counted.bytes, counted.ops))
    finally:
        dist.destroy_process_group()
    return elements, tensors, plain, wrapped, held


def _named(snapshot: dict) -> dict:
    """MemTracker's snapshot with each category by its name."""
    return {device: {str(getattr(k, "value", k)): v for k, v in kinds.items()} for device, kinds in snapshot.items()}


def build_gpt(cfg: object, dtype: torch.dtype) -> torch.nn.Module:
    """The GPT preset's model of ``cfg`` made in ``dtype`` (fake parameters cannot be converted in place)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return model_module.GPT(cfg)
    finally:
        torch.set_default_dtype(before)

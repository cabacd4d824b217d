"""What GPU users turn on for speed, as rules on the traced step (``vemesh plan --compile``, ``--float8``,
``--float8-all-gather``, ``--async-tp``): the trace stays eager and bf16; :mod:`vemesh.planning.step_time` times
its counts (:mod:`vemesh.planning.fusion`) by these rules.

* **attention** (always): the fused attention kernels' FLOPs at the profile's ``attention_achievable`` fraction of
  the peak where it has one (flash attention reaches less of it than a large matmul), or, with a calibrated grid of
  shapes, each call's FLOPs at the rate measured nearest its shape (:func:`attention_seconds`); the other FLOPs at
  ``achievable``.
* **transcendental ops** (always): their bytes at the profile's ``transcendental_bandwidth`` where it has one (a
  CPU's), the others at ``memory_bandwidth``; compiled, their arithmetic beyond a fused region's bytes is still done.
* **compile**: the memory-bound ops pay the bytes of :class:`~vemesh.planning.fusion.Fusion`'s fused regions, and
  the framework's time per op is paid per kernel (a region is one); DTensor's per-op dispatch is compiled away.
* **Float8** (``tensorwise`` or ``rowwise``, torchao's recipes): ``nn.Linear``'s matmuls run at the profile's
  ``fp8`` rate, but the output head (torchtitan keeps ``output`` in bf16; :attr:`Speedups.bf16_flops`). Each
  operand of each Float8 matmul is cast and scaled: eager reads it twice (the scale's amax, the cast) in the job's
  dtype and writes it in 1 byte; compiled, the amax and the cast fuse into the op that made it, which writes the
  1-byte copy too. ``rowwise`` pays the same bytes and runs at the same rate (its scales are per row).
* **Float8 all-gather**: FSDP2's parameter all-gather moves the Float8 Linear weights in 1 byte an element instead
  of the compute dtype's 2 (:attr:`Speedups.float8_share`: their share of the gathered parameters).
* **Float8 TP** (the Llama 3 preset under ``--float8 tensorwise``, as torchtitan applies torchao's
  ``Float8ColwiseParallel``, ``Float8RowwiseParallel`` and ``PrepareFloat8ModuleInput``): the blocks' inputs and
  their Linears' output gradients are cast to Float8 before TP gathers them, so TP's all-gathers into the block
  Linears (:mod:`vemesh.planning.tp_overlap` names them) move 1 byte an element; the head's stays bf16.
* **async TP**: a TP all-gather or reduce-scatter that torch's micro-pipeline pass fuses with its matmuls (an
  all-gather feeding matmuls as their first operand, a reduce-scatter of one matmul's output:
  :mod:`vemesh.planning.tp_overlap` finds them on the trace) hides behind those matmuls' time, call by call; the
  rest of TP's traffic (the reduce-scatter of a sum of matmuls' gradients, all-reduces) stays exposed.

None of these changes the predicted peak (the trace is eager), but for the Llama 3 preset's compiled loss: the request
traces it as inductor holds it (:func:`vemesh.models.llama3.planned.compiled_loss_fn`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ATTENTION_IN", "ATTENTION_KEY", "BACKWARD_KEY", "FLOAT8", "FLOPS_IN", "Speedups", "attention_key",
           "attention_seconds", "check_user_float8", "compute_dtype", "flops_by_dtype", "linear_share"]

#: ``--float8``'s recipes (torchao's ``Float8LinearConfig.from_recipe_name``).
FLOAT8 = ("tensorwise", "rowwise")
#: the prefix of a trace's count of attention FLOPs by shape: ``attention_flops@SEQxHEAD``
ATTENTION_KEY = "attention_flops@"
#: the backward's FLOPs by shape, counted under this key too (a subset of ``ATTENTION_KEY``'s)
BACKWARD_KEY = "attention_backward_flops@"
#: the prefix of a trace's count of the matmuls' and attention's FLOPs by the dtype they ran in (``flops_in@bfloat16``):
#: FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` computes a model of fp32 parameters in bf16
FLOPS_IN = "flops_in@"
#: the same of attention's FLOPs alone
ATTENTION_IN = "attention_in@"
#: a torch dtype's name as the device profiles name their matmul rates (``tf32``: fp32 matmuls the code lets run in
#: TF32, :func:`vemesh.planning.fusion._tf32`)
_PROFILE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
#: bytes per element of a Float8 operand's cast and scale: (eager, compiled), the operand in a 2-byte dtype
_CAST_BYTES = (2 + 2 + 1, 2 + 1)


@dataclass(frozen=True)
class Speedups:
    compile: bool = False
    float8: str | None = None
    float8_all_gather: bool = False
    async_tp: bool = False
    #: per rank class, FLOPs of Linear matmuls that stay in bf16 under Float8 (the output head), in class order
    bf16_flops: tuple[int, ...] = ()
    #: the share of FSDP2's gathered parameters that are Float8 Linear weights (:func:`linear_share`)
    float8_share: float = 1.0
    #: under Float8 tensorwise, TP's all-gathers into Linears move 1 byte an element (torchtitan's Float8 TP styles)
    float8_tp_gathers: bool = False
    #: per-call FLOPs of TP-fed matmuls that stay in bf16 under Float8 (the Llama 3 preset's output head)
    bf16_fed: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """What each switch needs of the others, one line each: none of them plans a job that cannot run (torchtitan
        refuses the same pairs)."""
        if self.float8 is not None and self.float8 not in FLOAT8:
            raise ValueError(f"--float8 {self.float8!r}: choose one of {', '.join(FLOAT8)}")
        if self.float8_all_gather and self.float8 is None:
            raise ValueError("--float8-all-gather sends FSDP2's Float8 weights in 1 byte: give --float8 "
                             f"{'|'.join(FLOAT8)} too")
        if self.float8_all_gather and self.float8 != "tensorwise":
            raise ValueError(f"--float8-all-gather with --float8 {self.float8}: torchao sends FSDP2's weights in Float8 "
                             "only under tensorwise scaling (torchtitan refuses the pair): give --float8 tensorwise, "
                             "or leave --float8-all-gather out")
        if self.async_tp and not self.compile:
            raise ValueError("--async-tp is torch's micro-pipeline pass, which only torch.compile (inductor) runs: "
                             "eager TP leaves every all-gather and reduce-scatter exposed (torchtitan refuses async TP "
                             "without compile): give --compile too, or leave --async-tp out")

    @property
    def any(self) -> bool:
        return self.compile or self.float8 is not None or self.async_tp

    def compute_seconds(self, c: Any, index: int, profile: Any, dtype: str) -> float:
        """A rank class's compute (matmuls, memory-bound bytes, per-op time) under these switches."""
        return paced(*self.compute_parts(c, index, profile, dtype), profile)

    def compute_parts(self, c: Any, index: int, profile: Any, dtype: str) -> tuple[float, float]:
        """A rank class's compute as ``(device, host)``: the device's work (matmuls, memory-bound bytes) and the host's
        dispatch (the profile's time per op, each op or, under compile, each kernel)."""
        counts = getattr(c, "counts", None) or {}
        dtype = compute_dtype(counts, dtype)
        rate = profile.flops(dtype) * profile.achievable
        attention = counts.get("attention_flops", 0)
        ran, ran_attention = flops_by_dtype(counts), flops_by_dtype(counts, ATTENTION_IN)
        # each dtype's matmuls at its rate, and any FLOPs no dtype counted at the rate of the one most ran in
        matmul = sum((f - ran_attention.get(d, 0)) / (profile.flops(d) * profile.achievable) for d, f in ran.items()) \
            + max(0, c.flops - attention - sum(ran.values()) + sum(ran_attention.values())) / rate \
            + attention_seconds(counts, profile, compute_dtype(counts, dtype, ATTENTION_IN))
        cast = 0.0
        if self.float8 is not None:
            linear = counts.get("linear_flops", 0)
            fp8 = self.fp8_flops(c, index)
            matmul += fp8 / (profile.flops("fp8") * profile.achievable) - fp8 / rate
            elements = counts.get("linear_elements", 0) * (fp8 / linear if linear else 0)
            cast = elements * _CAST_BYTES[self.compile]
        # the transcendental ops' arithmetic beyond what their bytes cost at the bandwidth (fused or not, it is done)
        slow = getattr(profile, "transcendental_bandwidth", None) or profile.memory_bandwidth
        arithmetic = counts.get("transcendental_bytes", 0) * max(0.0, 1 / slow - 1 / profile.memory_bandwidth)
        if self.compile:
            moved = counts.get("fused_bytes", c.memory_bytes) - c.optimizer_bytes + cast
            host = counts.get("kernels", c.ops) * profile.op_overhead_s
        else:
            moved = c.memory_bytes - c.optimizer_bytes + cast
            host = c.ops * profile.op_overhead_s + c.dtensor_ops * profile.dtensor_op_overhead_s
        return matmul + arithmetic + moved / profile.memory_bandwidth, host

    def fp8_flops(self, c: Any, index: int) -> int:
        """The FLOPs of rank class ``c`` (the ``index``-th) timed at the fp8 rate: its ``nn.Linear`` matmuls but the
        output head's, under ``--float8``; 0 without it."""
        if self.float8 is None:
            return 0
        linear = (getattr(c, "counts", None) or {}).get("linear_flops", 0)
        return max(0, linear - (self.bf16_flops[index] if index < len(self.bf16_flops) else 0))

    def matmul_seconds(self, flops: int, profile: Any, dtype: str) -> float:
        """The seconds of a TP-fed matmul of ``flops`` (under Float8 at the fp8 rate, but one that stays bf16): what
        async TP's fused collective runs under."""
        fp8 = self.float8 is not None and flops not in self.bf16_fed
        return flops / (profile.flops("fp8" if fp8 else dtype) * profile.achievable)

    def tp_gathered_bytes(self, fed: int, nbytes: float) -> float:
        """A TP all-gather's bytes: half for one into Float8 Linears (``fed``, its matmuls' FLOPs per call) under
        torchtitan's Float8 TP styles, which cast to Float8 before gathering."""
        return nbytes / 2 if self.float8_tp_gathers and fed and fed not in self.bf16_fed else nbytes

    def gathered_bytes(self, nbytes: float) -> float:
        """FSDP2's all-gather bytes with the Float8 weights sent in 1 byte (half the 2-byte compute dtype's)."""
        return nbytes * (1 - 0.5 * self.float8_share) if self.float8_all_gather else nbytes


def check_user_float8(speed: Speedups, fit: Any, dtype: str, name: str) -> None:
    """``--float8`` (and ``--float8-all-gather``) with the user's function ``name``, as its trace read it: Float8 runs
    in place of bf16 matmuls, which the function's own mixed precision may give under ``--dtype fp32`` (FSDP2's
    ``MixedPrecisionPolicy``, autocast), and gathers FSDP2's parameters. ``ValueError`` (one line) where the matmuls
    ran in another dtype, or where the function wrapped DDP, which gathers no parameters."""
    ran = sorted({compute_dtype(getattr(c, "counts", None) or {}, dtype) for c in fit.classes} - {"bf16"})
    if ran:
        raise ValueError(f"--float8 {speed.float8} runs the Linear matmuls in float8 in place of bf16 ones (torchao's "
                         f"training recipe), but your step ran them in {', '.join(ran)}: give FSDP2 a "
                         "MixedPrecisionPolicy(param_dtype=torch.bfloat16) or the step torch.autocast(dtype="
                         "torch.bfloat16), or plan with --dtype bf16")
    if speed.float8_all_gather and fit.dp_mode in ("ddp", "zero1"):
        raise ValueError(f"--float8-all-gather is FSDP2's parameter all-gather, but --parallelize {name} wrapped DDP "
                         f"(dp mode {fit.dp_mode}), which all-reduces gradients and gathers no parameters: leave "
                         "--float8-all-gather out, or shard with fully_shard")


def paced(device: float, host: float, profile: Any) -> float:
    """A rank's compute from the device's work and the host's dispatch: a GPU runs its queue while the host
    dispatches the next ops, so the slower of the two sets the pace (a queued profile's); a CPU does both in turn."""
    return max(device, host) if profile.queued else device + host


def attention_key(q_len: int, kv_len: int, head_dim: int, backward: bool = False) -> str:
    """The count's key of an attention call's FLOPs: the geometric mean of its query and key lengths (a ring step of
    context parallelism, or half of a load-balanced chunk, runs blocks shorter than the sequence), and its head size;
    with ``backward``, the key its backward's FLOPs are also counted under."""
    return f"{BACKWARD_KEY if backward else ATTENTION_KEY}{round((q_len * kv_len) ** 0.5)}x{head_dim}"


def flops_by_dtype(counts: dict[str, int], prefix: str = FLOPS_IN) -> dict[str, int]:
    """A trace's FLOPs by the profile's name of the dtype they ran in (``prefix``: :data:`FLOPS_IN`, every matmul and
    attention kernel; :data:`ATTENTION_IN`, attention's alone)."""
    out: dict[str, int] = {}
    for key, flops in counts.items():
        if key.startswith(prefix) and flops:
            name = _PROFILE_DTYPES.get(key[len(prefix):], key[len(prefix):])
            out[name] = out.get(name, 0) + flops
    return out


def compute_dtype(counts: dict[str, int], default: str, prefix: str = FLOPS_IN) -> str:
    """The dtype most of a trace's FLOPs ran in (the step's compute dtype: the rate of its MFU), else ``default``
    (the job's ``--dtype``: a trace that counted none by dtype)."""
    ran = flops_by_dtype(counts, prefix)
    return max(ran, key=lambda d: ran[d]) if ran else default


def attention_seconds(counts: dict[str, int], profile: Any, dtype: str) -> float:
    """The fused attention kernels' time: each shape's FLOPs (``attention_flops@SEQxHEAD``,
    :func:`attention_key`) at the profile's rate for that shape
    (:meth:`~vemesh.planning.profiles.DeviceProfile.attention_fraction`), the backward's
    (``attention_backward_flops@SEQxHEAD``) at that rate times the profile's ``attention_backward``, and any not
    counted by shape (an older trace) at its rate without a grid."""
    peak, seconds, by_shape = profile.flops(dtype), 0.0, 0
    slower = 1 / (getattr(profile, "attention_backward", None) or 1.0) - 1  # a backward's time over its forward rate's
    for key, flops in counts.items():
        for prefix, share in ((ATTENTION_KEY, 1.0), (BACKWARD_KEY, slower)):
            if key.startswith(prefix) and share:
                seq, head_dim = (int(x) for x in key[len(prefix):].split("x"))
                seconds += share * flops / (peak * profile.attention_fraction(seq, head_dim))
                by_shape += flops if prefix == ATTENTION_KEY else 0
    rest = counts.get("attention_flops", 0) - by_shape
    return seconds + max(0, rest) / (peak * (profile.attention_achievable or profile.achievable))


def linear_share(model: Any, skip: tuple[str, ...] = ("output",)) -> float:
    """The share of ``model``'s parameters (meta is fine) in ``nn.Linear`` weights, those named in ``skip`` (the head)
    left out: what Float8 gathers in 1 byte."""
    from torch import nn

    total = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in skip)
    return linear / total if total else 0.0

"""Device profiles: what a step-time prediction needs of the hardware, by name (built in) or from a JSON file.

A profile gives, per device: the peak matmul throughput per dtype and the fraction a training step reaches
(``achievable``), the memory bandwidth, and two link classes, ``host`` (the devices of one host, NVLink) and
``network`` (across hosts), each with a latency per collective step and a bus bandwidth (nccl-tests' busbw: the
bytes a ring moves per device per second). ``devices_per_host`` places the mesh on hosts; optional racks
(``hosts_per_rack`` and a third link class, ``rack``) time a group whose ranks lie in more than one rack on it.

The built-in profiles (``vemesh/planning/profiles/*.json``) come from the vendors' published specifications, each
file naming its sources and what it assumes; ``measured`` is false in them and the output says so.
``vemesh calibrate`` writes a measured one for the machine it runs on. Pure Python and pydantic: no torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["BUILT_IN", "AttentionRate", "DeviceProfile", "Link", "load_profile"]

_HERE = Path(__file__).resolve().parent / "profiles"
#: The names of the built-in profiles.
BUILT_IN: tuple[str, ...] = tuple(sorted(p.stem for p in _HERE.glob("*.json")))


class Link(BaseModel):
    """One class of link: the latency of one collective step, and the bus bandwidth per device (bytes/s)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    latency_s: float = Field(gt=0)
    bandwidth: float = Field(gt=0)


class AttentionRate(BaseModel):
    """Fused attention's measured rate at one shape: causal forward and backward of heads of ``head_dim`` over
    sequences of ``seq``, as a fraction of the profile's matmul peak (``vemesh calibrate`` measures a grid of them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    seq: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    achievable: float = Field(gt=0, le=1)


class DeviceProfile(BaseModel):
    """A device and its links (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    description: str = ""
    measured: bool
    sources: list[str] = Field(min_length=1)
    assumptions: list[str] = []
    devices_per_host: int = Field(gt=0)
    matmul_flops: dict[Literal["fp32", "tf32", "bf16", "fp16", "fp8"], float] = Field(min_length=1)
    achievable: float = Field(gt=0, le=1)
    #: the fraction of the peak that attention's fused kernels reach (flash attention's; None: ``achievable``)
    attention_achievable: float | None = Field(None, gt=0, le=1)
    #: attention's backward rate over its forward's (None: the same); the rates above are the forward's
    attention_backward: float | None = Field(None, gt=0, le=1)
    #: measured attention rates on a grid of shapes (every ``seq`` with every ``head_dim``): an attention call is timed
    #: at the rate interpolated at its shape (:meth:`attention_fraction`); a CPU's flash attention reaches 0.04 of
    #: its matmul rate at head size 4, 0.58 at (1024, 64). Empty: ``attention_achievable``
    attention: list[AttentionRate] = []
    memory_bandwidth: float = Field(gt=0)
    #: bytes per second of the memory-bound ops whose arithmetic is transcendental, a division or a normalization
    #: (exp, GELU, SiLU, rsqrt, softmax, norms: :mod:`vemesh.planning.fusion`). None: ``memory_bandwidth`` (a GPU runs
    #: them at its bandwidth, the built-in profiles); a CPU's cores are slower at them, and ``vemesh calibrate``
    #: measures them apart
    transcendental_bandwidth: float | None = Field(None, gt=0)
    #: the fraction of a collective that can run behind compute (1: a GPU's copy engines; a CPU whose cores the
    #: ranks already share has little to spare, and ``vemesh calibrate`` measures it)
    overlap: float = Field(1.0, ge=0, le=1)
    #: seconds each collective call on the critical path costs on top of its latency and bandwidth, because the
    #: ranks reach it at different moments (0 in the built-in profiles; ``vemesh calibrate`` measures it)
    collective_wait_s: float = Field(0.0, ge=0)
    #: seconds a collective issued through torch's functional collectives (DTensor's redistributions: TP's and SP's,
    #: CP's all-to-alls) costs per call on top of that: its Python wrapper, and its wait, which comes when the result
    #: is first used (0 in the built-in profiles; ``vemesh calibrate`` measures it, as TP runs one)
    functional_wait_s: float = Field(0.0, ge=0)
    #: seconds of framework time per op dispatched, and per op on a DTensor on top (eager mode's cost, which a GPU
    #: hides behind its queue when the ops are large: 0 in the built-in profiles; ``vemesh calibrate`` measures it)
    op_overhead_s: float = Field(0.0, ge=0)
    dtensor_op_overhead_s: float = Field(0.0, ge=0)
    #: the device runs its ops from a queue that the host fills (a GPU): the framework's time per op runs while the
    #: device works, so a rank's compute is the larger of the two, not their sum (a CPU does both in turn)
    queued: bool = False
    #: how many ranks share one compute engine when every rank runs: 1 for a device each (the built-in profiles);
    #: N / C for N ranks on C < N CPU cores (``vemesh calibrate`` writes it). The matmul and memory figures are per
    #: rank with every rank running; a rank that waits in a pipeline bubble leaves its share to the ranks that compute
    shared_compute: float = Field(1.0, ge=1)
    #: the collective library the links were measured with or published for; where a job's own collectives
    #: depend on it (ZeRO-1's gather: one broadcast per rank on gloo, an all-gather elsewhere), the time follows it
    backend: Literal["nccl", "gloo"] = "nccl"
    host: Link
    network: Link
    #: optional racks: ``hosts_per_rack`` hosts share a rack, and ``rack`` is the link a group crosses when its ranks
    #: lie in more than one rack (an oversubscribed spine: less bandwidth per device than ``network``); both or neither
    hosts_per_rack: int | None = Field(None, gt=0)
    rack: Link | None = None
    #: measured on the host link by ``vemesh calibrate``: per collective kind, per group size (as a string), the
    #: link its groups of that size see while every group of that size runs at once; other kinds take ``host``
    collectives: dict[str, dict[str, Link]] = {}

    @model_validator(mode="after")
    def _racks_whole(self) -> DeviceProfile:
        if (self.hosts_per_rack is None) != (self.rack is None):
            raise ValueError("racks need both hosts_per_rack and rack (the link between racks), or neither")
        seqs, heads = {a.seq for a in self.attention}, {a.head_dim for a in self.attention}
        if len({(a.seq, a.head_dim) for a in self.attention}) != len(seqs) * len(heads) or \
                len(self.attention) != len(seqs) * len(heads):
            raise ValueError(f"attention needs one rate for each seq ({sorted(seqs)}) with each head_dim "
                             f"({sorted(heads)}), a full grid; got {len(self.attention)} entries")
        return self

    def attention_fraction(self, seq: int, head_dim: int) -> float:
        """The fraction of the peak an attention call over sequences of ``seq`` with heads of ``head_dim`` reaches:
        the measured grid (:attr:`attention`) interpolated linearly in the logarithms of both, each held at the
        grid's edge beyond it; without a grid ``attention_achievable``, else ``achievable``."""
        if not self.attention:
            return self.attention_achievable or self.achievable
        rates = {(a.seq, a.head_dim): a.achievable for a in self.attention}
        (s0, s1, ws), (h0, h1, wh) = (_between(sorted({k[i] for k in rates}), x) for i, x in ((0, seq), (1, head_dim)))
        return ((1 - ws) * ((1 - wh) * rates[s0, h0] + wh * rates[s0, h1])
                + ws * ((1 - wh) * rates[s1, h0] + wh * rates[s1, h1]))

    def link(self, name: str, kind: str, size: int) -> Link:
        """The link a ``kind`` collective over ``size`` ranks runs on, in the ``name`` link class (``host``,
        ``network`` or ``rack``): the measured kind at the nearest measured group size, else the class's link."""
        if name == "rack":
            if self.rack is None:
                raise ValueError(f"device profile {self.name!r} has no racks (hosts_per_rack and rack)")
            return self.rack
        if name != "host" or kind not in self.collectives or not self.collectives[kind]:
            return self.network if name == "network" else self.host
        sizes = self.collectives[kind]
        nearest = min(sizes, key=lambda k: (abs(int(k) - size), int(k)))
        return sizes[nearest]

    def flops(self, dtype: str) -> float:
        """The peak matmul throughput for ``dtype``; ``ValueError`` names the dtypes the profile has. ``tf32`` (fp32
        matmuls where the user's code allows TF32) is fp32's where the profile has no TF32 rate (a CPU's, a
        calibration's: ``vemesh calibrate`` does not measure it), and on a GPU's profile without ``fp16``, fp16 is
        bf16's (their tensor cores' rates are one on every NVIDIA GPU since Ampere)."""
        if dtype == "tf32" and dtype not in self.matmul_flops:
            dtype = "fp32"
        if dtype == "fp16" and dtype not in self.matmul_flops and self.queued:
            dtype = "bf16"
        if dtype not in self.matmul_flops:
            raise ValueError(f"device profile {self.name!r} has no matmul throughput for {dtype}; it has "
                             f"{', '.join(sorted(self.matmul_flops))}")
        return self.matmul_flops[dtype]  # type: ignore[index]

def _between(points: list[int], x: float) -> tuple[int, int, float]:
    """The grid points either side of ``x`` and ``x``'s weight toward the upper one, in logarithms (held at the
    edges)."""
    x = min(max(x, points[0]), points[-1])
    upper = next((p for p in points if p >= x), points[-1])
    lower = max((p for p in points if p <= x), default=points[0])
    if upper == lower:
        return lower, upper, 0.0
    return lower, upper, (math.log(x) - math.log(lower)) / (math.log(upper) - math.log(lower))


def load_profile(ref: str | Path | DeviceProfile) -> DeviceProfile:
    """A built-in profile by name, or one from a JSON file; one-line ``ValueError`` naming a bad name or field."""
    if isinstance(ref, DeviceProfile):
        return ref
    text = str(ref)
    path = _HERE / f"{text}.json" if text in BUILT_IN else Path(text)
    if not path.is_file():
        raise ValueError(f"unknown device profile {text!r}: give a built-in name ({', '.join(BUILT_IN)}) or a JSON "
                         "file, such as one `vemesh calibrate --output FILE` wrote")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"device profile {text}: not a readable JSON file ({e})") from None
    try:
        return DeviceProfile.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        if first["type"] == "missing":
            raise ValueError(f"device profile {text}: field {where!r} is missing (a profile needs "
                             f"{', '.join(f for f, v in DeviceProfile.model_fields.items() if v.is_required())})") from None
        got = first.get("input")
        raise ValueError(f"device profile {text}: {where} {first['msg'].lower()}; got {got!r}") from None

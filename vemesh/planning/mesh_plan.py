"""Plan a mesh from parallel degrees: fill in the one missing degree, validate, say what to paste.

Pure, like :mod:`vemesh.layout`: no process group, no torch.

>>> plan = plan_mesh(64, devices_per_host=8, tp=8, pp=2)
>>> plan.degrees
{'PP': 2, 'DP': 4, 'CP': 1, 'TP': 8}
>>> plan.init_call()
'VESCALE_DEVICE_MESH.init_device_mesh("cuda", (2, 4, 8), mesh_dim_names=("PP", "DP", "TP"))'

Dims run outermost to innermost ``PP, DP, CP, TP`` (torchtitan's order): TP
innermost puts each TP group on consecutive ranks, so on one host when TP
divides the devices per host, and CP next keeps CP x TP together as far as it
fits. Dims of size 1 are left out of the mesh: vemesh answers for an absent
standard strategy as size 1 (``get_strategy_size("CP") == 1``), and torch then
builds no process group for it. EP (expert parallelism) reuses the DP x CP ranks,
as in torchtitan, so it does not change the product: ``ep`` must divide DP x CP,
and the plan splits DP x CP into ``(EDP, EP)``, a second factorization of those ranks.

The plan's :attr:`MeshPlan.layout` is built by the same ``split`` and ``flatten`` of
:class:`~vemesh.layout.MeshLayout` that the pasted lines run on the live mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from vemesh.layout.describe import LayoutWarning, check_layout
from vemesh.layout.mesh_layout import MeshLayout
from vemesh.layout.spec import MeshSpec

__all__ = ["AUTO", "PLAN_ORDER", "MeshPlan", "plan_mesh"]

#: The dims a plan can hold, outermost first.
PLAN_ORDER: tuple[str, ...] = ("PP", "DP", "CP", "TP")

#: A degree to fill in from the world size (``-1`` means the same).
AUTO = "auto"


@dataclass(frozen=True)
class MeshPlan:
    """A validated plan: the degree of every dim in :data:`PLAN_ORDER`, and the mesh they make."""

    world_size: int
    degrees: dict[str, int]
    filled: str | None  # the degree computed from the world size, if any
    device_type: str
    devices_per_host: int | None
    layout: MeshLayout  # the mesh after the pasted split and flatten lines, with every name
    base: MeshLayout  # the mesh that init_device_mesh builds
    warnings: list[LayoutWarning] = field(default_factory=list)
    ep: int = 1  # expert-parallel degree, carved out of the DP x CP ranks
    calls: tuple[str, ...] = ()  # the split and flatten lines to paste after init_call, in order

    @property
    def flattens(self) -> dict[str, tuple[str, ...]]:
        """Every merged name of the plan and the dims it merges: ``{"DP": ("dp_replicate", "dp_shard")}``."""
        return {n: self.layout.named(n).parts for n in self.layout.names if not self.layout.named(n).is_atom}

    def flatten_calls(self) -> list[str]:
        """The ``split`` and ``flatten`` lines to paste after :meth:`init_call`."""
        return list(self.calls)

    def product(self) -> str:
        """The degrees as arithmetic: ``"PP 2 x DP 4 x CP 1 x TP 8"``."""
        return " x ".join(f"{n} {d}" for n, d in self.degrees.items())

    def init_call(self) -> str:
        """The one line to paste into a training script (after ``from vemesh import VESCALE_DEVICE_MESH``)."""
        shape = ", ".join(map(str, self.base.shape)) + ("," if self.base.ndim == 1 else "")
        names = ", ".join(f'"{n}"' for n in self.base.dim_names) + ("," if self.base.ndim == 1 else "")
        return f'VESCALE_DEVICE_MESH.init_device_mesh("{self.device_type}", ({shape}), mesh_dim_names=({names}))'


def plan_mesh(
    world_size: int,
    *,
    pp: int | str = 1,
    dp: int | str | None = None,
    cp: int | str = 1,
    tp: int | str = 1,
    ep: int = 1,
    dp_replicate: int = 1,
    devices_per_host: int | None = None,
    device_type: str = "cuda",
) -> MeshPlan:
    """Fill in the one missing degree, check the product, and lay out the mesh.

    Args:
        world_size: total number of ranks.
        pp, dp, cp, tp: degree of each parallelism; at most one may be ``"auto"``
            (or ``-1``) to be computed. ``dp=None`` means ``"auto"`` when no other
            degree is, and 1 otherwise.
        ep: expert-parallel degree; it reuses the DP x CP ranks, so it must divide DP x CP.
        dp_replicate: split DP into ``(dp_replicate, dp_shard)`` for HSDP (torchtitan's layout): FSDP2
            shards over ``dp_shard`` (times CP) and replicates over ``dp_replicate``; ``DP`` keeps
            answering as the two. The plan then also lists the flattens to make: ``dp_shard_cp``
            and ``dp_cp`` with CP.
        devices_per_host: ranks per host, for the host checks of :func:`check_layout`.
        device_type: written into :meth:`MeshPlan.init_call`.

    Raises:
        ValueError: a degree or size that is not a positive integer, two degrees to
            fill in, or degrees whose product does not divide (or equal) the world size.
            The message names the product and the world size.

    ``plan_mesh(64, tp=8, pp=2)`` gives DP 4 and mesh ``(PP=2, DP=4, TP=8)``;
    ``plan_mesh(64, tp=8, pp=3)`` raises, since PP 3 x CP 1 x TP 8 = 24 does not divide 64.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"the world size must be a positive integer; got {world_size!r}")
    given = {"PP": pp, "DP": dp, "CP": cp, "TP": tp}
    auto = [n for n, d in given.items() if d == AUTO or d == -1]
    if len(auto) > 1:
        raise ValueError(f"only one degree can be filled in; got 'auto' for {', '.join(auto)}")
    if dp is None:
        given["DP"] = AUTO if not auto else 1
        auto = auto or ["DP"]
    for name, degree in given.items():
        if name not in auto and (not isinstance(degree, int) or isinstance(degree, bool) or degree < 1):
            raise ValueError(f"the {name} degree must be a positive integer or 'auto'; got {degree!r}")
    filled = auto[0] if auto else None
    known = {n: int(d) for n, d in given.items() if n != filled}  # type: ignore[call-overload]
    product = math.prod(known.values())
    expr = " x ".join(f"{n} {d}" for n, d in known.items())
    if filled is not None:
        if world_size % product:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            shown = ", ".join(map(str, divisors)) if len(divisors) <= 16 else f"{len(divisors)} of them"
            raise ValueError(
                f"cannot fill in {filled}: {expr} = {product} does not divide the world size {world_size} "
                f"(the product of the other degrees must be one of its divisors: {shown})"
            )
        degrees = {n: (world_size // product if n == filled else known[n]) for n in PLAN_ORDER}
    elif product != world_size:
        raise ValueError(
            f"{expr} = {product} but the world size is {world_size}; the product of the degrees "
            f"must equal the world size (set one degree to 'auto' to fill it in)"
        )
    else:
        degrees = dict(known)
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"the EP degree must be a positive integer; got {ep!r}")
    if (degrees["DP"] * degrees["CP"]) % ep:
        raise ValueError(
            f"EP {ep} must divide DP x CP = {degrees['DP']} x {degrees['CP']} = {degrees['DP'] * degrees['CP']}: "
            "expert parallelism reuses the data- and context-parallel ranks"
        )
    if not isinstance(dp_replicate, int) or isinstance(dp_replicate, bool) or dp_replicate < 1:
        raise ValueError(f"the dp_replicate degree must be a positive integer; got {dp_replicate!r}")
    if degrees["DP"] % dp_replicate:
        raise ValueError(f"dp_replicate {dp_replicate} must divide DP {degrees['DP']} (DP splits into dp_replicate x dp_shard)")
    names = tuple(n for n in PLAN_ORDER if degrees[n] > 1) or ("DP",)
    spec = MeshSpec(device_type=device_type, mesh_shape=tuple(degrees[n] for n in names), mesh_dim_names=names)
    base = spec.resolve(world_size)
    layout, calls = base, []

    def step(method: str, *args: Any) -> None:
        nonlocal layout
        layout = getattr(layout, method)(*args)
        calls.append(f"VESCALE_DEVICE_MESH.{method}({', '.join(_literal(a) for a in args)})")

    if dp_replicate > 1:
        step("split", "DP", ("dp_replicate", "dp_shard"), (dp_replicate, degrees["DP"] // dp_replicate))
        if degrees["CP"] > 1 and degrees["DP"] > dp_replicate:
            step("flatten", ("dp_shard", "CP"), "dp_shard_cp")
            step("flatten", ("dp_replicate", "dp_shard_cp"), "dp_cp")
    if degrees["CP"] > 1 and degrees["DP"] > 1 and not layout.has("dp_cp"):  # gradients average over DP x CP
        step("flatten", ("DP", "CP"), "dp_cp")
    if ep > 1:
        if degrees["CP"] > 1 and not layout.has("dp_cp"):
            step("flatten", ("CP",), "dp_cp")
        folded = "dp_cp" if degrees["CP"] > 1 else "DP"
        if layout.named(folded).is_atom:  # a mesh dim: flatten it under its own name for a second factorization
            step("flatten", (folded,), "dp_ep")
            folded = "dp_ep"
        step("split", folded, ("EDP", "EP"), (degrees["DP"] * degrees["CP"] // ep, ep))
    return MeshPlan(
        world_size=world_size,
        degrees=degrees,
        filled=filled,
        device_type=spec.device_type,
        devices_per_host=devices_per_host,
        layout=layout,
        base=base,
        warnings=check_layout(layout, devices_per_host),
        ep=ep,
        calls=tuple(calls),
    )


def _literal(value: Any) -> str:
    """A call argument as Python source with double quotes: ``("dp_shard", "CP")``, ``"DP"``, ``(2, 4)``."""
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_literal, value)) + ("," if len(value) == 1 else "") + ")"
    return f'"{value}"' if isinstance(value, str) else repr(value)

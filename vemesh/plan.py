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
as in torchtitan, so it does not change the product: ``ep`` must divide DP x CP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .describe import LayoutWarning, check_layout
from .layout import MeshLayout
from .spec import MeshSpec

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
    layout: MeshLayout
    warnings: list[LayoutWarning] = field(default_factory=list)
    ep: int = 1  # expert-parallel degree, carved out of the DP x CP ranks
    #: flattened dims to create after init (name -> dims, by name), with DP split for HSDP
    flattens: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def flatten_calls(self) -> list[str]:
        """The ``flatten`` lines to paste after :meth:`init_call`."""
        return [f'VESCALE_DEVICE_MESH.flatten(({", ".join(repr(d) for d in dims)}), {name!r})'.replace("'", '"')
                for name, dims in self.flattens.items()]

    def product(self) -> str:
        """The degrees as arithmetic: ``"PP 2 x DP 4 x CP 1 x TP 8"``."""
        return " x ".join(f"{n} {d}" for n, d in self.degrees.items())

    def init_call(self) -> str:
        """The one line to paste into a training script (after ``from vemesh import VESCALE_DEVICE_MESH``)."""
        shape = ", ".join(map(str, self.layout.shape)) + ("," if self.layout.ndim == 1 else "")
        names = ", ".join(f'"{n}"' for n in self.layout.dim_names) + ("," if self.layout.ndim == 1 else "")
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
            shards over ``dp_shard`` (times CP) and replicates over ``dp_replicate``. The plan then
            also lists the flattens to make: ``DP`` back, ``dp_shard_cp`` and ``dp_cp`` with CP.
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
    sizes = dict(degrees)
    flattens: dict[str, tuple[str, ...]] = {}
    order = PLAN_ORDER
    if dp_replicate > 1:
        sizes.pop("DP")
        sizes["dp_replicate"], sizes["dp_shard"] = dp_replicate, degrees["DP"] // dp_replicate
        order = ("PP", "dp_replicate", "dp_shard", "CP", "TP")
        present = [n for n in ("dp_replicate", "dp_shard") if sizes[n] > 1]
        if len(present) == 2:
            flattens["DP"] = ("dp_replicate", "dp_shard")
        if degrees["CP"] > 1 and sizes["dp_shard"] > 1:
            flattens["dp_shard_cp"] = ("dp_shard", "CP")
            flattens["dp_cp"] = ("dp_replicate", "dp_shard_cp")
    names = tuple(n for n in order if sizes[n] > 1) or ("DP",)
    spec = MeshSpec(device_type=device_type, mesh_shape=tuple(sizes.get(n, 1) for n in names), mesh_dim_names=names)
    layout = spec.resolve(world_size)
    return MeshPlan(
        world_size=world_size,
        degrees=degrees,
        filled=filled,
        device_type=spec.device_type,
        devices_per_host=devices_per_host,
        layout=layout,
        warnings=check_layout(layout, devices_per_host),
        ep=ep,
        flattens=flattens,
    )

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

from dataclasses import dataclass, field

from vemesh.layout.describe import LayoutWarning, check_layout
from vemesh.layout.mesh_layout import MeshLayout
from vemesh.layout.names import fill_sizes
from vemesh.layout.parallel_dims import DEGREES, ParallelDims, check_replicate
from vemesh.layout.spec import MeshSpec

__all__ = ["AUTO", "PLAN_ORDER", "MeshPlan", "plan_mesh"]

#: The dims a plan can hold, outermost first.
PLAN_ORDER: tuple[str, ...] = DEGREES

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
    dims: ParallelDims | None = None  # the degrees and the rule that derived every dim

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
    order: tuple[str, ...] | None = None,
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
            answering as the two.
        devices_per_host: ranks per host, for the host checks of :func:`check_layout`.
        device_type: written into :meth:`MeshPlan.init_call`.
        order: the mesh dims outermost first, a placement (:mod:`vemesh.planning.placement`); default
            ``PP, DP, CP, TP``, the dims of degree > 1.

    The mesh and every derived dim (``dp_cp``, the HSDP split, ``(EDP, EP)``) come from
    :class:`~vemesh.layout.parallel_dims.ParallelDims`, as in a training script that builds them.

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
    if dp is None:  # DP takes the rest, unless another degree does
        given["DP"] = 1 if any(d == AUTO or d == -1 for d in given.values()) else AUTO
    sizes = [-1 if d == AUTO else d for d in given.values()]
    auto = [n for n, d in zip(given, fill_sizes(sizes, None, names=list(given), fill="'auto'")) if d == -1]
    degrees = dict(zip(given, fill_sizes(sizes, world_size, names=list(given), fill="'auto'")))
    if not isinstance(dp_replicate, int) or isinstance(dp_replicate, bool) or dp_replicate < 1:
        raise ValueError(f"the dp_replicate degree must be a positive integer; got {dp_replicate!r}")
    check_replicate(degrees["DP"], dp_replicate)
    dims = ParallelDims(world_size, pp=degrees["PP"], dp_replicate=dp_replicate, dp_shard=degrees["DP"] // dp_replicate,
                        cp=degrees["CP"], tp=degrees["TP"], ep=ep, mesh_dims=order)
    base = MeshSpec(device_type=device_type, mesh_shape=dims.mesh_shape, mesh_dim_names=dims.mesh_dims).resolve(world_size)
    layout = dims.layout()
    return MeshPlan(
        world_size=world_size,
        degrees=dims.degrees,
        filled=auto[0] if auto else None,
        device_type=MeshSpec(device_type=device_type, mesh_shape=(1,)).device_type,
        devices_per_host=devices_per_host,
        layout=layout,
        base=base,
        warnings=check_layout(layout, devices_per_host),
        ep=dims.ep,
        calls=tuple(dims.calls()),
        dims=dims,
    )

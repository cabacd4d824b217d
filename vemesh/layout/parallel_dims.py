"""The one rule for every dim a job derives from its degrees (torchtitan's ``ParallelDims``, on vemesh's layout).

Pure: :class:`ParallelDims` computes the mesh, every derived name and the calls that make them with no
process group; :meth:`ParallelDims.build` runs the same calls on the live ``VESCALE_DEVICE_MESH``. The
example, ``vemesh plan`` and ``vemesh show`` ask it; none of them derives a dim on its own.

The degrees are ``pp, dp_replicate, dp_shard, cp, tp`` (their product is the world) and ``ep``, which
reuses the data ranks. ``dp = dp_replicate x dp_shard``. From them, in this order:

1. **the mesh**: dims ``PP, DP, CP, TP``, outermost first (torchtitan's order), or the order ``mesh_dims``
   gives (a placement); a dim of size 1 is left out unless ``mesh_dims`` names it (a world of one keeps ``DP``).
   A flatten lists its dims in the mesh's order, as torch's ``_flatten`` needs, so nothing sorts ranks back;
2. **HSDP** (``dp_replicate > 1``): ``DP`` is split into ``(dp_replicate, dp_shard)``; ``DP`` keeps
   answering as both;
3. **dp_shard_cp** (``dp_replicate > 1`` and ``cp > 1``): ``dp_shard x CP``, where FSDP2 shards under HSDP;
4. **dp_cp** (``cp > 1``): every rank holding a different part of the batch, ``DP x CP`` (``CP`` alone
   when the mesh has no DP): CP ranks hold other tokens of the same sequences;
5. **EDP x EP** (``ep > 1``): a second factorization of the data ranks (``dp_cp``, or ``DP``; a ``DP``
   mesh dim is first flattened as ``dp_ep``), EP innermost as in Megatron's expert groups. An EP rank
   holds ``1/EP`` of the experts and receives its tokens from its EP peers; expert gradients average
   over EDP, the ranks holding the same experts.

What the wrappers ask for:

* :attr:`~ParallelDims.grad_dim` (also the loss's): ``dp_cp`` with DP and CP, else the one data dim; None
  without either (these three are :func:`vemesh.layout.data_dims.data_dims`'s answers on :meth:`~ParallelDims.layout`);
* :attr:`~ParallelDims.fsdp_dims`: ``(dp_replicate, dp_shard_cp)`` (``dp_shard`` without CP) under HSDP,
  else ``(grad_dim,)``;
* :attr:`~ParallelDims.expert_dims`: ``("EDP", "EP")``, or ``()`` without EP.

On 16 ranks, ``ParallelDims(16, cp=2, tp=2, ep=2)`` fills ``dp_shard = 4``; rank 5 (``DP=1, CP=0, TP=1``)
averages dense gradients over ``dp_cp`` ``[1, 3, 5, 7, 9, 11, 13, 15]``, holds the experts of EP group
``[5, 7]`` and averages them over EDP ``[1, 5, 9, 13]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from vemesh.layout.data_dims import DataDims, data_dims
from vemesh.layout.mesh_layout import MeshLayout
from vemesh.layout.names import divisors, fill_sizes, listed

__all__ = ["DEGREES", "ParallelDims"]

#: The mesh dims a job can have, outermost first.
DEGREES: tuple[str, ...] = ("PP", "DP", "CP", "TP")


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the {name} degree must be a positive integer; got {value!r}")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """A job's degrees, validated, and every dim they derive (see the module docstring for the rule).

    Args:
        world_size: the number of ranks.
        pp, dp_shard, cp, tp: degrees; one of them may be -1, filled in from the world size
            (``dp_shard`` is -1 unless given).
        dp_replicate: HSDP's replica degree (1: no HSDP). ``DP = dp_replicate x dp_shard``.
        ep: the expert-parallel degree; it must divide ``DP x CP``.
        mesh_dims: the dims ``init_device_mesh`` makes, outermost first: some of ``PP, DP, CP, TP`` in any order
            (the placement of the dims on the hosts, :mod:`vemesh.planning.placement`); the degree of every dim left
            out must be 1. Default: the dims of degree > 1, in the order ``PP, DP, CP, TP``.

    Raises:
        ValueError: a degree that is not a positive integer, two -1s, a product that is not the world
            size, an EP that does not divide DP x CP, a dp_replicate that does not divide DP.
    """

    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    mesh_dims: tuple[str, ...] | None = None
    steps: tuple[tuple[str, tuple[Any, ...]], ...] = field(init=False, repr=False, compare=False)

    def __new__(cls, *args: Any, **kwargs: Any) -> ParallelDims:
        """A keyword that names no degree is a ``TypeError`` naming it and the valid ones (``dp=2``, as ``vemesh
        plan --dp`` reads, gets where DP goes)."""
        valid = [f.name for f in fields(cls) if f.init]
        unknown = [k for k in kwargs if k not in valid]
        if unknown:
            dp = next((kwargs[k] for k in unknown if k.lower() == "dp"), None)
            hint = (f"; the DP degree is dp_shard (dp_replicate x dp_shard with HSDP): pass dp_shard={dp!r}"
                    if dp is not None else "")
            raise TypeError(f"ParallelDims got {', '.join(map(repr, unknown))}, which name{'s' if len(unknown) == 1 else ''} no degree; the valid "
                            f"keywords are {', '.join(valid)}{hint}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"the world size must be a positive integer; got {self.world_size!r}")
        replicate, ep = _positive("dp_replicate", self.dp_replicate), _positive("EP", self.ep)
        shard = "DP" if replicate == 1 else "dp_shard"  # DP = dp_replicate x dp_shard: the user's DP when no HSDP
        names, given = ("PP", shard, "CP", "TP"), (self.pp, self.dp_shard, self.cp, self.tp)
        if replicate > 1:
            names, given = (*names, "dp_replicate"), (*given, replicate)
        sizes = fill_sizes(given, self.world_size, names=names)
        pp, dp_shard, cp, tp = sizes[:4]
        for attr, value in (("pp", pp), ("dp_shard", dp_shard), ("cp", cp), ("tp", tp)):
            object.__setattr__(self, attr, value)
        if (self.dp * cp) % ep:
            raise ValueError(f"EP {ep} must divide DP x CP = {self.dp} x {cp} = {self.dp * cp}: expert parallelism "
                             f"reuses the data- and context-parallel ranks; choose EP from {listed(divisors(self.dp * cp), 64)}")
        object.__setattr__(self, "mesh_dims", self._check_mesh_dims())
        object.__setattr__(self, "steps", self._steps())

    def _check_mesh_dims(self) -> tuple[str, ...]:
        degrees = self.degrees
        if self.mesh_dims is None:
            return tuple(n for n in DEGREES if degrees[n] > 1) or ("DP",)
        names = tuple(self.mesh_dims)
        if len(set(names)) != len(names) or any(n not in DEGREES for n in names):
            raise ValueError(f"mesh_dims {names} must be distinct names among {DEGREES} (in any order: the placement "
                             "of the dims on the hosts)")
        dropped = [f"{n}={d}" for n, d in degrees.items() if d > 1 and n not in names]
        if dropped:
            raise ValueError(f"mesh_dims {names} leaves out {', '.join(dropped)}: a dim of degree > 1 must be a mesh dim")
        return names

    # ------------------------------------------------------------------ degrees
    @property
    def dp(self) -> int:
        """The data-parallel degree: ``dp_replicate x dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def degrees(self) -> dict[str, int]:
        """``{"PP": .., "DP": .., "CP": .., "TP": ..}``, outermost first."""
        return {"PP": self.pp, "DP": self.dp, "CP": self.cp, "TP": self.tp}

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """What ``init_device_mesh`` gets, with :attr:`mesh_dims` as the names."""
        return tuple(self.degrees[n] for n in self.mesh_dims)  # type: ignore[union-attr]

    # ---------------------------------------------------------------- derived
    def _steps(self) -> tuple[tuple[str, tuple[Any, ...]], ...]:
        """The ``split`` and ``flatten`` calls, in order, that make every derived dim (see the module docstring)."""
        steps: list[tuple[str, tuple[Any, ...]]] = []
        hsdp = self.dp_replicate > 1
        position = {n: i for i, n in enumerate(self.mesh_dims)}  # type: ignore[arg-type]

        def in_mesh_order(*names: str) -> tuple[str, ...]:  # a flatten lists its dims in the mesh's order, as torch's
            return tuple(sorted(names, key=lambda n: position["DP" if n.startswith("dp_") else n]))

        if hsdp:
            steps.append(("split", ("DP", ("dp_replicate", "dp_shard"), (self.dp_replicate, self.dp_shard))))
            if self.cp > 1:
                steps.append(("flatten", (in_mesh_order("dp_shard", "CP"), "dp_shard_cp")))
        data = ("dp_replicate", "dp_shard") if hsdp else ("DP",) if "DP" in self.mesh_dims else ()  # type: ignore[operator]
        if self.cp > 1:
            steps.append(("flatten", (in_mesh_order(*data, "CP"), "dp_cp")))
        if self.ep > 1:
            folded = "dp_cp" if self.cp > 1 else "DP"
            if folded == "DP" and not hsdp:  # a mesh dim: flattened under another name, for a second factorization
                steps.append(("flatten", (("DP",), "dp_ep")))
                folded = "dp_ep"
            steps.append(("split", (folded, ("EDP", "EP"), (self.dp * self.cp // self.ep, self.ep))))
        return tuple(steps)

    @property
    def data(self) -> DataDims:
        """The one data-dims rule (:func:`vemesh.layout.data_dims.data_dims`) on this job's layout."""
        return data_dims(self.layout())

    @property
    def grad_dim(self) -> str | None:
        """The dim dense gradients (and the loss) average over: ``dp_cp`` with DP and CP, the one data dim
        otherwise (``DP``, or ``CP`` at DP 1); None without either. Asked of :func:`~vemesh.layout.data_dims.data_dims`."""
        return self.data.grad

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """The dims FSDP2 shards over: ``(dp_replicate, dp_shard_cp | dp_shard)`` under HSDP, else ``(grad_dim,)``."""
        return self.data.fsdp

    @property
    def expert_dims(self) -> tuple[str, ...]:
        """``("EDP", "EP")`` with expert parallelism, else ``()``."""
        return self.data.expert

    def layout(self, first_rank: int = 0) -> MeshLayout:
        """The mesh with every derived name, as pure arithmetic (the same calls :meth:`build` runs)."""
        layout = MeshLayout(self.mesh_shape, self.mesh_dims, first_rank=first_rank)  # type: ignore[arg-type]
        for method, args in self.steps:
            layout = getattr(layout, method)(*args)
        return layout

    def calls(self, mesh: str = "VESCALE_DEVICE_MESH") -> list[str]:
        """The ``split`` and ``flatten`` lines to paste after ``init_device_mesh``, as Python source."""
        return [f"{mesh}.{method}({', '.join(_literal(a) for a in args)})" for method, args in self.steps]

    def init_call(self, device_type: str = "cuda", mesh: str = "VESCALE_DEVICE_MESH") -> str:
        """The ``init_device_mesh`` line for this job."""
        comma = "," if len(self.mesh_dims) == 1 else ""  # type: ignore[arg-type]
        return (f'{mesh}.init_device_mesh("{device_type}", ({", ".join(map(str, self.mesh_shape))}{comma}), '
                f'mesh_dim_names=({", ".join(_literal(n) for n in self.mesh_dims)}{comma}))')  # type: ignore[union-attr]

    # --------------------------------------------------------------- live mesh
    def build(self, device_type: str = "cuda", mesh: Any = None, **init_kwargs: Any) -> Any:
        """``init_device_mesh`` with this job's dims, then every derived dim, on ``mesh`` (``VESCALE_DEVICE_MESH``).

        Every rank must call it (it creates process groups). ``init_kwargs`` go to ``init_device_mesh``
        (``timeout=``, ``backend_override=``). Returns the mesh manager.
        """
        if mesh is None:
            from vemesh.mesh import VESCALE_DEVICE_MESH as mesh  # the layout is pure: the live mesh (torch.distributed) only when build() runs
        mesh.init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dims, **init_kwargs)
        for method, args in self.steps:
            getattr(mesh, method)(*args)
        return mesh

    @classmethod
    def of(cls, layout: MeshLayout, *, dp_replicate: int = 1, ep: int = 1) -> ParallelDims:
        """The degrees of an initialized mesh whose dims are among ``PP, DP, CP, TP`` (in any order)."""
        unknown = [n for n in layout.dim_names if n not in DEGREES]
        if unknown:
            raise ValueError(f"the mesh's dims {layout.dim_names} must be among {DEGREES} to derive the others; "
                             f"{unknown} are not")
        sizes = dict(zip(layout.dim_names, layout.shape))
        dp = sizes.get("DP", 1)
        check_replicate(dp, dp_replicate)
        return cls(layout.world_size, pp=sizes.get("PP", 1), dp_replicate=dp_replicate, dp_shard=dp // dp_replicate,
                   cp=sizes.get("CP", 1), tp=sizes.get("TP", 1), ep=ep, mesh_dims=layout.dim_names)


def _literal(value: Any) -> str:
    """A call argument as Python source with double quotes: ``("dp_shard", "CP")``, ``"DP"``, ``(2, 4)``."""
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_literal, value)) + ("," if len(value) == 1 else "") + ")"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def check_replicate(dp: int, dp_replicate: int) -> None:
    """``ValueError`` naming the choices unless ``dp_replicate`` divides ``dp`` (HSDP splits DP in two)."""
    if dp % dp_replicate:
        raise ValueError(f"dp_replicate {dp_replicate} must divide DP {dp} (DP splits into dp_replicate x dp_shard); "
                         f"choose it from {listed(divisors(dp), 64)}")

"""Live fault tolerance: a replica dim kept by torchft, so training goes on when a replica fails.

Each *replica* is its own job (one ``torchrun``) holding an ordinary mesh of the inner dims
(``DP``, ``TP``, ``CP``). The replicas together form one more dim, outside every job's world,
whose membership can change from one step to the next. torchft is the engine: its Lighthouse
forms a quorum of the live replicas each step, its ``Manager`` reconfigures the process group
that joins the same inner rank of every replica, and a replica that comes back heals from a live
peer over the network. vemesh names that dim (reserving the name on the mesh, which refuses every
query of it: the replicas answer) and makes the wrappers use it::

    from vemesh.resilience.replicas import start_replicas

    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (1, 2), mesh_dim_names=("DP", "TP"))
    replicas = start_replicas(replica_id=0, lighthouse="http://lighthouse-host:29510")   # "dp_replicate"
    model = DistributedDataParallel(model, VESCALE_DEVICE_MESH["DP"], replicas=replicas)
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], lr=3e-4)
    replicas.track(model, opt)                              # what a returning replica heals from
    while replicas.step < steps:
        opt.zero_grad()                                     # this step's quorum (and healing, if behind)
        n = replicas.size()                                 # replicas taking part now
        i = replicas.index()                                # this replica's index among them
        loss_fn(model(rows_of(batch, i, n)), ...).backward()       # mean over DP, then over the replicas
        opt.step()                                          # commits only if every replica's reduce succeeded

The quorum is synchronous (torchft's ``use_async_quorum=False``): it is known before the data is
chosen, and a healed replica takes part in the very step it healed in. Between a commit and the
next quorum, ``size()``/``index()`` raise instead of answering from a quorum that may no longer hold.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vemesh.mesh.manager import VESCALE_DEVICE_MESH
from vemesh.parallel.ddp.grad_buffer import local_tensor
from vemesh.resilience.join import join_refusal

__all__ = ["INSTALL_HINT", "QuorumChange", "ReplicaError", "Replicas", "import_torchft", "start_replicas"]

INSTALL_HINT = "pip install \"vemesh[ft]\" (torchft, with its lighthouse binary torchft_lighthouse; from a checkout: pip install -e \".[ft]\")"


def import_torchft() -> Any:
    """The ``torchft`` module, or ``ImportError`` saying how to install it."""
    try:
        import torchft
        import torchft.process_group  # noqa: F401
    except ImportError as e:
        raise ImportError(f"live fault tolerance needs torchft, which is not installed here: {INSTALL_HINT}") from e
    return torchft


class ReplicaError(RuntimeError):
    """The replicas cannot go on: no lighthouse, no quorum within the timeout, a failed heal."""


@dataclass(frozen=True)
class QuorumChange:
    """One change of the replicas taking part, as rank 0 of a replica prints it."""

    step: int  #: the step the new quorum runs
    before: tuple[int, ...]  #: replica ids of the last quorum (empty at start)
    after: tuple[int, ...]  #: replica ids of this one
    healed_from: int | None  #: the replica this one took its state from, if it healed
    seconds_lost: float | None  #: since this replica's last committed step (None before the first)

    def __str__(self) -> str:
        heal = f"; healed from replica {self.healed_from}" if self.healed_from is not None else ""
        lost = f"; {self.seconds_lost:.2f}s since the last committed step" if self.seconds_lost is not None else ""
        return (f"quorum change at step {self.step}: replicas {list(self.before)} -> {list(self.after)} "
                f"({len(self.after)} taking part){heal}{lost}")


def _recording(cls: type) -> type:
    """``cls`` (a torchft reconfigurable process group) that remembers each configuration it is given."""

    def configure(self: Any, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: Any = None,
                  group_rank: Any = None, group_world_size: Any = None, global_ranks: Any = None) -> None:
        per = group_world_size or 1
        members = tuple(sorted(g // per for g in global_ranks)) if global_ranks else ()
        self.vemesh_quorum = (quorum_id, members)
        cls.configure(self, store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks)

    return type(f"Recording{cls.__name__}", (cls,), {"configure": configure, "vemesh_quorum": (None, ())})


class Replicas:
    """The fault-tolerant replica dim: a torchft ``Manager`` behind one mesh name.

    Build it with :func:`start_replicas` (or from your own ``Manager``, built with
    ``use_async_quorum=False`` over a process group from :func:`start_replicas`'s recipe).

    Args:
        manager: torchft's ``Manager`` of this replica group.
        replica_id: this replica's number (torchft's replica id is its decimal string).
        name: the dim's name, reserved on ``mesh``.
        admits: see :func:`start_replicas`.
        mesh: the mesh of this replica's inner dims (a :class:`~vemesh.mesh.manager.VeDeviceMesh`, initialized), on
            which ``name`` is reserved: the replicas answer for it (:meth:`size`, :meth:`index`, :attr:`group`), and
            the mesh refuses every query of it. None: no mesh is told.
    """

    def __init__(self, manager: Any, replica_id: int, name: str = "dp_replicate",
                 admits: Callable[[int], str | None] | None = None, mesh: Any = None) -> None:
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("the torchft Manager must be built with use_async_quorum=False: the quorum decides "
                             "which rows of the global batch this replica takes, so it must be known before the data")
        self.manager = manager
        self.replica_id = int(replica_id)
        self.name = name
        #: The mesh whose ``name`` these replicas hold (None if none was given).
        self.mesh = mesh
        #: The TCPStore :func:`start_replicas` started for a job of one process (torchrun's otherwise), else None.
        self.store: Any = None
        if mesh is not None:
            mesh.reserve(name)
        self._fresh = False  # a quorum for the step in flight is known
        #: torchft's vote on the step in flight: None before :meth:`should_commit`, then True or False.
        self.vote: bool | None = None
        self._seen: tuple[int, ...] = ()
        self._healed_from: int | None = None
        self._last_commit: float | None = None
        self._group: Any = None
        #: The change the last :meth:`start_step` brought, else None (rank 0 prints it).
        self.change: QuorumChange | None = None
        self._admits = admits
        #: Why this step's quorum cannot run (a replica id twice, a count ``admits`` refuses), else None: the step
        #: is voted down, and the training loop skips its compute and retries with the next quorum.
        self.refused: str | None = None

    # ------------------------------------------------------------- the step
    @property
    def step(self) -> int:
        """Steps committed so far (torchft's ``current_step``; a healed replica takes its peer's)."""
        return self.manager.current_step()

    def start_step(self) -> None:
        """Wait for this step's quorum, heal from a live peer if this replica is behind, and note any change.

        :meth:`vemesh.optim.DistributedOptimizer.zero_grad` calls it. Raises ``RuntimeError`` (with
        torchft's reason) when no quorum forms within the quorum timeout, e.g. the lighthouse is gone
        or fewer than ``min_replicas`` replicas are alive.
        """
        self._healed_from, self.vote = None, None
        try:
            with warnings.catch_warnings():  # torchft's transport loads tensors from a read-only buffer
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                self.manager.start_quorum()
        except Exception as e:
            raise ReplicaError(
                f"replica {self.replica_id}: the quorum of step {self.step + 1} failed (quorum timeout "
                f"{self.manager._quorum_timeout.total_seconds():g}s, min_replicas={self.manager._min_replica_size}; is "
                f"the lighthouse up, and are enough replicas alive?): {e}"
            ) from e
        self._fresh = True
        members = getattr(self.manager._pg, "vemesh_quorum", (None, ()))[1] or self._seen
        self.refused = self._refusal(members)
        if self.refused is not None:
            if not self._seen:  # the newcomer: it leaves, and the live replicas go on without it
                raise ReplicaError(f"replica {self.replica_id}: leaving the quorum of step {self.step + 1}: {self.refused}")
            self.discard(self.refused)  # a live replica: nothing of this step commits; the next quorum is retried
            self.change = None
            return
        self.change = None
        if members != self._seen or self._healed_from is not None:
            lost = None if self._last_commit is None else time.monotonic() - self._last_commit
            self.change = QuorumChange(self.step + 1, self._seen, members, self._healed_from, lost)
            self._seen = members

    def _refusal(self, members: tuple[int, ...]) -> str | None:
        """Why a step cannot run with this quorum, or None."""
        twice = sorted({m for m in members if members.count(m) > 1})
        if twice:
            return (f"replica id{'s' if len(twice) > 1 else ''} {twice} joined twice (two processes were started with "
                    "the same replica id)")
        reason = self._admits(self.manager.num_participants()) if self._admits is not None else None
        return f"{self.manager.num_participants()} replicas take part and {reason}" if reason else None

    def _check_fresh(self) -> None:
        if not self._fresh:
            raise RuntimeError(
                f"the {self.name!r} dim has no quorum for the next step yet (the last one was used by step "
                f"{self.step}'s commit): call optimizer.zero_grad() (or replicas.start_step()) first"
            )

    def size(self) -> int:
        """Replicas taking part in this step."""
        self._check_fresh()
        return self.manager.num_participants()

    def index(self) -> int:
        """This replica's index among those taking part (0 .. size-1)."""
        self._check_fresh()
        rank = self.manager.participating_rank()
        if rank is None:
            raise RuntimeError(f"replica {self.replica_id} is not taking part in step {self.step + 1} (a spare)")
        return rank

    @property
    def group(self) -> Any:
        """torchft's managed process group over the replicas: its size is the step's participant count, and
        a failed all-reduce is reported to the manager (so the step does not commit) instead of raising."""
        if self._group is None:
            self._group = import_torchft().process_group.ManagedProcessGroup(self.manager)
        return self._group

    def average_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` over the replicas taking part, in place. On failure the tensor holds garbage and
        :meth:`errored` is set: the step will not commit."""
        self._check_fresh()
        if self.manager.errored() is None:
            self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.AVG).wait()
        return tensor

    def errored(self) -> Exception | None:
        """The error that will keep this step from committing (a failed reduce, a lost peer), if any."""
        return self.manager.errored()

    def discard(self, reason: str) -> None:
        """Make this step fail to commit on every rank of this replica (e.g. a non-finite loss)."""
        self.manager.report_error(RuntimeError(reason))

    def should_commit(self) -> bool:
        """torchft's vote: True when every rank of this replica reduced without error with enough replicas.

        Called once per step by the optimizer before it steps; the quorum is spent afterwards.
        """
        self._check_fresh()
        self._fresh = False
        try:
            self.vote = self.manager.should_commit()
        except RuntimeError as e:  # torchft's max_retries: too many steps in a row failed to commit
            reason = self.errored() or f"{self.manager.num_participants()} replicas taking part, fewer than " \
                f"min_replicas={self.manager._min_replica_size}"
            raise ReplicaError(f"replica {self.replica_id}: step {self.step + 1} failed to commit too many times in a "
                               f"row ({str(e).splitlines()[0]}); the last reason: {str(reason).splitlines()[0]}") from e
        if self.vote:
            self._last_commit = time.monotonic()
        return self.vote

    @property
    def in_step(self) -> bool:
        """Whether this step's quorum is known and its commit vote not taken yet."""
        return self._fresh

    # ------------------------------------------------------------- healing
    def track(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Register what a returning replica takes from a live one: ``model``'s and ``optimizer``'s local state.

        Every replica holds the same layout, so each rank sends exactly its own shards (no collective):
        model tensors, and the optimizer's local state (a ZeRO-1 :class:`~vemesh.optim.DistributedOptimizer`
        sends its shard of this replica's DP group).
        """
        module = getattr(model, "module", model)

        def save() -> dict[str, Any]:
            local = getattr(optimizer, "local_state_dict", None)
            return {"from": self.replica_id,
                    "model": {k: local_tensor(v).detach() for k, v in module.state_dict().items()},
                    "optimizer": local() if local is not None else optimizer.state_dict()}

        def load(state: dict[str, Any]) -> None:
            with torch.no_grad():
                for k, v in module.state_dict().items():
                    local_tensor(v).copy_(state["model"][k])
            load_local = getattr(optimizer, "load_local_state_dict", None)
            (load_local or optimizer.load_state_dict)(state["optimizer"])
            self._healed_from = int(state["from"])

        self.manager.register_state_dict_fn("vemesh", load, save)

    def shutdown(self) -> None:
        """Stop torchft's manager server and checkpoint transport."""
        self.manager.shutdown(wait=False)


def start_replicas(
    replica_id: int,
    *,
    lighthouse: str | None = None,
    min_replicas: int = 1,
    name: str = "dp_replicate",
    device_type: str = "cpu",
    timeout: float = 60.0,
    quorum_timeout: float | None = None,
    connect_timeout: float | None = None,
    max_retries: int = 3,
    admits: Callable[[int], str | None] | None = None,
    mesh: Any = None,
) -> Replicas:
    """Join the live replicas through torchft: build its process group and ``Manager`` for this replica.

    Call it on every rank of this replica's job after the mesh exists.

    Args:
        replica_id: this replica's number, distinct per replica (0, 1, ...).
        lighthouse: the lighthouse's address, ``http://host:29510``; defaults to ``TORCHFT_LIGHTHOUSE``.
        min_replicas: the fewest replicas a step may commit with.
        name: the dim's name (``dp_replicate``), reserved on the mesh.
        mesh: the mesh of this replica's inner dims (default: ``VESCALE_DEVICE_MESH``), which must be initialized.
            The replicas answer for ``name`` (:meth:`Replicas.size`, :meth:`Replicas.index`); the mesh refuses it.
        device_type: ``cpu`` (gloo across replicas) or ``cuda`` (nccl).
        timeout: seconds any cross-replica collective, commit vote or healing transfer may take.
        quorum_timeout: seconds to wait for a quorum (default ``timeout``): a replica that never joins,
            or a lighthouse that is gone, ends in ``RuntimeError`` after this long.
        connect_timeout: seconds to reach the lighthouse and the peers (default ``timeout``).
        max_retries: consecutive steps that may fail to commit before ``RuntimeError``.
        admits: given a number of replicas taking part, None if a step can run with that many, else why not
            (the example's: the global batch must split over them). Checked before joining, and on every quorum.

    A replica that cannot take part is turned away at its join, before the live replicas see it: one whose id
    is already heartbeating at the lighthouse (another process started with the same ``replica_id``), or one
    that would make a count ``admits`` refuses. It gets :class:`ReplicaError`; the live replicas go on. If two
    start at the same moment and a quorum forms anyway, the newcomer raises at its first quorum and the live
    replicas vote that step down and retry it (see :meth:`Replicas.start_step`).
    """
    torchft = import_torchft()
    from torchft.manager import Manager

    if isinstance(replica_id, bool) or not isinstance(replica_id, int) or replica_id < 0:
        raise ValueError(f"replica_id must be a non-negative integer, distinct per replica; got {replica_id!r}")
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(f"min_replicas must be a positive integer; got {min_replicas!r}")
    lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse:
        raise ValueError("no torchft lighthouse: pass its address (http://host:29510) or set TORCHFT_LIGHTHOUSE; "
                         "start one with: torchft_lighthouse --min_replicas 1")
    for what, value in (("timeout", timeout), ("quorum_timeout", quorum_timeout), ("connect_timeout", connect_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
                                  or not math.isfinite(value)):
            raise ValueError(f"{what} must be a positive number of seconds; got {value!r}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda'; got {device_type!r}")
    if not dist.is_initialized():
        raise RuntimeError("start_replicas() needs this replica's process group: call "
                           "VESCALE_DEVICE_MESH.init_device_mesh(...) first")
    if admits is not None and not callable(admits):
        raise TypeError(f"admits must be a function of the number of replicas taking part; got {admits!r}")
    refusal = [join_refusal(lighthouse, replica_id, admits, connect_timeout or timeout) if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:  # rank 0 asked the lighthouse; every rank of this replica gets its answer
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise ReplicaError(refusal[0])
    store_addr, store_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    mesh = VESCALE_DEVICE_MESH if mesh is None else mesh
    if not mesh.is_initialized():
        raise RuntimeError("start_replicas: build the mesh of this replica's own ranks first "
                           "(VESCALE_DEVICE_MESH.init_device_mesh(...)); the replicas reserve their dim's name on it")
    mesh.layout.with_managed(name)  # a name the mesh already has raises here, before this replica joins
    store = None
    if store_addr is None or store_port is None:  # a plain `python train.py`: a store of our own
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store_addr, store_port = "127.0.0.1", str(store.port)
    pg_class = torchft.process_group.ProcessGroupGloo if device_type == "cpu" else torchft.process_group.ProcessGroupNCCL
    pg = _recording(pg_class)(timeout=timedelta(seconds=timeout))
    seconds = lambda s: timedelta(seconds=timeout if s is None else s)  # noqa: E731
    try:
        manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
                          use_async_quorum=False, timeout=seconds(timeout), quorum_timeout=seconds(quorum_timeout),
                          connect_timeout=seconds(connect_timeout), rank=dist.get_rank(),
                          world_size=dist.get_world_size(), store_addr=store_addr, store_port=int(store_port),
                          lighthouse_addr=lighthouse, replica_id=str(replica_id), init_sync=False, max_retries=max_retries)
    except Exception as e:
        raise ReplicaError(
            f"replica {replica_id}: cannot join the replicas through the torchft lighthouse at {lighthouse} within "
            f"{seconds(connect_timeout).total_seconds():g}s; is it running (torchft_lighthouse --min_replicas 1 --bind "
            f"[::]:PORT) and reachable from this host? torchft says: {str(e).splitlines()[0]}"
        ) from e
    replicas = Replicas(manager, replica_id, name, admits, mesh=mesh)
    replicas.store = store  # a store of our own lives as long as the replicas that use it
    return replicas

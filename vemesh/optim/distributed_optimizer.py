"""ZeRO-1: each data-parallel rank keeps optimizer state for 1/DP of the parameters.

The models are :class:`~vemesh.ddp.DistributedDataParallel` built with
``use_distributed_optimizer=True``, so their gradients and parameters live in flat buffers
whose buckets split evenly over DP. DP rank ``r`` owns slice ``r`` of every bucket. A step:

1. gradients are reduced over DP by the DDP buckets during backward (all-reduce on gloo,
   reduce-scatter elsewhere: see :func:`vemesh.ddp.grad_buffer.grad_collective_for_backend`);
2. optionally clip by the global norm (:mod:`vemesh.optim.clip_grad`);
3. the inner torch optimizer steps only this rank's slices ("main params": views of the
   parameter buffer for fp32 models, fp32 master copies for bf16/fp16 models);
4. each bucket's updated slices are gathered over DP into the parameter buffer, which plain
   parameters are views of (one broadcast per rank on gloo, all-gather elsewhere: see
   :func:`vemesh.ddp.grad_buffer.param_gather_for_backend`).

With DP = 2 and one bucket of 10 elements, rank 0 steps elements ``[0, 5)`` and holds Adam
state for 5 elements; rank 1 steps ``[5, 10)``; after the gather both see all 10.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..ddp.bucketing import contiguous_runs, shard_pieces
from ..ddp.distributed_data_parallel import DistributedDataParallel
from ..ddp.grad_buffer import GradBuffer
from .clip_grad import NormTerm, build_norm_terms, clip_grads_, global_grad_norm

__all__ = ["DistributedOptimizer"]

#: Largest flat tensor handed to the inner optimizer, in elements (2 MiB of fp32). An optimizer
#: makes several passes per tensor; chunks this size stay in cache. Measured on this project's
#: CPU machine, torch.optim.AdamW (default, for-loop implementation) over 4.2M elements:
#: one flat tensor 24.6 ms, 512K-element chunks 12.9 ms, 128K-element chunks 12.6 ms.
MAIN_PARAM_CHUNK = 1 << 19


class _Shard:
    """This rank's slices of one buffer: main params, their gradients, and how to sync them."""

    def __init__(self, buffer: GradBuffer, group_of: dict[int, int]) -> None:
        assert buffer.param_data is not None, "DDP was not built with use_distributed_optimizer=True"
        self.buffer = buffer
        self.pieces = shard_pieces(buffer.layout, buffer.dp_rank, buffer.dp_size)
        keys = [group_of.get(id(buffer.params[pc.param])) for pc in self.pieces]
        self.runs = contiguous_runs(self.pieces, keys)
        param_data = buffer.param_data
        self.copy_params = param_data.dtype != torch.float32  # keep fp32 masters
        self.copy_grads = buffer.data.dtype != torch.float32
        total = sum(end - start for _, start, end in self.runs)
        master = torch.empty(total, dtype=torch.float32, device=param_data.device) if self.copy_params else None
        grad_copy = torch.empty(total, dtype=torch.float32, device=param_data.device) if self.copy_grads else None
        self.main: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.model_views: list[torch.Tensor] = []  # param_data slices, one per run
        self.grad_views: list[torch.Tensor] = []  # buffer.data slices, one per run
        offset = 0
        for _, start, end in self.runs:
            n = end - start
            self.model_views.append(param_data[start:end])
            self.grad_views.append(buffer.data[start:end])
            self.main.append(master[offset : offset + n] if master is not None else param_data[start:end])
            self.grads.append(grad_copy[offset : offset + n] if grad_copy is not None else buffer.data[start:end])
            offset += n
        self.reload_model_params()

    def reload_model_params(self) -> None:
        """Copy the model's parameters into the parameter buffer and the fp32 masters."""
        self.buffer.copy_params_in()
        if self.copy_params:
            with torch.no_grad():
                torch._foreach_copy_(self.main, self.model_views)

    def piece_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """``(parameter, gradient view)`` for each owned piece that the optimizer steps."""
        out = []
        run = 0
        for pc in self.pieces:
            while run < len(self.runs) and self.runs[run][2] <= pc.start:
                run += 1
            if run == len(self.runs):
                break
            _, start, _ = self.runs[run]
            if pc.start >= start:  # pieces outside every run belong to no param group
                lo = pc.start - start
                out.append((self.buffer.params[pc.param], self.grads[run][lo : lo + pc.end - pc.start]))
        return out


class DistributedOptimizer:
    """A torch optimizer whose state and update are sharded over the data-parallel group (ZeRO-1).

    Args:
        optimizer: a ``torch.optim.Optimizer`` subclass (built here with ``optimizer_kwargs`` over
            this rank's shard), or a freshly built instance over the models' parameters (its
            param groups and their hyperparameters are kept; it must have no state yet).
        models: the :class:`~vemesh.ddp.DistributedDataParallel` models to optimize, all built
            with ``use_distributed_optimizer=True`` over the same DP group.
        clip_grad: clip gradients to this global 2-norm (``0.0`` or None: no clipping). The norm
            equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.
        **optimizer_kwargs: passed to ``optimizer`` when it is a class.

    The inner optimizer is :attr:`optimizer`; it only ever sees flat fp32 tensors covering this
    rank's shard, in chunks of at most :data:`MAIN_PARAM_CHUNK` elements. :meth:`step` returns
    the global gradient norm (before clipping) when ``clip_grad`` is set, else None. After
    loading model weights directly, call :meth:`reload_model_params`.

    Example::

        model = DDP(model, mesh["DP"], use_distributed_optimizer=True)
        opt = DistributedOptimizer(torch.optim.AdamW, models=[model], lr=3e-4, clip_grad=1.0)
        opt.zero_grad(); loss_fn(model(x), y).backward(); model.finish_grad_sync(); opt.step()
    """

    def __init__(
        self,
        optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer,
        models: Sequence[DistributedDataParallel],
        clip_grad: float | None = 0.0,
        **optimizer_kwargs: Any,
    ) -> None:
        self.models = self._check_models(models)
        if clip_grad is None:
            clip_grad = 0.0
        if isinstance(clip_grad, bool) or not isinstance(clip_grad, (int, float)) or clip_grad < 0:
            raise ValueError(f"clip_grad must be a non-negative number (0 or None disables clipping), got {clip_grad!r}")
        self.clip_grad = float(clip_grad)
        params = [p for m in self.models for b in m.buffers for p in b.params]
        group_of, group_options, cls = self._param_groups(optimizer, params, optimizer_kwargs)
        self._group_of = group_of  # id(model parameter) -> param group index
        self._shards = [_Shard(b, group_of) for m in self.models for b in m.buffers]
        inner_groups: list[dict[str, Any]] = [dict(opts, params=[]) for opts in group_options]
        #: ``(inner parameter, its gradient)``: one per chunk of each run of this rank's shard.
        self._inner: list[tuple[nn.Parameter, torch.Tensor]] = []
        for shard in self._shards:
            for (gid, _, _), main, grad in zip(shard.runs, shard.main, shard.grads):
                for main_chunk, grad_chunk in zip(main.split(MAIN_PARAM_CHUNK), grad.split(MAIN_PARAM_CHUNK)):
                    inner = nn.Parameter(main_chunk)  # shares storage with main
                    inner_groups[gid]["params"].append(inner)  # type: ignore[index]
                    self._inner.append((inner, grad_chunk))
        if not self._inner:  # a tiny model can leave a rank with nothing to own
            inner_groups[0]["params"].append(nn.Parameter(torch.zeros(0, device=params[0].device)))
        #: The inner torch optimizer, stepping only this rank's flat fp32 shard tensors.
        self.optimizer: torch.optim.Optimizer = cls(inner_groups, **optimizer_kwargs)
        if isinstance(optimizer, torch.optim.Optimizer):
            self.optimizer.defaults.update(optimizer.defaults)
        self._grads = [g for _, g in self._inner]
        self._norm_terms: list[NormTerm] = build_norm_terms(
            [pg for s in self._shards for pg in s.piece_grads()], params
        )
        self._dp_group = self.models[0].data_parallel_group
        self._device = self._shards[0].buffer.data.device

    @staticmethod
    def _check_models(models: Sequence[DistributedDataParallel]) -> list[DistributedDataParallel]:
        if isinstance(models, nn.Module) or not isinstance(models, Sequence) or not models:
            raise TypeError(f"models must be a non-empty list of vemesh DistributedDataParallel, got {models!r:.80}")
        for i, m in enumerate(models):
            if not isinstance(m, DistributedDataParallel):
                raise TypeError(f"models[{i}] must be a vemesh DistributedDataParallel, got {type(m).__name__}")
            if not m.use_distributed_optimizer:
                raise ValueError(
                    f"models[{i}] was built with use_distributed_optimizer=False; build it with "
                    "DistributedDataParallel(..., use_distributed_optimizer=True)"
                )
        ranks = [dist.get_process_group_ranks(m.data_parallel_group) for m in models]
        if any(r != ranks[0] for r in ranks):
            raise ValueError(f"all models must share one data-parallel group, got groups with ranks {ranks}")
        return list(models)

    @staticmethod
    def _param_groups(
        optimizer: Any, params: list[nn.Parameter], kwargs: dict[str, Any]
    ) -> tuple[dict[int, int], list[dict[str, Any]], type[torch.optim.Optimizer]]:
        """Map each model parameter to a param group index; return the groups' options and the class."""
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            return {id(p): 0 for p in params}, [{}], optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer subclass or instance, got {optimizer!r:.80}"
            )
        if kwargs:
            raise ValueError(f"optimizer_kwargs {sorted(kwargs)} are only accepted with an optimizer class")
        if optimizer.state:
            raise ValueError(
                f"optimizer already holds state for {len(optimizer.state)} parameters; pass a freshly built one"
            )
        known = {id(p) for p in params}
        group_of: dict[int, int] = {}
        options = []
        for gid, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in known:
                    raise ValueError(
                        f"optimizer param group {gid} holds a parameter of shape {tuple(p.shape)} "
                        "that is not a trainable parameter of the models"
                    )
                group_of[id(p)] = gid
            options.append({k: v for k, v in group.items() if k != "params"})
        return group_of, options, type(optimizer)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (set ``lr`` here, as on any torch optimizer)."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the models' gradient buffers (``set_to_none`` is accepted for torch compatibility)."""
        for m in self.models:
            m.zero_grad_buffer()

    @torch.no_grad()
    def step(self) -> torch.Tensor | None:
        """Finish the models' gradient sync, clip, step this rank's shard, all-gather the parameters.

        Returns:
            The global gradient norm before clipping (a 0-dim tensor) if ``clip_grad`` is set, else None.
        """
        for m in self.models:
            m.finish_grad_sync()
        for shard in self._shards:
            if shard.copy_grads:
                torch._foreach_copy_(shard.grads, shard.grad_views)
        norm = None
        if self.clip_grad > 0:
            norm = global_grad_norm(self._norm_terms, self._dp_group, self._device)
            clip_grads_(self._grads, self.clip_grad, norm)
        for p, g in self._inner:
            p.grad = g
        self.optimizer.step()
        self._sync_model_params()
        return norm

    def _sync_model_params(self) -> None:
        works: list[dist.Work] = []
        for shard in self._shards:
            if shard.copy_params and shard.main:
                torch._foreach_copy_(shard.model_views, shard.main)
            works += shard.buffer.start_param_gather()
        for work in works:
            work.wait()
        for shard in self._shards:
            shard.buffer.copy_params_out()

    def reload_model_params(self) -> None:
        """Re-read the models' parameters after changing them outside :meth:`step`.

        Call it after loading model weights directly (``model.load_state_dict``) once the
        optimizer exists: the optimizer steps its own copies (the parameter buffer for DTensor
        parameters, fp32 masters for bf16/fp16 models). :meth:`load_state_dict` needs no call.
        """
        for shard in self._shards:
            shard.reload_model_params()

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the inner optimizer's state dict and its fp32 main params.

        Returns:
            ``{"optimizer": ..., "main_params": [...], "shard_numels": [...]}``; load it on the
            same rank of the same mesh with :meth:`load_state_dict`.
        """
        return {
            "optimizer": self.optimizer.state_dict(),
            "main_params": [t.detach().clone() for s in self._shards for t in s.main],
            "shard_numels": [t.numel() for s in self._shards for t in s.main],
        }

    def sharded_state_dict(self) -> dict[str, Any]:
        """The state per parameter name, each tensor shaped and sharded like its parameter (any mesh can load it).

        A collective over DP: every DP rank must call it. On ``(DP, TP) = (2, 2)``, ranks 0 and 2
        both get the full TP shard of each ``exp_avg`` (a DTensor like the weight), though each
        holds Adam state for only half of it.

        Returns:
            ``{"state": {name: {"exp_avg": ..., "step": 0-dim tensor, ...}}, "param_groups":
            [{hyperparameters..., "params": [names]}]}``, plus ``"master_params": {name: fp32}``
            for bf16/fp16 models. :mod:`vemesh.checkpoint` saves it.
        """
        from .sharded_state import sharded_state_dict

        return sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`sharded_state_dict`'s form, whatever mesh wrote it, keeping this rank's slices.

        Args:
            state_dict: each tensor sharded like its parameter *on this mesh* (as DCP loads it);
                hyperparameters are taken from its ``param_groups``; ``master_params``, when
                present, become the weights (then gathered into the models over DP).
        """
        from .sharded_state import load_sharded_state_dict

        load_sharded_state_dict(self, state_dict)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` and write the main params into the models.

        Args:
            state_dict: saved by the same rank on the same mesh and model.
        """
        mains = [t for s in self._shards for t in s.main]
        numels = [t.numel() for t in mains]
        if state_dict.get("shard_numels") != numels:
            raise ValueError(
                f"state_dict holds shards of sizes {state_dict.get('shard_numels')}, this rank owns {numels}; "
                "load it on the same rank of the same mesh and model"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        for main, saved in zip(mains, state_dict["main_params"]):
            main.copy_(saved)
        self._sync_model_params()

"""A module's own per-head parameters sharded over TP: each rank's forward reads its own heads' slice.

torch's ``ColwiseParallel`` splits a projection's heads over TP; a parameter with a value per head that is no
Linear's weight stays whole. HF's GPT-OSS keeps ``sinks``, one logit per head (``nn.Parameter(num_attention_heads)``),
and concatenates them to this rank's attention scores: under TP the shapes disagree and the forward raises
(``Expected size 2 but got size 4``). Mamba2's ``A_log``, ``D`` and ``dt_bias`` are the same kind.

:class:`HeadwiseParallel` is a torch ``ParallelStyle`` for them: on the module that holds them, each named parameter
becomes a DTensor sharded over the plan's (TP) mesh along ``dim``, so that its checkpoint and ``full_tensor()`` are the
whole model's, and the optimizer steps this rank's heads. During the module's forward the attribute reads as this
rank's slice, a plain tensor (``to_local()``, whose gradient flows back into the DTensor), as FSDP2 swaps in its
unsharded parameters; after the forward (also one that raises) the DTensor is put back. Heads are split as
``ColwiseParallel`` splits a projection's rows: rank ``r`` holds block ``r`` of ``TP`` contiguous blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from vemesh.layout.names import divisors
from vemesh.parallel.tp_split import one_tp_dim

__all__ = ["HeadwiseParallel"]


class HeadwiseParallel(ParallelStyle):
    """The module's own parameters ``params`` (their names on it) sharded over the TP mesh along ``dim``, each rank's
    forward reading its own slice as a plain tensor. For per-head parameters beside ColwiseParallel projections, as
    GPT-OSS's attention sinks::

        parallelize_module(layer, mesh["TP"], {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "self_attn": HeadwiseParallel(("sinks",)),  # one logit per head: this rank's heads'
        })
    """

    def __init__(self, params: Sequence[str], dim: int = 0) -> None:
        super().__init__()
        if isinstance(params, str) or not params or not all(isinstance(p, str) and p for p in params):
            raise ValueError(f"HeadwiseParallel(params={params!r}): params must be a non-empty sequence of the "
                             "module's parameter names, e.g. ('sinks',)")
        if type(dim) is not int:
            raise ValueError(f"HeadwiseParallel(dim={dim!r}): dim must be an int, the parameters' heads dim")
        self.params, self.dim = tuple(params), dim

    def __repr__(self) -> str:
        return f"HeadwiseParallel({self.params!r}, dim={self.dim})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        one_tp_dim(repr(self), device_mesh)
        own = dict(module.named_parameters(recurse=False))
        for name in self.params:
            if name not in own:
                raise ValueError(f"{self!r} on {type(module).__name__}: it has no parameter {name!r} of its own; its "
                                 f"parameters: {sorted(own) or 'none'}")
            p, tp, where = own[name], device_mesh.size(), f"{self!r} on {type(module).__name__}.{name}"
            if isinstance(p, DTensor):
                raise ValueError(f"{where}: it is a DTensor already ({p.placements}); give it one style")
            if not -p.dim() <= self.dim < p.dim():
                raise ValueError(f"{where} of shape {tuple(p.shape)}: dim {self.dim} is not one of its dims")
            if p.shape[self.dim] % tp:
                heads = p.shape[self.dim]
                raise ValueError(f"{where} of shape {tuple(p.shape)}: TP {tp} does not divide its {heads} heads on dim "
                                 f"{self.dim}; choose TP from {', '.join(str(d) for d in divisors(heads))}")
            # from src_data_rank's values (rank 0's, as torch's styles; None: each rank's own), as ColwiseParallel does
            whole = distribute_tensor(p.detach(), device_mesh, [Shard(self.dim)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(whole, requires_grad=p.requires_grad))
        module.register_forward_pre_hook(self._local)
        module.register_forward_hook(self._restore, always_call=True)
        return module

    def _local(self, module: nn.Module, args: Any) -> None:
        held = {}
        for name in self.params:
            held[name] = module._parameters[name]
            module._parameters[name] = held[name].to_local()  # type: ignore[union-attr]
        module.__dict__.setdefault("_vemesh_headwise", []).append(held)

    def _restore(self, module: nn.Module, args: Any, out: Any) -> Any:
        stack = module.__dict__.get("_vemesh_headwise")
        if stack:
            module._parameters.update(stack.pop())
        return out

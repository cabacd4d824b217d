"""A fused projection (``[q|k|v]``, ``[gate|up]``) sharded column-wise by whole chunks.

nanoGPT's and GPT-2's ``c_attn`` is one ``nn.Linear(C, 3C)`` whose output rows are ``[q | k | v]``; fused MLPs
keep ``[gate | up]``. torch's ``ColwiseParallel`` cuts the rows in ``TP`` contiguous blocks, so at TP 2 rank 0
gets all of q and half of k: the model computes something else, and trains. :class:`FusedColwiseParallel` cuts
each chunk instead, so that rank ``r`` holds ``[q_r | k_r | v_r]``: its own heads' q, k and v, in the chunks'
order, exactly the layout a forward that splits the local output into local heads expects.

The weight stays one DTensor of the module's own global shape: ``_StridedShard(0, split_factor=chunks)``, torch's
placement for "every one of ``chunks`` blocks split over the mesh" (the one FSDP2 uses over TP). Its full tensor,
its checkpoint (DCP) and its gradient are the one-process ones at any TP degree. The bias is replicated over TP
(each rank adds its slice; its gradient is gathered): a 1-D strided shard could not be sharded again by FSDP2.

Under FSDP2, :func:`vemesh.parallel.fully_shard` shards such a weight over the data dims on its input dim
(``Shard(1)``): FSDP2's default, its rows again, would describe the rows of a strided shard as a strided shard of
the whole (``_StridedShard(0, sf=DP)`` over ``_StridedShard(0, sf=chunks)``), which gathers to a wrong tensor: a
checkpoint or ``full_tensor()`` of it would be silently wrong. torch's own ``fully_shard`` needs
``shard_placement_fn=vemesh.parallel.fused.fsdp_placement`` for the same reason.

The output:

* ``use_local_output=True`` (the default): the local ``[q_r | k_r | v_r]``, for a forward that reshapes with
  ``-1`` heads or local sizes (HF's, Megatron's, the planner docs' own model);
* ``use_local_output=False``: a DTensor of the global shape, for a forward written with global sizes
  (nanoGPT's ``split(n_embd, dim=2)`` then ``view(B, T, n_head, hs)``). torch's ``split`` of a strided shard
  gathers it first, so q, k and v are replicated and the attention after them runs every head on every rank:
  exact, at the price of an all-gather of the q/k/v activations and the whole attention on each TP rank
  (``bench/fused_tp.py`` measures it against local tensors).

A head-major layout (``[q_h k_h v_h]`` per head, as GPT-NeoX and Bloom ship; per KV group for Megatron's GQA) needs
no chunks: each TP rank's contiguous block of rows is whole heads, and torch's ``ColwiseParallel`` is exact.
Unequal chunks (GQA's ``[q | k | v]`` with fewer KV heads than query heads) cannot be one strided shard and are
refused: split the Linear into q and kv Linears, or store it head-major by KV group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["FusedColwiseParallel", "for_checkpoint", "fsdp_placement"]


def fsdp_placement(param: nn.Parameter) -> Shard | None:
    """FSDP2's ``shard_placement_fn`` for fused weights: ``Shard(1)`` for a weight whose TP placement is a strided
    shard of its rows, None (FSDP2's default ``Shard(0)``) for every other parameter."""
    if isinstance(param, DTensor) and param.dim() > 1 and \
            any(isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements):
        return Shard(1)
    return None


class FusedColwiseParallel(ColwiseParallel):
    """torch's ``ColwiseParallel`` for a Linear whose output is ``chunks`` equal blocks: each block is split.

    Args:
        chunks: how many equal blocks the output rows hold (3 for ``[q|k|v]``, 2 for ``[gate|up]``), or their
            sizes (which must be equal; GQA's unequal parts: see the module docstring).
        input_layouts: the input's placement, as torch's (default ``Replicate()``).
        output_layouts: ``None`` keeps the strided shard (local ``[q_r|k_r|v_r]``); ``Replicate()`` gathers it.
        use_local_output: as torch's: the local tensor (default) or the DTensor.

    ``parallelize_module(block, mesh["TP"], {"c_attn": FusedColwiseParallel(3), "c_proj": RowwiseParallel()})``
    shards nanoGPT's attention by heads.
    """

    def __init__(self, chunks: int | Sequence[int], *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        if isinstance(chunks, bool) or not isinstance(chunks, int):
            sizes = list(chunks) if isinstance(chunks, Sequence) else None
            if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"FusedColwiseParallel: chunks must be a positive int or a list of positive sizes, "
                                 f"got {chunks!r}")
            if len(set(sizes)) != 1:
                raise ValueError(
                    f"FusedColwiseParallel: chunks {sizes} are unequal (GQA's q and kv parts?): one strided shard "
                    "cannot hold them. Split the Linear into a q Linear and a kv Linear (each ColwiseParallel or "
                    "FusedColwiseParallel(2)), or store its rows head-major by KV group, which ColwiseParallel "
                    "shards exactly")
            chunks = len(sizes)
        if chunks < 1:
            raise ValueError(f"FusedColwiseParallel: chunks must be at least 1, got {chunks}")
        if output_layouts is not None and not isinstance(output_layouts, Replicate):
            raise ValueError(f"FusedColwiseParallel: output_layouts must be None (the strided shard, each rank's "
                             f"[q_r|k_r|v_r]) or Replicate(), got {output_layouts!r}")
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self.chunks = chunks
        self.gather_output = output_layouts is not None

    def _placement(self) -> list[Placement]:
        return [_StridedShard(0, split_factor=self.chunks)]

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        n = device_mesh.size()
        for pname, param in module.named_parameters():
            if param.dim() == 1:  # the bias: replicated (a slice of it joins the output; its gradient is gathered)
                module.register_parameter(pname, nn.Parameter(
                    distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=self.src_data_rank),
                    requires_grad=param.requires_grad))
                continue
            rows = param.shape[0]
            if rows % (self.chunks * n):
                raise ValueError(
                    f"FusedColwiseParallel: {name or 'the module'}.{pname} has {rows} rows, which {self.chunks} "
                    f"chunks over {n} TP ranks cannot split evenly ({rows} % {self.chunks * n} != 0): each TP "
                    "rank must get whole heads of every chunk")
            dist_param = nn.Parameter(distribute_tensor(param, device_mesh, self._placement(),
                                                        src_data_rank=self.src_data_rank),
                                      requires_grad=param.requires_grad)
            module.register_parameter(pname, dist_param)

    def _partition_embedding_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        raise ValueError(f"FusedColwiseParallel: {name or 'the module'} is an nn.Embedding; it shards a fused "
                         "nn.Linear only (use ColwiseParallel or RowwiseParallel for an embedding)")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"FusedColwiseParallel shards an nn.Linear, got {type(module).__name__}")
        return super()._apply(module, device_mesh)

    # torch calls it with (output_layouts, use_local_output, module, outputs, mesh) bound by partial
    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):  # type: ignore[override]
        if not isinstance(outputs, DTensor):
            raise TypeError(f"FusedColwiseParallel: the module returned {type(outputs).__name__}, not a DTensor")
        if self.gather_output:
            outputs = outputs.redistribute(placements=[Replicate()])
        return outputs.to_local() if use_local_output else outputs


def _strided_chunks(t: DTensor) -> list[tuple[list[int], list[int], slice]] | None:
    """``(global offsets, sizes, local rows)`` of each contiguous block of ``t``'s rows when a fused style's strided
    shard of dim 0 is its only sharding of dim 0 (its other mesh dims replicate it or shard other dims); None for
    every other DTensor (FSDP2 over TP's own strided shard included, which torch's DCP writes as it is)."""
    strided = [(i, p) for i, p in enumerate(t.placements) if isinstance(p, _StridedShard)]
    if len(strided) != 1 or strided[0][1].dim != 0:
        return None
    i, p = strided[0]
    if any(j != i and isinstance(q, Shard) and q.dim == 0 for j, q in enumerate(t.placements)):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    rest = [Replicate() if j == i else q for j, q in enumerate(t.placements)]
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, rest)
    n, coord = t.device_mesh.size(i), t.device_mesh.get_local_rank(i)
    rows, sf = t.shape[0], p.split_factor
    if rows % (sf * n):
        return None
    piece = rows // (sf * n)
    return [([c * (rows // sf) + coord * piece, *offset[1:]], [piece, *shape[1:]], slice(c * piece, (c + 1) * piece))
            for c in range(sf)]


def for_checkpoint(t: torch.Tensor) -> torch.Tensor:
    """``t`` as DCP can write and read it: a fused weight's strided shard (and its optimizer state, placed alike) as
    one chunk per block of rows, which DCP's default (one chunk per rank) cannot describe; anything else as it is.

    The result shares ``t``'s storage: DCP's load writes into ``t``. vemesh's checkpoints call it on every tensor.
    """
    chunks = _strided_chunks(t) if isinstance(t, DTensor) else None
    if chunks is None:
        return t
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    local = t._local_tensor.view(t._local_tensor.shape)  # a new object on the same storage, to carry the hooks

    def metadata() -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in chunks]

    def write_items(fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, m.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=m, properties=TensorProperties.create_from_tensor(local),
                                                      size=t.size()))
                for m in metadata()]

    def shard(index: MetadataIndex) -> torch.Tensor:
        for o, _, rows in chunks:
            if index.offset is not None and list(index.offset) == o:
                return local[rows]
        raise ValueError(f"no block of this rank's rows starts at {index.offset} ({index.fqn})")

    local.__create_write_items__ = write_items  # type: ignore[attr-defined]
    local.__create_chunk_list__ = metadata  # type: ignore[attr-defined]
    local.__get_tensor_shard__ = shard  # type: ignore[attr-defined]
    return DTensor(local, t._spec, requires_grad=False)

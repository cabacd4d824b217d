"""Every parallelism, as library functions and torch styles that apply to any model.

* :class:`ParallelDims`: a job's degrees and every dim derived from them (the one rule; built on the live mesh);

* :mod:`~vemesh.parallel.ddp` (also ``vemesh.ddp``): data parallelism, torch DDP's contract on a mesh dim;
* :mod:`~vemesh.parallel.optim` (also ``vemesh.optim``): the ZeRO-1 optimizer and clipping across meshes;
* :func:`context_parallel` (:mod:`~vemesh.parallel.context`): torch's context manager, ring attention over the CP group;
* :class:`ExpertParallel` (:mod:`~vemesh.parallel.experts`): a torch ``ParallelStyle`` for grouped experts over EP;
  :class:`ExpertTensorParallel`, each expert also split over TP (on ``mesh["EP", "TP"]``);
* :func:`fully_shard` (:mod:`~vemesh.parallel.fsdp`): torch's FSDP2 on the mesh's FSDP dims, experts on EDP;
* :class:`FusedColwiseParallel` (:mod:`~vemesh.parallel.fused`): a fused ``[q|k|v]`` or ``[gate|up]`` Linear
  sharded by whole chunks, each TP rank its own heads' q, k and v;
* :func:`parallelize_module` (:mod:`~vemesh.parallel.ties`): torch's, keeping tied parameters one parameter;
  vemesh's DDP, ZeRO-1 and ``fully_shard`` refuse a model whose tie was broken (:func:`check_ties`);
* :class:`SumGradOverTP` (:mod:`~vemesh.parallel.summed_grad`): a torch style for a replicated module whose output
  reaches this rank's heads outside torch's styles (DeepSeek-V3's shared rotary key): its gradient summed over TP;
* :class:`HeadwiseParallel` (:mod:`~vemesh.parallel.headwise`): a torch style for a module's own per-head
  parameters (GPT-OSS's attention sinks), sharded over TP, each rank's forward reading its heads' slice;
* :class:`DecoderStage` (:mod:`~vemesh.parallel.hf_stages`): a pipeline stage of a Hugging Face causal LM, run by the
  model's own forward under its own parameter names, checked against the whole model as it is built;
* :func:`~vemesh.parallel.attention.shard_cpu_attention`: torch's CPU attention kernel sharded over heads or batch on
  DTensors, as torch shards its CUDA ones (registered on import, where torch has no rule of its own).
"""

from vemesh.layout.parallel_dims import ParallelDims
from vemesh.parallel.context import context_parallel
from vemesh.parallel.experts import ExpertParallel, ExpertTensorParallel
from vemesh.parallel.fsdp import fully_shard
from vemesh.parallel.attention import shard_cpu_attention
from vemesh.parallel.fused import FusedColwiseParallel
from vemesh.parallel.headwise import HeadwiseParallel
from vemesh.parallel.hf_stages import DecoderStage
from vemesh.parallel.summed_grad import SumGradOverTP
from vemesh.parallel.ties import check_ties, parallelize_module, track_ties

shard_cpu_attention()
track_ties()

__all__ = ["DecoderStage", "ExpertParallel", "HeadwiseParallel", "FusedColwiseParallel", "check_ties", "parallelize_module", "ExpertTensorParallel", "ParallelDims", "SumGradOverTP", "context_parallel",
           "fully_shard"]

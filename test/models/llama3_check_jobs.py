"""The planner's Llama 3 preset (``vemesh.models.llama3``) as ``vemesh check`` takes it: a tiny config, the preset's
parallelize functions (TP with sequence parallelism, FSDP2 or vemesh DDP, activation checkpointing) and its step (with
CP inside ``context_parallel``, under TP inside ``loss_parallel``): the same functions ``vemesh plan --model llama3:...``
traces (:mod:`vemesh.models.llama3.planned`)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from vemesh.models.llama3.config import Llama3Config
from vemesh.models.llama3.model import Llama3
from vemesh.models.llama3.planned import loss_fn, parallelize_for, pipeline_step_for, step  # noqa: F401  (what
# vemesh check runs: the step, and with PP the schedule's loss and step)

#: grouped-query attention (4 query heads over 2 KV heads), as Llama 3's 8:1 is, on a width check runs in seconds
TINY = Llama3Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=256, seq_len=32)


def make(**kwargs: object) -> nn.Module:
    return Llama3(replace(TINY, **kwargs))  # type: ignore[arg-type]


parallelize_fsdp = parallelize_for("fsdp", "fp32", "none")
parallelize_fsdp_selective = parallelize_for("fsdp", "fp32", "selective-op")
parallelize_ddp = parallelize_for("ddp", "fp32", "full")


#: with PP: the preset's stages under FSDP2, its step of a batch through torch's 1F1B, and its loss
parallelize_pp = parallelize_for("fsdp", "fp32", "none", "1f1b")
pipeline_step = pipeline_step_for("1f1b")

"""The example's GPT (``vemesh.models.gpt``) as ``vemesh check`` takes it: the factory, the example's parallelize
functions (TP with and without sequence parallelism, vemesh DDP or FSDP2, MoE with EP) and its micro-batch step,
the same functions the planner's GPT preset runs (:mod:`vemesh.models.gpt.planned`)."""

from __future__ import annotations

from torch import nn

from vemesh.models.gpt.model import GPT, GPTConfig
from vemesh.models.gpt.planned import loss_fn, parallelize_for, pipeline_step_for, step  # noqa: F401  (what vemesh
# check runs: the step, and with PP the schedule's loss and step)


def make(**kwargs: object) -> nn.Module:
    return GPT(GPTConfig(**{"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64,
                            **kwargs}))  # type: ignore[arg-type]


parallelize_ddp = parallelize_for("ddp", "fp32", False, False)
parallelize_fsdp_sp = parallelize_for("fsdp", "fp32", True, False)

#: with PP: the example's stages (vemesh DDP on each), its step of a batch through torch's 1F1B
parallelize_pp = parallelize_for("ddp", "fp32", False, False, "1f1b")
pipeline_step = pipeline_step_for("1f1b")

"""The GPT preset: the model (no vemesh import), ``parallelize`` (TP, CP, EP, activation checkpointing, FSDP2 or DDP),
and the pipeline stages."""

from vemesh.models.gpt.model import GPT, GPTConfig, GroupedExperts, MoE
from vemesh.models.gpt.parallelize import apply_tp, gpt_tp_plan, parallelize
from vemesh.models.gpt.stages import cut_stage, split_layers, stage_indices, stage_owner, stages_per_rank

__all__ = ["GPT", "GPTConfig", "GroupedExperts", "MoE", "apply_tp", "cut_stage", "gpt_tp_plan", "parallelize",
           "split_layers", "stage_indices", "stage_owner", "stages_per_rank"]

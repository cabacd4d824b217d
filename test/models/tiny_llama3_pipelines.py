"""A tiny Llama 3 (width 32, 2 heads, sequences of 16) through torchtitan's parallelization on a pipeline: the
functions and job of a traced pipeline plan, shared by ``test/planning/test_pipeline_replay.py`` and
``bench/plan_replay.py``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vemesh.models.llama3 import planned
from vemesh.models.llama3.config import Llama3Config
from vemesh.parallel.schedules import stages_per_rank
from vemesh.planning.user_code import UserFunctions
from vemesh.planning.user_model import trace_arguments

TINY = Llama3Config(dim=32, n_layers=4, n_heads=2, n_kv_heads=2, hidden_dim=64, vocab_size=128, seq_len=16)


def tiny_pipeline(schedule: str, mode: str, batch: int, pp: int, tp: int, blocks: int = 1,
                  ac: str = "full") -> tuple[Any, dict]:
    """``(functions, trace keywords)`` of ``blocks`` blocks a stage over PP ``pp`` x DP 2 x TP ``tp``, micro-batches
    of 1 out of a global batch of ``batch`` (FSDP2 keeps fp32 parameters; DDP and ZeRO-1 train in bf16), under
    activation checkpointing ``ac``."""
    cfg = replace(TINY, n_layers=blocks * pp * stages_per_rank(schedule))
    fns = UserFunctions(planned.factory(cfg), planned.parallelize_for(mode, "bf16", ac, schedule),
                        planned.pipeline_step_for(schedule), (f"llama3 {cfg}", "p", "s"), loss=planned.loss_fn,
                        pp_schedule=schedule)
    job = dict(world_size=2 * pp * tp, degrees={"PP": pp, "DP": 2, "CP": 1, "TP": tp, "EP": 1}, dp_replicate=1,
               global_batch_size=batch, micro_batch_size=1, dtype="fp32" if mode == "fsdp" else "bf16", dp_mode=mode,
               load_factor=1.0, timed=True)
    return fns, trace_arguments(**job)

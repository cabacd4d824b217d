"""Fault injection, called by the loop at one point: ``with job.faults.during(step, ...)`` around a step's compute.

* ``--fail-at-step S``: the last rank exits at step S of the first attempt (a crashed worker, for torchrun's restart);
* ``--nan-at-step S``: rank 0's output is nan at step S of the first attempt (the non-finite skip or stop);
* ``--inject KIND:RANK:STEP[:MS]``, for the hang report, to see ``VEMESH_HANG_DIR``'s diagnosis once, and the tests
  that hold it exact:

* ``sleep:R:S``: rank R sleeps in compute at step S (a hang: its groups wait for it);
* ``skip-dp:R:S``: rank R skips its DP gradient average at step S;
* ``wrong-size-tp:R:S``: at step S every rank enters one extra TP all-reduce, rank R with twice the elements;
* ``slow:R:S:MS``: rank R sleeps MS milliseconds in compute at every step from S (a straggler, no hang).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vemesh import VESCALE_DEVICE_MESH

KINDS = ("sleep", "skip-dp", "wrong-size-tp", "slow")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    ms: float = 0.0

    @staticmethod
    def parse(text: str, world_size: int, steps: int) -> "Fault":
        parts = text.split(":")
        kind = parts[0]
        if kind not in KINDS:
            raise ValueError(f"--inject {text!r}: unknown kind {kind!r}; choose from {', '.join(KINDS)} "
                             "(KIND:RANK:STEP, slow:RANK:STEP:MS)")
        want = 4 if kind == "slow" else 3
        if len(parts) != want:
            raise ValueError(f"--inject {text!r}: {kind} takes {'KIND:RANK:STEP:MS' if kind == 'slow' else 'KIND:RANK:STEP'}")
        try:
            rank, step, ms = int(parts[1]), int(parts[2]), float(parts[3]) if kind == "slow" else 0.0
        except ValueError:
            raise ValueError(f"--inject {text!r}: RANK and STEP must be integers (MS a number)") from None
        if not 0 <= rank < world_size:
            raise ValueError(f"--inject {text!r}: rank {rank} is not one of the {world_size} ranks (0..{world_size - 1})")
        if not 1 <= step <= steps:
            raise ValueError(f"--inject {text!r}: step {step} is not one of the steps 1..{steps}")
        if kind == "slow" and not ms > 0:
            raise ValueError(f"--inject {text!r}: MS must be above 0")
        return Fault(kind, rank, step, ms)

    def _mine(self, step: int) -> bool:
        return dist.get_rank() == self.rank and (step >= self.step if self.kind == "slow" else step == self.step)

    def before_compute(self, step: int) -> None:
        """Where the step's compute begins: the sleep, the slow rank, and the extra TP all-reduce."""
        if self.kind == "sleep" and self._mine(step):
            print(f"rank {self.rank}: --inject {self.kind}: sleeping in compute at step {step}", file=sys.stderr, flush=True)
            time.sleep(24 * 3600)
        if self.kind == "slow" and self._mine(step):
            time.sleep(self.ms / 1000)
        if self.kind == "wrong-size-tp" and step == self.step and VESCALE_DEVICE_MESH.get_strategy_size("TP") > 1:
            probe = torch.ones(16 if dist.get_rank() == self.rank else 8)
            dist.all_reduce(probe, group=VESCALE_DEVICE_MESH.get_group("TP"))

    def skips_dp(self, step: int) -> bool:
        return self.kind == "skip-dp" and self._mine(step)


@contextlib.contextmanager
def no_dp_sync(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """The context of a step whose DP gradient average this rank skips (DDP's ``no_sync``, FSDP2's switch held off
    for the step, so that the loop's own switch for its last pass does not turn it back on)."""
    with contextlib.ExitStack() as stack:
        for chunk in chunks:
            if hasattr(chunk, "set_requires_gradient_sync"):
                chunk.set_requires_gradient_sync(False)
                chunk.set_requires_gradient_sync = lambda *a, **k: None  # type: ignore[method-assign]
                stack.callback(lambda c=chunk: (delattr(c, "set_requires_gradient_sync"), c.set_requires_gradient_sync(True)))
            else:
                stack.enter_context(chunk.no_sync())
        yield


@dataclass(frozen=True)
class Faults:
    """Every fault the flags ask for; the loop enters :meth:`during` once per step."""

    inject: Fault | None
    fail_at_step: int
    nan_at_step: int

    @staticmethod
    def of(cfg: Any) -> "Faults | None":
        """The faults of ``cfg`` (None when it asks for none)."""
        inject = Fault.parse(cfg.inject, cfg.world_size, cfg.steps) if cfg.inject is not None else None
        if inject is None and not cfg.fail_at_step and not cfg.nan_at_step:
            return None
        return Faults(inject, cfg.fail_at_step or 0, cfg.nan_at_step or 0)

    @contextlib.contextmanager
    def during(self, step: int, restart: int, chunks: list[torch.nn.Module], first: torch.nn.Module) -> Iterator[None]:
        """Around step ``step``'s forward and backward (``restart``: torchrun's attempt; ``first``: this rank's
        first model part, whose output --nan-at-step spoils)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if step == self.fail_at_step and restart == 0 and rank == world - 1:
            print(f"rank {rank}: --fail-at-step {step}: exiting to simulate a crashed worker", file=sys.stderr, flush=True)
            os._exit(13)
        if self.inject is not None:
            self.inject.before_compute(step)
        with contextlib.ExitStack() as stack:
            if self.inject is not None and self.inject.skips_dp(step):
                stack.enter_context(no_dp_sync(chunks))
            if step == self.nan_at_step and restart == 0 and rank == 0:  # one rank's loss goes bad
                hook = first.register_forward_hook(lambda module, args, out: out * float("nan"))
                stack.callback(hook.remove)
            yield

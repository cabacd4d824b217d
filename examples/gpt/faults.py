"""Fault injection for the hang report (``--inject KIND:RANK:STEP[:MS]``), to see ``VEMESH_HANG_DIR``'s
diagnosis once, and the tests that hold it exact:

* ``sleep:R:S``: rank R sleeps in compute at step S (a hang: its groups wait for it);
* ``skip-dp:R:S``: rank R skips its DP gradient average at step S;
* ``wrong-size-tp:R:S``: at step S every rank enters one extra TP all-reduce, rank R with twice the elements;
* ``slow:R:S:MS``: rank R sleeps MS milliseconds in compute at every step from S (a straggler, no hang).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

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


def no_dp_sync(chunks: list[torch.nn.Module]) -> contextlib.ExitStack:
    """The context of a step whose DP gradient average this rank skips (DDP's ``no_sync``, FSDP2's switch)."""
    stack = contextlib.ExitStack()
    for chunk in chunks:
        if hasattr(chunk, "set_requires_gradient_sync"):
            chunk.set_requires_gradient_sync(False)
        else:
            stack.enter_context(chunk.no_sync())
    return stack

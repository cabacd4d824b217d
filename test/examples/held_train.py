"""examples/gpt/train.py with every optimizer step held ``VEMESH_TEST_HOLD_S`` seconds while the
world has ``VEMESH_TEST_HOLD_WORLD`` processes.

The grow test needs the first agent still training when the second one joins; on two busy cores
a second torchrun takes longer to come up than a small model takes to finish, so the first
agent's steps are held (torch's global optimizer step hook) until the world has grown. Holding a
step changes no number: the losses still match the uninterrupted run.
"""

import os
import runpy
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"
HOLD_S = float(os.environ.get("VEMESH_TEST_HOLD_S", "1"))
HOLD_WORLD = int(os.environ.get("VEMESH_TEST_HOLD_WORLD", "2"))


def _hold(optimizer, args, kwargs):
    if dist.is_initialized() and dist.get_world_size() == HOLD_WORLD:
        time.sleep(HOLD_S)


if __name__ == "__main__":
    register_optimizer_step_pre_hook(_hold)
    sys.path.insert(0, str(TRAIN.parent))
    sys.argv = [str(TRAIN), *sys.argv[1:]]
    runpy.run_path(str(TRAIN), run_name="__main__")

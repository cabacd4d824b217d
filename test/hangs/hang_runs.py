"""Running a job under torchrun with the hang watch on, for the tests of test/hangs and test/examples."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60



def torchrun(nproc: int, args: list[str], tmp: Path, after_s: int | None, **env: str) -> tuple[int, float, str]:
    """Run ``args`` under torchrun with the hang watch on (``after_s`` None: the watch's defaults, no
    VEMESH_HANG_AFTER); (exit code, seconds, everything it printed)."""
    environ = dict(os.environ, OMP_NUM_THREADS="1", VEMESH_HANG_DIR=str(tmp / "dumps"),
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env)
    environ.pop("VEMESH_HANG_AFTER", None)
    if after_s is not None:
        environ["VEMESH_HANG_AFTER"] = str(after_s)
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                          *args], cwd=REPO, env=environ, capture_output=True, text=True, timeout=TIMEOUT_S + 30)
    return run.returncode, time.monotonic() - start, run.stdout + run.stderr


def report(out: str) -> str:
    """What the reporting rank printed: from its first line (a hang was found, or a rank raised) on."""
    assert "; every rank wrote its dump to " in out, out[-4000:]
    return out.split("; every rank wrote its dump to ", 1)[1]

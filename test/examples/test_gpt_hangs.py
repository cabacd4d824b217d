"""The GPT example's hangs named exactly, with ``VEMESH_HANG_DIR`` and ``--inject``: a rank asleep in compute on 8
gloo ranks of (PP=2, DP=2, TP=2), the run docs/debugging-hangs.md shows; a skipped DP gradient average and a
wrong-sized TP all-reduce on 4 ranks of (DP=2, TP=2) (test/hangs runs the same three on a job of its own); and a
straggler (test/hangs/hang_job.py's rank 2, 50 ms late into every DP all-reduce) named.
The collective timeout is 60 s; every job is over, every process gone, within timeout + 30 s. The
report of the sleep is checked against what docs/debugging-hangs.md shows."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "test" / "hangs"))
sys.path.insert(0, str(REPO / "docs"))
import snippets  # noqa: E402
from hang_runs import TIMEOUT_S, report, torchrun  # noqa: E402

pytestmark = pytest.mark.slow
HANG_JOB = REPO / "test" / "hangs" / "hang_job.py"

GPT = [str(REPO / "examples" / "gpt" / "train.py"), "--n-layer", "2", "--n-embd", "64", "--seq-len", "32",
       "--global-batch-size", "8", "--steps", "6", "--eval-every", "0", "--sample-tokens", "0", "--timeout-s",
       str(TIMEOUT_S)]


@pytest.mark.parametrize("mesh, inject, expected", [
    ("2,2,2", "sleep:5:3",
     ["HANG: TP all-reduce #95 (8.0 KiB, [1, 32, 64] float) at step 3 is stuck in the TP group [4, 5] (PP=1, DP=0)",
      "never entered: rank 5 (PP=1, DP=0, TP=1)",
      "it is not in any collective (in compute), at examples/gpt/faults.py:68 in before_compute",
      "DP all-reduce #16 (130.9 KiB, [33504] float) at step 3 is stuck in the DP group [5, 7] (PP=1, TP=1)"]),
    ("2,2", "skip-dp:3:3", ["is stuck in the DP group [1, 3] (TP=1)", "never entered: rank 3 (DP=1, TP=1)",
                            "it skipped one"]),
    ("2,2", "wrong-size-tp:3:3", ["DIED: rank 2 (DP=1, TP=0): Fatal Python error: Aborted",
                                  "in the TP group [2, 3] (DP=1), rank 3 last entered TP all-reduce #73 of [16] float"]),
])
def test_the_gpt_example_names_each_injected_hang(tmp_path, mesh, inject, expected):
    nproc = 8 if mesh == "2,2,2" else 4
    code, took, out = torchrun(nproc, [*GPT, "--mesh-shape", mesh, "--inject", inject], tmp_path, after_s=20)
    text = report(out)
    assert code != 0 and took < TIMEOUT_S + 30
    for line in expected:
        assert line in text, (line, text)
    if inject.startswith("sleep"):
        shown = snippets.excerpts("test_gpt_hangs")[0]  # what docs/debugging-hangs.md shows of this run
        assert not snippets.missing_from(shown, text), (snippets.missing_from(shown, text), text)


def test_a_straggler_is_named_with_its_lateness(tmp_path):
    code, _, log = torchrun(4, [str(HANG_JOB), "slow"], tmp_path, after_s=20)
    assert code == 0, log[-3000:]
    out = subprocess.run([sys.executable, "-m", "vemesh", "diagnose", "--stragglers", str(tmp_path / "dumps")],
                         cwd=REPO, capture_output=True, text=True)
    line = next(line for line in out.stdout.splitlines() if line.strip().startswith("DP:"))
    assert line.strip().startswith("DP: rank 2 is last into"), out.stdout
    behind = float(line.split(" ms behind")[0].rsplit(" ", 1)[1])
    assert 35 <= behind <= 65, line  # it sleeps 50 ms before each DP all-reduce: within 30%
    shown = snippets.excerpts("test_gpt_hangs")[1]  # what docs/debugging-hangs.md shows of this run
    assert not snippets.missing_from(shown, out.stdout), (snippets.missing_from(shown, out.stdout), out.stdout)

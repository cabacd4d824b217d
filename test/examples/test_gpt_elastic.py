"""Elastic training on torchrun's own agent: two agents on this machine (2 workers each,
``--nnodes=1:2``, c10d rendezvous on localhost). One agent dies mid-run and the survivor goes on
with DP=1; or a second agent joins mid-run and the job grows to DP=2. Every logged loss equals
the uninterrupted run's (one process) within 1e-4. After a death no more than ``--checkpoint-every``
steps are redone; after a join none are, because torchrun stops the workers with SIGTERM and the
example saves at the next step boundary before it exits.

The agent started first hosts the c10d rendezvous store (``--rdzv-endpoint``); as with any c10d
rendezvous, that host must survive, so the test kills the other one.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is needed for the grow: torch 2.13's rendezvous handler
publishes the bootstrap ``MASTER_ADDR``/``MASTER_PORT`` only in its first round when it shares
its TCPStore with the workers, so an agent joining a later round waits for keys that never come
(``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``, ``next_rendezvous``). The
elastic commands of docs/fault-tolerance.md set it too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TRAIN, exclusive, shared_run

sys.path.insert(0, str(REPO / "docs"))
import snippets  # noqa: E402

pytestmark = pytest.mark.slow


#: every agent a test started (``_agent``), killed at its end if still running
_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _one_timed_job_at_a_time(tmp_path_factory):
    """Agents that time rendezvous rounds, like replicas that time quorums, run one set at a time (see
    test_gpt_live_ft.py): two such sets on two busy cores can miss each other's windows. A failed test leaves none
    of its agents running beside the next one."""
    with exclusive(tmp_path_factory, "live-replicas"):
        yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            _kill_tree(proc.pid)


HELD = Path(__file__).with_name("held_train.py")
STEPS, EVERY, TOL = 40, 5, 1e-4  # longer runs amplify the rounding of the DP=1 steps past 1e-4 (2.8e-4 by step 59)
ARGS = ["--n-layer", "2", "--n-embd", "128", "--seq-len", "32", "--global-batch-size", "8", "--steps", str(STEPS),
        "--eval-every", "0", "--sample-tokens", "0", "--log-every", "5", "--mesh-shape", "-1,2", "--timeout-s", "30"]


def _agent(tmp: Path, tag: str, port: int, ckpt: Path, last_call: int = 2, script: Path = TRAIN,
           metrics: str | None = None) -> subprocess.Popen:
    """A torchrun agent of 2 workers, its output in ``{tag}.log``, its metrics in ``m_{metrics or tag}.jsonl``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=elastic-{port}", "--max-restarts=3", "--monitor-interval=1",
           f"--rdzv-conf=last_call_timeout={last_call},keep_alive_interval=2", str(script), *ARGS, "--checkpoint-dir", str(ckpt),
           "--checkpoint-every", str(EVERY), "--metrics-file", str(tmp / f"m_{metrics or tag}.jsonl")]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = open(tmp / f"{tag}.log", "w")
    _STARTED.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True))
    return _STARTED[-1]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(path: Path, step: int, agents: dict[str, subprocess.Popen], timeout: float = 180) -> None:
    """Wait until the metrics in ``path`` reach ``step``; fail at once, with every agent's log, if one exits first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rows = _rows(path)
        if rows and rows[-1]["step"] >= step:
            return
        exited = {tag: proc.poll() for tag, proc in agents.items() if proc.poll() is not None}
        if exited:
            pytest.fail(f"agent {exited} exited before {path.name} reached step {step}\n" + _logs(path.parent, agents))
        time.sleep(0.2)
    last = rows[-1]["step"] if rows else None
    pytest.fail(f"{path.name} did not reach step {step} in {timeout:g} s (last: {last})\n" + _logs(path.parent, agents))


def _logs(tmp: Path, agents: dict[str, subprocess.Popen], chars: int = 2500) -> str:
    return "\n".join(f"--- {tag}.log (end) ---\n{(tmp / f'{tag}.log').read_text()[-chars:]}" for tag in agents)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        pytest.fail("an agent did not finish")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = shared_run([*ARGS, "--mesh-shape", "1,1"], tmp_path_factory)  # one process: a fifth of the 4-rank CPU
    assert run.returncode == 0, run.describe()
    return {r["step"]: r["loss"] for r in run.records}


def _check(rows: list[dict], reference: dict[int, float], log: str) -> None:
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, STEPS + 1)), (steps, log[-3000:])
    diffs = [abs(r["loss"] - reference[r["step"]]) for r in rows]
    assert max(diffs) < TOL, diffs


def test_an_agent_dies_and_the_survivor_finishes_on_dp1(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    # A starts first and so hosts the c10d rendezvous store, which must outlive the failure (it
    # lives with the endpoint's host; on a cluster that is the node --rdzv-endpoint names)
    a = _agent(tmp_path, "a", 29761, ckpt, last_call=15)
    time.sleep(3)
    b = _agent(tmp_path, "b", 29761, ckpt, last_call=15)
    _wait_for_step(tmp_path / "m_a.jsonl", 22, {"a": a, "b": b})
    _kill_tree(b.pid)  # the agent and its workers, as when a node goes down
    b.wait()
    assert _finish(a) == 0, (tmp_path / "a.log").read_text()[-3000:]
    log = (tmp_path / "a.log").read_text()
    rows = _rows(tmp_path / "m_a.jsonl")
    _check(rows, reference, log)
    sizes = [r["world_size"] for r in rows]
    assert sizes[0] == 4 and sizes[-1] == 2 and sorted(set(sizes)) == [2, 4]
    line = next(line for line in log.splitlines() if line.startswith("reconfigured:"))
    assert "mesh [2, 2] (4 processes) -> [1, 2] (2 processes)" in line
    assert int(line.rsplit("steps redone: ", 1)[1]) <= EVERY
    (shown,) = snippets.excerpts("test_gpt_elastic")  # what docs/fault-tolerance.md shows of this run
    assert not snippets.missing_from(shown, log), (snippets.missing_from(shown, log), log[-3000:])


def test_a_second_agent_joins_and_the_job_grows_to_dp2(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    # A's steps are held 1 s each while its world is 2 processes (held_train.py): B's start-up and
    # the new rendezvous round take many seconds on busy cores, and a B that comes after A's last
    # step finds the rendezvous closed and the world never grows
    # Global rank 0 writes the metrics and the "reconfigured" line, read from the metrics written before: after
    # the grow it may be B's first worker (the rendezvous orders the nodes of the new round as they joined it),
    # so both agents name one metrics file, as they name one checkpoint folder (a cluster's shared filesystem).
    # With a file each, a B that took rank 0 found no rows of its own and said nothing (1 run in a loaded CI).
    a = _agent(tmp_path, "a", 29762, ckpt, script=HELD, metrics="ab")
    _wait_for_step(tmp_path / "m_ab.jsonl", 3, {"a": a})
    b = _agent(tmp_path, "b", 29762, ckpt, metrics="ab")
    assert _finish(a) == 0, (tmp_path / "a.log").read_text()[-3000:]
    assert _finish(b) == 0, (tmp_path / "b.log").read_text()[-3000:]
    log = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    rows = _rows(tmp_path / "m_ab.jsonl")
    _check(rows, reference, log)
    sizes = [r["world_size"] for r in rows]
    assert sizes[0] == 2 and sizes[-1] == 4
    line = next(line for line in log.splitlines() if line.startswith("reconfigured:"))
    assert "mesh [1, 2] (2 processes) -> [2, 2] (4 processes)" in line
    # torchrun stopped the workers with SIGTERM to restart them on the larger world: they saved first
    assert "stopping: torchrun sent SIGTERM" in log, log[-3000:]
    assert int(line.rsplit("steps redone: ", 1)[1]) == 0, line

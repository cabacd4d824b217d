"""Helpers for the GPT example's tests: import its modules, and run train.py as a user would."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch import run_main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gpt"
TRAIN = EXAMPLE / "train.py"

# The example's modules import each other by plain name, as a script in its folder does.
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    records: list[dict]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]

    def describe(self) -> str:
        return f"exit {self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-4000:]}"


def run_train(
    args: list[str],
    tmp_path: Path,
    *,
    nproc: int | None = None,
    timeout: float = 240.0,
    torchrun_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    torchrun: bool = False,
) -> Run:
    """Run ``train.py`` with ``args``: plain ``python`` when ``nproc`` is None, else on ``nproc`` gloo ranks.

    The ranks are started by ``launch.run_main``, torchrun's environment from the test process's forkserver (torch
    and the example imported once, not per rank: about 15 s less CPU a 4-rank run). ``torchrun=True`` (implied
    by ``torchrun_args``, e.g. ``--max-restarts=1``) launches torchrun itself, for the tests of what torchrun does.
    Adds ``--metrics-file`` and returns its records. A run that outlives ``timeout`` is killed, every rank of
    it, and fails the test. ``env`` goes into the environment.
    """
    metrics = tmp_path / f"metrics-{len(list(tmp_path.glob('metrics-*')))}.jsonl"
    run_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    run_env.pop("WORLD_SIZE", None)
    run_env.pop("RANK", None)
    run_env.update(env or {})
    argv = [*args, "--metrics-file", str(metrics)]
    if nproc is not None and not (torchrun or torchrun_args):
        try:
            done = run_main("train", argv, nproc, env=run_env, cwd=str(REPO), path=str(EXAMPLE), timeout=timeout)
        except TimeoutError as e:
            pytest.fail(f"train.py {' '.join(argv)} on {nproc} ranks: {e}")
        returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
    else:
        cmd = [sys.executable]
        if nproc is not None:
            cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *(torchrun_args or [])]
        cmd += [str(TRAIN), *argv]
        proc = subprocess.Popen(cmd, cwd=REPO, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"{' '.join(cmd)} did not finish within {timeout:.0f}s\n{stdout[-3000:]}\n{stderr[-3000:]}")
        returncode = proc.returncode
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return Run(returncode, stdout, stderr, records)


def shared_run(args: list[str], tmp_path_factory: pytest.TempPathFactory, nproc: int | None = None) -> Run:
    """``run_train(args, nproc=nproc)`` run once per test session: the pytest-xdist workers that need the
    same reference run share it (a file lock in the session's temporary root) instead of each running it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's root, above every worker's own
    key = hashlib.sha256(json.dumps([args, nproc]).encode()).hexdigest()[:16]
    saved = root / f"reference-{key}.json"
    with open(root / f"reference-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits for the first one's run
        if saved.exists():
            return Run(**json.loads(saved.read_text()))
        run = run_train(args, tmp_path_factory.mktemp("reference"), nproc=nproc)
        if run.returncode == 0:
            saved.write_text(json.dumps(dataclasses.asdict(run)))
        return run


@contextlib.contextmanager
def exclusive(tmp_path_factory: pytest.TempPathFactory, name: str):
    """Hold a lock of the whole test session named ``name``: the pytest-xdist workers run such blocks one at a time
    (live replicas that time quorums must not share two cores with another set of live replicas)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield

"""A new user's path: the built wheel in a fresh venv, used from a directory outside the checkout.

Builds the wheel (``pip wheel``), installs it into a new virtual environment with the constraints file
(what a user of the wheel types), and runs there, from a scratch directory, every snippet of
``docs/data-parallel.md`` and ``docs/checkpoints.md`` under torchrun, each printing what the page shows; and
``vemesh plan`` for the GPT preset and for a user's own ``mymodel.py`` in that directory, with the figures the
checkout prints; and a hang named by ``VEMESH_HANG_DIR`` and ``vemesh diagnose``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "docs"))
import snippets  # noqa: E402

pytestmark = pytest.mark.slow

PAGES = ("data-parallel.md", "checkpoints.md")


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="session")
def venv(tmp_path_factory) -> Path:
    """A fresh venv holding the wheel of this checkout and its dependencies, pinned as the README pins them.

    Built once per run, whichever pytest-xdist worker asks first: the workers share the base temp's parent, and the
    others wait on the lock, then use the venv the first one finished (about 100 s of building saved per worker).
    """
    import fcntl

    base = tmp_path_factory.getbasetemp()  # under xdist, each worker's base lies in the run's own folder
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "wheel-venv"
    root.mkdir(exist_ok=True)
    python = root / "venv" / "bin" / "python"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the build below raises
        if not (root / "ready").exists():
            _build(root)
            (root / "ready").write_text(str(python))
    return python


def _build(root: Path) -> None:
    for name in ("source", "dist", "venv"):  # a build that failed part-way leaves no half venv behind
        shutil.rmtree(root / name, ignore_errors=True)
    source = root / "source"  # built from a copy: setuptools writes build/ and *.egg-info into the tree it builds
    source.mkdir()
    for name in ("vemesh", "setup.cfg", "setup.py", "pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
          str(source)], root)
    (wheel,) = (root / "dist").glob("vemesh-*.whl")
    _run([sys.executable, "-m", "venv", str(root / "venv")], root)
    python = root / "venv" / "bin" / "python"
    # --no-compile: the same files installed, without byte-compiling all of torch up front (16 of 28 s alone).
    # One import of what the tests use compiles those modules once, before four workers of a torchrun would each
    # compile them at the same time.
    _run([str(python), "-m", "pip", "install", "-q", "--no-compile", "-c", str(REPO / "constraints.txt"),
          f"{wheel}[ft]"], root)
    _run([str(python), "-c", "import torch.distributed.run, torch.distributed.checkpoint, vemesh, vemesh.ddp, "
          "vemesh.optim, vemesh.checkpoint, vemesh.ft, vemesh.cli"], root)


def test_the_wheel_holds_the_package_and_nothing_of_the_checkout(venv) -> None:
    user = venv.parents[2] / "user"
    user.mkdir(exist_ok=True)
    out = _run([str(venv), "-c", "import vemesh, vemesh.ddp, vemesh.optim, vemesh.checkpoint, vemesh.ft; "
                "print(vemesh.__file__)"], user).stdout
    assert "site-packages" in out and str(REPO) not in out, out


@pytest.mark.parametrize("page", PAGES)
def test_each_snippet_runs_from_a_wheel_outside_the_checkout(venv, page) -> None:
    user = venv.parents[2] / f"user-{page}"
    user.mkdir(exist_ok=True)
    blocks = [b for b in snippets.blocks(REPO / "docs" / page) if b.lang == "python" and b.mode[0] == "gloo"]
    assert blocks, page
    for i, block in enumerate(blocks):
        (user / f"snippet{i}.py").write_text(block.text)
        script = user / f"run_snippet{i}.py"  # leaves with os._exit, as the docs tests do: see the gloo exit race
        script.write_text(f"import os, runpy, sys\nrunpy.run_path('snippet{i}.py', run_name='__main__')\n"
                          "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)\n")
        shown = block.output.text if block.output is not None else ""
        printed = _run([str(venv), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={block.mode[1]}",
                        script.name], user).stdout
        assert printed.strip() == shown.strip(), f"{block.where}: printed\n{printed}\nshown\n{shown}"


PLANS = {  # the GPT preset, and a user's own model with its parallelize function and step, in the user's folder
    "gpt": ["--model", "gpt:n_layer=2,n_embd=192,n_head=4", "--world-size", "4", "--tp", "2", "--json"],
    "mymodel": ["--model", "module:mymodel:make", "--parallelize", "mymodel:parallelize", "--step", "mymodel:step",
                "--world-size", "4", "--tp", "2", "--global-batch-size", "8", "--json"],
}


@pytest.mark.parametrize("name", list(PLANS))
def test_vemesh_plan_runs_from_a_wheel_with_the_figures_of_the_checkout(venv, name, monkeypatch, capsys) -> None:
    import json

    from vemesh.cli import main

    user = venv.parents[2] / f"user-plan-{name}"
    user.mkdir(exist_ok=True)
    shutil.copy(REPO / "examples" / "my_model" / "mymodel.py", user / "mymodel.py")
    vemesh = venv.parent / "vemesh"
    from_wheel = json.loads(_run([str(vemesh), "plan", *PLANS[name]], user).stdout)
    # the checkout's figures in this process (what `vemesh plan` prints there, without a second interpreter)
    monkeypatch.chdir(REPO / "examples" / "my_model")
    monkeypatch.syspath_prepend(str(REPO / "examples" / "my_model"))
    capsys.readouterr()
    assert main(["plan", *PLANS[name]]) == 0
    here = json.loads(capsys.readouterr().out)
    assert from_wheel == here
    assert from_wheel["peak"] > 0 and from_wheel["classes"][0]["bytes_per_step"]["TP"] > 0


def test_a_hang_is_named_from_a_wheel(venv) -> None:
    """VEMESH_HANG_DIR on a job run by the wheel's torchrun outside the checkout, then the wheel's ``vemesh diagnose``."""
    user = venv.parents[2] / "user-hang"
    user.mkdir(exist_ok=True)
    shutil.copy(REPO / "test" / "hangs" / "hang_job.py", user / "hang_job.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "WORLD_SIZE", "RANK")}
    env.update(OMP_NUM_THREADS="1", VEMESH_HANG_DIR=str(user / "dumps"), VEMESH_HANG_AFTER="6")
    job = subprocess.run([str(venv), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "hang_job.py",
                          "sleep"], cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert job.returncode != 0 and "never entered: rank 3 (DP=1, TP=1)" in job.stderr, job.stderr[-3000:]
    shown = _run([str(venv.parent / "vemesh"), "diagnose", "dumps"], user).stdout
    assert "stuck in the DP group [1, 3] (TP=1)" in shown and "hang_job.py:36 in compute: time.sleep(600)" in shown, shown

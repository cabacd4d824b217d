"""The fenced blocks of the README and docs/, and how each one is run.

Every block that shows code or output is one of these; ``docs/regenerate.py`` writes the outputs and
``test/docs/`` checks them.

* ```` ```python fake:N ````: a snippet run as every rank of an ``N``-rank world on torch's fake
  backend, one rank after another in one process (mesh queries: no data moves).
* ```` ```python gloo:N ````: a snippet run on ``N`` real gloo processes (``test/launch.py``), as
  ``torchrun --nproc_per_node=N`` would run it; ``gloo:N lighthouse`` first starts a torchft
  lighthouse and sets ``TORCHFT_LIGHTHOUSE``.
* ```` ```python gloo:N needs:MODULE ````: a snippet that imports a package outside the ``test`` extra
  (``needs:torchtitan``, the ``titan`` extra); where ``MODULE`` is not installed its test skips, naming the
  extra, and ``docs/regenerate.py`` leaves its output as it is.
* ```` ```python not-run ````: cannot run here (several hosts, a GPU, a crash that comes only
  sometimes); the text before it must say so.
* A ```` ```text ```` block right after a snippet is what it printed: every rank's output, in rank order.
* ```` ```console ```` blocks whose first line is ``$ vemesh ...``, ``$ torchrun ...`` or
  ``$ python ...``: the command and what it prints. A training run is shown up to its first
  ``step`` line (its start-up); timings, throughput and the standard library's path are masked
  when compared.
* ```` ```bash ```` blocks hold commands to copy: those that start the example are checked for
  their start-up too, unless marked ``bash multi-node`` (the text must say it needs hosts),
  ``bash setup`` (set-up and test commands: what CI runs) or ``bash together`` (one script, run by
  its own test).
* ```` ```text from:TEST ```` holds lines of a run that no one command makes (a killed replica, a
  second agent); ``test/examples/TEST.py`` makes that run and checks each line, numbers aside.
* ```` ```text layout ```` is the project's file list; a test checks that each path exists.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
MODES = ("fake", "gloo", "not-run")


@dataclass
class Block:
    """One fenced block: where it is, its info string and its text."""

    path: Path
    start: int  #: offset of the opening fence
    end: int  #: offset just past the closing fence
    line: int  #: the opening fence's line, from 1
    info: list[str]
    text: str
    output: Block | None = field(default=None, repr=False)  #: for a snippet, the text block after it

    @property
    def lang(self) -> str:
        return self.info[0] if self.info else ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def mode(self) -> tuple[str, int]:
        """``("fake" | "gloo", world)`` or ``("not-run", 0)`` for a python block."""
        for token in self.info[1:]:
            kind, _, n = token.partition(":")
            if kind in ("fake", "gloo") and n.isdigit():
                return kind, int(n)
            if kind == "not-run":
                return kind, 0
        raise ValueError(f"{self.where}: a python block needs one of fake:N, gloo:N or not-run after 'python' "
                         f"(see docs/snippets.py); it has {' '.join(self.info)!r}")

    @property
    def needs(self) -> list[str]:
        """The modules a snippet imports from outside the ``test`` extra (``needs:MODULE`` tokens)."""
        return [t.partition(":")[2] for t in self.info[1:] if t.startswith("needs:")]

    @property
    def missing(self) -> list[str]:
        """Those of :attr:`needs` that are not installed here."""
        return [m for m in self.needs if importlib.util.find_spec(m) is None]

    @property
    def command(self) -> str:
        """A console block's command: its first line after ``$ ``, continuation lines joined."""
        lines = self.text.split("\n")
        cmd = [lines[0][2:]]
        while cmd[-1].endswith("\\"):
            cmd[-1] = cmd[-1][:-1]
            cmd.append(lines[len(cmd)])
        return " ".join(c.strip() for c in cmd)

    @property
    def shown(self) -> str:
        """A console block's output: everything after the command's lines."""
        n = 1 + sum(1 for line in self.text.split("\n") if line.endswith("\\"))
        return "\n".join(self.text.split("\n")[n:])


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "api.md")]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``; a text block right after a python one (blank lines between) is its output."""
    text = path.read_text()
    found = [Block(path, m.start(), m.end(), text.count("\n", 0, m.start()) + 1, m.group(1).split(), m.group(2))
             for m in FENCE.finditer(text)]
    for before, after in zip(found, found[1:]):
        if before.lang == "python" and after.lang == "text" and not text[before.end:after.start].strip():
            before.output = after
    return found


def snippets() -> list[Block]:
    return [b for path in documents() for b in blocks(path) if b.lang == "python"]


def console(kind: str) -> list[Block]:
    """Console blocks whose command starts with ``kind`` (``vemesh``, or ``run`` for torchrun/python)."""
    heads = ("vemesh ",) if kind == "vemesh" else ("torchrun ", "python ")
    return [b for path in documents() for b in blocks(path)
            if b.lang == "console" and b.text.startswith("$ ") and b.command.startswith(heads)]


def commands() -> list[tuple[Block, str]]:
    """Each command line of the unmarked bash blocks that runs the example (``torchrun``/``python examples/``)."""
    out = []
    for path in documents():
        for b in blocks(path):
            if b.lang != "bash" or {"multi-node", "setup", "together"} & set(b.info):
                continue
            for line in b.text.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith(("torchrun ", "python examples/")):
                    out.append((b, line))
    return out


# ---- running snippets -------------------------------------------------------------------------------


def _exec(source: str, name: str) -> str:
    """Run ``source`` as a script runs (a fresh ``__main__`` namespace); what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, name, "exec"), {"__name__": "__main__"})
    return out.getvalue()


def _gloo_rank(rank: int, world: int, source: str, name: str, cwd: str) -> str:
    from vemesh import VESCALE_DEVICE_MESH

    os.chdir(cwd)  # files the snippet writes land in a scratch directory
    try:
        return _exec(source, name)
    finally:
        VESCALE_DEVICE_MESH.reset()


def run_snippet(block: Block) -> str:
    """Run one python block as its info string says; every rank's output in rank order."""
    kind, world = block.mode
    if kind == "not-run":
        raise ValueError(f"{block.where} is marked not-run")
    name = f"<{block.where}>"
    if kind == "fake":
        return _run_fake(block.text, world, name)
    return _run_gloo(block.text, world, name, lighthouse="lighthouse" in block.info)


def _run_fake(source: str, world: int, name: str) -> str:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vemesh import VESCALE_DEVICE_MESH

    printed = []
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        for rank in range(world):
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
            dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
            try:
                printed.append(_exec(source, name))
            finally:
                VESCALE_DEVICE_MESH.reset()
                dist.destroy_process_group()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return "".join(printed)


def _run_gloo(source: str, world: int, name: str, lighthouse: bool) -> str:
    if str(ROOT / "test") not in sys.path:
        sys.path.insert(0, str(ROOT / "test"))
    from launch import run_ranks

    env = {}
    with contextlib.ExitStack() as stack:
        cwd = stack.enter_context(tempfile.TemporaryDirectory())
        if lighthouse:
            import torch.distributed as dist
            from torchft.coordination import LighthouseServer

            os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse logs every quorum otherwise
            server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
            stack.callback(server.shutdown)
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            env = {"TORCHFT_LIGHTHOUSE": server.address(), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(store.port), "RUST_LOG": "warn"}
        return "".join(run_ranks(_gloo_rank, world, source, name, cwd, timeout=180.0, env=env))


# ---- running commands --------------------------------------------------------------------------------


def _argv(command: str) -> list[str]:
    argv = shlex.split(command)
    if argv[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    raise ValueError(f"cannot run {command!r}: only torchrun and python commands are run")


def _example_ranks(command: str) -> tuple[int, list[str]] | None:
    """``(N, args)`` for ``torchrun --standalone --nproc_per_node=N examples/gpt/train.py ARGS``, else None."""
    argv = shlex.split(command)
    if argv[:2] != ["torchrun", "--standalone"] or len(argv) < 4 or argv[3] != "examples/gpt/train.py":
        return None
    flag, _, n = argv[2].partition("=")
    return (int(n), argv[4:]) if flag in ("--nproc_per_node", "--nproc-per-node") and n.isdigit() else None


def _stepped(text: str) -> bool:
    return any(line.startswith("step ") for line in text.splitlines())


def startup(command: str, timeout: float = 240.0) -> str:
    """What ``command`` prints on stdout up to and including its first ``step`` line (all of it if it has none).

    It runs from a scratch directory that sees the repository's ``examples/``, so files it writes
    (metrics, checkpoints) land there; a training run is stopped once its first step is printed.
    ``torchrun --standalone --nproc_per_node=N examples/gpt/train.py ...`` runs the example's ``main`` on N ranks in
    torchrun's environment from the test process's forkserver (``test/launch.py``), which prints the same
    without N imports of torch; the README's command is also run by torchrun itself in the example's tests.
    """
    ranks = _example_ranks(command)
    if ranks is not None:
        return _startup_on_ranks(command, *ranks, timeout=timeout)
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "stderr", "w+") as errors:  # a file: never full
        os.symlink(ROOT / "examples", Path(tmp) / "examples")
        proc = subprocess.Popen(_argv(command), cwd=tmp, stdout=subprocess.PIPE, stderr=errors, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines: list[str] = []
        deadline = time.monotonic() + timeout
        trained = False
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # ends when the command closes its output: it is exiting
                lines.append(line)
                trained = line.startswith("step ")
                if trained or time.monotonic() > deadline:
                    break
        finally:
            if trained or proc.poll() is None and time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            else:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    raise
            errors.seek(0)
            err = errors.read()
        if not trained and proc.returncode != 0:
            raise RuntimeError(f"`{command}` exited with {proc.returncode} before a step:\n{''.join(lines)}{err[-3000:]}")
        return "".join(lines)


def _startup_on_ranks(command: str, world: int, args: list[str], timeout: float) -> str:
    if str(ROOT / "test") not in sys.path:
        sys.path.insert(0, str(ROOT / "test"))
    from launch import run_main

    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(ROOT / "examples", Path(tmp) / "examples")
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # torchrun's, for more ranks than cores
        run = run_main("train", args, world, env=env, cwd=tmp, path=str(ROOT / "examples" / "gpt"), timeout=timeout,
                       until=_stepped)
    if not run.stopped and run.returncode != 0:
        raise RuntimeError(f"`{command}` exited with {run.returncode} before a step:\n{run.stdout}{run.stderr[-3000:]}")
    lines = run.stdout.splitlines(keepends=True)
    end = next((i + 1 for i, line in enumerate(lines) if line.startswith("step ")), len(lines))
    return "".join(lines[:end])


_MASKS = [
    (re.compile(r" *[\d,]+ tok/s"), " N tok/s"),  # the padding too: the columns are right-aligned
    (re.compile(r" *\b\d+\.\d+s\b"), " T s"),
    (re.compile(r"\([^()\s]*/lib/python3\.\d+/\*\.py\)"), "(STDLIB/*.py)"),
    # an exact check's rounding: its last digits, and the tensor they fall on, follow the CPU's kernels (the same on one
    # machine run after run: 1.0e-06 on norm2's gradient where the docs were made, 9.2e-07 on norm1's on an AVX-512
    # EPYC)
    (re.compile(r"largest relative difference \d\.\de-\d\d \([^()]*\), within"),
     "largest relative difference R (AT), within"),
]


def masked(text: str) -> str:
    """``text`` with timings, throughput and the standard library's path masked."""
    for pattern, mask in _MASKS:
        text = pattern.sub(mask, text)
    return text


# ---- outputs of runs that one command cannot make (several agents, a killed replica) ----------------


def excerpts(source: str) -> list[Block]:
    """The ``text from:SOURCE`` blocks: lines of a run that the test ``SOURCE`` makes, and checks."""
    return [b for path in documents() for b in blocks(path) if b.lang == "text" and f"from:{source}" in b.info]


def _numbers_masked(line: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", line.strip())


def missing_from(excerpt: Block, log: str) -> list[str]:
    """The lines of ``excerpt`` that ``log`` has no line like (numbers aside: steps, times and ports vary).

    A log line may run on past the shown one (a process that shares the terminal can write onto the
    same line), and a shown line that ends in `` …`` stands for every line that starts like it (an
    error text that varies).
    """
    seen = [_numbers_masked(line) for line in log.splitlines()]

    def found(line: str) -> bool:
        want = _numbers_masked(line).removesuffix(" …")
        return any(s.startswith(want) for s in seen)

    return [line for line in excerpt.text.splitlines() if not found(line)]

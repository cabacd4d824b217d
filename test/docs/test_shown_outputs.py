"""Everything the README and docs/ show is what the code does now.

* every ``vemesh`` output shown is what the command prints (``docs/regenerate.py`` writes them);
* every Python snippet runs, on torch's fake backend or on real gloo ranks, and prints what is shown under it;
* every shown start-up of the example is what the command prints, timings and throughput aside;
* every command that starts the example, in a bash block, starts and trains a step;
* every block is of a kind that one of these checks, or is marked as not run here, with the reason in the text.

A failure names the file, the line and the block; ``python docs/regenerate.py`` rewrites what drifted.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from launch import free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))
import regenerate  # noqa: E402
import snippets  # noqa: E402

ALL = [b for path in snippets.documents() for b in snippets.blocks(path)]
VEMESH = snippets.console("vemesh")
RUNS = snippets.console("run")
SNIPPETS = [b for b in snippets.snippets() if b.mode[0] != "not-run"]
COMMANDS = snippets.commands()
STALE = "; run python docs/regenerate.py to rewrite it"


def _slow(block: snippets.Block) -> bool:
    argv = regenerate.vemesh_argv(block)
    shaped = any(flag in argv for flag in ("--pp", "--tp", "--dp"))
    search = "--model" in argv and "--device-memory" in argv and not shaped  # a search over every mesh: 25 s
    pipeline = "--model" in argv and "--pp" in argv  # a pipeline traced on every PP rank: 10 s and more
    return search or pipeline or argv[:1] == ["check"]  # vemesh check: the functions run on gloo ranks and one process


def _params(blocks, slow=lambda b: False):
    return [pytest.param(b, marks=[pytest.mark.slow] if slow(b) else [], id=b.where) for b in blocks]


def _check(block: snippets.Block) -> None:
    holder, shown, now = regenerate.generated(block)
    assert regenerate.same(shown, now), (
        f"{block.where}: `{block.text.splitlines()[0]}` now gives\n{now}\nbut the docs show\n{shown}{STALE}")


@pytest.mark.parametrize("block", _params(VEMESH, _slow))
def test_a_shown_vemesh_output_is_what_the_command_prints(block) -> None:
    _check(block)


@pytest.mark.parametrize("block", _params(SNIPPETS))
def test_a_snippet_runs_and_prints_what_is_shown(block) -> None:
    if block.missing:
        pytest.skip(f"{block.where} needs {', '.join(block.missing)}: the 'titan' extra, "
                    'pip install -c constraints.txt -e ".[test,titan]"')
    _check(block)


@pytest.mark.slow
@pytest.mark.parametrize("block", _params(RUNS))
def test_a_shown_start_up_is_what_the_command_prints(block) -> None:
    _check(block)


@pytest.mark.slow
@pytest.mark.parametrize("block, command", [pytest.param(b, c, id=f"{b.where}:{c[:60]}") for b, c in COMMANDS])
def test_a_command_in_the_docs_starts_and_trains_a_step(block, command) -> None:
    out = snippets.startup(command)
    assert out.splitlines()[-1].startswith("step "), f"{block.where}: `{command}` printed\n{out}"


@pytest.mark.slow
def test_the_live_fault_tolerance_commands_run_together_as_written() -> None:
    """The lighthouse and two replicas, the block of docs/fault-tolerance.md as one script, until both train."""
    (block,) = [b for b in ALL if b.lang == "bash" and "together" in b.info]
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(ROOT / "examples", Path(tmp) / "examples")
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "PYTHONUNBUFFERED": "1"}
        script = block.text.replace("torchrun ", f"{sys.executable} -m torch.distributed.run ")
        for port in sorted(set(re.findall(r"\b29[5-9]\d\d\b", script))):  # the ports as written may be taken by
            script = re.sub(rf"\b{port}\b", str(free_port()), script)  # another test of the suite: free ones
        proc = subprocess.Popen(["bash", "-c", script],
                                cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        lines, deadline = [], time.monotonic() + 240
        try:
            for line in proc.stdout:
                lines.append(line)
                if sum(1 for seen in lines if seen.startswith("step ")) >= 2 or time.monotonic() > deadline:
                    break
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = "".join(lines)
    assert sum(1 for seen in lines if seen.startswith("step ")) >= 2, f"{block.where}: both replicas should train:\n{log}"
    assert "fault tolerance: quorum change at step 1: replicas [] -> [" in log, log


def _text_before(b: snippets.Block) -> str:
    return " ".join(b.path.read_text()[max(0, b.start - 600):b.start].lower().split())


def test_every_block_is_generated_checked_or_marked_with_its_reason() -> None:
    outputs = {id(b.output) for b in ALL if b.output is not None}
    for b in ALL:
        if b.lang == "python":
            kind, world = b.mode  # raises for a python block that says nothing
            if kind == "not-run":
                before = _text_before(b)
                assert "not run" in before, f"{b.where}: a not-run snippet must say why, in the text before it"
        elif b.lang == "console":
            assert b.text.startswith("$ "), f"{b.where}: a console block starts with the command it shows"
        elif b.lang == "bash":
            if "multi-node" in b.info:
                before = _text_before(b)
                assert "multi-node" in before or "two hosts" in before, f"{b.where}: say in the text that it needs hosts"
        elif b.lang == "text":
            tagged = "layout" in b.info or any(t.startswith("from:") for t in b.info)
            assert id(b) in outputs or tagged, f"{b.where}: a text block must be a snippet's output, or say where it comes from"
        else:
            raise AssertionError(f"{b.where}: a ```{b.lang} block is none of python, console, bash or text")


def test_every_excerpt_of_a_run_is_checked_by_the_test_it_names() -> None:
    for b in ALL:
        for tag in (t for t in b.info if t.startswith("from:")):
            test = ROOT / "test" / "examples" / f"{tag[5:]}.py"
            assert test.exists() and "missing_from" in test.read_text(), f"{b.where}: {test} must check it"


INLINE = re.compile(r"`(vemesh (?:show|plan) [^`]+)`")


def test_every_inline_vemesh_command_runs() -> None:
    ran = 0
    for path in snippets.documents():
        for m in INLINE.finditer(path.read_text()):
            argv = m.group(1).replace("\n", " ").split()[1:]
            if len(argv) < 3:  # a name, such as `vemesh plan --model`, not a command
                continue
            regenerate.output_of(argv)  # SystemExit on a bad command
            ran += 1
    assert ran >= 5


def test_the_layout_lists_paths_that_exist_and_every_module() -> None:
    (block,) = [b for b in ALL if b.lang == "text" and "layout" in b.info]
    listed = [line.split()[0] for line in block.text.splitlines() if line.strip()]
    for path in listed:
        assert (ROOT / path).exists(), f"{block.where}: {path} does not exist"
    for module in sorted((ROOT / "vemesh").glob("*.py")):
        rel = f"vemesh/{module.name}"
        assert module.name in ("__init__.py", "__main__.py") or rel in listed, f"{block.where}: {rel} is not listed"


def test_a_hand_edit_is_caught() -> None:
    block = next(b for b in VEMESH if not _slow(b))
    edited = block.shown.replace("\n", " (edited)\n", 1)
    assert regenerate.output_of(regenerate.vemesh_argv(block)) != edited
    snippet = next(b for b in SNIPPETS if b.mode[0] == "fake" and b.output)
    assert snippets.run_snippet(snippet) != snippet.output.text.replace("\n", " (edited)\n", 1)


def test_masking_hides_timings_and_throughput_only() -> None:
    a = "step     1/200 | loss 5.5504 | lr 2.00e-04 |     2016 tok/s |    1.0s\n"
    b = "step     1/200 | loss 5.5504 | lr 2.00e-04 |     1658 tok/s |    1.2s\n"
    assert snippets.masked(a) == snippets.masked(b)
    assert snippets.masked(a) == snippets.masked(a.replace("   2016 tok/s |    1.0s", "  20160 tok/s |   10.0s"))
    assert snippets.masked(a) != snippets.masked(a.replace("5.5504", "5.5505"))


def test_there_is_something_of_each_kind_to_check() -> None:
    assert len(VEMESH) >= 4 and len(SNIPPETS) >= 10 and len(RUNS) >= 4 and len(COMMANDS) >= 1
    assert {b.mode[0] for b in SNIPPETS} == {"fake", "gloo"}


TOPICS = ["mesh", "views", "data-parallel", "pipeline", "context-parallel", "moe", "checkpoints", "fault-tolerance",
          "planning", "vescale", "troubleshooting"]


def test_the_front_page_is_short_and_links_every_topic_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 200
    for topic in TOPICS:
        assert (ROOT / "docs" / f"{topic}.md").exists() and f"(docs/{topic}.md)" in readme, topic


def test_the_api_reference_is_the_docstrings_of_today() -> None:
    assert (ROOT / "docs" / "api.md").read_text() == regenerate.api_markdown(), (
        "docs/api.md differs from the docstrings; run python docs/regenerate.py")

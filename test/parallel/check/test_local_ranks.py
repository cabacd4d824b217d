"""``vemesh.local_ranks.start``: the ranks of ``vemesh check`` and ``vemesh calibrate``, forked from a server that
imported torch once, with spawn's semantics: each call's ranks see the caller's environment as it is at that call."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest

from vemesh import local_ranks


def _report(rank: int, out: str) -> None:
    Path(out, f"{rank}.json").write_text(json.dumps({
        "value": os.environ.get("VEMESH_LOCAL_RANKS_TEST"), "parent": os.getppid(), "path": sys.path[:3],
        "cwd": os.getcwd()}))


def _fail(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1's own error")


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here")
def test_each_calls_ranks_see_the_callers_environment_of_that_call(tmp_path, monkeypatch) -> None:
    seen = []
    for value in ("first", "second"):  # the second call's ranks fork from the server the first one started
        monkeypatch.setenv("VEMESH_LOCAL_RANKS_TEST", value)
        out = tmp_path / value
        out.mkdir()
        assert local_ranks.start(_report, (str(out),), 2, join=True) is None
        seen.append([json.loads((out / f"{r}.json").read_text()) for r in range(2)])
    assert [[r["value"] for r in ranks] for ranks in seen] == [["first"] * 2, ["second"] * 2]
    parents = {r["parent"] for ranks in seen for r in ranks}
    assert len(parents) == 1 and os.getpid() not in parents  # one server, not this process, forked all four
    assert all(r["path"] == sys.path[:3] and r["cwd"] == os.getcwd() for ranks in seen for r in ranks)


def test_a_ranks_error_reaches_the_caller_and_its_file_is_removed(tmp_path, monkeypatch) -> None:
    """The traceback torch's rank writes into a file of the temporary directory reaches the caller, and the file does
    not stay there (torch's join reads it and leaves it: every failed ``vemesh check`` left one a failed rank)."""
    import tempfile

    import torch.multiprocessing as mp

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(mp.ProcessRaisedException, match="rank 1's own error"):
        local_ranks.start(_fail, (), 2, join=True)
    assert list(tmp_path.glob("pytorch-errorfile-*")) == []  # (multiprocessing's own pymp-* lives on)


def test_the_libraries_a_users_code_uses_are_named_for_the_server_and_its_own_modules_are_not(tmp_path,
                                                                                               monkeypatch) -> None:
    """A user's file that imports an installed library (by module, and a class of it), a file beside it, and holds an
    object that raises when asked anything: the
    library's modules this process imported are named, in the order it imported them; the user's own files, the
    standard library, torch (imported by the server anyway) and vemesh are not."""
    pytest.importorskip("hypothesis")
    (tmp_path / "helpers.py").write_text("def width():\n    return 8\n")
    (tmp_path / "usermodel.py").write_text(
        "import json\nimport torch\nimport hypothesis\nfrom hypothesis.strategies import integers\n"
        "import helpers\nimport vemesh\n\ndef make():\n    return torch.nn.Linear(helpers.width(), 2)\n\n"
        "class Step:\n    pass\n\n"
        "class Proxy:\n    def __getattribute__(self, name):\n        raise RuntimeError('not loaded yet')\n\n"
        "lazy = Proxy()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import usermodel

    names = local_ranks.libraries_of([usermodel.make, usermodel.Step])
    assert "hypothesis" in names and "hypothesis.strategies" in names, names
    assert {n.partition(".")[0] for n in names} == {"hypothesis"}, names
    order = list(sys.modules)
    assert names == sorted(names, key=order.index)
    assert local_ranks.libraries_of([len, print]) == []  # builtins: nothing to import


@pytest.mark.slow  # a program of its own, and its server started twice: about 6 s
@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here")
def test_a_library_that_raises_in_the_server_is_imported_by_each_rank_instead(tmp_path) -> None:
    """A library the parent imported may raise in the ranks' server something other than ImportError, which Python's
    server does not pass over: it stopped, and the ranks never started ("EOFError: unexpected EOF"). The server is
    started again without it, the ranks run, and a warning names the library. In a program of its own: this one's
    server is running already."""
    import subprocess

    (tmp_path / "badlib.py").write_text("import os\nif os.environ['PARENT_PID'] != str(os.getpid()):\n"
                                        "    raise RuntimeError('badlib imports in its parent only')\n")
    (tmp_path / "job.py").write_text(
        "import os, sys\nos.environ['PARENT_PID'] = str(os.getpid())\nimport badlib\nfrom vemesh import local_ranks\n\n"
        "def hello(rank):\n    os.write(1, f'rank {rank} ran\\n'.encode())\n\n"
        "if __name__ == '__main__':\n    local_ranks.start(hello, (), 2, join=True, preload=('badlib',))\n")
    done = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    # each rank's line in one write (print's pieces and its newline, written apart, interleaved once in CI:
    # "rank 0 ranrank 1 ran\n\n")
    assert sorted(line for line in done.stdout.split("\n") if line) == ["rank 0 ran", "rank 1 ran"], done.stdout
    assert "badlib imports in its parent only" in done.stderr  # the server's own traceback
    assert "the ranks' server stopped at an error importing badlib (above); each rank imports it itself" in done.stderr

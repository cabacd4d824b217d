"""The ``vemesh`` command line (show, plan) and the layout checks behind it.

Most cases call ``vemesh.cli.main(argv)`` in-process; a few run the real command
as a subprocess (each costs a Python start and, through ``vemesh/__init__``, a
torch import). Expected groups come from numpy, never from vemesh: the groups
along dim ``d`` are the rows of ``arange(n).reshape(shape)`` with ``d`` moved last.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vemesh import cli
from vemesh.layout.describe import check_layout, describe_layout, layout_document
from vemesh.layout import MeshLayout
from vemesh.planning.mesh_plan import plan_mesh

REPO = Path(__file__).resolve().parents[3]
NAMES = ("PP", "DP", "CP", "TP", "EP")


# ------------------------------------------------------------------ expected values
def numpy_groups(shape: tuple[int, ...], dim: int) -> list[list[int]]:
    """Groups along ``dim``: rows of the rank grid with ``dim`` moved last (other dims keep row-major order)."""
    grid = np.arange(math.prod(shape)).reshape(shape)
    return np.moveaxis(grid, dim, -1).reshape(-1, shape[dim]).tolist()


def crossing(groups: list[list[int]], dph: int) -> list[bool]:
    """For each group: does it hold ranks of more than one host?"""
    return [len({r // dph for r in g}) > 1 for g in groups]


def expected_warnings(shape: tuple[int, ...], names: tuple[str, ...], dph: int | None) -> set[tuple[str, str | None]]:
    """The (kind, dim) warnings the issue asks for, from numpy groups."""
    found: set[tuple[str, str | None]] = set()
    if dph is not None:
        for name in ("TP", "CP"):
            if name in names and any(crossing(numpy_groups(shape, names.index(name)), dph)):
                found.add(("spans_hosts", name))
        if math.prod(shape) % dph:
            found.add(("partial_host", None))
    if "TP" in names:
        i = names.index("TP")
        if shape[i] > 1 and any(s > 1 for s in shape[i + 1 :]):
            found.add(("tp_not_innermost", "TP"))
    return found


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def warning_count(err: str) -> int:
    return sum(line.startswith("vemesh: warning: ") for line in err.splitlines())


layouts = st.lists(st.integers(1, 6), min_size=1, max_size=4).filter(lambda s: math.prod(s) <= 256).flatmap(
    lambda shape: st.tuples(st.just(tuple(shape)), st.permutations(NAMES).map(lambda p: tuple(p[: len(shape)])))
)


# ------------------------------------------------------------------ show
@pytest.mark.parametrize(
    "shape, names",
    [((8,), None), ((2, 4), None), ((2, 2, 2), None), ((3, 5), ("DP", "TP")), ((2, 3, 2, 2), ("PP", "DP", "CP", "TP"))],
)
def test_show_json_groups_match_numpy(capsys, shape, names):
    argv = ["show", "--shape", ",".join(map(str, shape)), "--json"]
    if names:
        argv += ["--names", ",".join(names)]
    code, out, err = run(capsys, *argv)
    assert code == 0 and err == ""
    doc = json.loads(out)
    default = {1: ["DP"], 2: ["DP", "TP"], 3: ["PP", "DP", "TP"]}
    assert doc["shape"] == list(shape)
    assert doc["dim_names"] == list(names or default[len(shape)])
    assert doc["groups"] == {n: numpy_groups(shape, d) for d, n in enumerate(doc["dim_names"])}
    assert doc["warnings"] == []


def test_show_rank_view_on_every_rank(capsys):
    shape, dph = (2, 2, 2), 4
    grid = np.arange(8).reshape(shape)
    for rank in range(8):
        code, out, _ = run(capsys, "show", "--shape", "2,2,2", "--devices-per-host", str(dph), "--rank", str(rank), "--json")
        assert code == 0
        view = json.loads(out)["rank"]
        coord = [int(c) for c in np.unravel_index(rank, shape)]
        assert view["coordinate"] == dict(zip(("PP", "DP", "TP"), coord))
        assert (view["host"], view["local_rank"]) == (rank // dph, rank % dph)
        for d, name in enumerate(("PP", "DP", "TP")):
            (group,) = [g for g in numpy_groups(shape, d) if rank in g]
            assert view["groups"][name] == group
            assert view["index_in_group"][name] == group.index(rank)
        pp = coord[0]
        assert view["pipeline"] == {
            "previous": int(grid[pp - 1, coord[1], coord[2]]) if pp > 0 else None,
            "next": int(grid[pp + 1, coord[1], coord[2]]) if pp < 1 else None,
        }


def test_show_text_marks_hosts_and_rank(capsys):
    code, out, err = run(capsys, "show", "--shape", "2,2,2", "--devices-per-host", "4", "--rank", "5")
    assert code == 0 and err == ""
    assert out.splitlines()[0] == "mesh (PP=2, DP=2, TP=2): 8 ranks on 2 hosts of 4 devices"
    assert "      h0 0 1\n         2 3\n" in out and "      h1 4 5\n         6 7\n" in out
    assert "    PP: 4 groups of 2, each spans 2 hosts\n        [0, 4] [1, 5] [2, 6] [3, 7]\n" in out
    assert "    TP: 4 groups of 2, each on one host\n        [0, 1] [2, 3] [4, 5] [6, 7]\n" in out
    assert "  rank 5: PP=1, DP=0, TP=1; host 1, local rank 1\n" in out
    assert "    pipeline: previous stage rank 1, next stage none (last stage)" in out


def test_show_fills_in_minus_one_from_world_size(capsys):
    code, out, _ = run(capsys, "show", "--shape", "2,-1", "--world-size", "8", "--json")
    assert code == 0 and json.loads(out)["shape"] == [2, 4]


@pytest.mark.parametrize(
    "argv, names",
    [
        (["show", "--shape", "2,x"], ["--shape", "'2,x'", "2,2,2"]),
        (["show", "--shape", "2,0,2"], ["--shape", "got 0 in (2, 0, 2)"]),
        (["show", "--shape", "2,2,2", "--names", "PP,DP"], ["--names", "('PP', 'DP')", "3 dims"]),
        (["show", "--shape", "2,2,2,2"], ["4-D", "needs mesh_dim_names", "('PP', 'DP', 'TP')"]),
        (["show", "--shape", "2,2", "--names", "TP,TP"], ["--names", "['TP'] repeat"]),
        (["show", "--shape", "2,2", "--rank", "9"], ["--rank", "9", "0..3"]),
        (["show", "--shape", "2,-1"], ["--shape", "--world-size"]),
        (["show", "--shape", "2,-1", "--world-size", "7"], ["--world-size", "7", "DP 2 = 2 does not divide"]),
        (["show", "--shape", "2,2", "--devices-per-host", "0"], ["--devices-per-host", "'0'", "positive"]),
        (["sho", "--shape", "2"], ["'sho'", "'show', 'plan'"]),
        ([], ["'show', 'plan'"]),
        (["plan", "--world-size", "64", "--tp", "8", "--pp", "3"], ["DP", "PP 3 x CP 1 x TP 8 = 24", "world size 64"]),
        (["plan", "--world-size", "64", "--tp", "8", "--pp", "2", "--dp", "2"], ["= 32", "world size is 64", "'auto'"]),
        (["plan", "--world-size", "64", "--tp", "auto", "--dp", "auto"], ["only one size can be 'auto'", "for DP, TP in PP 1 x DP auto x CP 1 x TP auto"]),
        (["plan", "--world-size", "64", "--tp", "0"], ["--tp", "'0'", "'auto'"]),
        (["plan", "--world-size", "64", "--device-type", "gpu"], ["'gpu'", "'cuda'"]),
        (["plan", "--tp", "2"], ["--world-size"]),
        (["plan", "--world-size", "8", "--tp", "2", "--rank", "8"], ["--rank", "0..7"]),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(capsys, argv, names):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("vemesh: error: "), err
    for needle in names:
        assert needle in err, (needle, err)


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0 and "--world-size" in out


# ------------------------------------------------------------------ warnings
@pytest.mark.parametrize(
    "argv, kinds",
    [
        (["--shape", "2,8", "--devices-per-host", "8"], set()),
        (["--shape", "2,8", "--devices-per-host", "4"], {"TP groups cross hosts"}),
        (["--shape", "4,2", "--names", "TP,DP"], {"TP is not the innermost dim"}),
        (["--shape", "4,2,1", "--names", "DP,TP,CP"], set()),  # size-1 dims after TP do not count
        (["--shape", "3,4", "--devices-per-host", "5"], {"the world size 12 is not a multiple", "TP groups cross"}),
        (["--shape", "2,4,2", "--names", "DP,CP,TP", "--devices-per-host", "4"], {"CP groups cross hosts"}),
    ],
)
def test_warnings_on_stderr_and_in_json(capsys, argv, kinds):
    code, out, err = run(capsys, "show", *argv)
    assert code == 0 and warning_count(err) == len(kinds)
    unwrapped = " ".join(err.split())
    assert all(k in unwrapped for k in kinds)
    code, out, err_json = run(capsys, "show", *argv, "--json")
    assert code == 0 and err_json == err
    messages = json.loads(out)["warnings"]
    assert len(messages) == len(kinds) and all(any(k in m for m in messages) for k in kinds)


@settings(max_examples=300, deadline=None)
@given(layouts, st.one_of(st.none(), st.integers(1, 16)))
def test_warnings_exactly_when_groups_cross_hosts(layout_args, dph):
    shape, names = layout_args
    layout = MeshLayout(shape, names)
    found = {(w.kind, w.dim) for w in check_layout(layout, dph)}
    assert found == expected_warnings(shape, names, dph)
    doc = layout_document(layout, devices_per_host=dph)
    assert len(doc["warnings"]) == len(found)
    if dph is not None:
        assert doc["groups_spanning_hosts"] == {
            n: sum(crossing(numpy_groups(shape, d), dph)) for d, n in enumerate(names)
        }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layouts, st.integers(1, 16))
def test_cli_warns_exactly_when_expected(capsys, layout_args, dph):
    shape, names = layout_args
    code, out, err = run(
        capsys, "show", "--shape", ",".join(map(str, shape)), "--names", ",".join(names),
        "--devices-per-host", str(dph), "--json",
    )
    assert code == 0
    assert warning_count(err) == len(json.loads(out)["warnings"]) == len(expected_warnings(shape, names, dph))


# ------------------------------------------------------------------ output size
@settings(max_examples=150, deadline=None)
@given(layouts, st.one_of(st.none(), st.integers(1, 16)), st.integers(0, 255))
def test_text_fits_80_columns(layout_args, dph, rank):
    shape, names = layout_args
    layout = MeshLayout(shape, names)
    text = describe_layout(layout, rank=rank % layout.world_size, devices_per_host=dph)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    if layout.world_size <= 64:  # drawn in full: every rank appears in the grid
        grid = text.split("groups along each dim:")[0]
        assert len([t for t in grid.split() if t.isdigit()]) >= layout.world_size


def test_large_mesh_is_summarized_quickly(capsys):
    start = time.perf_counter()
    code, out, err = run(capsys, "show", "--shape", "4,512,8", "--devices-per-host", "8", "--rank", "5")
    elapsed = time.perf_counter() - start
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) < 40 and max(map(len, lines)) <= 80 and elapsed < 2.0, (elapsed, out)
    assert "    TP: 2048 groups of 8, each on one host" in lines
    assert "        [0..7] [8..15] ... [16376..16383]" in lines
    code, out, err = run(capsys, "show", "--shape", "4,512,8", "--names", "PP,TP,DP", "--devices-per-host", "8")
    assert warning_count(err) == 2 and all(len(line) <= 80 for line in err.splitlines())


# ------------------------------------------------------------------ plan
def test_plan_fills_dp_and_prints_the_call(capsys):
    code, out, err = run(capsys, "plan", "--world-size", "64", "--devices-per-host", "8", "--tp", "8", "--pp", "2")
    assert code == 0 and err == ""
    assert out.startswith("plan: 64 ranks = PP 2 x DP 4 x CP 1 x TP 8 (DP filled in)\n")
    assert "mesh (PP=2, DP=4, TP=8): 64 ranks on 8 hosts of 8 devices" in out
    assert '        "cuda", (2, 4, 8), mesh_dim_names=("PP", "DP", "TP")\n' in out
    assert max(map(len, out.splitlines())) <= 80
    code, out, _ = run(capsys, "plan", "--world-size", "64", "--devices-per-host", "8", "--tp", "8", "--pp", "2", "--json")
    doc = json.loads(out)
    assert doc["degrees"] == {"PP": 2, "DP": 4, "CP": 1, "TP": 8} and doc["filled_in"] == "DP"
    assert doc["init_device_mesh"] == (
        'VESCALE_DEVICE_MESH.init_device_mesh("cuda", (2, 4, 8), mesh_dim_names=("PP", "DP", "TP"))'
    )
    assert doc["groups"] == {n: numpy_groups((2, 4, 8), d) for d, n in enumerate(("PP", "DP", "TP"))}


@pytest.mark.parametrize(
    "kwargs, degrees, shape, names",
    [
        (dict(tp=8, pp=2), (2, 4, 1, 8), (2, 4, 8), ("PP", "DP", "TP")),
        (dict(tp="auto", pp=2, cp=2), (2, 1, 2, 16), (2, 2, 16), ("PP", "CP", "TP")),
        (dict(tp=-1, dp=4), (1, 4, 1, 16), (4, 16), ("DP", "TP")),
        (dict(pp=4, dp=2, cp=2, tp=4), (4, 2, 2, 4), (4, 2, 2, 4), ("PP", "DP", "CP", "TP")),
        (dict(tp=64), (1, 1, 1, 64), (64,), ("TP",)),
    ],
)
def test_plan_degrees_and_dim_order(kwargs, degrees, shape, names):
    plan = plan_mesh(64, **kwargs)
    assert tuple(plan.degrees.values()) == degrees
    assert (plan.layout.shape, plan.layout.dim_names) == (shape, names)


def test_plan_ep_reuses_dp_x_cp(capsys):
    code, out, err = run(capsys, "plan", "--world-size", "16", "--pp", "2", "--cp", "2", "--tp", "2", "--ep", "4")
    assert code == 0 and err == ""
    assert "EP 4: experts spread over groups of 4 of the 4 DP x CP ranks (EP reuses them; the mesh does not change)" in out
    assert '(2, 2, 2, 2), mesh_dim_names=("PP", "DP", "CP", "TP")' in out
    code, out, _ = run(capsys, "plan", "--world-size", "16", "--pp", "2", "--cp", "2", "--tp", "2", "--ep", "4", "--json")
    assert json.loads(out)["ep"] == 4
    code, out, err = run(capsys, "plan", "--world-size", "8", "--pp", "2", "--tp", "2", "--ep", "3")
    assert code == 2 and "EP 3 must divide DP x CP = 2 x 1 = 2" in err
    code, out, err = run(capsys, "plan", "--world-size", "8", "--ep", "0")
    assert code == 2 and "--ep" in err


def test_show_flattened_dims_of_torchtitans_mesh(capsys):
    argv = ["show", "--shape", "2,2,2,2", "--names", "dp_replicate,dp_shard,cp,tp", "--flatten", "dp_shard_cp=dp_shard,cp",
            "--flatten", "dp_cp=dp_replicate,dp_shard_cp", "--rank", "5"]
    code, out, err = run(capsys, *argv)
    assert code == 0 and err == ""
    assert "dp_shard_cp: 4 groups of 4\n        [0, 2, 4, 6] [1, 3, 5, 7] [8, 10, 12, 14] [9, 11, 13, 15]" in out
    assert "dp_cp group [1..15 step 2] (index 2)" in out
    code, out, _ = run(capsys, *argv, "--json")
    assert json.loads(out)["flattened"]["dp_shard_cp"]["groups"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    for bad, piece in [("x=tp,cp", "must be distinct and in mesh order"), ("x=dp,cp", "unknown dim 'dp'"),
                       ("tp=cp", "'tp' must be a new plain name"), ("nodims", "expected NAME=DIM,DIM")]:
        code, _, err = run(capsys, "show", "--shape", "2,2,2,2", "--names", "dp_replicate,dp_shard,cp,tp", "--flatten", bad)
        assert code == 2 and piece in err, err


def test_plan_of_one_rank_keeps_a_dp_dim():
    plan = plan_mesh(1)
    assert plan.init_call() == 'VESCALE_DEVICE_MESH.init_device_mesh("cuda", (1,), mesh_dim_names=("DP",))'


def test_plan_warns_when_tp_spans_hosts(capsys):
    code, _, err = run(capsys, "plan", "--world-size", "64", "--devices-per-host", "8", "--tp", "16", "--device-type", "cpu")
    assert code == 0 and warning_count(err) == 1 and "TP groups cross hosts" in err


# ------------------------------------------------------------------ describe_layout keeps mesh.py's keywords
def test_describe_layout_lists_flattened_dims():
    layout = MeshLayout((2, 2, 2), ("PP", "DP", "TP")).flatten(("DP", "TP"))
    text = describe_layout(layout, rank=5, devices_per_host=4)
    assert "    DP_TP: 2 groups of 4, each on one host\n        [0, 1, 2, 3] [4, 5, 6, 7]" in text
    assert "    DP_TP group [4, 5, 6, 7] (index 1)" in text


# ------------------------------------------------------------------ subprocesses
def _subprocess(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=120, **kwargs)


def test_python_m_vemesh_show_json():
    proc = _subprocess(sys.executable, "-m", "vemesh", "show", "--shape", "2,2,2", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["groups"] == {n: numpy_groups((2, 2, 2), d) for d, n in enumerate(("PP", "DP", "TP"))}


def test_console_script_plan_error():
    command = shutil.which("vemesh")
    args = [command] if command else [sys.executable, "-m", "vemesh"]
    proc = _subprocess(*args, "plan", "--world-size", "64", "--tp", "8", "--pp", "3")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("vemesh: error: cannot fill in DP: PP 3 x CP 1 x TP 8 = 24")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_cli_modules_do_not_import_torch():
    """cli, plan, describe, layout and spec load with torch blocked (``vemesh/__init__`` is bypassed)."""
    script = textwrap.dedent(f"""
        import importlib.abc, sys, types
        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked")
        sys.meta_path.insert(0, NoTorch())
        package = types.ModuleType("vemesh")
        package.__path__ = [{str(REPO / "vemesh")!r}]
        sys.modules["vemesh"] = package
        import vemesh.cli
        sys.exit(vemesh.cli.main(["plan", "--world-size", "16", "--tp", "8", "--json"]))
    """)
    proc = _subprocess(sys.executable, "-c", script)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["shape"] == [2, 8]


def test_pasted_init_call_builds_the_planned_mesh(capsys):
    """Run the call ``plan`` prints on torch's fake backend as ranks 0 and 45 of 64: same groups, same text."""
    plan = plan_mesh(64, tp=4, pp=2, cp=2, device_type="cpu")
    script = textwrap.dedent(f"""
        import json, sys
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from vemesh import VESCALE_DEVICE_MESH
        out = {{}}
        for rank in (0, 45):
            dist.init_process_group("fake", rank=rank, world_size=64, store=FakeStore())
            {plan.init_call()}
            groups = {{n: VESCALE_DEVICE_MESH[n].mesh.tolist() for n in VESCALE_DEVICE_MESH.mesh_dim_names}}
            out[rank] = {{"groups": groups, "describe": VESCALE_DEVICE_MESH.describe(devices_per_host=8)}}
            VESCALE_DEVICE_MESH.reset()
            dist.destroy_process_group()
        json.dump(out, sys.stdout)
    """)
    proc = _subprocess(sys.executable, "-c", script)
    assert proc.returncode == 0, proc.stderr
    live = json.loads(proc.stdout)
    for rank in (0, 45):
        assert live[str(rank)]["groups"] == layout_document(plan.layout, rank=rank)["rank"]["groups"]
        code, out, _ = run(
            capsys, "show", "--shape", ",".join(map(str, plan.layout.shape)), "--names", ",".join(plan.layout.dim_names),
            "--devices-per-host", "8", "--rank", str(rank),
        )
        assert code == 0 and out == live[str(rank)]["describe"] + "\n"


def test_import_vemesh_cli_is_torch_free():
    proc = _subprocess(sys.executable, "-c", "import vemesh.cli, sys; assert 'torch' not in sys.modules")
    assert proc.returncode == 0, proc.stderr


def test_hsdp_plan_pastes_into_a_working_mesh(fake_rank, capsys):
    """``plan --dp-replicate`` splits DP as torchtitan does; its init and flatten lines build those groups."""
    from vemesh import VESCALE_DEVICE_MESH

    plan = plan_mesh(16, dp_replicate=2, cp=2, tp=2, device_type="cpu")
    assert plan.layout.dim_names == ("dp_replicate", "dp_shard", "CP", "TP")
    for rank in (0, 5, 15):
        fake_rank(rank, 16)
        exec("\n".join([plan.init_call(), *plan.flatten_calls()]), {"VESCALE_DEVICE_MESH": VESCALE_DEVICE_MESH})
        try:
            for name, dims in plan.flattens.items():
                assert VESCALE_DEVICE_MESH[name].mesh.flatten().tolist() == plan.layout.group_ranks(rank, name)
            assert VESCALE_DEVICE_MESH["dp_replicate", "dp_shard_cp"].mesh.shape == (2, 4)
        finally:
            VESCALE_DEVICE_MESH.reset()
    code, _, err = run(capsys, "plan", "--world-size", "16", "--dp-replicate", "3", "--tp", "2")
    assert code == 2 and "dp_replicate 3 must divide DP 8" in err

"""The diagnosis over dumps written here by hand (layer 1: no process group): which dim, which group,
which rank never came, mismatches, dead ranks, torch's own dumps, stragglers, and the CLI's errors."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from vemesh.cli import main
from vemesh.hangs.diagnose import diagnose, load, user_frames
from vemesh.hangs.dumps import Layout
from vemesh.hangs.record import hang_after
from vemesh.hangs.stragglers import stragglers

MS = 1_000_000
LAYOUT = Layout.row_major((2, 2), ("DP", "TP"))
PG = {"DP": "2", "TP": "3", "world": "0"}


def entry(dim: str, seq: int, t: int, *, op: str = "all_reduce", size=(1024,), done: bool = True) -> dict:
    return {"process_group": [PG[dim], f"mesh_{dim}"], "collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False,
            "profiling_name": f"gloo:{op}", "input_sizes": [list(size)] if size else [], "input_dtypes": ["Float"],
            "time_created_ns": t, "retired": done, "state": "scheduled"}


def write(tmp: Path, rank: int, entries: list[dict], *, frames=None, steps=(), world: int = 4, run: str = "b",
          at: int = 2, ended: bool = False) -> None:
    groups = {PG[d]: {"dim": d, "ranks": LAYOUT.group(rank, (d,))} for d in ("DP", "TP")}
    groups["0"] = {"dim": "world", "ranks": list(range(world))}
    doc = {"rank": rank, "world_size": world, "run": run, "time_ns": at, "host": "h", "flight_recorder": {"entries": entries},
           "mesh": {"shape": [2, 2], "dim_names": ["DP", "TP"], "strides": [2, 1], "first_rank": 0, "groups": groups},
           "steps": list(steps), "fired_by": 1, "reason": "", "ended": ended,
           "stacks": [{"thread": "MainThread", "main": True, "frames": frames or [["/x/train.py", 10, "main", "step()"]]}]}
    (tmp / f"rank-{rank}.json").write_text(json.dumps(doc))


def test_a_rank_in_compute_is_named_with_its_dim_group_coordinates_and_line(tmp_path):
    for r in range(4):
        own = [entry("TP", 1, 100 * MS + r), entry("DP", 1, 200 * MS + r)]
        if r != 3:
            own.append(entry("DP", 2, 300 * MS + r, done=False))
        frames = [["/x/train.py", 40, "main", "loop()"], ["/x/train.py", 233, "loss_fn", "time.sleep(600)"]]
        write(tmp_path, r, own, frames=frames if r == 3 else None, steps=[(0, 1), (250 * MS, 2)])
    found = diagnose(load(tmp_path))
    text = found.text()
    first = found.stuck[0]
    assert (first.group.dim, first.group.ranks, first.seq, first.missing) == ("DP", [1, 3], 2, [3])
    assert "HANG: DP all-reduce #2 (4.0 KiB, [1024] float) at step 2 is stuck in the DP group [1, 3] (TP=1)" in text
    assert "never entered: rank 3 (DP=1, TP=1)" in text
    assert "rank 3's last finished collective: DP all-reduce #1" in text
    assert "not in any collective (in compute), at /x/train.py:233 in loss_fn: time.sleep(600)" in text
    doc = found.as_dict()
    assert doc["stuck"][0]["missing"] == [3] and doc["stuck"][0]["coordinates"][3] == {"DP": 1, "TP": 1}


def test_a_skipped_collective_is_a_mismatch_of_steps(tmp_path):
    steps = [(0, 1), (100 * MS, 2), (200 * MS, 3)]
    for r in range(4):
        own = [entry("DP", 1, 10 * MS), entry("DP", 2, 110 * MS if r != 3 else 210 * MS)]
        if r == 1:
            own.append(entry("DP", 3, 210 * MS, done=False))
        write(tmp_path, r, own, steps=steps)
    found = diagnose(load(tmp_path))
    (m,) = found.mismatches
    assert m.group.ranks == [1, 3] and m.seq == 2
    assert "rank(s) [3] reached #2 a step later: they skipped a DP collective of step 2" in found.text()


def test_ranks_whose_program_ended_are_said_so_not_dead(tmp_path):
    """On gloo a skipped collective need not hang: the skipping rank's next one pairs with its peer's, and the ranks
    that ran one collective fewer end their program while a peer waits on its last. Their dumps, written as the
    program ended, say so: they were named DEAD ("left no dump (killed, OOM-killed, or it exited)"). A run whose
    every rank ended is a healthy one: nothing said."""
    steps = [(0, 1), (100 * MS, 2), (200 * MS, 3)]
    for r in range(4):
        own = [entry("DP", 1, 10 * MS), entry("DP", 2, 110 * MS if r != 3 else 210 * MS)]
        if r == 1:
            own.append(entry("DP", 3, 210 * MS, done=False))
        write(tmp_path, r, own, steps=steps, ended=r != 1)
    text = diagnose(load(tmp_path)).text()
    assert "ENDED: rank 0, 2, 3 ended their program normally while the others still had collectives to run (the " \
        "last step marked: 3 on rank 0, 3 on rank 2, 3 on rank 3)" in text and "DEAD" not in text, text
    assert "rank(s) [3] reached #2 a step later" in text
    for r in range(4):
        write(tmp_path, r, [entry("DP", 1, 10 * MS)], steps=steps, ended=True)
    assert "ENDED" not in diagnose(load(tmp_path)).text()


RAISED_IN_WAIT = """Traceback (most recent call last):
  File "/x/train.py", line 21, in <module>
    dist.{call}
  File "/v/torch/distributed/c10d_logger.py", line 83, in wrapper
    return func(*args, **kwargs)
  File "/v/torch/distributed/distributed_c10d.py", line 5356, in {name}
    work.wait()
RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:46470.
"""


@pytest.mark.parametrize("extra", ["own_group", "barrier"])
def test_a_collective_one_rank_alone_entered_is_the_hang_not_the_one_it_holds_up(tmp_path, extra):
    """Rank 1 enters, at step 2, a collective its peers never run: an all-reduce on a group of the user's own
    (``dist.new_group([0, 1])``), or a world barrier. Ranks 0 and 2 finish and end; rank 3 waits in DP #2 for rank 1,
    and rank 1 raises in its wait as the peers' connections close. gloo's recorder retires the collective rank 1 raised
    in as if it had finished, and a dump sees the members of a group only where they entered it: the report said
    "rank 1's last finished collective: world barrier #3" under the DP all-reduce it held up (or a group of one rank,
    [1]). The collective rank 1 raised in is the hang, with the members that never entered it."""
    steps = [(0, 1), (100 * MS, 2), (200 * MS, 3)]
    own = {"process_group": ["5", "undefined"], "collective_seq_id": 1, "p2p_seq_id": 0, "is_p2p": False,
           "profiling_name": "gloo:all_reduce", "input_sizes": [[1]], "input_dtypes": ["Float"],
           "time_created_ns": 150 * MS, "retired": True, "state": "scheduled"}
    barrier = entry("world", 3, 150 * MS, op="barrier", size=())
    for r in range(4):
        mine = [entry("DP", 1, 10 * MS + r)]
        if r in (0, 2):
            mine += [entry("DP", 2, 110 * MS + r), entry("DP", 3, 210 * MS + r)]
        if r == 3:
            mine.append(entry("DP", 2, 110 * MS + r, done=False))
        if r == 1:
            mine.append(own if extra == "own_group" else barrier)
        write(tmp_path, r, mine, steps=steps, ended=r in (0, 2))
    doc = json.loads((tmp_path / "rank-1.json").read_text())
    call, name = ("all_reduce(torch.ones(1), group=side)", "all_reduce") if extra == "own_group" else ("barrier()", "barrier")
    doc["exception"] = RAISED_IN_WAIT.format(call=call, name=name)
    if extra == "own_group":  # what the rank's own description lists of the groups it is in
        doc["mesh"]["groups"]["5"] = {"dim": "group 5", "ranks": [0, 1]}
    (tmp_path / "rank-1.json").write_text(json.dumps(doc))
    found = diagnose(load(tmp_path))
    text = found.text()
    first = found.stuck[0]
    expected = ("group 5", [0, 1], [0]) if extra == "own_group" else ("world", [0, 1, 2, 3], [0, 2, 3])
    assert (first.group.dim, first.group.ranks, first.missing) == expected, text
    headline = ("HANG: group 5 all-reduce #1 (4 B, [1] float) at step 2 is stuck in group 5 [0, 1] (DP=0)"
                if extra == "own_group" else "HANG: world barrier #3 at step 2 is stuck in the world group [0, 1, 2, 3]")
    assert headline in text and "entered: rank 1\n" in text, text
    assert "rank 0's last finished collective: DP all-reduce #3\n    it ended its program (the last step it marked: 3)" \
        in text, text
    assert "held up by the above:\n  DP all-reduce #2 (4.0 KiB, [1024] float) at step 2 is stuck in the DP group [1, 3]" \
        in text, text


def test_different_sizes_at_one_number_are_a_mismatch_but_a_scatter_is_not(tmp_path):
    for r in range(4):
        size = (2048,) if r == 1 else (1024,)
        scatter = entry("TP", 2, 20 * MS, op="scatter", size=(4, 8) if r % 2 == 0 else ())
        write(tmp_path, r, [entry("TP", 1, 10 * MS, size=size), scatter])
    found = diagnose(load(tmp_path))
    assert [(m.group.ranks, m.seq) for m in found.mismatches] == [([0, 1], 1)]
    text = found.text()
    assert "MISMATCH in the TP group [0, 1] (DP=0) at its collective #1" in text
    assert "rank 1 (DP=0, TP=1): all-reduce of [2048] float (8.0 KiB)" in text


def test_a_rank_gloo_aborted_is_named_with_its_line_and_its_peers_sizes(tmp_path):
    for r in (1, 2, 3):
        write(tmp_path, r, [entry("TP", 1, 10 * MS, size=(8,)), entry("TP", 2, 20 * MS, size=(16,) if r == 1 else (8,))])
    (tmp_path / "rank-0.fatal.txt").write_text(
        'Fatal Python error: Aborted\n\nCurrent thread 0x01 (most recent call first):\n'
        '  File "/x/faults.py", line 66 in before_compute\n  File "/x/train.py", line 9 in main\n')
    text = diagnose(load(tmp_path)).text()
    assert "DIED: rank 0 (DP=0, TP=0): Fatal Python error: Aborted" in text
    assert "it was at /x/faults.py:66 in before_compute" in text
    assert "rank 1 last entered TP all-reduce #2 of [16] float (its all-reduce #1 was [8] float)" in text


def test_torch_dumps_are_mapped_by_shape_and_mesh_dim_descriptions(tmp_path):
    for r in range(4):
        own = [entry("TP", 1, 10 * MS), entry("DP", 1, 20 * MS)]
        if r != 3:
            own.append(entry("DP", 2, 30 * MS, done=False))
        for e in own:
            e["process_group"][1] = e["process_group"][1].lower()
        (tmp_path / f"fr_{r}").write_bytes(pickle.dumps({"version": "2.10", "pg_config": {}, "entries": own}))
    with pytest.raises(ValueError, match="give --shape and --dim-names"):
        load(tmp_path)
    with pytest.raises(ValueError, match=r"--shape \[3\] covers 3 ranks, but .* holds the dump of rank 3"):
        load(tmp_path, (3,), ("dp",))
    with pytest.raises(ValueError, match=r"--dim-names DP,TP names none of the dumps' mesh groups \(mesh_dp, mesh_tp\)"):
        load(tmp_path, (2, 2), ("DP", "TP"))
    found = diagnose(load(tmp_path, (2, 2), ("dp", "tp")))
    assert "HANG: dp all-reduce #2" in found.text() and "stuck in the dp group [1, 3] (tp=1)" in found.text()
    assert found.stuck[0].missing == [3]


def test_a_flattened_description_names_its_dims():
    layout = Layout.row_major((2, 2, 2), ("dp", "cp", "tp"))
    assert layout.dims_of("mesh_dp_cp") == ("dp", "cp") and layout.dims_of("mesh_tp") == ("tp",)
    assert layout.group(5, ("dp", "cp")) == [1, 3, 5, 7] and layout.dims_of("mesh_ep") is None


def test_a_straggler_is_named_and_the_ranks_it_held_up_are_not(tmp_path):
    """Rank 2 is 50 ms late into every DP all-reduce; rank 0, held up in DP by it, is then late into TP: not blamed."""
    steps = [(k * 1000 * MS, k) for k in range(1, 31)]
    docs: dict[int, list[dict]] = {r: [] for r in range(4)}
    for k in range(1, 31):
        base = k * 1000 * MS
        for r in range(4):
            docs[r].append(entry("DP", k, base + (50 * MS if r == 2 else r * MS // 10)))
            held = 50 * MS if r in (0, 2) else 0
            docs[r].append(entry("TP", k, base + 100 * MS + held + r * MS // 10))
    for r, own in docs.items():
        write(tmp_path, r, own, steps=steps)
    found = {d.dim: d for d in stragglers(load(tmp_path))}
    rank, share, behind = found["DP"].worst()
    assert rank == 2 and share == 1.0 and 35 <= behind <= 65
    assert found["TP"].worst()[0] == 2  # rank 2 holds its own TP group [2, 3] up too; rank 0 only waited for it


def test_a_rank_late_once_by_much_is_not_the_straggler_late_every_step(tmp_path):
    """CI's run on a loaded machine: ranks 1 and 0 started late and held up the first DP all-reduces by 236 and
    180 ms; rank 2 was 50 ms late into each of the other 29. The straggler is rank 2, who held its group up longest
    in all."""
    steps = [(k * 1000 * MS, k) for k in range(1, 31)]
    docs: dict[int, list[dict]] = {r: [] for r in range(4)}
    for k in range(1, 31):
        base = k * 1000 * MS
        for r in range(4):
            late = {(1, 1): 236 * MS, (1, 0): 180 * MS}.get((k, r), 50 * MS if r == 2 and k > 1 else r * MS // 10)
            docs[r].append(entry("DP", k, base + late))
    for r, own in docs.items():
        write(tmp_path, r, own, steps=steps)
    (found,) = stragglers(load(tmp_path))
    rank, share, behind = found.worst()
    assert rank == 2 and share >= 0.9 and 35 <= behind <= 65
    assert found.line().startswith("DP: rank 2 is last into "), found.line()


def test_a_reused_directory_reads_the_newest_run_alone(tmp_path):
    for r in range(8):  # an older run of 8 ranks, every one of them stuck
        write(tmp_path, r, [entry("DP", 1, 10 * MS, done=False)], world=8, run="a", at=1)
    (tmp_path / "rank-6.fatal.txt").write_text("Fatal Python error: Aborted\n")
    for r in range(4):
        write(tmp_path, r, [entry("DP", 1, 10 * MS)] + ([entry("TP", 1, 20 * MS, done=False)] if r == 0 else []))
    found = diagnose(load(tmp_path))
    assert found.job.world_size == 4 and not found.dead and found.job.older == 4
    assert "(the directory also holds 4 dumps of an older run, left out)" in found.text()
    assert [(s.group.ranks, s.missing) for s in found.stuck] == [([0, 1], [1])]


def test_user_frames_leave_out_torch_vemesh_and_the_standard_library():
    import threading

    import torch

    import vemesh

    stack = [["/x/a.py", 1, "f", ""], [torch.__file__, 2, "g", ""], [vemesh.__file__, 3, "h", ""],
             [threading.__file__, 4, "i", ""], ["/x/b.py", 5, "j", ""]]
    assert [f[0] for f in user_frames(stack)] == ["/x/a.py", "/x/b.py"]


def test_the_threshold_is_half_the_timeout_or_the_environment_below_it():
    assert hang_after(60.0, {}) == 30.0 and hang_after(60.0, {"VEMESH_HANG_AFTER": "5"}) == 5.0
    with pytest.raises(ValueError, match=r"VEMESH_HANG_AFTER=90 must be above 0 and below .* \(60 s\)"):
        hang_after(60.0, {"VEMESH_HANG_AFTER": "90"})
    with pytest.raises(ValueError, match="'soon' is not a number"):
        hang_after(60.0, {"VEMESH_HANG_AFTER": "soon"})


@pytest.mark.parametrize("argv, message", [
    (["diagnose", "/nonexistent/dumps"], "/nonexistent/dumps is not a directory of hang dumps"),
    (["diagnose", "{tmp}", "--shape", "2,x"], "invalid shape '2,x'"),
    (["diagnose", "{tmp}", "--shape", "2,0", "--dim-names", "dp,tp"], "--shape [2, 0]: every size must be a positive"),
    (["diagnose", "{tmp}", "--shape", "2,2", "--dim-names", "dp"], "--shape [2, 2] has 2 dims but --dim-names ['dp'] has 1"),
    (["diagnose", "{tmp}", "--shape", "2,2"], "give --shape and --dim-names together"),
    (["diagnose", "{tmp}"], "holds no hang dumps"),
])
def test_bad_input_is_one_line_naming_it(tmp_path, capsys, argv, message):
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vemesh: error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("text, message", [
    ("{not json", "rank-0.json is not a hang dump (Expecting property name"),
    ("{}", "rank-0.json is not a hang dump (no rank in it)"),
    ("[1, 2]", "rank-0.json is not a hang dump (no rank in it)"),
])
def test_a_file_that_is_no_dump_is_named_not_a_traceback(tmp_path, capsys, text, message):
    """A ``rank-N.json`` another program wrote: one line naming the file (before, the JSON error without the file's
    name, or a KeyError's traceback)."""
    write(tmp_path, 1, [entry("DP", 1, 10 * MS)])
    (tmp_path / "rank-0.json").write_text(text)
    assert main(["diagnose", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vemesh: error: ") and message in err and err.count("\n") == 1, err


def test_json_gives_what_the_text_says(tmp_path, capsys):
    for r in range(4):
        write(tmp_path, r, [entry("DP", 1, 10 * MS, done=r == 3)] if r != 1 else [])
    assert main(["diagnose", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    first = doc["stuck"][0]
    assert (first["dim"], first["group"], first["entered"], first["missing"]) == ("DP", [0, 2], [0, 2], [])
    assert main(["diagnose", str(tmp_path), "--stragglers", "--json"]) == 0
    assert "stragglers" in json.loads(capsys.readouterr().out)


class _RunsCode:
    """What an attacker pickles: unpickling it calls ``Path.touch`` on the marker."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_a_pickle_that_would_run_code_is_refused_in_one_line_and_nothing_runs(tmp_path, capsys):
    """Issue 50: torch's dumps are read with an unpickler that resolves no global, so a crafted file dropped into a
    shared hang directory is named and refused, and its code never runs."""
    from vemesh.cli import main

    for r in range(2):
        own = [entry("TP", 1, 10 * MS)]
        (tmp_path / f"fr_{r}").write_bytes(pickle.dumps({"version": "2.10", "pg_config": {}, "entries": own}))
    marker = tmp_path.parent / f"{tmp_path.name}-ran"
    (tmp_path / "fr_7").write_bytes(pickle.dumps({"entries": [_RunsCode(str(marker))]}))
    code = main(["diagnose", str(tmp_path), "--shape", "2", "--dim-names", "tp"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"refusing to read {tmp_path / 'fr_7'}: it is a pickle that refers to pathlib" in err, err
    assert "nothing in it was run" in err
    assert not marker.exists()

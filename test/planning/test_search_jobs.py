"""A search's meshes planned in several processes (``vemesh plan --jobs N``, :mod:`vemesh.planning.search_jobs`)."""

from __future__ import annotations

import json
import os
import time

import pytest

from vemesh.planning.search_jobs import run


def _pair(a: int, b: int) -> tuple[int, int]:
    return a + b, a * b


def _started(label: int) -> tuple[int, float]:
    began = time.monotonic()
    time.sleep(0.5)
    return label, began


def _refuse_two(value: int) -> int:
    if value == 2:
        raise ValueError(f"no {value}")
    return value


def test_run_returns_each_tasks_result_in_the_order_of_the_tasks_in_one_process_or_several() -> None:
    tasks = [(a, a + 1) for a in range(7)]
    assert run(_pair, tasks, 1) == run(_pair, tasks, 3) == [_pair(*t) for t in tasks]
    with pytest.raises(ValueError, match="no 2"):  # raised here, as it would be in one process
        run(_refuse_two, [(1,), (2,), (3,)], 2)


@pytest.mark.slow  # a script in its own process, and the search's processes
def test_a_script_that_searches_with_jobs_at_its_top_level_is_told_to_guard_it(tmp_path) -> None:
    """Each search process imports the main script again (Python's multiprocessing): a script that calls plan() with
    jobs at its top level calls it again in each while it starts, and they end. That is one line naming the idiom;
    before, it was concurrent.futures' BrokenProcessPool, "terminated abruptly"."""
    import subprocess
    import sys

    call = ("from vemesh.planning import plan\nout = plan(model='gpt:n_layer=2,n_embd=64,n_head=4,vocab=128,seq_len=64', "
            "world_size=4, device_memory='80GiB', global_batch_size=8, jobs=2)\nprint('fits:', len(out['fits']))\n")
    script = tmp_path / "unguarded.py"
    script.write_text(call)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0 and "fits:" not in done.stdout, done.stdout
    assert "RuntimeError: --jobs 2: a search's process ended abruptly" in done.stderr and \
        'under `if __name__ == "__main__":` (or plan with jobs=1)' in done.stderr, done.stderr[-2000:]


def test_in_processes_the_costliest_tasks_start_first_and_the_results_keep_the_tasks_order() -> None:
    """Longest first (a search's longest pipelines): the tasks are handed out by their cost, costliest first; each
    result still comes back in its task's place."""
    tasks = [(label,) for label in range(6)]
    done = run(_started, tasks, 2, cost=lambda task: task[0])
    assert [label for label, _ in done] == list(range(6))
    began = dict(done)
    assert max(began[5], began[4]) < min(began[1], began[0]), began


@pytest.mark.parametrize("jobs", [0, -1, True, 1.5])
def test_run_refuses_a_count_of_processes_that_is_not_a_positive_integer(jobs) -> None:
    with pytest.raises(ValueError, match=rf"--jobs must be a positive integer .*; got {jobs!r}"):
        run(_pair, [(1, 2)], jobs)


def test_a_job_that_cannot_travel_to_another_process_says_so() -> None:
    with pytest.raises(ValueError, match=r"--jobs 2: the job cannot travel to another process .* MODULE:FUNCTION"):
        run(lambda a: a, [(1,), (2,)], 2)


@pytest.mark.slow  # two searches (a PP mesh traced in each), and two worker processes started
def test_a_search_in_two_processes_is_the_search_in_one(capfd) -> None:
    """Every mesh's figures, the ranking and the rejections are those of the search in one process; the workers
    print the traces' progress lines as one process does, on the caller's stderr of now, not the one their server
    started with (here /dev/null: on a worker's own stderr the lines were lost). Only the notes may differ: how many
    of a pipeline's actions were replayed depends on the records its process holds from the meshes it planned
    before."""
    from vemesh.cli import main
    from vemesh.planning import fit

    gpt = ["plan", "--model", "gpt:n_layer=2,n_embd=64,n_head=4,vocab=256,seq_len=64", "--world-size", "2",
           "--global-batch-size", "4", "--device-profile", "h100-sxm", "--device-memory", "8GiB", "--trace-pp",
           "--json"]
    saved, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 2)
    try:  # the workers' server, if this process has none yet, starts with its stderr on /dev/null
        run(_pair, [(1, 2), (3, 4)], 2)
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(quiet)
    found, progress = {}, {}
    for jobs in (1, 2):
        fit._traced_preset.cache_clear()
        assert main([*gpt, "--jobs", str(jobs)]) == 0
        out, err = capfd.readouterr()
        found[jobs] = json.loads(out)
        progress[jobs] = sorted(line.split(" in ")[0] for line in err.splitlines() if line.startswith("vemesh: traced"))
        for mesh in found[jobs]["fits"] + found[jobs]["rejected"]:
            mesh.pop("notes", None)
    assert [f["degrees"]["PP"] for f in found[1]["fits"]].count(1) < len(found[1]["fits"])  # PP meshes among them
    assert found[2] == found[1]
    assert progress[2] == progress[1] == ["vemesh: traced PP=2"], progress


@pytest.mark.slow  # a search of two traced meshes, then each alone: about 8 s
def test_a_search_with_dp_replicate_plans_each_mesh_as_the_command_it_gives_for_it(capsys) -> None:
    """``--dp-replicate 2`` in a search (it was refused: the search planned every DP whole): each mesh that fits is
    planned and placed as the command the search gives for it plans it alone (``plan_alone``; the text names #1's),
    its DP bytes on ``dp_shard`` and ``dp_replicate``, the replicas between the hosts. That command carries the
    search's micro-batch size: a plan of one mesh otherwise takes the DP rank's whole share, and gave another peak.
    A DP that 2 does not divide, and a GPT-preset PP mesh without ``--trace-pp``, are rejected with their reason."""
    import shlex

    from vemesh.cli import main

    flags = ["plan", "--model", "gpt:n_layer=4,n_embd=64,n_head=4,vocab=256,seq_len=32", "--world-size", "4",
             "--global-batch-size", "8", "--dp-mode", "fsdp", "--devices-per-host", "2", "--dp-replicate", "2",
             "--device-memory", "80GiB"]
    assert main(flags + ["--json"]) == 0
    searched = json.loads(capsys.readouterr().out)
    assert searched["dp_replicate"] == 2 and sorted(f["degrees"]["TP"] for f in searched["fits"]) == [1, 2]
    for row in searched["fits"]:
        command = shlex.split(row["plan_alone"])
        assert command[:2] == ["vemesh", "plan"] and "--device-memory" in command and "--micro-batch-size" in command
        assert main(command[1:] + ["--json"]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert (row["peak"], row["classes"]) == (alone["peak"], alone["classes"])
        sent = row["classes"][0]["bytes_per_step"]
        assert sent["dp_replicate"] > 0 and (sent.get("dp_shard", 0) > 0) == (row["degrees"]["DP"] > 2), sent
        assert row["inter_host_dims"] == alone["placement"]["crossing_hosts"] and "dp_replicate" in row["inter_host_dims"]
    reasons = {tuple(r["degrees"][d] for d in ("PP", "DP", "TP")): r["reason"] for r in searched["rejected"]}
    assert reasons[1, 1, 4] == "DP 1 is not a multiple of --dp-replicate 2: HSDP splits DP into 2 replicas of DP / 2 ranks"
    assert reasons[2, 2, 1].startswith("not planned in a search: the GPT preset's PP meshes are traced"), reasons
    assert reasons[2, 2, 1].endswith("plan it with --pp 2 --dp-replicate 2, or search with --trace-pp"), reasons
    assert main(flags) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "plan #1 alone (each rank class, its placement, the lines to paste): " + searched["fits"][0]["plan_alone"])

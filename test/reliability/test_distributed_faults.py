"""Faults across ranks fail loudly and within a bounded time, on every rank, instead of hanging.

Four gloo ranks (``distributed_scenarios.worker``) with a 3-second process group timeout, and
one torchrun job in which a rank exits before ``init_device_mesh``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from distributed_scenarios import TIMEOUT, hung_worker, worker

from launch import free_port, run_ranks

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return run_ranks(worker, 4, str(root), timeout=120, pg_timeout=TIMEOUT, env={"OMP_NUM_THREADS": "1"}), root


def test_ranks_that_disagree_on_the_step_all_fail_and_write_nothing(world):
    results, root = world
    for r in results:
        o = r["different-steps"]
        assert not o["ok"] and o["type"] == "CheckpointError", o
        assert "ranks disagree on the step to save: ranks [0, 1, 3] passed step=2; ranks [2] passed step=3" in o["message"]
    assert not (root / "a").exists() or not any((root / "a").iterdir())


def test_ranks_that_built_different_models_all_fail_naming_the_entry(world):
    results, root = world
    for r in results:
        o = r["different-shapes"]
        assert not o["ok"] and o["type"] == "CheckpointError", o
        assert ("ranks disagree on the state to save: 'model.weight' is (4, 4) float32 on rank 0 but (5, 4) "
                "float32 on rank 3") in o["message"], o["message"]
    assert not (root / "c").exists() or not any((root / "c").iterdir())


def test_a_mesh_of_any_dimension_is_compared_whole(world):
    results, _ = world
    for r in results:
        o = r["mesh-18d"]
        assert not o["ok"] and o["type"] == "ValueError", o
        assert "ranks disagree on the mesh" in o["message"] and "Every rank must call init_device_mesh" in o["message"]


def test_a_save_called_on_one_rank_fails_within_the_timeout_naming_the_others(world):
    results, root = world
    o = results[0]["save-on-rank-0"]
    assert not o["ok"] and o["type"] == "CheckpointError", o
    assert "not every rank arrived" in o["message"] and "Ranks 1, 2, 3 failed to pass monitoredBarrier in 3000 ms" in o["message"]
    assert "every rank must call it" in o["message"]
    assert o["s"] < TIMEOUT + 5, o["s"]
    assert not (root / "b" / "step_000001").exists()


@pytest.mark.slow
def test_a_rank_that_stops_responding_fails_the_others_within_the_timeout():
    results = run_ranks(hung_worker, 4, timeout=120, pg_timeout=TIMEOUT, env={"OMP_NUM_THREADS": "1"})
    for rank in range(3):
        o = results[rank]["hung-rank"]
        assert not o["ok"], o
        assert "Timed out" in o["message"] or "timed out" in o["message"], o["message"]
        assert o["s"] < 2 * TIMEOUT + 3, o["s"]


SCRIPT = textwrap.dedent("""
    import os, pathlib, sys, time
    if os.environ["RANK"] == "3":
        sys.exit(0)  # exits cleanly before init_device_mesh
    from vemesh import VESCALE_DEVICE_MESH
    # ranks 0 to 2 start the 4 s wait together: on a loaded machine one rank's imports can end seconds after
    # another's, and that rank would then be named as missing too (a CI run named ranks [2, 3])
    ready = pathlib.Path(os.environ["READY_DIR"])
    (ready / os.environ["RANK"]).touch()
    while len(list(ready.iterdir())) < 3:
        time.sleep(0.05)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), timeout=4)
""")


@pytest.mark.slow
def test_a_rank_missing_at_start_up_is_named(tmp_path):
    script = tmp_path / "missing.py"
    script.write_text(SCRIPT)
    ready = tmp_path / "ready"
    ready.mkdir()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), READY_DIR=str(ready)))
    assert proc.returncode != 0
    assert "rank [3] of 4 never arrived within 4 s (crashed, exited early, or never started); the other 3 did" in proc.stderr, proc.stderr[-3000:]
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize("agent_store", [False, True])
def test_ranks_of_agents_whose_restart_counts_differ_meet_on_a_store_of_the_round(agent_store, monkeypatch):
    """After one node's workers fail, its torchrun agent counts a restart and the others restart for the new round
    without counting: TORCHELASTIC_RESTART_COUNT differs between nodes. On a store of the round's (rank 0 hosts it:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as multi-node elastic jobs run) the ranks still meet; a CI run of the
    elastic example spent every restart with each node's workers waiting for the other's. On the agent's store,
    kept over rounds, the count is what keeps the attempts apart, and the timeout says so."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from vemesh.mesh import startup

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False) if agent_store else None
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", str(agent_store))
    stores, wait = [], timedelta(seconds=3)
    for rank, restarts in ((0, "1"), (1, "0")):  # node 0's workers failed once; node 1's agent restarted for the round
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restarts)
        stores.append(startup._job_store(rank, 2, wait))
    errors: list[str] = []

    def arrive(rank: int) -> None:
        try:
            startup._wait_for_everyone(stores[rank], rank, 2, wait)
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=arrive, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del server
    if not agent_store:
        assert errors == []
    else:
        assert len(errors) == 2 and all("never arrived" in e and "agents count restarts apart" in e
                                        and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in e for e in errors), errors


TWO_NODES = textwrap.dedent("""
    import os, sys
    if os.environ["GROUP_RANK"] == "0" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["LOCAL_RANK"] == "0":
        sys.exit("node 0's first worker fails before init_device_mesh")
    from vemesh import VESCALE_DEVICE_MESH
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), timeout=45)  # loaded machines start workers apart
    print(f"up: rank {os.environ['RANK']}, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
    # rank 0 hosts the round's store, through which ranks 2 and 3 connect the group rank 0 is not in ({2, 3}):
    # exiting at once, it could take the store from a slower rank still connecting, whose agent would then restart
    # it into a round that node 0's agent, done, never joins. One guess at a CI run that hung here (node 0's ranks
    # were up; node 1's agent's words were not kept), not reproduced in 20 runs, 6 of them beside 3 CPU burners
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_two_agents_whose_restart_counts_differ_start_the_job_on_their_next_round(tmp_path):
    """Two torchrun agents of 2 workers (``--nnodes=2``, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the elastic docs
    run them); node 0's first worker exits before ``init_device_mesh``. Its agent counts a restart; node 1's workers
    are still waiting for it, and their agent restarts them for the new round without counting. Every rank comes up
    on that round, two of them at restart 1 and two at 0 (with the count in the store's prefix, each node's workers
    waited for the other's until every restart was spent: a CI run of the elastic example)."""
    script = tmp_path / "two_nodes.py"
    script.write_text(TWO_NODES)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=apart-{port}", "--max-restarts=2", "--monitor-interval=1",
           "--rdzv-conf=last_call_timeout=5", str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONPATH=str(REPO))
    agents = []
    for _ in range(2):  # the first hosts the rendezvous store
        agents.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True))
        time.sleep(2)
    deadline = time.monotonic() + 240
    try:
        outs = [a.communicate(timeout=max(deadline - time.monotonic(), 1))[0] for a in agents]
    except subprocess.TimeoutExpired:  # both agents' words, not only the first's: which node's workers stopped where
        for a in agents:
            a.kill()
        outs = [a.communicate()[0] for a in agents]
        pytest.fail("the two agents did not finish in 240 s:\n" +
                    "\n".join(f"--- agent {i}:\n{o[-3000:]}" for i, o in enumerate(outs)))
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outs)
    up = sorted(re.findall(r"up: rank (\d), restart (\d)", "".join(outs)))  # the workers' lines may interleave
    assert [rank for rank, _ in up] == ["0", "1", "2", "3"], up
    assert sorted(restart for _, restart in up) == ["0", "0", "1", "1"], up  # the agents' counts differ

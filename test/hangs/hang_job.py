"""A 4-rank job on a (DP=2, TP=2) mesh that uses only the mesh and plain torch collectives, with
one fault injected (argv[1]):

* ``sleep``: rank 3 sleeps in compute at step 3 (a hang: its DP group waits for it);
* ``skip``: rank 3 skips its DP all-reduce at step 3 (``skip-end``: no barrier after, each program ends as it would);
* ``size``: rank 1 enters the TP all-reduce at step 3 with the wrong size;
* ``slow``: rank 2 sleeps 50 ms before every DP all-reduce, 30 steps (a straggler, no hang);
* ``kill``: rank 2 kills itself with SIGKILL at step 3 (no dump, no fatal-error file: as the OOM killer does);
* ``exit137``: rank 2 exits with code 137 at step 3, skipping every exit handler;
* ``segv``: rank 2 crashes (a segfault: faulthandler writes its file) in compute at step 3, its peers in compute too;
* ``torch``: no vemesh at all: torch's own mesh, rank 3 withheld from a DP all-reduce, every rank
  writes torch's Flight Recorder dump (``TORCH_FR_DUMP_TEMP_FILE<rank>``) once every rank waits.
"""

import ctypes
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist


def compute(x: torch.Tensor, rank: int, step: int, fault: str) -> torch.Tensor:
    if fault in ("kill", "exit137") and rank == 2 and step == 3:
        print(f"rank 2 dies at {time.time():.3f}", flush=True)  # the test measures the report from here
        os.kill(os.getpid(), signal.SIGKILL) if fault == "kill" else os._exit(137)
    if fault == "segv" and step == 3:
        if rank == 2:
            print(f"rank 2 crashes at {time.time():.3f}", flush=True)
            ctypes.string_at(0)  # as a native extension's bug does
        time.sleep(30)  # the peers in compute: none of their collectives meets the crash, only the launcher's SIGTERM
    if fault == "sleep" and rank == 3 and step == 3:
        time.sleep(600)  # stuck in compute: the line the diagnosis must name
    if fault == "slow" and rank == 2:
        time.sleep(0.05)
    return x * 0.5 + 1


def vemesh_job(fault: str) -> None:
    from vemesh import VESCALE_DEVICE_MESH as mesh

    mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"), timeout=60)
    rank = dist.get_rank()
    x = torch.ones(1024)
    for step in range(1, 31 if fault == "slow" else 6):
        mesh.mark_step(step)
        wrong = fault == "size" and rank == 1 and step == 3
        if wrong:
            print(f"rank 1 sends the wrong size at {time.time():.3f}", flush=True)  # bench/hang_watch.py --dead
        y = torch.ones(1000 if wrong else 256)
        dist.all_reduce(y, group=mesh.get_group("TP"))
        x = compute(x, rank, step, fault)
        if not (fault.startswith("skip") and rank == 3 and step == 3):
            dist.all_reduce(x, group=mesh.get_group("DP"))
    if fault == "skip-end":  # as a training script ends (torch warns where it does not destroy its groups)
        dist.destroy_process_group()
        return
    dist.barrier()
    from vemesh import hangs

    hangs.dump()  # a healthy run's dump, for vemesh diagnose --stragglers (this script ends with os._exit)


def torch_job() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()

    store = dist.distributed_c10d._get_default_store()

    def until(keys: list[str]) -> None:  # check, not wait: a store client is one connection, and wait would hold it
        while not store.check(keys):
            time.sleep(0.1)

    def dump() -> None:  # once every rank is where it waits: each writes torch's dump, then all exit together
        until([f"ready/{r}" for r in range(4)])
        time.sleep(1)
        data = torch._C._distributed_c10d._dump_fr_trace(True, True, False)
        with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "wb") as f:
            f.write(data)
        store.set(f"dumped/{rank}", "1")
        until([f"dumped/{r}" for r in range(4)])
        os._exit(0)

    threading.Thread(target=dump, daemon=True).start()
    x = torch.ones(64)
    dist.all_reduce(x, group=mesh.get_group("tp"))
    dist.all_reduce(x, group=mesh.get_group("dp"))
    store.set(f"ready/{rank}", "1")
    if rank != 3:
        dist.all_reduce(x, group=mesh.get_group("dp"))  # rank 1 waits here for rank 3
    time.sleep(30)


def paced_job(fault: str) -> None:
    """The watch's defaults (no VEMESH_HANG_AFTER, a 60 s collective timeout: 30 s before the warm-up), 30 steps of
    about 0.1 s; ``paced-sleep``: rank 3 sleeps in compute at step 20, after the warm-up (a hang, named by the pace);
    ``paced-pause``: rank 0 declares a pause (vemesh.hangs.paused) of 8 s at step 20, its peers waiting on it (no hang);
    ``paced-slow-start``: rank 0 takes 12 s (SLOW_START_S) before its first collective, as a checkpoint load does (no
    hang);
    ``paced-straggle``: rank 2's steps take STRAGGLE_FACTOR times as long from step 12 on (a straggler, no hang).
    HANG_AT_STEP moves the sleep and the pause (default 20; bench/hang_watch.py --detection); STEPS sets the number of
    steps (default 30)."""
    from vemesh import VESCALE_DEVICE_MESH as mesh
    from vemesh.hangs import paused

    mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"), timeout=60)
    rank = dist.get_rank()
    if fault == "paced-slow-start" and rank == 0:
        time.sleep(float(os.environ.get("SLOW_START_S", "12")))
    x = torch.ones(1024)
    at, factor = int(os.environ.get("HANG_AT_STEP", "20")), float(os.environ.get("STRAGGLE_FACTOR", "1"))
    for step in range(1, int(os.environ.get("STEPS", "30")) + 1):
        mesh.mark_step(step)
        time.sleep(0.1 * (factor if fault == "paced-straggle" and rank == 2 and step >= 12 else 1))
        if step == at and fault == "paced-sleep" and rank == 3:
            print(f"rank 3 sleeps at {time.time():.3f}", flush=True)
            time.sleep(600)
        if step == at and fault == "paced-pause" and rank == 0:
            with paused():
                time.sleep(8)
        dist.all_reduce(x, group=mesh.get_group("DP"))
        dist.all_reduce(x, group=mesh.get_group("TP"))
    dist.barrier()


if __name__ == "__main__":
    fault = sys.argv[1]
    torch_job() if fault == "torch" else paced_job(fault) if fault.startswith("paced") else vemesh_job(fault)
    sys.stdout.flush()
    if fault == "skip-end":  # the program's exit hooks (vemesh's dump at exit), then no C++ teardown: torch's gloo
        import atexit  # group aborts the process ("terminate called") now and then under load while a peer waits

        atexit._run_exitfuncs()
    os._exit(0)

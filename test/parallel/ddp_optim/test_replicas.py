"""vemesh.ft.Replicas against a stand-in for torchft's Manager, in one process (a gloo world of 1):
the quorum is asked for before the data and spent by the commit vote; DDP averages each buffer across
the replicas after DP; ZeRO-1 steps only on a yes vote, and a torch optimizer may not step without one;
a replica's local state heals another. The real torchft runs in test/examples/test_gpt_live_ft.py."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchft")

from vemesh import VESCALE_DEVICE_MESH  # noqa: E402
from vemesh.ddp import DistributedDataParallel as DDP  # noqa: E402
from vemesh.ft import QuorumChange, ReplicaError, Replicas, start_replicas  # noqa: E402
from vemesh.optim import DistributedOptimizer  # noqa: E402


class Work:
    def wait(self) -> bool:
        return True


class FakeManager:
    """torchft's Manager as vemesh uses it: a quorum of ``members``, and an all-reduce in which the other
    replicas contribute ``peer`` times each tensor (0: zeros)."""

    _use_async_quorum = False
    _quorum_timeout = timedelta(seconds=5)
    _min_replica_size = 1

    def __init__(self, members=(0, 1), index=0, peer=0.0) -> None:
        self.members, self.index, self.peer = tuple(members), index, peer
        self._pg = type("PG", (), {"vemesh_quorum": (None, ())})()
        self.step, self.error, self.votes, self.fns, self.reduced = 0, None, [], {}, 0
        self.refuse = False

    def start_quorum(self) -> None:
        self.error = None
        self._pg.vemesh_quorum = (len(self.votes), self.members)

    def num_participants(self) -> int:
        return len(self.members)

    def participating_rank(self) -> int:
        return self.index

    def current_step(self) -> int:
        return self.step

    def errored(self):
        return self.error

    def report_error(self, e: Exception) -> None:
        self.error = e

    def allreduce(self, tensor, reduce_op=None):
        n = len(self.members)
        tensor.mul_((1 + self.peer * (n - 1)) / n)
        self.reduced += 1
        return Work()

    def should_commit(self) -> bool:
        ok = self.error is None and not self.refuse
        self.votes.append(ok)
        self.step += ok
        return ok

    def register_state_dict_fn(self, key, load, save) -> None:
        self.fns[key] = (load, save)


@pytest.fixture
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_quorum_comes_before_the_data_and_the_vote_spends_it() -> None:
    manager = FakeManager(members=(0, 1), index=1)
    replicas = Replicas(manager, replica_id=1)
    with pytest.raises(RuntimeError, match="has no quorum for the next step yet .* call optimizer.zero_grad"):
        replicas.size()
    replicas.start_step()
    assert (replicas.size(), replicas.index(), replicas.in_step) == (2, 1, True)
    assert replicas.change == QuorumChange(1, (), (0, 1), None, None)
    assert str(replicas.change) == "quorum change at step 1: replicas [] -> [0, 1] (2 taking part)"
    assert replicas.should_commit() is True and replicas.vote is True and replicas.step == 1
    with pytest.raises(RuntimeError, match="the last one was used by step 1's commit"):
        replicas.index()
    replicas.start_step()
    assert replicas.change is None and replicas.vote is None  # same members: nothing to print
    replicas.should_commit()
    manager.members, manager.index = (1,), 0
    replicas.start_step()
    assert replicas.change.before == (0, 1) and replicas.change.after == (1,) and replicas.change.seconds_lost >= 0
    replicas.discard("a non-finite loss")
    assert replicas.should_commit() is False and replicas.vote is False


def test_an_async_quorum_is_refused() -> None:
    manager = FakeManager()
    manager._use_async_quorum = True
    with pytest.raises(ValueError, match="use_async_quorum=False: the quorum decides which rows"):
        Replicas(manager, replica_id=0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_ddp_averages_across_replicas_and_zero1_steps_only_on_a_yes(world) -> None:
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    plain = _model()
    nn.functional.mse_loss(plain(x), y).backward()
    manager = FakeManager(members=(0, 1), peer=0.0)  # the other replica's gradient: zeros, so the mean halves
    replicas = Replicas(manager, replica_id=0)
    model = DDP(_model(), replicas=replicas)
    opt = DistributedOptimizer(torch.optim.SGD, models=[model], lr=0.1)
    opt.zero_grad()  # starts the quorum
    assert replicas.in_step
    nn.functional.mse_loss(model(x), y).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad / 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt.committed and manager.votes == [True]
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # a failed cross-replica reduce: the vote is no, nothing is applied, the gradients are dropped
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    manager.report_error(RuntimeError("Connection closed by peer"))
    kept = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert not opt.committed and manager.votes == [True, False]
    assert not replicas.in_step and manager.error is not None  # the next quorum waits for the next zero_grad
    assert all(torch.equal(a, p) for a, p in zip(kept, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    # no_sync accumulates without touching the replicas, even on a DP group of one
    opt.zero_grad()
    reduced = manager.reduced
    with model.no_sync():
        nn.functional.mse_loss(model(x), y).backward()
    assert manager.reduced == reduced
    nn.functional.mse_loss(model(x), y).backward()
    assert manager.reduced > reduced


def test_a_torch_optimizer_may_not_step_without_the_replicas_vote(world) -> None:
    manager = FakeManager()
    replicas = Replicas(manager, replica_id=0)
    model = DDP(_model(), replicas=replicas)
    opt = torch.optim.AdamW(model.parameters())
    replicas.start_step()
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="without their vote to commit \\(no vote yet\\)"):
        opt.step()
    manager.refuse = True
    assert replicas.should_commit() is False
    with pytest.raises(RuntimeError, match="voted down"):
        opt.step()
    replicas.start_step()
    model(torch.randn(2, 4)).sum().backward()
    manager.refuse = False
    assert replicas.should_commit() is True
    opt.step()  # with the vote: torchft's OptimizerWrapper pattern works


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replica_heals_from_another_ones_local_state(world, dtype) -> None:
    def build(seed: int):
        torch.manual_seed(seed)
        model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype), replicas=None)
        return model, DistributedOptimizer(torch.optim.AdamW, models=[model], lr=0.01)

    live, live_opt = build(0)
    for _ in range(3):
        live_opt.zero_grad()
        live(torch.randn(5, 4, dtype=dtype)).float().pow(2).mean().backward()
        live_opt.step()
    source, target = FakeManager(), FakeManager()
    Replicas(source, replica_id=0).track(live, live_opt)
    back, back_opt = build(1)
    healed = Replicas(target, replica_id=1)
    healed.track(back, back_opt)
    sent = copy.deepcopy(source.fns["vemesh"][1]())
    assert sent["from"] == 0
    target.fns["vemesh"][0](sent)
    assert healed._healed_from == 0
    for a, b in zip(live.parameters(), back.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    x = torch.randn(5, 4, dtype=dtype)
    for model, opt in ((live, live_opt), (back, back_opt)):  # the next step is the same on both
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
    for a, b in zip(live.parameters(), back.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_start_replicas_names_each_bad_argument(world, monkeypatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    cases = [(dict(replica_id=-1), "replica_id must be a non-negative integer"),
             (dict(replica_id=True), "got True"),
             (dict(replica_id=0, min_replicas=0, lighthouse="http://h:1"), "min_replicas must be a positive integer; got 0"),
             (dict(replica_id=0), "no torchft lighthouse: pass its address"),
             (dict(replica_id=0, lighthouse="http://h:1", timeout=0), "timeout must be a positive number of seconds; got 0"),
             (dict(replica_id=0, lighthouse="http://h:1", device_type="tpu"), "device_type must be 'cpu' or 'cuda'; got 'tpu'")]
    for kwargs, piece in cases:
        with pytest.raises(ValueError, match=piece):
            start_replicas(**kwargs)
    with pytest.raises(RuntimeError, match="start_replicas: build the mesh of this replica's own ranks first"):
        start_replicas(0, lighthouse="http://localhost:1", connect_timeout=1)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (1,), mesh_dim_names=("DP",))
    try:
        with pytest.raises(ValueError, match="'DP' is already a dim of this mesh"):
            start_replicas(0, lighthouse="http://localhost:1", name="DP")
        with pytest.raises(ReplicaError, match="cannot join the replicas through the torchft lighthouse at http://localhost:1"):
            start_replicas(0, lighthouse="http://localhost:1", connect_timeout=1)
    finally:
        VESCALE_DEVICE_MESH.reset()

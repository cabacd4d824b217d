"""The planner's static memory (vemesh.planning.estimate) against hand arithmetic and against what the real wrappers
allocate: vemesh DDP with torch AdamW, DDP with the ZeRO-1 DistributedOptimizer (fp32 and bf16, with and
without TP on the fake backend), and torch's FSDP2 on the fake backend."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from vemesh import VeDeviceMesh
from vemesh.ddp import DistributedDataParallel as DDP
from vemesh.planning.estimate import build_model, parse_size, static_memory
from vemesh.optim import DistributedOptimizer

from vemesh.models.gpt import GPT, GPTConfig  # noqa: E402

L, C, H, V, T = 2, 32, 4, 256, 32
SPEC = f"gpt:n_layer={L},n_embd={C},n_head={H},vocab={V},seq_len={T}"


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = t._local_tensor if isinstance(t, DTensor) else t
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _measure(model, ddp, opt) -> dict[str, int]:
    """What the wrappers hold after one step: parameters, gradients, optimizer state, fp32 masters."""
    inner = getattr(opt, "optimizer", opt)
    state = [v for st in inner.state.values() for k, v in st.items() if k != "step"]
    params = [p for p in model.parameters()] + [sh.param_data for sh in getattr(opt, "shards", [])]
    masters = [m for sh in getattr(opt, "shards", []) if sh.copy_params for m in sh.main]
    return {"params": _bytes(params), "grads": _bytes([b.data for b in ddp.grad_buffers] + list(ddp._holder.values())),
            "optimizer": _bytes(state), "masters": _bytes(masters)}


def _step(ddp, opt, dtype) -> None:
    x = torch.randint(0, V, (2, T))
    opt.zero_grad()
    ddp(x).float().sum().backward()
    opt.step()


def test_the_parameter_count_is_the_real_models_and_the_hand_count() -> None:
    model, kind = build_model(SPEC)
    assert kind == "gpt" and all(p.is_meta for p in model.parameters())
    n = L * (12 * C * C + 13 * C) + 2 * V * C + T * C + 2 * C  # blocks, wte + lm_head, wpe, ln_f
    assert sum(p.numel() for p in model.parameters()) == n
    row, = static_memory(SPEC, dtype="fp32", dp_mode="ddp")
    assert (row.params, row.grads, row.optimizer, row.masters) == (4 * n, 4 * n, 8 * n, 0)
    row, = static_memory(SPEC, dtype="bf16", dp_mode="zero1", dp=4)
    assert (row.params, row.grads, row.optimizer, row.masters) == (2 * n, 6 * n, 8 * -(-n // 4), 4 * -(-n // 4))


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_ddp_and_zero1_bytes_equal_what_the_wrappers_allocate(world_of_one, mode, dtype) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C)).to(
        {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters()) if mode == "ddp" else DistributedOptimizer(torch.optim.AdamW, models=[ddp])
    _step(ddp, opt, dtype)
    row, = static_memory(SPEC, dtype=dtype, dp_mode=mode)
    assert _measure(model, ddp, opt) == {"params": row.params, "grads": row.grads, "optimizer": row.optimizer,
                                          "masters": row.masters}


@pytest.fixture
def fake():
    def become(rank: int, world: int) -> None:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    yield become
    dist.destroy_process_group()


def test_zero1_under_tp_on_the_fake_backend(fake) -> None:
    from vemesh.models.gpt import apply_tp

    fake(0, 4)
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    torch.manual_seed(0)
    model = apply_tp(GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C)), mesh["TP"])
    ddp = DDP(model, mesh["DP"])
    opt = DistributedOptimizer(torch.optim.AdamW, models=[ddp])
    _step(ddp, opt, "fp32")
    row, = static_memory(SPEC, dp=2, tp=2, dtype="fp32", dp_mode="zero1")
    got = _measure(model, ddp, opt)
    assert got["params"] == row.params and got["grads"] == row.grads and got["masters"] == 0
    # the optimizer state: this rank's own slice of each buffer (the padded share is the largest rank's)
    assert got["optimizer"] <= row.optimizer and row.optimizer - got["optimizer"] <= 8 * 2


def test_fsdp2_shards_are_what_fully_shard_allocates_on_the_fake_backend(fake) -> None:
    from torch.distributed.fsdp import fully_shard

    fake(1, 4)
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (4,), mesh_dim_names=("DP",))
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C))
    for block in model.h.values():
        fully_shard(block, mesh=mesh["DP"])
    fully_shard(model, mesh=mesh["DP"])
    local = sum(p.to_local().numel() for p in model.parameters())
    row, = static_memory(SPEC, dp=4, dp_mode="fsdp")
    assert row.params == 4 * local == row.grads and row.optimizer == 8 * local


@pytest.mark.parametrize(("spec", "piece"), [
    ("gpt:n_layers=2,n_embd=32,n_head=4", "unknown field 'n_layers'; valid fields: n_layer, n_embd, n_head"),
    ("gpt:n_layer=2,n_embd=x,n_head=4", "n_embd needs a positive integer, as n_embd=8; got 'n_embd=x'"),
    ("gpt:n_layer=2", "missing n_embd, n_head"),
    ("module:json:loads", "json:loads() failed: TypeError"),
    ("module:os:getcwd", "getcwd() returned a str, not an nn.Module"),
    ("llama:7b", "expected gpt:FIELD=N,... or module:package.module:factory"),
])
def test_a_bad_model_string_names_the_value(spec, piece) -> None:
    with pytest.raises(ValueError, match=None) as err:
        build_model(spec)
    assert piece in str(err.value)


def test_a_memory_size_needs_a_unit() -> None:
    assert parse_size("80GiB") == 80 * 2**30 and parse_size("1.5 TB") == 1_500_000_000_000
    with pytest.raises(ValueError, match="'80' needs a unit"):
        parse_size("80")
    with pytest.raises(ValueError, match="unknown unit 'GiBs'"):
        parse_size("80GiBs")
    for bad, said in (("-1GiB", "'-1GiB': a size must be at least 1 byte"), ("0GiB", "at least 1 byte"),
                      ("0.5B", "at least 1 byte"), ("eighty GiB", "'eighty GiB' is not a size")):
        with pytest.raises(ValueError, match=said):
            parse_size(bad)

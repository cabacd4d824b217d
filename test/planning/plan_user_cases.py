"""Users' functions that go wrong, each in one plausible way, for test_plan_user_model.py (planned by file path)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import llama  # noqa: E402
import llama_jobs  # noqa: E402

from vemesh.ddp import DistributedDataParallel  # noqa: E402
from vemesh.parallel import fully_shard  # noqa: E402


def make_six() -> torch.nn.Module:
    return llama.make(**dict(llama_jobs.SMALL, n_layers=6))


def make_eight() -> torch.nn.Module:
    return llama.make(**dict(llama_jobs.SMALL, n_layers=8))


def make_two() -> torch.nn.Module:
    return llama.make(**dict(llama_jobs.SMALL, n_layers=2))


def make_eight_with_tables() -> torch.nn.Module:
    """:func:`make_eight` with a table of 2 MiB in each block, a buffer (as torchtitan's Llama3 keeps a RoPE table of
    131,072 positions in each block): 16 MiB that no wrapper shards."""
    model = make_eight()
    for block in model.layers.values():
        block.register_buffer("table", torch.zeros(512, 1024))
    return model


def make_sixteen() -> torch.nn.Module:
    """Sixteen blocks under a large vocabulary: on a pipeline of two stages (eight blocks each), 1F1B, micro-batches
    of 4, PP rank 0 peaks at the end of its backward with 3 or 4 blocks a stage and where the forward ends with 8; a
    difference of the whole step's peaks said 0.954 of tracing every block."""
    return llama.make(**dict(llama_jobs.SMALL, vocab_size=32768, n_layers=16))


def make_fails() -> torch.nn.Module:
    raise RuntimeError("no checkpoint at /models/base")


def make_not_a_module() -> dict:
    return {}


def parallelize_fails(model, mesh):
    raise KeyError("layers.9")


def parallelize_nothing(model, mesh):
    return model


def parallelize_torch_ddp(model, mesh):
    """What a torch user writes: torch's own DDP over the mesh's DP group."""
    return torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["DP"].get_group())


def parallelize_torch_ddp_compressed(model, mesh):
    """torch's own DDP with torch's fp16 compression hook, whose own casts the planner would not count."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["DP"].get_group())
    ddp.register_comm_hook(mesh["DP"].get_group(), default_hooks.fp16_compress_hook)
    return ddp


def parallelize_torch_ddp_unused(model, mesh):
    """torch's own DDP told to look for unused parameters each backward."""
    return torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["DP"].get_group(),
                                                     find_unused_parameters=True)


def parallelize_tp_torch_ddp(model, mesh):
    """TP, then torch's own DDP over the mesh's DP group: its constructor meets TP's DTensors beside plain tensors."""
    llama_jobs._model_parallel(model, mesh, sequence_parallel=False, checkpointed=False)
    return torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["DP"].get_group())


def parallelize_torch_replicate(model, mesh):
    """torch's composable DDP (``replicate``): DDP's C++ reducer, made at the first forward."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=mesh["DP"])
    return model


def parallelize_replicate_with_fsdp(model, mesh):
    """torch's replicate on FSDP2's engine: each block and the root, every parameter whole on each DP rank."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for layer in model.layers.values():
        replicate(layer, mesh=mesh["DP"])
    replicate(model, mesh=mesh["DP"])
    return model


def parallelize_fsdp1(model, mesh):
    """torch's FSDP1 as its examples wrap a model (on a GPU it takes the device from the parameters)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, process_group=mesh["DP"].get_group(), use_orig_params=True)


def parallelize_fsdp1_on_cpu(model, mesh):
    """torch's FSDP1 told its device is the CPU: it builds on a plan's fake tensors."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, process_group=mesh["DP"].get_group(), use_orig_params=True,
                                    device_id=torch.device("cpu"))


def parallelize_torch_fsdp(model, mesh):
    """torch's own ``fully_shard`` with no mesh, as torch's FSDP2 examples call it: a 1-D mesh over the world."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block)
    return fully_shard(model)


def parallelize_tp_then_torch_fsdp(model, mesh):
    """torchtitan's TP plan, then torch's ``fully_shard`` with no mesh (as torch's FSDP2 examples call it): torch
    raises ``TypeError: Invariant encountered: value was None when it should not be`` from inside FSDP2."""
    from torch.distributed.fsdp import fully_shard

    llama_jobs._tp(model, mesh, sequence_parallel=False)
    for block in model.layers.values():
        fully_shard(block)
    return fully_shard(model)


def parallelize_fsdp_then_tp(model, mesh):
    """FSDP2 over DP first, then torchtitan's TP plan: torch raises "Cannot distribute a DTensor with device mesh"."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh["DP"])
    llama_jobs._tp(fully_shard(model, mesh=mesh["DP"]), mesh, sequence_parallel=False)
    return model


def step_forward_only(model, micro_batch_size):
    """The loss computed and returned, no ``backward()``: a forward alone."""
    tokens = torch.randint(0, llama_jobs.SMALL["vocab_size"], (micro_batch_size, 65))
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def parallelize_fsdp_blocks_only(model, mesh):
    """FSDP2 on each block and not on the root: the embedding, the last norm and the head are never averaged."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh["DP"])
    return model


def parallelize_tp_on_the_whole_mesh(model, mesh):
    """A TP style given the whole mesh (DP, TP): torch raises "`placements` must have the same length"."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    return parallelize_module(model, mesh, {"output": ColwiseParallel()})


def _offloaded(model, mesh, pin_memory: bool):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh["DP"], offload_policy=CPUOffloadPolicy(pin_memory=pin_memory))
    return fully_shard(model, mesh=mesh["DP"], offload_policy=CPUOffloadPolicy(pin_memory=pin_memory))


def parallelize_offloaded(model, mesh):
    """FSDP2 with CPU offload, as its docs write it (pinned): the trace cannot pin a fake tensor."""
    return _offloaded(model, mesh, pin_memory=True)


def parallelize_offloaded_unpinned(model, mesh):
    """FSDP2 with CPU offload, unpinned: it traces, and the plan would count the host's shards as the device's."""
    return _offloaded(model, mesh, pin_memory=False)


def parallelize_reshard_to_pairs(model, mesh):
    """FSDP2 resharding each block over pairs of its DP ranks after forward (an int reshard_after_forward): the plan
    told the user their function read a tensor's value (FSDP2 builds the pairs' mesh from the rank tensor)."""
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=2)
    return fully_shard(model)


def parallelize_returns_none(model, mesh):
    DistributedDataParallel(model)


def parallelize_counts_blocks(model, mesh):
    """Reaches for block 7 by number: a model cut to 3 blocks has none, so the planner traces all 8."""
    model.layers["7"].ffn_norm.eps = 1e-5
    return DistributedDataParallel(model)


def step_reads_loss(model, micro_batch_size):
    loss = llama.loss_fn(model(torch.zeros(micro_batch_size, 16, dtype=torch.long)),
                         torch.zeros(micro_batch_size, 16, dtype=torch.long))
    loss.backward()
    print(f"loss {loss.item():.3f}")


def step_with_own_group(model, micro_batch_size):
    llama_jobs.step(model, micro_batch_size)
    pair = dist.new_group([0, 1])
    dist.all_reduce(torch.zeros(4), group=pair)


def step(model, micro_batch_size):
    llama_jobs.step(model, micro_batch_size)


def step_without_cp(model, micro_batch_size):
    """A step written before the job had CP: whole sequences, no ``context_parallel``."""
    tokens = torch.randint(0, llama_jobs.SMALL["vocab_size"], (micro_batch_size, 65))
    llama.loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()


def make_head_heavy() -> torch.nn.Module:
    """Nine blocks under a large vocabulary: under FSDP2, with 2 or 3 blocks the step peaks at the end of its
    backward (the head's and the embedding's unsharded gradients), with nine where every block's activations are
    held."""
    return llama.make(**dict(llama_jobs.SMALL, vocab_size=32768, dim=512, hidden_dim=1024, n_layers=9))


class SideBySideInPlace(torch.nn.Module):
    """Falcon's block in small: attention and MLP side by side, the attention's output added into the MLP's in place
    (``mlp_output += attention_output``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.attn = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        out = self.mlp(x)
        out += self.attn(x)
        return out


def make_side_by_side_in_place() -> torch.nn.Module:
    return SideBySideInPlace()


def parallelize_side_by_side(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {f"{part}.0": ColwiseParallel() for part in ("attn", "mlp")}
    plan.update({f"{part}.1": RowwiseParallel() for part in ("attn", "mlp")})
    parallelize_module(model, mesh["TP"], plan)
    return DistributedDataParallel(model)


def step_side_by_side(model, micro_batch_size):
    loss = model(torch.randint(0, 256, (micro_batch_size, 16))).square().mean()
    loss.backward()
    return loss.detach()


def parallelize_side_by_side_copied(model, mesh):
    """:func:`parallelize_side_by_side` with what the planner's error says to write: the MLP returns a copy."""
    model = parallelize_side_by_side(model, mesh)
    model.module.mlp.register_forward_hook(lambda module, args, out: out.clone())
    return model


def make_mlp() -> torch.nn.Module:
    """Eight wide Linear + Tanh layers: a step whose activations, not its weights, are most of its peak."""
    return torch.nn.Sequential(*(m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())))


def step_mlp(model, micro_batch_size):
    model(torch.randn(micro_batch_size * 64, 256)).square().mean().backward()


def step_mlp_saved_on_cpu(model, micro_batch_size):
    """What autograd saves goes to the host (``torch.autograd.graph.save_on_cpu``), back for the backward."""
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        loss = model(torch.randn(micro_batch_size * 64, 256)).square().mean()
    loss.backward()


def parallelize_mlp(model, mesh):
    return DistributedDataParallel(model)


class _Flex(torch.nn.Module):
    """One attention through torch's FlexAttention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v)


def make_flex() -> torch.nn.Module:
    return _Flex()


def step_flex(model, micro_batch_size):
    model(torch.randn(micro_batch_size, 8, 32)).sum().backward()


def make_mlp_cuda() -> torch.nn.Module:
    """The factory as a GPU script writes it: built under the device's context, and moved to it."""
    with torch.device("cuda"):
        return make_mlp().cuda()


def parallelize_mlp_to_cuda(model, mesh):
    model.to("cuda")
    return DistributedDataParallel(model)


def step_mlp_cuda(model, micro_batch_size):
    """The step as a GPU script writes it: its inputs made on the device, and moved there."""
    x = torch.randn(micro_batch_size * 64, 256, device="cuda")
    target = torch.zeros(micro_batch_size * 64, 256).to("cuda", non_blocking=True).pin_memory().cuda()
    (model(x) - target).square().mean().backward()


def step_mlp_target(model, micro_batch_size):
    """:func:`step_mlp_cuda` as a CPU script writes it."""
    x = torch.randn(micro_batch_size * 64, 256)
    target = torch.zeros(micro_batch_size * 64, 256)
    (model(x) - target).square().mean().backward()


def step_mlp_timed(model, micro_batch_size):
    """A step that times itself with CUDA events: ``torch.cuda``'s own objects need CUDA."""
    start = torch.cuda.Event(enable_timing=True)
    step_mlp(model, micro_batch_size)
    return start


def make_mlp_meta() -> torch.nn.Module:
    """torchtitan's way: built on the meta device, to be materialized by the parallelize function."""
    with torch.device("meta"):
        return make_mlp()


def parallelize_mlp_own_init(model, mesh):
    """Each rank initializes its own weights (seeded by its rank), then FSDP2: the replicas differ, a real bug."""
    from vemesh.parallel import fully_shard

    torch.manual_seed(1000 + dist.get_rank())
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
    return fully_shard(model)


def step_mlp_fixed(model, micro_batch_size):
    """The same rows on every DP rank (a generator of its own)."""
    x = torch.randn(micro_batch_size * 64, 256, generator=torch.Generator().manual_seed(3))
    model(x).square().mean().backward()

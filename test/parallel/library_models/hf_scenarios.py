"""What each rank runs in test_hf_models.py: Hugging Face transformers' own model classes, unchanged (tiny configs),
parallelized with vemesh and torch APIs only, trained 3 steps, and compared with one process on the global batch.

Each case returns its loss per step (the mean over the global batch) and the largest difference of any final
parameter from the one-process run, which every rank computes itself (the models are small).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import parity  # noqa: E402

from vemesh import VESCALE_DEVICE_MESH as mesh  # noqa: E402
from vemesh.ddp import DistributedDataParallel as DDP  # noqa: E402
from vemesh.parallel import DecoderStage, ExpertParallel, ParallelDims, context_parallel, fully_shard  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, LR, EPS = 3, 4, 16, 128, 1e-3, 1e-6

#: HF Llama's TP plan by its module names (what its config's base_model_tp_plan says), as torch's styles.
LLAMA_TP = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def make(kind: str) -> torch.nn.Module:
    """A tiny HF model, the same on every rank (HF's own init under one seed), in fp32."""
    import transformers as hf

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=64, attn_implementation="sdpa")
    if kind in ("llama", "llama4"):  # llama4: 4 layers, for 4 pipeline stages of one
        return hf.LlamaForCausalLM(hf.LlamaConfig(intermediate_size=64, **{**common, "num_hidden_layers": 2 + 2 * (kind == "llama4")}))
    if kind == "qwen3moe":
        return hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                                        num_experts_per_tok=2, norm_topk_prob=True, **common))
    if kind == "mixtral":
        return hf.MixtralForCausalLM(hf.MixtralConfig(intermediate_size=16, num_local_experts=4,
                                                      num_experts_per_tok=2, **common))
    raise ValueError(kind)


def batch(step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The mean next-token loss of HF's logits against labels shifted outside (so a CP shard's labels are its own)."""
    logits = model(input_ids=x, position_ids=positions).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make(kind)
    size = 2 * BATCH if kind == "llama4" else BATCH  # the pipelines': 4 micro-batches of 1 on each of 2 DP ranks
    losses = parity.one_process(model, (batch(step, size) for step in range(STEPS)), loss_of, lr=LR, eps=EPS)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(dims: ParallelDims, kind: str, wrap: str, optimizer: str) -> dict[str, Any]:
    dims.build("cpu", mesh)
    model = make(kind)
    layers = model.model.layers
    if dims.tp > 1:  # HF's module names, torch's styles, vemesh's TP mesh
        for layer in layers:
            parallelize_module(layer, mesh["TP"], LLAMA_TP)
    if dims.ep > 1:  # HF's fused experts (the routed contract): E / EP of them on each EP rank
        for layer in layers:
            parallelize_module(layer.mlp.experts, mesh["EP"], ExpertParallel())
    model = parity.wrap(model, layers, wrap)
    opt = parity.optimizer(model, optimizer, lr=LR, eps=EPS)
    rows = mesh.lookup_rank("DP")
    data = mesh.get_group(dims.grad_dim) if dims.grad_dim else None
    cp = mesh["CP"] if dims.cp > 1 else None
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = (t.chunk(dims.dp)[rows].clone() for t in batch(step))
        if cp is not None:  # HF takes positions: give them as a buffer, cut with the tokens and labels
            positions = torch.arange(SEQ).expand_as(x).clone()
            with context_parallel(cp, buffers=[x, y, positions], buffer_seq_dims=[1, 1, 1]):
                loss = loss_of(model, x, y, positions)
                loss.backward()
        else:
            loss = loss_of(model, x, y)
            loss.backward()
        opt.step()
        losses.append(parity.mean_over(loss, data))
    params = parity.whole_params(model)
    mesh.reset()
    return {"losses": losses, "params": params}


compare = parity.compare


def pipelined(world_size: int, schedule: str, pp: int, tp: int, wrap: str) -> dict[str, Any]:
    """HF Llama (4 layers) cut into vemesh's :class:`~vemesh.parallel.DecoderStage` s, run by torch's ``schedule`` on ``mesh["PP"]`` as a user calls it
    (``schedule.step``), with HF's TP plan inside the stages and vemesh DDP (or FSDP2 on each layer and the stage)
    over DP. Under a zero-bubble schedule the first step is tried before ``finish_grad_sync(force=True)`` (its
    refusal is returned), then stepped with it; with FSDP2, which has nothing to call, the refusal alone."""
    from torch.distributed.pipelining import PipelineStage

    from vemesh.parallel.schedules import MULTI_STAGE, ZERO_BUBBLE, schedule_class, stage_indices, stages_per_rank

    dims = ParallelDims(world_size, pp=pp, tp=tp)
    dims.build("cpu", mesh)
    model, n_stages = make("llama4"), pp * stages_per_rank(schedule)
    mine = stage_indices(mesh.lookup_rank("PP"), pp, schedule)
    parts = [DecoderStage(model, s, n_stages) for s in mine]
    for layer in (layer for part in parts for layer in part.model.layers if tp > 1):
        parallelize_module(layer, mesh["TP"], LLAMA_TP)
    if wrap == "fsdp":
        for part in parts:
            parity.wrap(part, list(part.model.layers), "fsdp")
    chunks = [DDP(part) if dims.dp > 1 and wrap == "ddp" else part for part in parts]
    stages = [PipelineStage(c, s, n_stages, torch.device("cpu"), group=mesh.get_group("PP")) for c, s in zip(chunks, mine)]
    loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
    run = schedule_class(schedule)(stages if schedule in MULTI_STAGE else stages[0], 2 * BATCH // dims.dp, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=LR, eps=EPS)
    losses, refused, last = [], "", n_stages - 1 in mine
    for step in range(STEPS):
        opt.zero_grad()
        x, y = (t.chunk(dims.dp)[mesh.lookup_rank("DP") if dims.dp > 1 else 0].clone() for t in batch(step, 2 * BATCH))
        held: list[torch.Tensor] = []
        run.step(*(x,) * (0 in mine), **(dict(target=y, losses=held) if last else {}))
        if schedule in ZERO_BUBBLE and dims.dp > 1:
            if step == 0:
                try:
                    opt.step()
                except RuntimeError as e:
                    refused = str(e)
            if wrap == "fsdp":
                mesh.reset()
                return {"refused": refused}
            for c in chunks:
                c.finish_grad_sync(force=True)
        opt.step()
        total = torch.stack(held).mean() if last else torch.zeros(())
        dist.all_reduce(total)  # the last stage's DP x TP ranks hold the loss (the TP peers alike)
        losses.append(total.item() / (dims.dp * tp))
    params: dict[str, torch.Tensor] = {}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, {k: v for c in chunks for k, v in parity.whole_params(c).items()})
    for part in gathered:
        params.update(part)
    mesh.reset()
    return {"losses": losses, "params": params, "refused": refused}


PIPELINES = {  # name: (schedule, pp, tp, data-parallel wrapper), on 4 ranks (DP the rest)
    "llama4-pp2-dp2-1f1b": ("1f1b", 2, 1, "ddp"),
    "llama4-pp2-dp2-zbv": ("zbv", 2, 1, "ddp"),
    "llama4-pp2-tp2-interleaved-1f1b": ("interleaved-1f1b", 2, 2, "ddp"),
    "llama4-pp2-dp2-1f1b-fsdp2": ("1f1b", 2, 1, "fsdp"),
    "llama4-pp2-dp2-zbv-fsdp2": ("zbv", 2, 1, "fsdp"),  # refused: FSDP2 misses the weight pass's gradients
}


CASES = {  # name: (degrees, model, wrapper, optimizer)
    "llama-tp2-ddp": (dict(tp=2), "llama", "ddp", "adamw"),
    "llama-tp2-zero1": (dict(tp=2), "llama", "ddp", "zero1"),
    "llama-dp2-cp2-ddp": (dict(cp=2), "llama", "ddp", "adamw"),
    "qwen3moe-ep2-ddp": (dict(ep=2), "qwen3moe", "ddp", "adamw"),
    "qwen3moe-ep2-zero1": (dict(ep=2), "qwen3moe", "ddp", "zero1"),
    "qwen3moe-ep2-fsdp2": (dict(ep=2), "qwen3moe", "fsdp", "adamw"),
    "mixtral-ep2-ddp": (dict(ep=2), "mixtral", "ddp", "adamw"),
}


def fsdp2_then_tp(world_size: int) -> dict[str, Any]:
    """HF Llama on FSDP2 over DP = 4 for 2 steps, saved with ``vemesh.checkpoint``; loaded into DP = 2 x TP = 2 (HF's
    TP plan, vemesh DDP, AdamW) built from other weights, and trained on for step 3: every loss and the final
    parameters against one process's 3 steps."""
    import shutil
    import tempfile

    from vemesh import checkpoint

    root = [tempfile.mkdtemp(prefix="hf-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    losses: list[float] = []

    def steps(model: torch.nn.Module, opt: torch.optim.Optimizer, dims: ParallelDims, which: range) -> None:
        rows = mesh.lookup_rank("DP")
        for step in which:
            opt.zero_grad()
            x, y = (t.chunk(dims.dp)[rows].clone() for t in batch(step))
            loss = loss_of(model, x, y)
            loss.backward()
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total, group=mesh.get_group("DP"))
            losses.append(total.item() / dims.dp)

    dims = ParallelDims(world_size)
    dims.build("cpu", mesh)
    model = make("llama")
    for layer in model.model.layers:
        fully_shard(layer)
    model = fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    steps(model, opt, dims, range(2))
    checkpoint.save(root[0], model=model, optimizer=opt, step=2)
    mesh.reset()
    dims = ParallelDims(world_size, tp=2)
    dims.build("cpu", mesh)
    torch.manual_seed(1)
    model = make("llama")
    with torch.no_grad():  # other weights than the saved ones: only the load can make them match
        for p in model.parameters():
            p.add_(0.5)
    for layer in model.model.layers:
        parallelize_module(layer, mesh["TP"], LLAMA_TP)
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    step, _ = checkpoint.load(root[0], model=model, optimizer=opt)
    dist.barrier()  # every rank has read the checkpoint: rank 0 removes what it made
    if dist.get_rank() == 0:
        shutil.rmtree(root[0])
    steps(model, opt, dims, range(step, STEPS))
    params = parity.whole_params(model)
    mesh.reset()
    return {"losses": losses, "params": params, "step": step}


def one_expert_for_all(world_size: int) -> dict[str, Any]:
    """Every token of every rank routed to experts 0 and 1 (EP rank 0's): the EP ranks holding no chosen expert still
    run the backward exchange their peers wait for; outputs and gradients (relative to their largest) match one
    process."""
    experts = make("qwen3moe").model.layers[0].mlp.experts
    whole = {n: p.detach().clone() for n, p in experts.named_parameters()}
    x = torch.randn(world_size * 6, 32, generator=torch.Generator().manual_seed(7))
    index = torch.zeros(x.size(0), 2, dtype=torch.long)
    index[:, 1] = 1  # the two choices: experts 0 and 1, both on EP rank 0
    weights = torch.rand(x.size(0), 2, generator=torch.Generator().manual_seed(8))
    ref = experts(x, index, weights)
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in experts.named_parameters()}
    ParallelDims(world_size, ep=2).build("cpu", mesh)
    mine = make("qwen3moe").model.layers[0].mlp.experts
    mine.load_state_dict(whole)
    parallelize_module(mine, mesh["EP"], ExpertParallel())
    rank = dist.get_rank()
    part = slice(rank * 6, rank * 6 + 6)
    out = mine(x[part], index[part], weights[part])
    out.square().sum().backward()
    diffs = []
    for n, p in mine.named_parameters():
        grad = p.grad.full_tensor()
        dist.all_reduce(grad, group=mesh.get_group("EDP"))  # an EP group's tokens' gradient; over EDP the batch's
        diffs.append(((grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item())  # relative: sums of 24
    result = {"out_diff": (out - ref[part]).abs().max().item(), "grad_diff": max(diffs)}

    class Shortcut(torch.nn.Module):  # grouped experts that return zeros without autograd when they get no token
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4, 32, 32) / 32)

        def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            if x.numel() == 0:
                return torch.zeros_like(x)
            return torch.cat([t @ w for t, w in zip(x.split(counts.tolist()), self.w)])

    shortcut = parallelize_module(Shortcut(), mesh["EP"], ExpertParallel())
    tokens = x[part].clone().requires_grad_()
    shortcut(tokens, torch.tensor([6, 0, 0, 0])).square().sum().backward()  # all to expert 0, EP rank 0's
    result["shortcut_grad"] = (tokens.grad - 2 * tokens.detach() @ shortcut.w.full_tensor()[0].detach() @
                               shortcut.w.full_tensor()[0].detach().t()).abs().max().item()
    mesh.reset()
    return result


def worker(rank: int, world_size: int, cases: dict[str, tuple]) -> dict[str, Any]:
    refs = {kind: reference(kind) for kind in {c[1] for c in cases.values()}}
    out: dict[str, Any] = {}
    for name, (degrees, kind, wrap, optimizer) in cases.items():
        try:
            out[name] = compare(train(ParallelDims(world_size, **degrees), kind, wrap, optimizer), refs[kind])
        except Exception:  # noqa: BLE001 - reported back to pytest
            out[name] = {"error": traceback.format_exc()}
            mesh.reset()
    for name, (schedule, pp, tp, wrap) in PIPELINES.items():
        try:
            got = pipelined(world_size, schedule, pp, tp, wrap)
            out[name] = dict(compare(got, reference("llama4")), refused=got["refused"]) if "params" in got else got
        except Exception:  # noqa: BLE001 - reported back to pytest
            out[name] = {"error": traceback.format_exc()}
            mesh.reset()
    out["one-expert-for-all"] = one_expert_for_all(world_size)
    try:
        got = fsdp2_then_tp(world_size)
        out["llama-fsdp2-checkpoint-to-dp2-tp2"] = dict(compare(got, refs.get("llama") or reference("llama")),
                                                         step=got["step"])
    except Exception:  # noqa: BLE001 - reported back to pytest
        out["llama-fsdp2-checkpoint-to-dp2-tp2"] = {"error": traceback.format_exc()}
        mesh.reset()
    return out

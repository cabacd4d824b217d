"""Ties and fused projections on torch's fake backend (every rank's view in one process), and the strided shard's
values on 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from vemesh import VESCALE_DEVICE_MESH as mesh
from vemesh.ddp import DistributedDataParallel
from vemesh.parallel import FusedColwiseParallel, ParallelDims, check_ties, fully_shard, parallelize_module
from vemesh.parallel.fused import fsdp_placement
from vemesh.parallel.ties import BrokenTieError, tie_groups
from vemesh.planning.fake_world import _forget_meshes


@pytest.fixture
def world():  # type: ignore[no-untyped-def]
    def build(n: int, rank: int = 0, tp: int = 2):  # type: ignore[no-untyped-def]
        dist.init_process_group("fake", rank=rank, world_size=n, store=FakeStore())
        ParallelDims(n, tp=tp).build("cpu")
        return mesh
    yield build
    mesh.reset()
    if dist.is_initialized():
        dist.destroy_process_group()
    _forget_meshes()  # DTensor's caches are keyed by meshes that compare equal across fake worlds


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 16)
        self.mid = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.mid(self.wte(idx)))


ENDS = {"wte": RowwiseParallel(input_layouts=Replicate()), "lm_head": ColwiseParallel(output_layouts=Replicate())}


def test_tie_groups_names_every_end() -> None:
    assert tie_groups(Tied()) == [["wte.weight", "lm_head.weight"]]


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_torch_parallelize_module_breaks_the_tie_and_ddp_and_fully_shard_refuse(world, rank: int) -> None:  # type: ignore[no-untyped-def]
    world(4, rank)
    model = Tied()
    torch_parallelize_module(model, mesh["TP"], ENDS)
    assert model.wte.weight is not model.lm_head.weight  # what torch does: two parameters where there was one
    with pytest.raises(BrokenTieError, match=r"vemesh DistributedDataParallel: the tied parameter wte.weight and "
                                             r"lm_head.weight was one parameter and is now 2"):
        DistributedDataParallel(model)
    with pytest.raises(BrokenTieError, match=r"vemesh.parallel.fully_shard: the tied parameter wte.weight"):
        fully_shard(model)


def test_one_end_sharded_is_a_broken_tie_too(world) -> None:  # type: ignore[no-untyped-def]
    world(2)
    model = Tied()
    torch_parallelize_module(model, mesh["TP"], {"lm_head": ColwiseParallel()})
    with pytest.raises(BrokenTieError, match=r"wte.weight is a plain tensor; lm_head.weight is a DTensor"):
        check_ties(model, "here")
    model = Tied()
    with pytest.raises(BrokenTieError, match=r"sharded its ends differently \(wte.weight is a plain tensor"):
        parallelize_module(model, mesh["TP"], {"lm_head": ColwiseParallel()})


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_vemesh_parallelize_module_keeps_one_parameter_sharded_once(world, rank: int) -> None:  # type: ignore[no-untyped-def]
    world(4, rank)
    model = Tied()
    parallelize_module(model, mesh["TP"], ENDS)
    assert model.wte.weight is model.lm_head.weight
    assert model.wte.weight.placements == (Shard(0),) and model.wte.weight.to_local().shape == (32, 16)
    assert len(list(model.parameters())) == 3  # wte/lm_head once, mid's weight and bias
    check_ties(model, "here")  # nothing to say
    DistributedDataParallel(model)  # accepted


class Head(nn.Module):
    """BERT's masked-LM head: its Linear's bias held again by the head (HF ties ``cls.predictions.bias`` to it)."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(16, 64)
        self.bias = nn.Parameter(torch.zeros(64))
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)


class TiedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 16)
        self.head = Head()
        self.wte.weight = self.head.decoder.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.wte(idx))


@pytest.mark.parametrize("rank", [0, 3])
def test_an_end_held_again_above_a_sharded_end_is_re_tied_and_a_use_of_its_own_left_whole_raises(world, rank: int) -> None:  # type: ignore[no-untyped-def]
    """The head's ``bias`` is its decoder's, held again by the module above; no style shards it. It is re-tied to
    the sharded bias; an embedding left whole beside its sharded head is a use of its own, and raises as before."""
    world(4, rank)
    model = TiedTwice()
    parallelize_module(model, mesh["TP"], {"wte": RowwiseParallel(input_layouts=Replicate()),
                                           "head.decoder": ColwiseParallel(output_layouts=Replicate())})
    assert model.head.bias is model.head.decoder.bias and model.wte.weight is model.head.decoder.weight
    assert model.head.bias.placements == (Shard(0),) and model.head.bias.to_local().shape == (32,)
    assert len(list(model.parameters())) == 2
    check_ties(model, "here")  # nothing to say
    DistributedDataParallel(model)  # accepted
    with pytest.raises(BrokenTieError, match=r"wte.weight and head.decoder.weight are one tied parameter, and the "
                                             r"plan sharded its ends differently \(wte.weight is a plain tensor"):
        parallelize_module(TiedTwice(), mesh["TP"], {"head.decoder": ColwiseParallel(output_layouts=Replicate())})


class Shared(nn.Module):
    """HF T5's ties: ``shared`` and each stack's ``embed_tokens`` are Embeddings holding one weight, and the head's."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(64, 16)
        self.encoder, self.decoder = nn.Module(), nn.Module()
        self.encoder.embed_tokens, self.decoder.embed_tokens = nn.Embedding(64, 16), nn.Embedding(64, 16)
        self.encoder.embed_tokens.weight = self.decoder.embed_tokens.weight = self.shared.weight
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.shared.weight

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.encoder.embed_tokens(src).mean(1, keepdim=True) + self.decoder.embed_tokens(tgt))


def test_ends_held_by_modules_like_a_styled_one_are_named_with_its_style(world) -> None:  # type: ignore[no-untyped-def]
    """The two stacks' Embeddings left out of the plan: the refusal names them with the style ``shared`` got; given
    it, the four ends are one sharded parameter."""
    world(2)
    with pytest.raises(BrokenTieError, match=r"encoder.embed_tokens and decoder.embed_tokens are Embedding like "
                                             r"shared, which the plan styled: add them to the plan with its style "
                                             r"\('encoder.embed_tokens': RowwiseParallel\(input_layouts=\(Replicate"):
        parallelize_module(Shared(), mesh["TP"], {"shared": RowwiseParallel(input_layouts=Replicate()),
                                                  "lm_head": ColwiseParallel(output_layouts=Replicate())})
    model = Shared()
    parallelize_module(model, mesh["TP"], {"shared": RowwiseParallel(input_layouts=Replicate()),
                                           "*.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                           "lm_head": ColwiseParallel(output_layouts=Replicate())})
    assert model.encoder.embed_tokens.weight is model.shared.weight is model.lm_head.weight
    assert len(list(model.parameters())) == 1 and model.shared.weight.placements == (Shard(0),)
    # a Linear end left whole beside a sharded Embedding is not of its kind: the general recipe
    with pytest.raises(BrokenTieError, match=r"Shard every end the same way"):
        parallelize_module(Tied(), mesh["TP"], {"wte": RowwiseParallel(input_layouts=Replicate())})


def test_a_re_tie_by_hand_is_accepted(world) -> None:  # type: ignore[no-untyped-def]
    world(2)
    model = Tied()
    torch_parallelize_module(model, mesh["TP"], ENDS)
    model.lm_head.weight = model.wte.weight
    check_ties(model, "here")


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_style_shards_each_chunk_and_replicates_the_bias(world, rank: int) -> None:  # type: ignore[no-untyped-def]
    world(2, rank)
    lin = nn.Linear(8, 24)
    torch_parallelize_module(lin, mesh["TP"], FusedColwiseParallel(3))
    assert lin.weight.placements == (_StridedShard(0, split_factor=3),) and lin.weight.to_local().shape == (12, 8)
    assert lin.bias.placements == (Replicate(),)
    assert fsdp_placement(lin.weight) == Shard(1) and fsdp_placement(lin.bias) is None


@pytest.mark.parametrize("make, message", [
    (lambda: FusedColwiseParallel([32, 8, 8]), r"chunks \[32, 8, 8\] are unequal \(GQA's q and kv parts\?\)"),
    (lambda: FusedColwiseParallel(0), r"chunks must be at least 1, got 0"),
    (lambda: FusedColwiseParallel("3"), r"chunks must be a positive int or a list of positive sizes, got '3'"),
    (lambda: FusedColwiseParallel(3, output_layouts=Shard(1)), r"output_layouts must be None .* or Replicate\(\)"),
])
def test_fused_style_bad_arguments(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        make()


def test_fused_style_refuses_rows_that_do_not_split_into_whole_chunks(world) -> None:  # type: ignore[no-untyped-def]
    world(4, tp=4)
    with pytest.raises(ValueError, match=r"has 18 rows, which 3 chunks over 4 TP ranks cannot split evenly"):
        torch_parallelize_module(nn.Linear(8, 18), mesh["TP"], FusedColwiseParallel(3))
    with pytest.raises(ValueError, match=r"shards an nn.Linear, got Embedding"):
        torch_parallelize_module(nn.Embedding(8, 12), mesh["TP"], FusedColwiseParallel(3))


def test_the_lineage_is_tracked_by_the_mesh_before_vemesh_parallel_is_imported(tmp_path) -> None:
    """A script that imports only the mesh, parallelizes with torch, and imports vemesh's DDP afterwards: the tie
    torch broke is still refused (the mesh registers the hook; parallelize_module needs the mesh first)."""
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from torch import nn\n"
        "from torch.distributed.tensor import Replicate\n"
        "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "from vemesh import VESCALE_DEVICE_MESH as mesh\n"
        "import sys\n"
        "assert 'vemesh.parallel' not in sys.modules, 'the test needs vemesh.parallel unimported here'\n"
        "dist.init_process_group('fake', rank=0, world_size=4, store=FakeStore())\n"
        "mesh.init_device_mesh('cpu', (2, 2), mesh_dim_names=('DP', 'TP'))\n"
        "m = nn.Module(); m.wte = nn.Embedding(8, 4); m.head = nn.Linear(4, 8, bias=False); m.wte.weight = m.head.weight\n"
        "parallelize_module(m, mesh['TP'], {'wte': RowwiseParallel(input_layouts=Replicate()), 'head': ColwiseParallel()})\n"
        "from vemesh.ddp import DistributedDataParallel\n"
        "try:\n"
        "    DistributedDataParallel(m)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "refused: vemesh DistributedDataParallel: the tied parameter wte.weight and head.weight" in out.stdout, \
        out.stdout + out.stderr[-2000:]


def test_the_checks_parallel_run_says_what_to_write_for_torchs_fsdp_over_the_world_on_tp(world) -> None:  # type: ignore[no-untyped-def]
    """torch's ``fully_shard`` with no mesh (a 1-D mesh over the world) on a model that TP shards raises torch's own
    ``TypeError: Invariant encountered: value was None`` from inside FSDP2. ``vemesh check`` reported those words
    alone (a user of Hugging Face's Qwen2 with torch's FSDP2 example's habit got nothing else); now it says what to
    write instead, as ``vemesh plan`` does (test_plan_user_model.py). FSDP2 over ``mesh["TP"]`` raises torch's
    "Cannot concatenate overlapping meshes": said the same way. FSDP2's pinned CPU offload runs (nothing to pin on
    this CPU; before, torch's "Cannot access accelerator device")."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from vemesh.check.run import UserError, call

    world(4)

    def parallelize(model, mesh):  # type: ignore[no-untyped-def]
        torch_parallelize_module(model.mid, mesh["TP"], ColwiseParallel())
        return torch_fully_shard(model)

    with pytest.raises(UserError, match=r"TypeError: Invariant encountered: value was None when it should not be; "
                                        r"FSDP2's fully_shard was given a mesh without dim names for a parameter "
                                        r"that TP already shards .* vemesh.parallel.fully_shard\(module\)"):
        call("--parallelize", "mine:parallelize", parallelize, Tied(), mesh)

    def over_tp(model, mesh):  # type: ignore[no-untyped-def]  # FSDP2 "over TP": torch's overlapping meshes
        torch_parallelize_module(model.mid, mesh["TP"], ColwiseParallel())
        return torch_fully_shard(model, mesh=mesh["TP"])

    with pytest.raises(UserError, match=r"RuntimeError: Cannot concatenate overlapping meshes: .*; FSDP2's "
                                        r"fully_shard was given a mesh that holds a dim TP already shards this "
                                        r"parameter over \(mesh\['TP'\]\)"):
        call("--parallelize", "mine:parallelize", over_tp, Tied(), mesh)

    def offloaded(model, mesh):  # type: ignore[no-untyped-def]  # FSDP2's CPU offload, pinned: nothing to pin here
        from torch.distributed.fsdp import CPUOffloadPolicy
        return torch_fully_shard(model, mesh=mesh["DP"], offload_policy=CPUOffloadPolicy())

    # the check's functions run on this CPU (OnThisCPU), where pinning is nothing: torch's "Cannot access accelerator
    # device when none is available" before
    assert call("--parallelize", "mine:parallelize", offloaded, Tied(), mesh) is not None


def test_the_checks_parallel_run_gives_vemeshs_own_errors_whole_and_cuts_others_visibly(world) -> None:  # type: ignore[no-untyped-def]
    """A broken tie's error ends with what to write instead; ``vemesh check`` cut every error at 400 characters, in
    the middle of that advice ("Parallelize with vemesh.parallel.paralleli", on Hugging Face's Qwen2 with tied
    embeddings). vemesh's own errors are given whole; another over 400 characters (torch's can print a tensor) is cut
    with '...' where it was cut."""
    from vemesh.check.run import UserError, call

    world(4)

    def untie(model, mesh):  # type: ignore[no-untyped-def]
        torch_parallelize_module(model, mesh["TP"], ENDS)
        return DistributedDataParallel(model)

    with pytest.raises(UserError, match=r"BrokenTieError: .* or re-tie by hand after parallelizing "
                                        r"\(lm_head.weight = wte.weight\)$"):
        call("--parallelize", "mine:untie", untie, Tied(), mesh)

    def long(model, mesh):  # type: ignore[no-untyped-def]
        raise RuntimeError("x" * 1000)

    with pytest.raises(UserError, match=r"RuntimeError: x{400}\.\.\.$"):
        call("--parallelize", "mine:long", long, Tied(), mesh)

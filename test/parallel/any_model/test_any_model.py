"""Every parallelism on a model that is not the example's GPT, through vemesh's library APIs only.

A small Llama-style model (``test/models/llama.py``: RMSNorm, RoPE from cos/sin buffers, SwiGLU, grouped-query
SDPA) and its MoE variant with grouped experts, trained 3 steps on real gloo ranks: ``context_parallel`` with
CP=2 and DP=2 x CP=2, ``ExpertParallel`` with EP=2 folded over DP=4, CP=2 and EP=2 together, expert TP
(``ExpertTensorParallel`` on EP=2 x TP=2, attention over TP), gradients reduced
by vemesh's DDP at its defaults (over ``dp_cp``, experts over EDP by themselves), ZeRO-1, and FSDP2
(``vemesh.parallel.fully_shard``). Every step's loss and every final parameter is within 1e-5 of one process.
What ``context_parallel`` cannot compute exactly is refused (fake backend, every rank).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import scenarios as S
from launch import run_ranks

from vemesh import VESCALE_DEVICE_MESH as mesh  # noqa: E402
from vemesh.parallel import ParallelDims, context_parallel  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_ranks(S.worker, 4, S.CASES_4, timeout=400, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_ranks(S.worker, 2, S.CASES_2, timeout=200, env={"OMP_NUM_THREADS": "1"})


def _exact(world: list[dict], name: str) -> None:
    for rank, results in enumerate(world):
        o = results[name]
        assert "error" not in o, f"rank {rank}:\n{o.get('error')}"
        assert o["loss_diff"] < TOL and o["param_diff"] < TOL, (rank, o)


@pytest.mark.parametrize("name", list(S.CASES_4))
@pytest.mark.slow
def test_four_ranks_match_one_process(four, name) -> None:
    _exact(four, name)


@pytest.mark.parametrize("name", list(S.CASES_2))
def test_two_ranks_match_one_process(two, name) -> None:
    _exact(two, name)


def test_a_replica_over_tp_whose_gradient_is_each_ranks_own_part_is_refused_at_the_first_backward(two) -> None:
    """q/k norms over each TP rank's own heads, left plain: torch leaves them replicas, and each TP rank's gradient
    is its own heads' part. vemesh DDP's first averaged backward names them (the same run, styled, matches)."""
    for rank, results in enumerate(two):
        error = results["tp2-norms-over-local-heads"].get("unstyled", "")
        assert "the gradient of 1.q_norm.weight, 1.k_norm.weight differs across the TP ranks [0, 1]" in error, (rank, error)
        assert "SequenceParallel(sequence_dim=...)" in error and "check_tp_gradients=False" in error
        # the wrapped model's forward got the same inputs on each TP rank: the same batch, so the input is the cause
        assert "Likeliest: the module's input is this rank's part only" in error, error
        assert "(The TP ranks saw the same batch: its forward got the same inputs on each TP rank.)" in error, error


def test_a_tp_collective_that_a_checkpoints_recompute_leaves_unread_is_warned_of_at_the_first_backward(two) -> None:
    """Side-by-side branches under TP and torch's checkpoint (stopped early, its default): each step leaves one
    all-reduce a block unwaited in torch's work registry (2 blocks, 3 steps: 6 held), and vemesh DDP's first averaged
    backward warns once, with the fix; recomputed whole, nothing is held and nothing is said."""
    for rank, results in enumerate(two):
        case = results["tp2-side-by-side-checkpointed"]
        assert "error" not in case, case.get("error")
        assert case["whole"] == {"said": [], "held": 0}, (rank, case)
        (said,) = case["stopped early"]["said"]
        assert case["stopped early"]["held"] == 6, (rank, case)
        assert said.startswith("vemesh: MEMORY LEAK: 2 collectives issued in this step were never waited on"), said
        assert "early_stop=False" in said, said


@pytest.mark.slow
def test_under_fsdp2_the_first_optimizer_step_warns_of_the_same_leak(four) -> None:
    """The same side-by-side blocks under vemesh's FSDP2 (DP = 2 x TP = 2): the first optimizer step warns once."""
    for rank, results in enumerate(four):
        case = results["dp2-tp2-side-by-side-checkpointed-fsdp2"]
        assert "error" not in case, case.get("error")
        assert case["whole"] == {"said": [], "held": 0}, (rank, case)
        (said,) = case["stopped early"]["said"]
        assert case["stopped early"]["held"] == 6 and "MEMORY LEAK: 2 collectives" in said, (rank, case)


@pytest.mark.slow
def test_under_fsdp2_the_first_optimizer_step_refuses_the_same_replicas(four) -> None:
    """The same norms under vemesh's FSDP2 (DP = 2 x TP = 2): refused at the first optimizer step, naming them."""
    for rank, results in enumerate(four):
        error = results["dp2-tp2-norms-over-local-heads-fsdp2"].get("unstyled", "")
        tp = [0, 1] if rank < 2 else [2, 3]
        assert f"the gradient of 1.q_norm.weight, 1.k_norm.weight differs across the TP ranks {tp}" in error, (rank, error)
        assert "fully_shard(..., check_tp_gradients=False)" in error


def test_the_buffer_broadcast_trap_would_be_seen() -> None:
    """The control: had DDP broadcast CP rank 0's RoPE shard over the others (torch's broadcast_buffers), the
    same comparison fails; so the exact result above is DDP leaving context_parallel's shards alone."""
    results = run_ranks(S.broadcast_trap, 4, timeout=200, env={"OMP_NUM_THREADS": "1"})
    assert all(r["loss_diff"] > 1e-4 for r in results), [r["loss_diff"] for r in results]


def test_backward_outside_the_context_under_activation_checkpointing_is_refused() -> None:
    results = run_ranks(S.checkpointed_backward_outside, 2, timeout=200, env={"OMP_NUM_THREADS": "1"})
    for r in results:
        assert "still to go backward: the recompute would run SDPA outside the ring" in r["refused"], r
        assert r["inside"]


@pytest.fixture
def cp_rank():
    """``cp_rank(rank)``: this process is that rank of a fake world of 2, with ``mesh["CP"]`` built."""

    def become(rank: int) -> None:
        mesh.reset()
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=2, store=FakeStore())
        ParallelDims(2, cp=2).build("cpu", mesh)

    yield become
    mesh.reset()
    if dist.is_initialized():
        dist.destroy_process_group()


def _sdpa(k=None, **kwargs):
    q = torch.randn(1, 2, 8, 4)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, q if k is None else k, q, **kwargs)


@pytest.mark.parametrize("call, message", [
    (_sdpa(attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=False), "an attn_mask is refused"),
    (_sdpa(is_causal=True, dropout_p=0.1), "dropout_p=0.1 is refused"),
    (_sdpa(is_causal=True, k=torch.randn(1, 2, 16, 4)), "keys of 16 positions for queries of 8"),
    (lambda: torch.nn.functional.scaled_dot_product_attention(*[torch.randn(1, 2, 16, 4)] * 3, is_causal=True),
     "the queries hold 16 positions, but this CP rank's share of the buffers' 16 is 8"),
    # attention by the model's own matmuls and softmax (Hugging Face's eager attention), which the ring never sees
    (lambda: torch.nn.functional.softmax(torch.randn(1, 2, 8, 8), dim=-1, dtype=torch.float32),
     "a softmax over a 8 x 8 score matrix inside context_parallel"),
    (lambda: torch.randn(1, 2, 8, 8).softmax(-1), "sees only this CP rank's 8 of the 16 positions"),
    (lambda: torch.softmax(torch.randn(1, 2, 8, 8), 3), 'attn_implementation="sdpa"'),
])
def test_what_the_ring_cannot_compute_is_refused_on_every_rank(cp_rank, call, message) -> None:
    for rank in range(2):
        cp_rank(rank)
        x = torch.zeros(1, 16)
        with context_parallel(mesh["CP"], buffers=[x], buffer_seq_dims=[1]):
            assert x.shape == (1, 8)  # this rank's share
            with pytest.raises(ValueError) as e:
                call()
        assert message in str(e.value) and "\n" not in str(e.value)
        assert x.shape == (1, 16)  # restored


def test_a_softmax_that_is_not_over_this_ranks_positions_squared_runs(cp_rank) -> None:
    """Only a square score matrix of this rank's positions per sequence and head is taken for attention: a softmax
    over the vocabulary of each position, over a square of another size, or a MoE router's over as many experts as
    the rank has positions, runs inside the context."""
    cp_rank(1)
    x = torch.zeros(1, 16)
    with context_parallel(mesh["CP"], buffers=[x], buffer_seq_dims=[1]):
        assert torch.softmax(torch.randn(1, 8, 100), -1).shape == (1, 8, 100)
        assert torch.randn(2, 2, 4, 4).softmax(-1).shape == (2, 2, 4, 4)
        assert torch.randn(1, 8, 8).softmax(-1).shape == (1, 8, 8)  # (batch, positions, 8 experts)
        assert torch.randn(8, 8).softmax(-1).shape == (8, 8)  # (tokens, 8 experts)


def _hf_llama(hf, attention: str) -> tuple:
    """A one-layer HF Llama (seeded), 2 sequences of 16 tokens and their positions."""
    torch.manual_seed(0)
    model = hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=8, attn_implementation=attention))
    return model, torch.randint(0, 128, (2, 16)), torch.arange(16).expand(2, 16).contiguous()


def test_hugging_faces_eager_attention_is_refused_under_context_parallel(cp_rank) -> None:
    """``LlamaForCausalLM`` with ``attn_implementation="eager"`` computes attention with its own matmuls and softmax,
    over the positions a CP rank holds: each rank would attend to its own share of the sequence only, and train (on 2
    gloo ranks its second rank's logits were 0.20 off one process's). Refused on every rank; under SDPA it runs."""
    hf = pytest.importorskip("transformers")
    for rank in range(2):
        cp_rank(rank)
        model, x, p = _hf_llama(hf, "eager")
        with context_parallel(mesh["CP"], buffers=[x, p], buffer_seq_dims=[1, 1]):
            with pytest.raises(ValueError, match='attention computed by the model itself.*attn_implementation="sdpa"'):
                model(input_ids=x, position_ids=p)


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_a_sliding_window_shorter_than_the_sequence_is_refused_under_context_parallel(cp_rank, kind) -> None:
    """Mistral's and Qwen2's sliding window (HF, SDPA): where a CP rank's share fits in the window, HF leaves the
    window's mask out and calls SDPA causal, and the ring attends over the whole sequence: on 2 gloo ranks, a window
    of 12 over 16 positions put the second rank's logits 0.06 (Mistral) and 0.04 (Qwen2) off one process's. Refused
    on every rank; a window the sequence fits in (16) changes nothing, and runs."""
    hf = pytest.importorskip("transformers")
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, attn_implementation="sdpa")
    for window, refused in ((12, True), (16, False)):
        for rank in range(2):
            cp_rank(rank)
            torch.manual_seed(0)
            model = (hf.MistralForCausalLM(hf.MistralConfig(sliding_window=window, **common)) if kind == "mistral" else
                     hf.Qwen2ForCausalLM(hf.Qwen2Config(use_sliding_window=True, sliding_window=window,
                                                        max_window_layers=0, **common)))
            x, p = torch.randint(0, 128, (2, 16)), torch.arange(16).expand(2, 16).contiguous()
            with context_parallel(mesh["CP"], buffers=[x, p], buffer_seq_dims=[1, 1]):
                if refused:
                    with pytest.raises(ValueError, match="a sliding window of 12 positions .* the sequence holds 16"):
                        model(input_ids=x, position_ids=p)
                else:
                    assert model(input_ids=x, position_ids=p).logits.shape == (2, 8, 128)


def test_a_shift_of_a_cut_buffer_inside_the_context_is_refused_and_other_indexing_runs(cp_rank) -> None:
    """A buffer the context holds cut, shifted by a position along its sequence dim (``y[:, 1:]``, ``F.pad``, HF's
    ``labels=`` which pads and shifts inside the model's loss), pairs tokens of other parts of the sequence: on 2
    gloo ranks, HF Llama's ``labels=`` loss was 4.8344 for one process's 4.8259. Refused; indexing that keeps the
    whole share, another dim, or a token by number runs."""
    hf = pytest.importorskip("transformers")
    for rank in range(2):
        cp_rank(rank)
        y, positions = torch.zeros(2, 16, dtype=torch.long), torch.arange(16.0).expand(2, 16).clone()
        with context_parallel(mesh["CP"], buffers=[y, positions], buffer_seq_dims=[1, -1]):
            for shift in (lambda: y[:, 1:], lambda: y[..., :-1], lambda: positions[:, 2:6],
                          lambda: torch.nn.functional.pad(y, (0, 1), value=-100)):
                with pytest.raises(ValueError, match="of a buffer context_parallel holds cut, along its sequence dim 1"):
                    shift()
            assert y[:, :].shape == y[:, :8].shape == y[..., 0:8].shape == (2, 8)
            assert y[1].shape == (8,) and y[:1].shape == (1, 8) and positions[:, None, :].shape == (2, 1, 8)
            assert torch.nn.functional.pad(y, (0, 0, 1, 0)).shape == (3, 8)  # the batch dim
        model, x, p = _hf_llama(hf, "sdpa")
        with context_parallel(mesh["CP"], buffers=[x, p], buffer_seq_dims=[1, 1]):
            with pytest.raises(ValueError, match=r"F.pad\(..., \(0, 1\)\) of a buffer .* not with labels="):
                model(input_ids=x, position_ids=p, labels=x)


def test_torchs_multihead_attention_returning_its_weights_is_refused_and_without_them_runs(cp_rank) -> None:
    """``nn.MultiheadAttention`` with ``need_weights=True`` (its default) computes its softmax itself to return the
    weights, over a rank's share only (on 2 gloo ranks the second rank's output was 0.75 off one process's); refused.
    With ``need_weights=False`` and ``is_causal=True`` it calls SDPA, which the ring computes."""
    for rank in range(2):
        cp_rank(rank)
        mha, x = torch.nn.MultiheadAttention(16, 4, batch_first=True), torch.randn(2, 16, 16)
        with context_parallel(mesh["CP"], buffers=[x], buffer_seq_dims=[1]):
            causal = torch.nn.Transformer.generate_square_subsequent_mask(8)
            with pytest.raises(ValueError, match="nn.MultiheadAttention with need_weights=True .* need_weights=False"):
                mha(x, x, x, attn_mask=causal, is_causal=True)
            assert mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0].shape == (2, 8, 16)


def test_a_decoder_stage_inside_context_parallel_takes_its_shares_positions(cp_rank) -> None:
    """``current_positions`` is the global positions of a CP rank's share inside the context (None outside);
    ``DecoderStage`` numbers its tokens by it, with a mask of no padding so that HF does not take a load-balanced
    share's jump (0-3, 12-15) for two packed sequences and mask them apart (which the ring refuses). On 2 gloo ranks
    two stages of an HF Llama chained inside the context gave one process's logits (6e-8)."""
    hf = pytest.importorskip("transformers")
    from vemesh.parallel import DecoderStage
    from vemesh.parallel.context import current_positions

    for rank, want in ((0, [0, 1, 2, 3, 12, 13, 14, 15]), (1, [4, 5, 6, 7, 8, 9, 10, 11])):
        cp_rank(rank)
        model, x, _ = _hf_llama(hf, "sdpa")
        stage, seen = DecoderStage(model, 0, 1), []
        stage.model.rotary_emb.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["position_ids"]),
                                                         with_kwargs=True)
        assert current_positions(16) is None
        with context_parallel(mesh["CP"], buffers=[x], buffer_seq_dims=[1]):
            assert current_positions(8).tolist() == want
            with pytest.raises(ValueError, match="16 positions are not this CP rank's share of the buffers' sequence"):
                current_positions(16)
            assert stage(x).shape == (2, 8, 128)
        assert seen[-1].tolist() == [want]


def test_a_cp_dim_of_one_rank_runs_the_block_as_it_is() -> None:
    """A job's CP dim of size 1 (a mesh whose dims are named for a larger run): nothing is cut, even a length 2 x CP
    would not split, and the model's SDPA is its own. It recursed: the ring's one-rank path called F's SDPA, which
    the context had swapped for the ring."""
    mesh.reset()
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        ParallelDims(1, mesh_dims=("DP", "CP")).build("cpu", mesh)
        q, x = torch.randn(1, 2, 7, 4), torch.arange(7).view(1, 7)
        want = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        with context_parallel(mesh["CP"], buffers=[x], buffer_seq_dims=[1]):
            got = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=None, is_causal=True)
            assert x.tolist() == [list(range(7))]
        assert torch.equal(got, want)
    finally:
        mesh.reset()
        dist.destroy_process_group()


def test_buffers_are_cut_the_same_way_and_put_back(cp_rank) -> None:
    for rank in range(2):
        cp_rank(rank)
        tokens, table = torch.arange(16).view(1, 16), torch.arange(32).view(16, 2)
        keep = torch.arange(16).view(1, 16)
        with context_parallel(mesh["CP"], buffers=[tokens, table, keep], buffer_seq_dims=[1, 0, 1],
                              no_restore_buffers={keep}):
            mine = [0, 1, 2, 3, 12, 13, 14, 15] if rank == 0 else [4, 5, 6, 7, 8, 9, 10, 11]  # head-tail
            assert tokens.tolist() == [mine] and table[:, 0].tolist() == [2 * p for p in mine]
        assert tokens.tolist() == [list(range(16))] and table.shape == (16, 2)
        assert keep.tolist() == [mine]  # left as its shard


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(buffers=[torch.zeros(1, 16), torch.zeros(32, 2)], buffer_seq_dims=[1, 0]), ValueError,
     "the buffers' sequence lengths differ ([16, 32]"),
    (dict(buffers=[torch.zeros(1, 10)], buffer_seq_dims=[1]), ValueError,
     "a sequence of 10 positions does not split into 4 equal chunks (CP 2, head-tail load balancing: 2 per rank); "
     "choose a sequence length that is a multiple of 4, or CP from 1, 5"),
    (dict(buffers=[torch.zeros(1, 16)], buffer_seq_dims=[]), ValueError, "one sequence dim per buffer: 1 buffers, 0"),
    (dict(buffers=[torch.nn.Parameter(torch.zeros(16))], buffer_seq_dims=[0]), ValueError, "buffers[0] is a Parameter"),
    (dict(no_restore_buffers={torch.zeros(2)}), ValueError, "no_restore_buffers must be a subset of buffers"),
    (dict(rotate="ring"), ValueError, "unknown rotate method 'ring'"),
])
def test_bad_arguments_are_refused_before_anything_changes(cp_rank, kwargs, error, message) -> None:
    cp_rank(1)
    with pytest.raises(error) as e:
        with context_parallel(mesh["CP"], **kwargs):
            pass
    assert message in str(e.value)
    with pytest.raises(TypeError, match="cp_mesh must be a 1-D DeviceMesh"):
        with context_parallel("CP"):
            pass

"""Fast, in-process checks of the GPT example's pipeline pieces: stage cuts, names, config errors."""

from __future__ import annotations

import pytest
import torch
from config import ConfigError
from vemesh.models.gpt import GPT, GPTConfig
from vemesh.models.gpt import cut_stage, split_layers, stage_indices, stages_per_rank
from test_gpt_parts import config


@pytest.mark.parametrize(("n_layer", "n_stages", "expected"), [
    (4, 2, [[0, 1], [2, 3]]), (5, 2, [[0, 1, 2], [3, 4]]), (4, 4, [[0], [1], [2], [3]]), (3, 1, [[0, 1, 2]]),
])
def test_split_layers(n_layer, n_stages, expected):
    assert split_layers(n_layer, n_stages) == expected


def test_too_many_stages():
    with pytest.raises(ValueError, match="4 pipeline stages cannot split 2 layers"):
        split_layers(2, 4)


def test_stages_go_round_robin():
    assert stages_per_rank("interleaved-1f1b") == 2 and stages_per_rank("1f1b") == 1 and stages_per_rank("zbv") == 2
    assert [stage_indices(r, 2, "interleaved-1f1b") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_indices(r, 2, "interleaved-zb") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_indices(r, 4, "1f1b") for r in range(4)] == [[0], [1], [2], [3]]


def test_v_shaped_schedules_fold_the_pipeline_back():
    for schedule in ("zbv", "dualpipev"):
        assert [stage_indices(r, 2, schedule) for r in range(2)] == [[0, 3], [1, 2]]
        assert [stage_indices(r, 4, schedule) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_stages_keep_the_full_models_names_and_compute_the_same():
    """Every parameter lands on exactly one stage under its full-model name; chained stages = the model."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=16)).eval()
    full = dict(model.named_parameters())
    parts = [cut_stage(model, s, 4) for s in range(4)]
    names = [n for p in parts for n, _ in p.named_parameters()]
    assert sorted(names) == sorted(full) and len(names) == len(set(names))
    assert parts[0].wte is not None and parts[0].lm_head is None and parts[3].wte is None and parts[3].lm_head is not None
    assert list(parts[2].h.keys()) == ["2"]
    idx = torch.randint(0, 256, (2, 8))
    x = idx
    for p in parts:
        x = p(x)
    torch.testing.assert_close(x, model(idx))



def test_a_stage_copies_only_what_it_keeps():
    """The blocks and ends a stage drops are never copied (a copy of the whole model, then cut, held each block twice):
    a block that cannot be copied does not stop the stages that leave it out, and the model itself keeps all."""
    class Uncopyable(torch.nn.Module):
        def __deepcopy__(self, memo):
            raise AssertionError("copied")

    model = GPT(GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=16))
    model.h["3"] = Uncopyable()
    first = cut_stage(model, 0, 2)
    assert list(first.h.keys()) == ["0", "1"] and first.lm_head is None and first.ln_f is None
    assert list(model.h.keys()) == ["0", "1", "2", "3"] and model.lm_head is not None
    with pytest.raises(AssertionError, match="copied"):
        cut_stage(model, 1, 2)

def test_three_numbers_make_a_3d_mesh():
    cfg = config(["--mesh-shape", "2,2,2", "--n-layer", "4"], 8)
    assert cfg.mesh_shape == (2, 2, 2) and cfg.mesh_dim_names == ("PP", "DP", "TP")
    assert (cfg.pp_size, cfg.dp_size, cfg.tp_size, cfg.microbatches) == (2, 2, 2, 4)  # default 2 x PP
    assert config(["--mesh-shape", "2,-1,1", "--n-layer", "4"], 8).dp_size == 4
    assert config(["--mesh-shape", "1,1,1"]).microbatches is None  # no pipeline: no micro-batches
    two_d = config(["--mesh-shape", "2,2"], 4)
    assert two_d.pp_size == 1 and two_d.mesh_dim_names == ("DP", "TP")


@pytest.mark.parametrize(
    ("world", "argv", "message"),
    [
        (4, ["--mesh-shape", "4,1,1", "--n-layer", "2"], "4 pipeline stages (PP=4) cannot split --n-layer 2; use at most 2 stages"),
        (4, ["--mesh-shape", "2,1,2", "--n-layer", "3", "--pp-schedule", "interleaved-1f1b"],
         "4 pipeline stages (2 per PP rank with interleaved-1f1b, PP=2) cannot split --n-layer 3"),
        (4, ["--mesh-shape", "2,2,1", "--n-layer", "4", "--microbatches", "3"],
         "--microbatches 3 does not divide the 16 sequences per DP rank (--global-batch-size 32 / DP 2)"),
        (4, ["--mesh-shape", "4,1,1", "--n-layer", "4", "--microbatches", "2"], "--microbatches 2: the 1f1b schedule needs at least one per stage (4)"),
        (4, ["--mesh-shape", "2,2", "--microbatches", "4"], "--microbatches and --pp-schedule need a PP dim"),
        (4, ["--mesh-shape", "2,2,2"], "PP 2 x DP 2 x TP 2 = 8 but the number of processes is 4"),
        (4, ["--mesh-shape", "2,1,2", "--pp-schedule", "zb"], "--pp-schedule: Input should be 'gpipe', '1f1b', 'interleaved-1f1b', 'interleaved-zb', 'zbv' or 'dualpipev'"),
    ],
)
def test_bad_pipeline_config_is_one_line(world, argv, message):
    with pytest.raises(ConfigError) as err:
        config(argv, world)
    assert message in str(err.value) and "\n" not in str(err.value)

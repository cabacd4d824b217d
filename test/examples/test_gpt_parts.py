"""Fast, in-process checks of the GPT example's pieces: config errors, data slicing, the model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vemesh.parallel import ParallelDims
from conftest import EXAMPLE, REPO, run_train
from config import ConfigError, TrainConfig
from data import ByteDataset, decode, encode, stdlib_corpus
from vemesh.models.gpt import GPT, GPTConfig


def config(argv: list[str], world_size: int = 1) -> TrainConfig:
    """Parse ``argv`` as rank of a torchrun world of ``world_size`` processes would."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", str(world_size))
        return TrainConfig.from_args(argv + ["--device", "cpu"])


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("world", "flag", "shape"),
    [(1, None, (1, 1)), (4, None, (2, 2)), (3, None, (3, 1)), (4, "4,1", (4, 1)), (4, "1,4", (1, 4)),
     (4, "-1,2", (2, 2)), (8, "2,-1", (2, 4))],
)
def test_mesh_shape_resolves(world, flag, shape):
    argv = ["--global-batch-size", "24"] + ([] if flag is None else [f"--mesh-shape={flag}"])
    cfg = config(argv, world)
    assert cfg.mesh_shape == (shape if flag is None or "-1" not in flag else tuple(int(s) for s in flag.split(",")))
    assert (cfg.dp_size, cfg.tp_size) == shape  # checked here; the mesh resolves the -1 itself at init


def test_negative_mesh_size_needs_no_equals_sign():
    cfg = config(["--mesh-shape", "-1,2"], 4)
    assert cfg.mesh_shape == (-1, 2) and (cfg.dp_size, cfg.tp_size) == (2, 2)


@pytest.mark.parametrize(
    ("world", "argv", "message"),
    [
        (4, ["--mesh-shape", "1,4", "--n-head", "6", "--n-embd", "192"], "TP size 4 does not divide --n-head 6 (choose TP from 1, 2, 3, 6)"),
        (4, ["--mesh-shape", "4,1", "--global-batch-size", "6"], "--global-batch-size 6 is not divisible by the DP size 4"),
        (1, ["--mesh-shape", "2,2"], "DP 2 x TP 2 = 4 but the number of processes is 1; the product must equal it (or set one size to -1 to fill it in); launch with torchrun"),
        (4, ["--mesh-shape", "-1,3"], "--mesh-shape: cannot fill in DP: TP 3 = 3 does not divide the number of processes 4"),
        (4, ["--mesh-shape", "-1,-1"], "--mesh-shape: only one size can be -1 (filled in); got 2 for DP, TP in DP -1 x TP -1"),
        (4, ["--mesh-shape", "2x2"], "--mesh-shape: expected DP,TP like 2,2 or -1,2, PP,DP,TP like 2,2,1, or one size per --mesh-dims name; got '2x2'"),
        (1, ["--n-head", "5"], "--n-embd 192 is not divisible by --n-head 5 (each head takes n_embd / n_head channels): "
                               "choose --n-head from 1, 2, 3, 4, 6, 8, 12"),
        (1, ["--steps", "ten"], "--steps: Input should be a valid integer"),
        (1, ["--dtype", "fp16"], "--dtype: Input should be 'fp32' or 'bf16'"),
        (1, ["--data", "/no/such/file.txt"], "--data: no such file"),
        (1, ["--bogus", "1"], "unrecognized arguments: --bogus 1 (see --help)"),
        (2, ["--mesh-shape", "1,2", "--sequence-parallel", "--seq-len", "33"], "--seq-len 33 must be divisible by the TP size 2"),
        (4, ["--mesh-shape", "2,2", "--mesh-dims", "TP,TP"], "--mesh-dims: TP appears more than once in TP,TP"),
    ],
)
def test_bad_config_names_the_flag(world, argv, message):
    with pytest.raises(ConfigError) as err:
        config(argv, world)
    assert message in str(err.value)


@pytest.mark.parametrize(("world", "argv", "expected"), [
    (4, [], dict(pp=1, dp_shard=2, tp=2, mesh_dims=("DP", "TP"))),
    (8, ["--mesh-shape", "2,-1,2"], dict(pp=2, dp_shard=2, tp=2, mesh_dims=("PP", "DP", "TP"))),
    (8, ["--mesh-shape", "2,2,2", "--mesh-dims", "DP,CP,TP", "--no-cp-load-balance"],
     dict(dp_shard=2, cp=2, tp=2, mesh_dims=("DP", "CP", "TP"))),
    (8, ["--mesh-shape", "4,2", "--fsdp", "--dp-replicate", "2"], dict(dp_replicate=2, dp_shard=2, tp=2, mesh_dims=("DP", "TP"))),
    (8, ["--mesh-shape", "4,2", "--moe-experts", "4", "--ep", "2"], dict(dp_shard=4, tp=2, ep=2, mesh_dims=("DP", "TP"))),
])
def test_the_config_asks_parallel_dims_for_every_degree(world, argv, expected):
    """The example derives no degree itself: ``cfg.dims`` is the library's ``ParallelDims`` (what ``job.setup`` builds
    the mesh from), and every size the config reports is read from it."""
    cfg = config(argv, world)
    assert cfg.dims == ParallelDims(world, **expected)
    d = cfg.dims
    assert (cfg.pp_size, cfg.dp_size, cfg.cp_size, cfg.tp_size, cfg.mesh_dim_names) == (d.pp, d.dp, d.cp, d.tp, d.mesh_dims)


def test_several_problems_are_all_reported():
    with pytest.raises(ConfigError) as err:
        config(["--steps", "0", "--lr", "-1"])
    assert "--steps:" in str(err.value) and "--lr:" in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda():
    with pytest.raises(ConfigError, match="--device cuda: this torch build sees no CUDA device"):
        TrainConfig.from_args(["--device", "cuda"])


def test_more_ranks_on_a_host_than_its_gpus_is_said_before_any_rank_takes_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for device in ("cuda", "auto"):
        with pytest.raises(ConfigError, match=r"--device cuda: 2 processes on this host \(torchrun's --nproc_per_node\) "
                                              r"but torch sees 1 CUDA device; each rank needs its own: launch at most "
                                              r"1 per host, or use --device cpu"):
            TrainConfig.from_args(["--device", device])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert TrainConfig.from_args(["--device", "auto"]).device == "cuda"


@pytest.mark.parametrize("world, argv", [(1, []), (2, ["--mesh-shape", "2,1,1"]), (4, ["--mesh-shape", "1,4"])])
def test_fsdp_without_ranks_to_shard_over_is_said_at_start(world, argv):
    with pytest.raises(ConfigError, match=r"--fsdp shards over DP x CP, which is 1 on the mesh .*TP=\d: give DP or CP "
                                          r"more than one rank \(torchrun --nproc_per_node and --mesh-shape\), or "
                                          r"leave --fsdp out"):
        config(argv + ["--fsdp"], world_size=world)
    assert config(["--mesh-shape", "2,1", "--fsdp"], world_size=2).fsdp


def test_boolean_flags_come_in_pairs():
    assert config([]).distributed_optimizer is True
    assert config(["--no-distributed-optimizer"]).distributed_optimizer is False
    assert config(["--sequence-parallel"]).sequence_parallel is True


# -------------------------------------------------------------------- data
def test_default_corpus_is_deterministic_and_capped():
    a, b = stdlib_corpus(50_000), stdlib_corpus(50_000)
    assert a == b and len(a) == 50_000


def test_dp_slices_tile_the_global_batch():
    """DP rank r of 4 gets rows [2r, 2r + 2) of the same global batch the single process sees."""
    ds = ByteDataset(None, max_bytes=100_000, val_fraction=0.1)
    kw = dict(step=3, seed=7, global_batch_size=8, seq_len=16)
    x, y = ds.get_batch("train", dp_rank=0, dp_size=1, **kw)
    parts = [ds.get_batch("train", dp_rank=r, dp_size=4, **kw) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one byte
    other_step = ds.get_batch("train", dp_rank=0, dp_size=1, **dict(kw, step=4))[0]
    assert not torch.equal(other_step, x)


def test_split_and_encoding(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld " * 100, encoding="utf-8")
    ds = ByteDataset(str(path), max_bytes=10_000, val_fraction=0.25)
    assert len(ds) == len("héllo wörld ".encode()) * 100
    assert len(ds.val) == len(ds) // 4
    assert decode(encode("héllo")) == "héllo"
    with pytest.raises(ConfigError, match="needs more than --seq-len"):
        ds.check(seq_len=1000)


# ------------------------------------------------------------------- model
def test_generate_pads_without_changing_logits():
    """Right-padding is invisible to causal attention, so generate() can use a fixed length."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    idx = torch.randint(0, 256, (2, 5))
    padded = torch.nn.functional.pad(idx, (0, 11))
    torch.testing.assert_close(model(padded)[:, :5], model(idx))
    out = model.generate(idx, 20, generator=torch.Generator().manual_seed(0))
    again = model.generate(idx, 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 25) and torch.equal(out, again) and torch.equal(out[:, :5], idx)


def test_the_model_refuses_a_head_count_and_a_sequence_it_cannot_take():
    """ValueErrors naming the value and the choices, not bare asserts (which ``python -O`` strips)."""
    with pytest.raises(ValueError, match="n_head 3 does not divide n_embd 16: .* choose n_head from 1, 2, 4, 8, 16$"):
        GPT(GPTConfig(block_size=16, n_layer=1, n_head=3, n_embd=16))
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match="a sequence of 9 tokens is longer than block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_model_file_does_not_import_vemesh():
    """The GPT preset's model file (what the example trains) imports torch only: parallelism comes from outside."""
    import ast

    tree = ast.parse((REPO / "vemesh" / "models" / "gpt" / "model.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith("vemesh") for m in imported), imported
    assert not (REPO / "examples" / "gpt" / "model.py").exists()  # one copy of the GPT


# ---------------------------------------------- one real process, bad config
def test_bad_config_exits_cleanly(tmp_path):
    run = run_train(["--n-head", "5"], tmp_path)
    assert run.returncode == 2, run.describe()
    assert run.stderr.strip() == ("error: --n-embd 192 is not divisible by --n-head 5 (each head takes n_embd / n_head "
                                  "channels): choose --n-head from 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 192, "
                                  "or another --n-embd"), run.describe()
    assert "Traceback" not in run.stdout + run.stderr


def test_config_docstring_quotes_the_real_error():
    """config.py's docstring shows a command and its error: the code must still print exactly that."""
    import config as config_module

    lines = [line.strip() for line in config_module.__doc__.splitlines() if line.strip().startswith(("$", "error:"))]
    command, expected = lines[0], lines[1]
    world = int(command.split("--nproc_per_node=")[1].split()[0])
    argv = command.split("train.py", 1)[1].split()
    with pytest.raises(ConfigError) as err:
        config(argv, world)
    assert f"error: {err.value}" == expected


# ------------------------------------------------------------------ SIGTERM
_STOP_SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, {example!r})
from stopping import StopRequest
stop = StopRequest(0.5, enabled=True)
os.kill(os.getpid(), signal.SIGTERM)
assert stop.received.is_set() and stop.wait(0)
if sys.argv[1] == "agreed":
    stop.agreed()  # the ranks agreed to stop and save: the grace timer no longer applies
time.sleep(2)
print("still here")
"""


@pytest.mark.parametrize("how", ["not-at-a-boundary", "agreed"])
def test_sigterm_waits_for_a_step_boundary_only_within_the_grace_period(how):
    """SIGTERM becomes a request; a rank that does not reach a step boundary in time exits anyway."""
    script = _STOP_SCRIPT.format(example=str(EXAMPLE))
    run = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=60)
    if how == "agreed":
        assert run.returncode == 0 and "still here" in run.stdout, run.stderr
    else:
        assert run.returncode == 128 + 15 and "still here" not in run.stdout, (run.returncode, run.stderr)
        assert "SIGTERM, and no step boundary within 0.5 s (--stop-grace-s): exiting without saving" in run.stderr


def test_a_config_error_reaches_the_terminal_whichever_rank_exits_first(tmp_path):
    """4 pipeline stages over 2 layers under torchrun: every rank sees it, and the first to exit takes the others
    down. The reason must be in the output, not only torchrun's ChildFailedError banner."""
    run = run_train(["--mesh-shape", "4,1,1", "--n-layer", "2", "--steps", "1"], tmp_path, nproc=4, timeout=120,
                    torchrun=True)
    assert run.returncode != 0, run.describe()
    assert "error: --mesh-shape: 4 pipeline stages (PP=4) cannot split --n-layer 2" in run.stderr, run.describe()

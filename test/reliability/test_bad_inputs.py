"""Bad inputs across the API, the CLI, the example's config and the checkpoint calls.

Each case names the exception type and a piece of the message: the bad value, and what would
be valid. Nothing here hangs or needs more than one process (mesh queries run on torch's fake
backend). ``CASES`` is counted in docs/checkpoints.md.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from vemesh import VeDeviceMesh, checkpoint
from vemesh.cli import main as cli
from vemesh.layout import MeshLayout
from vemesh.layout.spec import MeshSpec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))
from config import ConfigError, TrainConfig  # noqa: E402

LAYOUT = MeshLayout((2, 4), ("DP", "TP"))


def spec(**kw: Any) -> Callable[[], Any]:
    return lambda: MeshSpec(**{"device_type": "cpu", "mesh_shape": (2, 2), **kw})


# (id, call, exception type, piece of the message)
API = [
    ("name-with-space", spec(mesh_dim_names=(" DP", "TP")), ValueError, "dim name ' DP' is not a plain name"),
    ("name-set", spec(mesh_dim_names={"DP", "TP"}), ValueError, "ordered sequence (a tuple or list); got a set"),
    ("name-inner-space", spec(mesh_dim_names=("D P", "TP")), ValueError, "'D P' is not a plain name"),
    ("name-leading-digit", spec(mesh_dim_names=("1DP", "TP")), ValueError, "'1DP' is not a plain name"),
    ("name-not-str", spec(mesh_dim_names=(1, 2)), TypeError, "dim names must be strings; got 1 of type int"),
    ("size-float", spec(mesh_shape=(2.0, 2)), TypeError, "must be an integer (numpy and torch integer scalars count"),
    ("size-bool", spec(mesh_shape=(True, 2)), TypeError, "got True of type bool"),
    ("size-text", spec(mesh_shape="2,2"), ValueError, "mesh_shape must be a tuple of ints"),
    ("size-zero", spec(mesh_shape=(2, 0)), ValueError, "mesh_shape: every size must be a positive integer, or one -1 to fill in; got 0 in (2, 0)"),
    ("rank-bool", lambda: LAYOUT.coordinate(True), TypeError, "a global rank must be an integer"),
    ("rank-float", lambda: LAYOUT.coordinate(2.0), TypeError, "got 2.0 of type float"),
    ("rank-str", lambda: LAYOUT.coordinate("3"), TypeError, "got '3' of type str"),
    ("rank-too-big", lambda: LAYOUT.coordinate(8), ValueError, "global rank 8 is out of range; valid: 0..7"),
    ("rank-negative", lambda: LAYOUT.coordinate(-1), ValueError, "global rank -1 is out of range"),
    ("rank-numpy-too-big", lambda: LAYOUT.coordinate(np.int64(9)), ValueError, "global rank 9 is out of range"),
    ("coordinate-float", lambda: LAYOUT.rank((1, 2.5)), TypeError, "coordinate entry TP must be an integer"),
    ("coordinate-str", lambda: LAYOUT.rank("12"), TypeError, "a coordinate is a sequence of integers"),
    ("coordinate-short", lambda: LAYOUT.rank((1,)), ValueError, "has 1 entries"),
    ("local-rank-float", lambda: LAYOUT.member(0, (1,), 1.0), TypeError, "a local rank must be an integer"),
    ("offset-outside-world", lambda: MeshSpec(device_type="cpu", mesh_shape=(2, 2)).resolve(8, rank_offset=8), ValueError,
     "rank_offset 8 is outside the world of 8 ranks; valid: 0..7"),
    ("offset-too-many", lambda: MeshSpec(device_type="cpu", mesh_shape=(2, 4)).resolve(8, rank_offset=4), ValueError,
     "mesh_shape: DP 2 x TP 4 = 8 but the number of ranks from rank_offset 4 on (4..7) is only 4"),
    ("offset-float", lambda: MeshSpec(device_type="cpu", mesh_shape=(2, 2)).resolve(8, rank_offset=4.0), TypeError,
     "rank_offset must be an integer"),
    ("cuda-without-cuda", lambda: VeDeviceMesh().init_device_mesh("cuda", (1,)), RuntimeError,
     "device_type 'cuda': this machine has no cuda device"),
    ("timeout-negative", lambda: VeDeviceMesh().init_device_mesh("cpu", (1,), timeout=-1), ValueError, "timeout must be positive"),
    ("timeout-text", lambda: VeDeviceMesh().init_device_mesh("cpu", (1,), timeout="10"), TypeError, "timeout must be a datetime.timedelta"),
]

# on a fake (PP, DP, TP) = (2, 2, 2) world, as rank 5 sees it
MESH = [
    ("offset-float", lambda m: m.get_neighbor_rank("PP", 1.5), TypeError, "a neighbor offset must be an integer (numpy"),
    ("offset-bool", lambda m: m.get_neighbor_rank("PP", True), TypeError, "got True of type bool"),
    ("wrap-str", lambda m: m.get_neighbor_rank("PP", 1, wrap="yes"), TypeError, "wrap must be True or False; got 'yes'"),
    ("global-rank-of-int", lambda m: m.get_global_rank(5), TypeError, "a coordinate is a sequence of integers"),
    ("global-rank-float-entry", lambda m: m.get_global_rank({"PP": 1.0}), TypeError, "coordinate entry 'PP' must be an integer"),
    ("global-rank-unknown-dim", lambda m: m.get_global_rank({"XP": 0}), KeyError, "unknown dim name 'XP'"),
    ("global-rank-out-of-range", lambda m: m.get_global_rank([0, 0, 2]), ValueError, "TP=2 is out of range; valid: 0..1"),
    ("coordinate-of-bool", lambda m: m.get_strategy_coordinate(True), TypeError, "a global rank must be an integer"),
    ("coordinate-of-8", lambda m: m.get_strategy_coordinate(8), ValueError, "global rank 8 is out of range; valid: 0..7"),
    ("to-global-float", lambda m: m.to_global_rank(0.5, "TP"), TypeError, "a local rank must be an integer"),
    ("to-global-too-big", lambda m: m.to_global_rank(2, "TP"), ValueError, "local rank 2 is out of range along TP"),
    ("to-local-str", lambda m: m.to_local_rank("5", "TP"), TypeError, "got '5' of type str"),
    ("size-of-spaced-name", lambda m: m.get_strategy_size(" DP"), KeyError, "unknown dim name ' DP'"),
]

CLI = [
    ("show-minus-one-needs-world", ["show", "--shape", "-1,2"], "argument --world-size: needed for the -1 in --shape -1,2"),
    ("show-not-a-number", ["show", "--shape", "2,x"], "invalid shape '2,x'"),
    ("show-zero", ["show", "--shape", "0,2"], "every size must be a positive integer, or one -1 to fill in; got 0 in (0, 2)"),
    ("show-negative", ["show", "--shape", "-2,2"], "got -2 in (-2, 2)"),
    ("show-rank-out-of-range", ["show", "--shape", "2,2", "--rank", "4"], "global rank 4 is out of range; valid: 0..3"),
    ("show-rank-negative", ["show", "--shape", "2,2", "--rank", "-1"], "global rank -1 is out of range"),
    ("show-rank-float", ["show", "--shape", "2,2", "--rank", "1.5"], "invalid int value: '1.5'"),
    ("show-repeated-names", ["show", "--shape", "2,2", "--names", "DP,DP"], "must be unique"),
    ("show-spaced-name", ["show", "--shape", "2,2", "--names", "DP, TP"], "dim name ' TP' is not a plain name"),
    ("show-too-big", ["show", "--shape", "100000,100000"], "10,000,000,000 ranks is more than vemesh draws (524,288"),
    ("plan-too-big", ["plan", "--world-size", "1000000000"], "1,000,000,000 ranks is more than vemesh draws"),
    ("plan-overflow", ["plan", "--world-size", "9" * 30], "ranks is more than vemesh draws"),
    ("plan-zero-world", ["plan", "--world-size", "0"], "invalid value '0': expected a positive integer"),
    ("plan-tp-does-not-divide", ["plan", "--world-size", "8", "--tp", "3"], "TP 3 = 3 does not divide the world size 8"),
    ("plan-ep-does-not-divide", ["plan", "--world-size", "8", "--tp", "2", "--ep", "3"], "EP 3 must divide DP x CP = 4 x 1 = 4"),
    ("plan-model-unknown-field", ["plan", "--world-size", "2", "--model", "gpt:n_layers=2,n_embd=8,n_head=2"],
     "unknown field 'n_layers'; valid fields: n_layer, n_embd, n_head"),
    ("plan-model-factory-fails", ["plan", "--world-size", "2", "--model", "module:json:loads"],
     "module:json:loads: json:loads() failed: TypeError"),
    ("plan-memory-without-unit", ["plan", "--world-size", "2", "--model", "gpt:n_layer=1,n_embd=8,n_head=2",
                                  "--device-memory", "80"], "--device-memory '80' needs a unit"),
    ("plan-schedule-unknown", ["plan", "--world-size", "2", "--pp", "2", "--model", "gpt:n_layer=2,n_embd=8,n_head=2",
                               "--pp-schedule", "zigzag"], "pipeline schedule 'zigzag': choose one of gpipe, 1f1b, "
                                                           "interleaved-1f1b, interleaved-zb, zbv, dualpipev"),
    ("plan-job-without-model", ["plan", "--world-size", "2", "--device-memory", "80GiB"],
     "argument --device-memory: describes a job; give the model too"),
    # torch's own words alone said neither flag ("Number of microbatches (2) must be greater than or equal to ...")
    ("plan-too-few-micro-batches", ["plan", "--world-size", "4", "--pp", "4", "--model", "gpt:n_layer=4,n_embd=8,n_head=2",
                                    "--global-batch-size", "6", "--micro-batch-size", "3"],
     "PP 4 under 1f1b: 2 micro-batches of 3 per DP rank (6 sequences), which torch's schedule refuses (Number of "
     "microbatches (2) must be greater than or equal to the number of stages (4).): choose --micro-batch-size from 1"),
    ("plan-too-few-sequences", ["plan", "--world-size", "4", "--pp", "4", "--model", "gpt:n_layer=4,n_embd=8,n_head=2",
                                "--global-batch-size", "2"], "1 micro-batch of 2 per DP rank (2 sequences), which "
     "torch's schedule refuses (Number of microbatches (1) must be greater than or equal to the number of stages "
     "(4).): give a --global-batch-size of more sequences per DP rank, or fewer PP ranks"),
]


def _config(argv: list[str], world: int = 1) -> Callable[[], Any]:
    def parse() -> Any:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("WORLD_SIZE", str(world))
            mp.delenv("LOCAL_WORLD_SIZE", raising=False)
            return TrainConfig.from_args([*argv, "--device", "cpu"])

    return parse


def example_cases(tmp: Path) -> list[tuple[str, Callable[[], Any], type, str]]:
    (tmp / "empty.txt").write_text("")
    (tmp / "ckpt" / "step_000040").mkdir(parents=True, exist_ok=True)
    (tmp / "a_file").write_text("x")
    return [
        ("data-empty", _config(["--data", str(tmp / "empty.txt")]), ConfigError, "is empty; give a text file"),
        ("data-directory", _config(["--data", str(tmp)]), ConfigError, "--data: no such file"),
        ("metrics-missing-dir", _config(["--metrics-file", str(tmp / "no" / "m.jsonl")]), ConfigError, "does not exist"),
        ("metrics-is-dir", _config(["--metrics-file", str(tmp)]), ConfigError, "is a directory; give a file name"),
        ("ckpt-is-a-checkpoint", _config(["--checkpoint-dir", str(tmp / "ckpt" / "step_000040")]), ConfigError,
         f"is a checkpoint itself; pass the directory that holds the checkpoints, '{tmp / 'ckpt'}'"),
        ("ckpt-is-a-file", _config(["--checkpoint-dir", str(tmp / "a_file")]), ConfigError, "is a file, not a directory"),
        ("ckpt-under-a-file", _config(["--checkpoint-dir", str(tmp / "a_file" / "ckpt")]), ConfigError, "is not writable"),
        ("timeout-zero", _config(["--timeout-s", "0"]), ConfigError, "--timeout-s: Input should be greater than 0"),
        ("skip-negative", _config(["--skip-nonfinite", "-1"]), ConfigError, "--skip-nonfinite: Input should be greater than or equal to 0"),
        ("nan-with-pp", _config(["--mesh-shape", "2,1,1", "--n-layer", "2", "--nan-at-step", "1"], 2), ConfigError,
         "--nan-at-step injects into the loss of the DDP path"),
        ("stages-over-layers", _config(["--mesh-shape", "4,1,1", "--n-layer", "2"], 4), ConfigError,
         "4 pipeline stages (PP=4) cannot split --n-layer 2"),
        ("micro-batch-does-not-divide", _config(["--mesh-shape", "2,1", "--micro-batch-size", "5"], 2), ConfigError,
         "--micro-batch-size 5 does not divide the 16 sequences per DP rank"),
        ("gradient-sync-each-with-pp", _config(["--mesh-shape", "2,1,1", "--n-layer", "4", "--gradient-sync", "each"],
                                                2), ConfigError,
         "--gradient-sync each with PP > 1: torch's schedule runs the micro-batches (--microbatches)"),
        ("gradient-sync-unknown", _config(["--gradient-sync", "sometimes"]), ConfigError,
         "--gradient-sync: Input should be 'last' or 'each'"),
        ("interval-without-dir", _config(["--checkpoint-interval-s", "60"]), ConfigError,
         "--checkpoint-interval-s 60.0 needs --checkpoint-dir"),
        ("fsdp-with-zero-flag", _config(["--mesh-shape", "2,1", "--fsdp", "--no-distributed-optimizer"], 2), ConfigError,
         "--fsdp shards the optimizer state and reduces gradients itself; --no-distributed-optimizer does not apply"),
        ("dp-replicate-does-not-divide", _config(["--mesh-shape", "4,1", "--fsdp", "--dp-replicate", "3"], 4), ConfigError,
         "--dp-replicate 3 does not divide the DP size 4 (choose from 1, 2, 4)"),
        ("dp-replicate-without-fsdp", _config(["--mesh-shape", "4,1", "--dp-replicate", "2"], 4), ConfigError,
         "--dp-replicate 2 splits DP for HSDP; it needs --fsdp"),
        ("world-cannot-hold-tp", _config(["--mesh-shape", "-1,2"], 3), ConfigError, "--mesh-shape: cannot fill in DP: TP 2 = 2 does not divide the number of processes 3"),
        ("mesh-3-numbers-wrong-world", _config(["--mesh-shape", "2,2,2"], 4), ConfigError, "--mesh-shape: PP 2 x DP 2 x TP 2 = 8 but the number of processes is 4"),
        ("mesh-dims-unknown", _config(["--mesh-dims", "DP,XP", "--mesh-shape", "1,1"]), ConfigError,
         "--mesh-dims: unknown dim name 'XP' in DP,XP; choose from PP, DP, CP, TP"),
        ("mesh-dims-repeated", _config(["--mesh-dims", "DP,CP,DP", "--mesh-shape", "1,1,1"]), ConfigError,
         "--mesh-dims: DP appears more than once in DP,CP,DP"),
        ("mesh-dims-count", _config(["--mesh-dims", "DP,CP,TP", "--mesh-shape", "2,2"], 4), ConfigError,
         "--mesh-shape 2,2 has 2 sizes; --mesh-dims DP,CP,TP names 3 dims"),
        ("mesh-dims-without-shape", _config(["--mesh-dims", "CP"]), ConfigError, "--mesh-dims CP needs --mesh-shape"),
        ("four-sizes-without-dims", _config(["--mesh-shape", "1,1,1,1"]), ConfigError,
         "--mesh-shape 1,1,1,1 has 4 sizes; without --mesh-dims, it takes 2 sizes (DP,TP) or 3 (PP,DP,TP)"),
        ("cp-seq-len", _config(["--mesh-dims", "CP", "--mesh-shape", "4", "--seq-len", "100"], 4), ConfigError,
         "--seq-len 100 does not split over CP 4: each CP rank holds 2 of 8 equal chunks (head-tail load balancing); "
         "use a multiple of 8 or --no-cp-load-balance"),
        ("cp-dropout", _config(["--mesh-dims", "CP", "--mesh-shape", "2", "--dropout", "0.1"], 2), ConfigError,
         "--dropout 0.1: CP's ring attention supports no attention dropout"),
        ("cp-sequence-parallel", _config(["--mesh-dims", "CP,TP", "--mesh-shape", "2,4", "--sequence-parallel",
                                          "--seq-len", "12", "--n-head", "4", "--n-embd", "64"], 8),
         ConfigError, "--sequence-parallel: --seq-len 12 must be divisible by CP x TP = 2 x 4 = 8"),
        ("zero-bubble-with-fsdp", _config(["--mesh-shape", "2,2,1", "--n-layer", "4", "--pp-schedule", "zbv", "--fsdp"], 4),
         ConfigError, "--pp-schedule zbv with --fsdp and DP 2: torch's zero-bubble schedules add the weight gradients"),
        ("dualpipev-microbatches", _config(["--mesh-shape", "2,1,1", "--n-layer", "4", "--pp-schedule", "dualpipev",
                                            "--microbatches", "2", "--global-batch-size", "8"], 2),
         ConfigError, "--microbatches 2: dualpipev needs at least one per stage (4: 2 per PP rank)"),
        ("microbatches-without-pp", _config(["--mesh-dims", "DP,CP", "--mesh-shape", "1,1", "--microbatches", "2"]),
         ConfigError, "--microbatches and --pp-schedule need a PP dim"),
        ("ep-does-not-divide-dp-cp", _config(["--mesh-shape", "2,2", "--moe-experts", "4", "--ep", "4"], 4), ConfigError,
         "--ep 4 does not divide DP x CP = 2 x 1 = 2: EP folds over the data-parallel ranks (choose from 1, 2)"),
        ("ep-does-not-divide-experts", _config(["--mesh-shape", "4,1", "--moe-experts", "6", "--ep", "4"], 4), ConfigError,
         "--ep 4 does not divide the 6 experts of --moe-experts (each EP rank holds E / EP; choose from 1, 2)"),
        ("top-k-above-experts", _config(["--moe-experts", "4", "--moe-top-k", "5"]), ConfigError,
         "--moe-top-k 5 is more than the 4 experts of --moe-experts; choose 1..4"),
        ("ep-without-moe", _config(["--mesh-shape", "2,1", "--ep", "2"], 2), ConfigError,
         "--ep applies to a mixture of experts; add --moe-experts E"),
        ("moe-with-pp", _config(["--mesh-shape", "2,1,1", "--n-layer", "2", "--moe-experts", "2"], 2), ConfigError,
         "--moe-experts with a PP dim is not supported yet"),
        ("ft-flag-without-replica-id", _config(["--ft-lighthouse", "http://host:29510"]), ConfigError,
         "--ft-lighthouse applies to live fault tolerance; add --ft-replica-id I"),
        ("ft-lighthouse-not-an-address", _config(["--ft-replica-id", "0", "--ft-lighthouse", "host:29510"]), ConfigError,
         "--ft-lighthouse 'host:29510' is not an address like http://HOST:29510"),
        ("ft-with-fsdp", _config(["--ft-replica-id", "0", "--ft-lighthouse", "http://host:29510", "--fsdp"]), ConfigError,
         "--ft-replica-id with --fsdp is not supported: live fault tolerance runs DDP with the ZeRO-1"),
        ("ft-with-pp", _config(["--ft-replica-id", "1", "--ft-lighthouse", "http://host:1", "--mesh-shape", "2,1,1",
                                "--n-layer", "2"], 2), ConfigError, "--ft-replica-id with a PP dim is not supported"),
        ("ft-replica-id-negative", _config(["--ft-replica-id", "-1"]), ConfigError, "--ft-replica-id"),
    ]


def checkpoint_cases(tmp: Path) -> list[tuple[str, Callable[[], Any], type, str]]:
    model = nn.Linear(2, 2)
    step_dir = tmp / "ckpts" / "step_000010"
    step_dir.mkdir(parents=True, exist_ok=True)
    (tmp / "plain_file").write_text("x")
    return [
        ("save-into-a-checkpoint", lambda: checkpoint.save(step_dir, model=model, step=1), checkpoint.CheckpointError,
         f"it is a checkpoint itself, not a directory of checkpoints; pass its parent '{step_dir.parent}'"),
        ("resume-from-a-checkpoint", lambda: checkpoint.load_latest(step_dir, model=model), checkpoint.CheckpointError,
         "cannot resume from"),
        ("step-negative", lambda: checkpoint.save(tmp / "c", model=model, step=-1), ValueError, "step must be a non-negative int, got -1"),
        ("step-bool", lambda: checkpoint.save(tmp / "c", model=model, step=True), ValueError, "got True"),
        ("extra-not-json", lambda: checkpoint.save(tmp / "c", model=model, step=1, extra={"x": object()}), ValueError,
         "extra must be JSON-serializable; extra['x'] is a object, which JSON cannot hold"),
        # an LR scheduler as torch users hold it: its state dict is JSON (it said only "Object of type LambdaLR is not
        # JSON serializable")
        ("extra-a-scheduler", lambda: checkpoint.save(tmp / "c", model=model, step=1, extra={"data": [1, {
            "sched": torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters()), lambda s: 1.0)}]}),
         ValueError, "extra['data'][1]['sched'] is a LambdaLR, which JSON cannot hold: put its state_dict() there "
                     "instead (an LR scheduler's is JSON), and after load call its load_state_dict()"),
        ("lock-under-a-file", lambda: checkpoint.acquire_lock(tmp / "plain_file" / "ckpt"),
         checkpoint.CheckpointError, "is not writable"),
        ("lock-a-checkpoint", lambda: checkpoint.acquire_lock(step_dir), checkpoint.CheckpointError, "it is a checkpoint itself"),
    ]


def _raises(call: Callable[[], Any], exc: type, piece: str) -> None:
    with pytest.raises(exc) as err:
        call()
    text = err.value.args[0] if isinstance(err.value, KeyError) else str(err.value)
    assert piece in text, f"{exc.__name__} message {text!r} lacks {piece!r}"


@pytest.mark.parametrize(("call", "exc", "piece"), [c[1:] for c in API], ids=[c[0] for c in API])
def test_api(call, exc, piece):
    if "cuda" in piece and torch.cuda.is_available():
        pytest.skip("checks the message on a machine without CUDA")
    _raises(call, exc, piece)


@pytest.fixture
def rank5() -> Any:
    dist.init_process_group("fake", rank=5, world_size=8, store=FakeStore())
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("PP", "DP", "TP"))
    yield mesh
    dist.destroy_process_group()


@pytest.mark.parametrize(("call", "exc", "piece"), [c[1:] for c in MESH], ids=[c[0] for c in MESH])
def test_mesh_queries(rank5, call, exc, piece):
    _raises(lambda: call(rank5), exc, piece)


@pytest.mark.parametrize(("argv", "piece"), [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_cli(capsys, argv, piece):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vemesh: error: ") and err.count("\n") == 1, err
    assert piece in err, err


@pytest.mark.parametrize("cases", [example_cases, checkpoint_cases], ids=["example-config", "checkpoint-calls"])
def test_cases_built_in_a_directory(tmp_path, cases):
    for name, call, exc, piece in cases(tmp_path):
        try:
            _raises(call, exc, piece)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_numpy_and_torch_integers_are_accepted_everywhere(rank5):
    assert MeshSpec(device_type="cpu", mesh_shape=(np.int64(2), torch.tensor(2))).mesh_shape == (2, 2)
    assert rank5.get_neighbor_rank("PP", np.int64(-1)) == 1
    assert rank5.get_global_rank({"PP": torch.tensor(0)}) == 1
    assert rank5.to_global_rank(np.int32(0), "TP") == 4


def count_cases(tmp: Path) -> int:
    """How many bad inputs this file tries (docs/checkpoints.md quotes it)."""
    return len(API) + len(MESH) + len(CLI) + len(example_cases(tmp)) + len(checkpoint_cases(tmp))


def test_at_least_forty_bad_inputs(tmp_path):
    assert count_cases(tmp_path) >= 40, count_cases(tmp_path)
    assert math.isfinite(count_cases(tmp_path))

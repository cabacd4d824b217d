"""vemesh.checkpoint in one process (no process group): atomic saves, finding the latest good
checkpoint, clear errors for damaged or incompatible checkpoints, and safe loading."""

from __future__ import annotations

import shutil

import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import vemesh.resilience.checkpoint.api as api
from vemesh.resilience.checkpoint import files, integrity, safe_read
from vemesh import checkpoint
from vemesh.checkpoint import (
    CheckpointNotFoundError,
    DamagedCheckpointError,
    IncompatibleCheckpointError,
    checkpoint_path,
    list_checkpoints,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make(width: int = 8, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.LayerNorm(width), nn.Linear(width, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"w.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"s.{i}.{k}": v.clone() for k, v in st.items()})
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture
def two_saved(tmp_path: Path) -> tuple[Path, dict, dict]:
    """Checkpoints at steps 2 and 4 under tmp_path/ckpt, with snapshots of what each holds."""
    model, opt = make()
    train(model, opt, 2)
    checkpoint.save(tmp_path / "ckpt", model=model, optimizer=opt, step=2, extra={"seen": 2})
    at2 = snapshot(model, opt)
    train(model, opt, 2)
    checkpoint.save(tmp_path / "ckpt", model=model, optimizer=opt, step=4, extra={"seen": 4})
    return tmp_path / "ckpt", at2, snapshot(model, opt)


def shard_of(path: Path) -> Path:
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


# ------------------------------------------------------------------------- round trip
def test_round_trip_restores_weights_state_hyperparameters_and_extra(two_saved) -> None:
    root, _, at4 = two_saved
    model, opt = make(seed=1)
    opt.param_groups[0]["lr"] = 5.0
    assert checkpoint.load(root / "step_000004", model=model, optimizer=opt) == (4, {"seen": 4})
    assert_same(snapshot(model, opt), at4)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("kind", ["lambda", "cosine", "one-cycle", "sequential", "plateau"])
def test_an_lr_scheduler_resumes_through_extra_as_its_state_dict(tmp_path: Path, kind: str) -> None:
    """docs/checkpoints.md's way for a scheduler: its state dict in ``extra`` (JSON: the object itself is refused,
    test_bad_inputs.py), then ``load_state_dict``; the resumed run takes the uninterrupted run's learning rates."""
    def build(opt: torch.optim.Optimizer):  # type: ignore[no-untyped-def]
        lr = torch.optim.lr_scheduler
        if kind == "lambda":
            return lr.LambdaLR(opt, lambda s: 0.5 ** s)
        if kind == "cosine":
            return lr.CosineAnnealingLR(opt, T_max=8, eta_min=1e-4)
        if kind == "one-cycle":
            return lr.OneCycleLR(opt, max_lr=0.1, total_steps=8)
        if kind == "sequential":
            return lr.SequentialLR(opt, [lr.LinearLR(opt, 0.1, total_iters=3), lr.ExponentialLR(opt, 0.9)], [3])
        return lr.ReduceLROnPlateau(opt, patience=0)

    def run(model, opt, sched, steps: range) -> list[float]:  # type: ignore[no-untyped-def]
        rates = []
        for step in steps:
            train(model, opt, 1)
            sched.step(*([1.0 + step % 2] if kind == "plateau" else []))
            rates.append(opt.param_groups[0]["lr"])
        return rates

    model, opt = make()
    sched = build(opt)
    first = run(model, opt, sched, range(4))
    checkpoint.save(tmp_path / "ckpt", model=model, optimizer=opt, step=4, extra={"sched": sched.state_dict()})
    whole = first + run(model, opt, sched, range(4, 8))
    model, opt = make(seed=1)
    sched = build(opt)
    step, extra = checkpoint.load_latest(tmp_path / "ckpt", model=model, optimizer=opt)
    sched.load_state_dict(extra["sched"])
    assert first + run(model, opt, sched, range(step, 8)) == whole
    assert len(set(whole)) > 1  # the rates move


def test_layout_on_disk(two_saved) -> None:
    root, _, _ = two_saved
    names = sorted(p.name for p in root.iterdir())
    assert names == ["step_000002", "step_000004"]  # no temporary directory left behind
    assert {".metadata", "vemesh.json"} <= {p.name for p in (root / "step_000004").iterdir()}
    assert [(i.step, i.ok) for i in list_checkpoints(root)] == [(4, True), (2, True)]


def test_load_of_a_root_takes_the_latest(two_saved) -> None:
    root, _, at4 = two_saved
    model, opt = make(seed=1)
    assert checkpoint.load(root, model=model, optimizer=opt)[0] == 4
    assert_same(snapshot(model, opt), at4)


def test_keep_last_prunes_older_checkpoints(tmp_path: Path) -> None:
    model, opt = make()
    for step in range(1, 6):
        checkpoint.save(tmp_path, model=model, optimizer=opt, step=step, keep_last=2)
    assert [i.step for i in list_checkpoints(tmp_path)] == [5, 4]


def test_model_only(tmp_path: Path) -> None:
    model, opt = make()
    checkpoint.save(tmp_path, model=model, step=1)
    fresh, fresh_opt = make(seed=1)
    assert checkpoint.load(tmp_path, model=fresh) == (1, {})
    assert_same({k: v for k, v in fresh.state_dict().items()}, {k: v for k, v in model.state_dict().items()})
    with pytest.raises(IncompatibleCheckpointError, match="saved without optimizer state; pass optimizer=None"):
        checkpoint.load(tmp_path, model=fresh, optimizer=fresh_opt)


# --------------------------------------------------------------------- atomic saves
def test_a_crash_mid_save_leaves_the_last_checkpoint_intact(two_saved, monkeypatch) -> None:
    root, _, at4 = two_saved
    model, opt = make(seed=3)
    real_save = api.dcp.save

    def crash_after_writing(state, **kwargs):  # the shards are written, then the process "dies"
        real_save(state, **kwargs)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(api.dcp, "save", crash_after_writing)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(root, model=model, optimizer=opt, step=6)
    monkeypatch.undo()
    assert not (root / ".step_000006.tmp").exists() and not (root / "step_000006").exists()  # cleaned up
    shutil.copytree(root / "step_000004", root / ".step_000006.tmp")  # what a kill -9 mid-save leaves
    assert [i.step for i in list_checkpoints(root)] == [4, 2]
    fresh, fresh_opt = make(seed=1)
    assert checkpoint.load_latest(root, model=fresh, optimizer=fresh_opt) == (4, {"seen": 4})
    assert_same(snapshot(fresh, fresh_opt), at4)
    checkpoint.save(root, model=model, optimizer=opt, step=6)  # the next save clears the leftovers
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000004", "step_000006"]


def test_saving_a_step_again_replaces_it(two_saved) -> None:
    root, _, _ = two_saved
    model, opt = make(seed=5)
    checkpoint.save(root, model=model, optimizer=opt, step=4, extra={"again": True})
    fresh, fresh_opt = make(seed=1)
    assert checkpoint.load(root, model=fresh, optimizer=fresh_opt) == (4, {"again": True})
    assert_same(snapshot(fresh, fresh_opt), snapshot(model, opt))


# -------------------------------------------------------------- damaged checkpoints
@pytest.mark.parametrize("damage", ["truncate", "delete", "garble", "no-manifest"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(two_saved, damage: str) -> None:
    root, at2, _ = two_saved
    latest = root / "step_000004"
    shard = shard_of(latest)
    size = shard.stat().st_size
    expected_problem = {
        "truncate": f"file '{shard.name}' has {size // 2} bytes, {size} expected",
        "delete": f"file '{shard.name}' is missing",
        "garble": f"file '{shard.name}' does not match its checksum",
        "no-manifest": "has no vemesh.json: its save did not finish",
    }[damage]
    if damage == "truncate":
        os.truncate(shard, size // 2)
    elif damage == "delete":
        shard.unlink()
    elif damage == "garble":  # same size, so only reading the data finds it
        with open(shard, "r+b") as f:
            f.seek(64)
            f.write(os.urandom(size - 128))
    else:
        (latest / "vemesh.json").unlink()

    model, opt = make(seed=1)
    with pytest.raises(DamagedCheckpointError, match=expected_problem):
        checkpoint.load(latest, model=model, optimizer=opt)
    with pytest.warns(UserWarning, match=f"skipping damaged checkpoint: checkpoint '{latest}'.*{expected_problem}.*trying the previous one"):
        assert checkpoint.load_latest(root, model=model, optimizer=opt) == (2, {"seen": 2})
    assert_same(snapshot(model, opt), at2)


def test_every_checkpoint_damaged_stops_with_every_reason(two_saved) -> None:
    root, _, _ = two_saved
    for step in (2, 4):
        os.truncate(shard_of(checkpoint_path(root, step)), 10)
    model, opt = make(seed=1)
    with warnings.catch_warnings(), pytest.raises(DamagedCheckpointError) as err:
        warnings.simplefilter("ignore")
        checkpoint.load_latest(root, model=model, optimizer=opt)
    assert f"no usable checkpoint under '{root}'" in str(err.value)
    assert str(err.value).count("has 10 bytes") == 2


def test_missing_checkpoints(tmp_path: Path) -> None:
    model, opt = make()
    with pytest.raises(CheckpointNotFoundError, match=f"no checkpoint at '{tmp_path / 'nope'}': no such directory"):
        checkpoint.load(tmp_path / "nope", model=model, optimizer=opt)
    with pytest.raises(CheckpointNotFoundError, match="neither a checkpoint nor a directory of step_N checkpoints"):
        checkpoint.load(tmp_path, model=model, optimizer=opt)
    assert checkpoint.load_latest(tmp_path / "nope", model=model, optimizer=opt) is None  # a fresh run
    assert checkpoint.load_latest(tmp_path, model=model, optimizer=opt) is None


# ---------------------------------------------------------- incompatible checkpoints
def test_a_different_model_shape_names_the_parameter_and_both_shapes(two_saved) -> None:
    root, _, _ = two_saved
    model, opt = make(width=16)
    with pytest.raises(IncompatibleCheckpointError) as err:
        checkpoint.load(root / "step_000004", model=model, optimizer=opt)
    assert "parameter '0.weight' has shape (8, 4) in the checkpoint but (16, 4) in the model" in str(err.value)
    # load_latest does not fall back: an older checkpoint of the same run would not fit either
    with pytest.raises(IncompatibleCheckpointError, match="'0.weight' has shape"):
        checkpoint.load_latest(root, model=model, optimizer=opt)


def test_missing_and_unexpected_keys(two_saved) -> None:
    root, _, _ = two_saved
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2), nn.Linear(2, 2))
    with pytest.raises(IncompatibleCheckpointError, match="parameter '3.weight' of the model is not in the checkpoint"):
        checkpoint.load(root, model=model)
    checkpoint.load(root, model=nn.Sequential(*model[:3]))  # the first three layers fit
    small = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    with pytest.raises(IncompatibleCheckpointError, match=r"the checkpoint has 2 entries the model lacks: '2.bias', '2.weight'"):
        checkpoint.load(root, model=small)
    assert checkpoint.load(root, model=small, strict=False)[0] == 4


def test_a_different_optimizer_or_param_groups(two_saved) -> None:
    root, _, _ = two_saved
    model, _ = make(seed=1)
    with pytest.raises(IncompatibleCheckpointError, match="its optimizer is AdamW, not SGD"):
        checkpoint.load(root, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[1:].parameters())}]
    with pytest.raises(IncompatibleCheckpointError, match="its optimizer has 1 param groups, this one has 2"):
        checkpoint.load(root, model=model, optimizer=torch.optim.AdamW(groups))


# ------------------------------------------------------------------------ safe loading
class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_metadata_is_never_unpickled_with_arbitrary_classes(two_saved, tmp_path: Path, monkeypatch) -> None:
    root, _, _ = two_saved
    latest = root / "step_000004"
    (latest / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    monkeypatch.chdir(tmp_path)
    model, opt = make(seed=1)
    with pytest.raises(DamagedCheckpointError, match=rf"checkpoint '{latest}': refusing to unpickle 'posix.system' from .metadata"):
        checkpoint.load(latest, model=model, optimizer=opt)
    assert not (tmp_path / "PWNED").exists()
    problem = list_checkpoints(root)[0].problem
    assert problem is not None and "refusing to unpickle" in problem


def _rewrite_metadata(path: Path, edit) -> None:
    metadata = safe_read.read_metadata(path)
    edit(metadata)
    buf = io.BytesIO()
    pickle.dump(metadata, buf)
    (path / ".metadata").write_bytes(buf.getvalue())
    manifest = files.read_manifest(path)
    manifest["files"][".metadata"] = len(buf.getvalue())
    # a forger who knows the format also fixes the checksums (CRC-32 is no defence against that):
    # the restricted unpickler must still refuse what the metadata points at
    manifest["checksums"][".metadata"] = integrity.file_checksum(path / ".metadata")
    manifest["manifest_checksum"] = integrity.manifest_checksum(manifest)
    (path / "vemesh.json").write_text(__import__("json").dumps(manifest))


def test_pickled_entries_and_paths_outside_the_checkpoint_are_refused(two_saved) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    root, _, _ = two_saved
    latest = root / "step_000004"
    _rewrite_metadata(latest, lambda md: md.state_dict_metadata.__setitem__("model.0.weight", BytesStorageMetadata()))
    model, opt = make(seed=1)
    with pytest.raises(DamagedCheckpointError, match="entry 'model.0.weight' is a pickled Python object"):
        checkpoint.load(latest, model=model, optimizer=opt)

    previous = root / "step_000002"

    def escape(md):
        for info in md.storage_data.values():
            info.relative_path = "../../etc/passwd"

    _rewrite_metadata(previous, escape)
    with pytest.raises(DamagedCheckpointError, match="points outside the checkpoint directory"):
        checkpoint.load(previous, model=model, optimizer=opt)


def test_tensor_payloads_are_read_with_weights_only() -> None:
    """Pin the torch behaviour this module relies on (torch 2.13 filesystem.py)."""
    import inspect

    from torch.distributed.checkpoint.filesystem import FileSystemReader

    source = inspect.getsource(FileSystemReader.read_data)
    assert "weights_only=True" in source and "weights_only=False" not in source

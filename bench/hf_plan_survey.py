"""``vemesh plan`` on HF transformers' Llama-family decoders, against a real run of the same functions.

Each model is built small (2 layers, width 256, 8 query and 4 KV heads of 32, a vocabulary of 1024, 128 positions;
untied embeddings) from the library's own classes, and parallelized as a user of torch first writes it: torch's
``ColwiseParallel`` on q/k/v and gate/up (or a fused ``gate_up_proj``), ``RowwiseParallel`` on o/down, with what
``vemesh check`` says the plan needs to run exactly (``SequenceParallel`` on a norm over each head and on Apertus'
learned activation, StableLM's head counts set to this rank's, GLM's fused ``gate_up_proj`` under
``FusedColwiseParallel(2)``), then FSDP2 on each decoder layer and the root
(:func:`parallelize_fsdp`), or vemesh DDP with ZeRO-1 (:func:`parallelize_ddp`).
Each model is planned (``vemesh plan --model module:...``, the fake world) and then run for real on 4 gloo ranks, DP 2
x TP 2, by ``bench/plan_user_run.py`` with the same factory, parallelize function and step (3 steps, torch's
MemTracker): each row gives the predicted and the measured peak (with PP, the PP rank's furthest from the run's) and
each dim's bytes per step, and whether the plan
said that transformers took its tracing branch (its masks) or that the step leaks (a run's peak then grows with its
steps: the run's here is its third's).

    python bench/hf_plan_survey.py [--models llama,qwen3,...] [--modes fsdp,zero1] [--json OUT]

BENCHMARKS.md ("The planner on HF decoders") gives the table. The factories are ``make_<model>`` of this file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # the models are the sequence-parallel survey's (a rank imports this by path)
from hf_check_sp_survey import MODELS, SEQ, VOCAB, make  # noqa: E402

#: mode -> (the parallelize function, the step, the planner's and the run's flags besides the model's)
MODES = {"fsdp": ("parallelize_fsdp", "step", ["--tp", "2", "--dp-mode", "fsdp"]),
         "zero1": ("parallelize_ddp", "step", ["--tp", "2", "--dp-mode", "zero1"]),
         "fsdp-bf16": ("parallelize_fsdp_bf16", "step", ["--tp", "2", "--dp-mode", "fsdp"]),
         "fsdp-checkpointed": ("parallelize_fsdp_checkpointed", "step", ["--tp", "2", "--dp-mode", "fsdp"]),
         "pp-1f1b": ("parallelize_pp", "step_pp", ["--pp", "2", "--tp", "2", "--dp-mode", "ddp", "--loss",
                                                   f"{HERE}:loss_fn"])}


def _factory(name: str) -> Any:
    def factory() -> nn.Module:
        return make(name)
    factory.__name__ = factory.__qualname__ = f"make_{name}"
    return factory


globals().update({f"make_{name}": _factory(name) for name in MODELS})


def _tp(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    from vemesh.parallel import FusedColwiseParallel

    if mesh.get_strategy_size("TP") == 1:
        return
    for layer in model.model.layers:
        plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan.update({f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj") if hasattr(layer.mlp, p)})
        if hasattr(layer.mlp, "gate_up_proj"):  # GLM's gate and up in one Linear: each rank its part of both
            plan["mlp.gate_up_proj"] = FusedColwiseParallel(2)
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        # a norm over each head's queries and keys (Qwen3's) sees this rank's heads: its gradient summed over TP
        plan.update({f"self_attn.{p}": SequenceParallel(sequence_dim=2, use_local_output=True)
                     for p in ("q_norm", "k_norm") if hasattr(layer.self_attn, p)})
        if any(True for _ in getattr(layer.mlp, "act_fn", nn.Identity()).parameters()):  # Apertus' xIELU: learned
            plan["mlp.act_fn"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(layer, mesh["TP"], plan)
        if type(layer.self_attn).__name__ == "StableLmAttention":  # its views by the head counts: this rank's
            layer.self_attn.num_heads //= mesh["TP"].size()
            layer.self_attn.num_key_value_heads //= mesh["TP"].size()


def parallelize_fsdp(model: nn.Module, mesh: Any, **kwargs: Any) -> nn.Module:
    """The plain TP plan, then FSDP2 on each decoder layer and the root (``kwargs``: torch's, ``mp_policy``...)."""
    from vemesh.parallel import fully_shard

    _tp(model, mesh)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def parallelize_fsdp_bf16(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2 as above, computing in bf16 and reducing the gradients in fp32 (torchtitan's mixed precision)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return parallelize_fsdp(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                        reduce_dtype=torch.float32))


def parallelize_fsdp_checkpointed(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2 as above, with HF's own activation checkpointing of each decoder layer (``gradient_checkpointing_enable``,
    non-reentrant as torch recommends)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return parallelize_fsdp(model, mesh)


def parallelize_ddp(model: nn.Module, mesh: Any) -> nn.Module:
    """The plain TP plan, then vemesh DDP over the data dims (ZeRO-1 is the optimizer's)."""
    from vemesh.ddp import DistributedDataParallel

    _tp(model, mesh)
    return DistributedDataParallel(model)


def parallelize_pp(model: nn.Module, mesh: Any) -> list:
    """PP: this PP rank's stage as ``vemesh.parallel.DecoderStage`` cuts the model, the plain TP plan on its layers,
    in torch's ``PipelineStage`` (1F1B over PP 2 x TP 2: no data-parallel ranks)."""
    from torch.distributed.pipelining import PipelineStage

    from vemesh.parallel import DecoderStage

    pp = mesh.get_strategy_size("PP")
    part = DecoderStage(model, mesh.lookup_rank("PP"), pp)
    _tp(part, mesh)
    return [PipelineStage(part, mesh.lookup_rank("PP"), pp, torch.device("cpu"), group=mesh["PP"].get_group())]


def step_pp(schedule: Any, batch_size: int) -> None:
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    schedule.step(tokens[:, :-1].contiguous(), target=tokens[:, 1:].contiguous(), losses=[], return_outputs=False)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))


def step(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def _accuracy() -> Any:
    spec = importlib.util.spec_from_file_location("plan_accuracy", HERE.parent / "plan_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def survey(names: list[str], modes: list[str], workers: int = 4) -> list[dict[str, Any]]:
    """Each model and mode planned, then run: a row each (see the module docstring)."""
    accuracy = _accuracy()
    rows = []
    for name in names:
        for mode in modes:
            parallelize, step_fn, flags = MODES[mode]
            functions = ["--model", f"module:{HERE}:make_{name}", "--parallelize", f"{HERE}:{parallelize}",
                         "--step", f"{HERE}:{step_fn}", "--global-batch-size", "8"]
            started = time.monotonic()
            row: dict[str, Any] = {"model": name, "mode": mode}
            try:
                planned = accuracy.vemesh_plan([*functions, "--world-size", str(workers), "--device-type", "cpu",
                                                *flags])
            except SystemExit as e:
                row["error"] = f"plan: {str(e)[-300:]}"
            else:
                with tempfile.TemporaryDirectory() as workdir:
                    try:
                        run, _ = accuracy.measured(workers, [*functions, *flags], workdir,
                                                   HERE.parent / "plan_user_run.py")
                    except SystemExit as e:
                        row["error"] = f"run: {_reason(str(e))}"
                    else:
                        classes = accuracy._rows(name, planned, run)  # with PP a rank class a PP rank
                        got = max(classes, key=lambda c: abs(c["peak_ratio"] - 1))  # the worst
                        if len(classes) > 1:
                            row["classes"] = {c["rank_class"]: round(c["peak_ratio"], 4) for c in classes}
                        row.update(predicted_peak=got["predicted_peak"], measured_peak=got["measured_peak"],
                                   peak_ratio=round(got["peak_ratio"], 4),
                                   tracing_branch=any(n.startswith("transformers took") for n in planned["notes"]),
                                   leak_said=any(n.startswith("MEMORY LEAK") for n in planned["notes"]),
                                   bytes={d: b for d, b in got["bytes"].items() if b["predicted"] or b["measured"]})
            row["seconds"] = round(time.monotonic() - started, 1)
            rows.append(row)
            _print(row)
    return rows


def _reason(text: str) -> str:
    """A failed run's first rank's exception line (torchrun's own summary names no cause), else its tail."""
    import re

    found = re.search(r"\[rank\d+\]: (\w+(?:Error|Exception): .*)", text)
    return found.group(1)[:300] if found else text[-300:]


def _print(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['model']:10} {row['mode']:17} ERROR {row['error'][-200:]!r}", flush=True)
        return
    dims = "; ".join(f"{d} {b['predicted'] / b['measured']:.4f}" if b["measured"] else f"{d} {b['predicted']}/0"
                     for d, b in row["bytes"].items())
    print(f"{row['model']:10} {row['mode']:17} peak {row['predicted_peak'] / 2**20:7.2f} / "
          f"{row['measured_peak'] / 2**20:7.2f} MiB ({row['peak_ratio']:.3f})  bytes {dims}"
          f"{'  (transformers: its tracing branch, said)' if row['tracing_branch'] else ''}"
          f"{'  (MEMORY LEAK said)' if row['leak_said'] else ''}  ({row['seconds']} s)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated, from: {', '.join(MODELS)}")
    parser.add_argument("--modes", default="fsdp,zero1", help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    names = args.models.split(",") if args.models else list(MODELS)
    modes = args.modes.split(",")
    for given, known, what in ((names, MODELS, "model"), (modes, MODES, "mode")):
        unknown = [n for n in given if n not in known]
        if unknown:
            parser.error(f"unknown {what} {unknown[0]!r}; valid: {', '.join(known)}")
    rows = survey(names, modes)
    ok = [r for r in rows if "error" not in r]
    steady = [r for r in ok if not r["leak_said"]]  # a leaking run's peak grows with its steps (the plan says so)
    worst = max((abs(r["peak_ratio"] - 1) for r in steady), default=0.0)
    print(f"{len(ok)} of {len(rows)} planned and run; {len(ok) - len(steady)} said to leak; worst peak error of the "
          f"others {100 * worst:.1f}% (the planner's target: 10%)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())

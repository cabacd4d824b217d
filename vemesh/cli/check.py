"""``vemesh check``: does my parallelization compute what one process does? (:mod:`vemesh.check`)."""

from __future__ import annotations

import argparse
import ast
import json
from typing import Any

from vemesh.cli.common import UsageError, positive

__all__ = ["add_check"]


def model_kwargs(text: str) -> dict[str, Any]:
    """``n_layer=2,n_embd=64,bias=False``: each value a Python literal (a bare word stays a string)."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise argparse.ArgumentTypeError(f"invalid --model-kwargs item {item!r}: expected NAME=VALUE pairs "
                                             "separated by commas, such as n_layer=2,n_embd=64")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def add_check(commands: Any) -> argparse.ArgumentParser:
    sub = commands.add_parser(
        "check", help="compare your parallelized model with one process, module by module",
        description="Run your factory, parallelize function and step (those vemesh plan takes) once in one process "
                    "and once on N gloo processes of this machine, from the same seeds and inputs, and compare every "
                    "module's output and every gradient. Exit 0 when they match (exact), 1 when they differ (the "
                    "first module that differs and the gradients are named), 2 on bad input or when your code "
                    "raised in the parallel run before its step (nothing compared).")
    sub.add_argument("--model", required=True, metavar="module:MODULE:FACTORY", help="builds the model")
    sub.add_argument("--model-kwargs", type=model_kwargs, default={}, metavar="K=V,...",
                     help="keyword arguments for the factory: a small configuration of the same code")
    sub.add_argument("--parallelize", required=True, metavar="MODULE:FUNCTION", help="parallelize(model, mesh)")
    sub.add_argument("--step", required=True, metavar="MODULE:FUNCTION", help="step(model, micro_batch_size); with "
                     "--pp, step(schedule, batch_size)")
    sub.add_argument("--loss", default=None, metavar="MODULE:FUNCTION", help="with --pp: the schedule's "
                     "loss_fn(output, target)")
    sub.add_argument("--pp-schedule", default="1f1b", metavar="NAME", help="with --pp: torch's schedule "
                     "(gpipe, 1f1b, interleaved-1f1b, interleaved-zb, zbv, dualpipev; default 1f1b)")
    sub.add_argument("--world-size", type=positive, required=True, metavar="N", help="processes to run")
    for name in ("dp", "tp", "cp", "ep", "pp"):
        sub.add_argument(f"--{name}", type=positive, default=None if name == "dp" else 1, metavar="N",
                         help=f"the {name.upper()} degree" + (" (default: what the others leave)" if name == "dp"
                                                               else " (default 1)"))
    sub.add_argument("--dp-replicate", type=positive, default=1, metavar="N", help="HSDP's replica degree")
    sub.add_argument("--micro-batch-size", type=positive, default=2, metavar="B", help="the step's micro-batch "
                     "(default 2)")
    sub.add_argument("--rtol", type=float, default=None, metavar="R", help="the largest relative difference called "
                     "exact (default 1e-4; 2e-2 for bf16 or fp16 parameters)")
    sub.add_argument("--timeout", type=positive, default=300, metavar="S", help="seconds the parallel run may take")
    sub.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    sub.set_defaults(run=_run)
    return sub


def _run(args: argparse.Namespace) -> int:
    from vemesh.check import CheckInputError, check  # torch only when checking: `vemesh show` starts fast

    if args.rtol is not None and not args.rtol > 0:
        raise UsageError(f"argument --rtol: {args.rtol}: expected a positive number, such as 1e-4")
    try:
        result = check(args.model, args.parallelize, args.step, world_size=args.world_size, dp=args.dp, tp=args.tp,
                       cp=args.cp, ep=args.ep, pp=args.pp, dp_replicate=args.dp_replicate,
                       micro_batch_size=args.micro_batch_size, model_kwargs=args.model_kwargs, rtol=args.rtol,
                       timeout_s=args.timeout, loss=args.loss, pp_schedule=args.pp_schedule)
    except CheckInputError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(result.to_json(), indent=2) if args.json else result.render())
    return 0 if result.exact else 2 if result.verdict == "failed" else 1

"""The hints of ``vemesh check`` where the layouts a plan gives torch's styles are the cause, not how its Linears are
split (no recipe of a Linear is tried there):

* torch's ``PrepareModuleInput`` or ``PrepareModuleOutput`` refused the layouts it was given: one for each argument
  the module is called with, or each value it returns (:func:`layouts_hint`);
* a module given a style never runs its forward, its parent reading its weights (:func:`never_called_hint`);
* a line of the user's code reads a styled module's weight itself, a tie written in the forward
  (:func:`read_outside_hint`);
* the plan reads the whole sequence as a TP rank's part (torch's ``SequenceParallel`` and a ``Shard`` input layout
  read a plain tensor so), and every token is there TP times (:func:`repeated_sequence_hint`): attention over
  repeated tokens gives what it gives once, so outputs can match while every gradient is TP times one process's;
* the plan cuts a sequence that TP does not divide, and the ranks' collectives disagree on their sizes
  (:func:`uneven_sequence_hint`).

:func:`layout_hint` gives the first that applies.
"""

from __future__ import annotations

import linecache
import re
from typing import Any

__all__ = ["SIZES", "layout_hint", "layouts_hint", "never_called_hint", "output_length", "read_outside_hint",
           "repeated_sequence_hint", "uneven_sequence_hint"]

#: torch's words where an elementwise op meets two tensors of other sizes along a dim: the two sizes
SIZES = re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)")


def layout_hint(tp: int, ref: dict, result: Any, failed: list[dict]) -> str | None:
    """The first hint of this module's that applies to a run (``failed``: its ranks' errors, if it raised), or None."""
    if failed and (said := layouts_hint(failed[0]) or never_called_hint(ref, failed[0])
                   or read_outside_hint(failed[0])):
        return said
    if (said := repeated_sequence_hint(tp, ref, result, failed)) is not None:
        return said
    return uneven_sequence_hint(tp, ref, failed[0].get("went", {})) if failed else None


def layouts_hint(failed: dict) -> str | None:
    """The hint where torch's tensor-parallel style raised on the layouts it was given for a module's inputs or
    outputs (its own check, in ``torch/distributed/tensor/parallel/style.py``: as many layouts as the module is called
    with), else None."""
    first = re.split(r"\n(?:The above exception|During handling)", failed.get("trace", ""))[0]  # the innermost raise
    frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', first)
    if not frames or not frames[-1][0].replace("\\", "/").endswith("torch/distributed/tensor/parallel/style.py") \
            or "should have same length" not in failed.get("message", ""):
        return None
    where, check = failed.get("module") or "the root", frames[-1][1]
    if "output" in check:
        return (f"torch's style on {where} refused the layouts it was given for the module's outputs (its own check, "
                f"in {check}): a PrepareModuleOutput takes one layout for each value the module returns, None for one "
                "it leaves as it is")
    return (f"torch's style on {where} refused the layouts it was given for the module's inputs (its own check, in "
            f"{check}): a PrepareModuleInput takes one layout for each argument the module is called with by position "
            "(the call is where the run failed, above), None for one it leaves as it is (a mask, a cache), and "
            "input_kwarg_layouts for those given by name")


def never_called_hint(ref: dict, failed: dict) -> str | None:
    """Where the forward of a module raised on a plain tensor meeting a DTensor, and a module under it that the plan
    gave a TP style never ran its own forward in one process: the parent reads its parameters itself (torch's
    ``nn.MultiheadAttention`` hands ``out_proj.weight`` to ``F.multi_head_attention_forward``), so the style, which
    acts in the module's forward, only made them DTensors. The hint, or None."""
    where, went = failed.get("module") or "", failed.get("went", {})
    if "mixed torch.Tensor and DTensor" not in failed.get("message", ""):
        return None
    ran = {k[0] for k in (ref.get("outputs") or [{}])[0]}
    styled = [(n, style) for style in ("colwise", "rowwise") for n in went.get(style, ())
              if n not in ran and (not where or n.startswith(where + "."))]
    if not styled:
        return None
    name, style = styled[0]
    torch_style = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}[style]
    return (f"{name} is in the plan ({torch_style}), but its own forward never runs: {where or 'the root'} reads its "
            "parameters itself (as torch's nn.MultiheadAttention hands out_proj.weight to "
            f"F.multi_head_attention_forward), and torch's style acts in the module's forward, so it only made them "
            "DTensors, which that forward's plain tensors meet. Leave it out of the plan; a module whose parent reads "
            "its weights is not split by torch's styles (write the attention with Linears and SDPA to split it)")


#: where the user's code raised, in a ``--step ... failed at FILE:LINE in NAME`` message
_AT = re.compile(r" failed at (\S+?):(\d+) in \w+")


def read_outside_hint(failed: dict) -> str | None:
    """Where an op met a plain tensor and a DTensor at a line of the user's code that reads a parameter of a module
    the plan gave a TP style (``self.wte.weight``: a tie written in the forward, GPT-2's ``h @ wte.weight.T``): the
    style made that parameter a DTensor for every op that reads it, and only the module's own forward turns its
    plain inputs into DTensors. The hint, or None."""
    message, went = failed.get("message", ""), failed.get("went", {})
    if "mixed torch.Tensor and DTensor" not in message or not (at := _AT.search(message)):
        return None
    line = linecache.getline(at.group(1), int(at.group(2))).split("#")[0].strip()  # (a comment's words aside)
    for style, torch_style in (("rowwise", "RowwiseParallel"), ("colwise", "ColwiseParallel")):
        for name in went.get(style, ()):
            if (read := re.search(rf"\b{re.escape(name.rpartition('.')[2])}\.(weight|bias)\b", line)) is not None:
                return (f"{at.group(1)}:{at.group(2)} reads {read.group(0)} itself (`{line}`), and the plan gave "
                        f"{name} {torch_style}, which made its {read.group(1)} a DTensor sharded over TP: an op "
                        "outside the module meets it with plain tensors (only the module's own forward turns its "
                        "inputs into DTensors). A weight the forward uses twice, as a head tied in the forward "
                        f"(`h @ wte.weight.T`), is not split by a style on one of its users: leave {name} out of the "
                        "plan, or give the head a module of its own tied to it (lm_head.weight = wte.weight) and "
                        "shard both ends with vemesh.parallel.parallelize_module (docs/checking.md: a tied "
                        "embedding)")
    return None


def output_length(ref: dict, module: str, dim: int) -> int | None:
    """One process's length along ``dim`` of ``module``'s first output (of DP rank 0), or None."""
    return next((t.shape[dim] for (n, _, _), t in (ref.get("outputs") or [{}])[0].items()
                 if n == module and t.dim() > dim), None)


def _repeated(tp: int, failed: list[dict], ref: dict) -> tuple[str, int, int] | None:
    """(module, dim, length) where a run's forward raised on a tensor TP times as long as another, the shorter as long
    as one process's output of the module that raised along the sequence's dim (``length``), and the longer not the
    size of a parameter of that module (a norm over a projection's whole width, split by TP: OLMo 2's ``q_norm`` of
    256 over a sequence of 128 at TP 2); else None."""
    if not failed or not (where := failed[0].get("module")):
        return None
    message = failed[0].get("message", "")
    if not (sizes := SIZES.search(message)):
        return None
    short, long = sorted(map(int, sizes.groups()))
    if any(g is not None and long in g.shape for n, g in ref.get("grads", {}).items() if n.rpartition(".")[0] == where):
        return None  # a parameter of its own is that long: a width of features (OLMo 2's q_norm), for the width hint
    dim = failed[0].get("went", {}).get("sequence_dim", [1])[0]
    return (where, dim, short) if long == short * tp and output_length(ref, where, dim) == short else None


def repeated_sequence_hint(tp: int, ref: dict, result: Any, failed: list[dict]) -> str | None:
    """Under TP, a module's output TP times one process's along one dim (``result.repeated``: a
    :class:`~vemesh.check.result.CheckResult`), or a forward that raised on a tensor TP times the one-process sequence:
    a plan that reads the whole sequence as this rank's part, so that every token is there TP times. The hint, or
    None."""
    if tp == 1:
        return None
    if result.repeated is not None:
        where, dim, length = result.repeated["module"], result.repeated["dim"], result.repeated["length"]
        said = (f"{where or 'the root'}'s output is {tp * length} long along dim {dim} where one process's is {length} "
                f"(TP {tp} times)")
        seen = ("; attention over every token repeated gives what it gives once, so outputs after it can match, and "
                f"each gradient counts every token {tp} times")
    elif (found := _repeated(tp, failed, ref)) is not None:
        where, dim, length = found
        said = (f"the forward of {where} met a tensor {tp * length} long where one process's sequence is {length} "
                f"(TP {tp} times)")
        seen = ""
    else:
        return None
    return (f"{said}: a module of the plan read the whole sequence as this TP rank's part (torch's SequenceParallel, "
            f"and a PrepareModuleInput or ColwiseParallel with a Shard({dim}) input layout, read a plain tensor so), "
            f"so each TP rank holds every token {tp} times{seen}. Hand the first sequence-parallel module its part: "
            f"output_layouts=Shard({dim}) on the RowwiseParallel before it (torchtitan's embedding), or, where no "
            "Linear or Embedding makes its input (a patch embedding, a sum of embeddings), "
            f"PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard({dim}),)) on the first "
            "block; or, for no sequence parallelism, no SequenceParallel and no Shard input layout")


def uneven_sequence_hint(tp: int, ref: dict, went: dict) -> str | None:
    """Where the plan shards the sequence over TP (a RowwiseParallel whose output is ``Shard(d)``: ``went``, a rank's
    record of where torch's styles went) and one process's sequence there does not divide by TP: torch reads each
    rank's plain part as an equal share (``SequenceParallel``, ``DTensor.from_local``), so the ranks' collectives
    disagree on their sizes (gloo aborts, nccl hangs). The hint, or None."""
    if tp == 1 or not went.get("sequence"):
        return None
    where, dim = went["sequence"][0], went.get("sequence_dim", [1])[0]
    if (length := output_length(ref, where, dim)) is None or length % tp == 0:
        return None
    return (f"the plan shards the sequence over TP ({where}'s RowwiseParallel gives each TP rank a part along dim "
            f"{dim}), and one process's sequence there is {length} long, which TP {tp} does not divide: torch's "
            "SequenceParallel and a Shard input layout take each rank's plain part as an equal share, so the ranks' "
            "collectives disagree on their sizes (gloo aborts, nccl hangs). Make the sequence a multiple of TP (pad "
            "it; a class token counts), or leave sequence parallelism out")

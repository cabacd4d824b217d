"""The recipe ``vemesh check`` tries where a forward changes a TP style's output in place.

torch's ``RowwiseParallel`` (and ``ColwiseParallel``) hands the next module its output as a plain tensor by
``DTensor.to_local()``, which returns a view made by a custom autograd Function; autograd refuses to let such a view
be changed in place ("Output 0 of _ToTorchTensor is a view and is being modified inplace"). A block that adds into its
MLP's output (HF's Falcon: ``mlp_output += attention_output``) raises under TP where one process runs. The fix in the
user's parallelize function: a forward hook on each such Linear that returns a copy of its output (one activation's
bytes per layer), ``linear.register_forward_hook(lambda module, args, out: out.clone())``.

Where a rank raised that error, the check runs again with that hook on each RowwiseParallel Linear inside the module
whose forward raised, and on its alike (the same names in the other layers), and says whether that made it exact.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vemesh.check.record import parts, plain_name
from vemesh.planning.known_causes import INPLACE_ON_TP_OUTPUT as REFUSAL

__all__ = ["candidate", "hint", "layer_pattern", "set_clones"]


def layer_pattern(name: str) -> str:
    """``name`` with each layer's index as ``*`` (``h.0.mlp.c_proj`` -> ``h.*.mlp.c_proj``)."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def candidate(message: str, first: str | None, went: dict) -> tuple[str, ...] | None:
    """The RowwiseParallel Linears inside module ``first`` (whose forward raised ``message``, autograd's refusal to
    change a ``to_local()`` view in place) and their alike; None where the error is another or there are none."""
    if first is None or REFUSAL not in message:
        return None
    inside = {layer_pattern(n) for n in went.get("rowwise", []) if not first or n.startswith(first + ".")}
    names = tuple(sorted(n for n in went.get("rowwise", []) if layer_pattern(n) in inside))
    return names or None


def set_clones(names: tuple[str, ...], model: nn.Module) -> None:
    """A forward hook on each of ``names`` in ``model`` that returns a copy of its tensor output."""
    for name, module in (nm for part, _ in parts(model) for nm in part.named_modules()):
        if plain_name(name) in names:
            module.register_forward_hook(lambda m, args, out: out.clone() if isinstance(out, torch.Tensor) else out)


def hint(names: tuple[str, ...], first: str, outcome: str) -> str:
    """The hint for the hook on ``names`` tried: ``outcome`` ``""`` where it made the check exact, else where the run
    still went wrong."""
    every = sorted({layer_pattern(n) for n in names})
    where = ", ".join(every) + (" (* every layer)" if any("*" in n for n in every) else "")
    head = (f"the forward of {first or 'the root'} changes in place a tensor that torch's TP styles hand on as a view "
            "(DTensor.to_local()), which autograd refuses. ")
    tried = (f"Tried: a forward hook returning a copy of the output of each RowwiseParallel Linear there, {where}: "
             "linear.register_forward_hook(lambda module, args, out: out.clone()), after your parallelize function")
    if not outcome:
        return head + tried + (", which makes the check exact: add it there (it costs one copy of that output per "
                               "layer) (docs/checking.md: a forward that changes a TP output in place)")
    return head + tried + f": the check then {outcome}, so that is not the only cause"

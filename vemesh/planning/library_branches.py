"""Where a library's code took another branch on the plan's fake tensors than a run takes on real ones.

A plan runs the user's model on fake tensors: shapes, no values. Hugging Face transformers asks, before it reads a
tensor's values, whether it is being traced (``transformers.utils.is_tracing``), and it counts a fake tensor as a trace
(``is_fake_tensor``). So under a plan its masks take the branch of ``torch.compile`` and ``torch.export``: where a run
reads the batch and finds one sequence a row and no padding, and leaves the mask to SDPA's ``is_causal``, the plan
builds the 4-D mask (``find_packed_sequence_indices`` when the model makes its own ``position_ids`` without a cache, as
with ``use_cache=False`` and under ``gradient_checkpointing_enable``; ``_ignore_causal_mask_sdpa`` with an attention
mask given). HF's Llama under its gradient checkpointing, batches of 4 x 128 tokens: the plan's peak 1.019 of the
run's (the mask, and the recompute's copies it makes); ``bench/hf_plan_survey.py``.

The plan cannot read values it does not have, and a batch that is padded or packed does make the mask, so the branch
stays the trace's: its peak differs from a run of unpadded batches by the mask and what the attention does with it
(HF's Llama above: over by 2%). :func:`tracing_branches` records where it was taken, and the plan says so
(:meth:`~vemesh.planning.results.Counted.branches_note`).

One case needs no values: a model called without ``position_ids`` and without ``attention_mask`` makes its own
positions, ``arange`` from 0 without a cache, and ``find_packed_sequence_indices`` finds no packed sequence in them in
any run. There (:func:`own_positions` watches the calls) the plan answers as the run does, and builds no mask.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["TrainingCache", "own_positions", "tracing_branches"]

#: for each transformers model whose forward is running (the innermost last): whether it was called without
#: ``position_ids`` and ``attention_mask``, so that it makes its own positions, one unpadded sequence a row
_MADE: list[bool] = []


@contextlib.contextmanager
def tracing_branches() -> Iterator[set[str]]:
    """While open, each function of transformers that asked whether one of the plan's fake tensors is traced is added
    to the set yielded (its name); nothing else changes. A no-op where transformers is not imported (the user's code
    imports it: a plan never does)."""
    found: set[str] = set()
    module = sys.modules.get("transformers.utils.import_utils")
    real = getattr(module, "is_fake_tensor", None)
    if real is None:
        yield found
        return

    def is_fake_tensor(x: Any) -> bool:
        fake = real(x)
        if fake:
            caller = sys._getframe(1)
            if caller.f_code.co_name == "is_tracing":  # the function that asked is_tracing
                caller = caller.f_back or caller
            found.add(caller.f_code.co_name)
        return fake

    masks = sys.modules.get("transformers.masking_utils")
    packed = getattr(masks, "find_packed_sequence_indices", None)

    def find_packed_sequence_indices(position_ids: Any) -> Any:
        if _MADE and _MADE[-1]:  # the model's own positions: arange from 0, never packed (no values needed)
            return None
        return packed(position_ids)

    module.is_fake_tensor = is_fake_tensor
    if packed is not None:
        masks.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield found
    finally:
        module.is_fake_tensor = real
        if packed is not None:
            masks.find_packed_sequence_indices = packed


class TrainingCache:
    """HF's KV cache, made by a training forward whose layers torch's activation checkpointing wraps
    (``checkpoint_wrapper``, as torchtitan and ``apply_activation_checkpointing`` wrap them).

    transformers' causal models default to ``use_cache=True`` in training too (only HF's own
    ``gradient_checkpointing_enable`` turns it off), and the cache copies every layer's keys and values. Without
    checkpointing autograd keeps those anyway, and the cache costs nothing more; under it, the cache holds what the
    checkpoint frees, and the recompute appends its own. The plan counts them as a run holds them (its peak is the
    run's), and says how much the cache held at the forward's end (:meth:`~vemesh.planning.results.Counted.cache_note`).
    """

    def __init__(self) -> None:
        self.bytes = 0  #: the most the cache held at the end of a forward (its keys' and values' storages), 0: none

    def see(self, output: Any) -> None:
        held = 0
        for layer in getattr(getattr(output, "past_key_values", None), "layers", None) or ():
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                t = getattr(t, "_local_tensor", t)  # a DTensor's local part holds its bytes
                if isinstance(t, torch.Tensor):
                    held += t.untyped_storage().nbytes()
        self.bytes = max(self.bytes, held)


@contextlib.contextmanager
def own_positions(parts: list[nn.Module]) -> Iterator[TrainingCache]:
    """While open, each transformers model in ``parts`` says, while its forward runs, whether it was called without
    ``position_ids`` and ``attention_mask`` (see the module docstring); :func:`tracing_branches` reads it. Yields the
    :class:`TrainingCache` that a training forward of a part checkpointed by torch's wrapper made."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    handles, cache = [], TrainingCache()
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    for part in parts if pretrained is not None else ():  # transformers not imported: none of its models here
        wrapped = any(isinstance(m, CheckpointWrapper) for m in part.modules())
        for module in part.modules():
            if isinstance(module, pretrained):  # a model (its base or its head), not one of its layers
                handles += [module.register_forward_pre_hook(_called, with_kwargs=True),
                            module.register_forward_hook(functools.partial(_returned, cache if wrapped else None),
                                                         always_call=True)]
    try:
        yield cache
    finally:
        for handle in handles:
            handle.remove()


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    """A model class's ``forward`` signature, looked up once (the hook below runs at each call of a trace)."""
    return inspect.signature(cls.forward)


def _called(module: nn.Module, args: tuple, kwargs: dict) -> None:
    try:
        given = _signature(type(module)).bind_partial(module, *args, **kwargs).arguments
    except TypeError:
        given = {"position_ids": True}  # not bound as HF's models are: as given
    _MADE.append(given.get("position_ids") is None and given.get("attention_mask") is None)


def _returned(cache: TrainingCache | None, module: nn.Module, args: tuple, output: Any) -> None:
    if _MADE:
        _MADE.pop()
    if cache is not None and module.training:
        cache.see(output)

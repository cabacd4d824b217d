"""A pipeline stage of a Hugging Face causal LM, run by the model's own forward, and checked against the whole model.

torch's ``PipelineStage`` runs a module that takes and returns tensors; a Hugging Face ``*ForCausalLM`` takes token
ids and returns a ``ModelOutput``. :class:`DecoderStage` is stage ``stage`` of ``n_stages`` of such a model:

* it holds the model's own modules under their own names (layer 3 is ``model.layers.3`` on whichever stage holds
  it, so a checkpoint of the whole model loads into any cut): the embedding on the first stage, its share of the
  decoder layers (as even as possible, earlier stages taking the remainder), the final norm and the head on the
  last;
* its forward is the model's own base-model forward (``LlamaModel.forward``, ``Qwen2Model.forward``, ...) over the
  stage's layers, given token ids on the first stage and hidden states (``inputs_embeds``) on the others, so the
  model's own causal mask, sliding windows and rotary positions are made as the whole model makes them (its
  config's ``layer_types``, which that forward reads by a layer's place in its loop, are the stage's layers'); the
  last stage adds the head;
* it is checked as it is built: every stage of the cut, built alike, chained on a short random sequence, must give
  the whole model's logits. A model whose forward does more than its layers, norm and head (Gemma scales the
  embeddings inside the base model's forward, and Gemma 2 caps the logits in the head's) fails the check with its
  difference, instead of training another model;
* a head tied to the embedding (``tie_word_embeddings``) is refused: on the first and last stages each end would
  get its own part of the one parameter's gradient, and they would train apart.

Nothing of the model passed in is changed: the stage is a shallow copy of the model's modules (they share
parameters). Drop the whole model after building the stage, and only the stage's parameters stay.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vemesh.parallel.context.api import current_positions
from vemesh.parallel.schedules import split_layers

__all__ = ["DecoderStage"]


#: depth of :func:`unchecked`
_UNCHECKED = [0]


@contextlib.contextmanager
def unchecked(on: bool = True) -> Iterator[None]:
    """While active (where ``on``), :class:`DecoderStage` does not check its cut against the whole model: for
    ``vemesh check``, whose recipes may shard a model's per-head parameters over TP before the user's function cuts
    it, and which compares the whole run with one process itself."""
    _UNCHECKED[0] += on
    try:
        yield
    finally:
        _UNCHECKED[0] -= on


class _Layers(nn.ModuleList):
    """Decoder layers under their indices in the whole model (``"3"`` for layer 3); a slice, as the base model's
    forward takes it (``self.layers[: n]``), is a plain list of them in order."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        nn.Module.__init__(self)
        self._modules.update(layers)

    def __getitem__(self, index: Any) -> Any:
        return list(self._modules.values())[index]


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` that shares its parameters, buffers and submodules, whose own slots can be replaced."""
    out = copy.copy(module)
    for slot in ("_modules", "_parameters", "_buffers"):
        out.__dict__[slot] = dict(module.__dict__[slot])
    return out


def _parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    missing = [name for name, found in (("model", base), ("lm_head", head),
                                        ("model.layers", getattr(base, "layers", None)),
                                        ("model.embed_tokens", getattr(base, "embed_tokens", None)),
                                        ("model.norm", getattr(base, "norm", None))) if found is None]
    if missing:
        raise TypeError(f"DecoderStage takes a Hugging Face causal LM (model.layers, model.embed_tokens, model.norm, "
                        f"lm_head, as LlamaForCausalLM has them); {type(model).__name__} has no {', '.join(missing)}")
    return base, base.layers, head


class DecoderStage(nn.Module):
    """Stage ``stage`` of ``n_stages`` of the Hugging Face causal LM ``model`` (see the module docstring).

    Args:
        model: a ``*ForCausalLM`` with ``model.layers``, ``model.embed_tokens``, ``model.norm`` and ``lm_head``.
        stage: this stage's index, ``0 <= stage < n_stages``.
        n_stages: the stages of the cut (PP, or PP times the stages a rank holds under an interleaved schedule).
        check: chain every stage of the cut on a short random sequence and compare with the whole model first
            (two forwards of the model, in eval mode, without gradients); False skips it. Cut the model before
            parallelizing it (TP, FSDP2): the check runs the model whole on this rank (where a model parallelized
            in part fails it, the error says so). Under ``vemesh plan``'s
            trace (fake tensors: shapes, no values) there is nothing to compare, and it is not run.

    Raises:
        TypeError: a model without those modules.
        ValueError: a stage outside the cut, more stages than layers, a head tied to the embedding, or stages that
            chained are not the whole model (the check), with their difference.
    """

    def __init__(self, model: nn.Module, stage: int, n_stages: int, *, check: bool = True) -> None:
        super().__init__()
        base, layers, head = _parts(model)
        if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
            raise ValueError(f"n_stages must be a positive integer; got {n_stages!r}")
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < n_stages:
            raise ValueError(f"stage must be one of 0..{n_stages - 1}; got {stage!r}")
        cut = split_layers(len(layers), n_stages)
        if n_stages > 1 and head.weight is base.embed_tokens.weight:
            raise ValueError(f"{type(model).__name__}'s head is its embedding (tie_word_embeddings=True): on the first "
                             "and last stages each end would get its own part of the one parameter's gradient, and "
                             "they would train apart; untie them (tie_word_embeddings=False) to pipeline it")
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.model = _shallow(base)
        self.model.layers = _Layers({str(i): layers[i] for i in cut[stage]})
        # the base model's forward reads each layer's kind by its place in the loop (config.layer_types[i]: full or
        # sliding-window attention in Qwen2, Gemma 2, ...): the stage's config lists its own layers'
        config = self.model.config = copy.copy(base.config)
        config.num_hidden_layers = len(cut[stage])
        if isinstance(getattr(base.config, "layer_types", None), (list, tuple)):
            config.layer_types = [base.config.layer_types[i] for i in cut[stage]]
        if not self.first:
            self.model.embed_tokens = None  # the stage is given hidden states (inputs_embeds)
        if not self.last:
            self.model.norm = nn.Identity()
        self.lm_head = head if self.last else None
        if check and n_stages > 1 and not _UNCHECKED[0]:
            _check_cut(model, n_stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``(batch, seq)`` on the first stage, hidden states ``(batch, seq, hidden)`` on the others; the
        logits on the last stage, the hidden states on the others. Positions count from 0, or inside
        ``context_parallel`` are those of this CP rank's share of the sequence."""
        within = current_positions(x.size(1), x.device)  # inside context_parallel: this CP rank's share's
        # else the model's own, from 0 (one sequence a row, which a plan can tell without reading them)
        positions = None if within is None else within.unsqueeze(0)
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if within is not None:  # a share's positions jump (load balancing: 0-3 and 12-15), which HF takes for packed
            # sequences, each masked off from the others: a mask of no padding says there is one sequence
            given["attention_mask"] = torch.ones(x.shape[:2], dtype=torch.long, device=x.device)
        h = self.model(**given, position_ids=positions, use_cache=False).last_hidden_state
        return self.lm_head(h) if self.lm_head is not None else h


def _check_cut(model: nn.Module, n_stages: int) -> None:
    """``ValueError`` unless the ``n_stages`` stages of ``model`` chained give its logits, on a short random sequence."""
    base = model.model
    from torch._guards import detect_fake_mode

    if detect_fake_mode(list(model.parameters())) is not None:  # vemesh plan's trace: no values, only shapes
        return
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} is on the meta device, so its cut cannot be checked against it: build "
                         "the stages after loading its weights, or pass check=False once a small model of the same "
                         "class (its config with fewer layers and a smaller width) has passed the check")
    vocab = base.embed_tokens.num_embeddings
    length = min(16, getattr(model.config, "max_position_embeddings", 16) or 16)
    device = base.embed_tokens.weight.device
    tokens = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            whole = model(input_ids=tokens, use_cache=False).logits
            h = tokens
            for s in range(n_stages):
                h = DecoderStage(model, s, n_stages, check=False)(h)
    except Exception as e:
        from torch.distributed.tensor import DTensor

        sharded = next(((n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
        if sharded is None:
            raise
        # a model parallelized whole runs whole (its collectives on every rank); one parallelized in part does not
        raise ValueError(f"{type(model).__name__} was parallelized before the cut ({sharded[0]} is a DTensor "
                         f"{tuple(sharded[1].placements)} on {sharded[1].device_mesh.mesh_dim_names}), and the check "
                         f"of the cut, which runs the model whole, raised: {type(e).__name__}: {e}. Cut it first "
                         "(DecoderStage), then apply your TP plan and FSDP2 to the stage; or pass check=False") from e
    finally:
        for m, training in modes:
            m.training = training
    scale = whole.float().abs().max().clamp_min(1e-6)
    off = ((h.float() - whole.float()).abs().max() / scale).item()
    # the same ops on the same values in the same order: equal to the bit on a CPU (a capped head in bf16, Gemma 2's
    # on a random init, is 3e-3 off)
    tolerance = 1e-6 if whole.dtype == torch.float32 else 1e-3
    if h.shape != whole.shape or off > tolerance:
        raise ValueError(
            f"the {n_stages} stages of {type(model).__name__} chained are not the whole model: their logits are "
            f"{off:.2g} off its (relative; {tolerance:g} allowed) on a random sequence of {length} tokens. Its forward "
            "does more than its base model's layers, norm and head (Gemma scales the embeddings, Gemma 2 caps the "
            "logits): write a stage module of its own forward"
        )

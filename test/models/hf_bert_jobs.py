"""HF transformers' ``BertForMaskedLM`` as shipped, for ``vemesh check``: an encoder whose masked-LM head is tied twice,
its decoder's weight to the word embedding (``tie_word_embeddings``) and its decoder's bias to ``cls.predictions.bias``
(the same parameter, held again by the head above the Linear). The vocabulary-parallel pair (the embedding
``RowwiseParallel``, the decoder ``ColwiseParallel``) under ``vemesh.parallel.parallelize_module`` keeps both ties:
the bias's other end is re-tied to the sharded bias (before, it raised: an end left whole). And a step that draws its
batch from a generator of its own, which gives every DP rank the same batch: the check says DP was not checked;
one that picks its rows by its DP rank: the check says the runs had other inputs. Under
CP, BERT's attention is not causal (an encoder's), which the ring computes too; its masked-LM loss (``labels=``) is
each CP rank's mean over its own tokens, which the check compares as their mean over CP, and names as the cause
where the ranks count different numbers of tokens. HF's RoBERTa numbers its positions from its padding index + 1
(2), which a step under CP must give it cut with the tokens: the check's hint says from where."""

from __future__ import annotations

import torch
import transformers as hf
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from vemesh import VESCALE_DEVICE_MESH
from vemesh.ddp import DistributedDataParallel
from vemesh.parallel import context_parallel, parallelize_module

VOCAB, SEQ = 128, 16


def make() -> nn.Module:
    """2 layers of width 64, 4 heads, a vocabulary of 128, no dropout."""
    return hf.BertForMaskedLM(hf.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _masked(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, ::2] = -100  # every other token predicted
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss


def _masked_cp(model: nn.Module, batch_size: int, ignored: slice) -> torch.Tensor:
    """The tokens, labels and positions cut by ``context_parallel``; the tokens at ``ignored`` not predicted."""
    ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    labels, positions = ids.clone(), torch.arange(SEQ).expand(batch_size, SEQ).contiguous()
    labels[:, ignored] = -100
    with context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1]):
        loss = model(input_ids=ids, labels=labels, position_ids=positions).loss
        loss.backward()
    return loss.detach()


def step_cp(model: nn.Module, batch_size: int) -> torch.Tensor:
    """Every other token predicted: as many on each CP rank."""
    return _masked_cp(model, batch_size, slice(None, None, 2))


def step_cp_uneven(model: nn.Module, batch_size: int) -> torch.Tensor:
    """The first 4 tokens not predicted: CP rank 0 of 2 (tokens 0 to 3 and 12 to 15) counts 4, CP rank 1 counts 8."""
    return _masked_cp(model, batch_size, slice(None, 4))


def step(model: nn.Module, batch_size: int) -> torch.Tensor:
    """A batch from torch's RNG, which the check seeds with each DP rank's seed."""
    return _masked(model, torch.randint(0, VOCAB, (batch_size, SEQ)))


def step_own_generator(model: nn.Module, batch_size: int) -> torch.Tensor:
    """The same batch on every rank: a generator of the step's own, seeded alike everywhere."""
    return _masked(model, torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(1)))


def step_by_rank(model: nn.Module, batch_size: int) -> torch.Tensor:
    """DP rank ``d``'s rows of fixed data, chosen by the mesh's DP rank (as a ``DistributedSampler`` chooses): one
    process, where every DP rank is 0, runs rank 0's rows for each."""
    d = VESCALE_DEVICE_MESH.get_local_rank("DP")
    pool = torch.randint(0, VOCAB, (8 * batch_size, SEQ), generator=torch.Generator().manual_seed(2))
    return _masked(model, pool[d * batch_size:(d + 1) * batch_size])


def parallelize(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    """Each layer's attention and MLP as torch's styles split them, and the tied embedding and decoder
    vocabulary-parallel, through vemesh's ``parallelize_module`` (which keeps both ties)."""
    tp = mesh["TP"]
    for layer in model.bert.encoder.layer:
        parallelize_module(layer, tp, {"attention.self.query": ColwiseParallel(),
                                       "attention.self.key": ColwiseParallel(),
                                       "attention.self.value": ColwiseParallel(),
                                       "attention.output.dense": RowwiseParallel(),
                                       "intermediate.dense": ColwiseParallel(), "output.dense": RowwiseParallel()})
    parallelize_module(model, tp, {"bert.embeddings.word_embeddings": RowwiseParallel(input_layouts=Replicate()),
                                   "cls.predictions.decoder": ColwiseParallel(output_layouts=Replicate())})
    return model


def parallelize_ddp(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    """:func:`parallelize`, then vemesh DDP over DP."""
    return DistributedDataParallel(parallelize(model, mesh))


def parallelize_dp(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    """vemesh DDP alone (over DP x CP under CP)."""
    return DistributedDataParallel(model)


def make_roberta() -> nn.Module:
    """BERT's shapes as RoBERTa: its positions numbered from ``pad_token_id + 1`` (2) by the model itself."""
    return hf.RobertaForMaskedLM(hf.RobertaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=SEQ + 2, pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _roberta_cp(model: nn.Module, batch_size: int, start: int | None) -> torch.Tensor:
    """No pad token drawn; the positions, numbered from ``start``, cut with the tokens (None: the model numbers
    this rank's part itself)."""
    ids = torch.randint(3, VOCAB, (batch_size, SEQ))
    labels = ids.clone()
    labels[:, ::2] = -100
    given = {} if start is None else {"position_ids": torch.arange(start, SEQ + start).expand(batch_size, SEQ).clone()}
    with context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=[ids, labels, *given.values()],
                          buffer_seq_dims=[1] * (2 + len(given))):
        loss = model(input_ids=ids, labels=labels, **given).loss
        loss.backward()
    return loss.detach()


def step_roberta_cp_unnumbered(model: nn.Module, batch_size: int) -> torch.Tensor:
    return _roberta_cp(model, batch_size, None)


def step_roberta_cp(model: nn.Module, batch_size: int) -> torch.Tensor:
    """The positions as RoBERTa numbers them in one process, from 2."""
    return _roberta_cp(model, batch_size, 2)

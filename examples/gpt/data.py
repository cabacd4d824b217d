"""Byte-level text data for the GPT example: nothing is downloaded.

The default corpus is the Python standard library's own ``.py`` sources, which
every Python install has on disk, read in sorted path order up to a size cap so
that every rank (and every run) sees the same bytes. ``--data PATH`` takes any
text file instead. Tokens are bytes (vocab 256); the last ``val_fraction`` of
the bytes is held out for evaluation.

Batches are drawn from a generator seeded by ``(seed, step)`` only, so every
rank draws the same *global* batch and keeps its own DP slice:

    global batch of 8 on DP=2:  DP rank 0 gets rows 0..3, DP rank 1 rows 4..7;
    the TP ranks inside a DP group get identical rows.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from config import ConfigError

VOCAB_SIZE = 256


def stdlib_corpus(max_bytes: int) -> bytes:
    """The standard library's top-level ``.py`` files, sorted by name, concatenated up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if not corpus:
        raise FileNotFoundError(f"no .py files found under the standard library at {root}")
    return corpus


class ByteDataset:
    """A corpus of bytes split into ``train`` and ``val`` token tensors (uint8 -> int64 on demand)."""

    def __init__(self, data_path: str | None, *, max_bytes: int, val_fraction: float):
        if data_path is None:
            raw = stdlib_corpus(max_bytes)
            self.source = f"Python standard library sources ({sysconfig.get_paths()['stdlib']}/*.py)"
        else:
            raw = Path(data_path).read_bytes()[:max_bytes]
            self.source = data_path
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n_val = max(1, int(len(tokens) * val_fraction))
        self.train, self.val = tokens[:-n_val], tokens[-n_val:]

    def check(self, seq_len: int) -> None:
        """Raise ``ConfigError`` unless both splits hold more than one sequence of ``seq_len + 1`` bytes."""
        for split, data in (("train", self.train), ("held-out", self.val)):
            if len(data) <= seq_len + 1:
                raise ConfigError(
                    f"--data: the {split} split of {self.source} has {len(data)} bytes; it needs more than "
                    f"--seq-len + 1 = {seq_len + 1} (use a longer text, a shorter --seq-len or another --val-fraction)"
                )

    def __len__(self) -> int:
        return len(self.train) + len(self.val)

    def get_batch(
        self,
        split: str,
        *,
        step: int,
        seed: int,
        global_batch_size: int,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's slice of global batch number ``step``: ``(x, y)``, each (B_local, seq_len).

        The global batch depends only on ``(split, seed, step)``; DP rank r of
        ``dp_size`` gets rows ``[r * B_local, (r + 1) * B_local)``.
        """
        data = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(hash_seed(seed, step, split))
        starts = torch.randint(len(data) - seq_len - 1, (global_batch_size,), generator=g)
        local = global_batch_size // dp_size
        starts = starts[dp_rank * local : (dp_rank + 1) * local]
        x = torch.stack([data[s : s + seq_len] for s in starts.tolist()]).long()
        y = torch.stack([data[s + 1 : s + 1 + seq_len] for s in starts.tolist()]).long()
        return x, y


def hash_seed(seed: int, step: int, split: str) -> int:
    """A per-(seed, step, split) seed that does not depend on the rank."""
    return (seed * 1_000_003 + step * 2 + (split != "train")) % (2**63)


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor | list[int]) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")

"""Llama 3's shapes and the preset's options, in pure Python (a plan request checks them without torch)."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["AC_MODES", "SIZES", "Llama3Config", "check_ac", "config_of", "linear_share"]

#: ``--activation-checkpointing``: the modes, ``selective-N`` standing for every N-th block.
AC_MODES = ("none", "full", "selective-op", "selective-N")


@dataclass(frozen=True)
class Llama3Config:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    hidden_dim: int = 14336  # SwiGLU's inner width
    vocab_size: int = 128256
    seq_len: int = 8192  # the training sequence (torchtitan's default for Llama 3.1)
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


#: Llama 3.1's published shapes (Meta's model cards, torchtitan's ``llama3_configs``).
SIZES = {
    "8b": Llama3Config(),
    "70b": Llama3Config(dim=8192, n_layers=80, n_heads=64, hidden_dim=28672),
    "405b": Llama3Config(dim=16384, n_layers=126, n_heads=128, hidden_dim=53248),
}


def config_of(spec: str) -> Llama3Config:
    """``llama3:SIZE[,seq_len=N]`` -> its config; ``ValueError`` names a bad size or key in one line."""
    body = spec.split(":", 1)[1] if spec.startswith("llama3:") else spec
    size, *rest = [p.strip() for p in body.split(",") if p.strip()] or [""]
    size = size.lower() if size.lower() in SIZES else size  # torchtitan's flavors say "8B"
    if size not in SIZES:
        raise ValueError(f"--model llama3:{size}: unknown size {size!r}; choose one of {', '.join(SIZES)} "
                         "(llama3:8b[,seq_len=N])")
    config = SIZES[size]
    for item in rest:
        key, _, value = item.partition("=")
        if key != "seq_len":
            raise ValueError(f"--model {spec}: unknown key {key!r}; the Llama 3 preset takes seq_len=N")
        try:
            seq = int(value)
        except ValueError:
            seq = 0
        if seq < 1:
            raise ValueError(f"--model {spec}: seq_len={value!r} must be a positive integer")
        config = replace(config, seq_len=seq)
    return config




def check_ac(mode: str | bool | None) -> str:
    """The mode of ``--activation-checkpointing`` (``True``, the bare flag: ``full``; ``False``/None: ``none``);
    ``ValueError`` names a bad one and the choices."""
    if mode is True:
        return "full"
    if mode in (False, None):
        return "none"
    if mode in ("none", "full", "selective-op"):
        return str(mode)
    if isinstance(mode, str) and mode.startswith("selective-"):
        tail = mode[len("selective-"):]
        if tail.isdigit() and int(tail) >= 1:
            return mode
        raise ValueError(f"--activation-checkpointing {mode}: N of selective-N must be a whole number of blocks, 1 or "
                         f"more (every N-th block recomputed); choose one of {', '.join(AC_MODES)}")
    raise ValueError(f"--activation-checkpointing {mode!r}: choose one of {', '.join(AC_MODES)}")


def linear_share(cfg: Llama3Config) -> float:
    """The share of the parameters in the blocks' Linear weights (the head and the embedding left out): what Float8
    gathers in 1 byte under FSDP2 (``--float8-all-gather``)."""
    head = cfg.dim // cfg.n_heads
    block = cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * head + cfg.n_heads * head * cfg.dim + 3 * cfg.dim * cfg.hidden_dim
    total = cfg.n_layers * (block + 2 * cfg.dim) + 2 * cfg.vocab_size * cfg.dim + cfg.dim
    return cfg.n_layers * block / total

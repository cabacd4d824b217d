"""Llama 3 (8B, 70B, 405B at Llama 3.1's published shapes): the model (:mod:`~vemesh.models.llama3.model`),
torchtitan's parallelization (:mod:`~vemesh.models.llama3.parallelize`), and the functions
``vemesh plan --model llama3:SIZE[,seq_len=N]`` traces (:mod:`~vemesh.models.llama3.planned`). The shapes and the
preset's options (:mod:`~vemesh.models.llama3.config`) import no torch."""

from vemesh.models.llama3.config import AC_MODES, SIZES, Llama3Config, check_ac, config_of

__all__ = ["AC_MODES", "SIZES", "Llama3Config", "check_ac", "config_of"]

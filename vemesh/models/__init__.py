"""Models that ship with vemesh, as torchtitan ships its own: presets for the planner and the GPT example.

* :mod:`~vemesh.models.gpt`: a small GPT-2 style decoder (nanoGPT's shape), its ``parallelize`` function and its
  pipeline stages; ``vemesh plan --model gpt:...`` and the GPT example of the repository use it;
* :mod:`~vemesh.models.llama3`: Llama 3 at Llama 3.1's shapes with torchtitan's parallelization (TP with sequence
  parallelism, activation checkpointing modes, FSDP2, CP, pipeline stages); ``vemesh plan --model llama3:8b`` uses it.
"""

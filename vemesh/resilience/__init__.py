"""Surviving failures: checkpoints that load on any mesh, and live replicas through torchft.

* :mod:`~vemesh.resilience.checkpoint` (also ``vemesh.checkpoint``): DCP checkpoints with integrity checks;
* :mod:`~vemesh.resilience.replicas` (also ``vemesh.ft``): torchft's replicas as a mesh dim;
* :mod:`~vemesh.resilience.join`: before a replica joins, whether it may.
"""

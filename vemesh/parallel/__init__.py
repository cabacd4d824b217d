"""Every parallelism, as library functions and torch styles that apply to any model.

* :mod:`~vemesh.parallel.ddp` (also ``vemesh.ddp``): data parallelism, torch DDP's contract on a mesh dim;
* :mod:`~vemesh.parallel.optim` (also ``vemesh.optim``): the ZeRO-1 optimizer and clipping across meshes;
* :mod:`~vemesh.parallel.context`: context parallelism, ring attention over the CP group.
"""

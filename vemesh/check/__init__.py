"""``vemesh check``: compare a parallelized model with one process, module by module (see :mod:`vemesh.check.api`).

>>> from vemesh.check import check
>>> result = check("module:mymodel:make", "mymodel:parallelize", "mymodel:step", world_size=4, tp=2)  # doctest: +SKIP
>>> print(result.render())                                                                             # doctest: +SKIP
"""

from vemesh.check.api import CheckInputError, CheckResult, check

__all__ = ["CheckInputError", "CheckResult", "check"]

"""ZeRO-1 optimizer sharding over the data-parallel group, and gradient clipping across meshes.

* :class:`DistributedOptimizer`: a ``torch.optim.Optimizer`` whose state is sharded over DP.
* :func:`clip_grad_norm_` / :func:`total_norm`: torch's clipping for models that mix DTensor and
  plain parameters or span pipeline stages.
* :class:`GradScaler`: torch's loss scaler for models that mix DTensor and plain parameters.
* :func:`get_optimizer_state` / :func:`set_optimizer_state`: any optimizer's state by parameter name.
"""

from vemesh.parallel.optim.clip_grad import clip_grad_norm_, total_norm
from vemesh.parallel.optim.distributed_optimizer import DistributedOptimizer
from vemesh.parallel.optim.grad_scaler import GradScaler
from vemesh.parallel.optim.state import get_optimizer_state, set_optimizer_state

__all__ = ["DistributedOptimizer", "GradScaler", "clip_grad_norm_", "total_norm", "get_optimizer_state",
           "set_optimizer_state"]

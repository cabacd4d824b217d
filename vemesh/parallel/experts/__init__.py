"""Expert parallelism: :class:`ExpertParallel`, a torch ``ParallelStyle`` for any grouped-experts module,
:class:`ExpertTensorParallel` (each expert also split over TP), and the token exchange they run over the EP group."""

from vemesh.parallel.experts.exchange import combine, dispatch, source_to_expert_order
from vemesh.parallel.experts.style import (EXPERT, TITAN_TP_DIMS, ExpertParallel, ExpertTensorParallel, expert_modules,
                                           is_expert)

__all__ = ["EXPERT", "ExpertParallel", "ExpertTensorParallel", "TITAN_TP_DIMS", "combine", "dispatch", "expert_modules",
           "is_expert", "source_to_expert_order"]

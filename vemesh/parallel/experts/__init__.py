"""Expert parallelism: :class:`ExpertParallel`, a torch ``ParallelStyle`` for any grouped-experts module, and the
token exchange it runs over the EP group."""

from vemesh.parallel.experts.exchange import combine, dispatch, source_to_expert_order
from vemesh.parallel.experts.style import EXPERT, ExpertParallel, expert_modules, is_expert

__all__ = ["EXPERT", "ExpertParallel", "combine", "dispatch", "expert_modules", "is_expert", "source_to_expert_order"]

"""Placement: which mesh dims stay inside a host, chosen from what each dim's collectives cost.

The order of the dims in ``init_device_mesh`` decides which groups lie inside one host: the innermost dims'
ranks are consecutive, so they share a host as far as the host's devices go, and the outer dims' groups
cross hosts. What a rank sends per step along each dim does not depend on the order (the groups have the same
sizes), so one traced plan serves every order: for each order of the mesh dims the placement finds the dims
whose groups span hosts (:func:`vemesh.layout.describe.spans_hosts`, the rule the layout warnings and the step
time use), the bytes a rank sends per step along them, and, with a device profile, the step time with those
dims on the network link. The best order has the shortest predicted step (with a profile), then the fewest
bytes across hosts, then the default order ``PP, DP, CP, TP`` (torchtitan's
``[pp, dp_replicate, dp_shard, cp, tp]``) when it ties. An order on which a derived dim cannot be made is not
a candidate: EP splits the flattened ``DP x CP``, which needs DP and CP next to each other.

Every view, flatten and split the order makes keeps it: :class:`~vemesh.layout.parallel_dims.ParallelDims`
lists a flatten's dims in the mesh's order (as torch's ``_flatten`` needs), so the groups a run builds are the
planned ones (``test/planning/test_placement.py`` checks every rank of 1024 on the fake backend).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from vemesh.layout.describe import spans_hosts
from vemesh.layout.parallel_dims import DEGREES
from vemesh.planning.mesh_plan import MeshPlan, plan_mesh
from vemesh.planning.step_time import StepTime

__all__ = ["Placement", "crossing", "place", "render"]


@dataclass(frozen=True)
class Placement:
    """One order of the mesh dims: which used dims cross hosts, their bytes, and the step time on a profile."""

    mesh: MeshPlan
    crossing: tuple[str, ...]  #: the dims the step uses whose groups span hosts
    cross_bytes: int  #: bytes a rank sends per step along them (the worst rank class's)
    times: tuple[StepTime, ...] = ()  #: with a device profile

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(self.mesh.base.dim_names)

    @property
    def step_time(self) -> float | None:
        return max(t.total for t in self.times) if self.times else None

    @property
    def exposed(self) -> float | None:
        """The slowest class's exposed communication, seconds (with a profile)."""
        return max(self.times, key=lambda t: t.total).exposed if self.times else None

    def document(self) -> dict[str, Any]:
        return {"order": list(self.order), "init_device_mesh": self.mesh.init_call(), "flatten": self.mesh.flatten_calls(),
                "crossing_hosts": list(self.crossing), "cross_host_bytes_per_step": self.cross_bytes,
                "step_time": self.step_time, "exposed_communication": self.exposed}


def crossing(layout: Any, fit: Any, devices_per_host: int) -> tuple[tuple[str, ...], int]:
    """The dims ``fit``'s step uses whose groups span hosts on ``layout``, and the worst class's bytes along them."""
    used = sorted({d for c in fit.classes for d in c.sent if d != "other" and layout.has(d)})
    slow = tuple(d for d in used if spans_hosts(layout, d, devices_per_host))
    return slow, max((sum(b for d, b in c.sent.items() if d in slow) for c in fit.classes), default=0)


def place(fit: Any, mesh: MeshPlan, devices_per_host: int, timed: Any = None) -> tuple[Placement, dict[str, Placement]]:
    """The best order of ``mesh``'s dims for ``fit``'s step on hosts of ``devices_per_host`` ranks, and the
    baselines: ``{"torchtitan": the default order, "reverse": the best order reversed}``.

    ``timed(fit, mesh) -> list[StepTime]`` times a placed mesh (a device profile); without it the bytes decide.
    """
    def of(order: tuple[str, ...]) -> Placement:
        placed = plan_mesh(mesh.world_size, pp=mesh.degrees["PP"], dp=mesh.degrees["DP"], cp=mesh.degrees["CP"],
                           tp=mesh.degrees["TP"], ep=mesh.ep, dp_replicate=mesh.dims.dp_replicate if mesh.dims else 1,
                           devices_per_host=devices_per_host, device_type=mesh.device_type, order=order)
        slow, nbytes = crossing(placed.layout, fit, devices_per_host)
        # the layout's rules of thumb (TP innermost, TP and CP inside a host) give way to what the step costs
        placed = replace(placed, warnings=[w for w in placed.warnings if w.kind == "partial_host"], filled=mesh.filled)
        return Placement(placed, slow, nbytes, tuple(timed(fit, placed)) if timed is not None else ())

    default = tuple(mesh.dims.mesh_dims) if mesh.dims else tuple(mesh.base.dim_names)
    default = tuple(sorted(default, key=DEGREES.index))
    every = []
    for order in itertools.permutations(default):
        try:
            every.append(of(order))
        except ValueError:  # a derived dim this order cannot make (EP's split of DP x CP with TP between them)
            continue
    best = min(every, key=lambda p: (p.step_time or 0.0, p.cross_bytes, p.order != default, p.order))
    titan = next(p for p in every if p.order == default)
    reverse = next(p for p in every if p.order == tuple(reversed(best.order)))
    return best, {"torchtitan": titan, "reverse": reverse}


def render(best: Placement, baselines: dict[str, Placement], devices_per_host: int) -> str:
    """The chosen order beside the baselines: the dims between hosts, their bytes, and the time with a profile."""
    timed = best.step_time is not None
    lines = [f"placement on hosts of {devices_per_host} devices (mesh dims outermost first; the innermost share a host):",
             f"  {'':12}{'order':24}{'between hosts':>16}  " + ("  step time  exposed comm  " if timed else "")
             + "dims between hosts"]
    for label, p in (("chosen", best), *baselines.items()):
        when = f"{p.step_time * 1e3:9.3f}ms {p.exposed * 1e3:11.3f}ms  " if timed else ""  # type: ignore[operator]
        lines.append(f"  {label:12}{', '.join(p.order):24}{p.cross_bytes / 2**20:12.2f}MiB  {when}"
                     f"{', '.join(p.crossing) or '-'}")
    return "\n".join(lines)

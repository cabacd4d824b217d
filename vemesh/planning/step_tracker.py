"""torch's ``MemTracker`` as the planner and :class:`~vemesh.planning.measure.RunMeter` use it: over a whole run
or one traced step, with each part of a step's own peak (:class:`StepTracker`), and without module hooks where they
cannot run (:class:`NoModules`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

__all__ = ["NoModules", "StepTracker", "answer_device", "device_query"]


def device_query(func: Any, args: tuple) -> bool:
    """A fake tensor asked its device (``prim.device``), which its own class answers in Python. Autograd's engine and
    FakeTensor's cache misses ask it from C++: 61% of what a traced pipeline dispatches, each through every mode down
    to FakeTensorMode. A planner's mode answers it where it arrives (:func:`answer_device`)."""
    return func is _DEVICE and len(args) == 1 and isinstance(args[0], FakeTensor)


def answer_device(t: FakeTensor) -> torch.device:
    """FakeTensor's answer to its device query (``t.device``), and what the query did on its way down the modes:
    each open :class:`StepTracker` samples the bytes held (:meth:`StepTracker.sample`), as ``MemTracker`` samples
    them at every op it sees (a storage FSDP2 resizes grows between ops)."""
    for tracker in _OPEN:
        tracker.sample()
    return t.device


_DEVICE = torch.ops.prim.device.default
#: the trackers open now, innermost last (:func:`answer_device`)
_OPEN: list[StepTracker] = []


class NoModules:
    """Stands in for MemTracker's ModTracker when module hooks must stay off: a pipeline stage's backward
    metadata inference runs ``autograd.grad`` on leaf inputs, which ModTracker's multi-grad hooks refuse."""

    is_bw = False
    parents = {"Global"}

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> NoModules:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class StepTracker(MemTracker):
    """torch's MemTracker, over a whole run or one traced step.

    * A root module called again (the next step, a micro-batch, an eval) starts a new iteration of
      its per-module statistics instead of raising; the peak is kept.
    * :attr:`peak_besides_weights`: the highest bytes held besides parameters and gradients.
    * :attr:`step_peak`: the highest bytes held while :attr:`in_step` (the training steps of a run).
    * ``module_hooks=False`` tracks storages only (every category is then "Activation"; the totals
      are the same).
    """

    def __init__(self, module_hooks: bool = True) -> None:
        super().__init__()
        if not module_hooks:
            self._mod_tracker = NoModules()  # type: ignore[assignment]
        self.peak_besides_weights = 0
        self.step_peak = 0
        self.step_peak_by_kind: dict[str, int] = {}  #: the categories held at :attr:`step_peak` (MemTracker's names)
        self.on_step_peak: Any = None  #: called at each new step peak; what it returns is kept in step_peak_parts
        self.step_peak_parts: dict[str, int] = {}
        self.in_step = False
        #: the part of a step now running ("step", "optimizer"; None: not told), and each part's own peak:
        #: ``{phase: (bytes, categories at it, on_step_peak's parts at it)}``; a phase is cut further by :attr:`part`
        self._phase: str | None = None
        self._part = ""
        self.phase_peaks: dict[str, tuple[int, dict[str, int], dict[str, int]]] = {}
        #: called with the bytes held (``Other`` left out) at each update (a replayed pipeline's window on its peak)
        self.watch: Any = None
        self._sampled = -1  #: the bytes held (``Other`` too) at the last update

    def __enter__(self) -> StepTracker:
        super().__enter__()
        _OPEN.append(self)
        return self

    def __exit__(self, *args: Any) -> None:
        _OPEN.remove(self)
        super().__exit__(*args)

    def sample(self) -> None:
        """The update ``MemTracker`` makes after an op, made where the bytes held changed since the last one
        (:func:`answer_device`), under the fake mode the tracker was entered in (not DTensor's propagation)."""
        if sum(s["Total"] for s in self._curr_mem_snap.values()) != self._sampled and \
                active_fake_mode() is self._fake_mode_on_entry:
            self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)

    @property
    def phase(self) -> str | None:
        """The part of a step now running (``"step"``, ``"optimizer"``, an action of a pipeline's; None: not told)."""
        return self._phase

    @phase.setter
    def phase(self, value: str | None) -> None:
        self._phase, self._part = value, ""
        self._entered()

    @property
    def part(self) -> str:
        """Where a step is about its blocks (:mod:`vemesh.planning.step_parts`), reset with the phase."""
        return self._part

    @part.setter
    def part(self, value: str) -> None:
        self._part = value
        self._entered()

    def _entered(self) -> None:
        """A phase or part just began: it peaks at the bytes held now at least, whether or not an op is dispatched
        in it (a backward's first part may dispatch none: :func:`device_query`'s are answered above the tracker), and
        :attr:`watch` sees it begin."""
        if self.watch is not None:
            self.watch(self._held())
        if self.in_step and self._phase is not None:
            self._see_step()

    def _held(self) -> int:
        return sum(s["Total"] - s.get(_MemRefType.OTH, 0) for s in self._curr_mem_snap.values())

    def track_weights(self, *modules: torch.nn.Module, grads: bool = True) -> None:
        """Count ``modules``' parameters as parameters, their buffers as buffers and (``grads``) their gradients as
        gradients (no module hooks needed). What was made before the tracker was entered (a model built outside it)
        is counted from here on: torch's tracker sees a tensor first where an op returns it, and a parameter that no
        op returns (a frozen embedding, read by index; a bias that no view takes) went uncounted until the optimizer
        updated it in place, and under it (``Optstate``), or, frozen, never."""
        for module in modules:
            self._track_module_params_and_buffers(module, install_grad_hooks=grads)

    def _update_peak_stats(self, peak_state: Any) -> None:
        self._sampled = sum(s["Total"] for s in self._curr_mem_snap.values())
        if isinstance(self._mod_tracker, NoModules):  # no module's own statistics (torch's loop over them, every
            for dev, snap in self._curr_mem_snap.items():  # op, finds none): each device's peak, as torch keeps it
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)
        else:
            super()._update_peak_stats(peak_state)
        if self.watch is not None:
            self.watch(self._held())
        for snap in self._curr_mem_snap.values():
            total = snap["Total"]
            self.peak_besides_weights = max(self.peak_besides_weights,
                                            total - snap.get(_MemRefType.PARAM, 0) - snap.get(_MemRefType.GRAD, 0))
        if self.in_step:
            self._see_step()

    def _see_step(self) -> None:
        """:attr:`step_peak` and the phase's peak, at the bytes held now (what ``RunMeter.exclude`` registered,
        ``Other``, is not device memory)."""
        for snap in self._curr_mem_snap.values():
            held = snap["Total"] - snap.get(_MemRefType.OTH, 0)
            top = held > self.step_peak
            phase = None if self._phase is None else self._phase + self._part
            in_phase = phase is not None and held > self.phase_peaks.get(phase, (0,))[0]
            if not (top or in_phase):
                continue
            kinds = {str(k.value if hasattr(k, "value") else k): v for k, v in snap.items()}
            parts = self.on_step_peak() if self.on_step_peak is not None else {}
            if top:
                self.step_peak, self.step_peak_by_kind, self.step_peak_parts = held, kinds, parts
            if in_phase:
                self.phase_peaks[phase] = (held, kinds, parts)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:  # "does not support ... multiple iterative calls": the root again
            self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

"""Stop at a step boundary when torchrun asks, saving first, so that no step is redone.

torchrun stops its workers with SIGTERM when a node joins an elastic job (it restarts them on the
larger world), when it is itself stopped, or when another worker failed; it sends SIGKILL 30
seconds later. With a checkpoint directory, the example catches SIGTERM: the ranks agree on it
in the all-reduce that every step already does (for non-finite values), save the step they just
finished, and exit. A rank that is not at a step boundary within the grace period (blocked in a
collective with a dead peer, say) exits anyway, as SIGTERM would have made it, and the job
resumes from the last checkpoint as before.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


class StopRequest:
    """SIGTERM, turned into a request to stop at the next step boundary (within ``grace_s`` seconds)."""

    def __init__(self, grace_s: float, *, enabled: bool) -> None:
        self.grace_s = grace_s
        self.received = threading.Event()
        self._timer: threading.Timer | None = None
        if enabled and grace_s > 0:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if self.received.is_set():
            return
        self.received.set()
        self._timer = threading.Timer(self.grace_s, self._give_up)
        self._timer.daemon = True
        self._timer.start()

    def _give_up(self) -> None:
        print(f"rank {os.environ.get('RANK', 0)}: SIGTERM, and no step boundary within {self.grace_s:g} s "
              "(--stop-grace-s): exiting without saving", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)

    def agreed(self) -> None:
        """Every rank stops at this boundary: the save under way is no longer cut short by the grace timer."""
        if self._timer is not None:
            self._timer.cancel()

    def wait(self, timeout: float) -> bool:
        """Wait (up to ``timeout`` seconds) for this rank's own SIGTERM; whether it came."""
        return self.received.wait(timeout)

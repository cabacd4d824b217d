"""The entries of a TP plan that torch's ``parallelize_module`` skipped because their names match no submodule.

torch warns and goes on (``Parallelize plan key 'attn.qkvv' could not be resolved ... skipping this plan entry``), so
the module the entry meant runs unsharded and the run computes the right numbers: only the memory and the speed
are not what the plan said. Under a launcher the warning is one line of each rank's log among many.
:func:`skipped_plan_keys` records those warnings while the user's parallelize function runs (the others are
emitted as they were) and :func:`describe` says them in one line, for ``vemesh check`` and ``vemesh plan``.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections import Counter
from collections.abc import Iterator

__all__ = ["describe", "skipped_plan_keys"]

#: torch's warning (torch.distributed.tensor.parallel.api.parallelize_module), from 2.7 on; the module's repr follows
_SKIPPED = re.compile(r"Parallelize plan key '(?P<key>[^']*)' could not be resolved: no submodule matching token "
                      r"'(?P<token>[^']*)' in module (?P<owner>\w+)")


@contextlib.contextmanager
def skipped_plan_keys() -> Iterator[list[tuple[str, str, str]]]:
    """Yields a list that fills with ``(key, token, owner class)`` for each plan entry torch skipped in the block
    (a key applied to each of 4 layers and skipped in each counts 4 times). Every other warning is emitted on exit
    as it would have been."""
    skipped: list[tuple[str, str, str]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield skipped
        finally:
            others = []
            for w in caught:
                m = _SKIPPED.match(str(w.message))
                if m:
                    skipped.append((m["key"], m["token"], m["owner"]))
                else:
                    others.append(w)
    for w in others:  # outside the recording block: the filters the caller had decide, as without it
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def describe(skipped: list[tuple[str, str, str]], then: str) -> str:
    """One line: each skipped entry, where it was looked for and how many times, and ``then``: what follows from it
    where it is said (``vemesh check``'s verdict, ``vemesh plan``'s figures)."""
    counts = Counter(map(tuple, skipped))  # lists, after a JSON round trip
    parts = [f"'{key}' in {owner}" + (f" (no child matches '{token}')" if token != key else "")
             + (f" ({n} times)" if n > 1 else "") for (key, token, owner), n in counts.items()]
    n = len(counts)
    return (f"torch's parallelize_module skipped {n} plan entr{'y' if n == 1 else 'ies'} whose name matches no "
            f"submodule: {', '.join(parts)}. What {'it names' if n == 1 else 'they name'} stays unsharded, replicated "
            f"on every TP rank ({then}); name each module as the model names it (print(model) shows the names)")

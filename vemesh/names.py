"""Names and integers at the edge: dim names, rank-like integers, and the error for an unknown name.

Pure Python; shared by the layout, the spec and the mesh so each error is written once.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Sequence

__all__ = ["STANDARD_STRATEGIES", "as_index", "check_dim_names", "unknown_name_error"]

#: Strategy names that every mesh answers for: a standard name the mesh never had has size 1.
STANDARD_STRATEGIES: tuple[str, ...] = ("PP", "DP", "TP", "CP", "EP")


def _as_int(value: object) -> int | None:
    """``value`` as a Python int if it is an integer (numpy and torch ints too), else None; bools are not."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def as_index(value: object, what: str) -> int:
    """``value`` as a Python int, or ``TypeError`` naming ``what``: numpy and torch integers count, bools do not."""
    index = _as_int(value)
    if index is None:
        raise TypeError(
            f"{what} must be an integer (numpy and torch integer scalars count, bool does not); "
            f"got {value!r} of type {type(value).__name__}"
        )
    return index


def check_dim_names(names: object) -> tuple[str, ...]:
    """``names`` as a tuple, checked: an ordered sequence of distinct identifier-like strings.

    ``("DP", "TP")`` passes; ``{"DP", "TP"}`` (its order depends on the hash seed), ``(" DP",)``
    and ``("D-P",)`` raise ``ValueError``; ``(1, 2)`` raises ``TypeError``.
    """
    if isinstance(names, (set, frozenset, dict)):
        raise ValueError(
            f"dim names must be an ordered sequence (a tuple or list); got a {type(names).__name__}, "
            f"whose order changes from run to run: {sorted(map(str, names))!r}"
        )
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"dim names must be a tuple or list of strings; got {names!r}")
    out = tuple(names)
    for name in out:
        if not isinstance(name, str):
            raise TypeError(f"dim names must be strings; got {name!r} of type {type(name).__name__} in {out!r}")
        if not name.isidentifier():
            raise ValueError(
                f"dim name {name!r} is not a plain name (letters, digits and '_', not starting with a digit, "
                f"no spaces); got {out!r}"
            )
    dupes = sorted({n for n in out if out.count(n) > 1})
    if dupes:
        raise ValueError(f"dim names must be unique; {dupes} repeat in {out}")
    return out


def unknown_name_error(kind: str, name: object, valid: Sequence[str]) -> KeyError:
    """Build the ``KeyError`` for an unknown name, listing the valid ones and the closest match."""
    message = f"unknown {kind} {name!r}; valid {kind}s are {list(valid)}"
    if isinstance(name, str):
        lowered = {v.lower(): v for v in valid}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.5)
        if close:
            message += f"; did you mean {lowered[close[0]]!r}?"
    return KeyError(message)

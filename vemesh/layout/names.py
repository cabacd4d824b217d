"""Names and integers at the edge: dim names, rank-like integers, and the error for an unknown name.

Pure Python; shared by the layout, the spec and the mesh so each error is written once.
"""

from __future__ import annotations

import difflib
import math
import operator
from collections.abc import Sequence

__all__ = ["STANDARD_STRATEGIES", "as_index", "check_dim_names", "divisors", "fill_sizes", "listed", "other_spellings",
           "standard_absent_error", "unknown_name_error"]

#: Strategy names that every mesh answers for: a standard name the mesh never had has size 1.
STANDARD_STRATEGIES: tuple[str, ...] = ("PP", "DP", "TP", "CP", "EP")

#: Words that stand for data parallelism besides ``dp`` (torchtitan's and torch's names for its flavours).
_DATA_WORDS = ("fsdp", "hsdp", "ddp")


def other_spellings(standard: str, names: Sequence[str], atoms: Sequence[str] | None = None) -> list[str]:
    """The names among ``names`` that spell the standard strategy ``standard`` another way.

    Any name that equals it but for case (``dp``, ``Dp``) spells it. So does an *atom* (a mesh dim or a
    split part, ``atoms``; all of ``names`` when not given) that, split at ``_`` and compared without
    case, has it as a word (``dp_shard``, ``dp_replicate`` spell DP; ``cp`` spells CP), or for DP one of
    ``fsdp``, ``hsdp``, ``ddp``. A flattened name spells what its atoms spell: ``dp_cp`` made of ``CP``
    alone does not spell DP. ``EDP`` spells none of them (its one word is ``edp``). The exact spelling
    itself is not returned.

    >>> other_spellings("DP", ("dp_replicate", "dp_shard", "cp", "tp"))
    ['dp_replicate', 'dp_shard']
    >>> other_spellings("CP", ("DP", "TP"))
    []
    """
    word = standard.lower()
    words = (word, *_DATA_WORDS) if standard == "DP" else (word,)
    atoms = names if atoms is None else atoms
    return [n for n in names if n != standard and (n.lower() == word or (
        n in atoms and any(w in words for w in n.lower().split("_"))))]


def standard_absent_error(standard: str, spellings: Sequence[str], valid: Sequence[str]) -> KeyError:
    """The ``KeyError`` for a standard strategy the mesh spells another way (see :func:`other_spellings`).

    Answering "absent, size 1" there would be silently wrong: ``lookup_rank("DP")`` would be 0 on
    every rank of a ``("dp", "tp")`` mesh.
    """
    same = [n for n in spellings if n.lower() == standard.lower()]
    if same:
        fix = (f"{standard!r} is not a dim of this mesh, but {same[0]!r} is (the names differ only in case): ask "
               f"for {same[0]!r}, or name the dim {standard!r} in init_device_mesh")
    else:
        shown = ", ".join(repr(n) for n in spellings)
        fix = (f"{standard!r} is not a dim of this mesh, but {shown} {'is' if len(spellings) == 1 else 'are'} "
               f"{standard} under another name: ask for the one you mean, or flatten them into {standard!r} "
               f"(VESCALE_DEVICE_MESH.flatten({tuple(spellings)!r}, {standard!r}))")
    return KeyError(f"{fix}. A standard strategy ({', '.join(STANDARD_STRATEGIES)}) answers as absent (size 1) only "
                    f"when no name of the mesh spells it; valid dim names are {list(valid)}")


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


def fill_sizes(sizes: Sequence[object], total: int | None, *, names: Sequence[str] | None = None, what: str = "",
               of: str = "the world size", exact: bool = True, hint: str = "", fill: str = "-1") -> tuple[int, ...]:
    """The one place a ``-1`` size or degree is checked, filled in and worded: the mesh spec, the
    :class:`~vemesh.layout.parallel_dims.ParallelDims` degrees (so ``vemesh plan`` and ``vemesh show``), and the
    example's ``--mesh-shape`` all call it.

    Every size is a positive integer, or ``-1`` (one of them) for ``total`` over the product of the others.
    ``total=None`` checks the sizes only. With ``exact`` the product must equal ``total``, else it may be less.
    ``names`` labels each size in the messages (``PP 3 x TP 8``); ``what`` prefixes them (``"--mesh-shape"``);
    ``of`` names the total (``"the world size"``); ``hint`` ends the message of a product that does not match;
    ``fill`` is how the caller's users spell the size to fill in (``"'auto'"`` for ``vemesh plan``).

    >>> fill_sizes((2, -1, 2), 16)
    (2, 4, 2)
    >>> fill_sizes((3, -1), 8, names=("DP", "TP"))
    Traceback (most recent call last):
    ValueError: cannot fill in TP: DP 3 = 3 does not divide the world size 8 (the product of the others must be one of its divisors: 1, 2, 4, 8)
    """
    prefix = f"{what}: " if what else ""
    labels = list(names) if names is not None else [None] * len(sizes)

    def expr(pairs: Sequence[tuple[str | None, object]]) -> str:
        shown = [(n, fill.strip("'") if s == -1 else s) for n, s in pairs]
        if names is not None:
            return " x ".join(f"{n} {s}" for n, s in shown)
        return "(" + ", ".join(str(s) for _, s in shown) + ")"

    whole = expr(list(zip(labels, sizes)))
    checked: list[int] = []
    for label, size in zip(labels, sizes):
        value = _as_int(size)
        if value is None or (value < 1 and value != -1):
            named = f" for {label}" if label else ""
            raise ValueError(f"{prefix}every size must be a positive integer, or one {fill} to fill in; got {size!r}{named} "
                             f"in {whole}")
        checked.append(value)
    auto = [i for i, s in enumerate(checked) if s == -1]
    if len(auto) > 1:
        which = f" for {', '.join(str(labels[i]) for i in auto)}" if names is not None else ""
        raise ValueError(f"{prefix}only one size can be {fill} (filled in); got {len(auto)}{which} in {whole}")
    if total is None:
        return tuple(checked)
    known = [(labels[i], s) for i, s in enumerate(checked) if s != -1]
    product = math.prod(s for _, s in known)
    if auto:
        if total % product:
            fits = divisors(total)
            choices = listed(fits, 16) if len(fits) <= 16 else f"{len(fits)} of them"
            name = labels[auto[0]] or "the -1"
            raise ValueError(f"{prefix}cannot fill in {name}: {expr(known) if known else '()'} = {product} does not "
                             f"divide {of} {total} (the product of the others must be one of its divisors: {choices})")
        return tuple(total // product if s == -1 else s for s in checked)
    if exact and product != total:
        raise ValueError(f"{prefix}{whole} = {product} but {of} is {total}; the product must equal it "
                         f"(or set one size to {fill} to fill it in){hint}")
    if product > total:
        raise ValueError(f"{prefix}{whole} = {product} but {of} is only {total}{hint}")
    return tuple(checked)


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


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending: the sizes a dim of ``n`` ranks (or a length of ``n``) can be cut
    into, as the errors that name the valid choices list them. ``divisors(12)`` is ``[1, 2, 3, 4, 6, 12]``."""
    if n < 1:
        raise ValueError(f"divisors of {n}: only a positive integer has them")
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def listed(values: Sequence[object], most: int = 12) -> str:
    """``values`` as an error lists them: ``1, 2, 4``, the first ``most`` then ``...`` when there are more."""
    shown = ", ".join(map(str, values[:most]))
    return shown + (", ..." if len(values) > most else "")


def _joined(name: str, valid: Sequence[str]) -> list[str] | None:
    """The valid names, two or more, that ``name`` joins with ``_`` in order (``DP_CP`` joins DP and CP), or None."""
    ends: dict[int, list[str]] = {0: []}  # where a prefix of ``name`` ends -> the names that join it
    for at in range(len(name) + 1):
        if at not in ends or at == len(name):
            continue
        for v in valid:
            start = at + (1 if at else 0)
            if (at == 0 or name[at] == "_") and name.startswith(v, start) and start + len(v) not in ends:
                ends[start + len(v)] = [*ends[at], v]
    found = ends.get(len(name))
    return found if found is not None and len(found) > 1 else None


def unknown_name_error(kind: str, name: object, valid: Sequence[str]) -> KeyError:
    """Build the ``KeyError`` for an unknown name, listing the valid ones and the closest match."""
    message = f"unknown {kind} {name!r}; valid {kind}s are {list(valid)}"
    parts = _joined(name, valid) if isinstance(name, str) else None
    if parts:  # torchtitan's habit, mesh["DP", "CP"]._flatten("DP_CP"): torch's mesh gets the name, vemesh's does not
        return KeyError(f"{message}; {name!r} joins {' and '.join(parts)}: make it with "
                        f"VESCALE_DEVICE_MESH.flatten({tuple(parts)!r}, {name!r}), which every query then knows "
                        "(torch's _flatten on a view names torch's mesh only)")
    if isinstance(name, str):
        lowered = {v.lower(): v for v in valid}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.5)
        standard = name.upper() if name.upper() in STANDARD_STRATEGIES else None
        spelled = other_spellings(standard, valid) if standard else []
        if spelled:  # 'DP' on ('dp_shard', 'tp'): the mesh's own spelling, not the closest letters ('tp')
            message += f"; this mesh spells {standard} as {' and '.join(map(repr, spelled))}"
            if len(spelled) > 1:  # torchtitan's dp_replicate x dp_shard: one name needs them flattened
                message += f": name one, or make {standard} of them with VESCALE_DEVICE_MESH.flatten({tuple(spelled)!r}, {standard!r})"
        elif standard and standard not in valid:
            # 'CP' on a mesh with 'TP' is another parallelism, not a typo: say it is absent, and how a function that
            # runs on meshes with and without it asks (a strategy of size 1 is left out of the planner's meshes)
            message += (f"; the mesh has no {standard} dim (a strategy of size 1 is left out of a mesh: "
                        f"VESCALE_DEVICE_MESH.get_strategy_size({standard!r}) answers 1 for it, "
                        f"get_optional_mesh({standard!r}) None)")
        elif close:
            message += f"; did you mean {lowered[close[0]]!r}?"
    return KeyError(message)

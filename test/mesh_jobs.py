"""Every job of a world of up to ``limit`` ranks, as the data-dims tests enumerate them."""

from __future__ import annotations


def jobs(limit: int = 32) -> list[tuple[int, int, int, int, int, int]]:
    """Every ``(PP, dp_replicate, dp_shard, CP, TP, EP)`` whose first five multiply to at most ``limit``, with each
    EP that divides dp_replicate x dp_shard x CP, in the lexicographic order of ``itertools.product`` filtered by the
    product. Each degree is walked only up to what the degrees before it leave (``itertools.product`` over
    ``range(1, 33)`` walks 33.5 million tuples for the 3926 jobs: 17 s of every xdist worker's collection)."""
    out: list[tuple[int, int, int, int, int, int]] = []

    def walk(prefix: tuple[int, ...], left: int) -> None:
        if len(prefix) == 5:
            data = prefix[1] * prefix[2] * prefix[3]
            out.extend((*prefix, ep) for ep in range(1, data + 1) if data % ep == 0)
            return
        for n in range(1, left + 1):
            walk((*prefix, n), left // n)

    walk((), limit)
    return out

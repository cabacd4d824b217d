"""Suite-wide: the slow end-to-end runs start first.

With the pytest-xdist workers of setup.cfg, a long run collected last leaves one worker busy while
the other has finished; started first, the short tests fill the gaps at the end.
"""

from __future__ import annotations

import pytest


#: Files whose tests ran longest in the suite's own --durations (2026-11-25: the live-FT heal 165 s, the wheel's venv
#: 119 s, the docs' plans 50 to 65 s, the elastic and restart runs about 60 s), longest first: among the slow runs they
#: start first, so that none of them is the suite's tail.
LONGEST = ("test_gpt_live_ft.py", "test_from_a_wheel.py", "test_shown_outputs.py", "test_gpt_elastic.py",
           "test_gpt_fault_tolerance.py", "test_gpt_pipeline.py", "test_gpt_train.py", "test_gpt_hangs.py")


def _order(item: pytest.Item) -> tuple[bool, int]:
    name = item.path.name
    return item.get_closest_marker("slow") is None, LONGEST.index(name) if name in LONGEST else len(LONGEST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_order)  # stable: the order within each kind stays

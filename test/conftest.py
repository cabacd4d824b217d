"""Suite-wide: the slow end-to-end runs start first.

With the pytest-xdist workers of setup.cfg, a long run collected last leaves one worker busy while
the other has finished; started first, the short tests fill the gaps at the end.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the order within each kind stays

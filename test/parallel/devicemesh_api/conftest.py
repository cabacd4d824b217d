"""Fixtures for driving one rank's view of a large world in this process (torch's fake backend)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from vemesh import VeDeviceMesh


@pytest.fixture
def fake_rank() -> Iterator[Callable[[int, int], None]]:
    """``fake_rank(rank, world_size)`` makes this process that rank of a fake world."""

    def become(rank: int, world_size: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())

    yield become
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def fake_mesh(fake_rank) -> Callable[..., VeDeviceMesh]:
    """``fake_mesh(rank, shape, names)``: a fresh VeDeviceMesh as seen from ``rank``."""

    def build(
        rank: int, shape: tuple[int, ...], names: tuple[str, ...] | None = None, world_size: int | None = None
    ) -> VeDeviceMesh:
        fake_rank(rank, world_size or math.prod(shape))
        mesh = VeDeviceMesh()
        mesh.init_device_mesh("cpu", shape, mesh_dim_names=names)
        return mesh

    return build

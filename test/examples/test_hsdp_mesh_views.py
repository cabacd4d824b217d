"""``examples/hsdp/mesh_views.py`` runs as a user runs it and prints every rank's view of
torchtitan's mesh; each line agrees with the layout arithmetic."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

from vemesh.layout import MeshLayout


def test_every_ranks_view_is_printed_and_right():
    proc = subprocess.run([sys.executable, "examples/hsdp/mesh_views.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()[1:]
    assert len(lines) == 16
    layout = MeshLayout((2, 2, 2, 2), ("dp_replicate", "dp_shard", "cp", "tp"))
    for rank, line in enumerate(lines):
        shard_cp = layout.group_ranks(rank, (1, 2))
        hsdp = [layout.group_ranks(layout.rank((r, 0, 0, rank % 2)), (1, 2)) for r in range(2)]
        assert line.startswith(f"rank {rank:2d}: {layout.coordinate(rank)}, HSDP view {hsdp}"), line
        assert f"dp index {layout.index_in_group(rank, (0, 1))} of 4" in line
        assert f"dp_shard_cp {shard_cp}, cp {layout.group_ranks(rank, (2,))}, tp {layout.group_ranks(rank, (3,))}" in line

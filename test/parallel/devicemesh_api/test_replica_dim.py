"""The fault-tolerant replica dim (vemesh.ft) as the mesh sees it: the layout knows the name and refuses
every use its arithmetic cannot answer; the mesh answers size, index and group from the replicas on every
rank of a fake world, and every other query is what it was. Pure arithmetic and the fake backend only."""

from __future__ import annotations

import pytest

from vemesh.layout import MeshLayout

MANAGED = "fault-tolerant replica dim"


class FakeReplicas:
    """What the mesh reads of vemesh.ft.Replicas: a name, the step's size and index, and a group."""

    name = "dp_replicate"

    def __init__(self, size: int, index: int) -> None:
        self._size, self._index, self.group = size, index, object()

    def size(self) -> int:
        return self._size

    def index(self) -> int:
        return self._index


def test_the_layout_keeps_the_name_and_refuses_what_it_cannot_answer() -> None:
    base = MeshLayout((2, 4), ("DP", "TP"))
    layout = base.with_managed("dp_replicate")
    assert layout.managed == ("dp_replicate",) and layout.names == base.names
    for call in (lambda: layout.group_size("dp_replicate"), lambda: layout.resolve(("dp_replicate", "TP")),
                 lambda: layout.index_in_group(3, "dp_replicate"), lambda: layout.named("dp_replicate"),
                 lambda: layout.flatten(("DP", "TP"), "dp_replicate"), lambda: layout.split("dp_replicate", ("a", "b"), (1, 1)),
                 lambda: layout.neighbor(0, "dp_replicate")):
        with pytest.raises(ValueError, match=MANAGED):
            call()
    with pytest.raises(ValueError, match="split names \\['dp_replicate'\\] are already dims"):
        layout.split("DP", ("dp_replicate", "dp_shard"), (1, 2))
    with pytest.raises(ValueError, match="'TP' is already a dim of this mesh"):
        layout.with_managed("TP")
    with pytest.raises(ValueError, match="not a plain name"):
        layout.with_managed("dp replicate")
    # everything else is untouched, and survives later flattens and splits
    later = layout.flatten(("DP", "TP"), "dp_tp").split("DP", ("a", "b"), (1, 2))
    assert later.managed == ("dp_replicate",)
    for r in range(8):
        assert layout.group_ranks(r, "TP") == base.group_ranks(r, "TP")
        assert later.group_ranks(r, "DP") == base.group_ranks(r, "DP")


@pytest.mark.parametrize("rank", range(8))
def test_every_rank_asks_the_replicas_for_their_dim_and_the_layout_for_the_rest(fake_mesh, rank) -> None:
    mesh = fake_mesh(rank, (2, 2, 2), ("PP", "DP", "TP"))
    names = ("PP", "DP", "TP")
    before = {n: (mesh.get_strategy_size(n), mesh.lookup_rank(n), mesh.get_group(n), mesh[n],
                  [mesh.to_global_rank(i, n) for i in range(2)], mesh.get_neighbor_rank(n, wrap=True)) for n in names}
    replicas = FakeReplicas(size=3, index=2)
    mesh.add_replicas(replicas)
    assert mesh.replicas is replicas
    assert mesh.get_strategy_size("dp_replicate") == mesh.size("dp_replicate") == 3
    assert mesh.lookup_rank("dp_replicate") == mesh.get_local_rank("dp_replicate") == 2
    assert mesh.get_group("dp_replicate") is replicas.group
    replicas._size, replicas._index = 1, 0  # the next step's quorum: answered live, never cached
    assert mesh.get_strategy_size("dp_replicate") == 1 and mesh.lookup_rank("dp_replicate") == 0
    for n in names:
        after = (mesh.get_strategy_size(n), mesh.lookup_rank(n), mesh.get_group(n), mesh[n],
                 [mesh.to_global_rank(i, n) for i in range(2)], mesh.get_neighbor_rank(n, wrap=True))
        assert after == before[n], n
    assert mesh.get_strategy_coordinate() == list(mesh.layout.coordinate(rank)) and mesh.shape == (2, 2, 2)
    for call in (lambda: mesh["dp_replicate"], lambda: mesh["dp_replicate", "TP"], lambda: mesh.to_global_rank(0, "dp_replicate"),
                 lambda: mesh.to_local_rank(rank, "dp_replicate"), lambda: mesh.get_neighbor_rank("dp_replicate"),
                 lambda: mesh.get_global_rank({"dp_replicate": 0}), lambda: mesh.get_submeshes("dp_replicate"),
                 lambda: mesh.flatten(("DP", "dp_replicate"))):
        with pytest.raises(ValueError, match=MANAGED):
            call()
    with pytest.raises(KeyError, match="did you mean 'dp_replicate'"):
        mesh.get_strategy_size("dp_replicat")

"""The fault-tolerant replica dim (vemesh.ft) as the mesh sees it: the layout knows the name and refuses
every use its arithmetic cannot answer; the replicas hold the mesh and answer for their dim, on every rank of
a fake world, and every other query is what it was. Pure arithmetic and the fake backend only."""

from __future__ import annotations

import pytest

from vemesh.layout import MeshLayout

MANAGED = "fault-tolerant replica dim"


class FakeManager:
    """What ``vemesh.ft.Replicas`` reads of torchft's Manager when it is built (a synchronous quorum)."""

    _use_async_quorum = False


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
def test_the_replicas_hold_the_mesh_and_answer_for_their_dim_the_mesh_only_reserves_the_name(fake_mesh, rank) -> None:
    """Every rank of a fake world: the replicas (built with ``mesh=``) reserve their name on the mesh and answer
    size, index and group live; the mesh holds no replicas, refuses every query of the name, and answers every
    other dim as before."""
    from vemesh.ft import Replicas

    mesh = fake_mesh(rank, (2, 2, 2), ("PP", "DP", "TP"))
    names = ("PP", "DP", "TP")
    before = {n: (mesh.get_strategy_size(n), mesh.lookup_rank(n), mesh.get_group(n), mesh[n],
                  [mesh.to_global_rank(i, n) for i in range(2)], mesh.get_neighbor_rank(n, wrap=True)) for n in names}
    replicas = Replicas(FakeManager(), replica_id=2, mesh=mesh)
    assert replicas.mesh is mesh and mesh.layout.managed == ("dp_replicate",)
    assert not any(v is replicas for v in vars(mesh).values())  # the mesh holds the name, not the replicas
    for n in names:
        after = (mesh.get_strategy_size(n), mesh.lookup_rank(n), mesh.get_group(n), mesh[n],
                 [mesh.to_global_rank(i, n) for i in range(2)], mesh.get_neighbor_rank(n, wrap=True))
        assert after == before[n], n
    assert mesh.get_strategy_coordinate() == list(mesh.layout.coordinate(rank)) and mesh.shape == (2, 2, 2)
    for call in (lambda: mesh.get_strategy_size("dp_replicate"), lambda: mesh.size("dp_replicate"),
                 lambda: mesh.lookup_rank("dp_replicate"), lambda: mesh.get_local_rank("dp_replicate"),
                 lambda: mesh.get_group("dp_replicate"),
                 lambda: mesh["dp_replicate"], lambda: mesh["dp_replicate", "TP"], lambda: mesh.to_global_rank(0, "dp_replicate"),
                 lambda: mesh.to_local_rank(rank, "dp_replicate"), lambda: mesh.get_neighbor_rank("dp_replicate"),
                 lambda: mesh.get_global_rank({"dp_replicate": 0}), lambda: mesh.get_submeshes("dp_replicate"),
                 lambda: mesh.flatten(("DP", "dp_replicate"))):
        with pytest.raises(ValueError, match=MANAGED + r".*Ask the replicas \(vemesh.ft.Replicas\): replicas.size\(\)"):
            call()
    with pytest.raises(KeyError, match="did you mean 'dp_replicate'"):
        mesh.get_strategy_size("dp_replicat")
    with pytest.raises(ValueError, match="'dp_replicate' is already a dim of this mesh"):
        Replicas(FakeManager(), replica_id=0, mesh=mesh)  # a second replica dim of the same name
    mesh.reset()  # a reset drops the name with the layout; the replicas still hold the mesh object
    assert replicas.mesh is mesh and not mesh.is_initialized()

"""Rank maths without Ray: Horovod's rank, local and cross ranks, GPU visibility, reducescatter rows."""

import pytest

from hvdray.collective.topology import RankInfo, WorkerSlot, assign_ranks, reducescatter_rows, visible_devices


def slot(node, gpus=()):
    return WorkerSlot(node_id=node, hostname="h", ip="10.0.0.1", gpu_ids=tuple(gpus))


def test_single_node_ranks_follow_order():
    infos = assign_ranks([slot("a")] * 3)
    assert [i.rank for i in infos] == [0, 1, 2]
    assert all(i.local_size == 3 and i.cross_size == 1 and i.cross_rank == 0 for i in infos)
    assert [i.local_rank for i in infos] == [0, 1, 2]


def test_ranks_are_contiguous_per_node_even_when_interleaved():
    # workers arrive interleaved across two nodes that share one IP (several raylets on one machine)
    infos = assign_ranks([slot("a"), slot("b"), slot("a"), slot("b")])
    assert [i.rank for i in infos] == [0, 2, 1, 3]
    assert [(i.local_rank, i.local_size) for i in infos] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [(i.cross_rank, i.cross_size) for i in infos] == [(0, 2), (1, 2), (0, 2), (1, 2)]


def test_uneven_nodes_follow_horovod_cross_semantics():
    # node a has 3 workers, node b has 1: local_rank 0 exists on both nodes, 1 and 2 only on a
    infos = assign_ranks([slot("a"), slot("a"), slot("a"), slot("b")])
    by_rank = sorted(infos, key=lambda i: i.rank)
    assert by_rank[3] == RankInfo(rank=3, size=4, local_rank=0, local_size=1, cross_rank=1, cross_size=2)
    assert (by_rank[1].cross_rank, by_rank[1].cross_size) == (0, 1)
    assert (by_rank[0].cross_rank, by_rank[0].cross_size) == (0, 2)


def test_empty_slots_rejected():
    with pytest.raises(ValueError, match="slots"):
        assign_ranks([])


def test_visible_devices_is_the_union_per_node():
    # Ray GPUs cannot exist on this machine: the slots below stand in for what ray.get_gpu_ids() reports
    slots = [slot("a", ["1"]), slot("a", ["0"]), slot("b", ["3"]), slot("a", ["10"])]
    assert visible_devices(slots) == [("0", "1", "10"), ("0", "1", "10"), ("3",), ("0", "1", "10")]
    assert visible_devices([slot("a")]) == [()]


@pytest.mark.parametrize("rows,size,expected", [(10, 3, [4, 3, 3]), (2, 3, [1, 1, 0]), (6, 2, [3, 3]), (0, 2, [0, 0])])
def test_reducescatter_rows(rows, size, expected):
    assert reducescatter_rows(rows, size) == expected
    assert sum(reducescatter_rows(rows, size)) == rows


def _sysfs_cache(root, cpu, index, size, shared):
    folder = root / f"cpu{cpu}" / "cache" / f"index{index}"
    folder.mkdir(parents=True)
    (folder / "size").write_text(size + "\n")
    (folder / "shared_cpu_list").write_text(shared + "\n")


def test_shared_cache_bytes_is_the_largest_cache_every_usable_core_shares(tmp_path, monkeypatch):
    from hvdray.collective import topology

    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: {2, 3})
    _sysfs_cache(tmp_path, 2, 0, "32K", "2")  # per core: not shared by core 3
    _sysfs_cache(tmp_path, 2, 2, "1024K", "2-3")
    _sysfs_cache(tmp_path, 2, 3, "32M", "0-3,8")
    assert topology.shared_cache_bytes(str(tmp_path)) == 32 << 20
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: {2, 5})  # no cache spans cores 2 and 5
    assert topology.shared_cache_bytes(str(tmp_path)) == 0
    assert topology.shared_cache_bytes(str(tmp_path / "missing")) == 0  # no sysfs: unknown

"""The control-plane simulation (``benchmarks/control_plane_scale.py``) at small N: the rendezvous stays
within N log N coordinator calls (and would not without the gathered wait) and N^2 bytes read (and
would not with whole Gloo records), the steady training step costs one control collective of
constant size, and the simulation replays exactly what a real ``ProcessGroupGloo`` asks of its store."""

from __future__ import annotations

import importlib.util
import math
import socket
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from hvdray.collective.transport.sockets import partners

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_threads import gloo_group, in_threads  # noqa: E402 - shared by the Gloo unit tests

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "control_plane_scale.py"


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("control_plane_scale", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


class _Recording(dist.Store):
    """A store over a shared HashStore that records this rank's operations."""

    def __init__(self, base: dist.HashStore) -> None:
        super().__init__()
        self.base, self.ops = base, []

    def set(self, key, value):
        self.ops.append(("set", key, len(value)))
        self.base.set(key, value)

    def get(self, key):
        self.ops.append(("get", key))
        return self.base.get(key)

    def wait(self, keys, timeout=None):
        self.ops.append(("wait", list(keys)))
        self.base.wait(keys)

    def add(self, key, amount):
        self.ops.append(("add", key))
        return self.base.add(key, amount)

    def check(self, keys):
        return self.base.check(keys)

    def delete_key(self, key):
        return self.base.delete_key(key)


def _connect_all(size, connect):
    """Run ``connect(rank, store)`` for every rank in threads; each rank's recorded operations."""
    base = dist.HashStore()
    stores = [_Recording(base) for _ in range(size)]
    in_threads(size, lambda rank: connect(rank, stores[rank]))
    return [s.ops for s in stores]


def test_replayed_gloo_connect_is_what_real_gloo_asks_of_its_store(scale):
    size = 4
    groups = []

    def real(rank, store):
        groups.append(gloo_group(store, rank, size))

    real_ops = _connect_all(size, real)
    replayed_ops = _connect_all(size, lambda rank, store: scale.gloo_connect(store, rank, size))
    assert real_ops == replayed_ops
    # the record: host name and device address, each after its 8-byte length, and a pair id per rank
    record_bytes = 16 + len(socket.gethostname()) + scale.GLOO_DEVICE_ADDRESS_BYTES + 8 * size
    assert real_ops[0][0] == ("set", "0/0", record_bytes)


def test_rendezvous_grows_at_most_n_log_n_and_per_key_waits_would_not(scale):
    lazy = {n: scale.rendezvous(n, per_node=8, mode="parts") for n in (16, 64)}
    gathered = {n: scale.rendezvous(n, per_node=8, mode="parts", gloo="eager") for n in (16, 64)}
    per_key = {n: scale.rendezvous(n, per_node=8, mode="per-key", gloo="eager") for n in (16, 64)}
    bound = (64 * math.log2(64)) / (16 * math.log2(16))  # N log N from 16 to 64: x6
    for calls in (lazy, gathered):
        assert calls[64]["coordinator_calls"] / calls[16]["coordinator_calls"] <= bound
    assert per_key[64]["coordinator_calls"] / per_key[16]["coordinator_calls"] > bound  # the check can fail
    # 8 ranks per node: the job's partner connections (a record set by each rank with a partner above it, one
    # wait by each with a partner below it), the segment's name, the cross-node group's partner connections;
    # with the Gloo groups connected, also the job group's record and gathered wait and the cross group's
    sockets = _socket_store_ops(64) + 8 * _socket_store_ops(8)
    assert lazy[64]["store_ops"] == 64 + sockets
    assert gathered[64]["store_ops"] == 5 * 64 + sockets
    assert lazy[64]["calls_by_method"]["assign"] == gathered[64]["calls_by_method"]["assign"] == 1


def test_rendezvous_bytes_grow_as_n_squared_with_record_parts_and_whole_records_would_not(scale):
    """Each rank reads O(1) bytes of each peer's record (O(N^2) in all); whole records are O(N) each."""
    parts = {n: scale.rendezvous(n, per_node=1, mode="parts", gloo="eager")["value_bytes"] for n in (32, 128)}
    whole = {n: scale.rendezvous(n, per_node=1, mode="whole", gloo="eager")["value_bytes"] for n in (32, 128)}
    assert parts[128] / parts[32] <= 4**2 * 1.01
    assert whole[128] / whole[32] > 4**2 * 1.5  # the check can fail
    assert parts[128] < whole[128] / 5
    # with the Gloo group unconnected (no alltoall yet), each rank reads its log2 N partners' records only
    lazy = {n: scale.rendezvous(n, per_node=1, mode="parts")["value_bytes"] for n in (32, 128)}
    assert lazy[128] / lazy[32] <= (128 * math.log2(128)) / (32 * math.log2(32)) * 1.01
    assert lazy[128] < parts[128] / 20


def _socket_store_ops(size: int) -> int:
    """Store operations of ``PeerSockets.connect`` among ``size`` ranks: a set per listener, a wait per connector."""
    return sum(bool(below) + bool(above) for below, above in (partners(rank, size) for rank in range(size)))


def test_one_rank_per_node_rendezvous_is_about_two_store_calls_per_rank_and_four_with_gloo_connected(scale):
    """The small-message connections' record and wait (every rank but the last has a partner above it, every
    rank but the first one below it); with the Gloo group connected, also its record and gathered wait."""
    assert _socket_store_ops(16) == 2 * 16 - 2
    lazy = scale.rendezvous(16, per_node=1, mode="parts")
    assert lazy["calls_by_method"] == {"assign": 1, "kv_set": 15, "kv_read": 15}
    eager = scale.rendezvous(16, per_node=1, mode="parts", gloo="eager")
    assert eager["calls_by_method"] == {"assign": 1, "kv_set": 16 + 15, "kv_read": 16 + 15}


def test_steady_step_costs_one_constant_control_collective(scale):
    for size in (16, 64):
        first, *steady = scale.negotiation(size, per_node=8, tensors=8, steps=3)
        assert first["control_collectives"] == 2  # the flags, then the round that announces the names
        assert all(step["control_collectives"] == 1 for step in steady)
        assert steady[-1]["bytes_per_rank"] == steady[0]["bytes_per_rank"]


def test_steady_step_messages_grow_at_most_n_log_n(scale):
    """The flags' AND crosses the nodes by recursive doubling: P log2 P messages for P nodes (one rank per
    node: N log2 N), where an allgather ring would send P(P-1)."""
    for per_node in (1, 8):
        steady = {n: scale.negotiation(n, per_node=per_node, tensors=4, steps=2)[-1]["messages"] for n in (64, 256)}
        groups = {n: n // per_node if per_node > 1 else n for n in steady}
        for n, messages in steady.items():
            assert messages <= groups[n] * math.log2(groups[n]), (per_node, n, messages)
            assert messages < groups[n] * (groups[n] - 1)  # the ring's count: the check can fail

"""The ranks' own connections (``transport/sockets.py``) and the collectives over them
(``socket_strategies.py``), ranks as threads of this process:
who connects to whom, the listener closed to strangers and gone once its partners are in, a partner
that ends or falls silent failing the op fast and naming it, and messages in both directions at once."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from hvdray.collective.transport.gloo import recursive_doubling, recursive_doubling_messages
from hvdray.collective.transport.communicator import as_bytes
from hvdray.collective.transport.socket_strategies import (
    SocketAllgather,
    SocketBroadcast,
    SocketHalvingDoubling,
    SocketRecursiveDoubling,
    SocketReducescatter,
    and_bytes,
)
from hvdray.collective.transport.sockets import PeerSockets

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_threads import in_threads  # noqa: E402 - shared by the unit tests that run ranks as threads


def _connect_all(size: int, store: dist.Store, timeout_s: float = 10.0, address: str = "127.0.0.1") -> list[PeerSockets]:
    return in_threads(size, lambda rank: PeerSockets.connect(store, rank, size, address, timeout_s))


def _in_threads(fn, groups: list[PeerSockets]) -> list:
    """``fn(group)`` for every rank's group at once; each rank's result, or the exception it raised."""
    def outcome(rank: int):
        try:
            return fn(groups[rank])
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            return exc

    return in_threads(len(groups), outcome)


def _close(groups: list[PeerSockets]) -> None:
    for group in groups:
        group.close()


def _on_every_rank(size: int, member) -> list:
    """Connect ``size`` ranks, run ``member(group)`` on each at once and close them; each rank's result
    (the test fails if any rank raised)."""
    groups = _connect_all(size, dist.HashStore())
    try:
        results = _in_threads(member, groups)
    finally:
        _close(groups)
    for rank_results in results:
        assert not isinstance(rank_results, BaseException), rank_results
    return results


def _exact_values(rank: int, numel: int) -> torch.Tensor:
    """Float32 values that differ by rank and begin with NaN (odd ranks) or -0.0 (even): compared bit for bit."""
    values = torch.arange(numel, dtype=torch.float32) + rank * 0.5
    values[0] = float("nan") if rank % 2 else -0.0
    return values


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_each_rank_connects_to_its_recursive_doubling_partners_only(size):
    groups = _connect_all(size, dist.HashStore())
    try:
        for rank, group in enumerate(groups):
            assert set(group._peers) == {peer for _, peer, _ in recursive_doubling(rank, size)}
        connections = sum(len(group._peers) for group in groups) // 2
        assert connections <= recursive_doubling_messages(size)  # P log2 P, not the P(P-1)/2 of a full mesh
        totals = _in_threads(lambda g: SocketRecursiveDoubling(g).run(t := torch.full((3,), g.rank + 1.0),
                                                                         ReduceOp.SUM) or t.tolist(), groups)
        assert totals == [[size * (size + 1) / 2] * 3] * size
    finally:
        _close(groups)


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_the_bytes_and_gives_every_rank_the_and_of_every_ranks_bytes(size):
    """The engine's flags over the connections: every rank's bytes ANDed in place, for lengths from one
    byte to a flag vector of 1024 slots (257 bytes) and more, several rounds on the same connections."""
    lengths = (1, 3, 257, 4096)
    mine = {(rank, n, round_): bytes(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(
        rank * 100_003 + n * 7 + round_), dtype=torch.uint8).tolist()) for rank in range(size) for n in lengths
        for round_ in range(3)}

    def member(group: PeerSockets) -> list[bytes]:
        out = []
        for n in lengths:
            for round_ in range(3):
                data = bytearray(mine[group.rank, n, round_])
                and_bytes(group, memoryview(data))
                out.append(bytes(data))
        return out

    want = []
    for n in lengths:
        for round_ in range(3):
            combined = -1
            for rank in range(size):
                combined &= int.from_bytes(mine[rank, n, round_], "little")
            want.append(combined.to_bytes(n, "little"))
    assert _on_every_rank(size, member) == [want] * size


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 7, 8])
def test_halving_doubling_gives_every_rank_the_same_exact_reduction(size):
    """Large messages: a reduce-scatter by halving, then an allgather by doubling. Every rank ends with the
    same bits, equal to the reduction of every rank's tensor, for every op, for lengths that do not split
    evenly (fewer elements than ranks, odd lengths) and for a tensor that is not contiguous."""
    generator = torch.Generator().manual_seed(size)
    lengths = (1, size - 1, 7, 1001, 300_001)  # the last in several pieces (HALVING_PIECE_BYTES)
    inputs = {n: [torch.randn(n, generator=generator, dtype=torch.float64) for _ in range(size)] for n in lengths}
    ops = {ReduceOp.SUM: torch.add, ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum,
           ReduceOp.PRODUCT: torch.mul}

    def member(group: PeerSockets) -> list:
        results = []
        for n in lengths:
            for op in ops:
                mine = inputs[n][group.rank].clone()
                SocketHalvingDoubling(group).run(mine, op)
                results.append(mine)
        ints = torch.arange(12, dtype=torch.int64).reshape(3, 4).t() * (group.rank + 1)  # not contiguous
        SocketHalvingDoubling(group).run(ints, ReduceOp.SUM)
        results.append(ints)
        return results

    results = _on_every_rank(size, member)
    for rank_results in results:
        assert all(torch.equal(a, b) for a, b in zip(rank_results, results[0]))  # bit for bit, every rank
    expected = []
    for n in lengths:
        for reducer in ops.values():
            total = inputs[n][0].clone()
            for other in inputs[n][1:]:
                total = reducer(total, other)
            expected.append(total)
    for got, want in zip(results[0], expected):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)  # another order of the same sums
    assert torch.equal(results[0][-1], torch.arange(12).reshape(3, 4).t() * (size * (size + 1) // 2))


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 7, 8])
def test_the_reducescatter_gives_each_rank_its_reduced_chunk(size):
    """Rank r ends with chunk r reduced across every rank, for every op the strategy takes, for group
    sizes with and without ranks folded in, for chunks of one element and of several pieces (1 MiB
    each), in integers (exact whatever the order) and in floats; the input stays as it was."""
    generator = torch.Generator().manual_seed(size)
    shapes = ((1,), (3, 5), (140_000,))  # per chunk; the last in several pieces (HALVING_PIECE_BYTES)
    ops = {ReduceOp.SUM: torch.add, ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum,
           ReduceOp.PRODUCT: torch.mul}
    inputs = {
        (shape, dtype): [
            torch.randint(-3, 4, (size, *shape), generator=generator).to(dtype) for _ in range(size)
        ]
        for shape in shapes for dtype in (torch.int64, torch.float32)
    }

    def member(group: PeerSockets) -> list:
        results = []
        for (shape, _), tensors in inputs.items():
            for op in ops:
                out = torch.empty(shape, dtype=tensors[0].dtype)
                SocketReducescatter(group).run(tensors[group.rank], out, op)
                results.append(out)
        return results

    before = {key: [t.clone() for t in tensors] for key, tensors in inputs.items()}
    results = _on_every_rank(size, member)
    assert all(torch.equal(a, b) for key in inputs for a, b in zip(inputs[key], before[key]))
    for rank, rank_results in enumerate(results):
        want = iter(rank_results)
        for tensors in inputs.values():
            for reducer in ops.values():
                total = tensors[0][rank].clone()
                for other in tensors[1:]:
                    total = reducer(total, other[rank])
                assert torch.equal(next(want), total)  # small integers: exact in float32 too


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 7, 8])
def test_the_allgather_gives_every_rank_every_row_exactly(size):
    """Each rank's row reaches every rank bit for bit (NaN, -0.0 and all), for group sizes with and
    without ranks folded in, for rows of 4 bytes and of several MiB."""
    def member(group: PeerSockets) -> list:
        gathered = []
        for numel in (1, 3, 1 << 20):  # 4 B, 12 B, 4 MiB rows
            out = torch.full((size, numel), 7.0)
            SocketAllgather(group).run(_exact_values(group.rank, numel), out)
            gathered.append(out)
        return gathered

    for rank_results in _on_every_rank(size, member):
        for out, numel in zip(rank_results, (1, 3, 1 << 20)):
            want = torch.stack([_exact_values(r, numel) for r in range(size)])
            assert torch.equal(out.view(torch.int32), want.view(torch.int32))  # every bit, NaN included


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 7, 8])
def test_the_broadcast_gives_every_rank_the_roots_bytes_from_every_root(size):
    """A binomial tree over the partners, rooted anywhere (below and above the largest power of two),
    for a 4-byte tensor and a 4 MiB one: every rank ends with the root's bits."""
    def member(group: PeerSockets) -> list:
        got = []
        for root in range(size):
            for numel in (1, 1 << 20):
                tensor = _exact_values(group.rank, numel)
                SocketBroadcast(group).run(tensor, root)
                got.append(tensor)
        return got

    want = [_exact_values(root, numel) for root in range(size) for numel in (1, 1 << 20)]
    for rank_results in _on_every_rank(size, member):
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(rank_results, want))


@pytest.mark.parametrize("size", [2, 3, 5])
def test_allgather_and_broadcast_give_every_rank_the_exact_bytes(size):
    """Each moves bytes untouched: exact for every dtype (NaN, -0.0, bfloat16, and int16 moved as bytes, as
    the communicator moves dtypes Gloo lacks), and a strided view is written back in place."""

    def tensor_of(rank: int, dtype: torch.dtype) -> torch.Tensor:
        values = torch.tensor([rank + 0.5, -0.0, float("nan"), -(rank + 1) * 1e30])
        return values.to(dtype) if dtype.is_floating_point else torch.arange(4, dtype=dtype) * (rank + 1) - 5

    dtypes = (torch.float32, torch.bfloat16, torch.float64, torch.int16, torch.bool, torch.uint8)

    def member(group: PeerSockets) -> list:
        done = []
        for dtype in dtypes:
            mine = tensor_of(group.rank, dtype) if dtype != torch.bool else torch.tensor([group.rank % 2 == 0] * 3)
            out = torch.empty((size, *mine.shape), dtype=dtype)
            if dtype == torch.int16:  # Gloo has no int16: moved as bytes
                SocketAllgather(group).run(as_bytes(mine), as_bytes(out))
            else:
                SocketAllgather(group).run(mine, out)
            done.append(out)
        for root in range(size):
            tensor = tensor_of(group.rank, torch.float32)[::2]  # a strided view: written back in place
            SocketBroadcast(group).run(tensor, root)
            done.append(tensor)
        return done

    results = _on_every_rank(size, member)
    for rank in range(size):
        for dtype, gathered in zip(dtypes, results[rank]):
            want = torch.stack([tensor_of(r, dtype) if dtype != torch.bool else torch.tensor([r % 2 == 0] * 3)
                                for r in range(size)])
            assert torch.equal(as_bytes(gathered), as_bytes(want)), (rank, dtype)
        for root, got in enumerate(results[rank][len(dtypes):]):
            assert torch.equal(as_bytes(got.contiguous()), as_bytes(tensor_of(root, torch.float32)[::2].contiguous()))


def _ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_a_node_with_an_ipv6_address_listens_on_it():
    groups = _connect_all(3, dist.HashStore(), address="::1")
    try:
        sums = _in_threads(lambda g: SocketRecursiveDoubling(g).run(t := torch.ones(2), ReduceOp.SUM) or t.tolist(),
                           groups)
        assert sums == [[3.0, 3.0]] * 3
    finally:
        _close(groups)


def test_the_listener_drops_strangers_and_closes_once_its_partners_are_in():
    store = dist.HashStore()
    listening = threading.Event()
    published: dict = {}

    class Watching(dist.Store):  # rank 0's store: sees the address it publishes
        def set(self, key, value):
            published["address"] = value.decode().split()
            store.set(key, value)
            listening.set()

    stranger_errors: list = []

    def stranger() -> None:  # knows the port (a scan) but not the key: dropped, and rank 1 still gets in
        listening.wait(10)
        host, port, key_hex = published["address"]
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(b"\0" * 32 + (1).to_bytes(4, "big"))
            try:
                stranger_errors.append(conn.recv(1))  # b"": the listener closed it
            except OSError as exc:
                stranger_errors.append(exc)

    groups: list = [None, None]

    def rank0() -> None:
        groups[0] = PeerSockets.connect(Watching(), 0, 2, "127.0.0.1", 10)

    def rank1() -> None:
        time.sleep(0.5)  # after the stranger
        groups[1] = PeerSockets.connect(store, 1, 2, "127.0.0.1", 10)

    threads = [threading.Thread(target=f) for f in (rank0, stranger, rank1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    try:
        assert groups[0] is not None and groups[1] is not None
        assert stranger_errors and (stranger_errors[0] == b"" or isinstance(stranger_errors[0], OSError))
        host, port, _ = published["address"]
        with pytest.raises(ConnectionRefusedError):  # nothing listens any more
            socket.create_connection((host, int(port)), timeout=5)
        sums = _in_threads(lambda g: SocketRecursiveDoubling(g).run(t := torch.ones(2), ReduceOp.SUM) or t.tolist(),
                           groups)
        assert sums == [[2.0, 2.0], [2.0, 2.0]]
    finally:
        _close(groups)


def test_a_partner_that_ends_fails_the_op_at_once_naming_it():
    groups = _connect_all(3, dist.HashStore(), timeout_s=30)
    try:
        groups[2].close()  # rank 2's process ended: the kernel closes its connections

        def reduce_as_the_engine_does(group: PeerSockets) -> None:
            try:
                SocketRecursiveDoubling(group).run(torch.ones(4), ReduceOp.SUM)
            except BaseException:
                group.close()  # a failed engine closes its communicator: its partners fail at once too
                raise

        started = time.monotonic()
        errors = _in_threads(reduce_as_the_engine_does, groups[:2])
        assert time.monotonic() - started < 5  # not the 30 s timeout
        # rank 0 waited for rank 2's part (rank 2 folds into rank 0); rank 1 for rank 0, which then closed
        assert isinstance(errors[0], ConnectionError) and "rank 2 closed its connection" in str(errors[0])
        assert isinstance(errors[1], ConnectionError) and "rank 0 closed its connection" in str(errors[1])
    finally:
        _close(groups)


def test_a_partner_that_ends_in_the_middle_of_a_large_allreduce_fails_it_at_once_naming_it():
    """The halving-doubling streams: rank 1 sends one piece of its half, then its process ends. Rank 0,
    which reduced that piece and is still sending its own half, fails at once, not at the timeout."""
    groups = _connect_all(2, dist.HashStore(), timeout_s=30)
    try:
        def member(group: PeerSockets):
            if group.rank == 1:
                piece = torch.ones(1 << 18)  # 1 MiB of float32: a piece of its half, then it ends
                group.transfer(0, memoryview(piece.numpy()).cast("B"), None)
                group.close()
                return None
            SocketHalvingDoubling(group).run(torch.ones(8 << 20), ReduceOp.SUM)  # 32 MiB

        started = time.monotonic()
        outcome = _in_threads(member, groups)
        assert time.monotonic() - started < 5
        assert isinstance(outcome[0], ConnectionError) and "rank 1" in str(outcome[0]), outcome[0]
    finally:
        _close(groups)


def test_a_partner_that_never_connects_fails_the_connect_after_the_timeout_naming_it():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not connect within timeout_s"):
        PeerSockets.connect(dist.HashStore(), 0, 2, "127.0.0.1", 0.5)  # rank 1 never starts
    assert time.monotonic() - started < 5


class _EpochStore(dist.Store):
    """An in-memory store whose reads fail, as the coordinator's do, once its epoch is over."""

    def __init__(self) -> None:
        super().__init__()
        self._store = dist.HashStore()
        self.over = threading.Event()

    def set(self, key, value):
        self._store.set(key, value)

    def get(self, key):
        if self.over.is_set():
            from hvdray.collective.errors import HorovodInternalError

            raise HorovodInternalError("the membership epoch of rendezvous key(s) is over")
        return self._store.get(key)

    def wait(self, keys, timeout=None):
        self._store.wait(keys)


def test_a_rendezvous_that_ends_while_a_partner_is_awaited_fails_the_connect_at_once():
    """A partner that dies before it connects never will: the listener asks the store now and then, and
    gives up as soon as the rendezvous is over (an elastic epoch abandoned) instead of at timeout_s."""
    from hvdray.collective.errors import HorovodInternalError

    store = _EpochStore()
    threading.Timer(0.5, store.over.set).start()
    started = time.monotonic()
    with pytest.raises(HorovodInternalError, match="epoch"):
        PeerSockets.connect(store, 0, 2, "127.0.0.1", 60.0)  # rank 1 never starts
    assert time.monotonic() - started < 5


def test_a_silent_partner_fails_the_op_after_the_timeout():
    groups = _connect_all(2, dist.HashStore(), timeout_s=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank 0's exchange with rank 1 did not finish within 0.5 s \(timeout_s\)"):
            SocketRecursiveDoubling(groups[0]).run(torch.ones(4), ReduceOp.SUM)  # rank 1 never joins this op
        assert 0.4 < time.monotonic() - started < 5
    finally:
        _close(groups)


def test_closing_wakes_a_thread_blocked_on_a_partner():
    groups = _connect_all(2, dist.HashStore(), timeout_s=30)
    try:
        outcome: list = []

        def blocked() -> None:
            try:
                SocketRecursiveDoubling(groups[0]).run(torch.ones(4), ReduceOp.SUM)
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome.append(exc)

        thread = threading.Thread(target=blocked)
        thread.start()
        time.sleep(0.3)
        started = time.monotonic()
        groups[1].close()  # the partner's communicator closes (its engine failed)
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - started < 5
        assert isinstance(outcome[0], ConnectionError)
    finally:
        _close(groups)


def test_large_messages_in_both_directions_at_once_do_not_block_each_other():
    """Each side sends and receives together (non-blocking), so a message far beyond the kernel's socket
    buffers goes through even when both partners send at once."""
    groups = _connect_all(2, dist.HashStore())
    try:
        def exchange(group: PeerSockets) -> bool:
            mine = torch.full((4 << 20,), group.rank, dtype=torch.uint8)  # 4 MiB each way
            theirs = torch.empty_like(mine)
            group.transfer(1 - group.rank, memoryview(mine.numpy()), memoryview(theirs.numpy()))
            return bool((theirs == 1 - group.rank).all())

        assert _in_threads(exchange, groups) == [True, True]
    finally:
        _close(groups)

"""Allreduces, allgathers and broadcasts of every size over direct TCP connections between ranks, run by
the engine thread itself.

A Gloo op hands the work to the process group's worker thread, whose receive waits for the Gloo
device's own loop thread: several thread wake-ups per op. On the 2-core development machine a 2-rank
Gloo allgather of 8 bytes (the engine's flag exchange) took 0.6-0.8 ms where a round trip over a TCP
connection between the same processes takes about 0.07 ms. :class:`PeerSockets` connects each rank to
its partners of a recursive doubling (``gloo.recursive_doubling``: about log2 P connections per rank,
P log2 P in all, not a full mesh), and :class:`SocketRecursiveDoubling` runs small allreduces over
them: the calling thread sends, waits in ``poll`` and receives, with no other thread in between.
Larger allreduces take :class:`SocketHalvingDoubling` over the same partners: a reduce-scatter by
recursive halving and an allgather by recursive doubling, which moves as many bytes per rank as Gloo's
ring in log2 P steps instead of P - 1.
:class:`SocketAllgather` gathers over the same partners (each round swaps every row a rank holds), and
:class:`SocketBroadcast` sends down a binomial tree over them.
Ranks on one node that share a segment (``shm/``) need none of this: a single-node job's global group has no
sockets (its process sets, plain Gloo groups, do).

Connecting goes through the job's closed rendezvous, as Gloo's does: every rank that has a partner
above it listens on the node's address (the one Gloo uses, or the ``nics`` interface's) and publishes
its port and a fresh random key under the store; the higher rank of each pair connects and presents
that key and its rank. The listener accepts its partners only, drops any other connection, and closes
once every partner is in, so no port stays open while the job runs.

A partner that ends (its process killed, its communicator closed) closes its connections, and every
rank blocked on one fails at once; a silent partner fails the op after the group's timeout.
"""

from __future__ import annotations

import fcntl
import hmac
import secrets
import select
import socket
import struct
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from hvdray.collective.errors import NetworkDeviceError
from hvdray.collective.transport.gloo import recursive_doubling
from hvdray.collective.transport.reductions import REDUCERS, TransportOp
from hvdray.collective.transport.strategy import AllgatherStrategy, AllreduceStrategy, BroadcastStrategy, on_contiguous

#: the largest allreduce (bytes of one rank's tensor) the recursive doubling takes; larger ones take the
#: halving-doubling, which does not send the whole message log2 P times. ``python benchmarks/gloo_small.py
#: --ranks 2 4 8`` (2026-11-28, loopback) had the recursive doubling ahead of Gloo's allreduce, its
#: allgather + reduce and its recursive doubling at every size from 12 B to 1 MB among 2, 4 and 8
#: processes (1 MB: 2.8x, 2.1x and 3.7x Gloo's allreduce), and at 4 MB behind Gloo's ring among 4 and 8
#: (0.86x, 0.83x).
SOCKET_ALLREDUCE_BYTES = 1 << 20

#: the halving-doubling receives what it reduces in pieces of this many bytes, reduced while in the cache
HALVING_PIECE_BYTES = 1 << 20

_KEY_BYTES = 32
_HELLO = struct.Struct(f"!{_KEY_BYTES}sI")  # the listener's key, then the connecting rank
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_address(interface: str) -> str:
    """The IPv4 address of the network interface ``interface`` (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = struct.pack("256s", interface.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)[20:24])
        except OSError as exc:
            raise NetworkDeviceError(
                f"the network interface {interface!r} (nics) on node {socket.gethostname()} has no IPv4 "
                f"address for hvdray's own connections between ranks (peer_sockets): {exc}"
            ) from exc


class PeerSockets:
    """This rank's TCP connections to its recursive-doubling partners in a group of ``size`` ranks, and
    the blocking exchanges over them. Used by one thread at a time (the engine's); :meth:`close` may
    come from another and wakes that thread at once."""

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket], timeout_s: float) -> None:
        self.rank = rank
        self.size = size
        self._peers = peers
        self._timeout_s = timeout_s
        self.steps = tuple(recursive_doubling(rank, size))

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, address: str, timeout_s: float) -> "PeerSockets":
        """Connect to this rank's partners through ``store`` (keys ``"<rank>"``), listening on ``address``."""
        below, above = partners(rank, size)
        deadline = time.monotonic() + timeout_s
        peers: dict[int, socket.socket] = {}
        listener: Optional[socket.socket] = None
        try:
            own = None
            if above:
                family = socket.AF_INET6 if ":" in address else socket.AF_INET
                listener = socket.create_server((address, 0), family=family)
                key = secrets.token_bytes(_KEY_BYTES)
                own = f"{address} {listener.getsockname()[1]} {key.hex()}".encode()
            for peer, record in partner_records(store, rank, size, own).items():
                host, port, key_hex = record.decode().split()
                conn = socket.create_connection((host, int(port)), timeout=_left(deadline, f"connect to rank {peer}"))
                peers[peer] = conn
                conn.sendall(_HELLO.pack(bytes.fromhex(key_hex), rank))
            if listener is not None:
                _accept_partners(listener, key, set(above), peers, deadline)
        except BaseException:
            for conn in peers.values():
                conn.close()
            raise
        finally:
            if listener is not None:
                listener.close()
        for conn in peers.values():
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
        return cls(rank, size, peers, timeout_s)

    def close(self) -> None:
        """Close every connection; a thread blocked on one (here or at a partner) fails at once."""
        peers, self._peers = self._peers, {}
        for conn in peers.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the partner closed first
            conn.close()

    # -- blocking transfers (the calling thread does all the work) ------------------------------------
    def transfer(
        self, peer: int, send: Optional[memoryview], receive: Optional[memoryview],
        consume: Optional[Callable[[int], None]] = None, total: int = 0,
    ) -> None:
        """Send ``send`` to ``peer`` and receive from it, both at once (either may be None). Without
        ``consume``, ``receive``'s length arrives into it. With ``consume``, ``total`` bytes arrive through
        ``receive`` as a window: each time it is full, and at the end, ``consume(n)`` takes the ``n`` bytes
        in it before it is filled again, while this rank's own sending goes on as far as the kernel takes it."""
        conn = self._peers.get(peer)
        if conn is None:
            raise ConnectionError(f"rank {self.rank}'s connection to rank {peer} is closed")
        deadline = time.monotonic() + self._timeout_s
        sent = got = filled = 0
        to_send = len(send) if send is not None else 0
        window = len(receive) if receive is not None else 0
        to_get = total if consume is not None else window
        poller = None
        while True:
            try:
                if sent < to_send:
                    sent += _send_some(conn, send[sent:])
                if got < to_get:
                    received = _receive_some(conn, receive[filled:min(window, filled + to_get - got)])
                else:
                    received = -1
            except OSError as exc:
                raise ConnectionError(f"rank {self.rank}'s connection to rank {peer} failed: {exc}") from exc
            if received == 0:
                raise ConnectionError(f"rank {peer} closed its connection to rank {self.rank} (it ended or failed)")
            if received > 0:
                got += received
                filled += received
                if consume is not None and (filled == window or got == to_get):
                    consume(filled)
                    filled = 0
            if sent >= to_send and got >= to_get:
                return
            if poller is None:
                poller = select.poll()
                poller.register(conn, 0)
            poller.modify(conn, (select.POLLIN if got < to_get else 0) | (select.POLLOUT if sent < to_send else 0))
            left = deadline - time.monotonic()
            if left <= 0 or not _poll(poller, left):
                raise TimeoutError(
                    f"rank {self.rank}'s exchange with rank {peer} did not finish within {self._timeout_s} s "
                    "(timeout_s): it is not running this collective, or cannot be reached"
                )


def partners(rank: int, size: int) -> tuple[list[int], list[int]]:
    """``rank``'s recursive-doubling partners below it (it connects to them) and above it (they connect to
    it: it listens)."""
    peers = {peer for _, peer, _ in recursive_doubling(rank, size)}
    return sorted(p for p in peers if p < rank), sorted(p for p in peers if p > rank)


def partner_records(store: dist.Store, rank: int, size: int, own: Optional[bytes]) -> dict[int, bytes]:
    """What a rank asks of the store to connect: it publishes ``own`` (its listener's address and key,
    when it has partners above it), then waits for the records of its partners below it and reads them
    (one ``set`` and one ``wait`` per rank, about log2 P keys read: ``benchmarks/control_plane_scale.py``
    replays it)."""
    below, _ = partners(rank, size)
    if own is not None:
        store.set(str(rank), own)
    if not below:
        return {}
    store.wait([str(peer) for peer in below])
    return {peer: store.get(str(peer)) for peer in below}


def _send_some(conn: socket.socket, data: memoryview) -> int:
    """Bytes of ``data`` the non-blocking ``conn`` took now (0 while its buffer is full)."""
    try:
        return conn.send(data)
    except BlockingIOError:
        return 0


def _receive_some(conn: socket.socket, into: memoryview) -> int:
    """Bytes received into ``into`` now: -1 while nothing has arrived, 0 once the partner has closed."""
    try:
        return conn.recv_into(into)
    except BlockingIOError:
        return -1


def _poll(poller: "select.poll", seconds: float) -> bool:
    """Whether the registered socket became ready (or hung up) within ``seconds``."""
    return bool(poller.poll(max(1, int(seconds * 1000))))


def _left(deadline: float, what: str) -> float:
    """Seconds left before ``deadline`` to ``what`` (raises once none are)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"could not {what} within timeout_s (the ranks' own connections, peer_sockets)")
    return left


def _accept_partners(
    listener: socket.socket, key: bytes, expected: set[int], peers: dict[int, socket.socket], deadline: float
) -> None:
    """Accept a connection from each rank of ``expected`` that presents ``key``; drop any other."""
    while expected:
        listener.settimeout(_left(deadline, f"hear from rank(s) {sorted(expected)}"))
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            raise TimeoutError(
                f"rank(s) {sorted(expected)} did not connect within timeout_s (the ranks' own connections, "
                "peer_sockets)"
            ) from None
        try:
            conn.settimeout(min(5.0, _left(deadline, f"hear from rank(s) {sorted(expected)}")))
            hello = _receive_exactly(conn, _HELLO.size)
            presented, peer = _HELLO.unpack(hello)
            if not hmac.compare_digest(presented, key) or peer not in expected:
                raise PermissionError(f"a connection presented a wrong key or rank {peer}")
        except (OSError, PermissionError, struct.error):
            conn.close()  # not one of this rank's partners: keep waiting for them
            continue
        expected.discard(peer)
        peers[peer] = conn


def _receive_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed during the hello")
        data += chunk
    return bytes(data)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable flat byte view of the contiguous ``tensor`` (any dtype and shape)."""
    if not tensor.is_contiguous():
        raise ValueError("hvdray's connections move contiguous tensors only (a reshape would copy)")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


class SocketRecursiveDoubling(AllreduceStrategy):
    """Small allreduces (at most :data:`SOCKET_ALLREDUCE_BYTES`) as a recursive doubling over
    :class:`PeerSockets`: the engine's per-tick flags and small tensors, in one thread."""

    name = "socket recursive doubling"

    def __init__(self, peers: PeerSockets) -> None:
        self._peers = peers
        self._size = peers.size

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return (
            self._size > 1 and op in REDUCERS
            and tensor.numel() * tensor.element_size() <= SOCKET_ALLREDUCE_BYTES
        )

    def run(self, tensor: torch.Tensor, op: TransportOp) -> None:
        if tensor.numel():
            reducer = REDUCERS[op]
            on_contiguous(tensor, lambda flat: _recursive_doubling(self._peers, flat, reducer))


def _recursive_doubling(peers: PeerSockets, flat: torch.Tensor, reducer: Callable[..., torch.Tensor]) -> None:
    """Reduce the flat contiguous ``flat`` in place across ``peers``' group with ``reducer``."""
    theirs = torch.empty_like(flat)
    mine, received = _bytes_of(flat), _bytes_of(theirs)
    for kind, peer, _ in peers.steps:
        if kind == "send":
            peers.transfer(peer, mine, None)
        elif kind == "receive":
            peers.transfer(peer, None, mine)
        else:
            peers.transfer(peer, mine if kind == "exchange" else None, received)
            reducer(flat, theirs, out=flat)


class SocketHalvingDoubling(AllreduceStrategy):
    """Large allreduces (above :data:`SOCKET_ALLREDUCE_BYTES`) over :class:`PeerSockets`: a reduce-scatter
    by recursive halving, then an allgather by recursive doubling, between the same partners as the
    small messages' recursive doubling. Each rank sends and receives about 2 S (P-1)/P bytes of an
    S-byte message, as in Gloo's ring, in 2 log2 P exchanges instead of the ring's 2 (P-1) hops, and
    in the engine's own thread."""

    name = "socket halving-doubling"

    def __init__(self, peers: PeerSockets) -> None:
        self._peers = peers
        self._size = peers.size
        self._scratch = torch.empty(HALVING_PIECE_BYTES, dtype=torch.uint8)

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return self._size > 1 and op in REDUCERS

    def run(self, tensor: torch.Tensor, op: TransportOp) -> None:
        if tensor.numel():
            reducer = REDUCERS[op]
            on_contiguous(tensor, lambda flat: _halving_doubling(self._peers, flat, reducer, self._scratch))


def _halving_doubling(
    peers: PeerSockets, flat: torch.Tensor, reducer: Callable[..., torch.Tensor], scratch: torch.Tensor
) -> None:
    """Reduce the flat contiguous ``flat`` in place across ``peers``' group with ``reducer``, receiving
    what is reduced piece by piece into ``scratch`` (uint8; its bytes a multiple of every element size).

    With P the largest power of two up to the group's size, ranks from P on first fold their data into
    rank ``rank - P`` and get the result back at the end (as in :func:`~hvdray.collective.transport.gloo.
    recursive_doubling`). Among ranks 0..P-1, round k pairs each rank with the one differing in bit k:
    both hold the same block, each keeps one half (the lower for the rank whose bit is clear), sends the
    other and reduces its partner's copy of the kept half into its own. After log2 P rounds each rank
    holds one P-th of the result, reduced by that rank alone; the rounds then run backwards, each
    partner sending its part and receiving the other's, so every rank ends with the same bits."""
    rank, size = peers.rank, peers.size
    power = 1 << (size.bit_length() - 1)
    if rank >= power:
        mine = _bytes_of(flat)
        peers.transfer(rank - power, mine, None)
        peers.transfer(rank - power, None, mine)
        return
    folded = rank + power < size
    pieces = scratch.view(flat.dtype)
    if folded:
        _reduce_exchange(peers, rank + power, flat[:0], flat, pieces, reducer)
    lo, hi = 0, flat.numel()
    blocks = []
    bit = 1
    while bit < power:
        mid = lo + (hi - lo) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & bit else ((lo, mid), (mid, hi))
        blocks.append((lo, hi))
        _reduce_exchange(peers, rank ^ bit, flat[give[0]:give[1]], flat[keep[0]:keep[1]], pieces, reducer)
        lo, hi = keep
        bit <<= 1
    while blocks:
        bit >>= 1
        whole_lo, whole_hi = blocks.pop()
        other = (whole_lo, lo) if lo > whole_lo else (hi, whole_hi)
        peers.transfer(rank ^ bit, _bytes_of(flat[lo:hi]), _bytes_of(flat[other[0]:other[1]]))
        lo, hi = whole_lo, whole_hi
    if folded:
        peers.transfer(rank + power, _bytes_of(flat), None)


def _reduce_exchange(
    peers: PeerSockets, peer: int, give: torch.Tensor, keep: torch.Tensor, pieces: torch.Tensor,
    reducer: Callable[..., torch.Tensor],
) -> None:
    """Send ``give`` to ``peer`` while receiving its copy of ``keep`` and reducing it into ``keep``, a
    piece of ``pieces``' length at a time: each piece is reduced while it is still in the cache, and
    while the rest of ``give`` keeps going out."""
    done = 0

    def reduce_piece(nbytes: int) -> None:
        nonlocal done
        count = nbytes // keep.element_size()
        part = keep[done:done + count]
        reducer(part, pieces[:count], out=part)
        done += count

    peers.transfer(peer, _bytes_of(give), _bytes_of(pieces), reduce_piece, keep.numel() * keep.element_size())


class SocketAllgather(AllgatherStrategy):
    """Allgathers over :class:`PeerSockets` (the lengths and messages of the engine's full rounds, tensors
    of any size): a recursive doubling, each round exchanging every row a rank holds with its partner,
    so that each rank receives each other rank's row once ((P-1)/P of the result, as Gloo's ring), in
    log2 P exchanges, on the engine thread."""

    name = "socket allgather"

    def __init__(self, peers: PeerSockets) -> None:
        self._peers = peers
        self._size = peers.size

    def serves(self, tensor: torch.Tensor) -> bool:
        return self._size > 1

    def run(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        if not tensor.numel():
            return
        rows = out.view(self._size, -1).view(torch.uint8)
        rows[self._peers.rank].copy_(tensor.contiguous().view(-1).view(torch.uint8))
        _doubling_allgather(self._peers, rows)


def _doubling_allgather(peers: PeerSockets, rows: torch.Tensor) -> None:
    """Fill every row of ``rows`` (uint8, one row per rank, this rank's own already in place) with its
    rank's bytes.

    With P the largest power of two up to the group's size, rank ``r + P`` (where there is one) first
    hands its row to rank ``r``, which then holds rows r and r + P. In round k each rank of 0..P-1 and
    its partner differing in bit k swap what they hold: the rows of the 2^k ranks sharing their higher
    bits (one contiguous block), and those ranks' rows from P on (a second block). After log2 P rounds
    ranks 0..P-1 hold every row; each sends the whole result to its rank ``r + P`` last."""
    rank, size = peers.rank, peers.size
    power = 1 << (size.bit_length() - 1)
    if rank >= power:
        peers.transfer(rank - power, _bytes_of(rows[rank]), None)
        peers.transfer(rank - power, None, _bytes_of(rows))
        return
    folded = rank + power < size
    if folded:
        peers.transfer(rank + power, None, _bytes_of(rows[rank + power]))
    bit = 1
    while bit < power:
        mine, theirs = rank & ~(bit - 1), (rank ^ bit) & ~(bit - 1)
        peers.transfer(rank ^ bit, _bytes_of(rows[mine:mine + bit]), _bytes_of(rows[theirs:theirs + bit]))
        mine_extra, theirs_extra = rows[power + mine:power + mine + bit], rows[power + theirs:power + theirs + bit]
        if mine_extra.numel() or theirs_extra.numel():
            peers.transfer(rank ^ bit, _bytes_of(mine_extra), _bytes_of(theirs_extra))
        bit <<= 1
    if folded:
        peers.transfer(rank + power, _bytes_of(rows), None)


class SocketBroadcast(BroadcastStrategy):
    """Broadcasts over :class:`PeerSockets` (parameters, objects, tensors of any size): a binomial tree over
    the recursive-doubling partners, rooted at ``root``; each rank but the root receives the tensor once."""

    name = "socket broadcast"

    def __init__(self, peers: PeerSockets) -> None:
        self._peers = peers
        self._size = peers.size

    def serves(self, tensor: torch.Tensor, root: int) -> bool:
        return self._size > 1

    def run(self, tensor: torch.Tensor, root: int) -> None:
        if tensor.numel():
            on_contiguous(tensor, lambda flat: _binomial_broadcast(self._peers, _bytes_of(flat), root))


def _binomial_broadcast(peers: PeerSockets, data: memoryview, root: int) -> None:
    """Give every rank ``root``'s ``data``, in place.

    With P the largest power of two up to the group's size, a root from P on first hands its data to
    rank ``root - P``, the tree's root then. Among ranks 0..P-1, numbered from the tree's root by XOR (so
    that partners stay partners), the rounds go from the highest bit to the lowest: each rank that holds
    the data sends it to its partner differing in that bit. Last, each rank r holds it for rank
    ``r + P`` (where there is one, and it is not the root)."""
    rank, size = peers.rank, peers.size
    power = 1 << (size.bit_length() - 1)
    top = root - power if root >= power else root
    if rank >= power:
        if rank == root:
            peers.transfer(rank - power, data, None)
        else:
            peers.transfer(rank - power, None, data)
        return
    if root >= power and rank == top:
        peers.transfer(root, None, data)
    virtual = rank ^ top
    bit = power >> 1
    while bit:
        low = virtual & (2 * bit - 1)
        if low == 0:
            peers.transfer(rank ^ bit, data, None)
        elif low == bit:
            peers.transfer(rank ^ bit, None, data)
        bit >>= 1
    if rank + power < size and rank + power != root:
        peers.transfer(rank + power, data, None)


__all__ = [
    "PeerSockets", "partner_records", "partners", "SocketAllgather", "SocketBroadcast", "SocketHalvingDoubling",
    "SocketRecursiveDoubling", "SOCKET_ALLREDUCE_BYTES",
    "interface_address",
]

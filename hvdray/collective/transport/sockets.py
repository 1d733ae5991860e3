"""The ranks' own TCP connections: each rank connected to its recursive-doubling partners only, and
the blocking exchanges over them, done by the calling thread (the engine's) itself.

A Gloo op hands the work to the process group's worker thread, whose receive waits for the Gloo
device's own loop thread: several thread wake-ups per op. On the 2-core development machine a 2-rank
Gloo allgather of 8 bytes (the engine's flag exchange) took 0.6-0.8 ms where a round trip over a TCP
connection between the same processes takes about 0.07 ms. :class:`PeerSockets` connects each rank to
its partners of a recursive doubling (``gloo.recursive_doubling``: about log2 P connections per rank,
P log2 P in all, not a full mesh); the collectives over them are ``socket_strategies.py``'s. Ranks on
one node that share a segment (``shm/``) need none of this: a single-node job's global group has no
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

import torch.distributed as dist

from hvdray.collective.errors import NetworkDeviceError
from hvdray.collective.transport.gloo import recursive_doubling

_KEY_BYTES = 32
#: how often a listener still waiting for its partners asks the store whether the rendezvous goes on
_PARTNER_POLL_S = 1.0
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
                # a partner that dies before it connects never will: meanwhile the store is read now and then
                # (this rank's own record), which fails at once when the rendezvous is over (an elastic epoch
                # given up because a member left) instead of at timeout_s
                _accept_partners(listener, key, set(above), peers, deadline, lambda: store.get(str(rank)))
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
    listener: socket.socket, key: bytes, expected: set[int], peers: dict[int, socket.socket], deadline: float,
    still_forming: Callable[[], object] = lambda: None,
) -> None:
    """Accept a connection from each rank of ``expected`` that presents ``key``; drop any other. Every
    :data:`_PARTNER_POLL_S` without one, ``still_forming()`` runs (it raises when the rendezvous is over)."""
    while expected:
        left = _left(deadline, f"hear from rank(s) {sorted(expected)}")
        listener.settimeout(min(left, _PARTNER_POLL_S))
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if time.monotonic() < deadline:
                still_forming()
                continue
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


__all__ = ["PeerSockets", "interface_address", "partner_records", "partners"]

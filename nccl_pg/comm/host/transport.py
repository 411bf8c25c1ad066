"""A full mesh of TCP connections between the ranks of a host communicator,
and the engine that moves data over it.

Every algorithm is a sequence of ``exchange()`` steps: a set of sends and
receives that progress together on non-blocking sockets (so paired sends
never deadlock, whatever their size). Each message carries a header with a
per-peer sequence number, the operation's kind and its size, so ranks that
disagree (one in all_reduce, another in broadcast; different sizes) get an
error naming the peer and the difference, instead of garbage or a hang.

Peer death shows up as EOF or a reset on that peer's socket; the mesh is then
broken: it closes every connection, so the peers' peers see EOF too and the
failure spreads within milliseconds instead of leaving ranks blocked.
``abort()`` wakes a blocked exchange through a pipe and does the same.

Each direction of each connection has its own lock: exchanges over different
directions run at the same time (a send to rank 1 while a receive from rank 1
waits), which the host backend's point-to-point lanes rely on.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from ...errors import DistBackendError, DistNetworkError

HEADER = struct.Struct("<QB3xQ")  # per-peer seq, op kind, payload bytes
HELLO = struct.Struct("<16sI")  # communicator token, connecting rank
_IOV_MESSAGES = 64  # messages per gather write: 2 parts each, well under Linux's IOV_MAX of 1024

_POLLERR = select.POLLERR | select.POLLHUP | select.POLLNVAL


class MeshTimeoutError(DistBackendError):
    """Init's deadline passed with ``missing`` ranks not connected."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class PeerLostError(DistBackendError):
    """A peer's connection ended (EOF or reset): it exited, crashed or aborted."""


@dataclass
class _Out:
    parts: list[memoryview]


@dataclass
class _In:
    target: memoryview
    on_done: Callable[[], None] | None
    header: bytearray = field(default_factory=lambda: bytearray(HEADER.size))
    got_header: int = 0
    got: int = 0


Send = tuple[int, memoryview]
Recv = tuple[int, memoryview, Callable[[], None] | None]


class Mesh:
    def __init__(self, rank: int, nranks: int, socks: dict[int, socket.socket], name: str,
                 op_names: tuple[str, ...]) -> None:
        self.rank, self.nranks, self.name = rank, nranks, name
        self._op_names = op_names
        self._socks = socks
        self._fd_peer = {s.fileno(): p for p, s in socks.items()}
        # Ranks of this mesh on this host (peers reached at our own address), us included.
        self.local_ranks = 1 + sum(s.getpeername()[0] == s.getsockname()[0] for s in socks.values())
        self.tree_broadcast = False  # agreed on by all ranks at init (see HostCommunicator)
        for s in socks.values():
            s.setblocking(False)
        self._send_seq = [0] * nranks
        self._recv_seq = [0] * nranks
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # (peer, 0): sending to peer, (peer, 1): receiving from it; taken in this key order (no deadlock).
        self._locks = {(p, d): threading.Lock() for p in sorted(socks) for d in (0, 1)}
        self.error: BaseException | None = None
        self._closed = False

    def local_address(self) -> str | None:
        """The address this rank's connections use (None for one rank)."""
        for s in self._socks.values():
            return s.getsockname()[0]
        return None

    # --- failure ---------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """Break the mesh: wake any exchange and close every connection, so
        peers blocked on us see EOF instead of waiting forever."""
        if self.error is None:
            self.error = error
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        for s in self._socks.values():
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._holding(self._locks):  # exchanges in progress finish (or are failed) first
            if self._closed:
                return
            self._closed = True
            for s in self._socks.values():
                s.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    @contextlib.contextmanager
    def _holding(self, keys: Iterable[tuple[int, int]]) -> Iterator[None]:
        locks = [self._locks[k] for k in sorted(set(keys))]
        for lock in locks:
            lock.acquire()
        try:
            yield
        finally:
            for lock in reversed(locks):
                lock.release()

    @contextlib.contextmanager
    def _directions(self, sends_to: Iterable[int], recvs_from: Iterable[int]) -> Iterator[None]:
        """Hold the connection directions an exchange uses; a failure inside
        breaks the mesh (peers see EOF) and is raised as the mesh's error."""
        keys = {(p, 0) for p in sends_to} | {(p, 1) for p in recvs_from}
        missing = sorted({p for p, _ in keys if p not in self._socks})
        if missing:
            raise DistBackendError(f"{self.name}: no connection to rank {missing[0]}")
        with self._holding(keys):
            if self.error is not None:
                raise self.error
            if self._closed:
                raise DistBackendError(f"{self.name}: communicator is destroyed")
            try:
                yield
            except BaseException as exc:
                if self.error is None:
                    self.fail(exc)
                raise self.error from None

    # --- the engine ------------------------------------------------------------

    def exchange(self, kind: int, sends: list[Send], recvs: list[Recv]) -> None:
        """Deliver every send and fill every receive, all progressing at once;
        per peer, messages go in list order. ``on_done`` callbacks run as each
        receive completes (e.g. to reduce a chunk while the next arrives)."""
        with self._directions((p for p, _ in sends), (p for p, _, _ in recvs)):
            self._exchange(kind, sends, recvs)

    def recv_any(self, kind: int, target: memoryview) -> int:
        """Fill ``target`` with the first ``kind`` message to arrive from any
        peer, and return that peer. A peer whose next message belongs to
        another operation is not a candidate (it is ahead of us, in an
        operation we have not reached); with no candidate left, that is an
        error naming what the peers are in."""
        peers = sorted(self._socks)
        with self._directions((), peers):
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for p in peers:
                poller.register(self._socks[p].fileno(), select.POLLIN)
            elsewhere: dict[int, int] = {}
            while len(elsewhere) < len(peers):
                for fd, _ in poller.poll():
                    if fd == self._wake_r:
                        raise self.error or DistBackendError(f"{self.name}: aborted")
                    peer = self._fd_peer[fd]
                    try:
                        head = self._socks[peer].recv(HEADER.size, socket.MSG_PEEK)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as exc:
                        raise self._lost(peer, exc.strerror or str(exc)) from None
                    if not head:
                        raise self._lost(peer, "end of stream")
                    if len(head) < HEADER.size:
                        continue  # the rest of the header is on its way
                    their_kind = _kind(head)
                    if their_kind == kind:
                        self._exchange(kind, [], [(peer, target, None)])
                        return peer
                    elsewhere[peer] = their_kind
                    poller.unregister(fd)
            detail = ", ".join(f"rank {p} in {self._op_name(k)}" for p, k in sorted(elsewhere.items()))
            raise DistBackendError(f"{self.name}: rank {self.rank} waits to receive from any rank, but every peer "
                                   f"has gone on to another operation ({detail}): ranks issued different operations")

    def _exchange(self, kind: int, sends: list[Send], recvs: list[Recv]) -> None:
        outs: dict[int, deque[_Out]] = {}
        ins: dict[int, deque[_In]] = {}
        for peer, data in sends:
            hdr = HEADER.pack(self._send_seq[peer], kind, data.nbytes)
            self._send_seq[peer] += 1
            parts = [memoryview(hdr), data.cast("B")] if data.nbytes else [memoryview(hdr)]
            outs.setdefault(peer, deque()).append(_Out(parts))
        for peer, target, on_done in recvs:
            ins.setdefault(peer, deque()).append(_In(target.cast("B"), on_done))

        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        masks: dict[int, int] = {}

        def update(peer: int) -> None:
            mask = (select.POLLOUT if outs.get(peer) else 0) | (select.POLLIN if ins.get(peer) else 0)
            fd = self._socks[peer].fileno()
            if mask != masks.get(peer, 0):
                if peer in masks and masks[peer]:
                    poller.modify(fd, mask) if mask else poller.unregister(fd)
                elif mask:
                    poller.register(fd, mask)
                masks[peer] = mask

        for peer in set(outs) | set(ins):
            if peer not in self._socks:
                raise DistBackendError(f"{self.name}: no connection to rank {peer}")
            self._progress_out(peer, outs)  # most small messages go out without a poll
            update(peer)
        while any(outs.values()) or any(ins.values()):
            for fd, ev in poller.poll():
                if fd == self._wake_r:
                    raise self.error or DistBackendError(f"{self.name}: aborted")
                peer = self._fd_peer[fd]
                if ev & (select.POLLIN | _POLLERR) and ins.get(peer):
                    self._progress_in(kind, peer, ins)
                if ev & (select.POLLOUT | _POLLERR) and outs.get(peer):
                    self._progress_out(peer, outs)
                update(peer)

    def _lost(self, peer: int, why: str) -> PeerLostError:
        return PeerLostError(
            f"{self.name}: lost the connection to rank {peer} ({why}); that rank exited, crashed, "
            f"or aborted its communicator"
        )

    def _progress_out(self, peer: int, outs: dict[int, deque[_Out]]) -> None:
        sock, queue = self._socks[peer], outs.get(peer)
        while queue:
            # One gather write for the queued messages: a header never leaves as a tiny segment
            # of its own (one wakeup less for the receiver), and several chunks go in one call.
            iov = [p for out in itertools.islice(queue, _IOV_MESSAGES) for p in out.parts]
            try:
                n = sock.sendmsg(iov)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise self._lost(peer, exc.strerror or str(exc)) from None
            full = n < sum(p.nbytes for p in iov)
            while n:
                parts = queue[0].parts
                k = min(n, parts[0].nbytes)
                n -= k
                if k == parts[0].nbytes:
                    parts.pop(0)
                else:
                    parts[0] = parts[0][k:]
                if not parts:
                    queue.popleft()
            if full:  # the socket buffer is full: wait for POLLOUT rather than try again now
                return

    def _progress_in(self, kind: int, peer: int, ins: dict[int, deque[_In]]) -> None:
        sock, queue = self._socks[peer], ins[peer]
        while queue:
            cur = queue[0]
            try:
                if cur.got_header < HEADER.size:
                    n = sock.recv_into(memoryview(cur.header)[cur.got_header:])
                    if n == 0:
                        raise self._lost(peer, "end of stream")
                    cur.got_header += n
                    if cur.got_header < HEADER.size:
                        continue
                    self._check_header(kind, peer, cur)
                if cur.got < cur.target.nbytes:
                    n = sock.recv_into(cur.target[cur.got:])
                    if n == 0:
                        raise self._lost(peer, "end of stream")
                    cur.got += n
                    if cur.got < cur.target.nbytes:
                        continue
            except (BlockingIOError, InterruptedError):
                return
            except PeerLostError:
                raise
            except OSError as exc:
                raise self._lost(peer, exc.strerror or str(exc)) from None
            queue.popleft()
            if cur.on_done is not None:
                cur.on_done()

    def _check_header(self, kind: int, peer: int, cur: _In) -> None:
        seq, their_kind, nbytes = HEADER.unpack(cur.header)
        if seq != self._recv_seq[peer]:
            raise DistBackendError(f"{self.name}: message {seq} from rank {peer} arrived when message "
                                   f"{self._recv_seq[peer]} was due; the stream is corrupt")
        self._recv_seq[peer] += 1
        if their_kind != kind:
            raise DistBackendError(
                f"{self.name}: rank {peer} is in {self._op_name(their_kind)} while rank {self.rank} is in "
                f"{self._op_name(kind)}: ranks issued different operations"
            )
        if nbytes != cur.target.nbytes:
            raise DistBackendError(
                f"{self.name}: in {self._op_name(kind)}, rank {peer} sent {nbytes} bytes where rank "
                f"{self.rank} expected {cur.target.nbytes}: array sizes differ across ranks"
            )

    def _op_name(self, kind: int) -> str:
        return self._op_names[kind] if kind < len(self._op_names) else f"op #{kind}"


def _kind(header: bytes) -> int:
    """The operation kind a message header carries."""
    return int(HEADER.unpack(header)[1])


# --- building the mesh ------------------------------------------------------------


def listen(host: str) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        sock.bind(infos[0][4])
        sock.listen(1024)
    except OSError as exc:
        raise DistNetworkError(f"host communicator: cannot listen on {host}: {exc}") from None
    return sock


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed during the hello")
        buf += chunk
    return bytes(buf)


def connect_mesh(rank: int, nranks: int, listener: socket.socket, lower: dict[int, tuple[str, int]],
                 token: bytes, deadline: float, name: str,
                 aborted: Callable[[], bool] = lambda: False) -> dict[int, socket.socket]:
    """Connect to every lower rank (their listeners are up before their
    addresses are published) and accept every higher one. Raises a
    DistBackendError naming the ranks missing at the deadline."""
    socks: dict[int, socket.socket] = {}
    try:
        for peer, addr in sorted(lower.items()):
            while True:
                try:
                    sock = socket.create_connection(addr, timeout=max(deadline - time.monotonic(), 0.001))
                    break
                except OSError as exc:
                    if time.monotonic() >= deadline or aborted():
                        raise DistBackendError(f"{name}: cannot connect to rank {peer} at {addr[0]}:{addr[1]}: "
                                               f"{exc}") from None
                    time.sleep(0.01)
            socks[peer] = _tune(sock)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(HELLO.pack(token, rank))
        expected = set(range(rank + 1, nranks))
        while expected:
            if aborted():
                raise DistBackendError(f"{name}: aborted during init")
            listener.settimeout(min(max(deadline - time.monotonic(), 0.001), 0.1))
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise MeshTimeoutError(f"timeout: {name}: ranks {sorted(expected)} did not connect to rank "
                                           f"{rank} before the init deadline", sorted(expected)) from None
                continue
            try:
                their_token, peer = HELLO.unpack(_recv_exact(sock, HELLO.size, deadline))
            except (OSError, ConnectionError, struct.error):
                sock.close()
                continue
            if their_token != token or peer not in expected:
                sock.close()  # a stray or a stale connection: not one of ours
                continue
            expected.discard(peer)
            socks[peer] = _tune(sock)
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    finally:
        listener.close()
    return socks

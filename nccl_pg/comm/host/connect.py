"""Connecting the mesh of a host communicator at init.

``MeshBuilder`` connects one rank to every other: every connection, outgoing
and incoming, progresses at once on non-blocking sockets with the init
deadline, a connection must prove it belongs to this communicator (its
token) before it counts, strangers and silent connections are dropped
without delaying the others, and ``cancel()`` (abort) ends the build at once.
"""

from __future__ import annotations

import errno
import hmac
import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import DistBackendError, DistNetworkError
from .wire import MeshTimeoutError

# communicator token, sender's rank, communicator size
HELLO = struct.Struct("<16sII")

_HELLO_TIMEOUT = 2.0  # seconds an incoming connection may stay silent before it is dropped
_MAX_PENDING = 64  # unproven incoming connections kept at once, besides one per rank still expected
_RETRY_FIRST, _RETRY_MAX = 0.01, 0.2  # backoff between connection attempts to a listener not up (yet)


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


@dataclass
class _Dial:
    """Our connection to a lower rank: connect, send our hello, read its answer."""

    addr: tuple[str, int]
    sock: socket.socket | None = None
    stage: str = "idle"  # idle (retry at ``retry_at``) -> connecting -> hello -> done
    answer: bytearray = field(default_factory=bytearray)
    retry_at: float = 0.0
    backoff: float = _RETRY_FIRST
    error: str = "no attempt yet"


@dataclass
class _Caller:
    """An incoming connection that has not proven yet which rank it is."""

    sock: socket.socket
    since: float
    hello: bytearray = field(default_factory=bytearray)


class MeshBuilder:
    """Connects one rank to every other: out to each lower rank, and in from
    each higher one through ``listener`` (up before our address was
    published). Each connection carries a hello both ways (token, rank,
    size), so a connection counts only once the other side proved it
    belongs to this communicator, and a frozen peer (whose kernel accepts
    connections for it) is told from a live one."""

    def __init__(self, rank: int, nranks: int, listener: socket.socket, token: bytes, name: str) -> None:
        self.rank, self.nranks, self.name = rank, nranks, name
        self._listener, self._token = listener, token
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._cancelled = False
        self._closed = False
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """End ``build()`` at once (abort); safe from any thread."""
        with self._lock:
            self._cancelled = True
            if not self._closed:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass

    def _close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _hello(self) -> bytes:
        return HELLO.pack(self._token, self.rank, self.nranks)

    def build(self, lower: dict[int, tuple[str, int]], deadline: float, timeout: float) -> dict[int, socket.socket]:
        """The connections to every other rank.
        Raises MeshTimeoutError naming the ranks missing at ``deadline``
        (``timeout`` seconds after init began), or DistBackendError when
        cancelled or when a peer is not of this communicator."""
        dials = {peer: _Dial(addr) for peer, addr in lower.items()}
        callers: dict[int, _Caller] = {}
        expected = set(range(self.rank + 1, self.nranks))
        done: dict[int, socket.socket] = {}
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        self._listener.setblocking(False)
        if expected:
            poller.register(self._listener, select.POLLIN)
        dial_fds: dict[int, int] = {}

        def drop_dial(peer: int, why: str) -> None:
            d = dials[peer]
            if d.sock is not None:
                dial_fds.pop(d.sock.fileno(), None)
                poller.unregister(d.sock)
                d.sock.close()
            d.sock, d.stage, d.error = None, "idle", why
            d.retry_at, d.backoff = time.monotonic() + d.backoff, min(d.backoff * 2, _RETRY_MAX)

        def drop_caller(fd: int) -> None:
            c = callers.pop(fd)
            poller.unregister(fd)
            c.sock.close()

        try:
            while dials or expected:
                now = time.monotonic()
                if self._cancelled:
                    raise DistBackendError(f"{self.name}: aborted during init on rank {self.rank}")
                if now >= deadline:
                    raise self._timeout(dials, expected, timeout)
                for peer, d in dials.items():
                    if d.stage == "idle" and d.retry_at <= now:
                        self._dial(peer, d)
                        if d.sock is None:
                            drop_dial(peer, d.error)
                        else:
                            dial_fds[d.sock.fileno()] = peer
                            poller.register(d.sock, select.POLLOUT)
                for fd in [fd for fd, c in callers.items() if now - c.since > _HELLO_TIMEOUT]:
                    drop_caller(fd)  # silent: a stranger, or a peer that will dial again
                wake = min([deadline] + [d.retry_at for d in dials.values() if d.stage == "idle"]
                           + [c.since + _HELLO_TIMEOUT for c in callers.values()])
                for fd, ev in poller.poll(max(math.ceil((wake - now) * 1000), 1)):
                    if fd == self._wake_r:
                        continue  # cancelled: raised at the top of the loop
                    if fd == self._listener.fileno():
                        self._accept(poller, callers, len(expected) + _MAX_PENDING, drop_caller)
                    elif fd in dial_fds:
                        peer = dial_fds[fd]
                        d = dials[peer]
                        try:
                            if self._progress_dial(peer, d, ev, poller):
                                del dials[peer], dial_fds[fd]
                                poller.unregister(fd)
                                assert d.sock is not None
                                done[peer] = _tune(d.sock)
                        except OSError as exc:
                            drop_dial(peer, exc.strerror or str(exc))
                    elif fd in callers:
                        proven = self._progress_caller(callers[fd], expected)
                        if proven is None:
                            continue
                        c = callers.pop(fd)
                        poller.unregister(fd)
                        if proven < 0:
                            c.sock.close()
                            continue
                        expected.discard(proven)
                        done[proven] = _tune(c.sock)
        except BaseException:
            for sock in done.values():
                sock.close()
            for d in dials.values():
                if d.sock is not None:
                    d.sock.close()
            raise
        finally:
            for c in callers.values():
                c.sock.close()
            self._close()
        return done

    def _dial(self, peer: int, d: _Dial) -> None:
        host, port = d.addr
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        except OSError as exc:
            d.error = f"cannot reach {host}:{port}: {exc}"
            return
        sock.setblocking(False)
        err = sock.connect_ex(infos[0][4])
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            d.error = f"{os.strerror(err)} at {host}:{port}"
            return
        d.sock, d.stage, d.answer = sock, "connecting", bytearray()

    def _progress_dial(self, peer: int, d: _Dial, ev: int, poller: select.poll) -> bool:
        """True once the peer's answer proved it is rank ``peer`` of this communicator."""
        assert d.sock is not None
        if d.stage == "connecting":
            err = d.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, f"{os.strerror(err)} at {d.addr[0]}:{d.addr[1]}")
            d.sock.send(self._hello())  # a few bytes into an empty socket buffer: they fit
            d.stage = "hello"
            poller.modify(d.sock, select.POLLIN)
            return False
        chunk = d.sock.recv(HELLO.size - len(d.answer))
        if not chunk:
            raise OSError(errno.ECONNRESET, f"rank {peer} closed the connection before answering the hello")
        d.answer += chunk
        if len(d.answer) < HELLO.size:
            return False
        token, their_rank, their_size = HELLO.unpack(d.answer)
        if not hmac.compare_digest(token, self._token) or their_rank != peer:
            raise DistBackendError(f"{self.name}: the listener at {d.addr[0]}:{d.addr[1]}, published as rank "
                                   f"{peer}'s, belongs to another communicator or rank")
        if their_size != self.nranks:
            raise DistBackendError(f"{self.name}: rank {peer} has a communicator of {their_size} ranks; rank "
                                   f"{self.rank} has {self.nranks}: ranks disagree on the group size")
        return True

    def _accept(self, poller: select.poll, callers: dict[int, _Caller], limit: int,
                drop: Callable[[int], None]) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, say: the silent ones go first, then we try again
                if callers:
                    drop(min(callers, key=lambda fd: callers[fd].since))
                return
            sock.setblocking(False)
            callers[sock.fileno()] = _Caller(sock, time.monotonic())
            poller.register(sock, select.POLLIN)
            if len(callers) > limit:
                drop(min(callers, key=lambda fd: callers[fd].since))

    def _progress_caller(self, c: _Caller, expected: set[int]) -> int | None:
        """The rank a caller proved to be (after answering it), -1 to drop
        it, None while its hello is incomplete."""
        try:
            chunk = c.sock.recv(HELLO.size - len(c.hello))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return -1
        if not chunk:
            return -1
        c.hello += chunk
        if len(c.hello) < HELLO.size:
            return None
        token, peer, size = HELLO.unpack(c.hello)
        if not hmac.compare_digest(token, self._token) or peer not in expected:
            return -1  # a stranger, or a stale or duplicate connection: not one of ours
        if size != self.nranks:
            raise DistBackendError(f"{self.name}: rank {peer} has a communicator of {size} ranks; rank "
                                   f"{self.rank} has {self.nranks}: ranks disagree on the group size")
        try:
            c.sock.send(self._hello())
        except OSError:
            return -1  # gone already; it will dial again
        return peer

    def _timeout(self, dials: dict[int, _Dial], expected: set[int], timeout: float) -> MeshTimeoutError:
        missing = sorted([*dials, *expected])
        why = []
        for peer in sorted(dials):
            d = dials[peer]
            if d.stage == "hello":
                why.append(f"rank {peer} accepted the connection but never answered the hello (frozen?)")
            else:
                why.append(f"rank {peer} could not be reached ({d.error})")
        if expected:
            why.append(f"ranks {sorted(expected)} never connected to rank {self.rank}")
        return MeshTimeoutError(f"timeout: {self.name}: rank {self.rank}: Timed out after {timeout:g} s waiting "
                                f"for ranks {missing} to connect: {'; '.join(why)}", missing)

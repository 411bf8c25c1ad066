"""What the TCPStore server keeps per client, and the sockets under it: one
connection's state (handshake phase, buffers, blocked requests), one blocked
request (a waiter), the poller, the listening socket and the file-descriptor
limit. The server itself is tcp_server.py."""

from __future__ import annotations

import logging
import math
import resource
import select
import socket
from collections.abc import Callable
from typing import Any

from ..errors import DistNetworkError

log = logging.getLogger("nccl_pg.store.tcp_server")

IN = select.POLLIN
OUT = select.POLLOUT
# A connection's phases: hello awaited, proof of the secret awaited, serving requests, closing once written.
HELLO, AUTH, READY, CLOSING = range(4)
OUT_LIMIT = 4 << 20  # bytes of unread answers before a connection's input is paused


class Waiter:
    """A blocked get, wait, multi_get or queue_pop: answered when its keys are set or at its deadline."""

    __slots__ = ("conn", "tag", "op", "keys", "deadline", "pending", "done")

    def __init__(self, conn: Conn, tag: int, op: int, keys: list[str], deadline: float) -> None:
        self.conn, self.tag, self.op, self.keys, self.deadline = conn, tag, op, keys, deadline
        self.pending = 0  # keys it is registered under and still waits for
        self.done = False


class Conn:
    """One client connection, as the server's loop sees it."""

    __slots__ = ("sock", "fd", "peer", "phase", "deadline", "inbuf", "out", "client_nonce", "server_nonce",
                 "waiters", "last_active", "events", "paused", "closed")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.phase = HELLO
        self.deadline = deadline  # of the handshake
        self.inbuf = bytearray()
        self.out = bytearray()
        self.client_nonce = b""
        self.server_nonce = b""
        self.waiters: set[Waiter] = set()
        self.last_active = deadline
        self.events = IN
        self.paused = False  # back-pressure: its requests wait until its answers are read
        self.closed = False


class Poller:
    """epoll where there is one, else poll(); ``poll`` takes seconds."""

    def __init__(self) -> None:
        impl: Any
        if hasattr(select, "epoll"):
            impl = select.epoll()
            self.poll: Callable[[float], list[tuple[int, int]]] = impl.poll  # bound: no wrapper call per turn
            self.close: Callable[[], None] = impl.close
        else:
            impl = select.poll()
            self.poll = lambda seconds: impl.poll(math.ceil(seconds * 1000))
            self.close = lambda: None
        self.register: Callable[[int, int], None] = impl.register
        self.modify: Callable[[int, int], None] = impl.modify
        self.unregister: Callable[[int], None] = impl.unregister


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (each client
    connection costs the server one descriptor); returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # e.g. macOS caps it below an infinite hard limit
            log.debug("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, target, exc)
    return soft, hard


def listen(host: str, port: int, backlog: int, listen_fd: int | None) -> socket.socket:
    """The server's non-blocking listening socket: bound to ``host:port``, or ``listen_fd`` as given."""
    if listen_fd is not None:  # a socket bound by someone else (torch's master_listen_fd)
        try:
            sock = socket.socket(fileno=listen_fd)
        except OSError as exc:
            raise DistNetworkError(f"TCPStoreServer: listen fd {listen_fd} is not a usable socket: {exc}") from None
        if sock.type != socket.SOCK_STREAM:
            sock.detach()
            raise DistNetworkError(f"TCPStoreServer: listen fd {listen_fd} is not a TCP socket")
        sock.listen(backlog)
        sock.setblocking(False)
        return sock
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise DistNetworkError(f"TCPStoreServer: cannot resolve host {host!r}: {exc}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise DistNetworkError(f"TCPStoreServer: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


"""The simulated NCCL's transport: real TCP sockets between the processes of
a simulated job (one listener per process, one connection per peer process
and direction), messages delivered to mailboxes keyed by (communicator,
tag). A peer whose connection closes (its process died) is marked dead, and
the communicators that talked to it get an asynchronous error, as NCCL's
proxy reports a lost network peer (``ncclRemoteError``).
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

Addr = tuple[str, int]
_HEADER = struct.Struct("!I")
_SLICE = 0.05  # seconds between checks of abort flags while waiting for a message


class PeerLost(Exception):
    """The process of a peer we wait for is gone."""

    def __init__(self, addr: Addr) -> None:
        super().__init__(f"peer process at {addr[0]}:{addr[1]} closed its connection")
        self.addr = addr


class Aborted(Exception):
    """The wait was ended by an abort flag."""


class Net:
    def __init__(self, host: str | None = None) -> None:
        self.host = host or os.environ.get("SIMNCCL_HOST", "127.0.0.1")
        self.listener = socket.create_server((self.host, 0))
        self.addr: Addr = (self.host, self.listener.getsockname()[1])
        self.cv = threading.Condition()
        self.mail: dict[Any, deque[Any]] = {}
        self.dead: set[Addr] = set()
        self.out: dict[Addr, tuple[socket.socket, threading.Lock]] = {}
        self.out_lock = threading.Lock()
        self.on_lost: list[Callable[[Addr], None]] = []
        self.refusing: dict[Any, Callable[[Any], None]] = {}  # keys whose listener is closed: each message refused
        self.closed = False
        self.sent = 0
        threading.Thread(target=self._accept, name="simnccl-net-accept", daemon=True).start()

    # --- receiving -----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), name="simnccl-net-read", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        peer: Addr | None = None
        try:
            with conn:
                while True:
                    head = _recv_exact(conn, _HEADER.size)
                    if head is None:
                        break
                    body = _recv_exact(conn, _HEADER.unpack(head)[0])
                    if body is None:
                        break
                    sender, key, payload = pickle.loads(body)
                    peer = tuple(sender)  # type: ignore[assignment]
                    self._deliver(key, payload)
        except OSError:
            pass
        if peer is not None and not self.closed:
            with self.cv:
                self.dead.add(peer)
                self.cv.notify_all()
            for callback in list(self.on_lost):
                callback(peer)

    def _deliver(self, key: Any, payload: Any) -> None:
        with self.cv:
            refuse = self.refusing.get(key)
            if refuse is None:
                self.mail.setdefault(key, deque()).append(payload)
                self.cv.notify_all()
        if refuse is not None:
            refuse(payload)

    def refuse(self, key: Any, answer: Callable[[Any], None]) -> None:
        """From now on a message under ``key`` (and any waiting) is not delivered but given to ``answer``: a
        listener closed, whose connections are refused."""
        with self.cv:
            self.refusing[key] = answer
            waiting = self.mail.pop(key, deque())
        for payload in waiting:
            answer(payload)

    def pending(self, key: Any) -> int:
        """Messages under ``key`` delivered and not received yet."""
        with self.cv:
            return len(self.mail.get(key, ()))

    def recv(self, key: Any, peer: Addr | None, aborted: Callable[[], bool], fail_on_lost: bool = True,
             deadline: float | None = None) -> Any:
        """The next message under ``key``. Raises Aborted when ``aborted()``
        turns true, PeerLost when ``peer`` died (if ``fail_on_lost``; else it
        keeps waiting, as a GPU kernel does until it is aborted)."""
        with self.cv:
            while True:
                box = self.mail.get(key)
                if box:
                    value = box.popleft()
                    if not box:
                        del self.mail[key]
                    return value
                if aborted():
                    raise Aborted()
                if fail_on_lost and peer is not None and peer in self.dead:
                    raise PeerLost(peer)
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no message {key!r}")
                self.cv.wait(_SLICE)

    def poke(self) -> None:
        """Wake every waiter (an abort flag changed)."""
        with self.cv:
            self.cv.notify_all()

    # --- sending -------------------------------------------------------------------------------

    def send(self, addr: Addr, key: Any, payload: Any) -> bool:
        """False when the peer is known dead or cannot be reached."""
        if addr == self.addr:  # a rank of this process: straight into the mailbox
            self._deliver(key, payload)
            return True
        if addr in self.dead:
            return False
        with self.out_lock:
            entry = self.out.get(addr)
            if entry is None:
                try:
                    sock = socket.create_connection(addr, timeout=10)
                    sock.settimeout(None)
                except OSError:
                    return False
                entry = self.out[addr] = (sock, threading.Lock())
        sock, lock = entry
        body = pickle.dumps((self.addr, key, payload), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with lock:
                sock.sendall(_HEADER.pack(len(body)) + body)
            self.sent += 1
            return True
        except OSError:
            with self.cv:
                self.dead.add(addr)
                self.cv.notify_all()
            return False

    def close(self) -> None:
        self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not, on Linux)
            self.listener.close()
        except OSError:
            pass
        with self.out_lock:
            for sock, _ in self.out.values():
                try:
                    sock.close()
                except OSError:
                    pass
            self.out.clear()
        self.poke()


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < n:
        try:
            data = conn.recv(n - len(chunks))
        except OSError:
            return None
        if not data:
            return None
        chunks += data
    return bytes(chunks)

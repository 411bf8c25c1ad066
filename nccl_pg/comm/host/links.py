"""The connections of a host communicator's mesh, and how they end.

Each direction of each connection has its own lock: exchanges over different
directions run at the same time (a send to rank 1 while a receive from rank 1
waits), which the host backend's point-to-point lanes rely on. A goodbye holds
every sending direction, so that it never cuts into another lane's message.

Peer death shows up as EOF or a reset on that peer's socket; the mesh is then
broken: it says goodbye to every peer (a last frame naming the rank whose
failure started it, so that errors name the rank that died rather than the
healthy ones that aborted after it) and closes every connection, so the
failure spreads within milliseconds instead of leaving ranks blocked.
``fail()`` (abort) wakes a blocked exchange through a pipe and does the same.
A peer's goodbye, read where a message was due, blames the rank it names.
``Links`` is the base of transport.Mesh, which moves data over them.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator

from .wire import ANY, GOODBYE, HEADER, NO_NUMBER, NO_SIZE, Incoming, PeerLostError, advance

_GOODBYE_MAX = 2000  # bytes of reason text in a goodbye
# What Gloo says for a peer that closed its connection, in every lost-peer message: users grep logs for it.
GLOO_WORDS = "Connection closed by peer, in Gloo's words"
FAREWELL_BUDGET = 0.25  # seconds a failing rank spends finishing half-sent messages and saying goodbye


class Links:
    """A rank's connections to the other ranks of its mesh (``socks``: peer -> socket)."""

    def __init__(self, rank: int, nranks: int, socks: dict[int, socket.socket], name: str) -> None:
        self.rank, self.nranks, self.name = rank, nranks, name
        self._socks = socks
        self._fd_peer = {s.fileno(): p for p, s in socks.items()}
        # Ranks of this mesh on this host (peers reached at our own address), us included.
        self.local_ranks = 1 + sum(s.getpeername()[0] == s.getsockname()[0] for s in socks.values())
        for s in socks.values():
            s.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # (peer, 0): sending to peer, (peer, 1): receiving from it; taken in this key order (no deadlock).
        self._locks = {(p, d): threading.Lock() for p in sorted(socks) for d in (0, 1)}
        self.error: BaseException | None = None
        self._closed = False
        self._partial: dict[int, list[memoryview]] = {}  # per peer: the rest of a message half sent
        self._said_goodbye = False

    def local_address(self) -> str | None:
        """The address this rank's connections use (None for one rank)."""
        for s in self._socks.values():
            return s.getsockname()[0]
        return None

    # --- failure ---------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """Break the mesh: wake any exchange, say goodbye to every peer and
        close every connection, so peers blocked on us see the reason (or
        EOF) instead of waiting forever. Never blocks on an exchange in
        progress: that one says goodbye as it ends."""
        if self.error is None:
            self.error = error
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._try_farewell()

    def _try_farewell(self, wait: float = 0.0) -> None:
        """Say goodbye once every sending direction is free, waiting up to
        ``wait`` seconds for exchanges still ending (0: never block, as
        fail() must not; the last exchange to end says it then)."""
        held: list[threading.Lock] = []
        deadline = time.monotonic() + wait
        try:
            for key in sorted(k for k in self._locks if k[1] == 0):
                lock = self._locks[key]
                left = deadline - time.monotonic()
                if not (lock.acquire(timeout=left) if left > 0 else lock.acquire(blocking=False)):
                    return
                held.append(lock)
            self._farewell()
        finally:
            for lock in reversed(held):
                lock.release()

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

    # --- goodbyes --------------------------------------------------------------

    def _culprit(self) -> tuple[int, str]:
        """Who broke the mesh, and what happened to them (for our goodbye)."""
        err = self.error
        if isinstance(err, PeerLostError):
            return err.culprit, err.reason
        return self.rank, f"aborted its communicator ({err})"

    def _farewell(self) -> None:
        """With every sending direction held: finish the messages half sent (a peer could
        not parse what follows them), send each peer a goodbye naming the
        culprit, then shut every connection down; all bounded by
        FAREWELL_BUDGET. A peer that is not reading gets only EOF."""
        if self._said_goodbye or self._closed:
            return
        self._said_goodbye = True
        culprit, reason = self._culprit()
        text = reason.encode(errors="replace")[:_GOODBYE_MAX]
        frame = memoryview(HEADER.pack(0, GOODBYE, ANY, ANY, culprit, len(text), NO_SIZE, NO_NUMBER) + text)
        pending = {p: [*self._partial.pop(p, []), frame] for p in self._socks if p != culprit}
        deadline = time.monotonic() + FAREWELL_BUDGET
        poller = select.poll()
        by_fd = {self._socks[p].fileno(): p for p in pending}
        for fd in by_fd:
            poller.register(fd, select.POLLOUT)
        while pending:
            for peer in list(pending):
                parts = pending[peer]
                try:
                    while parts:
                        n = self._socks[peer].sendmsg(parts)
                        advance(parts, n)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    parts.clear()
                if not parts:
                    del pending[peer]
                    poller.unregister(self._socks[peer].fileno())
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            poller.poll(max(math.ceil(left * 1000), 1))
        self._partial.clear()
        for s in self._socks.values():
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _lost(self, peer: int, why: str, pending: deque[Incoming] | None = None) -> PeerLostError:
        """The connection to ``peer`` failed on a send: a goodbye may wait
        in what it sent us (``pending``: our receives from it); else it died."""
        return self._last_words(peer, pending) or PeerLostError(
            f"{self.name}: lost the connection to rank {peer} ({why}) with no goodbye: rank {peer} exited or "
            f"crashed ({GLOO_WORDS})", peer, f"exited or crashed (its connection to rank {self.rank} ended: {why})")

    def _last_words(self, peer: int, pending: deque[Incoming] | None) -> PeerLostError | None:
        """Read on (skipping data: the mesh is broken) from where our
        receives from ``peer`` stand, for a goodbye; bounded by FAREWELL_BUDGET."""
        sock = self._socks[peer]
        cur = pending[0] if pending else None
        header = bytearray(cur.header[:cur.got_header]) if cur is not None else bytearray()
        skip = cur.target.nbytes - cur.got if cur is not None and cur.got_header == HEADER.size else 0
        if skip:
            header = bytearray()
        deadline = time.monotonic() + FAREWELL_BUDGET
        while True:
            try:
                chunk = sock.recv(min(skip, 1 << 16) if skip else HEADER.size - len(header))
            except (BlockingIOError, InterruptedError):
                if not _readable(sock, deadline):
                    return None
                continue
            except OSError:
                return None
            if not chunk:
                return None
            if skip:
                skip -= len(chunk)
                continue
            header += chunk
            if len(header) == HEADER.size:
                _, kind, _, _, root, nbytes, _, _ = HEADER.unpack(header)
                if kind == GOODBYE:
                    return self._goodbye(peer, root, nbytes)
                header, skip = bytearray(), nbytes

    def _goodbye(self, peer: int, culprit: int, nbytes: int) -> PeerLostError:
        """The peer left the mesh: read why, and blame the rank it names."""
        sock = self._socks[peer]
        text = bytearray()
        deadline = time.monotonic() + FAREWELL_BUDGET
        while len(text) < min(nbytes, _GOODBYE_MAX):
            try:
                chunk = sock.recv(min(nbytes, _GOODBYE_MAX) - len(text))
            except (BlockingIOError, InterruptedError):
                if not _readable(sock, deadline):
                    break
                continue
            except OSError:
                break
            if not chunk:
                break
            text += chunk
        reason = text.decode(errors="replace") or "left without saying why"
        if culprit in (peer, self.rank) or not 0 <= culprit < self.nranks:
            return PeerLostError(f"{self.name}: lost the connection to rank {peer}: it {reason} ({GLOO_WORDS})", peer,
                                 reason)
        return PeerLostError(f"{self.name}: rank {culprit} {reason}; rank {peer} saw it and closed its connection "
                             f"to rank {self.rank} ({GLOO_WORDS})", culprit, reason)


def _readable(sock: socket.socket, deadline: float) -> bool:
    """Wait (poll: descriptors may be above select's 1024) until ``sock``
    has data or ``deadline`` passes."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(math.ceil(left * 1000), 1)))


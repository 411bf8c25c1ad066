"""A full mesh of TCP connections between the ranks of a host communicator,
and the engine that moves data over it.

Every algorithm is a sequence of ``exchange()`` steps: a set of sends and
receives that progress together on non-blocking sockets (so paired sends
never deadlock, whatever their size). Each message carries a header with a
per-peer sequence number, the operation's kind, dtype, reduction op, root,
size (of the operation's buffer, whatever the message carries of it) and
number (collectives are numbered in issue order, the same on every rank), so
ranks that disagree (one in all_reduce, another in broadcast; float32
against int32; SUM against MAX; different roots or sizes) get an error naming
the peer and both values, instead of garbage or a hang.

A rooted collective can only be checked where messages flow, and a root that
only sends hears from nobody: so in every rooted collective the root and
each other rank exchange at least one message both ways (the algorithms add
an empty one where no data goes: ``EMPTY``), in the same exchange as the
data, costing no round trip. A rank blocked in a rooted collective also
watches the connections it does not read from (``watch``): a message of the
same collective there, whose fields differ from its own, is a disagreement
too (a rank that named another root sent it). So a rank whose call disagrees
with a peer it depends on fails in that collective, naming both values; no
rank waits for data that will not come; and a rank completes only with the
data of the root it named, which agreed with it.

Peer death shows up as EOF or a reset on that peer's socket; the mesh is then
broken: it says goodbye to every peer (a last frame naming the rank whose
failure started it, so that errors name the rank that died rather than the
healthy ones that aborted after it) and closes every connection, so the
failure spreads within milliseconds instead of leaving ranks blocked.
``abort()`` wakes a blocked exchange through a pipe and does the same.

Each direction of each connection has its own lock: exchanges over different
directions run at the same time (a send to rank 1 while a receive from rank 1
waits), which the host backend's point-to-point lanes rely on. A goodbye holds
every sending direction, so that it never cuts into another lane's message.

``connect.MeshBuilder`` connects the mesh at init.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from ...errors import DistBackendError

# per-peer seq, op kind, dtype code, reduction-op code, root (in a goodbye: the culprit), payload bytes, the
# operation's size in bytes, the collective's number
HEADER = struct.Struct("<QBBBxiQQI4x")
ANY = 255  # dtype or op code of a message whose dtype or op is not checked (point-to-point, raw bytes)
NO_ROOT = -1
NO_SIZE = 2**64 - 1
NO_NUMBER = 2**32 - 1  # the number of a message outside the collectives (point-to-point, init)
# (dtype code, op code, root, size in bytes) of an operation, checked against every peer's
Meta = tuple[int, int, int, int]
NO_META: Meta = (ANY, ANY, NO_ROOT, NO_SIZE)
_UNSET = NO_META  # a field given as this on either side is not compared
GOODBYE = 255  # op kind of the last frame a rank sends on each connection when it leaves a broken mesh
_GOODBYE_MAX = 2000  # bytes of reason text in a goodbye
_FAREWELL_BUDGET = 0.25  # seconds a failing rank spends finishing half-sent messages and saying goodbye
_IOV_MESSAGES = 64  # messages per gather write: 2 parts each, well under Linux's IOV_MAX of 1024

_POLLERR = select.POLLERR | select.POLLHUP | select.POLLNVAL


@dataclass(frozen=True)
class WireNames:
    """Names of the codes in message headers, for error messages."""

    kinds: tuple[str, ...]
    dtypes: tuple[str, ...]
    ops: tuple[str, ...]


class MeshTimeoutError(DistBackendError):
    """Init's deadline passed with ``missing`` ranks not connected."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class PeerLostError(DistBackendError):
    """A peer's connection ended: it exited, crashed or aborted. ``culprit``
    is the rank whose failure started it (the peer itself, or the rank the
    peer's goodbye named), ``reason`` what happened to the culprit."""

    def __init__(self, message: str, culprit: int, reason: str) -> None:
        super().__init__(message)
        self.culprit, self.reason = culprit, reason


EMPTY = memoryview(b"")  # the data of a message that only carries its header (see the module's docstring)


def empty_target() -> memoryview:
    """Where an EMPTY message is received."""
    return memoryview(bytearray())


@dataclass
class _Out:
    parts: list[memoryview]
    sent: int = 0


def _advance(parts: list[memoryview], n: int) -> int:
    """Drop the first ``n`` bytes (at most all of them) from ``parts``;
    returns how many were dropped."""
    done = 0
    while parts and done < n:
        k = min(n - done, parts[0].nbytes)
        done += k
        if k == parts[0].nbytes:
            parts.pop(0)
        else:
            parts[0] = parts[0][k:]
    return done


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
                 names: WireNames) -> None:
        self.rank, self.nranks, self.name = rank, nranks, name
        self._names = names
        self._socks = socks
        self._fd_peer = {s.fileno(): p for p, s in socks.items()}
        # Ranks of this mesh on this host (peers reached at our own address), us included.
        self.local_ranks = 1 + sum(s.getpeername()[0] == s.getsockname()[0] for s in socks.values())
        self.tree_broadcast = False  # agreed on by all ranks at init (see HostCommunicator)
        self.collectives = 0  # collectives begun (their numbers in message headers)
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
        self._partial: dict[int, list[memoryview]] = {}  # per peer: the rest of a message half sent
        self._said_goodbye = False

    def next_collective(self) -> int:
        """The number of a collective beginning now (on every rank, collectives begin in the same order)."""
        number = self.collectives
        self.collectives = (number + 1) % NO_NUMBER
        return number

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
        _FAREWELL_BUDGET. A peer that is not reading gets only EOF."""
        if self._said_goodbye or self._closed:
            return
        self._said_goodbye = True
        culprit, reason = self._culprit()
        text = reason.encode(errors="replace")[:_GOODBYE_MAX]
        frame = memoryview(HEADER.pack(0, GOODBYE, ANY, ANY, culprit, len(text), NO_SIZE, NO_NUMBER) + text)
        pending = {p: [*self._partial.pop(p, []), frame] for p in self._socks if p != culprit}
        deadline = time.monotonic() + _FAREWELL_BUDGET
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
                        _advance(parts, n)
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

    # --- the engine ------------------------------------------------------------

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
        breaks the mesh and is raised as the mesh's error; once the mesh is
        broken, the goodbye is said after the directions are released."""
        keys = {(p, 0) for p in sends_to} | {(p, 1) for p in recvs_from}
        missing = sorted({p for p, _ in keys if p not in self._socks})
        if missing:
            raise DistBackendError(f"{self.name}: no connection to rank {missing[0]}")
        try:
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
                    raise (self.error or exc) from None
        finally:
            if self.error is not None:  # other lanes were woken by fail() and end at once
                self._try_farewell(_FAREWELL_BUDGET)

    def exchange(self, kind: int, sends: list[Send], recvs: list[Recv], meta: Meta = NO_META,
                 deadline: float | None = None, number: int = NO_NUMBER, watch: bool = False) -> None:
        """Deliver every send and fill every receive, all progressing at once;
        per peer, messages go in list order. ``on_done`` callbacks run as each
        receive completes (e.g. to reduce a chunk while the next arrives).
        ``meta``: the operation's dtype, reduction op, root and size, which
        every peer's messages must match; ``number``: the collective's (from
        next_collective()). ``watch``: while blocked, also look at the
        connections this exchange does not read from, for a message of this
        collective that disagrees (rooted collectives). ``deadline``
        (time.monotonic()): raise MeshTimeoutError naming the peers still
        owing data (collectives have none: the watchdog times them out)."""
        with self._directions((p for p, _ in sends), (p for p, _, _ in recvs)):
            self._exchange(kind, sends, recvs, meta, deadline, number, watch)

    def recv_any(self, kind: int, target: memoryview) -> int:
        """Fill ``target`` with the first ``kind`` message to arrive from any
        peer, and return that peer. A peer whose next message belongs to
        another operation is not a candidate (it is ahead of us, in an
        operation we have not reached); with no candidate left, that is an
        error naming what the peers are in. A goodbye is read as in any
        receive (it names the rank that failed)."""
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
                    if their_kind in (kind, GOODBYE):
                        self._exchange(kind, [], [(peer, target, None)], NO_META, None, NO_NUMBER, False)
                        return peer
                    elsewhere[peer] = their_kind
                    poller.unregister(fd)
            detail = ", ".join(f"rank {p} in {self._op_name(k)}" for p, k in sorted(elsewhere.items()))
            raise DistBackendError(f"{self.name}: rank {self.rank} waits to receive from any rank, but every peer "
                                   f"has gone on to another operation ({detail}): ranks issued different operations")

    def _exchange(self, kind: int, sends: list[Send], recvs: list[Recv], meta: Meta, deadline: float | None,
                  number: int, watch: bool) -> None:
        outs: dict[int, deque[_Out]] = {}
        ins: dict[int, deque[_In]] = {}
        for peer, data in sends:
            hdr = HEADER.pack(self._send_seq[peer], kind, meta[0], meta[1], meta[2], data.nbytes, meta[3], number)
            self._send_seq[peer] += 1
            parts = [memoryview(hdr), data.cast("B")] if data.nbytes else [memoryview(hdr)]
            outs.setdefault(peer, deque()).append(_Out(parts))
        for peer, target, on_done in recvs:
            ins.setdefault(peer, deque()).append(_In(target.cast("B"), on_done))

        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        masks: dict[int, int] = {}
        watched: set[int] = set()  # peers we read nothing from, whose next message we look at (``watch``)
        held: list[threading.Lock] = []

        def update(peer: int) -> None:
            mask = (select.POLLOUT if outs.get(peer) else 0) | (
                select.POLLIN if ins.get(peer) or peer in watched else 0)
            fd = self._socks[peer].fileno()
            if mask != masks.get(peer, 0):
                if peer in masks and masks[peer]:
                    poller.modify(fd, mask) if mask else poller.unregister(fd)
                elif mask:
                    poller.register(fd, mask)
                masks[peer] = mask

        try:
            for peer in set(outs) | set(ins):
                if peer not in self._socks:
                    raise DistBackendError(f"{self.name}: no connection to rank {peer}")
                self._progress_out(peer, outs, ins)  # most small messages go out without a poll
                update(peer)
            while any(outs.values()) or any(ins.values()):
                if watch and not held:  # about to block: watch the connections we do not read
                    held = self._watch({p for p, q in ins.items() if q}, watched)
                    for peer in watched:
                        update(peer)
                wait = None if deadline is None else max(math.ceil((deadline - time.monotonic()) * 1000), 0)
                events = poller.poll(wait)
                if not events and deadline is not None and time.monotonic() >= deadline:
                    late = sorted(p for p in set(outs) | set(ins) if outs.get(p) or ins.get(p))
                    raise MeshTimeoutError(f"{self.name}: ranks {late} did not answer before the deadline", late)
                for fd, ev in events:
                    if fd == self._wake_r:
                        raise self.error or DistBackendError(f"{self.name}: aborted")
                    peer = self._fd_peer[fd]
                    if ev & (select.POLLIN | _POLLERR) and ins.get(peer):
                        self._progress_in(kind, meta, number, peer, ins)
                    elif (ev & (select.POLLIN | _POLLERR) and peer in watched
                          and self._look(kind, meta, number, peer, bool(outs.get(peer)))):
                        watched.discard(peer)  # its next message is for later: nothing more to see there
                    if ev & (select.POLLOUT | _POLLERR) and outs.get(peer):
                        self._progress_out(peer, outs, ins)
                    update(peer)
        finally:
            for lock in held:
                lock.release()

    def _watch(self, reading: set[int], watched: set[int]) -> list[threading.Lock]:
        """Take the receiving direction of every peer not in ``reading``
        whose direction is free (another lane may be reading it: its bytes
        are not ours to look at), and add those peers to ``watched``."""
        held = []
        for peer in self._socks:
            if peer not in reading:
                lock = self._locks[(peer, 1)]
                if lock.acquire(blocking=False):
                    held.append(lock)
                    watched.add(peer)
        return held

    def _look(self, kind: int, meta: Meta, number: int, peer: int, sending: bool) -> bool:
        """Look (without reading it) at the next message from a peer this
        exchange reads nothing from (``sending``: but sends to). Raise if it
        belongs to this collective and disagrees with it, or if a peer we
        send to left (its goodbye, its end: the send would never finish).
        True once there is nothing more to see: a message of a later
        collective, one that agrees (read later in this collective), or the
        goodbye or end of a peer this exchange does not depend on (read at
        the next operation: a rank that timed out must not turn the other
        ranks' own timeouts, which name who is missing, into "lost the
        connection")."""
        sock = self._socks[peer]
        try:
            head = sock.recv(HEADER.size, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if sending:
                raise self._lost(peer, exc.strerror or str(exc)) from None
            return True
        if not head:
            if sending:
                raise self._lost(peer, "end of stream")
            return True
        if len(head) < HEADER.size:
            return False  # the rest of the header is on its way
        _, their_kind, dtype, op, root, nbytes, size, their_number = HEADER.unpack(head)
        if their_kind == GOODBYE:
            if sending:
                sock.recv(HEADER.size)  # ours to read: we hold this direction
                raise self._goodbye(peer, root, nbytes)
        elif their_number == number:
            self._compare(kind, meta, number, peer, their_kind, (dtype, op, root, size), their_number)
        return True

    def _lost(self, peer: int, why: str, pending: deque[_In] | None = None) -> PeerLostError:
        """The connection to ``peer`` failed on a send: a goodbye may wait
        in what it sent us (``pending``: our receives from it); else it died."""
        return self._last_words(peer, pending) or PeerLostError(
            f"{self.name}: lost the connection to rank {peer} ({why}) with no goodbye: rank {peer} exited or "
            f"crashed", peer, f"exited or crashed (its connection to rank {self.rank} ended: {why})")

    def _last_words(self, peer: int, pending: deque[_In] | None) -> PeerLostError | None:
        """Read on (skipping data: the mesh is broken) from where our
        receives from ``peer`` stand, for a goodbye; bounded by _FAREWELL_BUDGET."""
        sock = self._socks[peer]
        cur = pending[0] if pending else None
        header = bytearray(cur.header[:cur.got_header]) if cur is not None else bytearray()
        skip = cur.target.nbytes - cur.got if cur is not None and cur.got_header == HEADER.size else 0
        if skip:
            header = bytearray()
        deadline = time.monotonic() + _FAREWELL_BUDGET
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

    def _progress_out(self, peer: int, outs: dict[int, deque[_Out]], ins: dict[int, deque[_In]]) -> None:
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
                raise self._lost(peer, exc.strerror or str(exc), ins.get(peer)) from None
            full = n < sum(p.nbytes for p in iov)
            while n:
                head = queue[0]
                k = _advance(head.parts, n)
                head.sent += k
                n -= k
                if not head.parts:
                    queue.popleft()
            if queue and queue[0].sent:
                self._partial[peer] = queue[0].parts  # a goodbye must wait for the rest of this message
            else:
                self._partial.pop(peer, None)
            if full:  # the socket buffer is full: wait for POLLOUT rather than try again now
                return

    def _progress_in(self, kind: int, meta: Meta, number: int, peer: int, ins: dict[int, deque[_In]]) -> None:
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
                    self._check_header(kind, meta, number, peer, cur)
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

    def _check_header(self, kind: int, meta: Meta, number: int, peer: int, cur: _In) -> None:
        seq, their_kind, dtype, op, root, nbytes, size, their_number = HEADER.unpack(cur.header)
        if their_kind == GOODBYE:
            raise self._goodbye(peer, root, nbytes)
        if seq != self._recv_seq[peer]:
            raise DistBackendError(f"{self.name}: message {seq} from rank {peer} arrived when message "
                                   f"{self._recv_seq[peer]} was due; the stream is corrupt")
        self._recv_seq[peer] += 1
        self._compare(kind, meta, number, peer, their_kind, (dtype, op, root, size), their_number)
        if nbytes != cur.target.nbytes:
            raise DistBackendError(
                f"{self.name}: in {self._op_name(kind)}, rank {peer} sent {nbytes} bytes where rank "
                f"{self.rank} expected {cur.target.nbytes}: array sizes differ across ranks"
            )

    def _compare(self, kind: int, meta: Meta, number: int, peer: int, their_kind: int, theirs: Meta,
                 their_number: int) -> None:
        """Raise, naming both sides, where a peer's message disagrees with our operation."""
        differ = _fields_that_differ(theirs, meta)
        if their_kind == kind and not differ:
            if NO_NUMBER in (number, their_number) or number == their_number:
                return
            raise DistBackendError(
                f"{self.name}: rank {peer} is in {self._op_name(kind)} #{their_number} while rank {self.rank} is "
                f"in {self._op_name(kind)} #{number}: ranks issued different numbers of collectives")
        if their_kind == kind and differ == ["size"]:
            raise DistBackendError(
                f"{self.name}: in {self._op_name(kind)}, rank {peer} has {theirs[3]} bytes where rank {self.rank} "
                f"has {meta[3]}: array sizes differ across ranks")
        why = "ranks issued different operations" if their_kind != kind else f"ranks disagree on its {', '.join(differ)}"
        raise DistBackendError(f"{self.name}: rank {peer} is in {self._describe(their_kind, theirs)} while rank "
                               f"{self.rank} is in {self._describe(kind, meta)}: {why}")

    def _goodbye(self, peer: int, culprit: int, nbytes: int) -> PeerLostError:
        """The peer left the mesh: read why, and blame the rank it names."""
        sock = self._socks[peer]
        text = bytearray()
        deadline = time.monotonic() + _FAREWELL_BUDGET
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
            return PeerLostError(f"{self.name}: lost the connection to rank {peer}: it {reason}", peer, reason)
        return PeerLostError(f"{self.name}: rank {culprit} {reason}; rank {peer} saw it and closed its connection "
                             f"to rank {self.rank}", culprit, reason)

    def _op_name(self, kind: int) -> str:
        return _name(self._names.kinds, kind, "op")

    def _describe(self, kind: int, meta: Meta) -> str:
        dtype, op, root, size = meta
        fields = [_name(self._names.dtypes, dtype, "dtype")] if dtype != ANY else []
        fields += [_name(self._names.ops, op, "reduction")] if op != ANY else []
        fields += [f"root {root}"] if root != NO_ROOT else []
        fields += [f"{size} bytes"] if size != NO_SIZE else []
        return f"{self._op_name(kind)}({', '.join(fields)})" if fields else self._op_name(kind)


def _readable(sock: socket.socket, deadline: float) -> bool:
    """Wait (poll: descriptors may be above select's 1024) until ``sock``
    has data or ``deadline`` passes."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(math.ceil(left * 1000), 1)))


def _differ(theirs: Meta, ours: Meta) -> bool:
    """Fields both sides give (not ANY / NO_ROOT / NO_SIZE) must be equal."""
    return bool(_fields_that_differ(theirs, ours))


def _fields_that_differ(theirs: Meta, ours: Meta) -> list[str]:
    return [name for name, a, b, u in zip(("dtype", "reduction", "root", "size"), theirs, ours, _UNSET, strict=True)
            if a != b and a != u and b != u]


def _name(names: tuple[str, ...], code: int, what: str) -> str:
    return names[code] if code < len(names) else f"{what} #{code}"


def _kind(header: bytes) -> int:
    """The operation kind a message header carries."""
    return int(HEADER.unpack(header)[1])

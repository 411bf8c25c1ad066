"""The engine that moves data over the mesh of a host communicator
(links.py: its connections and how they end; wire.py: the messages).

Every algorithm is a sequence of ``exchange()`` steps: a set of sends and
receives that progress together on non-blocking sockets (so paired sends
never deadlock, whatever their size). Each message's header is checked
against the operation the receiving rank is in (wire.py: kind, dtype,
reduction op, root, size, the collective's number).

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

``connect.MeshBuilder`` connects the mesh at init.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from ...errors import DistBackendError
from . import wire
from .links import FAREWELL_BUDGET, Links
from .wire import (
    ANY,
    GOODBYE,
    NO_META,
    NO_NUMBER,
    NO_ROOT,
    NO_SIZE,
    Incoming,
    MeshTimeoutError,
    Meta,
    Outgoing,
    PeerLostError,
    WireNames,
    advance,
    code_name,
    fields_that_differ,
    header_kind,
)

# Bound here rather than imported by name: CPython 3.11 calls a method of a from-imported name without
# LOAD_METHOD (a bound method made per call), and HEADER.pack/unpack run for every message.
HEADER = wire.HEADER
_IOV_MESSAGES = 64  # messages per gather write: 2 parts each, well under Linux's IOV_MAX of 1024

_POLLERR = select.POLLERR | select.POLLHUP | select.POLLNVAL

Send = tuple[int, memoryview]
Recv = tuple[int, memoryview, Callable[[], None] | None]


class Mesh(Links):
    def __init__(self, rank: int, nranks: int, socks: dict[int, socket.socket], name: str,
                 names: WireNames) -> None:
        super().__init__(rank, nranks, socks, name)
        self._names = names
        self.tree_broadcast = False  # agreed on by all ranks at init (bootstrap.py)
        self.collectives = 0  # collectives begun (their numbers in message headers)
        self._send_seq = [0] * nranks
        self._recv_seq = [0] * nranks

    def next_collective(self) -> int:
        """The number of a collective beginning now (on every rank, collectives begin in the same order)."""
        number = self.collectives
        self.collectives = (number + 1) % NO_NUMBER
        return number

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
                self._try_farewell(FAREWELL_BUDGET)

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
                    their_kind = header_kind(head)
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
        outs: dict[int, deque[Outgoing]] = {}
        ins: dict[int, deque[Incoming]] = {}
        for peer, data in sends:
            hdr = HEADER.pack(self._send_seq[peer], kind, meta[0], meta[1], meta[2], data.nbytes, meta[3], number)
            self._send_seq[peer] += 1
            parts = [memoryview(hdr), data.cast("B")] if data.nbytes else [memoryview(hdr)]
            outs.setdefault(peer, deque()).append(Outgoing(parts))
        for peer, target, on_done in recvs:
            ins.setdefault(peer, deque()).append(Incoming(target.cast("B"), on_done))

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

    def _progress_out(self, peer: int, outs: dict[int, deque[Outgoing]], ins: dict[int, deque[Incoming]]) -> None:
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
                k = advance(head.parts, n)
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

    def _progress_in(self, kind: int, meta: Meta, number: int, peer: int, ins: dict[int, deque[Incoming]]) -> None:
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

    def _check_header(self, kind: int, meta: Meta, number: int, peer: int, cur: Incoming) -> None:
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
        differ = fields_that_differ(theirs, meta)
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

    def _op_name(self, kind: int) -> str:
        return code_name(self._names.kinds, kind, "op")

    def _describe(self, kind: int, meta: Meta) -> str:
        dtype, op, root, size = meta
        fields = [code_name(self._names.dtypes, dtype, "dtype")] if dtype != ANY else []
        fields += [code_name(self._names.ops, op, "reduction")] if op != ANY else []
        fields += [f"root {root}"] if root != NO_ROOT else []
        fields += [f"{size} bytes"] if size != NO_SIZE else []
        return f"{self._op_name(kind)}({', '.join(fields)})" if fields else self._op_name(kind)

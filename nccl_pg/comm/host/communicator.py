"""HostCommunicator: the Communicator contract for numpy arrays over TCP."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import env
from ...errors import DistBackendError, DistStoreError
from ...reduce_op import ReduceOp
from ...store import Store
from ..base import CommConfig, CommState, Communicator, Stream, check_dtype, check_reduction
from . import algorithms as alg
from .connect import MeshBuilder, listen
from .membership import Membership
from .stream import INLINE_BYTES, HostEvent, HostStream
from .transport import Mesh, MeshTimeoutError, Recv, Send

# Stream threads wait this much past the init deadline before giving up on init themselves.
_INIT_GRACE = 2.0
# destroy() marks its streams aborted first, so their threads end at their next check (every _ABORT_POLL);
# this bounds the wait for one stuck in a task.
_ABORTED_STREAM_CLOSE = 1.0
# A rank's address in the store: token (rank 0's; zeros from the others), port, then the host.
_ADDR_RECORD = struct.Struct("<16sH")
_ALL_JOINED = b"all joined"
_EXPLAIN_CHECKS = 64  # store requests a timed-out rendezvous may spend finding who never joined
# (color, key, port, token, host) published by every rank in a split
_SPLIT_RECORD = struct.Struct("<qqH16s64s")


def _host_address(store: Store) -> str:
    """The address peers should use to reach this rank: NCCL_PG_HOST_ADDR,
    else the local end of our connection to the store (the interface that
    reaches the other hosts), else loopback."""
    addr = env.HOST_ADDR.get()
    if addr:
        return addr
    inner = getattr(store, "underlying_store", store)
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    local_address = getattr(inner, "local_address", None)  # TCPStore's and EtcdStore's
    if callable(local_address):
        return str(local_address())
    return "127.0.0.1"


@dataclass
class _Bootstrap:
    """What a new rank needs to join its mesh."""

    listener: socket.socket
    lower: dict[int, tuple[str, int]]
    token: bytes


def _flat(a: Any, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what}: the host backend takes numpy arrays, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: array must be contiguous")
    check_dtype(a.dtype, what)
    return a if a.ndim == 1 else a.reshape(-1)


def _out(a: Any, what: str) -> np.ndarray:
    """An array the operation writes."""
    flat = _flat(a, what)
    if not flat.flags.writeable:
        raise ValueError(f"{what}: the output array is read-only")
    return flat


@dataclass
class _Branch:
    """A point-to-point operation moved onto a lane, not yet joined back."""

    lane: HostStream
    key: tuple[int | None, bool]  # (peer or None: any source, is a send)
    buf: np.ndarray

    def orders(self, key: tuple[int | None, bool], buf: np.ndarray) -> bool:
        """Must an operation (``key``, ``buf``) issued after this one wait for it?"""
        if not key[1] and not self.key[1] and (key[0] is None or self.key[0] is None):
            return True  # receives from any source and from one peer match messages in issue order
        return not (key[1] and self.key[1]) and bool(np.may_share_memory(buf, self.buf))


class HostCommunicator(Membership, Communicator):
    def __init__(self, rank: int, nranks: int, config: CommConfig, name: str,
                 store: Store | None = None, bootstrap: _Bootstrap | None = None) -> None:
        if not 0 <= rank < nranks:
            raise ValueError(f"rank {rank} out of range for {nranks} ranks")
        self.rank, self.nranks, self.config, self.name = rank, nranks, config, name
        self._state = CommState.INITIALIZING
        self._error: BaseException | None = None
        self._mesh: Mesh | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._streams: list[HostStream] = []
        self._used_streams: set[HostStream] = set()
        self._lanes: dict[tuple[int | None, bool], HostStream] = {}  # (peer or None: any, send?) -> its lane
        self._branched: dict[HostStream, list[_Branch]] = {}  # p2p ops moved off a stream, not joined back yet
        self._group: list[tuple[HostStream, str, Callable[[Mesh], None] | tuple[list[Send], list[Recv]]]] = []
        self._group_depth = 0
        self._split_count = 0
        self._shrink_count = 0
        self._store = store  # shrink() meets the survivors here (a split child gets its parent's)
        self._token = b""  # shared by every rank of this communicator: names its shrinks in the store
        self._rendezvous_store: Store | None = None  # set while init waits there: abort wakes it through it
        self._builder: MeshBuilder | None = None  # set while init connects: abort cancels it
        self._internal = self.new_stream()
        deadline = time.monotonic() + config.timeout
        if config.blocking:
            self._init(store, bootstrap, deadline)
            if self._error is not None:
                self.destroy()
                raise self._error
        else:
            threading.Thread(target=self._init, args=(store, bootstrap, deadline), daemon=True,
                             name=f"nccl_pg-init-{name}").start()

    @classmethod
    def create(cls, store: Store, nranks: int, rank: int, config: CommConfig | None = None,
               name: str = "host") -> HostCommunicator:
        """Join the communicator of ``nranks`` ranks that rendezvous in
        ``store`` (give each communicator its own PrefixStore)."""
        return cls(rank, nranks, config or CommConfig(), name, store=store)

    def __repr__(self) -> str:
        return f"HostCommunicator({self.name}, rank {self.rank}/{self.nranks}, {self._state.value})"

    # --- init ----------------------------------------------------------------------

    def _init(self, store: Store | None, boot: _Bootstrap | None, deadline: float) -> None:
        """Every step has the init deadline, names the ranks it did not hear
        from, and ends soon after abort(): the store wait is woken through
        the store, the connections are cancelled, and the mesh is failed."""
        try:
            if boot is None:
                assert store is not None
                boot = self._rendezvous(store, deadline)
            self._token = boot.token
            builder = MeshBuilder(self.rank, self.nranks, boot.listener, boot.token, self.name)
            with self._lock:
                self._builder = builder
            try:
                if self._error is not None:
                    raise self._error
                socks = builder.build(boot.lower, deadline, self.config.timeout)
            finally:
                with self._lock:
                    self._builder = None
            mesh = Mesh(self.rank, self.nranks, socks, self.name, alg.WIRE_NAMES)
            with self._lock:
                if self._error is not None:  # aborted while connecting
                    mesh.close()
                    return
                self._mesh = mesh  # within abort's reach from here on
            mesh.tree_broadcast = self._agree_on_tree_broadcast(mesh, deadline)
            with self._lock:
                if self._error is None:
                    self._state = CommState.READY
        except BaseException as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc if isinstance(exc, DistBackendError) else DistBackendError(
                        f"{self.name}: init failed on rank {self.rank}: {exc}")
                    self._state = CommState.ERROR
        finally:
            if boot is not None:
                boot.listener.close()
            self._ready.set()

    def _agree_on_tree_broadcast(self, mesh: Mesh, deadline: float) -> bool:
        """Every rank must run the same broadcast algorithm, but each one's
        preference depends on its own host (ranks vs CPUs) and environment:
        take the tree when any rank wants it."""
        algo = env.HOST_BROADCAST.get()
        votes = np.zeros(self.nranks, dtype=np.uint8)
        votes[self.rank] = algo == "tree" or (algo == "auto" and mesh.local_ranks > len(os.sched_getaffinity(0)))
        peers = [p for p in range(self.nranks) if p != self.rank]
        mine = alg.u8(votes[self.rank:self.rank + 1])
        try:
            mesh.exchange(alg.KIND["all_gather"], [(p, mine) for p in peers],
                          [(p, alg.u8(votes[p:p + 1]), None) for p in peers], deadline=deadline)
        except MeshTimeoutError as exc:
            raise MeshTimeoutError(
                f"timeout: {self.name}: rank {self.rank}: Timed out after {self.config.timeout:g} s waiting for ranks "
                f"{exc.missing} to finish the init handshake: they connected, then fell silent (frozen?)",
                exc.missing) from None
        return bool(votes.any())

    def _rendezvous(self, store: Store, deadline: float) -> _Bootstrap:
        """O(1) store requests per rank, whatever the number of ranks: publish
        our address, count ourselves in (and mark that we did, unless we are
        the last, who says all joined instead: so a rank stopped between its
        count and its word can be named), wait for the last rank to say all
        joined (or an aborting rank to say it never will), then fetch the
        lower ranks' addresses in one request (the higher ones connect to us)."""
        listener = listen(_host_address(store))
        try:
            host, port = listener.getsockname()[:2]
            token = os.urandom(16) if self.rank == 0 else bytes(16)
            with self._lock:
                if self._error is not None:
                    raise self._error
                self._rendezvous_store = store
            store.set(f"addr/{self.rank}", _ADDR_RECORD.pack(token, port) + host.encode())
            if store.add("joined", 1) == self.nranks:
                store.compare_set("all", b"", _ALL_JOINED)
            else:
                store.set(f"counted/{self.rank}", b"")
            try:
                store.wait(["all"], timeout=max(deadline - time.monotonic(), 0.001))
            except DistStoreError:
                if self._error is not None:
                    raise self._error from None
                raise self._rendezvous_timeout(store) from None
            verdict = store.get("all")
            if verdict != _ALL_JOINED:  # a rank aborted its init and woke everyone (see _wake_rendezvous): the
                # addresses of the ranks that never joined will not come
                raise self._error or DistBackendError(f"{self.name}: rank {self.rank}: init failed: "
                                                      f"{verdict.decode(errors='replace')}")
            values = store.multi_get([f"addr/{r}" for r in range(self.rank)])
        except BaseException:
            listener.close()
            raise
        finally:
            with self._lock:
                self._rendezvous_store = None
        lower = {}
        for r, record in enumerate(values):
            their_token, their_port = _ADDR_RECORD.unpack_from(record)
            lower[r] = (record[_ADDR_RECORD.size:].decode(), their_port)
            if r == 0:
                token = their_token
        return _Bootstrap(listener, lower, token)

    def _rendezvous_timeout(self, store: Store) -> DistBackendError:
        """Name the ranks that never published their address, or else the
        ones that counted themselves in but went no further: bisections of
        ``check`` requests (a few per such rank, bounded), not one per rank."""
        budget = [_EXPLAIN_CHECKS]

        def search(prefix: str, lo: int, hi: int, found: list[int]) -> list[int]:
            if budget[0] <= 0:
                return found
            budget[0] -= 1
            if store.check([f"{prefix}{r}" for r in range(lo, hi)]):
                return found
            if hi - lo == 1:
                found.append(lo)
                return found
            mid = (lo + hi) // 2
            search(prefix, lo, mid, found)
            return search(prefix, mid, hi, found)

        head = (f"timeout: {self.name}: rank {self.rank}: Timed out after {self.config.timeout:g} s waiting for "
                f"the other ranks to join the communicator")
        try:
            joined = store.add("joined", 0)
            absent = search("addr/", 0, self.nranks, [])
            # Everyone counted, yet nobody said so: the last to count (who has no mark) stopped before it could.
            silent = search("counted/", 0, self.nranks, []) if not absent and joined >= self.nranks else []
        except Exception as exc:  # the store itself may be gone; say what is known
            return DistBackendError(f"{head}; the store could not tell who is missing ({exc})")
        more = " (and maybe others: the search stopped at its budget)" if budget[0] <= 0 else ""
        if len(silent) == 1:
            return DistBackendError(f"{head}: all {self.nranks} ranks counted themselves in, but rank {silent[0]} "
                                    f"counted itself in last but never announced that all had joined: it stopped "
                                    f"there (frozen, or killed during init?)")
        if silent:
            return DistBackendError(f"{head}: all {self.nranks} ranks counted themselves in, but ranks {silent}"
                                    f"{more} stopped right after (frozen, or killed during init?)")
        return DistBackendError(f"{head}: {joined} of {self.nranks} joined; ranks {absent}{more} never joined")

    def _wake_rendezvous(self) -> None:
        """Abort during the store wait: end it now for every rank (none can
        finish without us) by marking the rendezvous aborted. On a thread of
        its own: abort() never waits for the store."""
        with self._lock:
            store = self._rendezvous_store
        if store is None:
            return
        why = f"rank {self.rank} aborted its init".encode()

        def wake() -> None:
            try:
                store.compare_set("all", b"", why)
            except Exception:  # the store is gone: the waits end at their deadline instead
                pass

        threading.Thread(target=wake, name=f"nccl_pg-abort-{self.name}", daemon=True).start()

    # --- lifecycle --------------------------------------------------------------------

    @property
    def state(self) -> CommState:
        return self._state

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise DistBackendError(f"timeout: {self.name}: rank {self.rank} still initializing after {timeout} s")
        if self._state is not CommState.READY:
            raise self._error or DistBackendError(f"{self.name}: not ready ({self._state.value})")

    def async_error(self) -> BaseException | None:
        return self._error

    def _fail(self, error: BaseException, state: CommState = CommState.ERROR) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            self._state = state
            mesh = self._mesh
        if mesh is not None:
            mesh.fail(error)

    def abort(self) -> None:
        """The state becomes ABORTED; async_error() keeps the first cause
        (e.g. a lost peer seen just before)."""
        self._stop(CommState.ABORTED, "communicator aborted")

    def finalize(self, timeout: float | None = None) -> None:
        seconds = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        for s in list(self._used_streams):
            if not s.record().synchronize(max(deadline - time.monotonic(), 0)):
                raise DistBackendError(f"timeout: {self.name}: finalize waited {seconds:.1f} s for pending "
                                       f"operations on rank {self.rank}")
        if self._error is not None:
            raise self._error

    def destroy(self) -> None:
        with self._lock:
            if self._state is CommState.DESTROYED:
                return
            if self._error is None:
                self._error = DistBackendError(f"{self.name}: communicator destroyed on rank {self.rank}")
            self._state = CommState.DESTROYED
            mesh = self._mesh
        self._release_init()
        if mesh is not None:
            mesh.fail(self._error)
            mesh.close()
        for s in self._streams:
            s.aborted = True
            s.close(timeout=_ABORTED_STREAM_CLOSE)

    # --- streams --------------------------------------------------------------------

    def new_stream(self, high_priority: bool = False) -> HostStream:
        stream = HostStream(f"{self.name}-r{self.rank}-s{len(self._streams)}")
        self._streams.append(stream)
        return stream

    def new_event(self, timing: bool = False) -> HostEvent:
        return HostEvent()

    # --- enqueueing ----------------------------------------------------------------

    def _usable(self) -> None:
        if self._state in (CommState.ABORTED, CommState.DESTROYED, CommState.ERROR, CommState.REVOKED):
            raise self._error or DistBackendError(f"{self.name}: {self._state.value}")

    def _stream(self, stream: Stream) -> HostStream:
        if not isinstance(stream, HostStream):
            raise TypeError(f"the host backend needs a HostStream, got {type(stream).__name__}")
        return stream

    def _enqueue(self, stream: Stream, kind: str, fn: Callable[[Mesh], None], nbytes: int | None = None) -> None:
        """``nbytes``: the largest buffer of a collective. With one rank there is nothing to communicate: a
        collective of up to INLINE_BYTES runs at once in the caller's thread when the stream is idle, rather
        than waking the stream's thread and waiting for it (larger ones stay on the stream, which the caller
        may overlap with its own work)."""
        self._usable()
        hs = self._stream(stream)
        if self._group_depth:
            self._group.append((hs, kind, fn))
            return
        self._used_streams.add(hs)
        if nbytes is not None and nbytes <= INLINE_BYTES and self.nranks == 1 and self._ready.is_set():
            hs.run_or_enqueue(lambda: self._run(fn))
        else:
            hs.enqueue(lambda: self._run(fn))

    def _run(self, fn: Callable[[Mesh], None]) -> None:
        """On the stream's thread: wait for init (nonblocking mode), then run.
        Init ends by its own deadline with the better error (it names the
        missing ranks); this wait is only a backstop, so it allows a grace."""
        if not self._ready.is_set() and not self._ready.wait(self.config.timeout + _INIT_GRACE):
            self._fail(DistBackendError(f"timeout: {self.name}: rank {self.rank} was still initializing after "
                                        f"{self.config.timeout:.1f} s when an operation was due"))
        mesh = self._mesh
        if self._error is not None or mesh is None:
            return  # the failure is already reported through async_error()
        try:
            fn(mesh)
        except BaseException as exc:
            self._fail(exc if isinstance(exc, DistBackendError) else DistBackendError(
                f"{self.name}: operation failed on rank {self.rank}: {exc!r}"))

    def _root(self, root: int) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.nranks:
            raise ValueError(f"root {root!r} out of range for {self.nranks} ranks")
        return int(root)

    def _peer(self, peer: int) -> int:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.nranks or peer == self.rank:
            raise ValueError(f"peer {peer!r} must be another rank in 0..{self.nranks - 1} (this is rank {self.rank})")
        return int(peer)

    @staticmethod
    def _same(send: np.ndarray, recv: np.ndarray, op: str, send_size: int, recv_size: int) -> None:
        if send.dtype != recv.dtype:
            raise TypeError(f"{op}: send dtype {send.dtype} differs from recv dtype {recv.dtype}")
        if send.size != send_size or recv.size != recv_size:
            raise ValueError(f"{op}: send has {send.size} elements and recv {recv.size}; expected "
                             f"{send_size} and {recv_size}")

    # --- operations -------------------------------------------------------------------

    def all_reduce(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None:
        s, r = _flat(send, "all_reduce send"), _out(recv, "all_reduce recv")
        self._same(s, r, "all_reduce", s.size, s.size)
        check_reduction(s.dtype, op, scale, "all_reduce")
        self._enqueue(stream, "all_reduce", lambda m: alg.all_reduce(m, s, r, op, scale), r.nbytes)

    def broadcast(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = self._root(root)
        r = _out(recv, "broadcast recv") if self.rank != root else _flat(recv, "broadcast recv")
        s = _flat(send, "broadcast send") if self.rank == root else r
        self._same(s, r, "broadcast", r.size, r.size)
        self._enqueue(stream, "broadcast", lambda m: alg.broadcast(m, s, r, root), r.nbytes)

    def reduce(self, send: Any, recv: Any, op: ReduceOp, root: int, stream: Stream,
               scale: float | None = None) -> None:
        root = self._root(root)
        s = _flat(send, "reduce send")
        r = _out(recv, "reduce recv") if self.rank == root else None
        if r is not None:
            self._same(s, r, "reduce", s.size, s.size)
        check_reduction(s.dtype, op, scale, "reduce")
        self._enqueue(stream, "reduce", lambda m: alg.reduce(m, s, r, op, root, scale), s.nbytes)

    def all_gather(self, send: Any, recv: Any, stream: Stream) -> None:
        s, r = _flat(send, "all_gather send"), _out(recv, "all_gather recv")
        self._same(s, r, "all_gather", s.size, s.size * self.nranks)
        self._enqueue(stream, "all_gather", lambda m: alg.all_gather(m, s, r), r.nbytes)

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None:
        s, r = _flat(send, "reduce_scatter send"), _out(recv, "reduce_scatter recv")
        self._same(s, r, "reduce_scatter", r.size * self.nranks, r.size)
        check_reduction(s.dtype, op, scale, "reduce_scatter")
        self._enqueue(stream, "reduce_scatter", lambda m: alg.reduce_scatter(m, s, r, op, scale), s.nbytes)

    def all_to_all(self, send: Any, recv: Any, stream: Stream, send_counts: Sequence[int] | None = None,
                   recv_counts: Sequence[int] | None = None) -> None:
        s, r = _flat(send, "all_to_all send"), _out(recv, "all_to_all recv")
        n = self.nranks
        if send_counts is None and recv_counts is None:
            if s.size % n or s.size != r.size:
                raise ValueError(f"all_to_all: send ({s.size}) and recv ({r.size}) must be equal and divisible "
                                 f"by {n} ranks")
            send_counts = recv_counts = [s.size // n] * n
        elif send_counts is None or recv_counts is None:
            raise ValueError("all_to_all: give both send_counts and recv_counts, or neither")
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if len(sc) != n or len(rc) != n or min(sc + rc) < 0:
            raise ValueError(f"all_to_all: counts must be {n} non-negative numbers each")
        self._same(s, r, "all_to_all", sum(sc), sum(rc))
        self._enqueue(stream, "all_to_all", lambda m: alg.all_to_all(m, s, r, sc, rc), max(s.nbytes, r.nbytes))

    def gather(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = self._root(root)
        s = _flat(send, "gather send")
        r = _out(recv, "gather recv") if self.rank == root else None
        if r is not None:
            self._same(s, r, "gather", s.size, s.size * self.nranks)
        self._enqueue(stream, "gather", lambda m: alg.gather(m, s, r, root), s.nbytes * self.nranks)

    def scatter(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = self._root(root)
        r = _out(recv, "scatter recv")
        s = _flat(send, "scatter send") if self.rank == root else None
        if s is not None:
            self._same(s, r, "scatter", r.size * self.nranks, r.size)
        self._enqueue(stream, "scatter", lambda m: alg.scatter(m, s, r, root), r.nbytes * self.nranks)

    def send(self, buf: Any, peer: int, stream: Stream) -> None:
        self._p2p(stream, [(self._peer(peer), alg.u8(_flat(buf, "send buf")))], [])

    def recv(self, buf: Any, peer: int, stream: Stream) -> None:
        self._p2p(stream, [], [(self._peer(peer), alg.u8(_out(buf, "recv buf")), None)])

    supports_recv_any = True

    def recv_any(self, buf: Any, stream: Stream) -> Callable[[], int | None]:
        target = alg.u8(_flat(buf, "recv buf"))
        if self._group_depth:
            raise ValueError("a receive from any source cannot be part of a group (group_start/group_end)")
        source: list[int] = []
        self._enqueue(stream, "recv from any source",
                      lambda m: source.append(m.recv_any(alg.KIND["send/recv"], target)))
        return lambda: source[0] if source else None

    # --- point-to-point lanes ---------------------------------------------------------

    def p2p_stream(self, stream: Stream, peer: int | None, send: bool, buf: Any) -> HostStream:
        """Each peer and direction has a lane (a stream of its own): a send
        never waits behind a receive from another peer or direction, as with
        Gloo, which torch's batch_isend_irecv relies on for a Python process
        group (it issues the ops one by one, receives first). What NCCL's
        stream order guarantees and programs rely on is kept: the lane starts
        after the work issued before on ``stream``; ops of one peer and
        direction stay in order; an op whose buffer overlaps that of a
        pending op on another lane (one of them writing) waits for it; a
        receive from any source is ordered with every receive; and the next
        non-p2p work on ``stream`` waits for the lanes (``join_p2p``)."""
        hs = self._stream(stream)
        key = (None if peer is None else self._peer(peer), send)
        arr = _flat(buf, "send buf" if send else "recv buf")
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = self.new_stream()
            if not hs.query():
                lane.wait_event(hs.record())
            pending = [b for b in self._branched.get(hs, []) if not b.lane.query()]
            for other in dict.fromkeys(b.lane for b in pending if b.lane is not lane and b.orders(key, arr)):
                lane.wait_event(other.record())
            self._branched[hs] = [*pending, _Branch(lane, key, arr)]
        return lane

    def join_p2p(self, stream: Stream) -> None:
        if not self._branched:
            return
        hs = self._stream(stream)
        with self._lock:
            pending = self._branched.pop(hs, [])
        for lane in dict.fromkeys(b.lane for b in pending):
            if not lane.query():
                hs.wait_event(lane.record())

    def _p2p(self, stream: Stream, sends: list[Send], recvs: list[Recv]) -> None:
        self._usable()
        hs = self._stream(stream)
        if self._group_depth:
            self._group.append((hs, "send/recv", (sends, recvs)))
            return
        self._enqueue(hs, "send/recv", lambda m: m.exchange(alg.KIND["send/recv"], sends, recvs))

    # --- groups ----------------------------------------------------------------------

    def group_start(self) -> None:
        self._group_depth += 1

    def group_end(self) -> None:
        if self._group_depth == 0:
            raise RuntimeError("group_end() without group_start()")
        self._group_depth -= 1
        if self._group_depth:
            return
        group, self._group = self._group, []
        if not group:
            return
        streams = list(dict.fromkeys(hs for hs, _, _ in group))
        main = streams[0]
        for other in streams[1:]:  # the group starts when all its streams reach it...
            main.wait_event(other.record())
        collectives = [fn for _, _, fn in group if callable(fn)]
        sends = [x for _, _, fn in group if not callable(fn) for x in fn[0]]
        recvs = [x for _, _, fn in group if not callable(fn) for x in fn[1]]

        def run_group(mesh: Mesh) -> None:
            for fn in collectives:
                fn(mesh)
            if sends or recvs:  # all point-to-point ops progress together: paired sends never deadlock
                mesh.exchange(alg.KIND["send/recv"], sends, recvs)

        self._enqueue(main, "group", run_group)
        done = main.record()
        for other in streams[1:]:  # ...and they go on only after it
            other.wait_event(done)

    # --- split -------------------------------------------------------------------------

    @property
    def split_count(self) -> int:
        return self._split_count

    def split(self, color: int | None, key: int, config: CommConfig | None = None) -> HostCommunicator | None:
        self._usable()
        cfg = config or self.config
        if color is not None and (not isinstance(color, int) or color < 0):
            raise ValueError(f"split color must be a non-negative int or None, got {color!r}")
        self._split_count += 1
        listener = listen(self._my_address()) if color is not None else None
        host, port = listener.getsockname()[:2] if listener else ("", 0)
        mine = np.frombuffer(_SPLIT_RECORD.pack(-1 if color is None else color, key, port, os.urandom(16),
                                                host.encode()), dtype=np.uint8)
        try:
            everyone = self._gather_internal(mine, cfg.timeout, "split")
        except BaseException:
            if listener:
                listener.close()
            raise
        if color is None:
            return None
        records = [_SPLIT_RECORD.unpack_from(everyone.data, i * _SPLIT_RECORD.size) for i in range(self.nranks)]
        members = sorted((rec[1], r) for r, rec in enumerate(records) if rec[0] == color)
        ranks = [r for _, r in members]
        child_rank = ranks.index(self.rank)
        lower = {i: (records[r][4].rstrip(b"\0").decode(), records[r][2]) for i, r in enumerate(ranks[:child_rank])}
        token = records[ranks[0]][3]
        assert listener is not None
        boot = _Bootstrap(listener, lower, token)
        child = HostCommunicator(child_rank, len(ranks), cfg, f"{self.name}.{color}", bootstrap=boot)
        child._store = self._store
        return child

    def _stop(self, state: CommState, why: str) -> None:
        """Fail what is in flight and everything after; the first cause (a
        lost peer, say) stays the async error."""
        self._fail(DistBackendError(f"{self.name}: {why} on rank {self.rank}"), state)
        with self._lock:
            if self._state is not CommState.DESTROYED:
                self._state = state
        self._release_init()
        for s in self._streams:
            s.aborted = True  # unblock streams waiting on events that will never come

    def _release_init(self) -> None:
        """An init still running ends now: its waiters are released at once
        and its thread soon after (the store wait woken, the connections
        cancelled; a mesh already built was failed by _fail)."""
        if self._ready.is_set():
            return
        self._wake_rendezvous()
        with self._lock:
            builder = self._builder
        if builder is not None:
            builder.cancel()
        self._ready.set()

    def _sibling(self, rank: int, nranks: int, config: CommConfig, name: str, store: Store) -> HostCommunicator:
        """A new communicator that meets through ``store`` (shrink, grow)."""
        return HostCommunicator(rank, nranks, config, name, store=store)

    def _gather_internal(self, mine: np.ndarray, timeout: float, what: str) -> np.ndarray:
        """Every rank's ``mine`` (uint8, the same size everywhere), gathered
        over the mesh on the internal stream, within ``timeout`` seconds."""
        everyone = np.empty(self.nranks * mine.size, dtype=np.uint8)
        self._enqueue(self._internal, what, lambda m: alg.all_gather(m, mine, everyone))
        if not self._internal.record().synchronize(timeout):
            raise DistBackendError(f"timeout: {self.name}: {what} waited {timeout:.1f} s for the other ranks")
        if self._error is not None:
            raise self._error
        return everyone

    def _my_address(self) -> str:
        return (self._mesh.local_address() if self._mesh else None) or env.HOST_ADDR.get() or "127.0.0.1"

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
from ...store import PrefixStore, Store, TCPStore
from ..base import CommConfig, CommState, Communicator, Stream, check_exclude
from . import algorithms as alg
from .stream import HostEvent, HostStream
from .transport import Mesh, MeshTimeoutError, Recv, Send, connect_mesh, listen

_FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e4m3fnuz", "float8_e5m2fnuz")
# Stream threads wait this much past the init deadline before giving up on init themselves.
_INIT_GRACE = 2.0
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
    if isinstance(inner, TCPStore):
        return inner.local_address()
    return "127.0.0.1"


@dataclass
class _Bootstrap:
    """What a new rank needs to join its mesh."""

    listener: socket.socket
    lower: dict[int, tuple[str, int]] | None  # None: read the addresses from the store
    token: bytes


def _flat(a: Any, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what}: the host backend takes numpy arrays, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: array must be contiguous")
    return a.reshape(-1)


def _check_reducible(a: np.ndarray, op: ReduceOp, scale: float | None) -> None:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a ReduceOp, got {op!r}")
    if a.dtype.name in _FP8:
        raise TypeError("Float8 dtypes are not supported for NCCL reductions")
    if a.dtype.kind == "c" and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise TypeError(f"{op!r} is not supported on complex arrays (only SUM and AVG)")
    if a.dtype == np.bool_ and op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM):
        raise TypeError(f"Cannot use {op!r} with boolean inputs")
    if (op is ReduceOp.PREMUL_SUM) != (scale is not None):
        raise ValueError("PREMUL_SUM needs a scale factor, and only PREMUL_SUM takes one")


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


class HostCommunicator(Communicator):
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
        try:
            if boot is None:
                assert store is not None
                boot = self._publish(store, deadline)
            if boot.lower is None:
                assert store is not None
                boot.lower = self._read_addresses(store, deadline)
            self._token = boot.token
            try:
                socks = connect_mesh(self.rank, self.nranks, boot.listener, boot.lower, boot.token, deadline,
                                     self.name, aborted=lambda: self._error is not None)
            except MeshTimeoutError as exc:
                raise self._explain(exc, store) from None
            mesh = Mesh(self.rank, self.nranks, socks, self.name, alg.OPS)
            mesh.tree_broadcast = self._agree_on_tree_broadcast(mesh)
            with self._lock:
                if self._error is not None:  # aborted while connecting
                    mesh.close()
                    return
                self._mesh = mesh
                self._state = CommState.READY
        except BaseException as exc:
            if boot is not None:
                boot.listener.close()
            with self._lock:
                if self._error is None:
                    self._error = exc if isinstance(exc, DistBackendError) else DistBackendError(
                        f"{self.name}: init failed on rank {self.rank}: {exc}")
                    self._state = CommState.ERROR
        finally:
            self._ready.set()

    def _agree_on_tree_broadcast(self, mesh: Mesh) -> bool:
        """Every rank must run the same broadcast algorithm, but each one's
        preference depends on its own host (ranks vs CPUs) and environment:
        take the tree when any rank wants it."""
        algo = env.HOST_BROADCAST.get()
        mine = algo == "tree" or (algo == "auto" and mesh.local_ranks > len(os.sched_getaffinity(0)))
        votes = np.empty(self.nranks, dtype=np.uint8)
        alg.all_gather(mesh, np.array([mine], dtype=np.uint8), votes)
        return bool(votes.any())

    def _explain(self, exc: MeshTimeoutError, store: Store | None) -> DistBackendError:
        """Tell the ranks that never joined from those that joined but wait,
        like us, for the missing ones (only the store knows who published)."""
        if store is None:
            return exc
        try:
            absent = [r for r in exc.missing if not store.check([f"addr/{r}"])]
        except Exception:  # the store itself may be gone; the plain message still holds
            return exc
        waiting = [r for r in exc.missing if r not in absent]
        detail = f"ranks {absent} never joined" if absent else f"ranks {waiting} joined but never connected"
        if absent and waiting:
            detail += f"; ranks {waiting} joined and are waiting for them too"
        return DistBackendError(f"timeout: {self.name}: rank {self.rank} waited {self.config.timeout:.1f} s "
                                f"to build the communicator: {detail}")

    def _publish(self, store: Store, deadline: float) -> _Bootstrap:
        if self.rank == 0:
            token = os.urandom(16)
            store.set("token", token)
        else:
            token = self._store_wait(store, ["token"], deadline)[0]
        listener = listen(_host_address(store))
        host, port = listener.getsockname()[:2]
        store.set(f"addr/{self.rank}", f"{host}:{port}")
        return _Bootstrap(listener, None, token)

    def _read_addresses(self, store: Store, deadline: float) -> dict[int, tuple[str, int]]:
        values = self._store_wait(store, [f"addr/{r}" for r in range(self.rank)], deadline)
        out = {}
        for r, v in enumerate(values):
            host, _, port = v.decode().rpartition(":")
            out[r] = (host, int(port))
        return out

    def _store_wait(self, store: Store, keys: list[str], deadline: float) -> list[bytes]:
        """Wait in short slices so that abort() interrupts a stuck init."""
        while True:
            if self._error is not None:
                raise self._error
            left = deadline - time.monotonic()
            try:
                store.wait(keys, timeout=max(min(left, 0.1), 0.001))
                return [store.get(k) for k in keys]
            except DistStoreError:
                if time.monotonic() >= deadline:
                    missing = [k for k in keys if not store.check([k])]
                    ranks = sorted(int(k.split("/")[1]) if "/" in k else 0 for k in missing)
                    raise DistBackendError(
                        f"timeout: {self.name}: rank {self.rank} waited {self.config.timeout:.1f} s for ranks "
                        f"{ranks} to join the communicator"
                    ) from None

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
        if mesh is not None:
            mesh.fail(self._error)
            mesh.close()
        for s in self._streams:
            s.aborted = True
            s.close(timeout=1.0)

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

    def _enqueue(self, stream: Stream, kind: str, fn: Callable[[Mesh], None]) -> None:
        self._usable()
        hs = self._stream(stream)
        if self._group_depth:
            self._group.append((hs, kind, fn))
            return
        self._used_streams.add(hs)
        hs.enqueue(lambda: self._run(fn))

    def _run(self, fn: Callable[[Mesh], None]) -> None:
        """On the stream's thread: wait for init (nonblocking mode), then run.
        Init ends by its own deadline with the better error (it names the
        missing ranks); this wait is only a backstop, so it allows a grace."""
        if not self._ready.wait(self.config.timeout + _INIT_GRACE):
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
        s, r = _flat(send, "all_reduce send"), _flat(recv, "all_reduce recv")
        self._same(s, r, "all_reduce", s.size, s.size)
        _check_reducible(s, op, scale)
        self._enqueue(stream, "all_reduce", lambda m: alg.all_reduce(m, s, r, op, scale))

    def broadcast(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = self._root(root)
        r = _flat(recv, "broadcast recv")
        s = _flat(send, "broadcast send") if self.rank == root else r
        self._same(s, r, "broadcast", r.size, r.size)
        self._enqueue(stream, "broadcast", lambda m: alg.broadcast(m, s, r, root))

    def reduce(self, send: Any, recv: Any, op: ReduceOp, root: int, stream: Stream,
               scale: float | None = None) -> None:
        root = self._root(root)
        s = _flat(send, "reduce send")
        r = _flat(recv, "reduce recv") if self.rank == root else None
        if r is not None:
            self._same(s, r, "reduce", s.size, s.size)
        _check_reducible(s, op, scale)
        self._enqueue(stream, "reduce", lambda m: alg.reduce(m, s, r, op, root, scale))

    def all_gather(self, send: Any, recv: Any, stream: Stream) -> None:
        s, r = _flat(send, "all_gather send"), _flat(recv, "all_gather recv")
        self._same(s, r, "all_gather", s.size, s.size * self.nranks)
        self._enqueue(stream, "all_gather", lambda m: alg.all_gather(m, s, r))

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None:
        s, r = _flat(send, "reduce_scatter send"), _flat(recv, "reduce_scatter recv")
        self._same(s, r, "reduce_scatter", r.size * self.nranks, r.size)
        _check_reducible(s, op, scale)
        self._enqueue(stream, "reduce_scatter", lambda m: alg.reduce_scatter(m, s, r, op, scale))

    def all_to_all(self, send: Any, recv: Any, stream: Stream, send_counts: Sequence[int] | None = None,
                   recv_counts: Sequence[int] | None = None) -> None:
        s, r = _flat(send, "all_to_all send"), _flat(recv, "all_to_all recv")
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
        self._enqueue(stream, "all_to_all", lambda m: alg.all_to_all(m, s, r, sc, rc))

    def gather(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = self._root(root)
        s = _flat(send, "gather send")
        r = _flat(recv, "gather recv") if self.rank == root else None
        if r is not None:
            self._same(s, r, "gather", s.size, s.size * self.nranks)
        self._enqueue(stream, "gather", lambda m: alg.gather(m, s, r, root))

    def scatter(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = self._root(root)
        r = _flat(recv, "scatter recv")
        s = _flat(send, "scatter send") if self.rank == root else None
        if s is not None:
            self._same(s, r, "scatter", r.size * self.nranks, r.size)
        self._enqueue(stream, "scatter", lambda m: alg.scatter(m, s, r, root))

    def send(self, buf: Any, peer: int, stream: Stream) -> None:
        self._p2p(stream, [(self._peer(peer), alg.u8(_flat(buf, "send buf")))], [])

    def recv(self, buf: Any, peer: int, stream: Stream) -> None:
        self._p2p(stream, [], [(self._peer(peer), alg.u8(_flat(buf, "recv buf")), None)])

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
        everyone = np.empty(self.nranks * _SPLIT_RECORD.size, dtype=np.uint8)
        self._enqueue(self._internal, "split", lambda m: alg.all_gather(m, mine, everyone))
        if not self._internal.record().synchronize(cfg.timeout):
            if listener:
                listener.close()
            raise DistBackendError(f"timeout: {self.name}: split waited {cfg.timeout:.1f} s for the other ranks")
        if self._error is not None:
            if listener:
                listener.close()
            raise self._error
        if color is None:
            return None
        records = [_SPLIT_RECORD.unpack_from(everyone, i * _SPLIT_RECORD.size) for i in range(self.nranks)]
        members = sorted((rec[1], r) for r, rec in enumerate(records) if rec[0] == color)
        ranks = [r for _, r in members]
        child_rank = ranks.index(self.rank)
        lower = {i: (records[r][4].rstrip(b"\0").decode(), records[r][2]) for i, r in enumerate(ranks[:child_rank])}
        token = records[ranks[0]][3]
        boot = _Bootstrap(listener, lower, token)
        assert listener is not None
        child = HostCommunicator(child_rank, len(ranks), cfg, f"{self.name}.{color}", bootstrap=boot)
        child._store = self._store
        return child

    # --- shrink and revoke ------------------------------------------------------------------

    supports_shrink = True
    supports_revoke = True

    def shrink(self, exclude: Sequence[int], config: CommConfig | None = None,
               abort_first: bool = False) -> HostCommunicator:
        """The survivors meet again through the store (NCCL reuses its
        bootstrap network; ours is the store), under a key only this
        communicator's ranks know, so that the excluded ranks, dead or alive,
        are never waited for. Works on a communicator in error or revoked."""
        excluded = check_exclude(exclude, self.nranks, self.rank)
        if self._state is CommState.INITIALIZING:
            self.wait_ready(self.config.timeout + _INIT_GRACE)
        if self._state is CommState.DESTROYED or self._store is None or not self._token:
            raise DistBackendError(f"{self.name}: cannot shrink a communicator that is {self._state.value}")
        if abort_first:
            self._stop(CommState.REVOKED, "in-flight operations stopped to shrink")
        self._shrink_count += 1
        survivors = [r for r in range(self.nranks) if r not in excluded]
        prefix = f"shrink/{self._token.hex()}/{self._shrink_count}/"
        return HostCommunicator(survivors.index(self.rank), len(survivors), config or self.config,
                                f"{self.name}.shrink{self._shrink_count}", store=PrefixStore(prefix, self._store))

    def revoke(self) -> None:
        self._stop(CommState.REVOKED, "communicator revoked")

    def _stop(self, state: CommState, why: str) -> None:
        """Fail what is in flight and everything after; the first cause (a
        lost peer, say) stays the async error."""
        self._fail(DistBackendError(f"{self.name}: {why} on rank {self.rank}"), state)
        with self._lock:
            if self._state is not CommState.DESTROYED:
                self._state = state
        for s in self._streams:
            s.aborted = True  # unblock streams waiting on events that will never come

    def _my_address(self) -> str:
        return (self._mesh.local_address() if self._mesh else None) or env.HOST_ADDR.get() or "127.0.0.1"

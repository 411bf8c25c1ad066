"""HostCommunicator: the Communicator contract for numpy arrays over TCP.
Its parts: bootstrap.py (init), operations.py (collectives, point-to-point,
groups), membership.py (shrink, revoke, grow); here, its state, lifecycle,
streams, the enqueueing every operation goes through, and split.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from ... import env
from ...errors import DistBackendError
from ...store import Store
from ..base import CommConfig, CommState, Communicator, Stream
from . import algorithms as alg
from .bootstrap import Bootstrap, Bootstrapping
from .connect import MeshBuilder, listen
from .membership import Membership
from .operations import Branch, Operations
from .stream import INLINE_BYTES, HostEvent, HostStream
from .transport import Mesh, Recv, Send

# Stream threads wait this much past the init deadline before giving up on init themselves.
_INIT_GRACE = 2.0
# destroy() marks its streams aborted first, so their threads end at their next check (every _ABORT_POLL);
# this bounds the wait for one stuck in a task.
_ABORTED_STREAM_CLOSE = 1.0
# (color, key, port, token, host) published by every rank in a split
_SPLIT_RECORD = struct.Struct("<qqH16s64s")
_READY, _INITIALIZING = CommState.READY, CommState.INITIALIZING  # the usable states


class HostCommunicator(Membership, Operations, Bootstrapping, Communicator):
    def __init__(self, rank: int, nranks: int, config: CommConfig, name: str,
                 store: Store | None = None, bootstrap: Bootstrap | None = None) -> None:
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
        self._branched: dict[HostStream, list[Branch]] = {}  # p2p ops moved off a stream, not joined back yet
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
        state = self._state
        if state is not _READY and state is not _INITIALIZING:  # identity: no Enum code on every operation
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
            hs.run_or_enqueue(functools.partial(self._run, fn))  # (a partial: no Python frame of its own)
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
        boot = Bootstrap(listener, lower, token)
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

"""ProcessGroup: one rank's view of a group of processes, over a backend.

It owns (lazily, or eagerly on request) one communicator and one stream,
numbers its operations, checks arguments, turns list-shaped arguments into
the flat buffers the Communicator contract takes (copies run on the same
stream), and hands out Works watched by the process-wide watchdog.
Ranks here are group ranks; distributed.py maps global ranks onto them.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np

from . import diagnosis, env, flight_recorder, forks, group_view, nan_check, watchdog
from .backends import get_backend
from .comm.base import Backend, CommConfig, CommState, Communicator, Event, Stream, check_dtype, check_exclude
from .errors import DistBackendError, NanError
from .fingerprint import Fingerprint, mismatch
from .flight_recorder import Entry
from .group_view import Activity, GroupView, InFlight
from .monitored_barrier import barrier_timeout, monitored_barrier
from .nan_check import NanCheck, Pending
from .reduce_op import PremulSum, ReduceOp, resolve
from .store import PrefixStore, Store
from .work import OpType, Work, WorkInfo

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)
# Error-handling modes 1 and 3: how long another failing thread waits for the process to end (it does at once).
_ENDING_GRACE = 10.0
# shrink flags (torch's values): stop the parent's in-flight operations first, or not
SHRINK_DEFAULT = 0x00
SHRINK_ABORT = 0x01

Op = ReduceOp | PremulSum
_P2P = (OpType.SEND, OpType.RECV)
_ANY_SOURCE = -1  # the peer of a receive from any source
# The flight recorder's names for operations (PyTorch's, so its tools read our dumps).
_PROFILING_NAME = {
    OpType.ALLREDUCE: "nccl:all_reduce", OpType.ALLREDUCE_COALESCED: "nccl:allreduce_coalesced",
    OpType.BROADCAST: "nccl:broadcast", OpType.REDUCE: "nccl:reduce", OpType.ALLGATHER: "nccl:all_gather",
    OpType._ALLGATHER_BASE: "nccl:_all_gather_base", OpType.REDUCE_SCATTER: "nccl:reduce_scatter",
    OpType._REDUCE_SCATTER_BASE: "nccl:_reduce_scatter_base", OpType.ALLTOALL_BASE: "nccl:all_to_all",
    OpType.ALLTOALL: "nccl:all_to_all", OpType.GATHER: "nccl:gather", OpType.SCATTER: "nccl:scatter",
    OpType.BARRIER: "nccl:all_reduce_barrier", OpType.COALESCED: "nccl:coalesced",
    OpType.SEND: "nccl:send", OpType.RECV: "nccl:recv",
}
Enqueue = Callable[[Communicator, Stream], None]
Checked = Sequence[tuple[str, Any]]  # (argument name, array) pairs a NaN check scans


# The longest deadline every blocking primitive can take (threading waits overflow beyond it, ~292 years).
MAX_TIMEOUT = threading.TIMEOUT_MAX


def seconds(timeout: timedelta | float | int) -> float:
    """A group timeout in seconds: finite and > 0. Every operation of a group
    has a deadline (the watchdog enforces it), so there is no "no limit"
    value; inf, nan and what no deadline can hold are refused here, at the
    call, rather than overflowing at the first collective."""
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float, np.integer, np.floating)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise TypeError(f"timeout must be a number of seconds or a timedelta, got {type(timeout).__name__}")
    if not 0 < value <= MAX_TIMEOUT:  # also False for nan
        raise ValueError(f"timeout must be a finite number of seconds > 0 and <= {MAX_TIMEOUT:.0f}, got {timeout!r}")
    return value


@dataclass
class NCCLConfig:
    """Communicator settings passed through to ncclConfig_t (the host backend
    keeps but ignores the NCCL-only ones). ``blocking=None``: from
    ``NCCL_PG_USE_COMM_NONBLOCKING``."""

    blocking: bool | None = None
    cga_cluster_size: int | None = None
    min_ctas: int | None = None
    max_ctas: int | None = None
    net_name: str | None = None
    comm_name: str | None = None
    split_share: bool | None = None


@dataclass
class Options:
    """Per-group options (``ProcessGroupNCCL.Options`` in torch).
    ``nan_check``: this group's NaN check mode (off, raise, async, trap);
    None: from ``NCCL_PG_NAN_CHECK``."""

    timeout: float = DEFAULT_TIMEOUT.total_seconds()
    is_high_priority_stream: bool = False
    config: NCCLConfig = field(default_factory=NCCLConfig)
    nan_check: str | None = None

    def __post_init__(self) -> None:
        self.timeout = seconds(self.timeout)

    @property
    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout)

    @_timeout.setter
    def _timeout(self, value: timedelta | float) -> None:
        self.timeout = seconds(value)


def _real(dtype: np.dtype) -> np.dtype:
    """Complex arrays travel as their real view (NCCL has no complex type)."""
    return np.empty(0, dtype).real.dtype if np.issubdtype(dtype, np.complexfloating) else dtype


class ProcessGroup:
    """A group of ``size`` ranks; this process is ``rank``."""

    def __init__(self, store: Store, rank: int, size: int, options: Options | None = None, *,
                 backend: str | Backend = "host", device_id: Any = None, group_name: str = "0",
                 group_desc: str = "undefined", uid: int = 0) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"world size must be a positive int, got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank {rank!r} out of range for world size {size}")
        env.watchdog_timing()  # contradictory watchdog settings fail here, before the watchdog starts
        self._owner = forks.Owner()  # a forked child's copy of this group must not abort it
        self._backend = get_backend(backend) if isinstance(backend, str) else backend
        # Where the CPU runs the operations (host, null), one may be complete when issued (nothing queued before
        # it); a GPU's never is, and asking its event would cost a runtime call per operation.
        self._may_complete_at_issue = self._backend.blocking_wait
        self._store = store
        self._rank, self._size = rank, size
        self.options = options or Options()
        self._timeout = self.options.timeout
        self._device = device_id
        self.group_name, self.group_desc, self.uid = group_name, group_desc, uid
        # Read by every Work's wait() (work.WorkGroup): plain attributes, no property calls on the hot path.
        self.blocking_wait = env.BLOCKING_WAIT.get()
        self.waits_block = self._backend.blocking_wait or self.blocking_wait
        self._error_handling = env.ASYNC_ERROR_HANDLING.get()
        self._detail = env.DEBUG.get() == "detail"  # log every operation issued (opt-in: hot path)
        self._global_ranks: list[int] | None = None  # group rank -> global rank, set by new_group
        self._lock = threading.RLock()
        self._comm: Communicator | None = None
        self._creating: Communicator | None = None  # an init in progress, for abort() to reach
        self._abort_requested = False  # set by abort() without the lock, for an init in progress to see
        self._stream: Stream | None = None
        self._live: tuple[Communicator, Stream] | None = None  # both, once set up: _ready's path without the lock
        self._split_from: ProcessGroup | None = None  # lazy: split this parent's communicator at first use
        self._seq = 0
        self._seq_p2p = 0
        self._monitored_barriers = 0
        self._completed_seq = 0
        self._started_seq = 0
        self._op_id = 0
        self._recorder = flight_recorder.get()
        self._coalesced_entries: list[Entry | None] = []
        self._coalesced_peers: list[int | None] = []  # per op in a coalescing group: its p2p peer, None: a collective
        self._coalesced_nan: list[Pending] = []
        self._prechecked = False  # raise mode: the open coalescing group's inputs were all checked up front
        self._timing_out: set[Work] = set()
        self._error_handled = False
        self._hooks: list[Callable[[WorkInfo], None]] = []
        self._timing = env.ENABLE_TIMING.get()
        self._pending: set[Work] = set()
        self._coalescing: list[Callable[[], None]] | None = None  # copy-outs deferred to the group's end
        self._coalesced_outputs: list[Any] = []
        self._closed: str | None = None  # "destroyed" / "aborted"
        self._close_reason: str | None = None  # the failure that aborted it (error handling, blocking wait)
        self._nonblocking = (self.options.config.blocking is False) or (
            self.options.config.blocking is None and env.USE_COMM_NONBLOCKING.get())
        self.diag = self._diag_view()
        group_view.register(self, self.diag)
        self._nan: NanCheck | None = None
        self.set_nan_check(self.options.nan_check)
        watchdog.get().watch_group(self)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(uid={self.uid}, desc={self.group_desc!r}, rank={self._rank}, "
                f"size={self._size}, backend={self._backend.name})")

    # --- identity ---------------------------------------------------------------------

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    @property
    def backend_name(self) -> str:
        return self._backend.name

    def _get_sequence_number_for_group(self) -> int:
        """Sequence number of the last collective issued (0: none yet)."""
        return self._seq

    def _set_default_timeout(self, timeout: timedelta | float) -> None:
        """Timeout of operations issued from now on (``options._timeout`` follows, as in torch)."""
        self._timeout = self.options.timeout = seconds(timeout)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self._timeout)

    def _set_blocking_wait(self, on: bool) -> None:
        self.blocking_wait = on
        self.waits_block = self._backend.blocking_wait or on

    def set_nan_check(self, mode: str | None) -> None:
        """NaN check mode of the operations issued from now on: off, raise,
        async or trap (see docs/NAN_CHECK.md); None: ``NCCL_PG_NAN_CHECK``."""
        resolved = nan_check.resolve_mode(mode)
        self.options.nan_check = mode
        self._nan = None if resolved == "off" else NanCheck(self.diag, self._backend, self._device, resolved)

    @property
    def nan_check(self) -> str:
        return "off" if self._nan is None else self._nan.mode

    def _global_rank_of(self, group_rank: int) -> int:
        return group_rank if self._global_ranks is None else self._global_ranks[group_rank]

    # --- communicator -------------------------------------------------------------------

    def _comm_config(self) -> CommConfig:
        c = self.options.config
        return CommConfig(blocking=not self._nonblocking, timeout=self._timeout,
                          comm_name=c.comm_name or f"pg{self.uid}:{self.group_desc}",
                          high_priority_stream=self.options.is_high_priority_stream,
                          cga_cluster_size=c.cga_cluster_size, min_ctas=c.min_ctas, max_ctas=c.max_ctas,
                          net_name=c.net_name, split_share=c.split_share)

    def _check_open(self) -> None:
        if self._closed is not None:
            why = f" after: {self._close_reason}" if self._close_reason else ""
            raise DistBackendError(f"process group {self.uid} ({self.group_desc!r}) on rank {self._rank} was "
                                   f"{self._closed}{why}; it cannot be used any more")

    def _ready(self, join: bool = True) -> tuple[Communicator, Stream]:
        """The communicator and the group's stream; with ``join``, work
        enqueued next waits for the point-to-point operations the backend
        ran apart from the stream (``Communicator.p2p_stream``)."""
        live = self._live
        if live is None or self._closed is not None:  # first use, or closed (raises): under the lock
            with self._lock:
                self._check_open()
                if self._comm is None:
                    self._set_comm(self._create_comm())
                assert self._comm is not None and self._stream is not None
                live = self._comm, self._stream
        if join:
            live[0].join_p2p(live[1])
        return live

    def _create_comm(self) -> Communicator:
        parent = self._split_from
        if parent is not None and parent._comm is not None and parent._closed is None:
            child = parent._split_comm(parent._comm, 0, self._rank, self._comm_config())
            assert child is not None
            return child
        store = PrefixStore(f"{self.group_name}/comm", self._store)
        cfg = self._comm_config()
        # Always started nonblocking (then waited for in blocking mode), so that abort() reaches an init stuck on
        # a missing peer; the init's own deadline fails it first, with the message naming the missing ranks.
        comm = self._creating = self._backend.create(store, self._size, self._rank, replace(cfg, blocking=False),
                                                     self._device)
        if self._abort_requested:  # abort() ran before _creating was set: it could not reach this comm
            comm.abort()
        if cfg.blocking:
            try:
                comm.wait_ready(cfg.timeout + 5.0)
            except BaseException:
                comm.destroy()
                raise
        return comm

    def _set_comm(self, comm: Communicator) -> None:
        self._comm = comm
        self._stream = stream = comm.new_stream(self.options.is_high_priority_stream)
        if self._device is not None and not self._nonblocking:
            comm.wait_ready(self._timeout)
        self._live = comm, stream

    def _eager_init(self) -> None:
        """Create the communicator now (``device_id`` given)."""
        self._ready()

    def _split_for(self, color: int | None, key: int, options: Options) -> Communicator | None:
        """Collective over this group: split its communicator for a subgroup
        (``color=None``: this rank is not a member)."""
        comm, _ = self._ready()
        cfg = CommConfig(**{**self._comm_config().__dict__, "timeout": options.timeout,
                            "high_priority_stream": options.is_high_priority_stream})
        return self._split_comm(comm, color, key, cfg)

    def _split_comm(self, comm: Communicator, color: int | None, key: int, cfg: CommConfig) -> Communicator | None:
        """Split after this group's issued operations have run: the host
        backend's split travels the same connections as they do, so one still
        queued (an un-waited broadcast, say) would meet the split's exchange."""
        if self._stream is not None and not self._stream.synchronize(cfg.timeout):
            raise DistBackendError(f"timeout: process group {self.uid} ({self.group_desc!r}) on rank {self._rank}: "
                                   f"operations issued before a split did not finish within {cfg.timeout:.1f} s")
        return comm.split(color, key, cfg)

    # --- shrink and revoke ----------------------------------------------------------------

    @property
    def supports_shrinking(self) -> bool:
        """Every group can shrink: through its communicator's own shrink when
        that is alive and able (ncclCommShrink from NCCL 2.27, the host
        backend), else through a fresh communicator of the survivors."""
        return True

    def _check_shrink(self, exclude: Sequence[int], flags: int) -> list[int]:
        """The sorted group ranks to exclude; raises on bad arguments."""
        if isinstance(flags, bool) or flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
            raise ValueError(f"invalid shrink_flags {flags!r}: use SHRINK_DEFAULT ({SHRINK_DEFAULT}) or "
                             f"SHRINK_ABORT ({SHRINK_ABORT}, to stop operations still in flight first)")
        return check_exclude(exclude, self._size, self._rank)

    def _shrink(self, excluded: list[int], abort_first: bool, options: Options | None, *, group_name: str,
                group_desc: str, uid: int) -> ProcessGroup:
        """Collective over the ranks not in ``excluded`` (from
        ``_check_shrink``; only the survivors call it): a new group of the
        survivors, in their order. This group is left to the caller to destroy."""
        with self._lock:
            if self._closed == "destroyed":
                raise DistBackendError(f"process group {self.uid} ({self.group_desc!r}) on rank {self._rank} was "
                                       "destroyed; it cannot be shrunk")
            comm = self._comm
            native = comm is not None and comm.supports_shrink and comm.state not in (
                CommState.ABORTED, CommState.DESTROYED, CommState.INITIALIZING)
            if abort_first:  # the failures that follow are this rank's doing: no error handling on them
                self._error_handled = True
                if self._closed is None:
                    self._closed, self._close_reason = "revoked", "shrink_group(SHRINK_ABORT)"
        survivors = [r for r in range(self._size) if r not in excluded]
        child = ProcessGroup(self._store, survivors.index(self._rank), len(survivors), options or self.options,
                             backend=self._backend, device_id=self._device, group_name=group_name,
                             group_desc=group_desc, uid=uid)
        if native:
            assert comm is not None
            if not abort_first and self._stream is not None and not self._stream.synchronize(child._timeout):
                raise DistBackendError(f"timeout: process group {self.uid} ({self.group_desc!r}) on rank "
                                       f"{self._rank}: operations issued before a shrink did not finish within "
                                       f"{child._timeout:.1f} s (SHRINK_ABORT stops them instead)")
            child._set_comm(comm.shrink(excluded, child._comm_config(), abort_first))
        else:
            if abort_first:
                self.abort()
            if self._comm is not None and self._device is not None:
                child._eager_init()  # an eager parent gets an eager child; a lazy one, a lazy child
        return child

    def revoke(self) -> None:
        """Stop this group's in-flight operations (they fail, saying
        "revoked") and refuse later ones, but keep the communicator for
        ``shrink_group``; local and bounded. Where the communicator cannot
        revoke (NCCL < 2.29) it is aborted, and a shrink builds a fresh one."""
        with self._lock:
            self._error_handled = True  # a revoke's failures are not errors to handle
            if self._closed is None:
                self._closed, self._close_reason = "revoked", "revoke_process_group()"
            comm = self._comm
        if comm is None:
            return
        if comm.supports_revoke and comm.state is not CommState.INITIALIZING:
            comm.revoke()
        else:
            comm.abort()

    def comm_split_count(self) -> int:
        """How many times this group's communicator was split."""
        return 0 if self._comm is None else self._comm.split_count

    def comm_error(self) -> BaseException | None:
        comm = self._comm
        return None if comm is None else comm.async_error()

    # --- works and hooks ----------------------------------------------------------------

    def _register_on_completion_hook(self, hook: Callable[[WorkInfo], None]) -> None:
        """``hook(WorkInfo)`` runs on the watchdog thread after each Work of
        this group finishes; turns timing on."""
        self._hooks.append(hook)
        self._timing = True

    def _enable_collectives_timing(self) -> None:
        """Record start events for the operations issued from now on: the
        flight recorder then shows "started" states and durations."""
        self._timing = True

    # --- callbacks of its Works (work.WorkGroup) ------------------------------------------

    def work_started(self, seq: int) -> None:
        self._started_seq = max(self._started_seq, seq)

    def work_failing(self, error: BaseException) -> None:
        if self._error_handling in (1, 3):
            # Modes that end the process do so before any waiter sees the failure (and runs on regardless).
            self._handle_error(error)

    def make_caller_wait(self, end: Event) -> None:
        self._backend.make_caller_wait(end, self._device)

    def work_finished(self, work: Work, error: BaseException | None) -> None:
        # A NaN found by the async check fails the Work but is no communication failure: the operation ran,
        # and the group stays usable (no error handling, no abort).
        ran = error is None or isinstance(error, NanError)
        with self._lock:
            if self._pending:
                self._pending.discard(work)
            if self._timing_out:
                self._timing_out.discard(work)
            seq = work.seq
            if ran and not work._p2p and seq > self._completed_seq:
                self._completed_seq = seq
        if self._hooks:
            hooks = list(self._hooks)

            def run_hooks() -> None:
                for h in hooks:
                    h(work._info())

            watchdog.get().call_soon(self, run_hooks)
        if error is not None and not ran:
            self._handle_error(error)

    # --- failures -----------------------------------------------------------------------

    def work_timed_out(self, work: Work) -> None:
        """``work`` passed its deadline: the diagnosis thread finds out who is
        missing (asking every rank, within a small budget), then fails it."""
        with self._lock:
            if work in self._timing_out or work._finished:
                return
            self._timing_out.add(work)
        text = work._timed_out_text()

        def finish(why: str, path: str | None) -> None:
            work._finish(DistBackendError(f"{text}; {why}" + (f"; debug dump: {path}" if path else "")))

        watchdog.get().diagnosis.submit(diagnosis.Timeout(
            self.diag, work.seq, tuple(work._peers) if work._p2p else None, work._timeout,
            work._issued_mono + work._timeout, f"{work.op_type.name} seq {work.seq} on group {self.uid}", text,
            finish))

    def _diag_view(self) -> GroupView:
        """What diagnostics read of this group; it holds no reference to the
        group, so that a dropped group can go."""
        me = weakref.ref(self)

        def global_rank(r: int) -> int:
            pg = me()
            return r if pg is None else pg._global_rank_of(r)

        def counts() -> tuple[int, int, int]:
            pg = me()
            return (0, 0, 0) if pg is None else (pg._seq, pg._completed_seq, pg._seq_p2p)

        def state() -> str | None:
            pg = me()
            return "destroyed" if pg is None else pg._closed

        def activity() -> Activity:
            pg = me()
            if pg is None:
                return Activity()
            pending = tuple(InFlight(w.op_type.name, w.seq, w.issued_at) for w in list(pg._pending))
            return Activity(pg._seq, pg._started_seq, pg._completed_seq, pg._seq_p2p, pending)

        return GroupView.of(self._store, self.group_name, self.uid, self.group_desc, self._rank, self._size,
                            global_rank, counts, state, self._backend.name, activity)

    @property
    def comm_backend(self) -> Backend:
        """The backend its communicators come from (the watchdog prepares its
        poller thread for each)."""
        return self._backend

    def check_comm(self) -> None:
        """Watchdog: act on a communicator broken while nothing was pending."""
        comm = self._comm
        if comm is None or self._closed is not None or self._error_handled:
            return
        error = comm.async_error()
        if error is not None:
            self._handle_error(DistBackendError(f"process group {self.uid} ({self.group_desc!r}) on rank "
                                               f"{self._rank}: communicator error: {error}"))

    def _handle_error(self, error: BaseException) -> None:
        """Apply NCCL_PG_ASYNC_ERROR_HANDLING to a failure (not to the
        consequences of this process's own abort or destroy)."""
        with self._lock:
            ending = self._error_handled and self._closed is None and self._error_handling in (1, 3)
            if not ending:
                if self._error_handled or self._closed is not None:
                    return
                self._error_handled = True
                comm = self._comm
                mode = self._error_handling
                if mode == 2:  # the group is aborted for good: later operations fail at once, saying why
                    self._closed, self._close_reason = "aborted", str(error)
        if ending:
            # Another thread is ending the process (modes 1 and 3): a failure seen meanwhile (through the
            # communicator it aborted, say) must not reach a waiter, who would run on regardless.
            time.sleep(_ENDING_GRACE)
            return
        log.error("nccl_pg: %s", error)
        if env.DUMP_ON_TIMEOUT.get() and "debug dump:" not in str(error):  # a timeout has written its dump
            self._dump_for_error(error)
        if mode in (1, 2) and comm is not None:
            comm.abort()
        if mode in (1, 3):
            print(f"nccl_pg: rank {self._global_rank_of(self._rank)}: {error}; ending the process "
                  f"(NCCL_PG_ASYNC_ERROR_HANDLING={mode})", file=sys.stderr, flush=True)
            os.abort()

    def abort_for_blocking_wait(self, work: Work, error: BaseException) -> None:
        """Blocking wait: a ``wait()`` about to raise ``error`` aborts the
        group first (torch's blocking wait aborts its communicators too), so
        later operations fail at once with the reason instead of queueing
        behind the failed one. An abort of this process's own making: the
        error-handling mode does not act on it."""
        with self._lock:
            if self._closed is None:
                self._closed, self._close_reason = "aborted", str(error)
        work._finish(error if isinstance(error, DistBackendError) else DistBackendError(str(error)))
        self.abort()

    def _dump_for_error(self, error: BaseException) -> None:
        """A failure dumps as a timeout does (this rank's dump, and a signal
        asking every other rank for theirs), but not again within 30 s of
        another dump of this process: that failure is most likely a
        consequence of the first, whose dumps show where everyone was."""
        from . import dump

        if not dump.written_within(30.0):
            dog = watchdog.get()
            dog.write_dump(str(error), self._global_rank_of(self._rank))
            dog.diagnosis.request_dumps(self.diag, f"failure on group {self.uid}: {error}")

    def _wait_for_pending_works(self, timeout: float | None = None) -> bool:
        return watchdog.get().drain(self, lambda: list(self._pending), self._timeout if timeout is None else timeout)

    def _issue(self, op_type: OpType, outputs: list[Any], enqueue: Enqueue,
               after: Callable[[Stream], None] | None = None, inputs: list[Any] | None = None,
               name: str | None = None, peer: int | None = None, check: Checked | None = None,
               fingerprint: Fingerprint | bool | None = None, buf: Any = None) -> Work | None:
        """Enqueue one operation; ``after`` enqueues copy-outs behind it.
        ``inputs`` (default: ``outputs``, in place) and ``name`` are for the
        flight recorder; ``peer`` (group rank, or ``_ANY_SOURCE``) makes it a
        send or recv of ``buf``, on the stream the backend gives it.
        ``check``: the arrays the NaN check scans; callers pass
        ``self._nan and [...]``, so that no list is built when it is off.
        ``fingerprint``: what every rank's collective must agree on, checked
        in debug mode (callers pass ``self._detail and Fingerprint(...)``)."""
        p2p = peer is not None
        lane = p2p and self._coalescing is None
        live = self._live  # _ready() inline: every operation comes here
        if live is None or self._closed is not None:
            live = self._ready(join=False)  # creates the communicator, or raises: the group is closed
        comm, stream = live
        if lane:
            stream = comm.p2p_stream(stream, None if peer == _ANY_SOURCE else peer, op_type is OpType.SEND, buf)
        else:
            comm.join_p2p(stream)
            if isinstance(fingerprint, Fingerprint) and self._coalescing is None and not stream.capturing:
                self._check_fingerprint(comm, stream, fingerprint)
        self._backend.wait_for_caller(stream, self._device)
        if stream.capturing:  # into a CUDA graph: it runs at each replay, unnumbered, unrecorded, unwatched,
            # and unchecked for NaNs (a check's result could only be read at a replay)
            enqueue(comm, stream)
            if self._coalescing is not None:
                self._coalesced_outputs.extend(outputs)
                if after is not None:
                    self._coalescing.append(lambda: after(stream))
                return None
            if after is not None:
                after(stream)
            return Work.captured(self, op_type, outputs, stream.record(), self._peers_of(peer))
        # Before anything is numbered or enqueued: in raise mode a NaN leaves no trace of the operation.
        nan = self._nan.check(op_type, check, stream, self._timeout) if check and self._nan is not None and not self._prechecked \
            else None
        self._op_id += 1
        if self._coalescing is not None:
            if nan is not None:
                self._coalesced_nan.append(nan)
            enqueue(comm, stream)
            self._coalesced_outputs.extend(outputs)
            self._coalesced_entries.append(self._record(op_type, inputs, outputs, p2p, name))
            self._coalesced_peers.append(peer)
            if after is not None:
                self._coalescing.append(lambda: after(stream))
            return None
        if p2p:
            self._seq_p2p += 1
        else:
            self._seq += 1
        entry = self._record(op_type, inputs, outputs, p2p, name)
        start = stream.record(comm.new_event(timing=True)) if self._timing else None
        enqueue(comm, stream)
        if after is not None:
            after(stream)
        return self._watch(op_type, self._seq_p2p if p2p else self._seq, outputs, start, stream,
                           () if entry is None else (entry,), None if peer is None else self._peers_of(peer),
                           None if nan is None else [nan])

    def _peers_of(self, peer: int | None) -> tuple[int, ...] | None:
        if peer is None:
            return None
        return tuple(r for r in range(self._size) if r != self._rank) if peer == _ANY_SOURCE else (peer,)

    def _check_fingerprint(self, comm: Communicator, stream: Stream, fp: Fingerprint) -> None:
        """Debug mode: every rank all-gathers its collective's fingerprint
        before issuing it; on a mismatch every rank raises (nothing is
        issued), naming ranks and fields. Unnumbered and unrecorded, so that
        sequence numbers match those of a run without the check."""
        mine = fp.encode()
        rows = self._backend.empty(mine.size * self._size, mine.dtype, self._device)
        comm.all_gather(self._backend.from_host(mine, self._device), rows, stream)
        if not stream.record().synchronize(self._timeout):
            self.abort()  # the stream holds an exchange that will never complete
            raise DistBackendError(f"timeout: {self!r}: Timed out after {self._timeout:g} s in the collective "
                                   f"fingerprint check (NCCL_PG_DEBUG=detail) before {fp.op.name}: not every rank "
                                   "issued a collective; the group is aborted")
        error = comm.async_error()
        if error is not None:
            raise error
        everyone = self._backend.to_host(rows).reshape(self._size, mine.size)
        ranks = [self._global_rank_of(r) for r in range(self._size)]
        wrong = mismatch(everyone, ranks)
        if wrong is not None:
            raise DistBackendError(f"{self!r}: ranks issued different collectives (collective fingerprint check, "
                                   f"NCCL_PG_DEBUG=detail): {wrong}")

    def _record(self, op_type: OpType, inputs: list[Any] | None, outputs: list[Any], p2p: bool,
                name: str | None) -> Entry | None:
        return self._recorder.record(self.diag, self._timeout, name or _PROFILING_NAME[op_type], self._seq,
                                     self._seq_p2p, self._op_id, outputs if inputs is None else inputs, outputs, p2p)

    def _watch(self, op_type: OpType, seq: int, outputs: list[Any], start: Any, stream: Stream,
               entries: Sequence[Entry], peers: tuple[int, ...] | None = None,
               nan: list[Pending] | None = None) -> Work:
        """``peers``: None for a collective, else the p2p operation's peers;
        ``nan``: async NaN checks the Work reports. A Work complete already
        (a CPU backend whose stream had nothing queued before it) finishes
        here; only the others are handed to the watchdog."""
        # With timing, the end event times too (CUDA measures only between two timing events).
        end = stream.record() if start is None or self._comm is None else stream.record(self._comm.new_event(timing=True))
        work = Work(self, op_type, seq, outputs, end, start, self._timeout, entries, peers, nan)
        if not (self._may_complete_at_issue and end.query() and work._poll()):
            with self._lock:
                self._pending.add(work)
            watchdog.get().watch(work)
        if self._detail:
            log.info("pg %d rank %d: issued %s seq %d", self.uid, self._rank, op_type.name, seq)
        return work

    # --- coalescing ------------------------------------------------------------------------

    def _start_coalescing(self) -> None:
        comm, stream = self._ready()
        if self._coalescing is not None:
            raise RuntimeError("coalescing already started on this group")
        self._coalescing, self._coalesced_outputs, self._coalesced_entries = [], [], []
        self._coalesced_peers = []  # the group is numbered at its end, once its kind is known
        self._coalesced_nan, self._prechecked = [], False
        self._coalesce_start = stream.record(comm.new_event(timing=True)) if self._timing and not \
            stream.capturing else None
        comm.group_start()

    def _end_coalescing(self, op_type: OpType = OpType.COALESCED) -> Work:
        if self._coalescing is None:
            raise RuntimeError("_end_coalescing() without _start_coalescing()")
        comm, stream = self._ready()
        copies, self._coalescing, self._prechecked = self._coalescing, None, False
        try:
            comm.group_end()
        finally:
            for copy in copies:
                copy()
        if stream.capturing:
            return Work.captured(self, op_type, self._coalesced_outputs, stream.record(), None)
        # Only sends/recvs: one p2p operation (torch's seqP2P_). Numbered as a collective, it would put the
        # collective count of the ranks taking part ahead of the others', and timeouts would blame the wrong ranks.
        kinds = self._coalesced_peers
        p2p = bool(kinds) and all(k is not None for k in kinds)
        if p2p:
            self._seq_p2p += 1
        else:
            self._seq += 1
        parts = [e for e in self._coalesced_entries if e is not None]
        for e in parts:
            e.collective_seq_id, e.p2p_seq_id = self._seq, self._seq_p2p
        whole = self._recorder.record_coalesced(self.diag, self._timeout, parts, self._seq, self._seq_p2p,
                                                self._op_id, p2p)
        nan, self._coalesced_nan = self._coalesced_nan, []
        return self._watch(op_type, self._seq_p2p if p2p else self._seq, self._coalesced_outputs,
                           self._coalesce_start, stream, parts if whole is None else [*parts, whole],
                           tuple(sorted({k for k in kinds if k is not None})) if p2p else None, nan or None)

    # --- argument helpers -------------------------------------------------------------------

    def _flat(self, array: Any, what: str, output: bool = False) -> Any:
        """``array`` as the backend's flat array, or the argument error, raised
        here on the caller's rank before anything is numbered or enqueued.
        ``output``: this rank's operation writes it."""
        flat = self._backend.flat(array, what)
        check_dtype(self._backend.dtype(flat), what)
        if output and not self._backend.writable(flat):
            raise ValueError(f"{what}: the output array is read-only")
        return flat

    def _reducible(self, flat: Any, op: ReduceOp, scale: float | None, what: str) -> None:
        self._backend.check_reduction(self._backend.dtype(flat), op, scale, what)

    def _same_dtype(self, flats: Sequence[Any], what: str) -> None:
        dtypes = {_real(self._backend.dtype(f)) for f in flats}
        if len(dtypes) > 1:
            a, b = sorted(str(d) for d in dtypes)[:2]
            raise ValueError(f"{what}: invalid usage of tensors with different dtypes: found {a} and {b}")

    def _moved(self, flat: Any) -> Any:
        """The real view of a complex array (data movement only)."""
        dt = self._backend.dtype(flat)
        return flat.view(_real(dt)) if np.issubdtype(dt, np.complexfloating) else flat

    def _group_rank(self, r: int, what: str) -> int:
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self._size:
            raise ValueError(f"{what} {r!r} out of range for a group of {self._size} ranks")
        return int(r)

    def _list(self, arrays: Sequence[Any], what: str, like: Any, output: bool = False) -> list[Any]:
        if len(arrays) != self._size:
            raise ValueError(f"{what}: expected {self._size} arrays (one per rank), got {len(arrays)}")
        flats = [self._flat(a, f"{what}[{i}]", output) for i, a in enumerate(arrays)]
        self._same_dtype([like, *flats], what)
        for i, f in enumerate(flats):
            if f.size * f.itemsize != like.size * like.itemsize:
                raise ValueError(f"{what}[{i}] has {f.size} elements; expected {like.size} like the input")
        return [self._moved(f) for f in flats]

    def _gathered(self, outs: list[Any], like: Any) -> tuple[Any, Callable[[Stream], None]]:
        """A flat buffer for size x ``like`` and the copy-out into ``outs``."""
        tmp = self._backend.empty(like.size * self._size, like.dtype, self._device)
        n = like.size

        def copy_out(stream: Stream) -> None:
            for i, o in enumerate(outs):
                self._backend.copy(o, tmp[i * n:(i + 1) * n], stream)

        return tmp, copy_out

    def _packed(self, ins: list[Any], like: Any, stream: Stream) -> Any:
        """``ins`` copied (on ``stream``) into one flat buffer, once the
        caller's work writing them (and allocating it) has run."""
        tmp = self._backend.empty(sum(i.size for i in ins), like.dtype, self._device)
        self._backend.wait_for_caller(stream, self._device)
        at = 0
        for i in ins:
            self._backend.copy(tmp[at:at + i.size], i, stream)
            at += i.size
        return tmp

    # --- collectives (group ranks; in place where torch is) ----------------------------------

    def allreduce(self, tensor: Any, op: Op = ReduceOp.SUM) -> Work | None:
        t = self._flat(_one(tensor), "all_reduce tensor", output=True)
        rop, scale = resolve(op)
        self._reducible(t, rop, scale, "all_reduce")
        return self._issue(OpType.ALLREDUCE, [tensor], lambda c, s: c.all_reduce(t, t, rop, s, scale),
                           check=[("tensor", _one(tensor))] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.ALLREDUCE, self._backend.dtype(t), t.size, rop))

    def allreduce_coalesced(self, tensors: Sequence[Any], op: Op = ReduceOp.SUM) -> Work:
        flats = [self._flat(t, f"all_reduce_coalesced tensors[{i}]", output=True) for i, t in enumerate(tensors)]
        self._same_dtype(flats, "all_reduce_coalesced")
        rop, scale = resolve(op)
        if flats:  # one dtype for all (checked above)
            self._reducible(flats[0], rop, scale, "all_reduce_coalesced")
        self._start_coalescing()
        try:
            self._check_up_front(OpType.ALLREDUCE_COALESCED, [(f"tensors[{i}]", t) for i, t in enumerate(tensors)])
            for i, (f, t) in enumerate(zip(flats, tensors, strict=True)):
                self._issue(OpType.ALLREDUCE, [], functools.partial(_all_reduce_in_place, f, rop, scale),
                            check=[(f"tensors[{i}]", t)] if self._nan is not None else None)
            self._coalesced_outputs = list(tensors)
        except BaseException:
            self._abandon_coalescing()
            raise
        return self._end_coalescing(OpType.ALLREDUCE_COALESCED)

    def _abandon_coalescing(self) -> None:
        """Close a coalescing group that failed while being built (argument
        errors are raised before anything is enqueued)."""
        if self._coalescing is not None and self._comm is not None:
            self._coalescing, self._prechecked = None, False
            for pending in self._coalesced_nan:
                pending.abandon()
            self._coalesced_nan = []
            self._comm.group_end()

    def _check_up_front(self, op_type: OpType, items: Checked) -> None:
        """Raise mode, in a coalescing group before its operations are
        issued: check all their inputs now, since a NaN found in a later one
        could not take back the earlier ones; the operations then skip their
        own checks."""
        if self._nan is not None and self._nan.mode == "raise" and self._coalescing is not None:
            stream = self._ready()[1]
            if not stream.capturing:  # captured operations are not checked (see _issue)
                self._nan.check(op_type, items, stream, self._timeout)
            self._prechecked = True

    def broadcast(self, tensor: Any, root: int = 0) -> Work | None:
        root = self._group_rank(root, "broadcast root")
        t = self._moved(self._flat(_one(tensor), "broadcast tensor", output=self._rank != root))
        # Only the root's array is sent; the others' are overwritten (torch checks the root's too).
        return self._issue(OpType.BROADCAST, [tensor], lambda c, s: c.broadcast(t, t, root, s),
                           check=[("tensor", _one(tensor))] if self._nan is not None and self._rank == root else None,
                           fingerprint=self._detail and Fingerprint(OpType.BROADCAST, self._backend.dtype(t), t.size, root=root))

    def reduce(self, tensor: Any, root: int = 0, op: Op = ReduceOp.SUM) -> Work | None:
        root = self._group_rank(root, "reduce root")
        t = self._flat(_one(tensor), "reduce tensor", output=self._rank == root)
        rop, scale = resolve(op)
        self._reducible(t, rop, scale, "reduce")
        return self._issue(OpType.REDUCE, [tensor], lambda c, s: c.reduce(t, t, rop, root, s, scale),
                           check=[("tensor", _one(tensor))] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.REDUCE, self._backend.dtype(t), t.size, rop, root))

    def allgather(self, output_list: Sequence[Any], tensor: Any) -> Work | None:
        inp = self._flat(_one(tensor), "all_gather input")
        outs = self._list(_one_list(output_list), "all_gather output list", inp, output=True)
        inp = self._moved(inp)
        tmp, copy_out = self._gathered(outs, inp)
        return self._issue(OpType.ALLGATHER, list(output_list), lambda c, s: c.all_gather(inp, tmp, s),
                           after=copy_out, inputs=[_one(tensor)], check=[("tensor", _one(tensor))] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.ALLGATHER, self._backend.dtype(inp), inp.size))

    def _allgather_base(self, output: Any, tensor: Any) -> Work | None:
        inp, out = self._flat(tensor, "all_gather_into_tensor input"), self._flat(output, "all_gather_into_tensor output", output=True)
        self._same_dtype([inp, out], "all_gather_into_tensor")
        if out.size != inp.size * self._size:
            raise ValueError(f"all_gather_into_tensor: output has {out.size} elements; expected "
                             f"{self._size} x {inp.size}")
        inp, out = self._moved(inp), self._moved(out)
        return self._issue(OpType._ALLGATHER_BASE, [output], lambda c, s: c.all_gather(inp, out, s),
                           inputs=[tensor], check=[("input_tensor", tensor)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType._ALLGATHER_BASE, self._backend.dtype(inp), inp.size))

    def reduce_scatter(self, output: Any, input_list: Sequence[Any], op: Op = ReduceOp.SUM) -> Work | None:
        out = self._flat(_one(output), "reduce_scatter output", output=True)
        ins = self._list(_one_list(input_list), "reduce_scatter input list", out)
        rop, scale = resolve(op)
        self._reducible(out, rop, scale, "reduce_scatter")
        _, stream = self._ready()
        tmp = self._packed(ins, out, stream)
        ins_given = list(_one_list(input_list))
        return self._issue(OpType.REDUCE_SCATTER, [output],
                           lambda c, s: c.reduce_scatter(tmp, out, rop, s, scale), inputs=ins_given,
                           check=[(f"input_list[{i}]", a) for i, a in enumerate(ins_given)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.REDUCE_SCATTER, self._backend.dtype(out), out.size, rop))

    def _reduce_scatter_base(self, output: Any, tensor: Any, op: Op = ReduceOp.SUM) -> Work | None:
        out = self._flat(output, "reduce_scatter_tensor output", output=True)
        inp = self._flat(tensor, "reduce_scatter_tensor input")
        self._same_dtype([inp, out], "reduce_scatter_tensor")
        if inp.size != out.size * self._size:
            raise ValueError(f"reduce_scatter_tensor: input has {inp.size} elements; expected "
                             f"{self._size} x {out.size}")
        rop, scale = resolve(op)
        self._reducible(out, rop, scale, "reduce_scatter_tensor")
        return self._issue(OpType._REDUCE_SCATTER_BASE, [output],
                           lambda c, s: c.reduce_scatter(inp, out, rop, s, scale), inputs=[tensor],
                           check=[("input", tensor)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType._REDUCE_SCATTER_BASE, self._backend.dtype(out), out.size,
                                                                    rop))

    def alltoall_base(self, output: Any, tensor: Any, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None) -> Work | None:
        out = self._flat(output, "all_to_all_single output", output=True)
        inp = self._flat(tensor, "all_to_all_single input")
        self._same_dtype([inp, out], "all_to_all_single")
        sc = self._counts(tensor, inp, input_split_sizes, "input_split_sizes")
        rc = self._counts(output, out, output_split_sizes, "output_split_sizes")
        k = 2 if np.issubdtype(self._backend.dtype(inp), np.complexfloating) else 1  # complex: 2 reals each
        out, inp = self._moved(out), self._moved(inp)
        sc, rc = [c * k for c in sc], [c * k for c in rc]
        # Split sizes may differ by rank: only the operation and dtype must agree.
        return self._issue(OpType.ALLTOALL_BASE, [output], lambda c, s: c.all_to_all(inp, out, s, sc, rc),
                           inputs=[tensor], check=[("input", tensor)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.ALLTOALL_BASE, self._backend.dtype(inp)))

    def _counts(self, array: Any, flat: Any, splits: Sequence[int] | None, what: str) -> list[int]:
        """Element counts per peer from split sizes along the first dimension."""
        rows = array.shape[0] if getattr(array, "shape", ()) else flat.size
        per_row = flat.size // rows if rows else 0
        if splits is None or len(splits) == 0:
            if rows % self._size:
                raise ValueError(f"all_to_all_single: {rows} rows do not split evenly over {self._size} ranks")
            return [rows // self._size * per_row] * self._size
        sizes = [int(x) for x in (splits.tolist() if hasattr(splits, "tolist") else splits)]
        if len(sizes) != self._size or min(sizes) < 0 or sum(sizes) != rows:
            raise ValueError(f"all_to_all_single: {what} {sizes} must be {self._size} non-negative numbers "
                             f"summing to the {rows} rows of the array")
        return [x * per_row for x in sizes]

    def alltoall(self, output_list: Sequence[Any], input_list: Sequence[Any]) -> Work | None:
        if len(output_list) != self._size or len(input_list) != self._size:
            raise ValueError(f"all_to_all: expected {self._size} input and output arrays, got "
                             f"{len(input_list)} and {len(output_list)}")
        outs = [self._flat(a, f"all_to_all output[{i}]", output=True) for i, a in enumerate(output_list)]
        ins = [self._flat(a, f"all_to_all input[{i}]") for i, a in enumerate(input_list)]
        self._same_dtype(outs + ins, "all_to_all")
        outs, ins = [self._moved(o) for o in outs], [self._moved(i) for i in ins]
        _, stream = self._ready()
        tmp_in = self._packed(ins, ins[0], stream)
        tmp_out = self._backend.empty(sum(o.size for o in outs), outs[0].dtype, self._device)
        sc, rc = [i.size for i in ins], [o.size for o in outs]

        def copy_out(s: Stream) -> None:
            at = 0
            for o in outs:
                self._backend.copy(o, tmp_out[at:at + o.size], s)
                at += o.size

        return self._issue(OpType.ALLTOALL, list(output_list),
                           lambda c, s: c.all_to_all(tmp_in, tmp_out, s, sc, rc), after=copy_out,
                           inputs=list(input_list),
                           check=[(f"input_list[{i}]", a) for i, a in enumerate(input_list)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.ALLTOALL, self._backend.dtype(tmp_in)))

    def gather(self, tensor: Any, gather_list: Sequence[Any] | None, root: int = 0) -> Work | None:
        inp = self._flat(tensor, "gather input")
        root = self._group_rank(root, "gather dst")
        if gather_list and self._rank != root:  # dtypes first on every rank (as torch), then roles
            self._same_dtype([inp, *(self._flat(a, "gather gather_list") for a in gather_list)], "gather")
        if self._rank == root:
            if gather_list is None:
                raise ValueError("gather: the destination rank must pass gather_list")
            outs = self._list(gather_list, "gather gather_list", inp, output=True)
            inp = self._moved(inp)
            tmp, copy_out = self._gathered(outs, inp)
            return self._issue(OpType.GATHER, list(gather_list), lambda c, s: c.gather(inp, tmp, root, s),
                               after=copy_out, inputs=[tensor], check=[("tensor", tensor)] if self._nan is not None else None,
                               fingerprint=self._detail and Fingerprint(OpType.GATHER, self._backend.dtype(inp), inp.size, root=root))
        if gather_list:
            raise ValueError("gather: gather_list must be given on the destination rank only")
        inp = self._moved(inp)
        return self._issue(OpType.GATHER, [], lambda c, s: c.gather(inp, None, root, s), inputs=[tensor],
                           check=[("tensor", tensor)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.GATHER, self._backend.dtype(inp), inp.size, root=root))

    def scatter(self, tensor: Any, scatter_list: Sequence[Any] | None, root: int = 0) -> Work | None:
        out = self._flat(tensor, "scatter output", output=True)
        root = self._group_rank(root, "scatter src")
        if scatter_list and self._rank != root:  # dtypes first on every rank (as torch), then roles
            self._same_dtype([out, *(self._flat(a, "scatter scatter_list") for a in scatter_list)], "scatter")
        if self._rank == root:
            if scatter_list is None:
                raise ValueError("scatter: the source rank must pass scatter_list")
            ins = self._list(scatter_list, "scatter scatter_list", out)
            out = self._moved(out)
            _, stream = self._ready()
            tmp = self._packed(ins, out, stream)
            return self._issue(OpType.SCATTER, [tensor], lambda c, s: c.scatter(tmp, out, root, s),
                               inputs=list(scatter_list),
                               check=[(f"scatter_list[{i}]", a) for i, a in enumerate(scatter_list)] if self._nan is not None else None,
                               fingerprint=self._detail and Fingerprint(OpType.SCATTER, self._backend.dtype(out), out.size, root=root))
        if scatter_list:
            raise ValueError("scatter: scatter_list must be given on the source rank only")
        out = self._moved(out)
        return self._issue(OpType.SCATTER, [tensor], lambda c, s: c.scatter(None, out, root, s),
                           fingerprint=self._detail and Fingerprint(OpType.SCATTER, self._backend.dtype(out), out.size, root=root))

    def send(self, tensor: Any, dst: int, tag: int = 0) -> Work | None:
        t = self._moved(self._flat(_one(tensor), "send tensor"))
        dst = self._peer(dst, "send dst")
        return self._issue(OpType.SEND, [tensor], lambda c, s: c.send(t, dst, s),
                           name=f"nccl:send {self._rank}->{dst}", peer=dst, check=[("tensor", _one(tensor))] if self._nan is not None else None,
                           buf=t)

    def recv(self, tensor: Any, src: int, tag: int = 0) -> Work | None:
        t = self._moved(self._flat(_one(tensor), "recv tensor", output=True))
        src = self._peer(src, "recv src")
        return self._issue(OpType.RECV, [tensor], lambda c, s: c.recv(t, src, s),
                           name=f"nccl:recv {self._rank}<-{src}", peer=src, buf=t)

    def recv_anysource(self, tensor: Any, tag: int = 0) -> Work:
        """Receive from whichever rank sends first (the host backend, as
        Gloo); ``work.source_rank()`` names it (a group rank) once complete.
        Among receives, it takes its turn in issue order."""
        t = self._moved(self._flat(_one(tensor), "recv tensor"))
        comm, _ = self._ready(join=False)
        if not comm.supports_recv_any:
            raise DistBackendError(f"recv from any source: the {self._backend.name} backend cannot receive from "
                                   "any source (NCCL has no wildcard receive); give src")
        if self._coalescing is not None:
            raise ValueError("recv from any source cannot be part of a coalesced group (batch_isend_irecv, "
                             "_coalescing_manager): give src")
        if self._size < 2:
            raise ValueError("recv from any source: this group has no other rank")
        source: list[Callable[[], int | None]] = []
        work = self._issue(OpType.RECV, [tensor], lambda c, s: source.append(c.recv_any(t, s)),
                           name=f"nccl:recvAnySource {self._rank}<-any", peer=_ANY_SOURCE, buf=t)
        assert work is not None and source
        work._source = source[0]
        return work

    def _peer(self, peer: int, what: str) -> int:
        peer = self._group_rank(peer, what)
        if peer == self._rank:
            raise ValueError(f"{what}: rank {peer} is this rank; send/recv need another rank")
        return peer

    def monitored_barrier(self, timeout: timedelta | float | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier over the group's store that names the ranks that did
        not arrive within ``timeout`` (default: the group's), as torch's;
        see nccl_pg/monitored_barrier.py. Ranks other than 0 wait for rank
        0's verdict up to the longer of ``timeout`` and the group timeout."""
        limit = self._timeout if timeout is None else barrier_timeout(timeout)
        with self._lock:
            self._check_open()
            self._monitored_barriers += 1
            generation = self._monitored_barriers
        monitored_barrier(PrefixStore(f"{self.group_name}/monitored_barrier", self._store), self._rank, self._size,
                          generation, limit, wait_all_ranks, max(limit, self._timeout))

    def barrier(self) -> Work | None:
        """An all_reduce of one byte: complete once every rank has issued it."""
        buf = self._backend.from_host(np.zeros(1, np.uint8), self._device)
        return self._issue(OpType.BARRIER, [], lambda c, s: c.all_reduce(buf, buf, ReduceOp.SUM, s),
                           fingerprint=self._detail and Fingerprint(OpType.BARRIER))

    # --- teardown ------------------------------------------------------------------------------

    def abort(self) -> None:
        """Fail every pending and later operation at once; never blocks."""
        self._abort_requested = True
        creating = self._creating  # read without the lock: the thread creating the comm holds it
        if creating is not None:
            creating.abort()
        with self._lock:
            if self._closed is None:
                self._closed = "aborted"
            comm = self._comm
        if comm is not None:
            comm.abort()

    def shutdown(self, timeout: float | None = None) -> None:
        """Flush pending operations (bounded by ``timeout``, default the group
        timeout) and their hooks, then free the communicator; on timeout,
        abort instead of waiting longer."""
        with self._lock:
            if self._closed == "destroyed":
                return
            comm = self._comm
        limit = self._timeout if timeout is None else timeout
        if comm is not None and self._closed is None and not self._wait_for_pending_works(limit):
            warnings.warn(f"{self!r}: pending operations did not finish within {limit:.1f} s at shutdown; "
                          "aborting them", RuntimeWarning, stacklevel=2)
            comm.abort()
            watchdog.get().drain(self, lambda: list(self._pending), 1.0)
        with self._lock:
            self._closed = "destroyed"
        if comm is not None:
            if comm.state is CommState.INITIALIZING:
                comm.abort()  # a nonblocking init still waiting for peers would hold destroy up
            comm.destroy()


    def __del__(self) -> None:
        # Dropped without destroy: free the communicator's threads and sockets
        # now rather than at exit (never blocks: abort first). Not in a forked
        # child: the sockets are the parent's too.
        owner = getattr(self, "_owner", None)
        comm = getattr(self, "_comm", None)
        if owner is not None and owner.here() and comm is not None and getattr(self, "_closed", None) != "destroyed":
            comm.abort()
            comm.destroy()


def _close_leftovers() -> None:
    """At exit: groups never destroyed are aborted (bounded), with a warning
    instead of a hang or a silent loss of pending work. Only this process's
    own groups: a forked child leaves its parent's alone."""
    dog = watchdog.existing()
    for pg in dog.groups() if dog is not None else []:
        if isinstance(pg, ProcessGroup) and pg._closed is None and pg._comm is not None and pg._owner.here():
            pending = len(pg._pending)
            print(f"nccl_pg: warning: {pg!r} was not destroyed before exit ({pending} operations pending); "
                  "aborting it. Call destroy_process_group() to flush pending work first.",
                  file=sys.stderr, flush=True)
            pg.abort()
            pg._comm.destroy()


atexit.register(_close_leftovers)


def _all_reduce_in_place(array: Any, op: ReduceOp, scale: float | None, comm: Communicator, stream: Stream) -> None:
    comm.all_reduce(array, array, op, stream, scale)


def _one(x: Any) -> Any:
    """torch's ProcessGroup methods take a list with one tensor per device;
    a process here drives one device."""
    if isinstance(x, (list, tuple)):
        if len(x) != 1:
            raise ValueError(f"expected one array (one device per process), got {len(x)}")
        return x[0]
    return x


def _one_list(x: Sequence[Any]) -> Sequence[Any]:
    """``[[t0, t1, ...]]`` (torch's per-device nesting) or ``[t0, t1, ...]``."""
    if len(x) == 1 and isinstance(x[0], (list, tuple)):
        return x[0]
    return x


class ProcessGroupHost(ProcessGroup):
    """The CPU backend's group (numpy arrays, TCP between ranks)."""

    def __init__(self, store: Store, rank: int, size: int, options: Options | None = None, **kwargs: Any) -> None:
        super().__init__(store, rank, size, options, backend="host", **kwargs)


class ProcessGroupNCCL(ProcessGroup):
    """The NCCL backend's group; raises ValueError where no GPU exists."""

    def __init__(self, store: Store, rank: int, size: int, options: Options | None = None, **kwargs: Any) -> None:
        super().__init__(store, rank, size, options, backend="nccl", **kwargs)

    Options: ClassVar[type[Options]] = Options  # torch's ProcessGroupNCCL.Options

"""The core of a process group: its state, identity and settings, its
communicator's lifecycle (lazy or eager creation, split, teardown), the
callbacks its Works and the watchdog make (work.WorkGroup,
watchdog.Watched), and what it does on a failure (error-handling modes,
timeout diagnosis, dumps). Issuing operations is issuing.py's; the
collectives are collectives.py's; shrink and revoke are process_group.py's.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

from .. import env
from ..comm.backends import get_backend
from ..comm.base import WAIT_READY_GRACE, Backend, CallTimeout, CommConfig, CommState, Communicator, Event, Stream
from ..diagnostics import diagnosis, flight_recorder, group_view
from ..diagnostics.flight_recorder import Entry
from ..diagnostics.group_view import Activity, GroupView, InFlight
from ..errors import DistBackendError, NanError
from ..store import PrefixStore, Store
from ..timeouts import Timeout, to_seconds
from . import forks, nan_check, watchdog
from .failure_dump import FailureDump
from .nan_check import NanCheck, Pending
from .options import Options
from .pairs import Pairs
from .replays import ReplayWatch
from .work import Work, WorkInfo

log = logging.getLogger("nccl_pg.group.process_group")

T = TypeVar("T")

# Error-handling modes 1 and 3: how long another failing thread waits for the process to end (it does at once).
_ENDING_GRACE = 10.0
# After abort() at shutdown the pending Works fail at once; this bounds the watchdog's running of their hooks.
_ABORTED_DRAIN = 1.0


class GroupState(enum.Enum):
    """Where a group is in its life: usable, or why not (back to OPEN only from SUSPENDED)."""

    OPEN = "open"
    SUSPENDED = "suspended"  # suspend(): its communicator's memory released until resume() (suspension.py)
    ABORTED = "aborted"  # abort(), an error-handling mode, or a failed blocking wait
    REVOKED = "revoked"  # revoke() or shrink(SHRINK_ABORT): in-flight operations stopped, shrink still possible
    DESTROYED = "destroyed"  # shutdown(): the communicator is freed


# The hot path's check as a global: an enum member read through its class costs a descriptor call.
OPEN = GroupState.OPEN


def _weakly(method: Callable[[], T], gone: T) -> Callable[[], T]:
    """``method`` of a group, called through a weak reference (a view must
    not keep its group alive); ``gone`` once the group was dropped."""
    ref = weakref.WeakMethod(method)

    def call() -> T:
        bound = ref()
        return gone if bound is None else bound()

    return call


class GroupCore:
    """A group of ``size`` ranks; this process is ``rank`` (see ProcessGroup)."""

    def __init__(self, store: Store, rank: int, size: int, options: Options | None = None, *,
                 backend: str | Backend = "host", device_id: Any = None, group_name: str = "0",
                 group_desc: str = "undefined", uid: int = 0, global_ranks: Sequence[int] | None = None,
                 split_from: GroupCore | None = None, comm: Communicator | None = None) -> None:
        """``global_ranks``: the global rank of each group rank (default: the
        same); ``split_from``: a parent whose communicator this group splits
        at its first use; ``comm``: its communicator, made already (a split)."""
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
        self._timeout = _capped(self.options.timeout)
        self._device = device_id
        self.group_name, self.group_desc, self.uid = group_name, group_desc, uid
        # Read by every Work's wait() (work.WorkGroup): plain attributes, no property calls on the hot path.
        self.blocking_wait = env.BLOCKING_WAIT.get()
        self.waits_block = self._backend.blocking_wait or self.blocking_wait
        self._error_handling = env.ASYNC_ERROR_HANDLING.get()
        self._detail = env.DEBUG.get() == "detail"  # log every operation issued (opt-in: hot path)
        self._global_ranks = None if global_ranks is None else list(global_ranks)  # group rank -> global rank
        self._lock = threading.RLock()
        self._comm: Communicator | None = None
        self._creating: Communicator | None = None  # an init in progress, for abort() to reach
        self._started: Communicator | None = None  # an init started at creation, not yet used (connect_now)
        self._abort_requested = False  # set by abort() without the lock, for an init in progress to see
        self._stream: Stream | None = None
        self._live: tuple[Communicator, Stream] | None = None  # both, once set up: _ready's path without the lock
        self._pairs = Pairs(rank)  # point-to-point before the communicator exists (pairs.py)
        self._paired = False  # a pair was asked for: only then does comm_error (every Work) ask the pairs
        self._split_from = split_from  # lazy: split this parent's communicator at first use
        self._seq = 0
        self._seq_p2p = 0
        self._monitored_barriers = 0
        self._completed_seq = 0
        self._started_seq = 0
        self._done_at_issue = 0  # the last collective its issuing thread finished itself (work_done_at_issue)
        self._failed: InFlight | None = None  # the last collective that failed: a waiter may still be in it
        self._failure_dump = FailureDump()
        self._op_id = 0
        self._recorder = flight_recorder.get()
        self._coalesced_entries: list[Entry | None] = []
        self._coalesce_launched: Event | None = None  # the open coalescing group's launch mark (issuing.py)
        self._coalesce_replayed: Event | None = None  # the start of a captured coalescing group (replays.py)
        self._launch_marks = False  # exact "started" marks from the backend (NCCL >= 2.32.3), set with the comm
        self._replays = ReplayWatch()
        self._coalesced_peers: list[int | None] = []  # per op in a coalescing group: its p2p peer, None: a collective
        self._coalesced_nan: list[Pending] = []
        self._prechecked = False  # raise mode: the open coalescing group's inputs were all checked up front
        self._error_handled = False
        self._hooks: list[Callable[[WorkInfo], None]] = []
        self._timing = env.ENABLE_TIMING.get()
        self._pending: set[Work] = set()
        self._coalescing: list[Callable[[], None]] | None = None  # copy-outs deferred to the group's end
        self._coalesced_outputs: list[Any] = []
        self._state = GroupState.OPEN
        self._close_reason: str | None = None  # the failure that aborted it (error handling, blocking wait)
        self._nonblocking = (self.options.config.blocking is False) or (
            self.options.config.blocking is None and env.USE_COMM_NONBLOCKING.get())
        self.diag = self._diag_view()
        group_view.register(self, self.diag)
        self._nan: NanCheck | None = None
        self.set_nan_check(self.options.nan_check)
        watchdog.get().watch_group(self)
        if comm is not None:
            self._set_comm(comm)

    @property
    def bound_device_id(self) -> Any:
        """The device its communicator is bound to (``device_id``; None: the
        host backend, or not given)."""
        return self._device

    @property
    def nonblocking(self) -> bool:
        """Its communicators start without blocking (``NCCLConfig.blocking``,
        ``NCCL_PG_USE_COMM_NONBLOCKING``): a subgroup splits at first use."""
        return self._nonblocking

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(uid={self.uid}, desc={self.group_desc!r}, rank={self._rank}, "
                f"size={self._size}, backend={self._backend.name})")

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

    def _set_default_timeout(self, timeout: Timeout) -> None:
        """Timeout of operations issued from now on (``options._timeout`` follows, as in torch)."""
        self.options.timeout = to_seconds(timeout)
        self._timeout = _capped(self.options.timeout)

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

    def _diag_view(self) -> GroupView:
        """What diagnostics read of this group; it holds no reference to the
        group, so that a dropped group can go."""
        global_rank_of = weakref.WeakMethod(self._global_rank_of)

        def global_rank(r: int) -> int:
            method = global_rank_of()
            return r if method is None else method(r)

        return GroupView.of(self._store, self.group_name, self.uid, self.group_desc, self._rank, self._size,
                            global_rank, _weakly(self._progress_counts, (0, 0, 0)),
                            _weakly(self._state_name, GroupState.DESTROYED.value), self._backend.name,
                            _weakly(self._activity, Activity()), _weakly(self._device_name, None))

    def _device_name(self) -> str | None:
        d = self._device
        if d is None or isinstance(d, str):
            return d
        return f"cuda:{d}" if isinstance(d, int) else str(d)

    def _progress_counts(self) -> tuple[int, int, int]:
        return self._seq, max(self._completed_seq, self._done_at_issue), self._seq_p2p

    def _state_name(self) -> str | None:
        return None if self._state is GroupState.OPEN else self._state.value

    def _activity(self) -> Activity:
        pending = tuple(InFlight(w.op_type.name, w.seq, w.issued_at) for w in list(self._pending))
        done, completed = self._done_at_issue, max(self._completed_seq, self._done_at_issue)
        failed = self._failed if self._failed is not None and self._failed.seq > completed else None
        return Activity(self._seq, max(self._started_seq, done), completed, self._seq_p2p, pending, failed)

    def _comm_config(self) -> CommConfig:
        c = self.options.config
        return CommConfig(blocking=not self._nonblocking, timeout=self._timeout,
                          comm_name=c.comm_name or f"pg{self.uid}:{self.group_desc}",
                          high_priority_stream=self.options.is_high_priority_stream,
                          cga_cluster_size=c.cga_cluster_size, min_ctas=c.min_ctas, max_ctas=c.max_ctas,
                          net_name=c.net_name, split_share=c.split_share)

    def _check_open(self) -> None:
        if self._state is GroupState.SUSPENDED:
            raise DistBackendError(f"process group {self.uid} ({self.group_desc!r}) on rank {self._rank} is suspended "
                                   "(suspend()): call resume() before using it")
        if self._state is not GroupState.OPEN:
            why = f" after: {self._close_reason}" if self._close_reason else ""
            raise DistBackendError(f"process group {self.uid} ({self.group_desc!r}) on rank {self._rank} was "
                                   f"{self._state.value}{why}; it cannot be used any more")

    def _ready(self, join: bool = True) -> tuple[Communicator, Stream]:
        """The communicator and the group's stream; with ``join``, work
        enqueued next waits for the point-to-point operations the backend
        ran apart from the stream (``Communicator.p2p_stream``)."""
        live = self._live
        if live is None or self._state is not OPEN:  # first use, or closed (raises): under the lock
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
        if self._split_from is not None:
            parent: GroupCore = self._split_from
            if parent._comm is not None and parent._state is GroupState.OPEN:
                child = parent._split_comm(parent._comm, 0, self._rank, self._comm_config())
                assert child is not None
                return child
        cfg = self._comm_config()
        # Always started nonblocking (then waited for in blocking mode), so that abort() reaches an init stuck on
        # a missing peer; the init's own deadline fails it first, with the message naming the missing ranks.
        comm, self._started = self._started or self._start_init(), None
        self._creating = comm
        if self._abort_requested:  # abort() ran before _creating was set: it could not reach this comm
            comm.abort()
        if cfg.blocking:
            try:
                comm.wait_ready(cfg.timeout + WAIT_READY_GRACE)
            except BaseException:
                comm.destroy()
                raise
        return comm

    def _refuse_with_live_graphs(self, what: str) -> None:
        """Refuse ``what`` (a revoke, or a reconfigure that replaces the communicator) while CUDA graphs that
        captured this group's collectives live (replays.py says why); an aborted, revoked or destroyed
        communicator is past that choice."""
        comm = self._comm
        if comm is not None and comm.state not in (CommState.ABORTED, CommState.REVOKED, CommState.DESTROYED):
            self._replays.refuse_if_alive(what, f"process group {self.uid} ({self.group_desc!r}) on rank {self._rank}")

    def _pair(self, peer: int) -> tuple[Communicator, Stream] | None:
        """The communicator for a standalone send or receive with ``peer``, when it is not the group's: one
        of the pair (pairs.py), before the group's exists, in a group of more than two, on a backend that
        does not connect groups at their creation."""
        if (self._comm is not None or self._size <= 2 or self._state is not OPEN
                or self._backend.connects_at_creation):
            return None
        self._paired = True
        return self._pairs.get(peer, self._create_pair)

    def _rank_in(self, comm: Communicator, peer: int) -> int:
        """``peer``'s rank in ``comm``: the group's communicator, or a pair's (its lower rank is 0)."""
        return peer if comm is self._comm else int(peer > self._rank)

    def _create_pair(self, peer: int) -> tuple[Communicator, Stream]:
        lo, hi = sorted((self._rank, peer))
        cfg = self._comm_config()
        cfg = replace(cfg, blocking=False, comm_name=f"{cfg.comm_name}:p2p{lo}-{hi}")
        comm = self._backend.create(PrefixStore(f"{self.group_name}/p2p/{lo}-{hi}", self._store), 2,
                                    int(self._rank == hi), cfg, self._device)
        self._pairs.creating.append(comm)  # within abort()'s reach while it comes up
        try:
            if self._abort_requested:
                comm.abort()
            comm.wait_ready(cfg.timeout + WAIT_READY_GRACE)  # (its operations would wait for it: NCCL's must)
        except BaseException as exc:
            comm.destroy()
            if "timeout" in str(exc).lower():
                raise DistBackendError(f"timeout: rank {peer} never joined the point-to-point communicator of ranks "
                                       f"{lo} and {hi} of process group {self.uid} ({self.group_desc!r}) within "
                                       f"{self._timeout:.3f} s ({exc})") from exc
            raise
        finally:
            self._pairs.creating.remove(comm)
        return comm, comm.new_stream(self.options.is_high_priority_stream)

    def _start_init(self) -> Communicator:
        cfg = self._comm_config()
        return self._backend.create(PrefixStore(f"{self.group_name}/comm", self._store), self._size, self._rank,
                                    replace(cfg, blocking=False), self._device)

    def connect_now(self) -> None:
        """Start the communicator's init now, without waiting for it (its first operation does), where the
        backend connects groups at their creation (``Backend.connects_at_creation``, as Gloo): every rank of
        the group then takes part at once, whatever it does next."""
        with self._lock:
            if (self._backend.connects_at_creation and self._comm is None and self._started is None
                    and self._split_from is None and self._state is GroupState.OPEN):
                self._started = self._creating = self._start_init()

    def _set_comm(self, comm: Communicator) -> None:
        # The same on every rank ("Every rank must provide a non-NULL event or every rank must provide NULL",
        # nccl.h): the same NCCL and the same NCCL_PG_LAUNCH_MARKS everywhere (the fingerprint check compares it)
        self._launch_marks = comm.supports_launch_marks and env.LAUNCH_MARKS.get()
        self._comm = comm
        self._stream = stream = comm.new_stream(self.options.is_high_priority_stream)
        self._pairs.join(stream)  # the group's work waits for what the pairs still run
        if self._device is not None and not self._nonblocking:
            comm.wait_ready(self._timeout)
        self._live = comm, stream

    def eager_init(self) -> None:
        """Create the communicator now (``device_id`` given)."""
        self._ready()

    def split_for(self, color: int | None, key: int, options: Options) -> Communicator | None:
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

    def comm_split_count(self) -> int:
        """How many times this group's communicator was split."""
        return 0 if self._comm is None else self._comm.split_count

    def comm_error(self) -> BaseException | None:
        comm = self._comm
        return (None if comm is None else comm.async_error()) or (self._pairs.async_error() if self._paired else None)

    @property
    def comm_backend(self) -> Backend:
        """The backend its communicators come from (the watchdog prepares its
        poller thread for each)."""
        return self._backend

    def _register_on_completion_hook(self, hook: Callable[[WorkInfo], None]) -> None:
        """``hook(WorkInfo)`` runs on the watchdog thread after each Work of
        this group finishes; turns timing on."""
        self._hooks.append(hook)
        self._timing = True

    def _enable_collectives_timing(self) -> None:
        """Record start events for the operations issued from now on: the
        flight recorder then shows "started" states and durations."""
        self._timing = True

    def work_started(self, seq: int) -> None:
        self._started_seq = max(self._started_seq, seq)

    def work_failing(self, error: BaseException) -> None:
        if self._error_handling in (1, 3):
            # Modes that end the process do so before any waiter sees the failure (and runs on regardless).
            self._handle_error(error)

    def make_caller_wait(self, end: Event) -> None:
        self._backend.make_caller_wait(end, self._device)

    def work_failed(self, error: BaseException) -> None:
        # The dump first: a waiter that wakes and ends the process must not cut it short (error handling follows,
        # in work_finished, after the waiters: its abort must not become the Work's error).
        with self._lock:
            if self._state is not GroupState.OPEN or self._error_handled:
                return  # the consequence of this process's own abort or destroy, or of a failure already seen
        self._failure_dump.first(error, self._global_rank_of(self._rank), self.diag, self.uid)

    def work_finished(self, work: Work, error: BaseException | None, p2p: bool) -> None:
        # A NaN found by the async check fails the Work but is no communication failure: the operation ran,
        # and the group stays usable (no error handling, no abort).
        ran = error is None or isinstance(error, NanError)
        with self._lock:
            if self._pending:
                self._pending.discard(work)
            seq = work.seq
            if ran and not p2p and seq > self._completed_seq:
                self._completed_seq = seq
            elif not ran and not p2p:
                self._failed = InFlight(work.op_type.name, seq, work.issued_at)
        if self._hooks:
            self._run_hooks(work)
        if error is not None and not ran:
            self._handle_error(error)

    def work_done_at_issue(self, work: Work, seq: int, p2p: bool) -> None:
        if p2p:
            self.work_finished(work, None, True)
            return
        # Without the lock: only the issuing thread writes this count, and the collectives it finishes itself come
        # in order; readers take the larger of it and the counts of the Works the watchdog or a waiter finished.
        self._done_at_issue = seq
        if self._hooks:
            self._run_hooks(work)

    def _run_hooks(self, work: Work) -> None:
        hooks = list(self._hooks)

        def run_hooks() -> None:
            for h in hooks:
                h(work.info())

        watchdog.get().call_soon(self, run_hooks)

    def diagnose_timeout(self, timeout: diagnosis.Timeout) -> None:
        watchdog.get().diagnosis.submit(timeout)

    def check_comm(self) -> None:
        """Watchdog: act on a communicator broken while nothing was pending
        (the group's or a pair's), and on a replayed collective past its
        timeout (replays.py)."""
        if self._state is not GroupState.OPEN:
            return
        if self._replays:  # polled after an error too: a destroyed graph's entries go
            for stuck in self._replays.poll():
                self._handle_error(DistBackendError(f"timeout: process group {self.uid} ({self.group_desc!r}), rank "
                                                    f"{self._rank} of {self._size}: {stuck.describe()}"))
        if self._error_handled:
            return
        error = self.comm_error()
        if error is not None and not isinstance(error, CallTimeout):  # the issuing caller explains a CallTimeout
            self._handle_error(DistBackendError(f"process group {self.uid} ({self.group_desc!r}) on rank "
                                               f"{self._rank}: communicator error: {error}"))

    def _handle_error(self, error: BaseException) -> None:
        """Apply NCCL_PG_ASYNC_ERROR_HANDLING to a failure (not to the
        consequences of this process's own abort or destroy)."""
        with self._lock:
            ending = self._error_handled and self._state is GroupState.OPEN and self._error_handling in (1, 3)
            if not ending:
                if self._error_handled or self._state is not GroupState.OPEN:
                    return
                self._error_handled = True
                comm = self._comm
                mode = self._error_handling
                if mode == 2:  # the group is aborted for good: later operations fail at once, saying why
                    self._state, self._close_reason = GroupState.ABORTED, str(error)
        if ending:
            # Another thread is ending the process (modes 1 and 3): a failure seen meanwhile (through the
            # communicator it aborted, say) must not reach a waiter, who would run on regardless.
            time.sleep(_ENDING_GRACE)
            return
        log.error("nccl_pg: %s", error)
        self._failure_dump.first(error, self._global_rank_of(self._rank), self.diag, self.uid)
        if mode in (1, 2):
            if comm is not None:
                comm.abort()
            self._pairs.abort()
        if mode in (1, 3):
            print(f"nccl_pg: rank {self._global_rank_of(self._rank)}: {error}; ending the process "
                  f"(NCCL_PG_ASYNC_ERROR_HANDLING={mode})", file=sys.stderr, flush=True)
            watchdog.get().ending()
            os.abort()

    def close_for_blocking_wait(self, error: BaseException) -> None:
        with self._lock:
            if self._state is GroupState.OPEN:
                self._state, self._close_reason = GroupState.ABORTED, str(error)

    def _wait_for_pending_works(self, timeout: float | None = None) -> bool:
        return watchdog.get().drain(self, lambda: list(self._pending), self._timeout if timeout is None else timeout)

    def abort(self) -> None:
        """Fail every pending and later operation at once; never blocks."""
        self._abort_requested = True
        creating = self._creating  # read without the lock: the thread creating the comm holds it
        if creating is not None:
            creating.abort()
        with self._lock:
            if self._state in (GroupState.OPEN, GroupState.SUSPENDED):
                self._state = GroupState.ABORTED
            comm = self._comm
        if comm is not None:
            comm.abort()
        self._pairs.abort()

    def shutdown(self, timeout: Timeout | None = None) -> None:
        """Flush pending operations (bounded by ``timeout``, default the group
        timeout; 0: do not wait) and their hooks, then free the communicator;
        on timeout, abort instead of waiting longer."""
        limit = self._timeout if timeout is None else to_seconds(timeout, "shutdown timeout", zero=True)
        with self._lock:
            comm = self._comm
            if self._state is GroupState.DESTROYED and (comm is None or comm.state is CommState.DESTROYED):
                return  # (a communicator that refused to go, its CUDA graphs alive, is destroyed again)
        if (comm is not None or self._pairs.comms()) and self._state is GroupState.OPEN and \
                not self._wait_for_pending_works(limit):
            warnings.warn(f"{self!r}: pending operations did not finish within {limit:.1f} s at shutdown; "
                          "aborting them", RuntimeWarning, stacklevel=2)
            if comm is not None:
                comm.abort()
            self._pairs.abort()
            watchdog.get().drain(self, lambda: list(self._pending), _ABORTED_DRAIN)
        with self._lock:
            self._state = GroupState.DESTROYED
            started, self._started = self._started, None
        watchdog.get().diagnosis.release(self.diag)  # the store's listener ends with its last group
        self._pairs.destroy()
        if started is not None:  # started at creation, never used
            started.abort()
            started.destroy()
        if comm is not None:
            if comm.state is CommState.INITIALIZING:
                comm.abort()  # a nonblocking init still waiting for peers would hold destroy up
            comm.destroy()

    def close_left_open(self) -> None:
        """At exit: abort it if it was never destroyed (bounded), with a
        warning if it was used, unless it is a forked child's copy of its
        parent's group."""
        comms = self._held()
        if self._state is GroupState.OPEN and comms and self._owner.here():
            # Not when the process ends on an exception: its traceback says why, the warning would be noise.
            if (self._comm is not None or self._pairs.comms()) and getattr(sys, "last_value", None) is None:
                print(f"nccl_pg: warning: {self!r} was not destroyed before exit ({len(self._pending)} operations "
                      "pending); aborting it. Call destroy_process_group() to flush pending work first.",
                      file=sys.stderr, flush=True)
            self.abort()
            for comm in comms:
                comm.destroy()

    def _held(self) -> list[Communicator]:
        """Every communicator this group holds: its own, one started at its creation, its pairs'."""
        return [c for c in (self._comm, self._started) if c is not None] + self._pairs.comms()

    def __del__(self) -> None:
        # Dropped without destroy: free the communicators' threads and sockets
        # now rather than at exit (never blocks: abort first). Not in a forked
        # child: the sockets are the parent's too.
        owner = getattr(self, "_owner", None)
        if owner is None or not owner.here() or getattr(self, "_state", None) is GroupState.DESTROYED:
            return
        try:
            comms = self._held()
        except AttributeError:  # (a constructor that failed half-way)
            return
        for comm in comms:
            comm.abort()
            comm.destroy()


def _capped(timeout: float) -> float:
    """A group's timeout, at most ``NCCL_PG_MAX_TIMEOUT`` (the test harness's operation timeout)."""
    cap = env.MAX_TIMEOUT.get()
    return timeout if cap is None else min(timeout, cap)

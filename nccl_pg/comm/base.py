"""The Communicator contract between the process-group core and its backends.

Everything above this file is backend-agnostic: it receives a Communicator
(NCCL over nccl4py, or the host backend over TCP) and drives it only through
the methods here. Operations are asynchronous: they are enqueued on a Stream
and return at once; completion is observed through Events, failures through
``async_error()``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import DistBackendError
from ..reduce_op import ReduceOp, resolve
from ..timeouts import to_seconds

# How long past a communicator's own init deadline a caller of wait_ready() waits: the communicator fails
# first, with a message naming the ranks that never joined, and that message must win the race.
WAIT_READY_GRACE = 5.0

if TYPE_CHECKING:
    from .nan_scan import NanScan


class CallTimeout(DistBackendError):
    """An operation's call into the communicator did not complete within the
    communicator's timeout (an NCCL call stuck waiting for peers that never
    issued the same operation). The caller that issued it explains it as a
    timed-out Work is explained: which ranks never issued the operation."""


class CommState(enum.Enum):
    INITIALIZING = "initializing"
    READY = "ready"
    ERROR = "error"
    ABORTED = "aborted"
    REVOKED = "revoked"  # in-flight operations stopped; only shrink() and destroy() remain
    DESTROYED = "destroyed"


@dataclass(frozen=True)
class CommConfig:
    """Communicator settings. ``blocking=False`` makes init and split return
    at once (poll ``state``/``wait_ready``); ``timeout`` is the deadline of
    init, split and finalize. The NCCL-only fields pass through to
    ncclConfig_t; the host backend ignores them."""

    blocking: bool = True
    timeout: float = 600.0
    comm_name: str | None = None
    high_priority_stream: bool = False
    cga_cluster_size: int | None = None
    min_ctas: int | None = None
    max_ctas: int | None = None
    net_name: str | None = None
    split_share: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout", to_seconds(self.timeout, "CommConfig.timeout"))  # frozen: the one way


class Event(ABC):
    """A marker in a stream: complete once everything enqueued before it is."""

    @abstractmethod
    def query(self) -> bool:
        """True when complete; never blocks."""

    @abstractmethod
    def synchronize(self, timeout: float | None = None) -> bool:
        """Block until complete or ``timeout`` seconds; False on timeout.
        Returns early (True) when the stream's communicator is aborted."""

    @abstractmethod
    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds between this event and a later one (both complete)."""


class Stream(ABC):
    """An in-order queue of operations."""

    @abstractmethod
    def record(self, event: Event | None = None) -> Event: ...

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Later work on this stream starts only after ``event`` completes."""

    @abstractmethod
    def query(self) -> bool: ...

    @abstractmethod
    def synchronize(self, timeout: float | None = None) -> bool: ...

    @property
    def capturing(self) -> bool:
        """True while this stream takes part in a CUDA graph capture: what is
        enqueued goes into the graph and runs only at its replays."""
        return False

    def capture_id(self) -> int:
        """While capturing: the capture's id, unique in the process (CUDA's
        cudaStreamGetCaptureInfo); 0 otherwise."""
        return 0

    def record_replayed(self, event: Event) -> None:
        """While capturing: put a record of ``event`` into the graph, so that
        every replay records it there again (queryable by the host)."""
        raise NotImplementedError(f"{type(self).__name__} has no CUDA graphs")

    def capture_gone(self) -> Callable[[], bool] | None:
        """While capturing: a probe that says (never blocking) whether the
        graph being captured, and every instantiation of it, were destroyed;
        None where that cannot be known."""
        return None


class Communicator(ABC):
    """One rank's endpoint of a group of ``nranks`` ranks."""

    rank: int
    nranks: int

    # --- lifecycle ------------------------------------------------------------

    @property
    @abstractmethod
    def state(self) -> CommState: ...

    @abstractmethod
    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until init finished (nonblocking mode); raises the init error
        or DistBackendError on timeout."""

    @abstractmethod
    def async_error(self) -> BaseException | None:
        """The error that broke this communicator (peer lost, aborted, ...)."""

    @abstractmethod
    def split(self, color: int | None, key: int, config: CommConfig | None = None) -> Communicator | None:
        """Collective over this communicator: ranks with the same color form
        a child ordered by (key, rank); ``color=None`` gets None."""

    @property
    @abstractmethod
    def split_count(self) -> int: ...

    @abstractmethod
    def abort(self) -> None:
        """Fail every pending and future operation; bounded, never hangs."""

    # --- fault tolerance: drop failed ranks without a fresh rendezvous ---------

    supports_shrink: bool = False
    supports_revoke: bool = False
    # True where shrink() is refused on a communicator that reports an error (NCCL: ncclCommShrink's
    # ncclCommEnsureReady), so that whether it can shrink differs between ranks: a reconfigure's ranks then
    # agree on shrinking or starting afresh (docs/ELASTIC.md).
    shrink_refuses_errors: bool = False

    def can_shrink(self) -> bool:
        """Whether ``shrink()`` can be issued on this rank now."""
        return self.supports_shrink and self.state not in (CommState.ABORTED, CommState.DESTROYED,
                                                           CommState.INITIALIZING)

    def shrink(self, exclude: Sequence[int], config: CommConfig | None = None,
               abort_first: bool = False) -> Communicator:
        """Collective over the ranks not in ``exclude`` (only they call it,
        with the same list): a new communicator of the survivors, ranked in
        their order here. ``abort_first`` stops this communicator's in-flight
        operations first (recovery after a failure); without it, nothing
        may be in flight."""
        raise NotImplementedError(f"{type(self).__name__} cannot shrink")

    def revoke(self) -> None:
        """Stop every in-flight operation (they fail) but keep the
        communicator for ``shrink()`` or ``destroy()``; local, bounded."""
        raise NotImplementedError(f"{type(self).__name__} cannot revoke")

    # --- fault tolerance: take new ranks without a fresh rendezvous (NCCL >= 2.29.2) ---------------
    # The order is NCCL's (ncclCommGetUniqueId, ncclCommGrow; docs/ELASTIC.md): one rank of this
    # communicator, the coordinator, calls get_unique_id(), sends the id to the new ranks out of band
    # (the group layer: through the store); every rank of this communicator calls grow() (the coordinator
    # may pass its id, the others pass None); each new rank calls Backend.join_grow() with the id and a
    # rank >= this communicator's size. The caller destroys this communicator afterwards.

    supports_grow: bool = False

    def get_unique_id(self) -> bytes:
        """Coordinator only: a single-use id for the next ``grow`` of this
        communicator (ncclCommGetUniqueId). Nothing may be in flight; a
        second id before the first was used by a grow raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot grow")

    def grow(self, nranks: int, unique_id: bytes | None = None, config: CommConfig | None = None) -> Communicator:
        """Collective over every rank of this communicator (and, through
        ``Backend.join_grow``, the new ones): a new communicator of
        ``nranks`` > ``self.nranks`` ranks in which this rank keeps its rank
        (ncclCommGrow with rank = -1). ``unique_id``: None, or the
        coordinator's own id. Needs a READY communicator with nothing in
        flight; with ``config.blocking=False`` the child is returned
        INITIALIZING and polled; ``config.timeout`` bounds it. Call it once
        the coordinator's ``get_unique_id`` has returned (the group layer's
        members wait for its record): NCCL's ranks 0 and N-1 receive the id
        inside ncclCommGrow, and would wait there for good without it."""
        raise NotImplementedError(f"{type(self).__name__} cannot grow")

    # --- suspend/resume: free a communicator's GPU memory between phases (NCCL >= 2.29.7) ---------------------

    def suspend_refusal(self) -> str | None:
        """Why ``suspend`` would be refused here (None: it would not)."""
        return "this backend holds no GPU memory to free"

    def suspend(self, timeout: float) -> None:
        """Collective over every rank: release the communicator's
        suspendable memory (ncclCommSuspend). Nothing may be in flight; no
        operation until ``resume``."""
        raise NotImplementedError(f"{type(self).__name__} cannot suspend")

    def resume(self, timeout: float) -> None:
        """Collective over every rank: the memory back (ncclCommResume)."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume")

    def mem_stats(self) -> dict[str, int]:
        """GPU memory the communicator holds (ncclCommMemStats):
        ``suspendable_bytes``, ``persistent_bytes``, ``total_bytes``,
        ``suspended`` (0/1)."""
        raise NotImplementedError(f"{type(self).__name__} has no memory statistics")

    @abstractmethod
    def finalize(self, timeout: float | None = None) -> None:
        """Wait for every enqueued operation (bounded); raises on timeout."""

    @abstractmethod
    def destroy(self) -> None:
        """Release resources; call after finalize or abort."""

    @abstractmethod
    def new_stream(self, high_priority: bool = False) -> Stream: ...

    @abstractmethod
    def new_event(self, timing: bool = False) -> Event: ...

    # --- operations (arrays are flat, contiguous, of one dtype) -----------------

    @abstractmethod
    def all_reduce(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None: ...

    @abstractmethod
    def broadcast(self, send: Any, recv: Any, root: int, stream: Stream) -> None: ...

    @abstractmethod
    def reduce(self, send: Any, recv: Any, op: ReduceOp, root: int, stream: Stream,
               scale: float | None = None) -> None: ...

    @abstractmethod
    def all_gather(self, send: Any, recv: Any, stream: Stream) -> None: ...

    @abstractmethod
    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None: ...

    @abstractmethod
    def all_to_all(self, send: Any, recv: Any, stream: Stream, send_counts: Sequence[int] | None = None,
                   recv_counts: Sequence[int] | None = None) -> None:
        """Equal blocks when counts are None; else element counts per peer,
        blocks packed contiguously in rank order."""

    @abstractmethod
    def gather(self, send: Any, recv: Any, root: int, stream: Stream) -> None: ...

    @abstractmethod
    def scatter(self, send: Any, recv: Any, root: int, stream: Stream) -> None: ...

    @abstractmethod
    def send(self, buf: Any, peer: int, stream: Stream) -> None: ...

    @abstractmethod
    def recv(self, buf: Any, peer: int, stream: Stream) -> None: ...

    supports_recv_any: bool = False  # NCCL has no wildcard receive

    # --- per-call settings of the next collective (NCCL >= 2.31.2: ncclCollConfig_t) --------------------------
    # The process-group core sets them just before it enqueues one collective and clears them just after, on the
    # issuing thread; a backend that cannot use them ignores them (the group validated the config already).

    supports_launch_marks: bool = False  # the ``launched`` event can be recorded at the kernel's launch

    def set_call_options(self, config: Any, launched: Event | None) -> None:
        """``config`` (a CollConfig, or None) and ``launched`` (an Event the
        backend records when the collective's kernel is launched, or None)
        for the next collective enqueued on this thread."""

    def clear_call_options(self) -> bool:
        """Forget them; True when the ``launched`` event was handed to the
        collective (False: it was not used, e.g. a send/recv-built one)."""
        return False

    def recv_any(self, buf: Any, stream: Stream) -> Callable[[], int | None]:
        """Receive from whichever peer sends first; the returned function
        gives that peer once the receive completed (None before)."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive from any source")

    def p2p_stream(self, stream: Stream, peer: int | None, send: bool, buf: Any) -> Stream:
        """The stream on which a send to (``send``) or a receive from
        ``peer`` (None: any source) issued on ``stream`` runs. By default
        ``stream`` itself: in stream order with everything else, as NCCL."""
        return stream

    def join_p2p(self, stream: Stream) -> None:
        """Make later work on ``stream`` wait for the operations that
        ``p2p_stream`` moved off it."""

    @abstractmethod
    def group_start(self) -> None: ...

    @abstractmethod
    def group_end(self) -> None: ...


def check_exclude(exclude: Sequence[int], nranks: int, rank: int) -> list[int]:
    """``exclude`` as a sorted list of distinct ranks of a communicator of
    ``nranks``, leaving at least one rank and not ``rank`` (the caller)."""
    if isinstance(exclude, (str, bytes)) or not isinstance(exclude, Sequence):
        raise TypeError(f"ranks to exclude must be a list of ints, got {type(exclude).__name__}")
    out: set[int] = set()
    for i, r in enumerate(exclude):
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"ranks to exclude must be ints; element {i} is {type(r).__name__}: {r!r}")
        if not 0 <= r < nranks:
            raise ValueError(f"rank {r} (element {i}) to exclude is out of range for {nranks} ranks")
        if r in out:
            raise ValueError(f"rank {r} appears twice in the ranks to exclude")
        out.add(r)
    if not out:
        raise ValueError("no rank to exclude: name at least one (e.g. the failed rank)")
    if len(out) >= nranks:
        raise ValueError(f"cannot exclude all {nranks} ranks: at least one must remain")
    if rank in out:
        raise RuntimeError(f"rank {rank} is in its own list of ranks to exclude: only the remaining ranks "
                           "take part in a shrink")
    return sorted(out)


# Types numpy sees as opaque (kind "V") that are numbers all the same: ml_dtypes' bfloat16 and 8-bit floats.
_ML_NUMBERS = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e4m3fnuz",
                         "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4", "float8_e8m0fnu"})


# The dtypes and reductions that passed the checks below: every operation checks its arrays, and the rules
# depend only on these keys (``dtype.name`` alone costs microseconds), so each is judged once per process.
_COMMUNICABLE: set[np.dtype] = set()
_REDUCIBLE: set[tuple[np.dtype, ReduceOp, bool]] = set()


def check_dtype(dtype: np.dtype, what: str) -> None:
    """Refuse element types no backend can communicate (objects hold
    pointers; strings, dates, void and structured records have no reduction
    and no wire format), at the call rather than inside the stream."""
    if dtype in _COMMUNICABLE:
        return
    if (dtype.kind in "biufc" and dtype.fields is None) or dtype.name in _ML_NUMBERS:
        _COMMUNICABLE.add(dtype)
        return
    raise TypeError(f"{what}: arrays of dtype {dtype} cannot be communicated; use a numeric dtype "
                    "(bool, integers, floats, complex, bfloat16, float8)")


def all_to_all_counts(nranks: int, send_size: int, recv_size: int, send_counts: Sequence[int] | None,
                      recv_counts: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """all_to_all's per-peer element counts, checked the same way on every
    backend: none given means equal splits of equal arrays; otherwise both,
    one non-negative count per rank."""
    if send_counts is None and recv_counts is None:
        if send_size % nranks or send_size != recv_size:
            raise ValueError(f"all_to_all: send ({send_size}) and recv ({recv_size}) must be equal and "
                             f"divisible by {nranks} ranks")
        return [send_size // nranks] * nranks, [recv_size // nranks] * nranks
    if send_counts is None or recv_counts is None:
        raise ValueError("all_to_all: give both send_counts and recv_counts, or neither")
    sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(sc) != nranks or len(rc) != nranks or min(sc + rc) < 0:
        raise ValueError(f"all_to_all: counts must be {nranks} non-negative numbers each")
    return sc, rc


def check_reduction(dtype: np.dtype, op: ReduceOp, scale: float | None, what: str) -> None:
    """The reductions both backends refuse (NCCL's rules: no float8
    reductions, complex only sums, no mean of booleans)."""
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{what}: op must be a ReduceOp, got {op!r}")
    key = (dtype, op, scale is not None)
    if key in _REDUCIBLE:
        return
    if dtype.name in _ML_NUMBERS and dtype.name != "bfloat16":
        raise TypeError(f"{what}: Float8 dtypes are not supported for NCCL reductions")
    if dtype.kind == "c" and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise TypeError(f"{what}: {op!r} is not supported on complex arrays (only SUM and AVG)")
    if dtype == np.bool_ and op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM):
        raise TypeError(f"{what}: Cannot use {op!r} with boolean inputs")
    if (op is ReduceOp.PREMUL_SUM) != (scale is not None):
        raise ValueError(f"{what}: PREMUL_SUM needs a scale factor, and only PREMUL_SUM takes one")
    _REDUCIBLE.add(key)


class Backend(ABC):
    """What the process-group core needs from a backend besides its
    Communicator: how to create one, and how to view, allocate and copy the
    arrays it works on. One instance per backend kind ("host", "nccl")."""

    name: str
    # Whether a group starts its communicator's init when it is created (nonblocking; its first operation waits
    # for it), as Gloo connects at creation: then every rank of the group takes part at once, whatever it does
    # next, so point-to-point between some ranks works from the first operation (receives from any source
    # included). Otherwise the init waits for the first operation, and a standalone send or receive before it
    # gets a communicator of its pair, as ProcessGroupNCCL does (group/pairs.py).
    connects_at_creation: bool = False

    @abstractmethod
    def create(self, store: Any, nranks: int, rank: int, config: CommConfig, device: Any = None) -> Communicator:
        """A new communicator bootstrapped through ``store`` (keys private to it)."""

    def join_grow(self, store: Any, unique_id: bytes, nranks: int, rank: int, config: CommConfig,
                  device: Any = None) -> Communicator:
        """A new rank's side of ``Communicator.grow`` (ncclCommGrow with no
        parent): rank ``rank`` (>= the grown communicator's old size, <
        ``nranks``) of the communicator that ``unique_id`` (from the
        coordinator's ``get_unique_id``) grows. ``store``: the job's store
        (the host backend meets the grown ranks there; NCCL needs only the
        id)."""
        raise NotImplementedError(f"the {self.name} backend cannot grow a communicator")

    @abstractmethod
    def flat(self, array: Any, what: str) -> Any:
        """A flat view sharing memory with ``array``; raises TypeError/ValueError
        naming ``what`` for an array this backend cannot use (wrong device,
        not contiguous)."""

    @abstractmethod
    def dtype(self, array: Any) -> Any:
        """The numpy dtype of ``array``."""

    def writable(self, array: Any) -> bool:
        """False for a flat array (from ``flat``) that must not be written,
        such as a read-only numpy view; outputs are checked with it before
        anything is enqueued."""
        return True

    def check_reduction(self, dtype: Any, op: ReduceOp, scale: float | None, what: str) -> None:
        """Raise TypeError/ValueError for a reduction this backend cannot do,
        before anything is enqueued (default: the rules of ``check_reduction``)."""
        check_reduction(dtype, op, scale, what)

    def checked_flat(self, array: Any, what: str, output: bool = False) -> Any:
        """``array`` as this backend's flat array, or the argument error naming
        ``what`` (a device, layout or element type it cannot take; a read-only
        array where ``output``: the operation writes it)."""
        flat = self.flat(array, what)
        check_dtype(self.dtype(flat), what)
        if output and not self.writable(flat):
            raise ValueError(f"{what}: the output array is read-only")
        return flat

    def in_place_reduction(self, array: Any, op: Any, what: str) -> tuple[Any, ReduceOp, float | None]:
        """What an in-place reduction of ``array`` with ``op`` (a ReduceOp or
        ``make_premul_sum(factor)``) takes: the flat array, the operator and its
        scale; or the argument error, named for the collective ``what``."""
        flat = self.checked_flat(array, f"{what} tensor", output=True)
        rop, scale = resolve(op)
        self.check_reduction(self.dtype(flat), rop, scale, what)
        return flat, rop, scale

    @abstractmethod
    def empty(self, count: int, dtype: Any, device: Any = None) -> Any:
        """A new flat array of ``count`` elements on the backend's device."""

    @abstractmethod
    def copy(self, dst: Any, src: Any, stream: Stream) -> None:
        """Enqueue ``dst[...] = src`` (flat arrays, same size and dtype) on ``stream``."""

    @abstractmethod
    def from_host(self, data: Any, device: Any = None) -> Any:
        """A device array holding the numpy array ``data`` (object collectives)."""

    @abstractmethod
    def to_host(self, array: Any) -> Any:
        """A numpy copy of ``array``; call after the operation writing it completed."""

    @abstractmethod
    def wait_for_caller(self, stream: Stream, device: Any = None) -> None:
        """Make ``stream`` wait for the work the caller enqueued so far (its
        current device stream); nothing to do where the caller is the CPU."""

    @property
    @abstractmethod
    def blocking_wait(self) -> bool:
        """True when ``Work.wait()`` must block the CPU until the operation
        completes (the host backend: the caller reads its arrays next)."""

    @abstractmethod
    def make_caller_wait(self, event: Event, device: Any = None) -> None:
        """Make the caller's current device stream wait for ``event`` (used
        when ``blocking_wait`` is False)."""

    def prepare_poller(self) -> None:
        """Runs once on the watchdog's poller thread before it first polls
        this backend's events."""

    def find_nan(self, arrays: Sequence[Any], stream: Stream | None, trap: Callable[[int], str] | None,
                 device: Any = None) -> NanScan:
        """Scan flat ``arrays`` (of dtypes in ``nan_scan.RULES``, complex as
        two lanes) for the first NaN lane of their concatenation, after the
        work enqueued so far on ``stream`` (None: the caller's stream, or the
        calling thread). ``trap``: end the process on a NaN instead (with
        ``trap(lane)`` as the last words where the backend can say them)."""
        raise NotImplementedError(f"the {self.name} backend has no NaN check")

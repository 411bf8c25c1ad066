"""Issuing one operation of a process group: the communicator at hand, the
NaN check, numbering, the flight-recorder entry, the enqueue and its Work;
and the coalescing batch (operations issued between start and end as one
group, one Work)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..coll_config import CollConfig
from ..comm.base import CallTimeout, Communicator, Event, Stream
from ..diagnostics import diagnosis, verdicts
from ..diagnostics.flight_recorder import Entry
from ..errors import Culprit, DistBackendError
from . import watchdog
from .core import OPEN, GroupCore
from .fingerprint import Fingerprint, mismatch
from .nan_check import Pending
from .work import OpType, Work

log = logging.getLogger("nccl_pg.group.process_group")

ANY_SOURCE = -1  # the peer of a receive from any source
_DIAGNOSIS_GRACE = 1.0  # seconds a stuck enqueue waits for its diagnosis beyond the diagnosis's own bounds
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


class Issuing(GroupCore):
    """Issuing operations and coalescing them (see ProcessGroup)."""

    def _issue(self, op_type: OpType, outputs: list[Any], enqueue: Enqueue,
               after: Callable[[Stream], None] | None = None, inputs: list[Any] | None = None,
               name: str | None = None, peer: int | None = None, check: Checked | None = None,
               fingerprint: Fingerprint | bool | None = None, buf: Any = None,
               source: list[Callable[[], int | None]] | None = None, config: CollConfig | None = None) -> Work | None:
        """Enqueue one operation; ``after`` enqueues copy-outs behind it.
        ``inputs`` (default: ``outputs``, in place) and ``name`` are for the
        flight recorder; ``peer`` (group rank, or ``ANY_SOURCE``) makes it a
        send or recv of ``buf``, on the stream the backend gives it.
        ``check``: the arrays the NaN check scans; callers pass
        ``[...] if self._nan is not None else None``, so that no list is built
        when it is off.
        ``fingerprint``: what every rank's collective must agree on, checked
        in debug mode (callers pass ``self._detail and Fingerprint(...)``).
        ``source``: a receive from any source's enqueue appends who sent
        (read once it completed) for its Work. ``config``: the collective's
        per-call CollConfig (validated by the caller)."""
        live = self._live  # _ready() inline: every operation comes here
        if peer is not None or live is None or self._state is not OPEN or self._coalescing is not None or \
                check is not None or config is not None or self._detail or self._timing or self._launch_marks or \
                live[1].capturing:
            return self._issue_any(op_type, outputs, enqueue, after, inputs, name, peer, check, fingerprint, buf,
                                   source, config, live)
        # The common case, every operation's: a collective with the communicator up, no coalescing, capture, NaN
        # check, fingerprint, timing, launch mark or per-call config. _issue_any's steps without its checks.
        comm, stream = live
        comm.join_p2p(stream)
        self._backend.wait_for_caller(stream, self._device)
        self._op_id += 1
        seq = self._seq = self._seq + 1
        entry = self._recorder.record(self.diag, self._timeout, name or _PROFILING_NAME[op_type], seq, self._seq_p2p,
                                      self._op_id, outputs if inputs is None else inputs, outputs, False)
        try:
            enqueue(comm, stream)
        except CallTimeout as exc:
            raise self._stuck(op_type, seq, None, exc) from None
        if after is not None:
            after(stream)
        end = stream.record()
        work = Work(self, op_type, seq, outputs, end, None, self._timeout, () if entry is None else (entry,))
        if not (self._may_complete_at_issue and end.query() and (work.complete_at_issue() or work.is_completed())):
            self._track(work)
        return work

    def _issue_any(self, op_type: OpType, outputs: list[Any], enqueue: Enqueue, after: Callable[[Stream], None] | None,
                   inputs: list[Any] | None, name: str | None, peer: int | None, check: Checked | None,
                   fingerprint: Fingerprint | bool | None, buf: Any, source: list[Callable[[], int | None]] | None,
                   config: CollConfig | None, live: tuple[Communicator, Stream] | None) -> Work | None:
        """``_issue`` of any operation (``live``: the group's ``_live`` as it read it)."""
        p2p = peer is not None
        lane = p2p and self._coalescing is None
        if live is None or self._state is not OPEN:
            # before the communicator exists, a standalone send or receive goes to the pair's (pairs.py)
            pair = self._pair(peer) if lane and peer is not None and peer != ANY_SOURCE else None
            live = pair or self._ready(join=False)  # creates the communicator, or raises: the group is closed
        comm, stream = live
        if lane:
            stream = comm.p2p_stream(stream, None if peer is None or peer == ANY_SOURCE else self._rank_in(comm, peer),
                                     op_type is OpType.SEND, buf)
        else:
            comm.join_p2p(stream)
            if isinstance(fingerprint, Fingerprint) and self._coalescing is None and not stream.capturing:
                self._check_fingerprint(comm, stream, fingerprint)
        self._backend.wait_for_caller(stream, self._device)
        if stream.capturing:  # into a CUDA graph: it runs at each replay, unnumbered and unrecorded, watched
            # through events in the graph (replays.py), unchecked for NaNs (a check's result could only be read at a
            # replay)
            watched = self._coalescing is None  # a coalesced group is watched as one, from its start to its end
            start = self._mark_replayed(comm, stream) if watched else None
            self._enqueue(comm, stream, enqueue, config, None)
            if start is not None:
                self._replayed(comm, stream, op_type, start)
            if self._coalescing is not None:
                self._coalesced_outputs.extend(outputs)
                if after is not None:
                    self._coalescing.append(lambda: after(stream))
                return None
            if after is not None:
                after(stream)
            return Work.captured(self, op_type, outputs, stream.record(), self._peers_of(peer),
                                 source[0] if source else None)
        # Before anything is numbered or enqueued: in raise mode a NaN leaves no trace of the operation.
        nan = self._nan.check(op_type, check, stream, self._timeout) if check and self._nan is not None and not self._prechecked \
            else None
        self._op_id += 1
        if self._coalescing is not None:
            if nan is not None:
                self._coalesced_nan.append(nan)
            # NCCL takes at most one launch-completion event per communicator and group: the first operation's
            mark = comm.new_event() if self._launch_marks and not p2p and self._coalesce_launched is None and \
                not self._coalesced_entries else None
            self._coalesce_launched = self._enqueue(comm, stream, enqueue, config, mark) or self._coalesce_launched
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
        launched = comm.new_event() if self._launch_marks and not p2p else None
        try:
            launched = self._enqueue(comm, stream, enqueue, config, launched)
        except CallTimeout as exc:
            raise self._stuck(op_type, self._seq_p2p if p2p else self._seq, self._peers_of(peer), exc) from None
        if after is not None:
            after(stream)
        return self._watch(op_type, self._seq_p2p if p2p else self._seq, outputs, start, stream,
                           () if entry is None else (entry,), None if peer is None else self._peers_of(peer),
                           None if nan is None else [nan], source[0] if source else None, launched)

    @staticmethod
    def _enqueue(comm: Communicator, stream: Stream, enqueue: Enqueue, config: CollConfig | None,
                 launched: Event | None) -> Event | None:
        """``enqueue`` with the per-call settings; ``launched`` if the backend took it (else None)."""
        if config is None and launched is None:
            enqueue(comm, stream)
            return None
        comm.set_call_options(config, launched)
        try:
            enqueue(comm, stream)
        finally:
            used = comm.clear_call_options()
        return launched if used else None

    def _mark_replayed(self, comm: Communicator, stream: Stream) -> Event:
        """The start of a captured collective: an event every replay records (replays.py)."""
        start = comm.new_event()
        stream.record_replayed(start)
        return start

    def _replayed(self, comm: Communicator, stream: Stream, op_type: OpType, start: Event) -> None:
        """The end of a captured collective; it is watched from now on, at every replay."""
        end = comm.new_event()
        stream.record_replayed(end)
        self._replays.captured(stream.capture_id(), op_type.name, start, end, self._timeout, stream.capture_gone)

    def _stuck(self, op_type: OpType, seq: int, peers: tuple[int, ...] | None, error: CallTimeout) -> DistBackendError:
        """An operation whose call into the communicator did not complete within the timeout (stuck in NCCL,
        waiting for peers): explained as a timed-out Work is (diagnosis.py asks every rank where it is, within
        its budget), then the group's error handling applies."""
        text = (f"timeout: process group {self.uid} ({self.group_desc!r}), rank {self._rank} of {self._size}: "
                f"{verdicts.op_name(op_type.value)} #{seq} did not complete its enqueue within its timeout of "
                f"{self._timeout:.3f} s ({error})")
        done, said, blamed = threading.Event(), [], []

        def finish(why: str, path: str | None, culprits: tuple[Culprit, ...]) -> None:
            said.append(f"{text}; {why}" + (f"; debug dump: {path}" if path else ""))
            blamed.append(culprits)
            done.set()

        self.diagnose_timeout(diagnosis.Timeout(self.diag, seq, peers, self._timeout, time.monotonic(),
                                                verdicts.collective(op_type.value, seq, self.group_name), text,
                                                finish))
        done.wait(diagnosis.longest(self._timeout) + _DIAGNOSIS_GRACE)
        err = DistBackendError(said[0] if said else f"{text}; the other ranks could not be asked where they are")
        if blamed:
            err.culprits = blamed[0]
        self._handle_error(err)
        return err

    def _peers_of(self, peer: int | None) -> tuple[int, ...] | None:
        if peer is None:
            return None
        return tuple(r for r in range(self._size) if r != self._rank) if peer == ANY_SOURCE else (peer,)

    def _check_fingerprint(self, comm: Communicator, stream: Stream, fp: Fingerprint) -> None:
        """Debug mode: every rank all-gathers its collective's fingerprint
        before issuing it; on a mismatch every rank raises (nothing is
        issued), naming ranks and fields. Unnumbered and unrecorded, so that
        sequence numbers match those of a run without the check."""
        mine = fp.encode()
        rows = self._backend.empty(mine.size * self._size, mine.dtype, self._device)
        sent = self._backend.from_host(mine, self._device)
        self._backend.wait_for_caller(stream, self._device)  # both were made on the caller's stream
        comm.all_gather(sent, rows, stream)
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
               nan: list[Pending] | None = None, source: Callable[[], int | None] | None = None,
               launched: Event | None = None) -> Work:
        """``peers``: None for a collective, else the p2p operation's peers;
        ``nan``: async NaN checks the Work reports."""
        # With timing, the end event times too (CUDA measures only between two timing events).
        end = stream.record() if start is None or self._comm is None else stream.record(self._comm.new_event(timing=True))
        work = Work(self, op_type, seq, outputs, end, start, self._timeout, entries, peers, nan, source, launched)
        if not (self._may_complete_at_issue and end.query() and (work.complete_at_issue() or work.is_completed())):
            self._track(work)
        if self._detail:
            log.info("pg %d rank %d: issued %s seq %d", self.uid, self._rank, op_type.name, seq)
        return work

    def _track(self, work: Work) -> None:
        """Hand a new Work to the watchdog. Its issuer finished it instead if
        it was complete already (a CPU backend whose stream had nothing queued
        before it)."""
        with self._lock:
            self._pending.add(work)
        watchdog.get().watch(work)

    def _start_coalescing(self) -> None:
        comm, stream = self._ready()
        if self._coalescing is not None:
            raise RuntimeError("coalescing already started on this group")
        self._coalescing, self._coalesced_outputs, self._coalesced_entries = [], [], []
        self._coalesced_peers = []  # the group is numbered at its end, once its kind is known
        self._coalesced_nan, self._prechecked = [], False
        self._coalesce_launched = None
        capturing = stream.capturing
        self._coalesce_start = stream.record(comm.new_event(timing=True)) if self._timing and not capturing else None
        self._coalesce_replayed = self._mark_replayed(comm, stream) if capturing else None
        comm.group_start()

    def _end_coalescing(self, op_type: OpType = OpType.COALESCED) -> Work:
        if self._coalescing is None:
            raise RuntimeError("_end_coalescing() without _start_coalescing()")
        comm, stream = self._ready()
        copies, self._coalescing, self._prechecked = self._coalescing, None, False
        captured = stream.capturing
        # Only sends/recvs: one p2p operation (torch's seqP2P_). Numbered as a collective, it would put the
        # collective count of the ranks taking part ahead of the others', and timeouts would blame the wrong ranks.
        # Numbered before its launch (group_end), as a single operation is before its enqueue.
        kinds = self._coalesced_peers
        p2p = bool(kinds) and all(k is not None for k in kinds)
        if not captured:
            if p2p:
                self._seq_p2p += 1
            else:
                self._seq += 1
        try:
            comm.group_end()
        except CallTimeout as exc:
            peers = tuple(sorted({k for k in kinds if k is not None})) if p2p else None
            raise self._stuck(op_type, self._seq_p2p if p2p else self._seq, peers, exc) from None
        finally:
            for copy in copies:
                copy()
        if captured:
            if self._coalesce_replayed is not None:
                self._replayed(comm, stream, op_type, self._coalesce_replayed)
            return Work.captured(self, op_type, self._coalesced_outputs, stream.record(), None)
        parts = [e for e in self._coalesced_entries if e is not None]
        for e in parts:
            e.collective_seq_id, e.p2p_seq_id = self._seq, self._seq_p2p
        whole = self._recorder.record_coalesced(self.diag, self._timeout, parts, self._seq, self._seq_p2p,
                                                self._op_id, p2p)
        nan, self._coalesced_nan = self._coalesced_nan, []
        launched, self._coalesce_launched = self._coalesce_launched, None
        return self._watch(op_type, self._seq_p2p if p2p else self._seq, self._coalesced_outputs,
                           self._coalesce_start, stream, parts if whole is None else [*parts, whole],
                           tuple(sorted({k for k in kinds if k is not None})) if p2p else None, nan or None,
                           launched=launched)

    def abandon_coalescing(self) -> None:
        """Close a coalescing group that failed while being built (argument
        errors are raised before anything is enqueued)."""
        if self._coalescing is not None and self._comm is not None:
            self._coalescing, self._prechecked = None, False
            for pending in self._coalesced_nan:
                pending.abandon()
            self._coalesced_nan = []
            self._comm.group_end()

    def check_up_front(self, op_type: OpType, items: Checked) -> None:
        """Raise mode, in a coalescing group before its operations are
        issued: check all their inputs now, since a NaN found in a later one
        could not take back the earlier ones; the operations then skip their
        own checks."""
        if self._nan is not None and self._nan.mode == "raise" and self._coalescing is not None:
            stream = self._ready()[1]
            if not stream.capturing:  # captured operations are not checked (see _issue)
                self._nan.check(op_type, items, stream, self._timeout)
            self._prechecked = True

"""ProcessGroup: one rank's view of a group of processes, over a backend.

It owns (lazily, or eagerly on request) one communicator and one stream,
numbers its operations, checks arguments, turns list-shaped arguments into
the flat buffers the Communicator contract takes (copies run on the same
stream), and hands out Works watched by the process-wide watchdog.
Ranks here are group ranks; the module API (distributed/world.py) maps global ranks onto them.
"""

from __future__ import annotations

import atexit
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ..comm.base import CommConfig, CommState, Communicator, check_exclude
from ..errors import DistBackendError, DistStoreError
from ..store import PrefixStore, Store
from ..timeouts import Timeout, to_seconds
from . import handles, watchdog
from .collectives import Collectives
from .core import GroupState
from .options import Options
from .suspension import Suspension

# shrink flags (torch's values): stop the parent's in-flight operations first, or not
#: ``shrink_group(..., shrink_flags=SHRINK_DEFAULT)``: the parent's operations in flight go on (torch's value).
SHRINK_DEFAULT = 0x00
#: ``shrink_group(..., shrink_flags=SHRINK_ABORT)``: stop the parent's operations in flight first (torch's value).
SHRINK_ABORT = 0x01


class ProcessGroup(Suspension, Collectives):
    """A group of ``size`` ranks; this process is ``rank``. Its parts, in
    nccl_pg/group/: core.py (state, communicator lifecycle, failures),
    issuing.py (one operation, coalescing), collectives.py (the
    operations); here, shrink and revoke."""

    @property
    def supports_shrinking(self) -> bool:
        """Every group can shrink: through its communicator's own shrink when
        that is alive and able (ncclCommShrink from NCCL 2.27, the host
        backend), else through a fresh communicator of the survivors."""
        return True

    def check_shrink(self, exclude: Sequence[int], flags: int) -> list[int]:
        """The sorted group ranks to exclude; raises on bad arguments."""
        if isinstance(flags, bool) or flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
            raise ValueError(f"invalid shrink_flags {flags!r}: use SHRINK_DEFAULT ({SHRINK_DEFAULT}) or "
                             f"SHRINK_ABORT ({SHRINK_ABORT}, to stop operations still in flight first)")
        return check_exclude(exclude, self._size, self._rank)

    def shrink(self, excluded: list[int], abort_first: bool, options: Options | None, *, group_name: str,
               group_desc: str, uid: int, global_ranks: Sequence[int] | None = None,
               init_timeout: float | None = None, native: bool | None = None) -> ProcessGroup:
        """Collective over the ranks not in ``excluded`` (from
        ``check_shrink``; only the survivors call it): a new group of the
        survivors, in their order. This group is left to the caller to
        destroy. ``init_timeout`` bounds the new communicator's creation
        (default: the new group's timeout). ``native``: through the
        communicator's own shrink, or a fresh communicator (default: as
        this rank's communicator can)."""
        with self._lock:
            if self._state is GroupState.DESTROYED:
                raise DistBackendError(f"process group {self.uid} ({self.group_desc!r}) on rank {self._rank} was "
                                       "destroyed; it cannot be shrunk")
            comm = self._comm
            native = comm is not None and (comm.can_shrink() if native is None else native)
            if abort_first:  # the failures that follow are this rank's doing: no error handling on them
                self._error_handled = True
                if self._state is GroupState.OPEN:
                    self._state, self._close_reason = GroupState.REVOKED, "shrink_group(SHRINK_ABORT)"
        survivors = [r for r in range(self._size) if r not in excluded]
        child = ProcessGroup(self._store, survivors.index(self._rank), len(survivors), options or self.options,
                             backend=self._backend, device_id=self._device, group_name=group_name,
                             group_desc=group_desc, uid=uid, global_ranks=global_ranks)
        if native:
            assert comm is not None
            limit = child._timeout if init_timeout is None else init_timeout
            if not abort_first and self._stream is not None and not self._stream.synchronize(limit):
                raise DistBackendError(f"timeout: process group {self.uid} ({self.group_desc!r}) on rank "
                                       f"{self._rank}: operations issued before a shrink did not finish within "
                                       f"{limit:.1f} s (SHRINK_ABORT stops them instead)")
            child._set_comm(comm.shrink(excluded, replace(child._comm_config(), timeout=limit), abort_first))
        else:
            if abort_first:
                self.abort()
            if self._comm is not None and self._device is not None:
                child.eager_init()  # an eager parent gets an eager child; a lazy one, a lazy child
        return child

    def revoke(self) -> None:
        """Stop this group's in-flight operations (they fail, saying
        "revoked") and refuse later ones, but keep the communicator for
        ``shrink_group``; local and bounded. Where the communicator cannot
        revoke (NCCL < 2.28.7) it is aborted, and a shrink builds a fresh one.
        Refused while CUDA graphs that captured its collectives are alive."""
        self._refuse_with_live_graphs("revoke")
        with self._lock:
            if self._state is GroupState.DESTROYED:  # (a late revoke from another thread: nothing left to stop)
                return
            self._error_handled = True  # a revoke's failures are not errors to handle
            if self._state is GroupState.OPEN:
                self._state, self._close_reason = GroupState.REVOKED, "revoke_process_group()"
            comm = self._comm
        self._pairs.abort()  # (pair communicators cannot be revoked; a shrink makes no use of them)
        if comm is None:
            return
        if comm.supports_revoke and comm.state is not CommState.INITIALIZING:
            comm.revoke()
        else:
            comm.abort()


    # --- reconfigure: from any membership to any other (docs/ELASTIC.md) -----------------------------------

    uuid: int = 0  # the configuration this group is (torchcomms' uuid): 0 when created, then each reconfigure's

    def get_init_handle(self) -> str:
        """This process's handle in this group's configuration, for the
        ``init_handles`` of the next ``reconfigure``."""
        return handles.handle_for(self.uuid, self._rank)

    def healthy(self) -> bool:
        """Open, with a communicator (if made yet) that nothing broke."""
        comm = self._comm
        return self._state is GroupState.OPEN and (comm is None or comm.async_error() is None)

    def reconfigure(self, uuid: int, init_handles: Any, timeout: Timeout | None = None, *, store: Store | None = None,
                    options: Options | None = None, group_desc: str | None = None, uid: int | None = None,
                    global_ranks: Sequence[int] | None = None) -> ProcessGroup:
        """The group of the configuration ``init_handles`` name (see
        group/handles.py for who gets which rank), within one deadline
        (``timeout``, default this group's): this group itself when nothing
        changes and it is healthy; else revoke, then an abortive shrink
        (ranks left; this group is then aborted, never finalized) or, with
        nobody left but the group broken, a fresh communicator of the same
        ranks; then a grow (ranks joined), after which its parent is
        destroyed. ``store``: where members and new processes meet
        (default: this group's store; the new processes pass one that
        reaches the same keys)."""
        plan = handles.make_plan(uuid, init_handles, self.get_init_handle(), self._size)
        limit = self._timeout if timeout is None else to_seconds(timeout, "reconfigure timeout")
        deadline = time.monotonic() + limit
        meet = self._store if store is None else store
        names = GroupSetup(options or self.options, group_desc or self.group_desc, self.uid if uid is None else uid,
                       None if global_ranks is None else list(global_ranks))
        if not plan.member:  # this process's configuration lost the quorum: it comes back as a new one
            self.abort()
            self.shutdown(0)
            return ProcessGroup.join(plan, meet, deadline, self._backend, self._device, names)
        left = plan.left(self._size)
        # The same group or a fresh one: every member takes the same way, whatever it sees alone.
        same = False if left else _agree(plan, meet, deadline, self._rank, "same", self.healthy())
        if same and not plan.joiners:
            self.uuid = plan.uuid
            return self
        self._refuse_with_live_graphs("reconfigure")  # it revokes the communicator, or destroys it after a grow
        if not left and not same:
            self.revoke()
        try:
            return self._change(plan, left, meet, deadline, names)
        except BaseException:  # a failed change leaves no group behind: this one, or one made on the way
            self.abort()
            self.shutdown(0)
            raise

    def _change(self, plan: handles.Plan, left: list[int], meet: Store, deadline: float,
                names: GroupSetup) -> ProcessGroup:
        current: ProcessGroup = self
        if left or (not plan.joiners and not self.healthy()):
            self.revoke()
            if left:
                comm, native = self._comm, None
                if comm is not None and comm.shrink_refuses_errors:  # every survivor takes the same way
                    native = _agree(plan, meet, deadline, self._rank, "shrink", comm.can_shrink())
                current = self.shrink(left, True, names.options, group_name=f"{self.group_name}:shrunk",
                                      group_desc=names.desc, uid=names.uid, global_ranks=names.global_ranks,
                                      init_timeout=_left(deadline, "the shrink"), native=native)
            else:  # nobody left, nobody joins, but the group is broken: a fresh communicator of the same ranks
                current = ProcessGroup._fresh(plan, meet, deadline, self._backend, self._device, names)
            self.abort()  # after an abortive shrink: aborted, never finalized
            self.shutdown(0)
        try:
            if current is not self:
                current.wait_comm(deadline, "the shrink")
            if plan.joiners:  # a broken group (nobody left) grows through a fresh communicator: grow() sees to it
                grown = current.grow(plan, meet, deadline, names)
                current.shutdown(_left(deadline, "destroying the grown group's parent"))
                current = grown
        except BaseException:
            current.abort()
            current.shutdown(0)
            raise
        current.uuid = plan.uuid
        return current

    def wait_comm(self, deadline: float, what: str) -> None:
        """Poll this group's communicator, if it has one, out of
        INITIALIZING until ``deadline`` (a nonblocking creation)."""
        comm = self._comm
        if comm is not None:
            comm.wait_ready(_left(deadline, what))

    def grow(self, plan: handles.Plan, meet: Store, deadline: float, names: GroupSetup) -> ProcessGroup:
        """The members' side of a grow (every rank of this group calls it):
        group rank 0, the coordinator, publishes in ``meet`` the grow id of
        this group's communicator (ncclCommGetUniqueId) for the new
        processes, and every member grows it (ncclCommGrow, rank = -1),
        keeping its rank. Without a communicator able to grow (lazy, broken,
        NCCL < 2.29.2) every member and new process builds a fresh one
        through the store instead, as the published record says. The other
        members read that record before they grow (one parked wait, one get):
        NCCL's ranks 0 and N-1 would otherwise block inside ncclCommGrow until
        the coordinator's ncclCommGetUniqueId (bootstrap.cc bcastGrowHandle),
        and a coordinator that goes fresh takes everyone with it."""
        comm = self._comm
        native = (comm is not None and comm.supports_grow and comm.state is CommState.READY
                  and self._state is GroupState.OPEN)
        if self._stream is not None and not self._stream.synchronize(_left(deadline, "the grow")):
            raise DistBackendError(f"timeout: process group {self.uid} ({self.group_desc!r}) on rank {self._rank}: "
                                   "operations issued before a grow did not finish in time")
        unique_id = b""
        if self._rank == 0:
            if native:
                assert comm is not None
                unique_id = comm.get_unique_id()
            meet.set(_grow_key(plan), _GrowRecord(plan.digest, plan.size, unique_id.hex()).encode())
        else:
            coordinator_grows = bool(_grow_record(plan, meet, deadline, "member").unique_id)
            if coordinator_grows and not native:
                raise DistBackendError(f"reconfigure to uuid {plan.uuid}: the coordinator grows its communicator, but "
                                       f"rank {self._rank}'s cannot ({'none' if comm is None else comm.state.value})")
            native = coordinator_grows
        if not native:
            return ProcessGroup._fresh(plan, meet, deadline, self._backend, self._device, names)
        assert comm is not None
        child = ProcessGroup._of(plan, self._rank, meet, self._backend, self._device, names, names.options)
        child.start_comm(deadline, "the grow", lambda cfg: comm.grow(plan.size, unique_id or None, cfg))
        return child

    @classmethod
    def join(cls, plan: handles.Plan, meet: Store, deadline: float, backend: Any, device: Any,
             names: GroupSetup) -> ProcessGroup:
        """A new process's side: wait (parked, until ``deadline``) for the
        coordinator's record, then join the members' grow with its id
        (ncclCommGrow with no parent), or the fresh communicator they build."""
        if plan.quorum is None:  # nobody comes from a configuration: everyone starts afresh
            return cls._fresh(plan, meet, deadline, backend, device, names)
        record = _grow_record(plan, meet, deadline, "joining")
        if not record.unique_id:
            return cls._fresh(plan, meet, deadline, backend, device, names)
        child = cls._of(plan, plan.rank, meet, backend, device, names, names.options)
        child.start_comm(deadline, "the grow", lambda cfg: child.comm_backend.join_grow(
            meet, bytes.fromhex(record.unique_id), plan.size, plan.rank, cfg, device))
        child.uuid = plan.uuid
        return child

    @classmethod
    def _fresh(cls, plan: handles.Plan, meet: Store, deadline: float, backend: Any, device: Any,
               names: GroupSetup) -> ProcessGroup:
        """Every process of the new configuration builds a new communicator
        through the store, now (so that reconfigure returns a working group)."""
        child = cls._of(plan, plan.rank, meet, backend, device, names,
                        replace(names.options, timeout=_left(deadline, "a fresh communicator")))
        child.start_comm(deadline, "a fresh communicator", None)
        child._set_default_timeout(names.options.timeout)
        child.uuid = plan.uuid
        return child

    @classmethod
    def _of(cls, plan: handles.Plan, rank: int, meet: Store, backend: Any, device: Any, names: GroupSetup,
            options: Options) -> ProcessGroup:
        """The group of configuration ``plan`` (its keys under the plan's uuid in ``meet``), not started."""
        return cls(PrefixStore(f"nccl_pg/u{plan.uuid}", meet), rank, plan.size, options, backend=backend,
                   device_id=device, group_name="0", group_desc=names.desc, uid=names.uid,
                   global_ranks=names.global_ranks)

    def start_comm(self, deadline: float, what: str, grow: Callable[[CommConfig], Communicator] | None) -> None:
        """Give this new group its communicator, ready by ``deadline``: the one ``grow(config)`` makes, or
        else its own eager init. If that fails, nothing is left of the group."""
        try:
            if grow is None:
                self.eager_init()
            else:
                self._set_comm(grow(replace(self._comm_config(), timeout=_left(deadline, what))))
            self.wait_comm(deadline, what)
        except BaseException:
            self.abort()
            self.shutdown(0)
            raise


@dataclass(frozen=True)
class GroupSetup:
    """How a reconfigured group is set up: its options, description, uid
    (this process's number for it) and global ranks (None: its own)."""

    options: Options
    desc: str
    uid: int
    global_ranks: list[int] | None


@dataclass(frozen=True)
class _GrowRecord:
    """What the coordinator of a grow publishes for the new processes: the
    plan's digest and size, and the grow id (hex; empty: a fresh communicator)."""

    digest: str
    size: int
    unique_id: str

    def encode(self) -> bytes:
        return json.dumps({"digest": self.digest, "size": self.size, "id": self.unique_id}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> _GrowRecord:
        d = json.loads(raw)
        return cls(str(d["digest"]), int(d["size"]), str(d["id"]))


def _grow_key(plan: handles.Plan) -> str:
    return f"nccl_pg/reconfigure/{plan.quorum}-{plan.uuid}/grow"


def _agree(plan: handles.Plan, meet: Store, deadline: float, rank: int, what: str, can: bool) -> bool:
    """Whether every member staying (``plan.survivors``) can take the native way: shrink its communicator
    (``what`` = "shrink"), keep its group ("same": healthy); each says so in ``meet`` (a set, a parked wait,
    a multi_get), and all take the same way: else they all build a fresh communicator."""
    prefix = f"nccl_pg/reconfigure/{plan.quorum}-{plan.uuid}/{what}"
    meet.set(f"{prefix}/{rank}", b"1" if can else b"0")
    keys = [f"{prefix}/{r}" for r in plan.survivors]
    try:
        meet.wait(keys, _left(deadline, f"the members' agreement ({what})"))
    except DistStoreError as exc:  # the store's error names the keys still missing
        try:  # (the failure's path only: a request per member)
            missing = [r for r in plan.survivors if not meet.check([f"{prefix}/{r}"])]
        except DistStoreError:
            missing = []
        raise DistBackendError(f"timeout: reconfigure to uuid {plan.uuid}: rank {rank} waited for the other members "
                               f"of configuration {plan.quorum} to reach it, in vain: ranks {missing} of "
                               f"configuration {plan.quorum} never called reconfigure ({exc})") from None
    return all(bytes(v) == b"1" for v in meet.multi_get(keys))


def _grow_record(plan: handles.Plan, meet: Store, deadline: float, who: str) -> _GrowRecord:
    """The coordinator's record of this grow (a parked wait, then a get), checked against this process's plan."""
    key = _grow_key(plan)
    try:
        meet.wait([key], _left(deadline, "waiting for the coordinator's grow record"))
    except DistStoreError as exc:
        raise DistBackendError(f"timeout: reconfigure to uuid {plan.uuid}: rank {plan.rank} ({who}) waited for the "
                               f"coordinator (rank 0 of configuration {plan.quorum}) to start the grow, in vain "
                               f"({exc})") from None
    record = _GrowRecord.decode(meet.get(key))
    if record.digest != plan.digest or record.size != plan.size:
        raise DistBackendError(f"reconfigure to uuid {plan.uuid}: the coordinator was given other init_handles than "
                               f"rank {plan.rank} ({who}): its plan is a group of {record.size} ranks, digest "
                               f"{record.digest}; this one's {plan.size}, {plan.digest}")
    return record


def _left(deadline: float, what: str) -> float:
    """Seconds to ``deadline``; raises a timeout naming ``what`` once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DistBackendError(f"timeout: reconfigure ran out of time before {what}")
    return left


def _close_leftovers() -> None:
    """At exit: groups never destroyed are aborted (bounded), with a warning
    instead of a hang or a silent loss of pending work. Only this process's
    own groups: a forked child leaves its parent's alone."""
    dog = watchdog.existing()
    for pg in dog.groups() if dog is not None else []:
        if isinstance(pg, ProcessGroup):
            pg.close_left_open()


atexit.register(_close_leftovers)


class ProcessGroupHost(ProcessGroup):
    """The CPU backend's group (numpy arrays, TCP between ranks)."""

    def __init__(self, store: Store, rank: int, size: int, options: Options | None = None, **kwargs: Any) -> None:
        super().__init__(store, rank, size, options, backend="host", **kwargs)


class ProcessGroupNCCL(ProcessGroup):
    """The NCCL backend's group; raises ValueError where no GPU exists."""

    def __init__(self, store: Store, rank: int, size: int, options: Options | None = None, **kwargs: Any) -> None:
        super().__init__(store, rank, size, options, backend="nccl", **kwargs)

    Options: ClassVar[type[Options]] = Options  # torch's ProcessGroupNCCL.Options

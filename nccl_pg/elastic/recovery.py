"""``Elastic``: one process's side of elastic recovery — start or come in,
recover from a failure, agree on the step (docs/ELASTIC.md).

A recovery runs attempts until one succeeds or its deadline (``timeout``)
passes; each attempt has a deadline of its own (``attempt_timeout``). An
attempt follows the records (records.py) to the newest configuration:

- a configuration it left a handle in is seen through first (every member
  that read it either comes or marks itself gone, so it ends quickly);
- older ones it skips are marked gone in its own slot (so that whoever waits
  on them learns at once that it went on);
- the newest: when this process is not in it (left out while away), it
  writes the next one with itself in; when it went there before and its
  group broke since (or nobody wrote one since the failure), it writes the
  next one with the same members (a re-form); else it puts its handle in its
  slot and waits for every slot to be decided. All handles: ``reconfigure``
  to it. A tombstone: the next configuration is those who came. The attempt
  ran out with slots still empty: the first to claim it tombstones them, so
  the next attempt starts on a configuration without them.

Then one all_reduce (MIN) of [step reached, -(has no state), rank if it has
the state]: the step every old member has, whether anyone needs the state,
and the lowest rank that has it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import env
from ..distributed import _get_default_group, init_process_group, is_initialized
from ..distributed.world import current_world
from ..errors import DistBackendError, DistStoreError
from ..group.options import Options
from ..group.process_group import ProcessGroup
from ..membership import get_init_handle, job_store, reconfigure
from ..reduce_op import ReduceOp
from ..store import Store, TCPStore
from ..timeouts import Timeout, to_seconds
from .records import FINISHED, GONE, Config, Records, config_key, slot_key
from .watch import RecordWatch

log = logging.getLogger(__name__)

_NO_STEP = 2**62  # what a process without a state says it has reached (and its rank: none)
DEFAULT_ATTEMPT = 60.0  # seconds of one attempt, at most (and at most the whole recovery's timeout)


@dataclass(frozen=True)
class Change:
    """One membership change this process went through."""

    uuid: int
    world_size: int
    rank: int
    joined: bool  # this process came in with it (a replacement, a new node's rank, back after a failed change)
    took_s: float


@dataclass
class Recovery:
    """What a start or a recovery ended with: the step every member agreed
    on; whether anyone needs the state (``needs_state``: every rank then
    calls ``Elastic.broadcast_state(arrays)``, which sends it from
    ``source``, the lowest rank that has it); whether this process must take it
    (``fresh``: a replacement, or a member left out while it was away,
    whose own state is stale); the membership changes on the way."""

    step: int
    needs_state: bool
    changes: list[Change] = field(default_factory=list)
    source: int = 0
    fresh: bool = False
    finished: bool = False  # the others' loop ended before this process got in: it has nothing to do


class _Finished(Exception):
    """The members' loop ended (``Elastic.close``) before this process got in."""


class Elastic:
    """One process's side of elastic recovery over the membership records
    in ``store`` (the job's store), as member ``member``. ``join_uuid``: not
    None for a process that comes in while the job runs (a replacement, a
    new node's rank: the configuration current when it was started). None:
    an original rank, in configuration 0 from ``init_process_group``.
    ``timeout``: the deadline of a whole start or recovery;
    ``attempt_timeout``: of each attempt within it (default: the smaller of
    ``timeout`` and 60 s), which is also how long the others wait for a
    member that does not come before they go on without it.
    ``on_change(change)`` runs after each membership change. ``watch``:
    revoke the group when a newer record appears (a change no failure
    announces: a replacement or a node coming in), so that the loop's next
    collective fails and it recovers."""

    def __init__(self, store: Store | None, member: int, join_uuid: int | None = None, timeout: Timeout = 300.0,
                 on_change: Callable[[Change], None] | None = None, *, attempt_timeout: Timeout | None = None,
                 watch: bool = True, init_method: str | None = None) -> None:
        if isinstance(member, bool) or not isinstance(member, int) or member < 0:
            raise ValueError(f"Elastic: member must be an int >= 0, got {member!r}")
        if join_uuid is not None and store is None:
            raise ValueError("Elastic: a process that joins needs the job's store")
        self.member, self.join_uuid = member, join_uuid
        self.timeout = to_seconds(timeout, "Elastic timeout")
        self.attempt_timeout = min(self.timeout, DEFAULT_ATTEMPT if attempt_timeout is None else
                                   to_seconds(attempt_timeout, "Elastic attempt_timeout"))
        self.on_change = on_change
        self.init_method = init_method
        self._store = store
        self._records = None if store is None else Records(store)
        self._watching = watch
        self._watch: RecordWatch | None = None
        self._join_kwargs: dict[str, Any] = {}
        self._done: set[int] = set()  # configurations this process reconfigured to (or tried)
        self._offered: int | None = None  # a configuration whose slot holds its handle, not seen through yet
        self._seen = -1  # the newest configuration it looked at (those before it are behind it)
        self._rounds: Counter[int] = Counter()  # attempts that waited for a configuration's slots in vain
        self._fresh = join_uuid is not None  # no state of its own (a replacement) or a stale one (left out)
        self._transfer: Recovery | None = None  # the recovery whose state is still to be sent (broadcast_state)

    @classmethod
    def from_env(cls, timeout: Timeout = 300.0, on_change: Callable[[Change], None] | None = None,
                 environ: dict[str, str] | None = None, **kwargs: Any) -> Elastic:
        """As ``nccl-pg run --elastic`` starts a process: its member number
        (``NCCL_PG_ELASTIC_MEMBER``), for a process that comes in while the
        job runs the configuration then (``NCCL_PG_ELASTIC_UUID``), and the
        job's store: ``NCCL_PG_ELASTIC_STORE`` (``etcd://...``, several
        nodes) or else the launcher's (``MASTER_ADDR``, ``MASTER_PORT``,
        ``NCCL_PG_STORE_SECRET``). ``kwargs``: as the constructor's."""
        environ = dict(os.environ if environ is None else environ)
        member = env.ELASTIC_MEMBER.get(environ)
        if member is None:
            raise ValueError(f"Elastic.from_env: {env.ELASTIC_MEMBER.name} is not set: start the job with "
                             "`nccl-pg run --elastic`, or make an Elastic(store, member, ...) yourself")
        join_uuid = env.ELASTIC_UUID.get(environ)
        url = env.ELASTIC_STORE.get(environ)
        store: Store | None = None
        if url is not None:
            store = _store_of(url, to_seconds(timeout))
        elif join_uuid is not None:  # the original ranks connect in init_process_group (env://)
            addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
            if not addr or not port or not port.isdigit():
                raise ValueError("Elastic.from_env: MASTER_ADDR and MASTER_PORT must name the launcher's store")
            store = TCPStore(addr, int(port), is_master=False, timeout=to_seconds(timeout),
                             secret=env.STORE_SECRET.get(environ))
        return cls(store, member, join_uuid, timeout, on_change, init_method=url, **kwargs)

    @property
    def joining(self) -> bool:
        """True for a process that comes in while the job runs (until its start)."""
        return self.join_uuid is not None

    @property
    def watch(self) -> RecordWatch | None:
        return self._watch

    def start(self, backend: str | None = None, **init_kwargs: Any) -> Recovery:
        """An original rank: ``init_process_group(backend, **init_kwargs)``
        (env://, or the job's store), step 0. A process that comes in: writes
        the configuration with itself in, follows the records there, then
        agrees on the step with the members (of ``init_kwargs``, ``timeout``
        (the operations' timeout; default the Elastic's), ``device_id`` and
        ``pg_options`` shape its group)."""
        op_timeout = to_seconds(init_kwargs.get("timeout", self.timeout), "timeout")
        self._join_kwargs = {"backend": backend, "pg_options": init_kwargs.get("pg_options") or Options(op_timeout),
                             **({"device_id": init_kwargs["device_id"]} if "device_id" in init_kwargs else {})}
        if self.join_uuid is None:
            if not is_initialized():
                kwargs = {"timeout": self.timeout, **init_kwargs}
                if self.init_method is not None and "store" not in kwargs and "init_method" not in kwargs:
                    assert self._store is not None
                    kwargs.update(store=self._store, rank=int(os.environ["RANK"]),
                                  world_size=int(os.environ["WORLD_SIZE"]))
                init_process_group(backend, **kwargs)
            if self._store is None:
                self._store = job_store()
                self._records = Records(self._store)
            assert self._records is not None
            # Record 0 (a launcher wrote the same already; without one, the ranks go on without a lost rank)
            self._records.start(range(_get_default_group().size()))
            self._done.add(0)
            self._seen = 0
            self._arm()
            return Recovery(0, False)
        deadline = time.monotonic() + self.timeout
        records = self._need_records()
        me = self.member
        if records.finished():
            return Recovery(0, False, finished=True)
        mine = records.write_next(lambda c: None if me in c.members else (*c.members, me),
                                  f"member {me} comes in", deadline)
        self._seen = (records.latest() if mine is None else mine.uuid) - 1
        self.join_uuid = None
        return self._recover(None, deadline)

    def recover(self, step: int, error: BaseException | None = None) -> Recovery:
        """After a collective failed (``error``): revoke the group, report the
        ranks its timeout named (if any), then run attempts until this
        process is in a working group of the newest configuration and every
        member agreed on the step (``step``: the last this process
        completed). Raises DistBackendError when no attempt succeeded within
        ``timeout`` (the message says why the last one failed), ValueError
        when the records in the store are malformed (naming the key)."""
        if error is not None:
            log.warning("nccl_pg elastic: member %d: recovering from: %s", self.member, error)
        deadline = time.monotonic() + self.timeout
        pg = _default_or_none()
        if pg is not None:
            pg.revoke()
            self._report_stuck(pg, error)
        return self._recover(None if self._fresh else step, deadline)

    def broadcast_state(self, arrays: Sequence[Any]) -> bool:
        """After a start or recovery that needs the state (``needs_state``):
        send every array, in order, from the rank that has it
        (``Recovery.source``) to the others, in place; every member calls it
        with its state at the agreed step. Returns True once sent; False
        (nothing to do) when no recovery since the last transfer needs it, so
        a loop may call it at the top of every step. Raises DistBackendError
        when the transfer fails (a member died, a newer configuration was
        written meanwhile): call ``recover`` then, as for a failed step; a
        process whose state had not come counts as stale there, so it is sent
        again."""
        rec = self._transfer
        if rec is None:
            return False
        # Waited for on the CPU (no limit of its own: the group's op timeout ends it), so that the state counts as
        # sent only once it arrived, on a device stream too.
        pg = _get_default_group()
        works = [pg.broadcast(a, rec.source) for a in arrays]
        for work in works:
            if work is None:  # issued into a caller's coalescing block: it would arrive only at the block's end
                raise RuntimeError("Elastic.broadcast_state: called inside a coalescing block; call it outside")
            work.wait(math.inf)
        self._transfer = None
        self._fresh = False
        return True

    def close(self) -> None:
        """The loop is done: end the record watch, and let processes still
        coming in (a replacement started late) learn that the job finished
        (their start returns ``finished``). Call it before
        ``destroy_process_group``."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        pg = _default_or_none()
        if pg is not None and self._records is not None:
            try:
                self._records.finish(self.member, pg.uuid, None)
            except (DistStoreError, ValueError) as exc:  # nobody waits for this one then, or the store is gone
                log.warning("nccl_pg elastic: member %d: could not mark the job finished: %s", self.member, exc)

    # --- the attempts ---------------------------------------------------------------------------------

    def _recover(self, step: int | None, deadline: float) -> Recovery:
        if self._watch is not None:
            self._watch.disarm()
        self._transfer = None
        changes: list[Change] = []
        attempt = 0
        while True:
            attempt += 1
            attempt_deadline = min(deadline, time.monotonic() + self.attempt_timeout)
            try:
                self._follow(attempt_deadline, changes)
                rec = self._agree(None if self._fresh else step, changes, attempt_deadline)
            except _Finished:
                log.warning("nccl_pg elastic: member %d: the job's loop ended before this process got in",
                            self.member)
                return Recovery(0, False, changes, finished=True)
            except DistBackendError as exc:
                if time.monotonic() >= deadline:
                    raise DistBackendError(f"timeout: nccl_pg elastic: member {self.member} found no working "
                                           f"configuration within {self.timeout:g} s ({attempt} attempts); the "
                                           f"last failed with: {exc}") from exc
                log.warning("nccl_pg elastic: member %d: attempt %d failed (%s); trying again on the newest records",
                            self.member, attempt, exc)
                pg = _default_or_none()
                if pg is not None:
                    pg.revoke()
                continue
            # Stale until the state came: a transfer that fails leaves it stale for the next recovery.
            self._fresh = rec.fresh
            self._transfer = rec if rec.needs_state else None
            self._arm()
            return rec

    def _follow(self, deadline: float, changes: list[Change]) -> None:
        """Reconfigure to the newest configuration (module docstring)."""
        records, me = self._need_records(), self.member
        while True:
            if time.monotonic() >= deadline:
                raise DistBackendError(f"timeout: nccl_pg elastic: member {me}: the attempt ran out following the "
                                       "membership records")
            pg = _default_or_none()
            latest = records.latest()
            target = self._offered if self._offered is not None else latest
            if target == latest:
                self._skip(records, latest)
            if target in self._done:
                if pg is not None and pg.uuid == target and pg.healthy() and target == latest:
                    return
                records.write_next(lambda c, t=target: c.members if c.uuid == t else None,  # type: ignore[misc]
                                   f"re-form: member {me}'s group of configuration {target} broke", deadline)
                self._offered = None
                continue
            config = records.read(target)
            if me not in config.members:
                self._fresh = True  # left out while away: the others went on without its state
                records.write_next(lambda c: None if me in c.members else (*c.members, me),
                                   f"member {me} back in (left out of configuration {target})", deadline)
                continue
            if self._offered is None:
                self._offered = target
                records.offer(config, me, get_init_handle())
            try:
                slots = records.collect(config, deadline)
            except DistStoreError:
                self._rounds[target] += 1
                why = (f"did not come to configuration {target} within the {self.attempt_timeout:g} s attempt of "
                       f"member {me}")
                marked = records.evict(config, self._rounds[target], why)
                if marked:  # evidence for their launchers: alive, they made no progress for an attempt
                    self._report(target, [{"member": m, "reason": why} for m in marked], "absent", why)
                raise DistBackendError(f"timeout: nccl_pg elastic: member {me}: not every member of configuration "
                                       f"{target} {list(config.members)} came within the attempt"
                                       + (f"; it marked {marked} gone" if marked else "")) from None
            self._offered = None
            if any(why.startswith(FINISHED) for why in slots.gone.values()):
                raise _Finished
            if not slots.complete:
                came, first = slots.came(), next(iter(slots.gone.items()))
                records.write_next(lambda c, t=target, k=came: k if c.uuid == t and k else None,  # type: ignore[misc]
                                   f"members {sorted(slots.gone)} of configuration {target} are gone (member "
                                   f"{first[0]}: {first[1]})", deadline)
                self._done.add(target)  # never again: it is dead
                continue
            self._done.add(target)
            joined = pg is None
            t0 = time.monotonic()
            new = reconfigure(target, [slots.handles[m] for m in config.members],
                              max(deadline - time.monotonic(), 0.001), store=self._store if joined else None,
                              **(self._join_kwargs if joined else {}))
            change = Change(target, new.size(), new.rank(), joined, time.monotonic() - t0)
            changes.append(change)
            if self.on_change is not None:
                self.on_change(change)

    def _skip(self, records: Records, latest: int) -> None:
        """Mark this member gone in the configurations it skips on its way to
        ``latest`` (their other members may be waiting for it)."""
        skipped = list(range(self._seen + 1, latest))
        self._seen = max(self._seen, latest)
        if not skipped:
            return
        raws = records.store.multi_get([config_key(u) for u in skipped])
        tomb = GONE + f"member {self.member} went on to configuration {latest}".encode()
        for u, raw in zip(skipped, raws, strict=True):
            config = Config.decode(raw, config_key(u))
            if self.member in config.members:
                records.store.compare_set(slot_key(u, config.index(self.member)), b"", tomb)

    def _agree(self, step: int | None, changes: list[Change], deadline: float) -> Recovery:
        """One all_reduce (MIN) of [step reached, -(has no state), rank if it has the state]."""
        pg = _get_default_group()
        has = step is not None
        mine = np.array([step if has else _NO_STEP, -int(not has), pg.rank() if has else _NO_STEP], dtype=np.int64)
        out = pg.allreduce_host(mine, ReduceOp.MIN, timeout=max(deadline - time.monotonic(), 0.001))
        agreed, anyone_new, source = int(out[0]), bool(out[1] < 0), int(out[2])
        if agreed == _NO_STEP:  # nobody has a state: everyone starts afresh
            return Recovery(0, False, changes, 0, False)
        return Recovery(agreed, anyone_new, changes, source, not has)

    # --- helpers --------------------------------------------------------------------------------------

    def _need_records(self) -> Records:
        if self._records is None:
            self._store = job_store()
            self._records = Records(self._store)
        return self._records

    def _arm(self) -> None:
        if not self._watching:
            return
        assert self._store is not None
        if self._watch is None:
            self._watch = RecordWatch(self._store, self.member)
        self._watch.arm(_get_default_group(), _get_default_group().uuid)

    def _report_stuck(self, pg: ProcessGroup, error: BaseException | None) -> None:
        """The ranks an operation's timeout named (no progress past the op
        timeout, by the diagnosis) go to the launchers as evidence."""
        culprits = getattr(error, "culprits", ())
        if not culprits:
            return
        records = self._need_records()
        members: Sequence[int]
        try:
            members = records.read(pg.uuid).members
        except (DistStoreError, ValueError):
            members = ()
        suspects = [{"rank": c.rank, "member": members[c.rank] if 0 <= c.rank < len(members) else None,
                     "host": c.host, "pid": c.pid, "reason": c.reason} for c in culprits]
        self._report(pg.uuid, suspects, "op-timeout", str(error))

    def _report(self, uuid: int, suspects: list[dict[str, Any]], kind: str, evidence: str) -> None:
        try:
            self._need_records().report_stuck({"uuid": uuid, "reporter": self.member, "kind": kind,
                                               "suspects": suspects, "error": evidence[:2000]})
        except DistStoreError as exc:  # the recovery goes on; the launcher just learns nothing from this one
            log.warning("nccl_pg elastic: member %d: could not report the stuck ranks %s: %s", self.member,
                        [s["member"] for s in suspects], exc)


def _default_or_none() -> ProcessGroup | None:
    pg = current_world().default_pg
    return pg if isinstance(pg, ProcessGroup) else None


def _store_of(url: str, timeout: float) -> Store:
    """The job's store named by ``NCCL_PG_ELASTIC_STORE``: ``etcd://host:port[,...]/job``."""
    from ..store.rendezvous import etcd_store_of  # noqa: PLC0415 - only jobs on etcd load its client

    return etcd_store_of(url, timeout)

"""Elastic recovery for a training loop: what a loop needs to go on when a
rank dies, and to take its replacement back (docs/ELASTIC.md)::

    job = elastic.Elastic.from_env()          # under `nccl-pg run --elastic`
    rec = job.start("host")                   # the original ranks: init; a replacement: joins
    while step < steps:
        try:
            ...collectives of one step...; step += 1
        except nccl_pg.DistBackendError:
            rec = job.recover(step)           # shrink, grow, agree on the step
            step = rec.step                   # roll back to it; if rec.needs_state: broadcast the state

Membership records. Someone must say who is in each configuration; under
``nccl-pg run --elastic`` the launcher does (it sees every death, and starts
every replacement). It writes, in the job's store, one record per
configuration, ``nccl_pg/elastic/config/<uuid>``: the member numbers in the
order of their new ranks, and ``nccl_pg/elastic/latest``, the newest uuid.
When member d dies in configuration u, it writes u+1 (the others), and, with
a replacement left to start, u+2 (u+1's members and the replacement, whose
number is new), then starts the replacement with ``NCCL_PG_ELASTIC_UUID=u+2``.
Anyone else (another launcher, a test) can write the same records.

A recovery, on each process (O(1) store requests per process per
configuration, each wait parked on the server, all within one deadline):
revoke the group (what is in flight fails at once); wait for record u+1;
publish this process's init handle under ``nccl_pg/elastic/<u+1>/handle/<member>``
and read everyone's in one request; ``reconfigure`` to it; then, while the
record ``latest`` is newer, the same with the next one. Last, every member
agrees, in one all_reduce, on the step all of the old members have reached
(the minimum: a step one of them did not finish is done again) and on
whether a new member needs the state.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import env
from .distributed import _get_default_group, broadcast, init_process_group, is_initialized
from .errors import DistBackendError, DistStoreError
from .group.process_group import ProcessGroup
from .membership import get_init_handle, job_store, reconfigure
from .reduce_op import ReduceOp
from .store import Store, TCPStore
from .timeouts import Timeout, to_seconds

log = logging.getLogger(__name__)

NAMESPACE = "nccl_pg/elastic"
LATEST_KEY = f"{NAMESPACE}/latest"
_NO_STEP = 2**62  # what a new member says it has reached: nothing


def config_key(uuid: int) -> str:
    return f"{NAMESPACE}/config/{uuid}"


def handle_key(uuid: int, member: int) -> str:
    return f"{NAMESPACE}/{uuid}/handle/{member}"


@dataclass(frozen=True)
class Config:
    """One membership record: the members of configuration ``uuid``, in
    the order of their ranks there."""

    uuid: int
    members: tuple[int, ...]

    def encode(self) -> bytes:
        return json.dumps({"uuid": self.uuid, "members": list(self.members)}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Config:
        d = json.loads(raw)
        return cls(int(d["uuid"]), tuple(int(m) for m in d["members"]))


def publish(store: Store, configs: Sequence[Config]) -> None:
    """Write membership records and move ``latest`` to the last, in one
    request (the launcher's side)."""
    store.multi_set([*(config_key(c.uuid) for c in configs), LATEST_KEY],
                    [*(c.encode() for c in configs), str(configs[-1].uuid).encode()])


@dataclass(frozen=True)
class Change:
    """One membership change this process went through."""

    uuid: int
    world_size: int
    rank: int
    joined: bool  # this process came in with it (a replacement, or back after a failed change)
    took_s: float


@dataclass
class Recovery:
    """What a start or a recovery ended with: the step every member agreed
    on, whether a new member needs the state (broadcast it from rank 0, an
    old member), and the membership changes on the way."""

    step: int
    needs_state: bool
    changes: list[Change] = field(default_factory=list)


class Elastic:
    """One process's side of elastic recovery over the membership records
    in ``store`` (the job's store), as member ``member``. ``join_uuid``: the
    configuration a replacement joins (None: an original rank, in
    configuration 0 from ``init_process_group``). ``timeout``: the deadline
    of a whole start or recovery. ``on_change(change)`` runs after each
    membership change (e.g. to print it)."""

    def __init__(self, store: Store | None, member: int, join_uuid: int | None = None, timeout: Timeout = 300.0,
                 on_change: Callable[[Change], None] | None = None) -> None:
        if isinstance(member, bool) or not isinstance(member, int) or member < 0:
            raise ValueError(f"Elastic: member must be an int >= 0, got {member!r}")
        if join_uuid is not None and store is None:
            raise ValueError("Elastic: a process that joins needs the job's store")
        self.member, self.join_uuid = member, join_uuid
        self.timeout = to_seconds(timeout, "Elastic timeout")
        self.on_change = on_change
        self._store = store
        self._backend: str | None = None

    @classmethod
    def from_env(cls, timeout: Timeout = 300.0, on_change: Callable[[Change], None] | None = None,
                 environ: dict[str, str] | None = None) -> Elastic:
        """As ``nccl-pg run --elastic`` starts a process: its member number
        (``NCCL_PG_ELASTIC_MEMBER``), for a replacement the configuration it
        joins (``NCCL_PG_ELASTIC_UUID``) and a connection to the launcher's
        store (``MASTER_ADDR``, ``MASTER_PORT``, ``NCCL_PG_STORE_SECRET``)."""
        environ = dict(os.environ if environ is None else environ)
        member = env.ELASTIC_MEMBER.get(environ)
        if member is None:
            raise ValueError(f"Elastic.from_env: {env.ELASTIC_MEMBER.name} is not set: start the job with "
                             "`nccl-pg run --elastic`, or make an Elastic(store, member, ...) yourself")
        join_uuid = env.ELASTIC_UUID.get(environ)
        store = None
        if join_uuid is not None:  # the original ranks connect in init_process_group (env://)
            addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
            if not addr or not port or not port.isdigit():
                raise ValueError("Elastic.from_env: MASTER_ADDR and MASTER_PORT must name the launcher's store")
            store = TCPStore(addr, int(port), is_master=False, timeout=to_seconds(timeout),
                             secret=env.STORE_SECRET.get(environ))
        return cls(store, member, join_uuid, timeout, on_change)

    @property
    def joining(self) -> bool:
        """True for a replacement (until its start)."""
        return self.join_uuid is not None

    def start(self, backend: str | None = None, **init_kwargs: Any) -> Recovery:
        """An original rank: ``init_process_group(backend, **init_kwargs)``
        (env:// unless told otherwise), step 0. A replacement: join its
        configuration (and any newer one), then agree on the step with the
        members."""
        if self.join_uuid is None:
            if not is_initialized():
                init_process_group(backend, **{"timeout": self.timeout, **init_kwargs})
            self._store = job_store()
            return Recovery(0, False)
        self._backend = backend
        deadline = time.monotonic() + self.timeout
        changes = self._follow(self.join_uuid, deadline)
        self.join_uuid = None
        return self._agree(None, changes)

    def recover(self, step: int, error: BaseException | None = None) -> Recovery:
        """After a collective failed (``error``, for the log): revoke the
        group, follow the membership records to the newest, then agree on
        the step (``step``: the last this process completed) and on whether
        new members need the state. Raises DistBackendError when no record
        comes, or the changes fail, within the timeout."""
        if error is not None:
            log.warning("nccl_pg elastic: member %d: recovering from: %s", self.member, error)
        deadline = time.monotonic() + self.timeout
        pg = _get_default_group()
        pg.revoke()
        changes = self._follow(pg.uuid + 1, deadline)
        return self._agree(step, changes)

    # --- the steps ------------------------------------------------------------------------------------

    def _follow(self, uuid: int, deadline: float) -> list[Change]:
        """Reconfigure to record ``uuid``, then to each newer one."""
        changes = []
        while True:
            config = self._record(uuid, deadline)
            if self.member not in config.members:
                raise DistBackendError(f"nccl_pg elastic: member {self.member} is not in configuration {uuid} "
                                       f"(members {list(config.members)}): the records say it left")
            handles = self._handles(config, deadline)
            joined = not is_initialized()
            t0 = time.monotonic()
            pg = reconfigure(uuid, handles, max(deadline - time.monotonic(), 0.001),
                             store=self._store if joined else None, backend=self._backend if joined else None)
            change = Change(uuid, pg.size(), pg.rank(), joined, time.monotonic() - t0)
            changes.append(change)
            if self.on_change is not None:
                self.on_change(change)
            assert self._store is not None
            latest = int(self._store.get(LATEST_KEY))
            if latest <= uuid:
                return changes
            uuid += 1

    def _record(self, uuid: int, deadline: float) -> Config:
        assert self._store is not None
        try:
            self._store.wait([config_key(uuid)], max(deadline - time.monotonic(), 0.001))
        except DistStoreError:
            raise DistBackendError(f"timeout: nccl_pg elastic: member {self.member} waited for membership record "
                                   f"{uuid} in vain (is the job started with `nccl-pg run --elastic`, or does "
                                   "something else write the records?)") from None
        return Config.decode(self._store.get(config_key(uuid)))

    def _handles(self, config: Config, deadline: float) -> list[str]:
        """Publish this process's init handle for ``config``; everyone's, in
        the record's order (three requests)."""
        assert self._store is not None
        self._store.set(handle_key(config.uuid, self.member), get_init_handle())
        keys = [handle_key(config.uuid, m) for m in config.members]
        try:
            self._store.wait(keys, max(deadline - time.monotonic(), 0.001))
        except DistStoreError:
            raise DistBackendError(f"timeout: nccl_pg elastic: configuration {config.uuid}: not every member of "
                                   f"{list(config.members)} published its handle in time (one died meanwhile?)") \
                from None
        return [v.decode() for v in self._store.multi_get(keys)]

    def _agree(self, step: int | None, changes: list[Change]) -> Recovery:
        """One all_reduce (MIN) of [the step reached, -(new member)]: the
        step every old member has, and whether anyone needs the state."""
        mine = np.array([_NO_STEP if step is None else step, -int(step is None)], dtype=np.int64)
        mine = _get_default_group().allreduce_host(mine, ReduceOp.MIN)  # a GPU array on NCCL, numpy on the host
        agreed, anyone_new = int(mine[0]), mine[1] < 0
        if agreed == _NO_STEP:  # nobody has a state: everyone starts afresh
            return Recovery(0, False, changes)
        return Recovery(agreed, bool(anyone_new), changes)


def broadcast_state(arrays: Sequence[Any], group: ProcessGroup | None = None) -> None:
    """Send every array from rank 0 (an old member) to the others, in order."""
    for a in arrays:
        broadcast(a, src=0, group=group)

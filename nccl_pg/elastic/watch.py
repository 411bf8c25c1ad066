"""The record watch: between recoveries, each process keeps one wait parked
on the key of the record after its group's configuration. When that record
appears (someone died, someone came), the watch revokes the group, so that
every member's next (or current) collective fails at once and its loop
calls ``recover()`` — also for a change that no failure announces, as a
replacement or a new node coming in while the others train.

One thread per process; the store holds the wait (no polling), renewed every
``PARK`` seconds; ``disarm`` during a recovery, ``arm`` after it, ``close``
at the end (and at exit, before the interpreter finalizes).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref

from ..errors import DistStoreError
from ..group.process_group import ProcessGroup
from ..store import Store
from ..store.base import Parking, Unparked
from .records import config_key

log = logging.getLogger(__name__)

PARK = 600.0  # seconds of one parked wait (then renewed): one request per process per 10 minutes
RETRY_CAP = 10.0  # a store that fails (rather than times the wait out): retried after 0.1, 0.2, ... s, at most this

_open: weakref.WeakSet[RecordWatch] = weakref.WeakSet()


class RecordWatch:
    """Revokes ``pg`` when the record of configuration ``uuid + 1`` appears."""

    def __init__(self, store: Store, member: int) -> None:
        self.store, self.member = store, member
        self._cond = threading.Condition()
        self._target: tuple[ProcessGroup, int] | None = None
        self._parking: Parking | None = None
        self._closed = False
        self.fired: list[int] = []  # the records it revoked a group for (tests read it)
        self._thread = threading.Thread(target=self._run, name="nccl_pg-elastic-watch", daemon=True)
        self._thread.start()
        _open.add(self)

    def arm(self, pg: ProcessGroup, uuid: int) -> None:
        with self._cond:
            self._end_wait()
            self._target = (pg, uuid)
            self._cond.notify_all()

    def disarm(self) -> None:
        with self._cond:
            self._end_wait()
            self._target = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._end_wait()
            self._target = None
            self._cond.notify_all()
        _open.discard(self)

    def _end_wait(self) -> None:
        if self._parking is not None:
            self._parking.close()
            self._parking = None

    def _run(self) -> None:
        delay = 0.1
        while True:
            with self._cond:
                while self._target is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                target = self._target
                parking = self._parking = self.store.parking()
            assert target is not None
            pg, uuid = target
            try:
                parking.wait([config_key(uuid + 1)], PARK)
            except Unparked:
                continue
            except DistStoreError as exc:
                if not str(exc).startswith("timeout"):
                    log.warning("nccl_pg elastic: member %d: the record watch's store failed (%s); again in %.1f s",
                                self.member, exc, delay)
                    with self._cond:
                        self._cond.wait(delay)
                    delay = min(delay * 2, RETRY_CAP)
                continue
            delay = 0.1
            with self._cond:
                if self._target is not target:  # re-armed or disarmed meanwhile: that one is not ours to revoke
                    continue
                self._target = None
                self.fired.append(uuid + 1)
            log.warning("nccl_pg elastic: member %d: configuration %d was written; revoking the group of "
                        "configuration %d so that its members recover", self.member, uuid + 1, uuid)
            pg.revoke()


def _close_all() -> None:
    for watch in list(_open):
        watch.close()


atexit.register(_close_all)

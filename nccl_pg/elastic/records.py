"""The membership records of elastic recovery, in the job's store: who is in
each configuration, who came to it, who never will. Ranks and launchers read
and write them; nothing here talks to a communicator (docs/ELASTIC.md,
"The records").

Keys, under ``nccl_pg/elastic/``:

- ``config/<u>``: configuration u: its members (numbers), in the order of
  their ranks there, and why it was written. Written once (``compare_set``)
  by whoever makes the change: a launcher (its ranks died), a process coming
  in (a replacement, a new node's rank, a member left out while it was
  away), or a recovering member (to re-form a group that broke; to leave out
  the members that did not come).
- ``latest``: a hint of the newest u. Readers look past it (a ``check`` of
  the next record): a writer may die between its record and the hint, and
  two writers may set it out of order.
- ``<u>/slot/<i>``: the init handle of configuration u's i-th member, or a
  tombstone (``gone: <why>``) put there by whoever found that this member
  will never come (its launcher saw it die; the others waited for it a whole
  attempt). Each slot is decided once (``compare_set``), so a configuration
  is complete (every slot a handle) or dead (a tombstone in some slot) alike
  for everyone who reads it: nobody goes on with a configuration another
  gave up. Once every slot is decided, who came is known to all alike.
- ``<u>/evict/<k>``: the claim (``add``) on tombstoning u's empty slots
  after the k-th attempt that waited for them in vain: one claimer, not
  every waiter, writes them.
- ``members``: member numbers handed out after the first ones (``add``).
- ``finished``: the configuration and step at which the members' loop ended
  (the first to end writes it); each member that ends also marks itself gone
  (``finished``) in the newer configurations, so that a process coming in
  late learns it and ends too.
- ``stuck/count``, ``stuck/<n>``: reports of the ranks an operation's
  timeout named (the launchers' evidence for replacing a hung rank).

Every request is the store's, bounded by its timeout; a reader's waits are
parked on the server, bounded by the caller's deadline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DistBackendError
from ..group import handles
from ..store import Store

#: The store prefix of every membership record of an elastic job.
NAMESPACE = "nccl_pg/elastic"
#: The key that holds the newest configuration's number (the one a recovery goes to).
LATEST_KEY = f"{NAMESPACE}/latest"
MEMBERS_KEY = f"{NAMESPACE}/members"
STUCK_COUNT_KEY = f"{NAMESPACE}/stuck/count"
FINISHED_KEY = f"{NAMESPACE}/finished"
GONE = b"gone: "
FINISHED = "finished"  # the reason of a tombstone left by a member whose loop ended
# A death's record tombstones the dead members' slots in this many configurations before it: those that
# someone may still be waiting on (the ranks always go to the newest, so only a few recent ones).
HISTORY = 8
_MAX_RECORD = 1 << 20  # a record larger than this is not one of ours


def config_key(uuid: int) -> str:
    return f"{NAMESPACE}/config/{uuid}"


def slot_key(uuid: int, index: int) -> str:
    return f"{NAMESPACE}/{uuid}/slot/{index}"


def stuck_key(n: int) -> str:
    return f"{NAMESPACE}/stuck/{n}"


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


@dataclass(frozen=True)
class Config:
    """One membership record: the members of configuration ``uuid``, in the
    order of their ranks there, and why it was written."""

    uuid: int
    members: tuple[int, ...]
    why: str = ""

    def encode(self) -> bytes:
        return json.dumps({"uuid": self.uuid, "members": list(self.members), "why": self.why}).encode()

    @classmethod
    def decode(cls, raw: bytes, key: str = "a membership record") -> Config:
        """A record read from the store: anything else than what ``encode``
        writes is a ValueError naming the key."""
        try:
            d: Any = json.loads(raw) if len(raw) <= _MAX_RECORD else None
            members = d["members"]
            ok = (type(d["uuid"]) is int and isinstance(members, list)
                  and all(type(m) is int and m >= 0 for m in members)
                  and len(set(members)) == len(members) and isinstance(d.get("why", ""), str))
        except (ValueError, TypeError, KeyError):
            ok = False
        if not ok:
            raise ValueError(f"nccl_pg elastic: {key} holds {bytes(raw[:120])!r}, not a membership record "
                             "(JSON {\"uuid\": int, \"members\": [distinct ints >= 0], \"why\": str})")
        return cls(int(d["uuid"]), tuple(members), d.get("why", ""))

    def index(self, member: int) -> int:
        return self.members.index(member)


@dataclass(frozen=True)
class Slots:
    """What configuration ``config``'s slots hold once every one is decided:
    the handles of those who came, the tombstones of those who will not."""

    config: Config
    handles: dict[int, str]  # member -> its init handle
    gone: dict[int, str]  # member -> why

    @property
    def complete(self) -> bool:
        return not self.gone

    def came(self) -> list[int]:
        return [m for m in self.config.members if m in self.handles]


class Records:
    """The records in ``store`` (the job's), read and written as the module
    docstring says."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # --- reading ------------------------------------------------------------------------------------------

    def latest(self) -> int:
        """The newest configuration's uuid (the hint, then a look past it)."""
        raw = self.store.get(LATEST_KEY)
        try:
            uuid = int(raw)
        except ValueError:
            raise ValueError(f"nccl_pg elastic: {LATEST_KEY} holds {bytes(raw[:40])!r}, not a uuid") from None
        while self.store.check([config_key(uuid + 1)]):
            uuid += 1
        return uuid

    def read(self, uuid: int) -> Config:
        key = config_key(uuid)
        config = Config.decode(self.store.get(key), key)
        if config.uuid != uuid:
            raise ValueError(f"nccl_pg elastic: {key} holds the record of configuration {config.uuid}")
        return config

    def newest(self) -> Config:
        return self.read(self.latest())

    # --- writing ------------------------------------------------------------------------------------------

    def start(self, members: Sequence[int]) -> Config:
        """Record 0 (every launcher of a job writes the same; the first one in stays)."""
        config = Config(0, tuple(members), "start")
        got = self.store.compare_set(config_key(0), b"", config.encode())
        if got != config.encode():
            theirs = Config.decode(got, config_key(0))
            if theirs.members != config.members:
                raise ValueError(f"nccl_pg elastic: configuration 0 of this job has members {list(theirs.members)}, "
                                 f"not {list(members)}: another job uses the same store and name?")
        if not self.store.check([LATEST_KEY]):
            self.store.compare_set(LATEST_KEY, b"", b"0")
        return config

    def write_next(self, change: Callable[[Config], Sequence[int] | None], why: str,
                   deadline: float | None = None) -> Config | None:
        """Write the configuration after the newest: ``change(newest)``'s
        members (None: nothing to write, returns None). Another writer first:
        ``change`` is asked again about theirs."""
        while True:
            newest = self.newest()
            members = change(newest)
            if members is None:
                return None
            new = Config(newest.uuid + 1, tuple(members), why)
            if self.store.compare_set(config_key(new.uuid), b"", new.encode()) == new.encode():
                self.store.set(LATEST_KEY, str(new.uuid))
                return new
            if deadline is not None and time.monotonic() > deadline:
                raise DistBackendError(f"timeout: nccl_pg elastic: could not write configuration {new.uuid} "
                                       f"({why}): other writers kept coming first")

    def new_members(self, first: int, n: int) -> list[int]:
        """``n`` member numbers nobody had (from ``first``, the size of record 0, on)."""
        top = self.store.add(MEMBERS_KEY, n)
        return list(range(first + top - n, first + top))

    def tombstone(self, members: Sequence[int], why: str, upto: int) -> int:
        """Mark ``members`` gone in the configurations up to ``upto`` that
        hold them (the last HISTORY), where their slots are still empty.
        Returns how many slots it decided."""
        uuids = list(range(max(0, upto - HISTORY + 1), upto + 1))
        configs = [Config.decode(raw, config_key(u)) for u, raw in
                   zip(uuids, self.store.multi_get([config_key(u) for u in uuids]), strict=True)]
        tomb = GONE + why.encode()
        decided = 0
        for config in configs:
            for m in members:
                if m in config.members:
                    decided += self.store.compare_set(slot_key(config.uuid, config.index(m)), b"", tomb) == tomb
        return decided

    # --- the slots ----------------------------------------------------------------------------------------

    def offer(self, config: Config, member: int, handle: str) -> bool:
        """Put this member's handle in its slot; False when it was tombstoned first."""
        mine = handle.encode()
        return self.store.compare_set(slot_key(config.uuid, config.index(member)), b"", mine) == mine

    def collect(self, config: Config, deadline: float) -> Slots:
        """Every slot of ``config``, once each is decided (a parked wait, then
        one multi_get); DistStoreError at ``deadline``."""
        keys = [slot_key(config.uuid, i) for i in range(len(config.members))]
        self.store.wait(keys, _left(deadline))
        found, gone = {}, {}
        for key, member, raw in zip(keys, config.members, self.store.multi_get(keys), strict=True):
            if raw.startswith(GONE):
                gone[member] = raw[len(GONE):].decode(errors="replace")
            else:
                found[member] = _handle(raw, key, member)
        return Slots(config, found, gone)

    def evict(self, config: Config, round_: int, why: str) -> list[int] | None:
        """After this process's ``round_``-th wait for ``config``'s slots ran
        out: if it is the first to claim the round, tombstone the empty slots
        (the others' waits then end) and return whose they were; else None."""
        if self.store.add(f"{NAMESPACE}/{config.uuid}/evict/{round_}", 1) != 1:
            return None
        tomb = GONE + why.encode()
        return [m for i, m in enumerate(config.members)
                if self.store.compare_set(slot_key(config.uuid, i), b"", tomb) == tomb]

    def finish(self, member: int, uuid: int, step: int | None) -> None:
        """Member ``member``'s loop ended in configuration ``uuid``."""
        self.store.compare_set(FINISHED_KEY, b"", json.dumps({"uuid": uuid, "step": step, "member": member}))
        latest = self.latest()
        newer = list(range(uuid + 1, latest + 1))
        tomb = GONE + f"{FINISHED} (member {member}'s loop ended in configuration {uuid})".encode()
        for u, raw in zip(newer, self.store.multi_get([config_key(u) for u in newer]), strict=True):
            config = Config.decode(raw, config_key(u))
            if member in config.members:
                self.store.compare_set(slot_key(u, config.index(member)), b"", tomb)

    def finished(self) -> bool:
        return self.store.check([FINISHED_KEY])

    # --- hung ranks ---------------------------------------------------------------------------------------

    def report_stuck(self, report: dict[str, Any]) -> int:
        """Publish a report of ranks an operation's timeout named; its number."""
        n = self.store.add(STUCK_COUNT_KEY, 1)
        self.store.set(stuck_key(n), json.dumps(report))
        return n

    def read_stuck(self, n: int) -> dict[str, Any]:
        """Report ``n`` (it exists); a malformed one comes back as {"malformed": its first bytes, in hex}."""
        raw = self.store.get(stuck_key(n))
        try:
            report = json.loads(raw) if len(raw) <= _MAX_RECORD else None
        except ValueError:
            report = None
        return report if isinstance(report, dict) else {"malformed": bytes(raw[:200]).hex()}


def _handle(raw: bytes, key: str, member: int) -> str:
    """A slot's handle, checked: anything else is a ValueError naming the key and the member."""
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"nccl_pg elastic: member {member}'s init handle under {key} is not UTF-8 ({exc.reason} at "
                         f"byte {exc.start}): {bytes(raw[:80])!r}") from None
    try:
        handles.Handle.parse(text, f"member {member}'s init handle under {key}")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"nccl_pg elastic: {exc}") from None
    return text

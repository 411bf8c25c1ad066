"""What the diagnostics read of a process group, and the registry of live
groups they read it from.

This module sits below both the group layer and the diagnostics (flight
recorder, dumps, progress, diagnosis): a group builds its ``GroupView`` and
registers it here; diagnostics read views and never name the group. A view
holds no reference to its group (its callables go through a weak
reference), so that a group its user dropped can go.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from ..store import PrefixStore, Store


def root_of(store: Store) -> tuple[Store, str]:
    """The store under every PrefixStore layer, and the layers' prefixes
    joined (the group's namespace in it)."""
    prefixes: list[str] = []
    while isinstance(store, PrefixStore):
        prefixes.append(store.prefix)
        store = store.underlying_store
    return store, "/".join(reversed(prefixes))


@dataclass(frozen=True)
class InFlight:
    """An operation in flight, as dumps show it (``issued``: time.monotonic())."""

    op: str
    seq: int
    issued: float


@dataclass(frozen=True)
class Activity:
    """A group's counters and operations in flight at one moment (dumps)."""

    issued: int = 0
    started: int = 0
    completed: int = 0
    p2p_issued: int = 0
    pending: tuple[InFlight, ...] = ()
    failed: InFlight | None = None  # the last collective that failed (timed out, aborted), if none completed since


def _no_activity() -> Activity:
    return Activity()


def _no_device() -> str | None:
    return None


@dataclass(eq=False)
class GroupView:
    """What diagnostics read of a group. ``ident`` names the group the same
    way on every member (its namespace in the shared store and its name);
    ``counts`` returns (last collective issued, last completed, last
    point-to-point operation issued); ``state`` returns None while open,
    else "aborted", "revoked" or "destroyed"; ``activity`` the counters and
    pending operations for a dump; ``device`` the device its communicator
    is bound to, in words ("cuda:1"), None when there is none."""

    ident: str
    uid: int
    desc: str
    rank: int
    size: int
    root: Store
    global_rank: Callable[[int], int]
    counts: Callable[[], tuple[int, int, int]]
    state: Callable[[], str | None]
    name: str = "0"
    backend: str = ""
    activity: Callable[[], Activity] = field(default=_no_activity)
    device: Callable[[], str | None] = field(default=_no_device)

    @classmethod
    def of(cls, store: Store, name: str, uid: int, desc: str, rank: int, size: int,
           global_rank: Callable[[int], int], counts: Callable[[], tuple[int, int, int]],
           state: Callable[[], str | None], backend: str = "",
           activity: Callable[[], Activity] = _no_activity, device: Callable[[], str | None] = _no_device) -> GroupView:
        root, path = root_of(store)
        return cls(f"{path}|{name}", uid, desc, rank, size, root, global_rank, counts, state, name, backend, activity,
                   device)

    def name_of(self, r: int) -> str:
        """Group rank ``r`` in words ("1 (global 2)")."""
        g = self.global_rank(r)
        return f"{r}" if g == r else f"{r} (global {g})"

    def global_ranks(self) -> list[int]:
        """Group rank -> global rank, for every member."""
        return [self.global_rank(r) for r in range(self.size)]


# The live groups of this process, by the group object (weakly: the entry goes with its group), in the order
# they were made.
_live: weakref.WeakKeyDictionary[object, GroupView] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def register(group: object, view: GroupView) -> None:
    """``group`` is live; diagnostics read it through ``view``."""
    with _lock:
        _live[group] = view


def views() -> list[GroupView]:
    """The views of the groups alive now, oldest first."""
    with _lock:
        return list(_live.values())


def _forget_after_fork() -> None:
    global _live, _lock
    # A forked child's copies of its parent's groups are not its groups (it must not dump or diagnose them).
    _live, _lock = weakref.WeakKeyDictionary(), threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)

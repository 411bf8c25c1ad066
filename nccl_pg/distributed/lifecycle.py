"""Groups made and ended through the module API: ``init_process_group``
(the default group), ``new_group``, ``shrink_group``, and destroy, abort
and revoke; the default store and a group's timeout.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .. import env
from ..comm import backends
from ..group.options import DEFAULT_TIMEOUT, Options
from ..group.process_group import SHRINK_ABORT, SHRINK_DEFAULT, ProcessGroup
from ..store import PrefixStore, Store
from ..store.rendezvous import rendezvous
from ..timeouts import Timeout, to_seconds
from .world import NON_GROUP_MEMBER, Group, _get_default_group, current_world, ranks_of

log = logging.getLogger(__name__)


def is_nccl_available() -> bool:
    """Whether the NCCL backend can run here: the CUDA driver sees a GPU (asked without creating a context)."""
    return backends.gpu_count() > 0


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: Timeout | None = None, world_size: int = -1, rank: int = -1,
                       store: Store | None = None, group_name: str = "", pg_options: Options | None = None,
                       device_id: Any = None, group_desc: str | None = None) -> None:
    """Create the default group. Its communicator is created at the first
    collective, or now when ``device_id`` is given (eager init)."""
    w = current_world()
    if w.default_pg is not None:
        raise ValueError("trying to initialize the default process group twice!")
    env.validate_all()
    name = (backend or backends.default_backend_name()).lower()
    impl = backends.get_backend(name)
    if pg_options is not None and pg_options.timeout != DEFAULT_TIMEOUT.total_seconds():
        warnings.warn("pg_options._timeout was specified, but timeout kwarg has a default value that will "
                      "always override it.", UserWarning, stacklevel=2)
    limit = to_seconds(timeout) if timeout is not None else DEFAULT_TIMEOUT.total_seconds()
    if store is None:
        rdzv = rendezvous(init_method or "env://", rank=rank, world_size=world_size, timeout=limit)
        store, rank, world_size = rdzv.store, rdzv.rank, rdzv.world_size
    elif init_method is not None:
        raise ValueError("init_method and store are mutually exclusive")
    elif rank < 0 or world_size <= 0:
        raise ValueError(f"with store=, give rank and world_size (got rank={rank}, world_size={world_size})")
    options = replace(pg_options or Options(), timeout=limit)
    w.generation += 1
    w.store = PrefixStore(f"nccl_pg/{w.generation}", store)
    w.root_store, w.used_uuids, w.names_from = store, {0}, 0
    pg = ProcessGroup(w.store, rank, world_size, options, backend=impl, device_id=device_id,
                      group_name=group_name or "0", group_desc=group_desc or "default_pg", uid=0)
    w.default_pg, w.groups, w.group_count, w.local_sync_counts = pg, {pg: list(range(world_size))}, 1, {}
    w.eager = device_id is not None
    if w.eager:
        try:
            pg.eager_init()
        except BaseException:  # (as torch: a group that could not be created is not the default one)
            pg.shutdown(0)
            w.default_pg, w.groups, w.eager = None, {}, False
            raise
    else:
        pg.connect_now()  # where the backend connects at creation, as Gloo (the host backend)
    if env.DEBUG.get() != "off":
        log.info("rank %d: initialized the default group (%s, %d ranks, timeout %.0f s)", rank, name,
                 world_size, limit)


def destroy_process_group(group: Group = None) -> None:
    """Destroy one group, or with None/WORLD every group and the default one
    (subgroups first). Pending operations are flushed, bounded by each
    group's timeout, then aborted."""
    w = current_world()
    if group is NON_GROUP_MEMBER:
        return
    if group is None or group is w.default_pg:
        if w.default_pg is None:
            raise ValueError("destroy_process_group: the default process group is not initialized")
        for pg in sorted(w.groups, key=lambda g: -g.uid):
            pg.shutdown()
        w.default_pg, w.groups, w.eager = None, {}, False
        return
    if group not in w.groups:
        raise ValueError(f"destroy_process_group: {group!r} is not registered")
    assert isinstance(group, ProcessGroup)
    group.shutdown()
    del w.groups[group]


def abort_process_group(group: Group = None) -> None:
    """Abort one group, or with None every group of this process's world:
    pending and later operations fail with "aborted" at once (bounded, never
    waits for peers). Destroy them afterwards to free resources."""
    w = current_world()
    if group is NON_GROUP_MEMBER:
        return
    targets = list(w.groups) if group is None or group is w.default_pg else [group]
    for pg in targets:
        if isinstance(pg, ProcessGroup):
            pg.abort()


_abort_process_group = abort_process_group  # torch's private name


def revoke_process_group(group: Group = None) -> None:
    """Stop the group's in-flight operations (they fail, saying "revoked")
    without freeing its communicator, so that ``shrink_group`` can reuse it
    (ncclCommRevoke from NCCL 2.28.7; the host backend). Local and bounded."""
    pg = _get_default_group() if group is None else group
    if isinstance(pg, ProcessGroup):
        pg.revoke()


def shrink_group(ranks_to_exclude: list[int], group: Group = None, shrink_flags: int = SHRINK_DEFAULT,
                 pg_options: Options | None = None) -> ProcessGroup:
    """A new group of ``group``'s ranks minus ``ranks_to_exclude`` (ranks of
    ``group``), as torch's ``shrink_group``: only the remaining ranks call it,
    with the same list. ``SHRINK_ABORT`` first stops operations still in
    flight (recovery after a failure). The old group is destroyed; shrinking
    the default group also destroys every other group and renumbers the
    world (the new group becomes the default)."""
    w = current_world()
    target = _get_default_group() if group is None else group
    if not isinstance(target, ProcessGroup):
        raise ValueError("shrink_group: this rank is not in the group")
    if not isinstance(ranks_to_exclude, list):
        raise TypeError(f"ranks_to_exclude must be a list, but got {type(ranks_to_exclude).__name__}")
    if target.size() <= 1:
        raise ValueError(f"Cannot shrink a process group with size {target.size()}")
    is_default = target is w.default_pg
    old_ranks = ranks_of(target)
    excluded = target.check_shrink(ranks_to_exclude, shrink_flags)  # before a uid is taken
    uid = w.group_count
    w.group_count += 1
    remaining = [g for i, g in enumerate(old_ranks) if i not in excluded]
    new = target.shrink(excluded, shrink_flags == SHRINK_ABORT, pg_options,
                        group_name=f"{target.group_name}:shrunk",
                        group_desc="default:shrunk" if is_default else f"{target.group_desc}:shrunk", uid=uid,
                        global_ranks=None if is_default else remaining)
    if is_default:  # global ranks change: every other group's mapping is wrong now
        for pg in [g for g in w.groups if g is not target]:
            pg.abort()
            pg.shutdown()
        w.groups = {}
    if shrink_flags == SHRINK_ABORT or target.diag.state() is not None:
        target.abort()
    target.shutdown()
    w.groups.pop(target, None)
    if is_default:
        w.default_pg = new
        w.groups[new] = list(range(new.size()))
    else:
        w.groups[new] = remaining
    return new


def new_group(ranks: Sequence[int] | None = None, timeout: Timeout | None = None,
              backend: str | None = None, pg_options: Options | None = None,
              use_local_synchronization: bool = False,
              group_desc: str | None = None) -> Group:
    """A subgroup of the default group. Every rank calls it (with
    ``use_local_synchronization=True`` only the members need to; a non-member
    calling it gets None). With an eagerly initialized, blocking parent the
    communicator is split now; otherwise at first use."""
    w = current_world()
    parent = _get_default_group()
    n = parent.size()
    members = sorted(set(range(n) if ranks is None else (int(r) for r in ranks)))
    bad = [r for r in members if not 0 <= r < n]
    if bad:
        raise ValueError(f"new_group: ranks {bad} are outside the world of {n} ranks")
    if not members:
        raise ValueError("new_group: ranks must not be empty")
    me = parent.rank()
    if use_local_synchronization and me not in members:
        return None  # as torch: only the members synchronize, and a non-member gets no group at all
    if backend is not None and backend.lower() != parent.backend_name:
        raise ValueError(f"new_group: backend {backend!r} differs from the default group's "
                         f"{parent.backend_name!r}; one backend per job")
    uid = w.group_count
    w.group_count += 1
    if use_local_synchronization:
        key = tuple(members)
        count = w.local_sync_counts.get(key, 0)
        w.local_sync_counts[key] = count + 1
        name = f"local:{','.join(map(str, members))}:{count}"
    else:
        # Numbered among the groups every rank creates: local-sync groups (uids too, but only on their members)
        # must not shift it, or ranks would rendezvous under different names (as torch: they take no number).
        name = str(uid - w.names_from - sum(w.local_sync_counts.values()))
    options = replace(pg_options or parent.options,
                      timeout=to_seconds(timeout) if timeout is not None else parent.timeout.total_seconds())
    # A nonblocking parent splits at the subgroup's first use, as torch does (eager or not).
    split_now = w.eager and not use_local_synchronization and not parent.nonblocking
    child = parent.split_for(0 if me in members else None, me, options) if split_now else None
    if me not in members:
        return NON_GROUP_MEMBER
    assert w.store is not None
    # Without a split now, one at first use when every parent rank is here to take part in it.
    lazy_split = child is None and len(members) == n and not use_local_synchronization
    pg = ProcessGroup(w.store, members.index(me), len(members), options, backend=parent.comm_backend,
                      device_id=parent.bound_device_id, group_name=name, group_desc=group_desc or "undefined",
                      uid=uid, global_ranks=members, split_from=parent if lazy_split else None, comm=child)
    w.groups[pg] = members
    pg.connect_now()
    return pg


def _set_pg_timeout(timeout: Timeout, group: Group = None) -> None:
    """Set the timeout of ``group``'s future operations (the default group's if None), as torch's."""
    pg = _get_default_group() if group is None else group
    if isinstance(pg, ProcessGroup):
        pg._set_default_timeout(timeout)


def _get_process_group_uid(pg: ProcessGroup) -> int:
    """``pg``'s number, unique in this process (torch's private name)."""
    return pg.uid


def _get_default_store() -> Store:
    """The store of the default group (what ``init_process_group`` rendezvoused on)."""
    _get_default_group()
    store = current_world().store
    assert store is not None
    return store

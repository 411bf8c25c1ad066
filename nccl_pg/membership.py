"""``reconfigure`` and ``get_init_handle``: the module API of membership
changes, in torchcomms' shape (``reconfigure(uuid, init_handles, timeout)``,
``get_init_handle()``). The plan (who gets which rank) is group/handles.py's;
the stages (revoke, abortive shrink, grow) are ProcessGroup.reconfigure's;
here, the bookkeeping of this process's world: the default group, the other
groups (destroyed when the default group changes, as by ``shrink_group``),
the store the new groups use. docs/ELASTIC.md tells it all.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import env
from .comm import backends
from .distributed.world import Group, _get_default_group, current_world
from .errors import DistBackendError
from .group import handles
from .group.options import DEFAULT_TIMEOUT, Options
from .group.process_group import GroupSetup, ProcessGroup
from .store import PrefixStore, Store
from .timeouts import Timeout, to_seconds

log = logging.getLogger(__name__)


def get_init_handle(group: Group = None) -> str:
    """This process's init handle: where it stands (the default group's
    configuration and its rank there; with no default group, a process in
    no configuration, which ``reconfigure`` makes join). Give every process
    of the next configuration the handles of all of them."""
    w = current_world()
    if group is None and w.default_pg is None:
        return handles.handle_for(None, None)
    pg = _get_default_group() if group is None else group
    if not isinstance(pg, ProcessGroup):
        raise ValueError("get_init_handle: this rank is not in the group")
    return pg.get_init_handle()


def reconfigure(uuid: int, init_handles: Any, timeout: Timeout | None = None, group: Group = None, *,
                store: Store | None = None, backend: str | None = None, device_id: Any = None,
                pg_options: Options | None = None) -> ProcessGroup:
    """Make the default group (or ``group``) the configuration that
    ``init_handles`` name: every process of it calls this with the same
    ``uuid`` (never used before) and handles, within ``timeout`` (one
    deadline for the whole; default: the group's timeout). Members of the
    group keep their order (a shrink's numbering); processes from elsewhere
    take the ranks after theirs. Returns the new group, which becomes the
    default one when the default group changed (every other group is then
    destroyed, as by ``shrink_group``). A process with no default group
    joins: give it the job's ``store`` (and ``backend``, ``device_id``,
    ``pg_options`` as to ``init_process_group``); it gets a default group.
    Raises TypeError/ValueError for bad arguments before anything happens,
    DistBackendError when the change fails or its deadline passes."""
    w = current_world()
    uuid = handles.check_uuid(uuid)
    if uuid in w.used_uuids:
        raise ValueError(f"reconfigure: uuid {uuid} was used before in this process; each reconfigure takes a new "
                         "one")
    if group is None and w.default_pg is None:
        return _join(uuid, init_handles, timeout, store, backend, device_id, pg_options)
    target = _get_default_group() if group is None else group
    if not isinstance(target, ProcessGroup):
        raise ValueError("reconfigure: this rank is not in the group")
    if target not in w.groups:
        raise ValueError(f"reconfigure: {target!r} is not registered (destroyed, or replaced by an earlier "
                         "reconfigure or shrink)")
    if backend is not None or device_id is not None:
        raise ValueError("reconfigure: backend and device_id are for a process that joins (has no default group); "
                         "a member keeps its group's")
    is_default = target is w.default_pg
    plan = handles.make_plan(uuid, init_handles, target.get_init_handle(), target.size())  # bad input: raise now
    old_ranks = w.groups[target]
    if not is_default and plan.joiners:
        raise ValueError("reconfigure: new processes join the default group only; a subgroup can lose ranks")
    ranks = None if is_default else [old_ranks[r] for r in plan.survivors]
    meet = store or (w.root_store if is_default else None)
    try:
        new = target.reconfigure(uuid, init_handles, timeout, store=meet, options=pg_options,
                                 group_desc="default_pg" if is_default else target.group_desc, uid=w.group_count,
                                 global_ranks=ranks)
    except DistBackendError:
        if is_default:
            _leave_all()
        else:
            w.groups.pop(target, None)
        raise
    w.used_uuids.add(uuid)
    if new is target:
        return new
    w.group_count += 1
    if is_default:
        _install_default(new, meet)
    else:
        w.groups.pop(target, None)
        w.groups[new] = ranks or []
    log.info("rank %d: reconfigured to uuid %d: %d ranks", new.rank(), uuid, new.size())
    return new


def job_store() -> Store:
    """The store the default group rendezvoused on (not its prefixed view):
    where ``reconfigure`` meets new processes."""
    _get_default_group()
    store = current_world().root_store
    assert store is not None
    return store


def _leave_all() -> None:
    """After a failed reconfigure: this process is in no group any more (its
    handle becomes a new process's, which the next reconfigure takes in)."""
    w = current_world()
    for pg in list(w.groups):
        pg.abort()
        pg.shutdown(0)
    w.default_pg, w.groups, w.eager = None, {}, False


def _install_default(new: ProcessGroup, meet: Store | None) -> None:
    """``new`` becomes the default group; every other group goes (their
    global ranks are wrong now)."""
    w = current_world()
    for pg in [g for g in w.groups if g is not new]:
        pg.abort()
        pg.shutdown(0)
    w.default_pg, w.groups = new, {new: list(range(new.size()))}
    if meet is not None:
        w.store = PrefixStore(f"nccl_pg/u{new.uuid}", meet)
    w.names_from, w.local_sync_counts = w.group_count - 1, {}


def _join(uuid: int, init_handles: Any, timeout: Timeout | None, store: Store | None, backend: str | None,
          device_id: Any, pg_options: Options | None) -> ProcessGroup:
    """A process with no default group joins the configuration."""
    w = current_world()
    if store is None:
        raise ValueError("reconfigure: this process has no default group; pass the job's store= to join one")
    env.validate_all()
    impl = backends.get_backend((backend or backends.default_backend_name()).lower())
    limit = to_seconds(timeout) if timeout is not None else DEFAULT_TIMEOUT.total_seconds()
    options = pg_options or Options(timeout=limit)
    plan = handles.make_plan(uuid, init_handles, handles.handle_for(None, None), None)
    setup = GroupSetup(options, "default_pg", w.group_count, None)
    new = ProcessGroup.join(plan, store, time.monotonic() + limit, impl, device_id, setup)
    w.group_count += 1
    w.root_store, w.eager = store, device_id is not None
    w.used_uuids.add(uuid)
    _install_default(new, store)
    return new

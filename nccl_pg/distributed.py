"""The module-level API, mirroring torch.distributed: the default group,
subgroups, and collectives taking ``group=`` and ``async_op=``.

Ranks given to these functions (``src``, ``dst``, ``peer``) are global ranks
as in torch; the ``group_src``/``group_dst``/``group_peer`` forms take ranks
within the group. State lives in a World: one per process, or one per thread
under the thread-per-rank test harness (nccl_pg.testing).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, overload

from . import env
from .arrays import Array
from .comm import backends
from .group.options import DEFAULT_TIMEOUT, Options
from .group.process_group import SHRINK_ABORT, SHRINK_DEFAULT, ProcessGroup
from .group.work import OpType, Work
from .reduce_op import ReduceOp
from .store import PrefixStore, Store
from .store.rendezvous import rendezvous
from .timeouts import Timeout, to_seconds

log = logging.getLogger(__name__)


class _NonGroupMember:
    """What ``new_group`` returns on a rank outside the group."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


NON_GROUP_MEMBER = _NonGroupMember()
Group = ProcessGroup | _NonGroupMember | None


@dataclass
class _World:
    default_pg: ProcessGroup | None = None
    store: Store | None = None
    groups: dict[ProcessGroup, list[int]] = field(default_factory=dict)  # group -> global ranks
    group_count: int = 0
    generation: int = 0  # inits so far; keeps a re-init's store keys apart from the last one's
    eager: bool = False
    local_sync_counts: dict[tuple[int, ...], int] = field(default_factory=dict)
    root_store: Store | None = None  # the store the job rendezvoused on (reconfigure meets new processes there)
    used_uuids: set[int] = field(default_factory=set)  # configurations this process has been in (reconfigure)
    names_from: int = 0  # new_group numbers its groups from here: 0, or the uid a reconfigure reached


class _ThreadWorld(threading.local):
    world: _World | None = None  # a class default: reading it never raises (getattr's miss costs ~0.4 µs per op)


_global_world = _World()
_tls = _ThreadWorld()


def _world() -> _World:
    return _tls.world or _global_world


def _set_thread_world(world: _World | None) -> None:
    """Give the calling thread its own World (thread-per-rank tests)."""
    _tls.world = world


class _WorldMeta(type):
    @property
    def WORLD(cls) -> ProcessGroup | None:
        return _world().default_pg


class GroupMember(metaclass=_WorldMeta):
    """``GroupMember.WORLD`` is the default group; ``NON_GROUP_MEMBER`` marks
    a group this rank is not in."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


class group(metaclass=_WorldMeta):  # noqa: N801 - torch's name
    """``group.WORLD``: the default process group."""


# --- initialization -------------------------------------------------------------------------

def is_initialized() -> bool:
    return _world().default_pg is not None


def is_nccl_available() -> bool:
    return backends.gpu_count() > 0


def _get_default_group() -> ProcessGroup:
    pg = _world().default_pg
    if pg is None:
        raise ValueError("Default process group has not been initialized, please make sure to call "
                         "init_process_group.")
    return pg


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: Timeout | None = None, world_size: int = -1, rank: int = -1,
                       store: Store | None = None, group_name: str = "", pg_options: Options | None = None,
                       device_id: Any = None, group_desc: str | None = None) -> None:
    """Create the default group. Its communicator is created at the first
    collective, or now when ``device_id`` is given (eager init)."""
    w = _world()
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
        pg.eager_init()
    if env.DEBUG.get() != "off":
        log.info("rank %d: initialized the default group (%s, %d ranks, timeout %.0f s)", rank, name,
                 world_size, limit)


def destroy_process_group(group: Group = None) -> None:
    """Destroy one group, or with None/WORLD every group and the default one
    (subgroups first). Pending operations are flushed, bounded by each
    group's timeout, then aborted."""
    w = _world()
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
    w = _world()
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
    w = _world()
    target = _get_default_group() if group is None else group
    if not isinstance(target, ProcessGroup):
        raise ValueError("shrink_group: this rank is not in the group")
    if not isinstance(ranks_to_exclude, list):
        raise TypeError(f"ranks_to_exclude must be a list, but got {type(ranks_to_exclude).__name__}")
    if target.size() <= 1:
        raise ValueError(f"Cannot shrink a process group with size {target.size()}")
    is_default = target is w.default_pg
    old_ranks = _ranks_of(target)
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
              group_desc: str | None = None) -> ProcessGroup | _NonGroupMember | None:
    """A subgroup of the default group. Every rank calls it (with
    ``use_local_synchronization=True`` only the members need to; a non-member
    calling it gets None). With an eagerly initialized, blocking parent the
    communicator is split now; otherwise at first use."""
    w = _world()
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
    return pg


def _set_pg_timeout(timeout: Timeout, group: Group = None) -> None:
    pg = _get_default_group() if group is None else group
    if isinstance(pg, ProcessGroup):
        pg._set_default_timeout(timeout)


def _get_process_group_uid(pg: ProcessGroup) -> int:
    return pg.uid


def _get_default_store() -> Store:
    """The store of the default group (what ``init_process_group`` rendezvoused on)."""
    _get_default_group()
    store = _world().store
    assert store is not None
    return store


# --- ranks ------------------------------------------------------------------------------------

def _ranks_of(group: ProcessGroup) -> list[int]:
    ranks = _world().groups.get(group)
    if ranks is None:
        raise ValueError(f"Group {group!r} is not registered, please create group with nccl_pg.new_group")
    return ranks


def get_rank(group: Group = None) -> int:
    """This process's rank in ``group`` (the default group if None); -1 when
    not a member."""
    if group is NON_GROUP_MEMBER:
        return -1
    pg = _get_default_group() if group is None else group
    assert isinstance(pg, ProcessGroup)
    return pg.rank()


def get_world_size(group: Group = None) -> int:
    if group is NON_GROUP_MEMBER:
        return -1
    pg = _get_default_group() if group is None else group
    assert isinstance(pg, ProcessGroup)
    return pg.size()


def get_backend(group: Group = None) -> str:
    pg = _get_default_group() if group is None else group
    if not isinstance(pg, ProcessGroup):
        raise ValueError("get_backend: this rank is not in the group")
    return pg.backend_name


def get_process_group_ranks(group: ProcessGroup) -> list[int]:
    return list(_ranks_of(group))


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    ranks = _ranks_of(group)
    if global_rank not in ranks:
        raise ValueError(f"Global rank {global_rank} is not part of group {group!r}")
    return ranks.index(global_rank)


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    ranks = _ranks_of(group)
    if not 0 <= group_rank < len(ranks):
        raise ValueError(f"Group rank {group_rank} is not part of group {group!r} (size {len(ranks)})")
    return ranks[group_rank]


def _resolve(group: Group, op_name: str) -> ProcessGroup | None:
    """The group to run on, or None (with a warning) on a non-member."""
    if group is None:
        pg = _world().default_pg
        if pg is not None:
            return pg
    if group is NON_GROUP_MEMBER:
        default = _world().default_pg
        me = default.rank() if default is not None else -1
        warnings.warn(f"Running {op_name} on global rank {me} which does not belong to the given group.",
                      UserWarning, stacklevel=3)
        return None
    if group is None:
        return _get_default_group()
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"{op_name}: group must be a ProcessGroup, got {type(group).__name__}")
    return group


def _in_group(pg: ProcessGroup, global_rank: int | None, group_rank: int | None, what: str) -> int:
    """A peer/root as a group rank, from exactly one of the two forms."""
    if (global_rank is None) == (group_rank is None):
        if global_rank is None and group_rank is None:
            return 0  # torch's default root: rank 0 of the group
        raise ValueError(f"{what}: give either the global rank or the group rank, not both")
    if group_rank is not None:
        return int(group_rank)
    ranks = _world().groups.get(pg)
    if ranks is None:  # a group made directly (ProcessGroupHost(...)): its ranks are the global ones
        return int(global_rank)  # type: ignore[arg-type]
    if global_rank not in ranks:
        raise ValueError(f"{what}: global rank {global_rank} is not part of group {pg!r} (ranks {ranks})")
    return ranks.index(global_rank)


def _global(pg: ProcessGroup, group_rank: int) -> int:
    ranks = _world().groups.get(pg)
    return group_rank if ranks is None else ranks[group_rank]


def _finish(work: Work | None, async_op: bool) -> Work | None:
    if work is None:
        return None  # inside a coalescing manager: its Work covers this op
    if async_op:
        return work
    work.wait()
    return None


# --- collectives ------------------------------------------------------------------------------

@overload
def all_reduce(tensor: Array, op: Any = ReduceOp.SUM, group: Group = None, async_op: Literal[False] = False) -> None: ...


@overload
def all_reduce(tensor: Array, op: Any = ReduceOp.SUM, group: Group = None, async_op: bool = False) -> Work | None: ...


def all_reduce(tensor: Array, op: Any = ReduceOp.SUM, group: Group = None, async_op: bool = False) -> Work | None:
    pg = _resolve(group, "all_reduce")
    return None if pg is None else _finish(pg.allreduce(tensor, op), async_op)


@overload
def all_reduce_coalesced(tensors: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                         async_op: Literal[False] = False) -> None: ...


@overload
def all_reduce_coalesced(tensors: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                         async_op: bool = False) -> Work | None: ...


def all_reduce_coalesced(tensors: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                         async_op: bool = False) -> Work | None:
    pg = _resolve(group, "all_reduce_coalesced")
    return None if pg is None else _finish(pg.allreduce_coalesced(list(tensors), op), async_op)


@overload
def broadcast(tensor: Array, src: int | None = None, group: Group = None, async_op: Literal[False] = False,
              group_src: int | None = None) -> None: ...


@overload
def broadcast(tensor: Array, src: int | None = None, group: Group = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None: ...


def broadcast(tensor: Array, src: int | None = None, group: Group = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    pg = _resolve(group, "broadcast")
    if pg is None:
        return None
    return _finish(pg.broadcast(tensor, _in_group(pg, src, group_src, "broadcast src")), async_op)


@overload
def reduce(tensor: Array, dst: int | None = None, op: Any = ReduceOp.SUM, group: Group = None,
           async_op: Literal[False] = False, group_dst: int | None = None) -> None: ...


@overload
def reduce(tensor: Array, dst: int | None = None, op: Any = ReduceOp.SUM, group: Group = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None: ...


def reduce(tensor: Array, dst: int | None = None, op: Any = ReduceOp.SUM, group: Group = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    pg = _resolve(group, "reduce")
    if pg is None:
        return None
    return _finish(pg.reduce(tensor, _in_group(pg, dst, group_dst, "reduce dst"), op), async_op)


@overload
def all_gather(tensor_list: Sequence[Array], tensor: Array, group: Group = None, async_op: Literal[False] = False) -> None: ...


@overload
def all_gather(tensor_list: Sequence[Array], tensor: Array, group: Group = None, async_op: bool = False) -> Work | None: ...


def all_gather(tensor_list: Sequence[Array], tensor: Array, group: Group = None, async_op: bool = False) -> Work | None:
    pg = _resolve(group, "all_gather")
    return None if pg is None else _finish(pg.allgather(tensor_list, tensor), async_op)


@overload
def all_gather_into_tensor(output_tensor: Array, input_tensor: Array, group: Group = None,
                           async_op: Literal[False] = False) -> None: ...


@overload
def all_gather_into_tensor(output_tensor: Array, input_tensor: Array, group: Group = None,
                           async_op: bool = False) -> Work | None: ...


def all_gather_into_tensor(output_tensor: Array, input_tensor: Array, group: Group = None,
                           async_op: bool = False) -> Work | None:
    pg = _resolve(group, "all_gather_into_tensor")
    return None if pg is None else _finish(pg._allgather_base(output_tensor, input_tensor), async_op)


@overload
def reduce_scatter(output: Array, input_list: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                   async_op: Literal[False] = False) -> None: ...


@overload
def reduce_scatter(output: Array, input_list: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                   async_op: bool = False) -> Work | None: ...


def reduce_scatter(output: Array, input_list: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                   async_op: bool = False) -> Work | None:
    pg = _resolve(group, "reduce_scatter")
    return None if pg is None else _finish(pg.reduce_scatter(output, input_list, op), async_op)


@overload
def reduce_scatter_tensor(output: Array, input: Array, op: Any = ReduceOp.SUM, group: Group = None,
                          async_op: Literal[False] = False) -> None: ...


@overload
def reduce_scatter_tensor(output: Array, input: Array, op: Any = ReduceOp.SUM, group: Group = None,
                          async_op: bool = False) -> Work | None: ...


def reduce_scatter_tensor(output: Array, input: Array, op: Any = ReduceOp.SUM, group: Group = None,
                          async_op: bool = False) -> Work | None:
    pg = _resolve(group, "reduce_scatter_tensor")
    return None if pg is None else _finish(pg._reduce_scatter_base(output, input, op), async_op)


@overload
def all_to_all(output_tensor_list: Sequence[Array], input_tensor_list: Sequence[Array], group: Group = None,
               async_op: Literal[False] = False) -> None: ...


@overload
def all_to_all(output_tensor_list: Sequence[Array], input_tensor_list: Sequence[Array], group: Group = None,
               async_op: bool = False) -> Work | None: ...


def all_to_all(output_tensor_list: Sequence[Array], input_tensor_list: Sequence[Array], group: Group = None,
               async_op: bool = False) -> Work | None:
    pg = _resolve(group, "all_to_all")
    return None if pg is None else _finish(pg.alltoall(output_tensor_list, input_tensor_list), async_op)


@overload
def all_to_all_single(output: Array, input: Array, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: Group = None,
                      async_op: Literal[False] = False) -> None: ...


@overload
def all_to_all_single(output: Array, input: Array, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: Group = None,
                      async_op: bool = False) -> Work | None: ...


def all_to_all_single(output: Array, input: Array, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: Group = None,
                      async_op: bool = False) -> Work | None:
    """Split sizes count rows (the first dimension), as in torch."""
    pg = _resolve(group, "all_to_all_single")
    if pg is None:
        return None
    return _finish(pg.alltoall_base(output, input, output_split_sizes, input_split_sizes), async_op)


@overload
def gather(tensor: Array, gather_list: Sequence[Array] | None = None, dst: int | None = None, group: Group = None,
           async_op: Literal[False] = False, group_dst: int | None = None) -> None: ...


@overload
def gather(tensor: Array, gather_list: Sequence[Array] | None = None, dst: int | None = None, group: Group = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None: ...


def gather(tensor: Array, gather_list: Sequence[Array] | None = None, dst: int | None = None, group: Group = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    pg = _resolve(group, "gather")
    if pg is None:
        return None
    return _finish(pg.gather(tensor, gather_list, _in_group(pg, dst, group_dst, "gather dst")), async_op)


@overload
def scatter(tensor: Array, scatter_list: Sequence[Array] | None = None, src: int | None = None, group: Group = None,
            async_op: Literal[False] = False, group_src: int | None = None) -> None: ...


@overload
def scatter(tensor: Array, scatter_list: Sequence[Array] | None = None, src: int | None = None, group: Group = None,
            async_op: bool = False, group_src: int | None = None) -> Work | None: ...


def scatter(tensor: Array, scatter_list: Sequence[Array] | None = None, src: int | None = None, group: Group = None,
            async_op: bool = False, group_src: int | None = None) -> Work | None:
    pg = _resolve(group, "scatter")
    if pg is None:
        return None
    return _finish(pg.scatter(tensor, scatter_list, _in_group(pg, src, group_src, "scatter src")), async_op)


def isend(tensor: Any, dst: int | None = None, group: Group = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    pg = _resolve(group, "isend")
    if pg is None:
        return None
    if dst is None and group_dst is None:
        raise ValueError("isend: give dst (global rank) or group_dst")
    return pg.send(tensor, _in_group(pg, dst, group_dst, "send dst"), tag)


def irecv(tensor: Any, src: int | None = None, group: Group = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    pg = _resolve(group, "irecv")
    if pg is None:
        return None
    if src is None and group_src is None:  # any source: the host backend (work.source_rank() names it)
        return pg.recv_anysource(tensor, tag)
    return pg.recv(tensor, _in_group(pg, src, group_src, "recv src"), tag)


def send(tensor: Any, dst: int | None = None, group: Group = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    _finish(isend(tensor, dst, group, tag, group_dst), async_op=False)


def recv(tensor: Any, src: int | None = None, group: Group = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Returns the sender's global rank (-1 on a non-member). Without
    ``src``/``group_src``: from any source (host backend; NCCL has none)."""
    pg = _resolve(group, "recv")
    if pg is None:
        return -1
    if (src, group_src) == (None, None):
        work = pg.recv_anysource(tensor, tag)
        work.wait()
        return _global(pg, work.source_rank())
    peer = _in_group(pg, src, group_src, "recv src")
    _finish(pg.recv(tensor, peer, tag), async_op=False)
    return _global(pg, peer)


@dataclass
class P2POp:
    """One point-to-point operation for ``batch_isend_irecv``: ``op`` is
    ``isend`` or ``irecv``."""

    op: Callable[..., Work | None]
    tensor: Any
    peer: int | None = None
    group: Group = None
    tag: int = 0
    group_peer: int | None = None

    def __post_init__(self) -> None:
        if self.op not in (isend, irecv):
            raise ValueError("P2POp.op must be nccl_pg.isend or nccl_pg.irecv")
        if (self.peer is None) == (self.group_peer is None):
            raise ValueError("P2POp: give exactly one of peer and group_peer")


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Issue the sends and receives as one group (no deadlock for paired
    operations); returns the Works to wait on."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("batch_isend_irecv needs a non-empty list of P2POp")
    groups = {id(p.group) for p in p2p_op_list}
    if len(groups) != 1:
        raise ValueError("batch_isend_irecv: all operations must use the same group")
    with _coalescing_manager(p2p_op_list[0].group, async_ops=True) as cm:
        pg = p2p_op_list[0].group or _get_default_group()
        if isinstance(pg, ProcessGroup):  # NCCL_PG_NAN_CHECK=raise: every send checked before any is issued
            pg.check_up_front(OpType.SEND, [(f"p2p_op_list[{i}].tensor", p.tensor)
                                             for i, p in enumerate(p2p_op_list) if p.op is isend])
        for p in p2p_op_list:
            if p.op is isend:
                isend(p.tensor, p.peer, p.group, p.tag, group_dst=p.group_peer)
            else:
                irecv(p.tensor, p.peer, p.group, p.tag, group_src=p.group_peer)
    return cm.works


@overload
def barrier(group: Group = None, async_op: Literal[False] = False, device_ids: Sequence[int] | None = None) -> None: ...


@overload
def barrier(group: Group = None, async_op: bool = False, device_ids: Sequence[int] | None = None) -> Work | None: ...


def barrier(group: Group = None, async_op: bool = False, device_ids: Sequence[int] | None = None) -> Work | None:
    if device_ids is not None and not (isinstance(device_ids, (list, tuple))
                                       and all(isinstance(d, int) for d in device_ids)):
        raise TypeError("Invalid function argument: device_ids type should be List[int]")
    pg = _resolve(group, "barrier")
    return None if pg is None else _finish(pg.barrier(), async_op)


def monitored_barrier(group: Group = None, timeout: Timeout | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive, as torch's: rank 0
    waits ``timeout`` (default: the group's timeout) and raises naming the
    first missing rank, or every missing one with ``wait_all_ranks``; the
    others raise too, with rank 0's verdict. Over the group's store (a
    constant number of requests per rank), so a stuck communicator cannot
    hold it up. A no-op on a rank outside ``group`` (with a warning)."""
    pg = _resolve(group, "monitored_barrier")
    if pg is not None:
        pg.monitored_barrier(timeout, wait_all_ranks)


class _CoalescingManager:
    def __init__(self) -> None:
        self.works: list[Work] = []

    def append(self, work: Work) -> None:
        self.works.append(work)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


@contextlib.contextmanager
def _coalescing_manager(group: Group = None, device: Any = None,
                        async_ops: bool = False) -> Iterator[_CoalescingManager]:
    """Operations on ``group`` issued inside run as one group with one Work
    (``cm.works``); with ``async_ops=False`` it is waited on at exit."""
    cm = _CoalescingManager()
    pg = _resolve(group, "coalescing manager")
    if pg is None:
        yield cm
        return
    pg._start_coalescing()
    try:
        yield cm
    except BaseException:
        pg.abandon_coalescing()
        raise
    work = pg._end_coalescing()
    if async_ops:
        cm.append(work)
    else:
        work.wait()

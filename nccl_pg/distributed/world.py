"""This process's World (one per process, or one per thread under the
thread-per-rank test harness, nccl_pg.testing): the default group and the
registered groups with their global ranks; how a module-level call finds its
group (``resolve``) and maps global ranks onto group ranks and back.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field

from ..group.process_group import ProcessGroup
from ..store import Store


class _NonGroupMember:
    """What ``new_group`` returns on a rank outside the group."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


NON_GROUP_MEMBER = _NonGroupMember()
Group = ProcessGroup | _NonGroupMember | None


@dataclass
class World:
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
    world: World | None = None  # a class default: reading it never raises (getattr's miss costs ~0.4 µs per op)


_global_world = World()
_tls = _ThreadWorld()


def current_world() -> World:
    return _tls.world or _global_world


def set_thread_world(world: World | None) -> None:
    """Give the calling thread its own World (thread-per-rank tests)."""
    _tls.world = world


class _WorldMeta(type):
    @property
    def WORLD(cls) -> ProcessGroup | None:
        return current_world().default_pg


class GroupMember(metaclass=_WorldMeta):
    """``GroupMember.WORLD`` is the default group; ``NON_GROUP_MEMBER`` marks
    a group this rank is not in."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


class group(metaclass=_WorldMeta):  # noqa: N801 - torch's name
    """``group.WORLD``: the default process group."""


def is_initialized() -> bool:
    """Whether this process (or thread rank) has a default group."""
    return current_world().default_pg is not None


def _get_default_group() -> ProcessGroup:
    """The default group (torch's private name, which libraries call); ValueError when there is none."""
    pg = current_world().default_pg
    if pg is None:
        raise ValueError("Default process group has not been initialized, please make sure to call "
                         "init_process_group.")
    return pg


# --- ranks ------------------------------------------------------------------------------------

def ranks_of(group: ProcessGroup) -> list[int]:
    ranks = current_world().groups.get(group)
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
    """The number of ranks in ``group`` (the default group if None); -1 when not a member."""
    if group is NON_GROUP_MEMBER:
        return -1
    pg = _get_default_group() if group is None else group
    assert isinstance(pg, ProcessGroup)
    return pg.size()


def get_backend(group: Group = None) -> str:
    """The name of ``group``'s backend (the default group's if None), e.g. "host" or "nccl"."""
    pg = _get_default_group() if group is None else group
    if not isinstance(pg, ProcessGroup):
        raise ValueError("get_backend: this rank is not in the group")
    return pg.backend_name


def get_process_group_ranks(group: ProcessGroup) -> list[int]:
    """The global ranks of ``group``'s members, in group rank order."""
    return list(ranks_of(group))


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """``global_rank``'s rank in ``group``; ValueError when it is not a member."""
    ranks = ranks_of(group)
    if global_rank not in ranks:
        raise ValueError(f"Global rank {global_rank} is not part of group {group!r}")
    return ranks.index(global_rank)


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank``."""
    ranks = ranks_of(group)
    if not 0 <= group_rank < len(ranks):
        raise ValueError(f"Group rank {group_rank} is not part of group {group!r} (size {len(ranks)})")
    return ranks[group_rank]


def resolve(group: Group, op_name: str) -> ProcessGroup | None:
    """The group to run on, or None (with a warning) on a non-member."""
    if group is None:
        pg = (_tls.world or _global_world).default_pg  # current_world() inline: every operation asks
        if pg is not None:
            return pg
    if group is NON_GROUP_MEMBER:
        default = current_world().default_pg
        me = default.rank() if default is not None else -1
        warnings.warn(f"Running {op_name} on global rank {me} which does not belong to the given group.",
                      UserWarning, stacklevel=3)
        return None
    if group is None:
        return _get_default_group()
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"{op_name}: group must be a ProcessGroup, got {type(group).__name__}")
    return group


def group_rank_of(pg: ProcessGroup, global_rank: int | None, group_rank: int | None, what: str) -> int:
    """A peer/root as a group rank, from exactly one of the two forms."""
    if (global_rank is None) == (group_rank is None):
        if global_rank is None and group_rank is None:
            return 0  # torch's default root: rank 0 of the group
        raise ValueError(f"{what}: give either the global rank or the group rank, not both")
    if group_rank is not None:
        return int(group_rank)
    ranks = current_world().groups.get(pg)
    if ranks is None:  # a group made directly (ProcessGroupHost(...)): its ranks are the global ones
        return int(global_rank)  # type: ignore[arg-type]
    if global_rank not in ranks:
        raise ValueError(f"{what}: global rank {global_rank} is not part of group {pg!r} (ranks {ranks})")
    return ranks.index(global_rank)


def global_rank_of(pg: ProcessGroup, group_rank: int) -> int:
    """A group rank as a global rank (the same for a group made directly, unregistered)."""
    ranks = current_world().groups.get(pg)
    return group_rank if ranks is None else ranks[group_rank]

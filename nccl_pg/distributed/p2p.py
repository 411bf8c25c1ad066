"""Point-to-point operations of the module API (``send``/``recv``,
``isend``/``irecv``, ``batch_isend_irecv``) and the coalescing manager that
issues several operations as one group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..group.process_group import ProcessGroup
from ..group.work import OpType, Work
from .collectives import finish
from .world import Group, _get_default_group, global_rank_of, group_rank_of, resolve


def isend(tensor: Any, dst: int | None = None, group: Group = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Send ``tensor`` to rank ``dst`` (a global rank; ``group_dst``: in ``group``) without waiting: the
    Work completes when it is sent (None on a non-member)."""
    pg = resolve(group, "isend")
    if pg is None:
        return None
    if dst is None and group_dst is None:
        raise ValueError("isend: give dst (global rank) or group_dst")
    return pg.send(tensor, group_rank_of(pg, dst, group_dst, "send dst"), tag)


def irecv(tensor: Any, src: int | None = None, group: Group = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    """Receive into ``tensor`` from rank ``src`` (a global rank; ``group_src``: in ``group``; neither:
    from any rank, host backend only) without waiting: the Work completes when it has arrived."""
    pg = resolve(group, "irecv")
    if pg is None:
        return None
    if src is None and group_src is None:  # any source: the host backend (work.source_rank() names it)
        return pg.recv_anysource(tensor, tag)
    return pg.recv(tensor, group_rank_of(pg, src, group_src, "recv src"), tag)


def send(tensor: Any, dst: int | None = None, group: Group = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to rank ``dst`` (a global rank; ``group_dst``: in ``group``) and wait until it is sent."""
    finish(isend(tensor, dst, group, tag, group_dst), async_op=False)


def recv(tensor: Any, src: int | None = None, group: Group = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Returns the sender's global rank (-1 on a non-member). Without
    ``src``/``group_src``: from any source (host backend; NCCL has none)."""
    pg = resolve(group, "recv")
    if pg is None:
        return -1
    if (src, group_src) == (None, None):
        work = pg.recv_anysource(tensor, tag)
        work.wait()
        return global_rank_of(pg, work.source_rank())
    peer = group_rank_of(pg, src, group_src, "recv src")
    finish(pg.recv(tensor, peer, tag), async_op=False)
    return global_rank_of(pg, peer)


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
    pg = resolve(group, "coalescing manager")
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

"""The module-level API, mirroring torch.distributed: the default group,
subgroups, and collectives taking ``group=`` and ``async_op=``.

Ranks given to these functions (``src``, ``dst``, ``peer``) are global ranks
as in torch; the ``group_src``/``group_dst``/``group_peer`` forms take ranks
within the group. State lives in a World: one per process, or one per thread
under the thread-per-rank test harness (nccl_pg.testing).

By responsibility: ``world.py`` (the World, the default group, ranks, which
group a call runs on), ``lifecycle.py`` (init, new_group, shrink_group,
destroy, abort, revoke), ``collectives.py`` (the collectives and barriers),
``p2p.py`` (point-to-point and the coalescing manager). The names below are
the API (``nccl_pg.distributed.all_reduce``, ...; ``nccl_pg`` exports them
too).
"""

from __future__ import annotations

from .collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from .lifecycle import (
    _abort_process_group,
    _get_default_store,
    _get_process_group_uid,
    _set_pg_timeout,
    abort_process_group,
    destroy_process_group,
    init_process_group,
    is_nccl_available,
    new_group,
    revoke_process_group,
    shrink_group,
)
from .p2p import P2POp, _coalescing_manager, batch_isend_irecv, irecv, isend, recv, send
from .world import (
    NON_GROUP_MEMBER,
    Group,
    GroupMember,
    _get_default_group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    is_initialized,
)

__all__ = [
    "NON_GROUP_MEMBER",
    "Group",
    "GroupMember",
    "P2POp",
    "_abort_process_group",
    "_coalescing_manager",
    "_get_default_group",
    "_get_default_store",
    "_get_process_group_uid",
    "_set_pg_timeout",
    "abort_process_group",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "destroy_process_group",
    "gather",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_initialized",
    "is_nccl_available",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "revoke_process_group",
    "scatter",
    "send",
    "shrink_group",
]

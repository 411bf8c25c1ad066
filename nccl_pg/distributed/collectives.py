"""The collectives of the module API, as torch.distributed's: ``group=``
(the default group if None), global ranks for ``src``/``dst`` (or group
ranks as ``group_src``/``group_dst``), ``async_op=`` (a Work to wait on, or
wait now); and the barriers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

from ..arrays import Array
from ..group.work import Work
from ..reduce_op import ReduceOp
from ..timeouts import Timeout
from .world import Group, group_rank_of, resolve


def finish(work: Work | None, async_op: bool) -> Work | None:
    """What a call returns: the Work with ``async_op``, else None once it is waited on."""
    if work is None:
        return None  # inside a coalescing manager: its Work covers this op
    if async_op:
        return work
    work.wait()
    return None


@overload
def all_reduce(tensor: Array, op: Any = ReduceOp.SUM, group: Group = None, async_op: Literal[False] = False) -> None: ...


@overload
def all_reduce(tensor: Array, op: Any = ReduceOp.SUM, group: Group = None, async_op: bool = False) -> Work | None: ...


def all_reduce(tensor: Array, op: Any = ReduceOp.SUM, group: Group = None, async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` over the ranks of ``group`` with ``op``, in place: every rank ends with the result."""
    pg = resolve(group, "all_reduce")
    return None if pg is None else finish(pg.allreduce(tensor, op), async_op)


@overload
def all_reduce_coalesced(tensors: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                         async_op: Literal[False] = False) -> None: ...


@overload
def all_reduce_coalesced(tensors: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                         async_op: bool = False) -> Work | None: ...


def all_reduce_coalesced(tensors: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                         async_op: bool = False) -> Work | None:
    """``all_reduce`` of several arrays, issued as one operation (one Work for all)."""
    pg = resolve(group, "all_reduce_coalesced")
    return None if pg is None else finish(pg.allreduce_coalesced(list(tensors), op), async_op)


@overload
def broadcast(tensor: Array, src: int | None = None, group: Group = None, async_op: Literal[False] = False,
              group_src: int | None = None) -> None: ...


@overload
def broadcast(tensor: Array, src: int | None = None, group: Group = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None: ...


def broadcast(tensor: Array, src: int | None = None, group: Group = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    """Copy rank ``src``'s ``tensor`` (a global rank; ``group_src``: its rank in ``group``) into ``tensor``
    on every other rank of the group."""
    pg = resolve(group, "broadcast")
    if pg is None:
        return None
    return finish(pg.broadcast(tensor, group_rank_of(pg, src, group_src, "broadcast src")), async_op)


@overload
def reduce(tensor: Array, dst: int | None = None, op: Any = ReduceOp.SUM, group: Group = None,
           async_op: Literal[False] = False, group_dst: int | None = None) -> None: ...


@overload
def reduce(tensor: Array, dst: int | None = None, op: Any = ReduceOp.SUM, group: Group = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None: ...


def reduce(tensor: Array, dst: int | None = None, op: Any = ReduceOp.SUM, group: Group = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` over the group with ``op`` into rank ``dst``'s ``tensor`` (a global rank;
    ``group_dst``: its rank in ``group``); only that rank gets the result."""
    pg = resolve(group, "reduce")
    if pg is None:
        return None
    return finish(pg.reduce(tensor, group_rank_of(pg, dst, group_dst, "reduce dst"), op), async_op)


@overload
def all_gather(tensor_list: Sequence[Array], tensor: Array, group: Group = None, async_op: Literal[False] = False) -> None: ...


@overload
def all_gather(tensor_list: Sequence[Array], tensor: Array, group: Group = None, async_op: bool = False) -> Work | None: ...


def all_gather(tensor_list: Sequence[Array], tensor: Array, group: Group = None, async_op: bool = False) -> Work | None:
    """Every rank's ``tensor`` into ``tensor_list`` (one array per rank of the group, in rank order), on
    every rank."""
    pg = resolve(group, "all_gather")
    return None if pg is None else finish(pg.allgather(tensor_list, tensor), async_op)


@overload
def all_gather_into_tensor(output_tensor: Array, input_tensor: Array, group: Group = None,
                           async_op: Literal[False] = False) -> None: ...


@overload
def all_gather_into_tensor(output_tensor: Array, input_tensor: Array, group: Group = None,
                           async_op: bool = False) -> Work | None: ...


def all_gather_into_tensor(output_tensor: Array, input_tensor: Array, group: Group = None,
                           async_op: bool = False) -> Work | None:
    """Every rank's ``input_tensor`` into ``output_tensor`` (group size times as large: the inputs
    one after the other in rank order), on every rank."""
    pg = resolve(group, "all_gather_into_tensor")
    return None if pg is None else finish(pg._allgather_base(output_tensor, input_tensor), async_op)


@overload
def reduce_scatter(output: Array, input_list: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                   async_op: Literal[False] = False) -> None: ...


@overload
def reduce_scatter(output: Array, input_list: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                   async_op: bool = False) -> Work | None: ...


def reduce_scatter(output: Array, input_list: Sequence[Array], op: Any = ReduceOp.SUM, group: Group = None,
                   async_op: bool = False) -> Work | None:
    """Reduce ``input_list`` (one array per rank of the group) over the group with ``op``: group rank i
    gets the reduction of every rank's ``input_list[i]`` in ``output``."""
    pg = resolve(group, "reduce_scatter")
    return None if pg is None else finish(pg.reduce_scatter(output, input_list, op), async_op)


@overload
def reduce_scatter_tensor(output: Array, input: Array, op: Any = ReduceOp.SUM, group: Group = None,
                          async_op: Literal[False] = False) -> None: ...


@overload
def reduce_scatter_tensor(output: Array, input: Array, op: Any = ReduceOp.SUM, group: Group = None,
                          async_op: bool = False) -> Work | None: ...


def reduce_scatter_tensor(output: Array, input: Array, op: Any = ReduceOp.SUM, group: Group = None,
                          async_op: bool = False) -> Work | None:
    """Reduce ``input`` (group size times the size of ``output``) over the group with ``op``: group
    rank i gets the reduction of every rank's i-th slice in ``output``."""
    pg = resolve(group, "reduce_scatter_tensor")
    return None if pg is None else finish(pg._reduce_scatter_base(output, input, op), async_op)


@overload
def all_to_all(output_tensor_list: Sequence[Array], input_tensor_list: Sequence[Array], group: Group = None,
               async_op: Literal[False] = False) -> None: ...


@overload
def all_to_all(output_tensor_list: Sequence[Array], input_tensor_list: Sequence[Array], group: Group = None,
               async_op: bool = False) -> Work | None: ...


def all_to_all(output_tensor_list: Sequence[Array], input_tensor_list: Sequence[Array], group: Group = None,
               async_op: bool = False) -> Work | None:
    """Each rank sends ``input_tensor_list[j]`` to group rank j and receives group rank j's in
    ``output_tensor_list[j]``."""
    pg = resolve(group, "all_to_all")
    return None if pg is None else finish(pg.alltoall(output_tensor_list, input_tensor_list), async_op)


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
    """``all_to_all`` on one array each way: ``input``'s parts (equal, or ``input_split_sizes``) go to
    the group's ranks in order, and ``output`` receives theirs (``output_split_sizes``). Split sizes count rows
    (the first dimension), as in torch."""
    pg = resolve(group, "all_to_all_single")
    if pg is None:
        return None
    return finish(pg.alltoall_base(output, input, output_split_sizes, input_split_sizes), async_op)


@overload
def gather(tensor: Array, gather_list: Sequence[Array] | None = None, dst: int | None = None, group: Group = None,
           async_op: Literal[False] = False, group_dst: int | None = None) -> None: ...


@overload
def gather(tensor: Array, gather_list: Sequence[Array] | None = None, dst: int | None = None, group: Group = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None: ...


def gather(tensor: Array, gather_list: Sequence[Array] | None = None, dst: int | None = None, group: Group = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Every rank's ``tensor`` into ``gather_list`` (one array per rank of the group, in rank order) on
    rank ``dst`` (a global rank; ``group_dst``: in ``group``); the others pass no list."""
    pg = resolve(group, "gather")
    if pg is None:
        return None
    return finish(pg.gather(tensor, gather_list, group_rank_of(pg, dst, group_dst, "gather dst")), async_op)


@overload
def scatter(tensor: Array, scatter_list: Sequence[Array] | None = None, src: int | None = None, group: Group = None,
            async_op: Literal[False] = False, group_src: int | None = None) -> None: ...


@overload
def scatter(tensor: Array, scatter_list: Sequence[Array] | None = None, src: int | None = None, group: Group = None,
            async_op: bool = False, group_src: int | None = None) -> Work | None: ...


def scatter(tensor: Array, scatter_list: Sequence[Array] | None = None, src: int | None = None, group: Group = None,
            async_op: bool = False, group_src: int | None = None) -> Work | None:
    """Rank ``src`` (a global rank; ``group_src``: in ``group``) sends ``scatter_list[i]`` to group rank i,
    which receives it in ``tensor``; the others pass no list."""
    pg = resolve(group, "scatter")
    if pg is None:
        return None
    return finish(pg.scatter(tensor, scatter_list, group_rank_of(pg, src, group_src, "scatter src")), async_op)


@overload
def barrier(group: Group = None, async_op: Literal[False] = False, device_ids: Sequence[int] | None = None) -> None: ...


@overload
def barrier(group: Group = None, async_op: bool = False, device_ids: Sequence[int] | None = None) -> Work | None: ...


def barrier(group: Group = None, async_op: bool = False, device_ids: Sequence[int] | None = None) -> Work | None:
    """Complete once every rank of the group has entered it. ``device_ids`` is checked (a list of
    ints, as torch requires) and otherwise unused."""
    if device_ids is not None and not (isinstance(device_ids, (list, tuple))
                                       and all(isinstance(d, int) for d in device_ids)):
        raise TypeError("Invalid function argument: device_ids type should be List[int]")
    pg = resolve(group, "barrier")
    return None if pg is None else finish(pg.barrier(), async_op)


def monitored_barrier(group: Group = None, timeout: Timeout | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive, as torch's: rank 0
    waits ``timeout`` (default: the group's timeout) and raises naming the
    first missing rank, or every missing one with ``wait_all_ranks``; the
    others raise too, with rank 0's verdict. Over the group's store (a
    constant number of requests per rank), so a stuck communicator cannot
    hold it up. A no-op on a rank outside ``group`` (with a warning)."""
    pg = resolve(group, "monitored_barrier")
    if pg is not None:
        pg.monitored_barrier(timeout, wait_all_ranks)

"""Simulated ``nccl.bindings.nccl`` (nccl4py 0.6.0's low-level binding) for
CI without a GPU: it proves nccl_pg's logic against NCCL's documented and
implemented behaviour, never GPU behaviour.

Types and checks are the real binding's: ``Comm``, ``UniqueId``, ``Config``,
``NCCLError``, ``Result`` are nccl4py's own classes, every function has the
real one's parameters, and arguments convert as the real Cython code converts
them (checks.py), so an int where a ``Comm`` belongs raises the real
``TypeError: Cannot convert int to nccl.bindings.nccl.Comm``. ``ncclInProgress``
is not raised, as the binding's ``check_status`` lets it through.

This module is the binding's surface (``module()``, the functions named as
nccl4py names them, ``install()``, ``world()``); the behaviour is in
nccl_state.py (communicators, shared resources, thread safety, configuration),
nccl_groups.py (groups, enqueue, launches), nccl_kernels.py (the device side)
nccl_lifecycle.py (init, split, shrink, finalize, destroy, abort, revoke),
nccl_grow.py (ncclCommGetUniqueId, ncclCommGrow), nccl_collconfig.py (the
nccl*Config entry points) and nccl_suspend.py (suspend, resume, memory
statistics). It is NCCL 2.32.3 (``SIM_VERSION``). Every rule cites what it
follows: NCCL's sources at the tag it was read at (v2.30.7-1 for ``src/init.cc``,
``group.cc``, ``enqueue.cc``, ``nccl.h.in``, ``argcheck.cc``, ``bootstrap.cc``,
their init.cc functions unchanged at v2.31.2-1; v2.31.2-1 and v2.32.3-1 for
what 2.31 and 2.32 added) or the user guide (``docs/userguide/source/usage/*.rst``);
the table in docs/NCCL_BACKEND.md lists them with that tag.
"""

from __future__ import annotations

import ctypes
import inspect
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from . import checks, cuda_state, nccl_collconfig, nccl_grow, nccl_lifecycle, nccl_state, nccl_suspend
from .nccl_groups import enqueue
from .nccl_groups import group_end as _group_end
from .nccl_groups import group_start as _group_start
from .nccl_kernels import Task
from .nccl_state import (
    DTYPES,
    IN_PROGRESS,
    INTERNAL,
    INVALID_ARGUMENT,
    INVALID_USAGE,
    NOCOLOR,
    NUM_OPS,
    REMOTE,
    SHRINK_ABORT,
    SUCCESS,
    SYSTEM,
    UNDEF,
    UNHANDLED_CUDA,
    Call,
    Comm,
    Config,
    NCCLError,
    Result,
    UniqueId,
    World,
    ensure_ready,
    enter,
    find_comm,
    live_comm,
    raise_,
    real,
    world,
)

__all__ = ["IN_PROGRESS", "INTERNAL", "INVALID_ARGUMENT", "INVALID_USAGE", "NOCOLOR", "NUM_OPS", "REMOTE",
           "SHRINK_ABORT", "SUCCESS", "SYSTEM", "UNDEF", "UNHANDLED_CUDA", "Comm", "Config", "NCCLError", "Result",
           "UniqueId", "World", "install", "module", "uninstall", "world"]


def __getattr__(name: str) -> Any:  # noqa: N807 - PEP 562: ``ncclsim.WORLD`` is the state's current one
    if name == "WORLD":
        return nccl_state.WORLD
    raise AttributeError(name)


def _coll(kind: str, nccl_name: str, send: int, recv: int, count: int, dtype: int, op: int, root: int,
          comm: Any, stream: int, peer: int = -1, config: int = 0) -> None:
    w = world()
    cfg = nccl_collconfig.parse(config, w.version)  # collectives.cc: ncclParseCollConfig before ncclEnqueueCheck
    enqueue(w, nccl_name, comm, Task(kind, nccl_name, send, recv, count, dtype, op, root, peer, stream, cfg))


def _note(w: World, call: str, comm: Any, **details: Any) -> None:
    """A communicator lifecycle call, in the order made (simnccl.call_log())."""
    w.log.append((call, {"comm": int(comm.handle), **details}))


# The binding's functions (parameter names as in nccl4py 0.6.0; checked in module()).

def all_reduce(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, op: Any, comm: Any, stream: Any) -> Any:
    _, a = enter("ncclAllReduce", "all_reduce", (sendbuff, recvbuff, count, datatype, op, comm, stream))
    _coll("all_reduce", "ncclAllReduce", a[0], a[1], a[2], a[3], a[4], 0, comm, a[6])


def reduce(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, op: Any, root: Any, comm: Any, stream: Any) -> Any:
    _, a = enter("ncclReduce", "reduce", (sendbuff, recvbuff, count, datatype, op, root, comm, stream))
    _coll("reduce", "ncclReduce", a[0], a[1], a[2], a[3], a[4], a[5], comm, a[7])


def broadcast(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, root: Any, comm: Any, stream: Any) -> Any:
    _, a = enter("ncclBroadcast", "broadcast", (sendbuff, recvbuff, count, datatype, root, comm, stream))
    _coll("broadcast", "ncclBroadcast", a[0], a[1], a[2], a[3], 0, a[4], comm, a[6])


def all_gather(sendbuff: Any, recvbuff: Any, sendcount: Any, datatype: Any, comm: Any, stream: Any) -> Any:
    _, a = enter("ncclAllGather", "all_gather", (sendbuff, recvbuff, sendcount, datatype, comm, stream))
    _coll("all_gather", "ncclAllGather", a[0], a[1], a[2], a[3], 0, 0, comm, a[5])


def reduce_scatter(sendbuff: Any, recvbuff: Any, recvcount: Any, datatype: Any, op: Any, comm: Any, stream: Any) -> Any:
    _, a = enter("ncclReduceScatter", "reduce_scatter", (sendbuff, recvbuff, recvcount, datatype, op, comm, stream))
    _coll("reduce_scatter", "ncclReduceScatter", a[0], a[1], a[2], a[3], a[4], 0, comm, a[6])


def allto_all(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, comm: Any, stream: Any) -> Any:
    _, a = enter("ncclAlltoAll", "allto_all", (sendbuff, recvbuff, count, datatype, comm, stream))
    _coll("allto_all", "ncclAlltoAll", a[0], a[1], a[2], a[3], 0, 0, comm, a[5])


def gather(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, root: Any, comm: Any, stream: Any) -> Any:
    _, a = enter("ncclGather", "gather", (sendbuff, recvbuff, count, datatype, root, comm, stream))
    _coll("gather", "ncclGather", a[0], a[1], a[2], a[3], 0, a[4], comm, a[6])


def scatter(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, root: Any, comm: Any, stream: Any) -> Any:
    _, a = enter("ncclScatter", "scatter", (sendbuff, recvbuff, count, datatype, root, comm, stream))
    _coll("scatter", "ncclScatter", a[0], a[1], a[2], a[3], 0, a[4], comm, a[6])


# The nccl*Config entry points (v2.31.2-1): the same collectives with a trailing ncclCollConfig_t*.

def all_reduce_config(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, op: Any, comm: Any, stream: Any,
                      config: Any) -> Any:
    _, a = enter("ncclAllReduceConfig", "all_reduce_config", (sendbuff, recvbuff, count, datatype, op, comm, stream,
                                                              config))
    _coll("all_reduce", "ncclAllReduceConfig", a[0], a[1], a[2], a[3], a[4], 0, comm, a[6], config=a[7])


def reduce_config(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, op: Any, root: Any, comm: Any,
                  stream: Any, config: Any) -> Any:
    _, a = enter("ncclReduceConfig", "reduce_config", (sendbuff, recvbuff, count, datatype, op, root, comm, stream,
                                                       config))
    _coll("reduce", "ncclReduceConfig", a[0], a[1], a[2], a[3], a[4], a[5], comm, a[7], config=a[8])


def broadcast_config(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, root: Any, comm: Any, stream: Any,
                     config: Any) -> Any:
    _, a = enter("ncclBroadcastConfig", "broadcast_config", (sendbuff, recvbuff, count, datatype, root, comm, stream,
                                                             config))
    _coll("broadcast", "ncclBroadcastConfig", a[0], a[1], a[2], a[3], 0, a[4], comm, a[6], config=a[7])


def all_gather_config(sendbuff: Any, recvbuff: Any, sendcount: Any, datatype: Any, comm: Any, stream: Any,
                      config: Any) -> Any:
    _, a = enter("ncclAllGatherConfig", "all_gather_config", (sendbuff, recvbuff, sendcount, datatype, comm, stream,
                                                              config))
    _coll("all_gather", "ncclAllGatherConfig", a[0], a[1], a[2], a[3], 0, 0, comm, a[5], config=a[6])


def reduce_scatter_config(sendbuff: Any, recvbuff: Any, recvcount: Any, datatype: Any, op: Any, comm: Any,
                          stream: Any, config: Any) -> Any:
    _, a = enter("ncclReduceScatterConfig", "reduce_scatter_config", (sendbuff, recvbuff, recvcount, datatype, op,
                                                                      comm, stream, config))
    _coll("reduce_scatter", "ncclReduceScatterConfig", a[0], a[1], a[2], a[3], a[4], 0, comm, a[6], config=a[7])


def allto_all_config(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, comm: Any, stream: Any,
                     config: Any) -> Any:
    _, a = enter("ncclAlltoAllConfig", "allto_all_config", (sendbuff, recvbuff, count, datatype, comm, stream,
                                                            config))
    _coll("allto_all", "ncclAlltoAllConfig", a[0], a[1], a[2], a[3], 0, 0, comm, a[5], config=a[6])


def gather_config(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, root: Any, comm: Any, stream: Any,
                  config: Any) -> Any:
    _, a = enter("ncclGatherConfig", "gather_config", (sendbuff, recvbuff, count, datatype, root, comm, stream,
                                                       config))
    _coll("gather", "ncclGatherConfig", a[0], a[1], a[2], a[3], 0, a[4], comm, a[6], config=a[7])


def scatter_config(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, root: Any, comm: Any, stream: Any,
                   config: Any) -> Any:
    _, a = enter("ncclScatterConfig", "scatter_config", (sendbuff, recvbuff, count, datatype, root, comm, stream,
                                                         config))
    _coll("scatter", "ncclScatterConfig", a[0], a[1], a[2], a[3], 0, a[4], comm, a[6], config=a[7])


def send(sendbuff: Any, count: Any, datatype: Any, peer: Any, comm: Any, stream: Any) -> Any:
    _, a = enter("ncclSend", "send", (sendbuff, count, datatype, peer, comm, stream))
    _coll("send", "ncclSend", a[0], 0, a[1], a[2], 0, 0, comm, a[5], peer=a[3])


def recv(recvbuff: Any, count: Any, datatype: Any, peer: Any, comm: Any, stream: Any) -> Any:
    _, a = enter("ncclRecv", "recv", (recvbuff, count, datatype, peer, comm, stream))
    _coll("recv", "ncclRecv", 0, a[0], a[1], a[2], 0, 0, comm, a[5], peer=a[3])


def group_start() -> Any:
    w, _ = enter("ncclGroupStart", "group_start", ())
    _group_start(w)


def group_end() -> Any:
    w, _ = enter("ncclGroupEnd", "group_end", ())
    raise_(_group_end(w))


# --- version, ids, errors -----------------------------------------------------------------------------------

def get_version() -> Any:
    w, _ = enter("ncclGetVersion", "get_version", ())
    return w.version


def get_error_string(result: Any) -> Any:
    enter("ncclGetErrorString", "get_error_string", (result,))
    return real.get_error_string(result)


def get_unique_id() -> Any:
    w, _ = enter("ncclGetUniqueId", "get_unique_id", ())
    return nccl_lifecycle.new_unique_id(w)


# --- communicators -------------------------------------------------------------------------------------------

def comm_init_rank_config(nranks: Any, comm_id: Any, rank: Any, config: Any) -> Any:
    w, a = enter("ncclCommInitRankConfig", "comm_init_rank_config", (nranks, comm_id, rank, config))
    comm = nccl_lifecycle.init(w, "ncclCommInitRankConfig", a[0], a[2], [nccl_lifecycle.id_bytes(a[1], 1)], a[3])
    _note(w, "ncclCommInitRankConfig", comm, nranks=a[0], rank=a[2])
    return comm


def comm_init_rank_scalable(nranks: Any, myrank: Any, n_id: Any, comm_ids: Any, config: Any) -> Any:
    w, a = enter("ncclCommInitRankScalable", "comm_init_rank_scalable", (nranks, myrank, n_id, comm_ids, config))
    raw = nccl_lifecycle.id_bytes(a[3], a[2])
    ids = [raw[i * 128:(i + 1) * 128] for i in range(a[2])]
    comm = nccl_lifecycle.init(w, "ncclCommInitRankScalable", a[0], a[1], ids, a[4])
    _note(w, "ncclCommInitRankScalable", comm, nranks=a[0], rank=a[1])
    return comm


def comm_split(comm: Any, color: Any, key: Any, config: Any) -> Any:
    w, a = enter("ncclCommSplit", "comm_split", (comm, color, key, config))
    _note(w, "ncclCommSplit", comm, color=a[1])
    return nccl_lifecycle.child(w, "ncclCommSplit", comm, a[3], a[1], a[2], None, 0)


def comm_shrink(comm: Any, exclude_ranks_list: Any, exclude_ranks_count: Any, config: Any, shrink_flags: Any) -> Any:
    w, a = enter("ncclCommShrink", "comm_shrink", (comm, exclude_ranks_list, exclude_ranks_count, config, shrink_flags))
    excl = a[1]
    if isinstance(excl, int):
        excl = list(np.frombuffer(ctypes.string_at(excl, 4 * a[2]), np.int32)) if a[2] else []
    exclude = sorted(int(x) for x in excl[:a[2]])
    _note(w, "ncclCommShrink", comm, flags=a[4], exclude=exclude)
    return nccl_lifecycle.child(w, "ncclCommShrink", comm, a[3], 0, 0, exclude, a[4])


def comm_get_unique_id(comm: Any) -> Any:
    w, _ = enter("ncclCommGetUniqueId", "comm_get_unique_id", (comm,))
    return nccl_grow.get_unique_id(w, comm)


def comm_grow(comm: Any, n_ranks: Any, unique_id: Any, rank: Any, config: Any) -> Any:
    w, a = enter("ncclCommGrow", "comm_grow", (comm, n_ranks, unique_id, rank, config))
    return nccl_grow.grow(w, comm, a[1], a[2], a[3], a[4])


def comm_get_async_error(comm: Any) -> Any:
    w, _ = enter("ncclCommGetAsyncError", "comm_get_async_error", (comm,))
    c = live_comm(w, comm, "ncclCommGetAsyncError")
    with Call(w, "ncclCommGetAsyncError", c):
        return nccl_state.async_error(c)


def comm_user_rank(comm: Any) -> Any:
    w, _ = enter("ncclCommUserRank", "comm_user_rank", (comm,))
    c = live_comm(w, comm, "ncclCommUserRank")
    with Call(w, "ncclCommUserRank", c):
        raise_(ensure_ready(c))
        return c.rank


def comm_count(comm: Any) -> Any:
    w, _ = enter("ncclCommCount", "comm_count", (comm,))
    c = live_comm(w, comm, "ncclCommCount")
    with Call(w, "ncclCommCount", c):
        raise_(ensure_ready(c))
        return c.nranks


def comm_finalize(comm: Any) -> Any:
    w, _ = enter("ncclCommFinalize", "comm_finalize", (comm,))
    _note(w, "ncclCommFinalize", comm)
    nccl_lifecycle.finalize(w, comm)


def comm_destroy(comm: Any) -> Any:
    w, _ = enter("ncclCommDestroy", "comm_destroy", (comm,))
    _note(w, "ncclCommDestroy", comm)
    nccl_lifecycle.destroy(w, comm)


def comm_abort(comm: Any) -> Any:
    w, _ = enter("ncclCommAbort", "comm_abort", (comm,))
    _note(w, "ncclCommAbort", comm)
    nccl_lifecycle.abort(w, comm)


def comm_revoke(comm: Any, revoke_flags: Any) -> Any:
    w, a = enter("ncclCommRevoke", "comm_revoke", (comm, revoke_flags))
    _note(w, "ncclCommRevoke", comm)
    c = find_comm(w, comm, "ncclCommRevoke")
    if c is None:
        return None  # NULL comm: success
    nccl_lifecycle.revoke(w, c, a[1])


def comm_suspend(comm: Any, flags: Any) -> Any:
    w, a = enter("ncclCommSuspend", "comm_suspend", (comm, flags))
    _note(w, "ncclCommSuspend", comm, flags=a[1])
    nccl_suspend.suspend(w, comm, a[1])


def comm_resume(comm: Any) -> Any:
    w, _ = enter("ncclCommResume", "comm_resume", (comm,))
    _note(w, "ncclCommResume", comm)
    nccl_suspend.resume(w, comm)


def comm_mem_stats(comm: Any, stat: Any) -> Any:
    w, a = enter("ncclCommMemStats", "comm_mem_stats", (comm, stat))
    return nccl_suspend.mem_stats(w, comm, a[1])


# --- user reduction ops (enqueue.cc) -------------------------------------------------------------------------

def red_op_create_pre_mul_sum(scalar: Any, datatype: Any, residence: Any, comm: Any) -> Any:
    w, a = enter("ncclRedOpCreatePreMulSum", "red_op_create_pre_mul_sum", (scalar, datatype, residence, comm))
    c = live_comm(w, comm, "ncclRedOpCreatePreMulSum")
    with Call(w, "ncclRedOpCreatePreMulSum", c):
        raise_(ensure_ready(c))
        if a[1] not in DTYPES:
            raise_(INTERNAL)
        dt = DTYPES[a[1]]
        if a[2] == 1:  # ncclScalarHostImmediate: the value is copied now
            value: Any = np.frombuffer(ctypes.string_at(a[0], dt.itemsize), dt)[0]
            entry = (a[1], value, False)
        else:  # ncclScalarDevice: a pointer read by the kernel
            entry = (a[1], a[0], True)
        c.op_slots += 1
        op = NUM_OPS + (c.handle >> 8) % 64 * 4096 + c.op_slots  # ncclUserRedOpMangle: tied to this comm
        c.user_ops[op] = entry
        return op


def red_op_destroy(op: Any, comm: Any) -> Any:
    w, a = enter("ncclRedOpDestroy", "red_op_destroy", (op, comm))
    if 0 <= a[0] < NUM_OPS:  # "operator is a NCCL builtin"
        raise_(INVALID_ARGUMENT)
    c = live_comm(w, comm, "ncclRedOpDestroy")
    with Call(w, "ncclRedOpDestroy", c):
        if c.user_ops.pop(a[0], None) is None:  # "operator unknown to this communicator"
            raise_(INVALID_ARGUMENT)


_FUNCTIONS: list[Callable[..., Any]] = [
    all_reduce, reduce, broadcast, all_gather, reduce_scatter, allto_all, gather, scatter, send, recv, group_start,
    group_end, get_version, get_error_string, get_unique_id, comm_init_rank_config, comm_init_rank_scalable,
    comm_split, comm_shrink, comm_get_unique_id, comm_grow, comm_get_async_error, comm_user_rank, comm_count, comm_finalize, comm_destroy,
    comm_abort, comm_revoke, red_op_create_pre_mul_sum, red_op_destroy, all_reduce_config, reduce_config,
    broadcast_config, all_gather_config, reduce_scatter_config, allto_all_config, gather_config, scatter_config,
    comm_suspend, comm_resume, comm_mem_stats]


def module() -> types.ModuleType:
    """The simulated ``nccl.bindings.nccl``: these functions (their parameter
    names checked against the real binding's), the real classes and enums."""
    mod = types.ModuleType("simnccl.nccl", "simulated nccl.bindings.nccl (tests/simnccl)")
    for fn in _FUNCTIONS:
        real_fn = getattr(real, fn.__name__)
        mine = list(inspect.signature(fn).parameters)
        theirs = [p for _, p in checks.real_params(fn.__name__)]
        if mine != theirs:
            raise cuda_state.SimError(f"simulated {fn.__name__}{tuple(mine)} does not match nccl4py's "
                                      f"{real_fn.__doc__.splitlines()[0]}")
        setattr(mod, fn.__name__, fn)

    def __getattr__(attr: str) -> Any:  # noqa: N807 - PEP 562
        value = getattr(real, attr)
        if callable(value) and not isinstance(value, type):
            raise cuda_state.SimError(f"nccl.bindings.nccl.{attr} is not simulated (tests/simnccl/ncclsim.py)")
        return value

    setattr(mod, "__getattr__", __getattr__)  # noqa: B010 - PEP 562 on a module object
    return mod


def install(version: int, violations: cuda_state.Violations) -> World:
    if nccl_state.WORLD is not None:
        nccl_state.WORLD.net.close()
    w = nccl_state.WORLD = World(version, violations)
    s = cuda_state.sim()
    s.checks.append(w.group_violations)
    s.resets.append(w.reset_groups)
    return w


def uninstall() -> None:
    if nccl_state.WORLD is not None:
        nccl_state.WORLD.net.close()
    nccl_state.WORLD = None

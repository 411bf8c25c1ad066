"""NCCL's C ABI onto the simulation: the handlers behind the stub
libnccl.so.2 (stub/libnccl_stub.c, loaded by stublib.py).

The real nccl4py binding converts its arguments and calls the C function;
each handler here gets the raw C arguments (pointers as ints, the unique id's
bytes through a pointer, the ncclConfig_t pointer), calls the simulation's
nccl4py-shaped function (``ncclsim.module()``, the only way in), and answers
as NCCL does: a ncclResult_t (an NCCLError from the simulation becomes its
code) and the out-parameters written. Whatever else the simulation raises (the
FunctionNotFoundError of a function the simulated version lacks, a refusal)
is raised by nccl4py in its caller. This proves the binding layer's logic,
never GPU behaviour.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

import nccl.bindings.nccl as real  # type: ignore[import-untyped]

from . import ncclsim, stublib

SUCCESS, INVALID_ARGUMENT = 0, 4
LOADING_ERROR = -42  # what the stub returns after raise_in_caller (nccl4py's exception value)
NOCOLOR = -1
NCCL_API_MAGIC = 0xCAFEBEEF
ID_BYTES = 128

# Pointers arrive as signed ints (ssize_t is pointer-sized here), as nccl4py's intptr_t parameters take them.
_P, _I, _Z = ctypes.c_ssize_t, ctypes.c_int, ctypes.c_size_t


class NotSimulated(RuntimeError):
    """An NCCL function the simulation does not model was called."""


_nccl: Any = None  # ncclsim.module() while installed
_handlers: dict[str, tuple[tuple[Any, ...], Callable[..., int]]] = {}
_registered = False

# Split/shrink children the simulation has not written yet: (its Comm, the caller's ncclComm_t*). NCCL writes
# *newcomm when the child's job ends (init.cc ncclCommInitRankFunc); a caller may rely on it only once the parent
# has left ncclInProgress, which it learns from a call, so each call ends by copying what has been written.
_unwritten: list[tuple[Any, int]] = []
_unwritten_lock = threading.Lock()


def _reset_lock() -> None:
    global _unwritten_lock
    _unwritten_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_lock)


def simulation() -> Any:
    """The simulation's nccl4py-shaped module the handlers call (tests wrap its functions)."""
    return _nccl


def install() -> None:
    """Answer the stub's calls from the simulation (loads the stub first)."""
    global _nccl, _registered
    _nccl = ncclsim.module()
    if not _registered:
        for name, (argtypes, fn) in _handlers.items():
            stublib.register(name, ctypes.CFUNCTYPE(_I, *argtypes)(fn))
        stublib.register("unmodelled", ctypes.CFUNCTYPE(None, ctypes.c_char_p)(_unmodelled))
        _registered = True
    stublib.simulate(True)


def uninstall() -> None:
    """The stub passes calls on to the real libnccl again."""
    stublib.simulate(False)


# --- plumbing ------------------------------------------------------------------------------------------------

def _handler(name: str, *argtypes: Any) -> Callable[[Callable[..., int]], Callable[..., int]]:
    def register(fn: Callable[..., int]) -> Callable[..., int]:
        _handlers[name] = (argtypes, fn)
        return fn

    return register


def _answer(call: Callable[[], None]) -> int:
    """Run one call on the simulation; its ncclResult_t. Never raises (a ctypes callback must not)."""
    try:
        call()
        code = SUCCESS
    except real.NCCLError as exc:
        code = int(exc.status)
    except BaseException as exc:  # noqa: B036 - not NCCL's: nccl4py raises it in the caller (KeyboardInterrupt too)
        stublib.raise_in_caller(exc)
        code = LOADING_ERROR
    if _unwritten:
        _write_children()
    return code


def _unmodelled(name: bytes) -> None:
    stublib.raise_in_caller(NotSimulated(
        f"{name.decode()} is not simulated (tests/simnccl): nccl_pg does not call it, or the simulation must model it"))


def _comm(handle: int) -> Any:
    return real.Comm(handle)


def _write_int(ptr: int, value: int) -> None:
    ctypes.c_int.from_address(ptr).value = int(value)


def _write_comm(ptr: int, handle: int) -> None:
    ctypes.c_ssize_t.from_address(ptr).value = handle


def _child(comm: Any, out: int, written: bool) -> None:
    """``*newcomm`` of a split or shrink: now if the simulation has written it (or never will), else at the end of
    the first call after it has."""
    if comm.handle or written:
        _write_comm(out, comm.handle)
    else:
        with _unwritten_lock:
            _unwritten.append((comm, out))


def _write_children() -> None:
    with _unwritten_lock:
        for entry in [e for e in _unwritten if e[0].handle]:
            _write_comm(entry[1], entry[0].handle)
            _unwritten.remove(entry)


def _ids(ptr: int, n: int) -> bytearray:
    """The ``n`` ncclUniqueIds at ``ptr`` (the caller's copy for a by-value id), as bytes."""
    if not ptr or n < 0:
        raise real.NCCLError(INVALID_ARGUMENT)
    return bytearray(ctypes.string_at(ptr, ID_BYTES * n))


def _config(ptr: int) -> Any:
    """The ncclConfig_t at ``ptr`` as NCCL reads it (init.cc parseCommConfig, v2.30.7): at most its own struct's
    size of it, taken from the ``size`` field; the rest NCCL_CONFIG_INITIALIZER's; a magic other than
    NCCL_API_MAGIC is ncclInvalidArgument ("not initialized via NCCL_CONFIG_INITIALIZER"). NULL: NCCL's defaults.
    NCCL reads it during the call (before any async job), so a copy lives as long as the call."""
    if not ptr:
        return 0
    size = ctypes.c_size_t.from_address(ptr).value
    own = real.Config()  # NCCL_CONFIG_INITIALIZER of NCCL 2.32.3, the header nccl4py 0.6.0 was generated from
    if size >= own.size_:
        if ctypes.c_uint.from_address(ptr + 8).value != NCCL_API_MAGIC:
            raise real.NCCLError(INVALID_ARGUMENT)
        return ptr
    own.magic = 0
    ctypes.memmove(own.ptr, ptr, size)
    if own.magic != NCCL_API_MAGIC:
        raise real.NCCLError(INVALID_ARGUMENT)
    return own


# --- the handlers (NCCL 2.32.3's signatures; out-parameters NULL: ncclInvalidArgument, as init.cc's PtrCheck) ----

@_handler("ncclGetVersion", _P)
def _get_version(version: int) -> int:
    if not version:
        return INVALID_ARGUMENT
    return _answer(lambda: _write_int(version, _nccl.get_version()))


@_handler("ncclGetUniqueId", _P)
def _get_unique_id(out: int) -> int:
    if not out:
        return INVALID_ARGUMENT

    def call() -> None:
        uid = _nccl.get_unique_id()  # referenced while its storage is read
        ctypes.memmove(out, uid.ptr, ID_BYTES)

    return _answer(call)


@_handler("ncclCommInitRankConfig", _P, _I, _P, _I, _P)
def _init_rank_config(out: int, nranks: int, comm_id: int, rank: int, config: int) -> int:
    if not out:
        return INVALID_ARGUMENT

    def call() -> None:
        comm = _nccl.comm_init_rank_config(nranks, _ids(comm_id, 1), rank, _config(config))
        _write_comm(out, comm.handle)

    return _answer(call)


@_handler("ncclCommInitRankScalable", _P, _I, _I, _I, _P, _P)
def _init_rank_scalable(out: int, nranks: int, myrank: int, n_id: int, comm_ids: int,
                        config: int) -> int:
    if not out:
        return INVALID_ARGUMENT

    def call() -> None:
        comm = _nccl.comm_init_rank_scalable(nranks, myrank, n_id, _ids(comm_ids, n_id), _config(config))
        _write_comm(out, comm.handle)

    return _answer(call)


@_handler("ncclCommSplit", _P, _I, _I, _P, _P)
def _split(comm: int, color: int, key: int, out: int, config: int) -> int:
    if not out:
        return INVALID_ARGUMENT
    return _answer(lambda: _child(_nccl.comm_split(_comm(comm), color, key, _config(config)), out, color == NOCOLOR))


@_handler("ncclCommShrink", _P, _P, _I, _P, _P, _I)
def _shrink(comm: int, exclude: int, count: int, out: int, config: int,
            flags: int) -> int:
    if not out or (count > 0 and not exclude):
        return INVALID_ARGUMENT

    def call() -> None:
        ranks = list((ctypes.c_int * count).from_address(exclude)) if count > 0 and exclude else []
        _child(_nccl.comm_shrink(_comm(comm), ranks, count, _config(config), flags), out, False)

    return _answer(call)


@_handler("ncclCommGetUniqueId", _P, _P)
def _comm_get_unique_id(comm: int, out: int) -> int:
    if not out:
        return INVALID_ARGUMENT

    def call() -> None:
        uid = _nccl.comm_get_unique_id(_comm(comm))  # referenced while its storage is read
        ctypes.memmove(out, uid.ptr, ID_BYTES)

    return _answer(call)


@_handler("ncclCommGrow", _P, _I, _P, _I, _P, _P)
def _grow(comm: int, nranks: int, unique_id: int, rank: int, out: int, config: int) -> int:
    """init.cc ncclCommGrow: ``*newcomm`` is written before the job runs (``initState = ncclInProgress``), so at
    once; the id is read during the call (the simulation copies it, as NCCL copies it into its job)."""
    if not out:
        return INVALID_ARGUMENT
    return _answer(lambda: _write_comm(out, _nccl.comm_grow(_comm(comm), nranks, unique_id, rank,
                                                             _config(config)).handle))


@_handler("ncclCommGetAsyncError", _P, _P)
def _get_async_error(comm: int, out: int) -> int:
    if not out:
        return INVALID_ARGUMENT
    return _answer(lambda: _write_int(out, _nccl.comm_get_async_error(_comm(comm))))


@_handler("ncclCommCount", _P, _P)
def _count(comm: int, out: int) -> int:
    if not out:
        return INVALID_ARGUMENT
    return _answer(lambda: _write_int(out, _nccl.comm_count(_comm(comm))))


@_handler("ncclCommUserRank", _P, _P)
def _user_rank(comm: int, out: int) -> int:
    if not out:
        return INVALID_ARGUMENT
    return _answer(lambda: _write_int(out, _nccl.comm_user_rank(_comm(comm))))


@_handler("ncclCommFinalize", _P)
def _finalize(comm: int) -> int:
    return _answer(lambda: _nccl.comm_finalize(_comm(comm)))


@_handler("ncclCommDestroy", _P)
def _destroy(comm: int) -> int:
    return _answer(lambda: _nccl.comm_destroy(_comm(comm)))


@_handler("ncclCommAbort", _P)
def _abort(comm: int) -> int:
    return _answer(lambda: _nccl.comm_abort(_comm(comm)))


@_handler("ncclCommRevoke", _P, _I)
def _revoke(comm: int, flags: int) -> int:
    return _answer(lambda: _nccl.comm_revoke(_comm(comm), flags))


@_handler("ncclRedOpCreatePreMulSum", _P, _P, _I, _I, _P)
def _premul_sum(out: int, scalar: int, datatype: int, residence: int, comm: int) -> int:
    if not out:
        return INVALID_ARGUMENT
    return _answer(lambda: _write_int(out, _nccl.red_op_create_pre_mul_sum(scalar, datatype, residence,
                                                                           _comm(comm))))


@_handler("ncclRedOpDestroy", _I, _P)
def _red_op_destroy(op: int, comm: int) -> int:
    return _answer(lambda: _nccl.red_op_destroy(op, _comm(comm)))


@_handler("ncclAllReduce", _P, _P, _Z, _I, _I, _P, _P)
def _all_reduce(send: int, recv: int, count: int, datatype: int, op: int, comm: int,
                stream: int) -> int:
    return _answer(lambda: _nccl.all_reduce(send, recv, count, datatype, op, _comm(comm), stream))


@_handler("ncclReduce", _P, _P, _Z, _I, _I, _I, _P, _P)
def _reduce(send: int, recv: int, count: int, datatype: int, op: int, root: int, comm: int,
            stream: int) -> int:
    return _answer(lambda: _nccl.reduce(send, recv, count, datatype, op, root, _comm(comm), stream))


@_handler("ncclBroadcast", _P, _P, _Z, _I, _I, _P, _P)
def _broadcast(send: int, recv: int, count: int, datatype: int, root: int, comm: int,
               stream: int) -> int:
    return _answer(lambda: _nccl.broadcast(send, recv, count, datatype, root, _comm(comm), stream))


@_handler("ncclReduceScatter", _P, _P, _Z, _I, _I, _P, _P)
def _reduce_scatter(send: int, recv: int, count: int, datatype: int, op: int, comm: int,
                    stream: int) -> int:
    return _answer(lambda: _nccl.reduce_scatter(send, recv, count, datatype, op, _comm(comm), stream))


@_handler("ncclAllGather", _P, _P, _Z, _I, _P, _P)
def _all_gather(send: int, recv: int, count: int, datatype: int, comm: int,
                stream: int) -> int:
    return _answer(lambda: _nccl.all_gather(send, recv, count, datatype, _comm(comm), stream))


@_handler("ncclAlltoAll", _P, _P, _Z, _I, _P, _P)
def _all_to_all(send: int, recv: int, count: int, datatype: int, comm: int,
                stream: int) -> int:
    return _answer(lambda: _nccl.allto_all(send, recv, count, datatype, _comm(comm), stream))


@_handler("ncclGather", _P, _P, _Z, _I, _I, _P, _P)
def _gather(send: int, recv: int, count: int, datatype: int, root: int, comm: int,
            stream: int) -> int:
    return _answer(lambda: _nccl.gather(send, recv, count, datatype, root, _comm(comm), stream))


@_handler("ncclScatter", _P, _P, _Z, _I, _I, _P, _P)
def _scatter(send: int, recv: int, count: int, datatype: int, root: int, comm: int,
             stream: int) -> int:
    return _answer(lambda: _nccl.scatter(send, recv, count, datatype, root, _comm(comm), stream))


@_handler("ncclSend", _P, _Z, _I, _I, _P, _P)
def _send(send: int, count: int, datatype: int, peer: int, comm: int, stream: int) -> int:
    return _answer(lambda: _nccl.send(send, count, datatype, peer, _comm(comm), stream))


@_handler("ncclRecv", _P, _Z, _I, _I, _P, _P)
def _recv(recv: int, count: int, datatype: int, peer: int, comm: int, stream: int) -> int:
    return _answer(lambda: _nccl.recv(recv, count, datatype, peer, _comm(comm), stream))


@_handler("ncclGroupStart")
def _group_start() -> int:
    return _answer(lambda: _nccl.group_start())


@_handler("ncclGroupEnd")
def _group_end() -> int:
    return _answer(lambda: _nccl.group_end())


# --- the nccl*Config collectives (v2.31.2-1), suspend/resume/memory statistics (v2.29.7-1) ---------------------
# The ncclCollConfig_t pointer goes to the simulation as it is: ncclParseCollConfig reads it during the call.

@_handler("ncclAllReduceConfig", _P, _P, _Z, _I, _I, _P, _P, _P)
def _all_reduce_config(send: int, recv: int, count: int, datatype: int, op: int, comm: int, stream: int,
                       config: int) -> int:
    return _answer(lambda: _nccl.all_reduce_config(send, recv, count, datatype, op, _comm(comm), stream, config))


@_handler("ncclBroadcastConfig", _P, _P, _Z, _I, _I, _P, _P, _P)
def _broadcast_config(send: int, recv: int, count: int, datatype: int, root: int, comm: int, stream: int,
                      config: int) -> int:
    return _answer(lambda: _nccl.broadcast_config(send, recv, count, datatype, root, _comm(comm), stream, config))


@_handler("ncclReduceConfig", _P, _P, _Z, _I, _I, _I, _P, _P, _P)
def _reduce_config(send: int, recv: int, count: int, datatype: int, op: int, root: int, comm: int, stream: int,
                   config: int) -> int:
    return _answer(lambda: _nccl.reduce_config(send, recv, count, datatype, op, root, _comm(comm), stream, config))


@_handler("ncclAllGatherConfig", _P, _P, _Z, _I, _P, _P, _P)
def _all_gather_config(send: int, recv: int, count: int, datatype: int, comm: int, stream: int, config: int) -> int:
    return _answer(lambda: _nccl.all_gather_config(send, recv, count, datatype, _comm(comm), stream, config))


@_handler("ncclReduceScatterConfig", _P, _P, _Z, _I, _I, _P, _P, _P)
def _reduce_scatter_config(send: int, recv: int, count: int, datatype: int, op: int, comm: int, stream: int,
                           config: int) -> int:
    return _answer(lambda: _nccl.reduce_scatter_config(send, recv, count, datatype, op, _comm(comm), stream,
                                                       config))


@_handler("ncclAlltoAllConfig", _P, _P, _Z, _I, _P, _P, _P)
def _all_to_all_config(send: int, recv: int, count: int, datatype: int, comm: int, stream: int, config: int) -> int:
    return _answer(lambda: _nccl.allto_all_config(send, recv, count, datatype, _comm(comm), stream, config))


@_handler("ncclGatherConfig", _P, _P, _Z, _I, _I, _P, _P, _P)
def _gather_config(send: int, recv: int, count: int, datatype: int, root: int, comm: int, stream: int,
                   config: int) -> int:
    return _answer(lambda: _nccl.gather_config(send, recv, count, datatype, root, _comm(comm), stream, config))


@_handler("ncclScatterConfig", _P, _P, _Z, _I, _I, _P, _P, _P)
def _scatter_config(send: int, recv: int, count: int, datatype: int, root: int, comm: int, stream: int,
                    config: int) -> int:
    return _answer(lambda: _nccl.scatter_config(send, recv, count, datatype, root, _comm(comm), stream, config))


@_handler("ncclCommSuspend", _P, _I)
def _suspend(comm: int, flags: int) -> int:
    return _answer(lambda: _nccl.comm_suspend(_comm(comm), flags))


@_handler("ncclCommResume", _P)
def _resume(comm: int) -> int:
    return _answer(lambda: _nccl.comm_resume(_comm(comm)))


@_handler("ncclCommMemStats", _P, _I, _P)
def _mem_stats(comm: int, stat: int, out: int) -> int:
    """mem_manager.cc ncclCommMemStats: ncclCommEnsureReady first, then a NULL ``value`` is ncclInvalidArgument."""
    def call() -> None:
        value = _nccl.comm_mem_stats(_comm(comm), stat)
        if not out:
            raise real.NCCLError(INVALID_ARGUMENT)
        ctypes.c_uint64.from_address(out).value = int(value)

    return _answer(call)

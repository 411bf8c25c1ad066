"""The simulated bindings (tests/simnccl) against the real ones and against
the NCCL/CUDA rules they claim to follow.

What the simulation takes from the real bindings is checked mechanically:
every simulated function has the real one's parameters, and arguments convert
(or are refused) as the real nccl4py 0.6.0 binding converts them: each rule is
probed on the real binding in a forked child (a call that gets past conversion
reaches libnccl, which fails without a GPU, or crashes: either way the child
only reports it). The behaviours the simulation models are checked on small
cases, each against the rule its docstring cites. None of this is about GPU
behaviour.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import threading
import time
from typing import Any

import numpy as np
import pytest
import simnccl
from simnccl import checks, cudart, ncclsim

pytestmark = [pytest.mark.simnccl, pytest.mark.timeout(120), pytest.mark.usefixtures("simnccl_installed")]

real: Any = pytest.importorskip("nccl.bindings.nccl")


@pytest.fixture(autouse=True)
def _clean():
    simnccl.clear()
    yield
    simnccl.clear()


def _driver_present() -> bool:
    from cuda.bindings import runtime  # type: ignore[import-untyped]

    return int(runtime.cudaGetDeviceCount()[0]) == 0


# --- the binding's surface ---------------------------------------------------------------------------

def test_every_simulated_function_has_the_real_parameters() -> None:
    mod = ncclsim.module()  # raises if any simulated function's parameters differ from nccl4py's
    for fn in ncclsim._FUNCTIONS:
        assert getattr(mod, fn.__name__) is fn
        assert [p for _, p in checks.real_params(fn.__name__)] == list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
    runtime, driver = cudart.modules()  # the same check for the CUDA runtime and driver
    assert runtime.cudaEventCreateWithFlags is cudart.cudaEventCreateWithFlags
    assert runtime.cudaStream_t is cudart.real_runtime.cudaStream_t  # types and enums are the real ones
    assert mod.Comm is real.Comm and mod.UniqueId is real.UniqueId and mod.Config is real.Config
    with pytest.raises(cudart.SimError, match="not simulated"):
        mod.comm_grow  # noqa: B018 - a function the simulation does not model is refused, not faked


def _probe_real(name: str, args: tuple[Any, ...]) -> str:
    """What the real binding does with ``args``: the conversion error it raises, or "reached" (libnccl ran)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        faulthandler.disable()  # a crash inside libnccl is an answer here, not news
        try:
            getattr(real, name)(*args)
            out = "reached"
        except real.NCCLError:
            out = "reached"
        except Exception as exc:
            out = type(exc).__name__
        os.write(w, pickle.dumps(out))
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return pickle.loads(data) if data else "reached"  # no answer: it crashed inside libnccl


def _probe_sim(name: str, args: tuple[Any, ...]) -> str:
    try:
        checks.convert(name, args)
        return "reached"
    except (TypeError, ValueError, OverflowError) as exc:
        return type(exc).__name__


class _Index:
    def __index__(self) -> int:
        return 1


class _Int:
    def __int__(self) -> int:
        return 1


_VALUES = {"int": 1, "bool": True, "float": 1.5, "np.int64": np.int64(1), "str": "1", "None": None,
           "huge": 2**70, "negative": -1, "2**40": 2**40, "__index__": _Index(), "__int__": _Int(),
           "bytes": bytes(128), "bytearray": bytearray(128), "list": [1], "Comm": real.Comm(0)}
# One function per parameter kind: the rule depends on the C type (or, untyped, the parameter's name).
_REPRESENTATIVES = [("get_error_string", 0, (7,)), ("all_reduce", 2, (0, 0, 1, 7, 0, real.Comm(0), 0)),
                    ("all_reduce", 0, (0, 0, 1, 7, 0, real.Comm(0), 0)), ("comm_get_async_error", 0, (real.Comm(0),)),
                    ("comm_split", 3, (real.Comm(0), 0, 0, 0)), ("comm_init_rank_config", 1, (1, 0, 0, 0)),
                    ("comm_init_rank_scalable", 3, (1, 0, 1, 0, 0)), ("comm_shrink", 1, (real.Comm(0), [1], 1, 0, 0))]


@pytest.mark.skipif(_driver_present(), reason="probes the real binding only where it cannot touch a GPU")
@pytest.mark.parametrize(("name", "index", "base"), _REPRESENTATIVES,
                         ids=[f"{n}-{checks.real_params(n)[i][1]}" for n, i, _ in _REPRESENTATIVES])
def test_arguments_convert_as_the_real_binding_converts_them(name: str, index: int, base: tuple[Any, ...]) -> None:
    mismatches = []
    for label, value in _VALUES.items():
        if checks.real_params(name)[index][1] in ("comm_id", "comm_ids") and label in ("int", "bool", "huge", "2**40",
                                                                                       "negative"):
            continue  # an int is a pointer there: the real call would read that address
        args = base[:index] + (value,) + base[index + 1:]
        want, got = _probe_real(name, args), _probe_sim(name, args)
        if want != got:
            mismatches.append(f"{name}({checks.real_params(name)[index][1]}={label}): binding {want}, simulation {got}")
    assert mismatches == []


def test_wrong_arity_is_refused_like_the_binding() -> None:
    for fn in ncclsim._FUNCTIONS:
        n = len(checks.real_params(fn.__name__))
        with pytest.raises(TypeError):
            getattr(real, fn.__name__)(*([0] * (n + 1)))
        with pytest.raises(TypeError):
            checks.convert(fn.__name__, (0,) * (n + 1))


def test_an_int_is_not_a_communicator() -> None:
    """Defect 1's shape: nccl4py 0.6 takes only its Comm object."""
    nccl = ncclsim.module()
    for call in (lambda: nccl.comm_get_async_error(5), lambda: nccl.comm_abort(5),
                 lambda: nccl.all_reduce(0, 0, 1, 7, 0, 5, 0)):
        with pytest.raises(TypeError, match="Cannot convert int to nccl.bindings.nccl.Comm"):
            call()


@pytest.mark.skipif(_driver_present(), reason="the real runtime checks arguments only where there is no driver")
def test_cuda_arguments_are_checked_by_the_real_runtime() -> None:
    runtime, _ = cudart.modules()
    with pytest.raises(TypeError):
        runtime.cudaSetDevice("0")  # the real cuda.bindings refuses it; so does the simulation
    with pytest.raises(TypeError):
        runtime.cudaStreamWaitEvent(0, 0)


# --- CUDA rules ------------------------------------------------------------------------------------------

def _rt() -> Any:
    from nccl_pg.comm.nccl import _lib

    return _lib.cudart()


def test_elapsed_time_needs_timing_events() -> None:
    """Runtime API, cudaEventElapsedTime: an event created with cudaEventDisableTiming is an invalid handle."""
    rt = _rt()
    simnccl.select_device(1)
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, timed = rt.cudaEventCreateWithFlags(rt.cudaEventDefault)
    _, plain = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
    for ev in (timed, plain):
        rt.cudaEventRecord(ev, s)
    rt.cudaStreamSynchronize(s)
    assert rt.cudaEventElapsedTime(timed, plain)[0] == rt.cudaError_t.cudaErrorInvalidResourceHandle
    _, timed2 = rt.cudaEventCreateWithFlags(rt.cudaEventDefault)
    rt.cudaEventRecord(timed2, s)
    rt.cudaStreamSynchronize(s)
    err, ms = rt.cudaEventElapsedTime(timed, timed2)
    assert err == rt.cudaError_t.cudaSuccess and ms >= 0


def test_a_side_thread_without_a_device_makes_a_context_on_gpu_0() -> None:
    rt = _rt()
    simnccl.select_device(1)
    _, ev = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
    t = threading.Thread(target=lambda: rt.cudaEventQuery(ev))  # never chose a device: its current one is 0
    t.start()
    t.join()
    assert any("context was created on device 0" in v for v in simnccl.violations())
    simnccl.clear()

    def chosen() -> None:
        rt.cudaSetDevice(1)
        rt.cudaEventQuery(ev)

    t = threading.Thread(target=chosen)
    t.start()
    t.join()
    assert simnccl.violations() == []


@pytest.mark.parametrize(("mode", "invalidated"), [(0, True), (1, False), (2, False)])
def test_unsafe_calls_during_a_capture(mode: int, invalidated: bool) -> None:
    """cudaThreadExchangeStreamCaptureMode: a cudaMalloc on another thread invalidates a global capture only
    when that thread is in global mode."""
    rt = _rt()
    simnccl.select_device(1)
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal)
    seen = []

    def other() -> None:
        rt.cudaSetDevice(1)
        rt.cudaThreadExchangeStreamCaptureMode(mode)
        seen.append(rt.cudaMalloc(16)[0])

    t = threading.Thread(target=other)
    t.start()
    t.join()
    err, _ = rt.cudaStreamEndCapture(s)
    if invalidated:
        assert seen == [rt.cudaError_t.cudaErrorStreamCaptureUnsupported]
        assert err == rt.cudaError_t.cudaErrorStreamCaptureInvalidated
    else:
        assert seen == [rt.cudaError_t.cudaSuccess] and err == rt.cudaError_t.cudaSuccess
    simnccl.clear()


def test_unordered_streams_are_a_race() -> None:
    rt = _rt()
    simnccl.select_device(1)
    _, a = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, b = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, src = rt.cudaMalloc(64)
    _, dst = rt.cudaMalloc(64)
    rt.cudaMemsetAsync(src, 1, 64, a)
    rt.cudaMemcpyAsync(dst, src, 64, rt.cudaMemcpyKind(3), b)  # b reads what a writes, unordered
    assert any(v.startswith("race") for v in simnccl.violations())
    simnccl.clear()
    _, ev = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
    rt.cudaMemsetAsync(src, 2, 64, a)
    rt.cudaEventRecord(ev, a)
    rt.cudaStreamWaitEvent(b, ev, 0)
    rt.cudaMemcpyAsync(dst, src, 64, rt.cudaMemcpyKind(3), b)
    rt.cudaStreamSynchronize(b)
    assert simnccl.violations() == []
    assert cudart.view(dst, 64, "check")[0] == 2


# --- NCCL rules ------------------------------------------------------------------------------------------

def _config(blocking: int) -> Any:
    c = real.Config()
    c.blocking = blocking
    return c


def _init_one(blocking: int) -> Any:
    nccl = ncclsim.module()
    simnccl.select_device(1)
    return nccl, nccl.comm_init_rank_config(1, nccl.get_unique_id(), 0, _config(blocking))


def _poll(nccl: Any, comm: Any) -> int:
    deadline = time.monotonic() + 10
    while (code := nccl.comm_get_async_error(comm)) == ncclsim.IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.001)
    return code


def test_nonblocking_init_and_split_protocol() -> None:
    """init.cc: handle at once, ncclInProgress until ready; a split child is NULL until the parent's job ends,
    and the parent refuses use meanwhile (ncclCommEnsureReady) and is left in error."""
    nccl, comm = _init_one(0)
    assert comm.handle != 0
    assert _poll(nccl, comm) == ncclsim.SUCCESS
    child = nccl.comm_split(comm, 0, 0, _config(0))
    assert child.handle == 0 and nccl.comm_get_async_error(comm) == ncclsim.IN_PROGRESS
    with pytest.raises(real.NCCLError, match="InvalidArgument"):
        nccl.comm_user_rank(comm)
    assert _poll(nccl, comm) == ncclsim.SUCCESS and child.handle != 0
    assert nccl.comm_user_rank(child) == 0 and nccl.comm_count(child) == 1
    child2 = nccl.comm_split(comm, 0, 0, _config(0))
    with pytest.raises(real.NCCLError, match="InvalidArgument"):  # an enqueue while in progress ...
        nccl.all_reduce(0, 0, 0, 7, 0, comm, 0)
    assert nccl.comm_get_async_error(comm) == ncclsim.INVALID_ARGUMENT  # ... leaves the parent in error
    for c in (child2, child, comm):
        nccl.comm_abort(c) if c.handle else None
    with pytest.raises(real.NCCLError):
        nccl.comm_get_async_error(comm)  # aborted: freed
    assert any("use after free" in v for v in simnccl.violations())
    simnccl.clear()


def test_nonblocking_collectives_take_a_thread_each_blocking_ones_none() -> None:
    """group.cc ncclGroupEndInternal: a nonblocking group runs on a new thread; a blocking one inline."""
    started = {}
    for blocking in (0, 1):
        nccl, comm = _init_one(blocking)
        assert _poll(nccl, comm) == ncclsim.SUCCESS
        rt = _rt()
        _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
        _, buf = rt.cudaMalloc(16)
        before = simnccl.counters()["threads"]
        for _ in range(5):
            nccl.all_reduce(buf, buf, 4, 7, 0, comm, int(s))
            _poll(nccl, comm)
        started[blocking] = simnccl.counters()["threads"] - before
        rt.cudaStreamSynchronize(s)
        nccl.comm_finalize(comm)
        assert _poll(nccl, comm) == ncclsim.SUCCESS
        nccl.comm_destroy(comm)
    assert started == {0: 5, 1: 0}


def test_groups_do_not_mix_blocking_and_nonblocking() -> None:
    nccl, a = _init_one(0)
    _, b = _init_one(1)
    assert _poll(nccl, a) == ncclsim.SUCCESS
    rt = _rt()
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, buf = rt.cudaMalloc(16)
    nccl.group_start()
    nccl.all_reduce(buf, buf, 4, 7, 0, a, int(s))
    with pytest.raises(real.NCCLError, match="InvalidArgument"):
        nccl.all_reduce(buf, buf, 4, 7, 0, b, int(s))
    with pytest.raises(real.NCCLError):
        nccl.group_end()
    for c in (a, b):
        nccl.comm_abort(c)


def test_premul_sum_ops() -> None:
    """enqueue.cc: host-immediate scalars are read at creation; builtins and unknown ops cannot be destroyed."""
    nccl, comm = _init_one(1)
    scalar = np.array([0.5], np.float32)
    op = nccl.red_op_create_pre_mul_sum(scalar.ctypes.data, 7, 1, comm)
    scalar[0] = 4.0  # too late: already read
    assert op >= ncclsim.NUM_OPS
    rt = _rt()
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, buf = rt.cudaMalloc(16)
    host = np.full(4, 3.0, np.float32)
    rt.cudaMemcpyAsync(buf, host.ctypes.data, 16, rt.cudaMemcpyKind(1), s)
    nccl.all_reduce(buf, buf, 4, 7, op, comm, int(s))
    rt.cudaMemcpyAsync(host.ctypes.data, buf, 16, rt.cudaMemcpyKind(2), s)
    assert host.tolist() == [1.5] * 4
    nccl.red_op_destroy(op, comm)
    for bad in (0, op):
        with pytest.raises(real.NCCLError, match="InvalidArgument"):
            nccl.red_op_destroy(bad, comm)
    nccl.comm_destroy(comm)

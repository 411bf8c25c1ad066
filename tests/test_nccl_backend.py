"""The NCCL backend (nccl_pg.comm.nccl).

CPU parts run everywhere (those needing libnccl skip when it cannot be
loaded); ``gpu`` parts need a GPU and CuPy, and run with ``make test-gpu``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
from harness.forked import Rank, run_world

import nccl_pg as dist
from nccl_pg.comm import backends
from nccl_pg.comm.base import CommConfig, CommState
from nccl_pg.errors import DistBackendError
from nccl_pg.reduce_op import ReduceOp
from nccl_pg.store import HashStore

GPU = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(backends.gpu_count() == 0, reason="needs a GPU")


@pytest.fixture(scope="module")
def libnccl() -> int:
    from nccl_pg.comm.nccl import _lib

    try:
        return _lib.version()
    except DistBackendError as exc:
        pytest.skip(f"libnccl.so.2 cannot be loaded here: {str(exc).splitlines()[0]}")


# ==================================== CPU ====================================================


def test_import_loads_no_gpu_library() -> None:
    """Importing nccl_pg, and even the NCCL backend's package, loads no CUDA/NCCL module."""
    code = ("import sys, nccl_pg, nccl_pg.comm.backends, nccl_pg.comm.nccl\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cuda', 'nccl', 'torch', 'jax')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_bindings_import() -> None:
    import nccl.bindings.nccl as b

    assert hasattr(b, "comm_init_rank_config") and hasattr(b, "comm_split")


def test_version(libnccl: int) -> None:
    from nccl_pg.comm.nccl import _lib

    major, minor, patch = _lib.version_tuple(libnccl)
    assert (major, minor) >= (2, 18), "ncclCommSplit needs NCCL >= 2.18"
    assert libnccl == major * 10000 + minor * 100 + patch


def test_unique_id_without_gpu(libnccl: int) -> None:
    """ncclGetUniqueId needs no GPU (only the bootstrap network)."""
    from nccl_pg.comm.nccl.config import unique_id, unique_id_bytes

    a, b = unique_id_bytes(), unique_id_bytes()
    assert len(a) == len(b) == 128 and a != b
    import ctypes

    assert ctypes.string_at(unique_id(a).ptr, 128) == a


@pytest.mark.parametrize(("dtype", "code", "k"), [
    ("int8", 0, 1), ("uint8", 1, 1), ("bool", 1, 1), ("int32", 2, 1), ("uint32", 3, 1), ("int64", 4, 1),
    ("uint64", 5, 1), ("float16", 6, 1), ("float32", 7, 1), ("float64", 8, 1), ("bfloat16", 9, 1),
    ("float8_e4m3fn", 10, 1), ("float8_e5m2", 11, 1), ("complex64", 7, 2), ("complex128", 8, 2), ("int16", 1, 2),
])
def test_dtype_mapping(dtype: str, code: int, k: int) -> None:
    from nccl_pg.comm.nccl import _lib
    from nccl_pg.comm.nccl.array import named_dtype

    assert _lib.nccl_dtype(named_dtype(dtype), "x") == (code, k)


def test_dtype_unsupported() -> None:
    from nccl_pg.comm.nccl import _lib

    with pytest.raises(TypeError, match="not supported by NCCL"):
        _lib.nccl_dtype(np.dtype("U4"), "all_reduce send")


def test_reduction_checks() -> None:
    from nccl_pg.comm.nccl import _lib
    from nccl_pg.comm.nccl.array import named_dtype

    for fp8 in ("float8_e4m3fn", "float8_e5m2"):
        with pytest.raises(TypeError, match="Float8 dtypes are not supported for NCCL reductions"):
            _lib.reduction(named_dtype(fp8), ReduceOp.SUM, None, "all_reduce")
    with pytest.raises(TypeError, match="complex"):
        _lib.reduction(np.dtype(np.complex64), ReduceOp.MAX, None, "all_reduce")
    assert _lib.reduction(np.dtype(np.complex64), ReduceOp.AVG, None, "all_reduce") == (7, 2)
    with pytest.raises(TypeError, match="boolean"):
        _lib.reduction(np.dtype(np.bool_), ReduceOp.AVG, None, "all_reduce")
    with pytest.raises(ValueError, match="scale"):
        _lib.reduction(np.dtype(np.float32), ReduceOp.PREMUL_SUM, None, "all_reduce")
    with pytest.raises(ValueError, match="scale"):
        _lib.reduction(np.dtype(np.float32), ReduceOp.SUM, 2.0, "all_reduce")
    with pytest.raises(TypeError, match="ReduceOp"):
        _lib.reduction(np.dtype(np.float32), "sum", None, "all_reduce")  # type: ignore[arg-type]
    assert _lib.nccl_op(ReduceOp.AVG, np.dtype(np.float32)) == 4
    assert _lib.nccl_op(ReduceOp.SUM, np.dtype(np.bool_)) == 2  # logical or
    assert _lib.nccl_op(ReduceOp.PRODUCT, np.dtype(np.bool_)) == 3  # logical and
    assert _lib.scalar_bytes(0.5, np.dtype(np.complex128)).dtype == np.float64


def test_nccl_config_fields() -> None:
    from nccl_pg.comm.nccl.communicator import nccl_config

    c = nccl_config(CommConfig(blocking=True, comm_name="pg0:default", cga_cluster_size=2, min_ctas=4, max_ctas=8,
                               net_name="Socket", split_share=True))
    assert c.blocking == 0  # always nonblocking underneath: init and abort stay boundable
    assert (c.cga_cluster_size, c.min_ctas, c.max_ctas, c.split_share) == (2, 4, 8, 1)
    assert (c.comm_name, c.net_name) == ("pg0:default", "Socket")
    assert nccl_config(CommConfig()).min_ctas == -(2**31)  # left to NCCL's default
    with pytest.raises(ValueError, match="min_ctas"):
        nccl_config(CommConfig(min_ctas=-1))


@pytest.mark.parametrize(("fields", "named"), [({"min_ctas": 0, "max_ctas": 4}, "min_ctas"),
                                                ({"max_ctas": 0}, "max_ctas"), ({"min_ctas": 4}, "max_ctas"),
                                                ({"min_ctas": 8, "max_ctas": 4}, "min_ctas")],
                         ids=["min0", "max0", "min-alone", "min>max"])
def test_cta_limits_are_checked_as_nccl_does(fields: dict, named: str) -> None:
    """init.cc parseCommConfig refuses minCTAs/maxCTAs <= 0 and minCTAs > maxCTAs, where an unset maxCTAs is
    NCCL_CONFIG_UNDEF_INT (INT_MIN): minCTAs alone fails init with ncclInvalidArgument. Issue 23 defect 8
    (failed before: all four were accepted)."""
    from nccl_pg.comm.nccl.communicator import nccl_config

    with pytest.raises(ValueError, match=f"CommConfig.{named}"):
        nccl_config(CommConfig(**fields))
    assert (nccl_config(CommConfig(min_ctas=2, max_ctas=2)).min_ctas, nccl_config(CommConfig(max_ctas=3)).max_ctas) \
        == (2, 3)


def test_device_array_views() -> None:
    from nccl_pg.comm.nccl.array import DeviceArray

    a = DeviceArray(0x1000, 10, np.dtype(np.complex64), 0, None)
    v = a.view(np.float32)
    assert (v.size, v.ptr, v.dtype) == (20, 0x1000, np.float32)
    s = a[2:5]
    assert (s.size, s.ptr, s.nbytes) == (3, 0x1000 + 16, 24)
    assert a.reshape(-1) is a
    cai = a.__cuda_array_interface__
    assert cai["data"] == (0x1000, False) and cai["shape"] == (10,) and cai["typestr"] == "<c8"
    with pytest.raises(ValueError):
        a[::2]
    with pytest.raises(ValueError):
        DeviceArray(0, 3, np.dtype(np.uint8), 0, None).view(np.float32)


class _FakeDevice:
    id = 0


class _FakeCai:
    """An object exporting __cuda_array_interface__ (no memory behind it)."""

    device = _FakeDevice()

    def __init__(self, shape, typestr="<f4", strides=None, dtype=None) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (0x2000, False),
                                         "strides": strides, "version": 3}
        if dtype is not None:
            self.dtype = dtype


def test_interop_checks_without_device() -> None:
    from nccl_pg.comm.nccl.array import as_device_array

    a = as_device_array(_FakeCai((4, 3)), "x")
    assert (a.size, a.ptr, a.dtype, a.device) == (12, 0x2000, np.float32, 0)
    assert as_device_array(_FakeCai((4, 3), strides=(12, 4)), "x").size == 12
    assert as_device_array(_FakeCai((4, 1), strides=(4, 400)), "x").size == 4  # size-1 dims: any stride
    with pytest.raises(ValueError, match="x: tensors must be contiguous"):
        as_device_array(_FakeCai((4, 3), strides=(4, 16)), "x")
    bf = as_device_array(_FakeCai((2,), typestr="<V2", dtype="bfloat16"), "x")
    assert bf.dtype.name == "bfloat16"
    with pytest.raises(DistBackendError, match="numpy"):  # as torch: a CPU array on NCCL is a DistBackendError
        as_device_array(np.zeros(3), "broadcast recv")
    with pytest.raises(TypeError, match="GPU arrays"):
        as_device_array([1, 2, 3], "x")


def test_dlpack_cpu_array_refused() -> None:
    from nccl_pg.comm.nccl.array import as_device_array

    class Cpu:  # a DLPack producer on the CPU
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, stream=None):
            raise AssertionError("must not be exported")

    with pytest.raises(ValueError, match="CUDA device"):
        as_device_array(Cpu(), "x")


def test_device_index() -> None:
    from nccl_pg.comm.nccl.backend import device_index

    class TorchLike:
        index = 3

    assert device_index(2) == 2 and device_index("cuda:1") == 1 and device_index(TorchLike()) == 3
    with pytest.raises(ValueError):
        device_index("cpu")


@pytest.mark.skipif(backends.gpu_count() > 0, reason="GPUs are available")
def test_no_gpu() -> None:
    with pytest.raises(ValueError, match="no GPUs found"):
        backends.get_backend("nccl")
    assert backends.default_backend_name() == "host"


@pytest.mark.timeout(30)
def test_unique_id_wait_names_rank_0(libnccl: int) -> None:
    """A rank whose rank 0 never publishes the unique id fails by the deadline, naming rank 0."""
    from nccl_pg.comm.nccl import NcclCommunicator

    t0 = time.monotonic()
    with pytest.raises(DistBackendError, match=r"timeout: .*rank 1 waited 0.5 s for rank 0's NCCL unique id"):
        NcclCommunicator.create(HashStore(), 2, 1, CommConfig(timeout=0.5))
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(30)
def test_abort_unblocks_nonblocking_init(libnccl: int) -> None:
    from nccl_pg.comm.nccl import NcclCommunicator

    comm = NcclCommunicator.create(HashStore(), 2, 1, CommConfig(timeout=60, blocking=False))
    assert comm.state is CommState.INITIALIZING  # returned at once
    threading.Timer(0.2, comm.abort).start()
    t0 = time.monotonic()
    with pytest.raises(DistBackendError, match="aborted"):
        comm.wait_ready(10)
    assert time.monotonic() - t0 < 5 and comm.state is CommState.ABORTED
    comm.destroy()
    assert comm.state is CommState.DESTROYED


# ==================================== GPU ====================================================

def _cupy():
    return pytest.importorskip("cupy", reason="the GPU tests use CuPy arrays")


def _one_rank(**cfg):
    from nccl_pg.comm.nccl import NcclCommunicator

    return NcclCommunicator.create(HashStore(), 1, 0, CommConfig(timeout=60, **cfg), device=0)


_DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64", "bfloat16",
           "float8_e4m3fn", "float8_e5m2", "complex64", "bool"]


def every_op(comm, dt, dev, back) -> None:
    """Every collective of a one-rank communicator on ``dt``, results checked
    against numpy; ``dev(host)`` makes a device array on the caller's current
    stream, ``back(array)`` reads one. Shared by the GPU test and the
    simulated one (test_nccl_sim.py)."""
    from nccl_pg.comm.nccl.array import caller_stream

    host = (np.arange(1, 13) % 5).astype(np.float32).astype(dt)
    stream = comm.new_stream()

    def run(fn):
        stream.wait_stream(caller_stream(comm.device))  # the inputs were written on the caller's stream
        fn()
        assert stream.synchronize(60)
        assert comm.async_error() is None

    reducible = not dt.name.startswith("float8")
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT] if dt.kind != "c" else [ReduceOp.SUM]
    if dt.kind in "fc":
        ops.append(ReduceOp.AVG)
    for op in ops if reducible else []:
        s, r = dev(host), dev(np.zeros_like(host))
        run(lambda s=s, r=r, op=op: comm.all_reduce(s, r, op, stream))
        np.testing.assert_array_equal(back(r), host)
        r2 = dev(np.zeros_like(host))
        run(lambda s=s, r2=r2, op=op: comm.reduce(s, r2, op, 0, stream))
        np.testing.assert_array_equal(back(r2), host)
        r3 = dev(np.zeros_like(host))
        run(lambda s=s, r3=r3, op=op: comm.reduce_scatter(s, r3, op, stream))
        np.testing.assert_array_equal(back(r3), host)
    if reducible and dt.kind == "f":
        s, r = dev(host), dev(np.zeros_like(host))
        run(lambda: comm.all_reduce(s, r, ReduceOp.PREMUL_SUM, stream, scale=2.0))
        np.testing.assert_allclose(back(r).astype(np.float64), host.astype(np.float64) * 2)
    if not reducible:
        with pytest.raises(TypeError, match="Float8 dtypes are not supported for NCCL reductions"):
            comm.all_reduce(dev(host), dev(host), ReduceOp.SUM, stream)
    for name, call in [
        ("broadcast", lambda s, r: comm.broadcast(s, r, 0, stream)),
        ("all_gather", lambda s, r: comm.all_gather(s, r, stream)),
        ("all_to_all", lambda s, r: comm.all_to_all(s, r, stream)),
        ("all_to_all uneven", lambda s, r: comm.all_to_all(s, r, stream, [host.size], [host.size])),
        ("gather", lambda s, r: comm.gather(s, r, 0, stream)),
        ("scatter", lambda s, r: comm.scatter(s, r, 0, stream)),
    ]:
        s, r = dev(host), dev(np.zeros_like(host))
        run(lambda s=s, r=r, call=call: call(s, r))
        np.testing.assert_array_equal(back(r), host, err_msg=name)
    comm.finalize(30)
    comm.destroy()


@GPU
@needs_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", _DTYPES)
def test_world_size_one_every_op(dtype: str) -> None:
    cp = _cupy()
    from nccl_pg.comm.nccl.array import as_device_array, named_dtype

    dt = named_dtype(dtype)

    def dev(a):
        if dt.name in ("bfloat16",) or dt.name.startswith("float8"):  # CuPy has no such dtype: move the bytes
            return as_device_array(cp.asarray(a.view(np.uint8)), "x").view(dt)
        return cp.asarray(a)

    def back(d):
        if hasattr(d, "get"):
            return d.get()
        return np.asarray(cp.ndarray((d.nbytes,), cp.uint8, cp.cuda.MemoryPointer(
            cp.cuda.UnownedMemory(d.ptr, d.nbytes, d.owner), 0)).get()).view(dt)

    every_op(_one_rank(), dt, dev, back)


@GPU
@needs_gpu
@pytest.mark.timeout(120)
def test_events_and_priority_stream() -> None:
    cp = _cupy()
    comm = _one_rank(high_priority_stream=True)
    stream = comm.new_stream()
    start = stream.record(comm.new_event(timing=True))
    x = cp.ones(1 << 20, cp.float32)
    comm.all_reduce(x, x, ReduceOp.SUM, stream)
    end = stream.record(comm.new_event(timing=True))
    assert end.synchronize(30) and end.query()
    assert start.elapsed_ms(end) >= 0
    comm.destroy()


# --- several ranks on one GPU (harness.forked sets NCCL_HOSTID etc. for backend="nccl") ----------------

def _s_collectives(r: Rank) -> None:
    r.init(device_id=r.device)
    x = r.full((8,), r.rank + 1)
    dist.all_reduce(x)
    assert (r.host(x) == 3).all()
    dist.all_reduce(x, dist.ReduceOp.AVG)
    assert (r.host(x) == 3).all()
    out = r.array(np.zeros(4, np.float32))
    dist.all_to_all_single(out, r.array(np.arange(4, dtype=np.float32) + 10 * r.rank))
    expect = np.array([0, 1, 10, 11], np.float32) + (2 if r.rank else 0)
    np.testing.assert_array_equal(r.host(out), expect)
    buf = r.full((3,), r.rank)
    if r.rank == 0:
        dist.send(buf, 1)
    else:
        dist.recv(buf, 0)
        assert (r.host(buf) == 0).all()
    dist.barrier()
    sub = dist.new_group([0, 1])
    y = r.full((2,), 1.0)
    dist.all_reduce(y, group=sub)
    assert (r.host(y) == 2).all()
    assert dist._get_default_group().comm_split_count() == 1
    dist.destroy_process_group()


@GPU
@needs_gpu
@pytest.mark.timeout(240)
def test_two_ranks_one_gpu(tmp_path) -> None:
    _cupy()
    run_world(_s_collectives, 2, tmp_path, backend="nccl", timeout=180)


def _s_nonblocking_init(r: Rank) -> None:
    import os

    os.environ["NCCL_PG_USE_COMM_NONBLOCKING"] = "1"
    r.init()
    x = r.full((4,), 1.0)
    dist.all_reduce(x)
    assert (r.host(x) == 2).all()
    dist.destroy_process_group()


@GPU
@needs_gpu
@pytest.mark.timeout(240)
def test_two_ranks_nonblocking_init(tmp_path) -> None:
    _cupy()
    run_world(_s_nonblocking_init, 2, tmp_path, backend="nccl", timeout=180)


def _s_abort_unblocks(r: Rank) -> None:
    pg = r.init(device_id=r.device)
    x = r.full((4,), 1.0)
    dist.all_reduce(x)  # both ranks: the communicator exists
    if r.rank == 0:
        work = dist.all_reduce(x, async_op=True)  # rank 1 never joins: stuck
        threading.Timer(1.0, pg.abort).start()
        t0 = time.monotonic()
        with pytest.raises(DistBackendError):
            work.wait(timedelta(seconds=30))
        assert time.monotonic() - t0 < 20
    else:
        time.sleep(3)


@GPU
@needs_gpu
@pytest.mark.timeout(240)
def test_abort_unblocks_stuck_op(tmp_path) -> None:
    _cupy()
    run_world(_s_abort_unblocks, 2, tmp_path, backend="nccl", timeout=180)


@GPU
@needs_gpu
@pytest.mark.timeout(120)
def test_torch_and_dlpack_interop() -> None:
    torch = pytest.importorskip("torch", reason="needs torch")
    comm = _one_rank()
    stream = comm.new_stream()
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = torch.arange(6, device="cuda").to(dtype)
        out = torch.zeros(12, device="cuda").to(dtype)
        comm.all_gather(t, out, stream)
        assert stream.synchronize(30)
        assert torch.equal(out[:6].float(), t.float())
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.ones(4, 4, device="cuda").t(), torch.ones(16, device="cuda"), ReduceOp.SUM, stream)

    class DlpackOnly:  # only DLPack: the path JAX arrays take
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__()

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    src = torch.full((5,), 3.0, device="cuda")
    dst = torch.zeros(5, device="cuda")
    comm.all_reduce(DlpackOnly(src), DlpackOnly(dst), ReduceOp.SUM, stream)
    assert stream.synchronize(30)
    assert torch.equal(dst, src)
    comm.destroy()



# --- CUDA graph capture ----------------------------------------------------------------------------------

def _s_graph_capture(r: Rank) -> dict:
    """Collectives captured into a CUDA graph (CuPy, global capture mode,
    with an un-waited operation pending so the watchdog polls during the
    capture) replay correctly; they are not numbered, recorded or watched."""
    import cupy as cp

    from nccl_pg.diagnostics import flight_recorder

    pg = r.init(device_id=r.device)
    n = r.world_size
    x = cp.full(1024, r.rank + 1, dtype=cp.float32)
    y = cp.ones(8, dtype=cp.float32)
    parts = [cp.zeros(8, dtype=cp.float32) for _ in range(n)]
    dist.all_reduce(y)  # warm up outside the capture: the communicator exists
    pending = dist.all_reduce(cp.ones(4, cp.float32), async_op=True)
    seq, entries = pg._get_sequence_number_for_group(), len(flight_recorder.get().entries())
    pending_before = len(pg._pending)  # the un-waited one, and the warm-up until the watchdog retires it
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
        dist.all_reduce(x)
        work = dist.all_reduce(x, dist.make_premul_sum(0.5), async_op=True)
        work.wait()
        dist.all_gather(parts, y)
        graph = s.end_capture()
    captured = {"done": work.is_completed(), "seq": pg._get_sequence_number_for_group() - seq,
                "entries": len(flight_recorder.get().entries()) - entries,
                "pending": len(pg._pending) - pending_before}
    pending.wait()
    for _ in range(3):
        graph.launch(s)
    s.synchronize()
    xs = [k + 1.0 for k in range(n)]  # x on each rank: each replay sums it, then sums half of it
    for _ in range(3):
        xs = [sum(xs)] * n
        xs = [sum(0.5 * v for v in xs)] * n
    expect = xs[0]
    captured["x"] = float(x[0].get())
    captured["expect"] = expect
    captured["parts"] = [float(p[0].get()) for p in parts]
    dist.all_reduce(y)  # eager again: numbered and watched as usual
    captured["after_seq"] = pg._get_sequence_number_for_group() - seq
    del graph  # NCCL's finalize waits until the graphs that captured collectives are destroyed (issue 23)
    dist.destroy_process_group()
    return captured


def _s_destroy_with_live_graph(r: Rank) -> dict:
    """Destroying a group while a CUDA graph that captured one of its collectives is alive: NCCL's finalize
    (and abort) wait for the graph (init.cc commDestroySync, localPersistentRefs). destroy_process_group
    refuses within the timeout, saying so, and succeeds once the graph is gone."""
    import gc

    import cupy as cp

    r.init(device_id=r.device, timeout=timedelta(seconds=3))
    x = cp.ones(256, dtype=cp.float32)
    dist.all_reduce(x)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
        dist.all_reduce(x)
        graph = s.end_capture()
    graph.launch(s)
    s.synchronize()
    t0 = time.monotonic()
    try:
        dist.destroy_process_group()
        refused = ""
    except DistBackendError as exc:
        refused = str(exc)
    took = time.monotonic() - t0
    del graph
    gc.collect()
    t1 = time.monotonic()
    dist.destroy_process_group()
    return {"refused": refused, "took": took, "then": time.monotonic() - t1}


@GPU
@needs_gpu
@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [1, 2])
def test_graph_capture_replays(tmp_path, n) -> None:
    _cupy()
    for out in run_world(_s_graph_capture, n, tmp_path, backend="nccl", timeout=180):
        assert out["done"] and out["seq"] == 0 and out["entries"] == 0 and out["pending"] <= 0, out
        assert out["x"] == pytest.approx(out["expect"], rel=1e-6), out
        assert out["parts"] == [float(n)] * n  # y was all_reduced once (to n) before the capture
        assert out["after_seq"] == 1


@GPU
@needs_gpu
@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [1, 2])
def test_destroy_with_a_live_graph(tmp_path, n) -> None:
    _cupy()
    for out in run_world(_s_destroy_with_live_graph, n, tmp_path, backend="nccl", timeout=180):
        assert "destroy the CUDA graphs" in out["refused"], out
        assert out["took"] < 15 and out["then"] < 15, out


# --- shrink and revoke: version gates -------------------------------------------------------------------------

def test_shrink_and_revoke_gates(libnccl: int) -> None:
    """ncclCommShrink from 2.27, ncclCommRevoke from 2.28.7 (the first tags whose nccl.h.in declares them;
    issue 23 defect 8: revoke was gated at 2.29, failed before): a communicator says which it can do, and the
    group layer falls back to a fresh communicator (shrink) or an abort (revoke) when it cannot."""
    from nccl_pg.comm.nccl import _lib
    from nccl_pg.comm.nccl.communicator import NcclCommunicator

    comm = NcclCommunicator(2, 0, 0, CommConfig(), "gate")
    assert comm.supports_shrink == (libnccl >= 22700)
    assert comm.supports_revoke == (libnccl >= 22807)
    comm._version = 22807
    assert comm.supports_revoke
    comm._version = 22600
    assert not comm.supports_shrink and not comm.supports_revoke
    with pytest.raises(DistBackendError, match=r"ncclCommShrink needs NCCL >= 2\.27\.0; this is 2\.26\.0"):
        comm.shrink([1])
    with pytest.raises(DistBackendError, match=r"ncclCommRevoke needs NCCL >= 2\.28\.7"):
        comm.revoke()
    assert (_lib.SHRINK_DEFAULT, _lib.SHRINK_ABORT) == (dist.SHRINK_DEFAULT, dist.SHRINK_ABORT)


def test_streams_do_not_capture_on_the_host() -> None:
    from nccl_pg.comm.host.stream import HostStream

    s = HostStream("t")
    try:
        assert s.capturing is False
    finally:
        s.close(timeout=1.0)

"""NaN checks (NCCL_PG_NAN_CHECK): the configuration, every mode on the host
backend (thread ranks, and a real process for ``trap``); ``gpu`` tests run the
kernels and the modes on the NCCL backend (``make test-gpu``). The kernels,
their CPU emulation and the numpy scan are in test_nan_kernels.py."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import nccl_pg as dist
from nccl_pg import env
from nccl_pg.comm import backends
from nccl_pg.comm.nan_scan import first_nan_of, lane_dtype
from nccl_pg.errors import NanError
from nccl_pg.group.options import Options
from nccl_pg.testing import run_threads

DTYPES = ["float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128"]
needs_gpu = pytest.mark.skipif(backends.gpu_count() == 0, reason="needs a GPU (run with make test-gpu)")


def dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) and name not in ("float16", "float32",
                                                                                            "float64") else np.dtype(name)


def nan_of(name: str) -> object:
    return complex(0, float("nan")) if name.startswith("complex") else float("nan")


# ================================ configuration ================================================

@pytest.mark.parametrize("raw, mode", [("off", "off"), ("0", "off"), ("false", "off"), ("1", "raise"),
                                       ("true", "raise"), ("raise", "raise"), ("ASYNC", "async"), ("trap", "trap")])
def test_env_values(raw: str, mode: str) -> None:
    assert env.NAN_CHECK.get({"NCCL_PG_NAN_CHECK": raw}) == mode
    assert env.NAN_CHECK.get({"TORCH_NCCL_NAN_CHECK": raw}) == mode
    assert env.NAN_CHECK.get({}) == "off"


def test_env_invalid_and_precedence() -> None:
    for raw in ("maybe", "2", "raises"):
        with pytest.raises(ValueError, match="NCCL_PG_NAN_CHECK"):
            env.validate_all({"NCCL_PG_NAN_CHECK": raw})
    with pytest.raises(ValueError, match="TORCH_NCCL_NAN_CHECK"):
        env.NAN_CHECK.get({"TORCH_NCCL_NAN_CHECK": "yes please"})
    assert env.NAN_CHECK.get({"NCCL_PG_NAN_CHECK": "async", "TORCH_NCCL_NAN_CHECK": "1"}) == "async"


def _per_group_options(rank: int, world: int) -> tuple[str, str, str, str]:
    checked = dist.new_group(list(range(world)), pg_options=Options(nan_check="async"))
    x = np.array([np.nan], np.float32)
    dist.all_reduce(x)  # the default group: off
    work = dist.all_reduce(np.array([np.nan], np.float32), group=checked, async_op=True)
    with pytest.raises(NanError):
        work.wait()
    default = dist._get_default_group()
    default.set_nan_check("raise")
    with pytest.raises(NanError):
        dist.all_reduce(x)
    with pytest.raises(ValueError, match="nan_check"):
        default.set_nan_check("sometimes")
    default.set_nan_check(None)  # back to the environment's
    return default.nan_check, checked.nan_check, "ok", "ok"


def test_per_group_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_PG_NAN_CHECK", raising=False)
    monkeypatch.delenv("TORCH_NCCL_NAN_CHECK", raising=False)
    assert run_threads(_per_group_options, 2, timeout=30) == [("off", "async", "ok", "ok")] * 2


# ================================ modes on the host backend ====================================

def _nan_assert(rank: int, world: int, name: str) -> tuple[int, str]:
    """The seed's test_nan_assert: every rank puts a NaN somewhere in a 10x10 input."""
    pg = dist._get_default_group()
    x = np.full((10, 10), rank, dtype(name))
    i, j = random.randrange(10), random.randrange(10)
    x[i, j] = np.nan
    with pytest.raises(RuntimeError) as caught:  # as the seed asserts; NanError is a RuntimeError
        pg.allreduce(x)
    err = caught.value
    assert isinstance(err, NanError)
    assert (err.rank, err.group, err.op, err.input, err.index) == (rank, 0, "ALLREDUCE", "tensor", 10 * i + j)
    assert f"rank {rank}" in str(err) and f"element {10 * i + j}, index ({i}, {j})" in str(err)
    assert pg._get_sequence_number_for_group() == 0  # not issued
    x[i, j] = 1  # the process and the group are still usable
    pg.allreduce(x).wait()
    return pg._get_sequence_number_for_group(), str(err)


@pytest.mark.parametrize("name", ["float16", "float32", "float64"])
def test_nan_assert(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_NAN_CHECK", "1")
    monkeypatch.delenv("NCCL_PG_NAN_CHECK", raising=False)
    results = run_threads(_nan_assert, 2, timeout=30, args=(name,))
    assert [seq for seq, _ in results] == [1, 1]
    assert "NaN in the input of all_reduce on process group 0 ('default_pg'), rank 1 (group rank 1 of 2)" in results[1][1]
    assert "NCCL_PG_NAN_CHECK=raise" in results[1][1]


def _off(rank: int, world: int) -> bool:
    x = np.array([np.nan, 1], np.float32)
    dist.all_reduce(x)
    return bool(np.isnan(x[0]))


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_PG_NAN_CHECK", raising=False)
    monkeypatch.delenv("TORCH_NCCL_NAN_CHECK", raising=False)
    assert run_threads(_off, 2, timeout=30) == [True, True]


def _async(rank: int, world: int) -> tuple[str | None, str | None, list[float]]:
    x = np.full(6, 1.0, np.float64)
    if rank == 1:
        x[4] = np.nan
    work = dist.all_reduce(x, async_op=True)
    assert work._wait_finished(10)  # finished by the watchdog: nobody polled or waited
    error = work.exception()
    caught = None
    try:
        work.wait()
    except NanError as exc:
        caught = str(exc)
    assert (error is None) == (caught is None)
    y = np.full(3, float(rank), np.float64)  # the group is not aborted (error handling left it alone)
    dist.all_reduce(y)
    return caught, None if error is None else type(error).__name__, y.tolist()


def test_async_mode_fails_only_the_work_with_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_PG_NAN_CHECK", "async")
    monkeypatch.setenv("NCCL_PG_ASYNC_ERROR_HANDLING", "2")  # would abort the group on a communication failure
    r0, r1 = run_threads(_async, 2, timeout=30)
    assert r0 == (None, None, [1.0, 1.0, 1.0])
    text, kind, clean = r1
    assert kind == "NanError" and clean == [1.0, 1.0, 1.0]
    assert text is not None and "all_reduce #1 on" in text and "tensor element 4 (6 x float64)" in text
    assert "the operation ran" in text


def _async_blocking_wait(rank: int, world: int) -> list[float]:
    pg = dist._get_default_group()
    pg._set_blocking_wait(True)
    work = dist.all_reduce(np.array([np.nan], np.float32), async_op=True)
    with pytest.raises(NanError):
        work.wait()
    y = np.ones(2, np.float32)
    dist.all_reduce(y)  # blocking wait aborts a group on a failed wait, but not for a NaN
    return y.tolist()


def test_async_mode_with_blocking_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_PG_NAN_CHECK", "async")
    assert run_threads(_async_blocking_wait, 2, timeout=30) == [[2.0, 2.0]] * 2


def _scatter_and_broadcast(rank: int, world: int) -> tuple[str | None, str | None]:
    out = np.full(4, np.nan, np.float32)  # non-roots' buffers hold NaN: not checked (overwritten)
    inputs = [np.full(4, float(i), np.float32) for i in range(world)] if rank == 0 else None
    if rank == 0:
        inputs[2][3] = np.nan  # type: ignore[index]
    work = dist.scatter(out, inputs, src=0, async_op=True)
    scatter = None
    try:
        work.wait()
    except NanError as exc:
        scatter = type(exc).__name__
        assert "scatter_list[2] element 3" in str(exc)
    buf = np.full(2, np.nan if rank != 0 else 5.0, np.float32)
    bwork = dist.broadcast(buf, src=0, async_op=True)
    bwork.wait()
    assert buf.tolist() == [5.0, 5.0]
    return scatter, None if bwork.exception() is None else "failed"


def test_scatter_checks_only_root_inputs_and_broadcast_only_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_PG_NAN_CHECK", "async")
    assert run_threads(_scatter_and_broadcast, 3, timeout=30) == [("NanError", None), (None, None), (None, None)]


def _send_recv(rank: int, world: int, mode: str) -> str | None:
    dist.barrier()  # communicators are created lazily, by a collective of every rank
    if rank == 0:
        a = np.arange(5, dtype=np.float32)
        a[3] = np.nan
        try:
            work = dist.isend(a, dst=1)
        except NanError as exc:  # raise mode: not sent
            assert mode == "raise"
            return str(exc)
        with pytest.raises(NanError) as caught:
            work.wait()
        return str(caught.value)
    if mode == "async":
        buf = np.full(5, np.nan, np.float32)  # a receive buffer is not checked
        dist.recv(buf, src=0)
        assert np.isnan(buf[3]) and buf[4] == 4
    return None


@pytest.mark.parametrize("mode", ["raise", "async"])
def test_sends_are_checked_recvs_are_not(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_PG_NAN_CHECK", mode)
    text, none = run_threads(_send_recv, 2, timeout=30, args=(mode,))
    assert none is None and text is not None and "NaN in the input of send " in text and "tensor element 3" in text


def _lists_and_dtypes(rank: int, world: int) -> list[str]:
    texts = []
    ins = [np.full(3, 1.0, np.float32) for _ in range(world)]
    ins[1][2] = np.nan
    outs = [np.empty(3, np.float32) for _ in range(world)]
    with pytest.raises(NanError) as caught:
        dist.all_to_all(outs, ins)
    texts.append(str(caught.value))
    c = np.ones((2, 2), np.complex64)
    c[1, 0] = complex(0, np.nan)
    with pytest.raises(NanError) as caught:
        dist.all_gather([np.empty_like(c) for _ in range(world)], c)
    texts.append(str(caught.value))
    bf = np.ones(9, dtype("bfloat16"))
    bf[8] = np.nan
    with pytest.raises(NanError) as caught:
        dist.reduce_scatter_tensor(np.empty(3, bf.dtype) if world == 3 else np.empty(9 // world, bf.dtype), bf)
    texts.append(str(caught.value))
    e4 = np.ones(4, dtype("float8_e4m3fn"))
    e4[0] = np.nan
    with pytest.raises(NanError) as caught:
        dist.all_gather_into_tensor(np.empty(4 * world, e4.dtype), e4)
    texts.append(str(caught.value))
    ok = [np.ones(2, np.float32), np.ones(3, np.float32)]
    bad = [np.ones(2, np.float32), np.array([1, np.nan, 1], np.float32)]
    pg = dist._get_default_group()
    with pytest.raises(NanError) as caught:
        pg.allreduce_coalesced(bad)  # nothing of the group is issued, not even tensors[0]
    texts.append(str(caught.value))
    pg.allreduce_coalesced(ok).wait()
    assert ok[1].tolist() == [float(world)] * 3
    texts.append(str(pg._get_sequence_number_for_group()))
    return texts


def test_list_inputs_dtypes_and_coalesced_in_raise_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_PG_NAN_CHECK", "raise")
    texts = run_threads(_lists_and_dtypes, 3, timeout=30)[2]
    assert "NaN in the input of all_to_all on" in texts[0] and "input_list[1] element 2 (3 x float32)" in texts[0]
    assert "NaN in the input of all_gather on" in texts[1] and "tensor element 2 (imaginary part), index (1, 0) of shape (2, 2)" in texts[1]
    assert "NaN in the input of reduce_scatter_tensor on" in texts[2] and "input element 8 (9 x bfloat16)" in texts[2]
    assert "input_tensor element 0 (4 x float8_e4m3fn)" in texts[3]
    assert "NaN in the input of all_reduce_coalesced on" in texts[4] and "tensors[1] element 1" in texts[4]
    assert texts[5] == "1"  # only the clean coalesced all_reduce was issued


def _batch_raise(rank: int, world: int) -> list[float]:
    dist.barrier()
    if rank == 0:
        ops = [dist.P2POp(dist.isend, np.full(2, 7.0, np.float32), 1),
               dist.P2POp(dist.isend, np.array([1.0, np.nan], np.float32), 1)]
        with pytest.raises(NanError, match=r"send .*p2p_op_list\[1\]\.tensor element 1"):
            dist.batch_isend_irecv(ops)
        dist.send(np.full(2, 3.0, np.float32), 1)
        return []
    buf = np.zeros(2, np.float32)
    dist.recv(buf, 0)  # a send of the failed batch, had it been issued, would arrive here first
    return buf.tolist()


def test_batch_isend_irecv_raise_issues_none_of_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_PG_NAN_CHECK", "raise")
    assert run_threads(_batch_raise, 2, timeout=30) == [[], [3.0, 3.0]]


def _coalesced_async(rank: int, world: int) -> str:
    pg = dist._get_default_group()
    work = pg.allreduce_coalesced([np.ones(2, np.float32), np.array([np.nan], np.float32)])
    with pytest.raises(NanError) as caught:
        work.wait()
    return str(caught.value)


def test_coalesced_async(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_PG_NAN_CHECK", "async")
    text = run_threads(_coalesced_async, 2, timeout=30)[0]
    assert "all_reduce (in all_reduce_coalesced #1)" in text and "tensors[1] element 0" in text


def test_a_dropped_group_with_a_check_is_freed_at_once() -> None:
    """The check must not tie the group into a reference cycle (its __del__ frees the communicator)."""
    import gc
    import time
    import weakref

    from nccl_pg.group.process_group import ProcessGroup

    pg = ProcessGroup(dist.HashStore(), 0, 1, Options(nan_check="async"))
    pg.allreduce(np.ones(4, np.float32)).wait()
    ref = weakref.ref(pg)
    gc.disable()
    try:
        del pg
        deadline = time.monotonic() + 5
        while ref() is not None and time.monotonic() < deadline:  # the watchdog drops its last Work soon
            time.sleep(0.05)
        assert ref() is None
    finally:
        gc.enable()


TRAP = textwrap.dedent("""
    import numpy as np, nccl_pg as dist
    dist.init_process_group("host", store=dist.HashStore(), rank=0, world_size=1)
    x = np.ones(8, np.float32)
    dist.all_reduce(x)
    print("clean all_reduce done", flush=True)
    x[5] = np.nan
    dist.all_reduce(x)
    dist.barrier()
    print("survived", flush=True)
""")


def test_trap_ends_the_process() -> None:
    env_ = {**os.environ, "NCCL_PG_NAN_CHECK": "trap", "NCCL_PG_DEBUG_INFO_TEMP_FILE": "/tmp/nccl_pg_nan_trap_"}
    env_["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env_.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", TRAP], env=env_, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGABRT, proc.stderr
    assert "clean all_reduce done" in proc.stdout and "survived" not in proc.stdout
    assert "NaN in the input of all_reduce on" in proc.stderr and "tensor element 5" in proc.stderr
    assert "NCCL_PG_NAN_CHECK=trap" in proc.stderr


# ================================ GPU ============================================================

def _cupy():
    return pytest.importorskip("cupy", reason="the GPU tests use CuPy arrays")


def _view(raw, dt: np.dtype, offset: int, size: int):
    """``size`` elements of ``dt`` from element ``offset`` of CuPy bytes ``raw`` (CuPy has no bf16/fp8)."""
    from nccl_pg.comm.nccl.array import DeviceArray

    return DeviceArray(int(raw.data.ptr) + offset * dt.itemsize, size, dt, raw.device.id, raw)


def _gpu_scan(a) -> int | None:
    from nccl_pg.comm.nccl.backend import NCCL

    scan = NCCL.find_nan([a], None, None)
    assert scan.wait(60)
    lane = scan.first()
    scan.release(True)
    return lane


GPU_SIZES = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 255, 1023, 4097, 65537, 2**20 + 3]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", DTYPES)
def test_gpu_kernel_every_dtype_position_size_offset(name: str) -> None:
    cp = _cupy()
    dt = dtype(name)
    per = lane_dtype(dt)[1]  # type: ignore[index]
    rng = random.Random(0)
    for size in GPU_SIZES:
        for offset in (0, 1, 3, 5, 15):  # unaligned starts: views into a larger buffer
            host = np.ones(size + offset + 16, dt)
            for at in sorted({0, size - 1, rng.randrange(size)}):
                h = host.copy()
                h[offset + at] = nan_of(name)
                h[offset + size:] = nan_of(name)  # past the end: must not be read
                if offset:
                    h[offset - 1] = nan_of(name)  # before the start: must not be read
                lane = _gpu_scan(_view(cp.asarray(h.view(np.uint8)), dt, offset, size))
                assert lane is not None and lane // per == at, (name, size, offset, at, lane)
                assert lane == first_nan_of([h[offset:offset + size]])
            clean = host.copy()
            clean[:offset] = clean[offset + size:] = nan_of(name)
            assert _gpu_scan(_view(cp.asarray(clean.view(np.uint8)), dt, offset, size)) is None


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float32"])
def test_gpu_kernel_one_gib_and_beyond_2_31_lanes(name: str) -> None:
    cp = _cupy()
    dt = dtype(name)
    n = 2**30 // dt.itemsize if name == "float32" else 2**31 + 5  # fp8: more lanes than an int32 counts
    raw = cp.zeros(n, cp.uint8 if dt.itemsize == 1 else cp.uint32)
    assert _gpu_scan(_view(raw, dt, 0, n)) is None
    for at in (0, n - 1, n // 2 + 12345):
        raw[at] = 0x7F if dt.itemsize == 1 else 0x7FC00000
        assert _gpu_scan(_view(raw, dt, 0, n)) == at
        raw[at] = 0


def _gpu_group(mode: str):
    store = dist.HashStore()
    return dist.ProcessGroupNCCL(store, 0, 1, Options(nan_check=mode, timeout=60), device_id=0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["raise", "async"])
def test_gpu_context_usable_after_a_nan(mode: str) -> None:
    cp = _cupy()
    pg = _gpu_group(mode)
    try:
        x = cp.ones((64, 64), cp.float16)
        x[5, 9] = cp.nan
        with pytest.raises(NanError, match=r"element 329, index \(5, 9\)"):
            work = pg.allreduce(x)  # raise mode raises here
            assert work._wait_finished(30)  # async: the watchdog fails the Work once it completed
            work.wait()
        y = cp.full(1000, 2.0, cp.float32)
        pg.allreduce(y).wait()
        assert float(y.sum().get()) == 2000.0  # the context and the communicator still work
        assert cp.isnan(x).any().get()
    finally:
        pg.shutdown()


GPU_TRAP = textwrap.dedent("""
    import cupy as cp, nccl_pg as dist
    from nccl_pg.group.options import Options
    pg = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, Options(nan_check="trap", timeout=20), device_id=0)
    x = cp.ones(100, cp.float32); x[7] = cp.nan
    w = pg.allreduce(x)
    cp.cuda.get_current_stream().synchronize()
    w.wait()
    print("survived", flush=True)
""")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(120)
def test_gpu_trap_kills_the_context() -> None:
    _cupy()
    proc = subprocess.run([sys.executable, "-c", GPU_TRAP], capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0 and "survived" not in proc.stdout

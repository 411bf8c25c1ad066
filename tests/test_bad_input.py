"""Bad arguments and contradictory settings fail at the call, on the caller's
rank only, with a message naming what was wrong (issue 14, items 15-17):
unsupported dtypes and read-only outputs, reductions a backend cannot do,
non-finite or out-of-range timeouts, ``Work.wait(nan)``, and watchdog
settings that contradict each other. After a refused call the group is
intact: the ranks' next collective is correct and no rank was aborted.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import nccl_pg as dist
from nccl_pg import ReduceOp, env
from nccl_pg.comm.base import CommConfig
from nccl_pg.distributed import _get_default_group
from nccl_pg.group.options import Options
from nccl_pg.store import HashStore
from nccl_pg.testing import run_threads

pytestmark = pytest.mark.timeout(60)

WORLD = 2
# Element types with no wire format or no meaning in a reduction.
BAD_DTYPES = [np.dtype(object), np.dtype("datetime64[s]"), np.dtype("timedelta64[ms]"), np.dtype("V8"),
              np.dtype("U2"), np.dtype("S8"), np.dtype([("a", np.int32), ("b", np.float32)]),
              np.dtype(ml_dtypes.int4)]


def _bad(dt: np.dtype) -> np.ndarray:
    return np.zeros(4, dtype=dt)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _still_healthy(rank: int) -> None:
    """Both ranks' next collective is right, and their sequence numbers agree
    (a refused call was never numbered)."""
    x = np.full(3, rank + 1, np.float32)
    dist.all_reduce(x)
    assert (x == 3).all(), x
    seqs: list[Any] = [None] * WORLD
    dist.all_gather_object(seqs, _get_default_group()._seq)
    assert seqs[0] == seqs[1], seqs


def test_unsupported_dtypes_raise_at_the_call_on_the_caller_only() -> None:
    def body(rank: int, world: int) -> None:
        if rank == 0:
            for dt in BAD_DTYPES:
                calls = [lambda a: dist.all_reduce(a), lambda a: dist.broadcast(a, src=0),
                         lambda a: dist.send(a, dst=1), lambda a: dist.all_gather([np.zeros_like(a), np.zeros_like(a)], a),
                         lambda a: dist.all_to_all_single(np.zeros_like(a), a), lambda a: dist.reduce(a, dst=0)]
                for call in calls:
                    with pytest.raises(TypeError, match=re.escape(f"dtype {dt} cannot be communicated")):
                        call(_bad(dt))
        _still_healthy(rank)

    run_threads(body, WORLD, timeout=30)


def test_read_only_outputs_raise_at_the_call_read_only_inputs_are_fine() -> None:
    def body(rank: int, world: int) -> None:
        ro = _readonly(np.ones(4, np.float32))
        if rank == 0:
            refused = {
                "all_reduce": lambda: dist.all_reduce(_readonly(np.ones(4, np.float32))),
                "recv": lambda: dist.recv(_readonly(np.ones(4, np.float32)), src=1),
                "all_gather": lambda: dist.all_gather([ro, np.ones(4, np.float32)], np.ones(4, np.float32)),
                "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(_readonly(np.ones(8, np.float32)),
                                                                              np.ones(4, np.float32)),
                "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(ro, np.ones(8, np.float32)),
                "all_to_all_single": lambda: dist.all_to_all_single(ro, np.ones(4, np.float32)),
                "scatter": lambda: dist.scatter(ro, [np.ones(4, np.float32)] * 2, src=0),
                "gather (destination)": lambda: dist.gather(np.ones(4, np.float32), [ro, ro], dst=0),
                "reduce (destination)": lambda: dist.reduce(ro, dst=0),
                "broadcast (receiver)": lambda: dist.broadcast(ro, src=1),
            }
            for what, call in refused.items():
                with pytest.raises(ValueError, match="read-only"):
                    call()
                    pytest.fail(f"{what}: a read-only output was accepted")
        # Read-only arrays that are only read: a send, the broadcast root's and the reduce non-root's tensor.
        if rank == 0:
            dist.send(_readonly(np.full(4, 7, np.float32)), dst=1)
        else:
            got = np.zeros(4, np.float32)
            dist.recv(got, src=0)
            assert (got == 7).all()
        root_data = _readonly(np.full(4, 5, np.float32)) if rank == 0 else np.zeros(4, np.float32)
        dist.broadcast(root_data, src=0)
        assert (root_data == 5).all()
        dist.reduce(_readonly(np.ones(4, np.float32)) if rank == 1 else np.ones(4, np.float32), dst=0)
        _still_healthy(rank)

    run_threads(body, WORLD, timeout=30)


def test_impossible_reductions_raise_before_the_operation_is_numbered() -> None:
    """Before the fix these raised inside the enqueue, after the group had
    numbered the operation: the ranks' sequence numbers then disagreed."""
    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)

    def body(rank: int, world: int) -> None:
        if rank == 0:
            with pytest.raises(TypeError, match="Float8"):
                dist.all_reduce(np.zeros(4, fp8))
            with pytest.raises(TypeError, match="complex"):
                dist.all_reduce(np.zeros(4, np.complex64), op=ReduceOp.MAX)
            with pytest.raises(TypeError, match="boolean"):
                dist.reduce_scatter_tensor(np.zeros(2, bool), np.zeros(4, bool), op=ReduceOp.AVG)
            with pytest.raises(TypeError, match="Float8"):
                dist.reduce(np.zeros(4, fp8), dst=1)
        _still_healthy(rank)

    run_threads(body, WORLD, timeout=30)


# --- timeouts ------------------------------------------------------------------------------------

BAD_TIMEOUTS = [math.inf, -math.inf, math.nan, 0, -1, 1e300, timedelta.max, timedelta(seconds=-5)]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=str)
def test_group_timeouts_must_be_finite_and_positive(timeout: Any) -> None:
    """Refused at the call (before the fix, inf passed and raised
    OverflowError at the first collective)."""
    with pytest.raises(ValueError, match="timeout"):
        dist.init_process_group("host", store=HashStore(), rank=0, world_size=1, timeout=timeout)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="timeout"):
        Options(timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        CommConfig(timeout=timeout)
    dist.init_process_group("host", store=HashStore(), rank=0, world_size=1, timeout=30)
    try:
        with pytest.raises(ValueError, match="timeout"):
            dist.new_group([0], timeout=timeout)
        with pytest.raises(ValueError, match="timeout"):
            dist.distributed._set_pg_timeout(timeout)
        assert _get_default_group().timeout == timedelta(seconds=30)
        x = np.ones(2)
        dist.all_reduce(x)  # the group is unharmed
        assert (x == 1).all()
    finally:
        dist.destroy_process_group()


def test_timeout_types_are_checked() -> None:
    with pytest.raises(TypeError, match="timeout"):
        Options(timeout="10")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout"):
        Options(timeout=True)


def test_work_wait_refuses_nan_and_negative_inf_means_no_limit() -> None:
    dist.init_process_group("host", store=HashStore(), rank=0, world_size=1, timeout=30)
    try:
        work = dist.all_reduce(np.ones(3), async_op=True)
        for bad in (math.nan, -1.0, -math.inf):
            with pytest.raises(ValueError, match="wait"):
                work.wait(bad)
        with pytest.raises(TypeError, match="wait"):
            work.wait("1")  # type: ignore[arg-type]
        assert work.wait(math.inf) and work.wait(timedelta(seconds=5)) and work.wait(0)
    finally:
        dist.destroy_process_group()


# --- contradictory settings ----------------------------------------------------------------------


def test_heartbeat_below_two_watchdog_intervals_is_refused_naming_both() -> None:
    bad = {"NCCL_PG_WATCHDOG_INTERVAL": "1", "NCCL_PG_HEARTBEAT_TIMEOUT": "1.5"}
    with pytest.raises(ValueError, match="NCCL_PG_HEARTBEAT_TIMEOUT.*NCCL_PG_WATCHDOG_INTERVAL"):
        env.validate_all(bad)
    with pytest.raises(ValueError, match="NCCL_PG_HEARTBEAT_TIMEOUT.*NCCL_PG_WATCHDOG_INTERVAL"):
        env.validate_all({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "0.1"} | {"NCCL_PG_WATCHDOG_INTERVAL": "0.1"})
    env.validate_all({**bad, "NCCL_PG_ENABLE_MONITORING": "0"})  # no monitor: nothing to contradict
    env.validate_all({"NCCL_PG_WATCHDOG_INTERVAL": "1", "NCCL_PG_HEARTBEAT_TIMEOUT": "2"})


def test_watchdog_interval_has_a_floor() -> None:
    with pytest.raises(ValueError, match="NCCL_PG_WATCHDOG_INTERVAL.*0.001"):
        env.validate_all({"NCCL_PG_WATCHDOG_INTERVAL": "1e-6"})
    assert env.WATCHDOG_INTERVAL.get({"NCCL_PG_WATCHDOG_INTERVAL": "0.001"}) == 0.001


def test_contradictory_settings_fail_at_group_creation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Also without init_process_group (a ProcessGroup made directly)."""
    monkeypatch.setenv("NCCL_PG_WATCHDOG_INTERVAL", "2")
    monkeypatch.setenv("NCCL_PG_HEARTBEAT_TIMEOUT", "3")
    with pytest.raises(ValueError, match="contradictory"):
        dist.init_process_group("host", store=HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="contradictory"):
        dist.ProcessGroupHost(HashStore(), 0, 1)

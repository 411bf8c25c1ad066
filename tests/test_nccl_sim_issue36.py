"""Issue 36 on the simulation: the NCCL path as NCCL 2.32 offers it. Watched
CUDA-graph replays (a hanging replay is named within its timeout + 1 s),
per-call config (validated up front, caught by the fingerprint check when
ranks differ), exact "started" marks from launch-completion events,
suspend/resume (an operation in flight is waited for or the suspend is
refused), and the blocking variant's grow. Ranks are real processes on the
simulated NCCL (tests/simnccl); this proves our logic against NCCL's sources,
never GPU behaviour.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta
from typing import Any

import pytest
import simnccl
from harness.forked import Rank, run_world
from harness.launch_marks import started_while_waiting
from simnccl import ncclsim

import nccl_pg as dist
from nccl_pg import CollConfig, DistBackendError
from nccl_pg.comm.base import Event
from nccl_pg.group.core import GroupState
from nccl_pg.group.replays import ReplayWatch

pytestmark = [pytest.mark.simnccl, pytest.mark.timeout(90)]
REPLAY_TIMEOUT = 1.5
INTERVAL = 0.05  # NCCL_PG_WATCHDOG_INTERVAL of the replay scenario


def world(scenario: Any, n: int, tmp_path: Any, env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    return run_world(scenario, n, tmp_path, backend="simnccl", env=env, timeout=60, **kwargs)


def _sync(r: Rank, key: str) -> None:
    """Every rank reached ``key``."""
    r.store().set(f"{key}/{r.rank}", b"1")
    r.store().wait([f"{key}/{p}" for p in range(r.world_size)], timedelta(seconds=30))


# --- watched CUDA-graph replays ----------------------------------------------------------------------------------

def _s_watched_replay(r: Rank) -> dict[str, Any]:
    from simnccl import xp

    pg = r.init(device_id=r.device, timeout=timedelta(seconds=REPLAY_TIMEOUT))
    x = r.full((4,), 1.0)
    dist.all_reduce(x)  # the communicator exists and is connected before the capture
    s = xp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        dist.all_reduce(x)
        dist.all_reduce(x)
        graph = s.end_capture()
    out: dict[str, Any] = {"captures": pg._replays.captures()}
    for _ in range(3):  # healthy replays, longer than the timeout all told: nothing is named
        graph.launch(s)
        s.synchronize()
        time.sleep(REPLAY_TIMEOUT / 2)
    out["healthy"] = (pg._state.value, float(r.host(x)[0]))
    _sync(r, "replayed")
    queries = simnccl.counters()["cuda"].get("cudaEventQuery", 0)
    time.sleep(0.5)  # idle: one event query per poll (the last collective's end), nothing per replay
    out["idle_queries"] = simnccl.counters()["cuda"].get("cudaEventQuery", 0) - queries
    if r.rank == 0:  # rank 1 does not replay: rank 0's first captured all_reduce waits for it
        t0 = time.monotonic()
        graph.launch(s)
        while pg._state is GroupState.OPEN and time.monotonic() - t0 < REPLAY_TIMEOUT + 10:
            time.sleep(0.01)
        out["named_after"] = time.monotonic() - t0
        out["reason"] = pg._close_reason
        s.synchronize()  # the abort (NCCL_PG_ASYNC_ERROR_HANDLING=2) ended the waiting kernel
        r.store().set("named", b"1")
    else:
        r.store().wait(["named"], timedelta(seconds=30))
    del graph
    gc.collect()
    deadline = time.monotonic() + 5  # the watchdog's next poll sees the graph gone
    while pg._state is GroupState.OPEN and pg._replays.captures() and time.monotonic() < deadline:
        time.sleep(0.01)
    out["captures_after_del"] = pg._replays.captures() if pg._state is GroupState.OPEN else None
    dist.destroy_process_group()
    return out


def test_a_hanging_replay_is_named_within_its_timeout(tmp_path: Any) -> None:
    env = {"NCCL_PG_WATCHDOG_INTERVAL": str(INTERVAL), "NCCL_PG_DUMP_ON_TIMEOUT": "0"}
    out = world(_s_watched_replay, 2, tmp_path, env=env)
    for o in out:
        assert o["captures"] == 1 and o["healthy"] == ("open", 128.0), o  # 2 after the warm-up, x4 per replay
        assert o["idle_queries"] <= 0.5 / INTERVAL + 3, o
    assert REPLAY_TIMEOUT <= out[0]["named_after"] <= REPLAY_TIMEOUT + 1.0, out[0]
    assert "ALLREDUCE (collective 1 of 2 this group captured into CUDA graph capture" in out[0]["reason"], out[0]
    assert f"past its timeout of {REPLAY_TIMEOUT:.3f} s" in out[0]["reason"]
    assert out[1]["captures_after_del"] == 0  # the graph's destruction freed its watch (a CUDA user object)


class _Marker(Event):
    """An event whose completion the test sets (what the watch queries of a replay's record nodes)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self, timeout: float | None = None) -> bool:
        return self.done

    def elapsed_ms(self, end: Event) -> float:
        return 0.0


@pytest.mark.parametrize("late_start", [False, True], ids=["reached-at-first-poll", "reached-after-it"])
def test_the_replay_is_named_in_the_collective_it_waits_in(late_start: bool) -> None:
    """Two captured collectives; the replay reaches the first and hangs there. The watch names the first, never the
    second that waits behind it, also when the first poll came before the replay reached the first collective (its
    start completing later restarts its clock; the second's clock ran from that first poll): on a loaded machine the
    simulated replay above was named at "collective 2 of 2"."""
    watch = ReplayWatch()
    marks = [(_Marker(), _Marker()) for _ in range(2)]
    for start, end in marks:
        watch.captured(7, "ALLREDUCE", start, end, 1.0, lambda: None)
    marks[0][0].done = not late_start
    assert watch.poll(0.0) == []
    marks[0][0].done = True
    assert watch.poll(0.5) == []
    stuck = watch.poll(1.2) + watch.poll(1.6)
    assert [(s.place, s.of) for s in stuck] == [(1, 2)], stuck
    assert stuck[0].elapsed == pytest.approx(1.2 if not late_start else 1.1)


def _handles(r: Rank, stage: str, who: list[int]) -> list[str]:
    r.store().set(f"{stage}/handle/{r.rank}", dist.get_init_handle())
    keys = [f"{stage}/handle/{p}" for p in who]
    r.store().wait(keys, timedelta(seconds=30))
    return [r.store().get(k).decode() for k in keys]


def _s_graphs_and_reconfigure(r: Rank, refuse: bool) -> dict[str, Any]:
    from simnccl import xp

    pg = r.init(device_id=r.device, timeout=timedelta(seconds=20))
    x = r.full((4,), 1.0)
    dist.all_reduce(x)  # 3
    s = xp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        dist.all_reduce(x)
        graph = s.end_capture()
    out: dict[str, Any] = {"same": dist.reconfigure(1, _handles(r, "same", [0, 1, 2]), timeout=20) is pg}
    graph.launch(s)
    s.synchronize()
    out["replayed"] = float(r.host(x)[0])  # 9: nothing changed, the graph keeps working
    if r.rank == 2:  # leaves
        del graph
        gc.collect()
        dist.destroy_process_group()
        return out
    if not refuse:  # what the refusal prevents: NCCL frees the revoked communicator under the graph
        pg._refuse_with_live_graphs = lambda what: None  # type: ignore[method-assign]
    shrink = lambda: dist.reconfigure(2, _handles(r, "shrink", [0, 1]), timeout=20)  # noqa: E731
    for call in (pg.revoke, shrink) if refuse else (shrink,):
        try:
            call()
            out.setdefault("refused", []).append(None)
        except RuntimeError as exc:  # not a DistBackendError: nothing happened, the group is as it was
            out.setdefault("refused", []).append(f"{type(exc).__name__}: {exc}")
    out["state"] = pg._state.value
    del graph
    gc.collect()
    g = shrink() if refuse else dist._get_default_group()
    y = r.full((4,), 1.0)
    dist.all_reduce(y)
    out["after"] = (g is not pg, float(r.host(y)[0]), g.size())
    out["violations"] = simnccl.violations()
    simnccl.clear()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("refuse", [True, False], ids=["refused", "without-the-refusal"])
def test_graphs_captured_before_a_reconfigure(tmp_path: Any, refuse: bool) -> None:
    """A reconfigure that changes nothing returns the same group: its graphs keep working. One that revokes the
    communicator (or destroys it after a grow) is refused while graphs that captured the group's collectives are
    alive, naming them; once they are destroyed it goes ahead, and graphs are captured anew. Without the refusal,
    NCCL frees the revoked communicator under the graph (init.cc ncclCommRevoke sets finalizeCalled; commReclaim
    then skips the wait for localPersistentRefs) and the graph's destruction writes into it (enqueue.cc
    persistentDestructor): the simulation records it."""
    out = world(_s_graphs_and_reconfigure, 3, tmp_path, refuse=refuse)
    for o in out:
        assert o["same"] and o["replayed"] == 9.0, o
    for o in out[:2]:
        assert o["after"] == (True, 2.0, 2), o
        if refuse:
            assert o["state"] == "open" and len(o["refused"]) == 2, o
            assert all(m is not None and m.startswith("RuntimeError: process group 0") and
                       "refused: CUDA graph capture(s)" in m and "del graph" in m
                       for m in o["refused"]), o
            assert o["violations"] == [], o
        else:
            assert o["refused"] == [None] and o["state"] == "destroyed", o
            assert any("destroyed after the communicator was freed" in v for v in o["violations"]), o


# --- per-call config -----------------------------------------------------------------------------------------------

def _s_per_call_config(r: Rank) -> dict[str, Any]:
    pg = r.init(device_id=r.device, timeout=timedelta(seconds=20))
    out: dict[str, Any] = {}
    x = r.full((8,), r.rank + 1.0)
    pg.allreduce(x, config=CollConfig(min_ctas=2, max_ctas=4, algorithm="ring", profiler_tag=9)).wait()
    out["sum"] = float(r.host(x)[0])
    out["config_calls"] = ncclsim.world().calls.get("ncclAllReduceConfig", 0)
    for mine in ([CollConfig(algorithm="ring"), CollConfig(algorithm="tree")][r.rank],
                 CollConfig(max_ctas=4) if r.rank == 0 else None):
        try:
            pg.allreduce(x, config=mine)
            out.setdefault("mismatch", []).append(None)
        except DistBackendError as exc:
            out.setdefault("mismatch", []).append(str(exc))
    pg.allreduce(x).wait()
    out["after"] = float(r.host(x)[0])  # nothing was issued by the refused ones
    pg._detail = False  # without the check, only NCCL's own (local) validation remains
    pg.allreduce(x, config=[CollConfig(algorithm="ring"), CollConfig(algorithm="tree")][r.rank]).wait(
        timedelta(seconds=20))
    out["unchecked"] = simnccl.violations()
    simnccl.clear()
    dist.destroy_process_group()
    return out


def test_a_mismatched_per_call_config_is_caught(tmp_path: Any) -> None:
    """NCCL checks a per-call config only locally (nccl.h 2.32.3): the fingerprint check (NCCL_PG_DEBUG=detail)
    makes every rank raise before the collective, naming the ranks and the config; without it the simulation
    records what a GPU would not say."""
    for o in world(_s_per_call_config, 2, tmp_path, env={"NCCL_PG_DEBUG": "detail"}):
        assert o["sum"] == 3.0 and o["config_calls"] >= 1, o
        assert all(m is not None and "config" in m and "rank 1 issued" in m for m in o["mismatch"]), o
        assert o["after"] == 6.0, o
        assert o["unchecked"] and all("per-call config" in v for v in o["unchecked"]), o


def test_per_call_config_is_checked_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused on the caller's rank before anything is numbered or enqueued: what NCCL would find only inside the
    enqueue (leaving a nonblocking communicator in error), what it cannot take (send/recv-built collectives),
    a version without it."""
    with pytest.raises(ValueError, match="no NCCL algorithm"):
        CollConfig(algorithm="ring+nosuch")
    with pytest.raises(ValueError, match="min_ctas"):
        CollConfig(min_ctas=8, max_ctas=4)
    with pytest.raises(ValueError, match="profiler_tag"):
        CollConfig(profiler_tag=1 << 63)
    pg = simnccl.start_world1(1)
    try:
        from simnccl import xp

        x = xp.ones(4, dtype="float32")
        seq = pg._get_sequence_number_for_group()
        with pytest.raises(ValueError, match="selects no algorithm NCCL has for all_reduce"):
            pg.allreduce(x, config=CollConfig(algorithm="pat"))
        with pytest.raises(ValueError, match="selects no algorithm NCCL has for all_to_all"):
            pg.alltoall_base(x, xp.ones(4, dtype="float32"), config=CollConfig(algorithm="ring"))
        with pytest.raises(ValueError, match="grouped send/recv"):
            pg.alltoall_base(x, xp.ones(4, dtype="float32"), [4], [4], config=CollConfig(min_ctas=1))
        with pytest.raises(TypeError, match="nccl_pg.CollConfig"):
            pg.allreduce(x, config={"algorithm": "ring"})  # type: ignore[arg-type]
        assert pg._get_sequence_number_for_group() == seq + 1  # only the send/recv-built one reached its issue
        pg.allreduce(x, config=CollConfig(algorithm="pat", force_algorithm=False)).wait()
    finally:
        simnccl.stop_world1()
    simnccl.install()
    simnccl.set_version(23007)  # NCCL 2.30.7: no nccl*Config entry points, no launch marks
    pg = simnccl.start_world1(1)
    try:
        from simnccl import xp

        assert not pg._launch_marks
        with pytest.raises(DistBackendError, match=r"needs NCCL >= 2\.31\.2"):
            pg.allreduce(xp.ones(4, dtype="float32"), config=CollConfig(algorithm="ring"))
    finally:
        simnccl.set_version(simnccl.SIM_VERSION)
        simnccl.stop_world1()
    host = dist.ProcessGroup(dist.HashStore(), 0, 1, backend="host")
    try:
        import numpy as np

        y = np.ones(4, np.float32)
        host.allreduce(y, config=CollConfig(algorithm="ring", max_ctas=2)).wait()  # checked, then ignored
        with pytest.raises(ValueError, match="selects no algorithm"):
            host.allreduce(y, config=CollConfig(algorithm="pat"))
    finally:
        host.shutdown()


# --- exact "started" marks -------------------------------------------------------------------------------------------

def _s_started_marks(r: Rank, version: int) -> dict[str, Any]:
    simnccl.set_version(version)
    pg = r.init(device_id=r.device, timeout=timedelta(seconds=20))
    x = r.full((4,), 1.0)
    dist.all_reduce(x)
    out: dict[str, Any] = {"marks": pg._launch_marks, **started_while_waiting(r, x, 1.0)}
    out["config_calls"] = ncclsim.world().calls.get("ncclAllReduceConfig", 0)
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("version", [23203, 23102], ids=["2.32.3", "2.31.2"])
def test_started_marks_come_from_the_kernel_launch(tmp_path: Any, version: int) -> None:
    """NCCL >= 2.32.3: the launch-completion event marks the collective started (flight recorder, watchdog) while
    it still waits for a peer, with timing off; NCCL 2.31 has no such event, and without timing no mark."""
    out = world(_s_started_marks, 2, tmp_path, version=version)
    new = version >= 23203
    assert [o["marks"] for o in out] == [new, new]
    assert out[0]["while_waiting"] == (("started" if new else "scheduled"), False), out[0]
    assert out[0]["after"] == "completed"
    assert (out[0]["config_calls"] > 0) == new


# --- suspend and resume --------------------------------------------------------------------------------------------

def _s_suspend(r: Rank) -> dict[str, Any]:
    pg = r.init(device_id=r.device, timeout=timedelta(seconds=20))
    x = r.full((4,), 1.0)
    dist.all_reduce(x)
    out: dict[str, Any] = {"stats": pg.mem_stats()}
    # ordered: rank 0's operation in flight (rank 1 issues its part 0.5 s later) completes before the suspend
    if r.rank == 0:
        t0 = time.monotonic()
        work = dist.all_reduce(x, async_op=True)
        pg.suspend(timeout=10)
        out["ordered"] = (work.is_completed(), time.monotonic() - t0 >= 0.4)
    else:
        time.sleep(0.5)
        dist.all_reduce(x)
        pg.suspend(timeout=10)
    out["suspended"] = (pg.suspended, pg.mem_stats()["suspended"])
    try:
        dist.all_reduce(x)
    except DistBackendError as exc:
        out["while_suspended"] = str(exc)
    time.sleep(0.6)  # longer than nothing: a suspended group has nothing pending and is not stuck
    pg.resume(timeout=10)
    dist.all_reduce(x)
    out["resumed"] = (pg.mem_stats()["suspended"], float(r.host(x)[0]))
    # refused: rank 0's operation stays in flight past the suspend's deadline (rank 1 issues it afterwards)
    if r.rank == 0:
        work = dist.all_reduce(x, async_op=True)
        try:
            pg.suspend(timeout=0.5)
        except DistBackendError as exc:
            out["refused"] = str(exc)
        r.store().set("refused", b"1")
        work.wait()
    else:
        r.store().wait(["refused"], timedelta(seconds=30))
        dist.all_reduce(x)
    dist.all_reduce(x)
    out["after_refusal"] = (pg._state.value, float(r.host(x)[0]))
    # a rank that never suspends: the other's suspend fails at its deadline, and its communicator is aborted
    if r.rank == 0:
        t0 = time.monotonic()
        try:
            pg.suspend(timeout=1.0)
        except DistBackendError as exc:
            out["alone"] = (str(exc), time.monotonic() - t0, pg._state.value)
        r.store().set("alone", b"1")
    else:
        r.store().wait(["alone"], timedelta(seconds=30))
    dist.destroy_process_group()
    return out


def test_suspend_and_resume_with_operations_in_flight(tmp_path: Any) -> None:
    out = world(_s_suspend, 2, tmp_path, env={"NCCL_PG_DUMP_ON_TIMEOUT": "0"})
    for o in out:
        assert o["stats"] == {"suspendable_bytes": 1 << 20, "suspended": 0, "persistent_bytes": 64 << 10,
                              "total_bytes": (1 << 20) + (64 << 10)}, o
        assert o["suspended"] == (True, 1) and "is suspended (suspend()): call resume()" in o["while_suspended"], o
        assert o["resumed"] == (0, 8.0), o  # 1 -> 2 -> 4 (in flight at the suspend) -> 8
        assert o["after_refusal"] == ("open", 32.0), o
    assert out[0]["ordered"] == (True, True)
    assert "suspend refused: operations still in flight" in out[0]["refused"] and "ALLREDUCE seq" in out[0]["refused"]
    text, took, state = out[0]["alone"]
    assert "suspend" in text and took < 3.0 and state == "aborted", out[0]


def test_suspend_is_refused_where_it_means_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host backend holds no GPU memory; NCCL < 2.29.7 has no ncclCommSuspend; the blocking variant's
    operations communicator shares the control one's memory manager, which NCCL refuses."""
    host = dist.ProcessGroup(dist.HashStore(), 0, 1, backend="host")
    with pytest.raises(DistBackendError, match="no GPU memory to free"):
        host.suspend()
    host.shutdown()
    for version, variant, match in ((22905, "nonblocking", r"needs NCCL >= 2\.29\.7"),
                                    (simnccl.SIM_VERSION, "blocking", "share their memory manager")):
        monkeypatch.setenv("NCCL_PG_NCCL_OPS", variant)
        simnccl.install()
        simnccl.set_version(version)
        pg = simnccl.start_world1(1)
        try:
            with pytest.raises(DistBackendError, match=match):
                pg.suspend()
            from simnccl import xp

            pg.allreduce(xp.ones(4, dtype="float32")).wait()  # refused before NCCL: the group still works
        finally:
            simnccl.set_version(simnccl.SIM_VERSION)
            simnccl.stop_world1()


# --- the blocking variant's grow -------------------------------------------------------------------------------------

def test_the_blocking_variant_grows_through_a_fresh_communicator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its control communicator shares resources with its operations communicator, so a grow of it would reuse a
    proxy sized for the old ranks (init.cc initTransportsRank; the simulation's rule in test_nccl_sim_rules_2_32):
    the backend says it cannot grow natively, and the group layer builds a fresh communicator."""
    for variant, native in (("blocking", False), ("nonblocking", True)):
        monkeypatch.setenv("NCCL_PG_NCCL_OPS", variant)
        pg = simnccl.start_world1(1)
        try:
            assert pg._comm.supports_grow is native
        finally:
            simnccl.stop_world1()

"""The flight recorder on the host backend: the seed's NCCL trace tests
(test_c10d_nccl.py: NCCLTraceTestBase and its subclasses, NcclErrorDumpTest)
ported, plus dump options (only_active, stack traces, JSON).

Ranks are real processes: forked from a preloaded server (harness.forked) where a
rank returns its dump to the test, and started as plain interpreters where
the seed checks exit codes (timeouts, stuck ranks, errors). The seed's
"parent process" role (MAIN_PROCESS_RANK) is played by the test itself or by
another rank. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import pickle
import textwrap
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import pytest
from harness.forked import Rank, run_world
from harness.procs import run_scripts

import nccl_pg as dist
from nccl_pg.diagnostics.flight_recorder import dump_flight_recorder, dump_flight_recorder_json

WORLD = 2
THIS_FILE = os.path.basename(__file__)


def _env(tmp_path: Any, **extra: str) -> dict[str, str]:
    """What the seed's setUp sets (timing off, buffer 1000, dump on timeout, dump prefix)."""
    env = {"NCCL_PG_ENABLE_TIMING": "0", "NCCL_PG_TRACE_BUFFER_SIZE": "1000", "NCCL_PG_DUMP_ON_TIMEOUT": "1",
           "NCCL_PG_DEBUG_INFO_TEMP_FILE": str(tmp_path / "trace_"), "NCCL_PG_TRACE_STACKS": "1"}
    env.update(extra)
    return env


def _wait_until(cond: Any, what: str, timeout: float = 10.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"gave up after {timeout} s waiting for {what}")
        time.sleep(0.02)


def _trace(**kwargs: Any) -> dict[str, Any]:
    return pickle.loads(dump_flight_recorder(**kwargs))


def _started_or_scheduled(timing: bool) -> str:
    return "started" if timing else "scheduled"


# --- NCCLTraceTest -----------------------------------------------------------------------


def _short(r: Rank, timing: bool, include_collectives: bool) -> dict[str, Any]:
    pg = r.init()
    if timing:
        pg._enable_collectives_timing()
    a = r.full((3, 4), float(r.rank))
    for _ in range(2):
        f = pg.allreduce(a)
    f.wait()
    pg._wait_for_pending_works()
    if include_collectives:
        return _trace()
    return _trace(include_collectives=False, include_stack_traces=None, only_active=None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("include_collectives", [True, False])
@pytest.mark.parametrize("timing_enabled", [True, False])
def test_short(tmp_path: Any, timing_enabled: bool, include_collectives: bool) -> None:
    """Seed test_short (NCCLTraceTest): fields and states of a dump after two all_reduces."""
    before = datetime.now()
    t = run_world(_short, WORLD, tmp_path, env=_env(tmp_path), timing=timing_enabled,
                  include_collectives=include_collectives)[1]
    assert t["version"] == "2.10"
    pg_config = t["pg_config"]
    assert len(pg_config) == 1
    default_pg_info = pg_config["0"]
    assert {"name", "desc", "ranks"} <= set(default_pg_info)
    assert len(json.loads(default_pg_info["ranks"])) == WORLD
    assert t["pg_status"]["0"]["last_enqueued_collective"] == 2
    if not include_collectives:
        assert "entries" not in t
        return
    entries = t["entries"]
    assert len(entries) == 2
    last = entries[-1]
    assert last["process_group"] == ("0", "default_pg")
    assert last["state"] == "completed"
    s, f = last["time_discovered_started_ns"], last["time_discovered_completed_ns"]
    assert last["record_id"] == 1
    assert f is not None
    if timing_enabled:
        assert s is not None and s <= f
    assert THIS_FILE in str(last["frames"])
    assert last["input_sizes"] == [[3, 4]]
    assert last["input_dtypes"] == ["Float"]
    assert last["output_sizes"] == [[3, 4]]
    assert last["output_dtypes"] == ["Float"]
    assert last["collective_seq_id"] == 2
    assert last["timeout_ms"] == 600000
    created = datetime.fromtimestamp(last["time_created_ns"] / 1e9)
    assert before - timedelta(minutes=1) < created < datetime.now()
    if timing_enabled:
        assert last["duration_ms"] >= 0
    else:
        assert "duration_ms" not in last


def _dump_pipe(r: Rank) -> bool:
    pg = r.init()
    a = r.full((3, 4), float(r.rank))
    for _ in range(2):
        f = pg.allreduce(a)
    f.wait()
    found = True
    if r.rank == 1:  # the seed's parent process: ask rank 0 for a dump through its pipe
        dump_file = os.environ["NCCL_PG_DEBUG_INFO_TEMP_FILE"] + "0"
        pipe = dump_file + ".pipe"
        _wait_until(lambda: os.path.exists(pipe), "rank 0's dump pipe")
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)  # fails at once (ENXIO) if nobody reads it
        try:
            os.write(fd, b"1\n")
        finally:
            os.close(fd)
        _wait_until(lambda: os.path.exists(dump_file), "rank 0's dump")
        with open(dump_file, "rb") as fh:
            found = "all_reduce" in str(pickle.load(fh))
    pg.barrier().wait()  # rank 0 stays in the group (its pipe open) until rank 1 has read the dump
    return found


@pytest.mark.timeout(60)
def test_dump_pipe(tmp_path: Any) -> None:
    """Seed test_dump_pipe (NCCLTraceTest): a byte written to <prefix><rank>.pipe makes that rank dump."""
    assert run_world(_dump_pipe, WORLD, tmp_path, env=_env(tmp_path)) == [True, True]
    assert not os.path.exists(str(tmp_path / "trace_1"))  # only the rank asked through its pipe dumped


def _signal_dump(r: Rank) -> bool:
    from nccl_pg.group import watchdog

    pg = r.init()
    pg.allreduce(r.full((3, 4), 1.0)).wait()
    found = True
    if r.rank == 0:  # as FLIGHT_RECORDER.md documents: ask every other rank on pg's store for its dump
        watchdog.get().signal_dump(pg, "asked by rank 0")
        dump_file = os.environ["NCCL_PG_DEBUG_INFO_TEMP_FILE"] + "1"
        _wait_until(lambda: os.path.exists(dump_file), "rank 1's dump")
        with open(dump_file, "rb") as fh:
            found = "all_reduce" in str(pickle.load(fh))
    pg.barrier().wait()  # rank 1 stays in the group until rank 0 has read its dump
    return found


@pytest.mark.timeout(60)
def test_signal_dump_makes_the_other_ranks_dump(tmp_path: Any) -> None:
    """watchdog.get().signal_dump(pg, reason), as documented: every other rank sharing pg's store dumps."""
    assert run_world(_signal_dump, WORLD, tmp_path, env=_env(tmp_path)) == [True, True]
    assert not os.path.exists(str(tmp_path / "trace_0"))  # the asking rank writes its own only if it asks to


def _long(r: Rank) -> list[dict[str, Any]]:
    pg = r.init()
    a = r.full((3, 4), float(r.rank))
    for _ in range(2):
        # the other primitives, to see that their strings are valid
        xs = [r.array(np.ones((3, 4), np.float32))]
        pg.broadcast(xs).wait()
        pg.allreduce(xs).wait()
        pg.reduce(xs).wait()
        ys = [[r.array(np.empty((3, 4), np.float32)) for _ in range(r.world_size)]]
        pg.allgather(ys, xs).wait()
        pg.reduce_scatter(xs, ys).wait()
        f = pg.allreduce(a)
    f.wait()
    return _trace()["entries"]


@pytest.mark.timeout(60)
def test_long(tmp_path: Any) -> None:
    """Seed test_long (NCCLTraceTest): a buffer of 10 (torch's variable name) keeps the newest 10 of 12 ops."""
    env = _env(tmp_path, TORCH_NCCL_TRACE_BUFFER_SIZE="10")
    del env["NCCL_PG_TRACE_BUFFER_SIZE"]
    t = run_world(_long, WORLD, tmp_path, env=env)[0]
    assert len(t) == 10
    first, last = t[0], t[-1]
    assert [e["profiling_name"] for e in t[:5]] == ["nccl:reduce", "nccl:all_gather", "nccl:reduce_scatter",
                                                   "nccl:all_reduce", "nccl:broadcast"]
    assert last["profiling_name"] == "nccl:all_reduce"
    assert last["state"] == "completed"
    assert THIS_FILE in str(last["frames"])
    assert last["input_sizes"] == [[3, 4]]
    assert last["input_dtypes"] == ["Float"]
    assert last["output_sizes"] == [[3, 4]]
    assert last["output_dtypes"] == ["Float"]
    assert last["timeout_ms"] == 600000
    assert last["collective_seq_id"] - first["collective_seq_id"] == 9
    assert [e["record_id"] for e in t] == list(range(2, 12))


def _all_retired(r: Rank) -> list[dict[str, Any]]:
    pg = r.init()
    for _ in range(12):  # more works than the buffer holds
        pg.broadcast([r.array(np.ones((3, 4), np.float32))]).wait()
    pg._wait_for_pending_works()
    return _trace()["entries"]


@pytest.mark.timeout(60)
def test_trace_while_all_works_retired(tmp_path: Any) -> None:
    """Seed test_trace_while_all_works_retired (NCCLTraceTest): after the buffer wrapped, entries are retired+completed."""
    t = run_world(_all_retired, WORLD, tmp_path, env=_env(tmp_path, NCCL_PG_TRACE_BUFFER_SIZE="10"))[0]
    assert len(t) == 10
    last = t[-1]
    assert last["retired"] is True
    assert last["state"] == "completed"
    assert all(e["retired"] and e["state"] == "completed" for e in t)


def _last_state(want: str) -> Any:
    def check() -> Any:
        entries = _trace()["entries"]
        return entries if entries and entries[-1]["state"] == want else None
    return check


def _while_active(r: Rank, timing: bool, only_active: bool) -> list[dict[str, Any]]:
    pg = r.init()
    if timing:
        pg._enable_collectives_timing()
    a = r.full((3, 4), float(r.rank))
    pg.allreduce(a).wait()
    pending = None
    if r.rank != 0:
        pending = pg.allreduce(a)  # rank 0 has not joined: in flight
        if timing:  # the watchdog sees the start event fire within a poll or so
            _wait_until(_last_state("started"), "the watchdog to mark the all_reduce started")
    t = _trace(only_active=only_active)["entries"]
    store = r.store()
    store.set(f"dumped/{r.rank}", "1")
    if r.rank == 0:
        store.wait([f"dumped/{q}" for q in range(1, r.world_size)], timedelta(seconds=30))
        pg.allreduce(a).wait()
    else:
        assert pending is not None
        pending.wait()
    return t


@pytest.mark.timeout(60)
@pytest.mark.parametrize("only_active", [True, False])
@pytest.mark.parametrize("timing_enabled", [True, False])
def test_trace_while_active(tmp_path: Any, timing_enabled: bool, only_active: bool) -> None:
    """Seed test_trace_while_active (NCCLTraceTest): dump while rank 1's second all_reduce waits for rank 0."""
    t0, t1 = run_world(_while_active, WORLD, tmp_path, env=_env(tmp_path), timing=timing_enabled,
                       only_active=only_active)
    if only_active:
        assert len(t0) == 0
        assert len(t1) == 1
    else:
        assert t0[-1]["profiling_name"] == "nccl:all_reduce"
        assert t0[-1]["collective_seq_id"] == 1
        assert t0[-1]["state"] == "completed"
        assert t1[-1]["profiling_name"] == "nccl:all_reduce"
        assert t1[-1]["collective_seq_id"] == 2
        assert t1[-1]["state"] == _started_or_scheduled(timing_enabled)
    if only_active:
        assert t1[0]["collective_seq_id"] == 2 and t1[0]["state"] == _started_or_scheduled(timing_enabled)


def _while_stuck(r: Rank, timing: bool) -> dict[str, Any]:
    pg = r.init()
    if timing:
        pg._enable_collectives_timing()
    a = r.full((3, 4), float(r.rank))
    pg.allreduce(a).wait()
    store = r.store()
    seen: dict[str, Any] = {}

    def gather_trace() -> None:
        try:
            if r.rank != 0:  # wait until this rank is stuck in its second all_reduce
                want = _started_or_scheduled(timing)
                _wait_until(lambda: _trace()["entries"][-1]["collective_seq_id"] == 2
                            and _trace()["entries"][-1]["state"] == want, "the stuck all_reduce in the dump")
                time.sleep(0.3)  # stays stuck: nothing completes it while rank 0 is away
            seen["last"] = _trace()["entries"][-1]
        except BaseException as exc:
            seen["error"] = repr(exc)
        finally:
            # lets rank 0, which is missing, go on, which unblocks the others
            store.set(f"traced/{r.rank}", "1")

    if r.rank != 0:
        th = threading.Thread(target=gather_trace)
        th.start()
        pg.allreduce(a).wait()  # stuck here until rank 0 joins, while the thread dumps
        th.join(30)
    else:
        gather_trace()
        store.wait([f"traced/{q}" for q in range(1, r.world_size)], timedelta(seconds=30))
        pg.allreduce(a).wait()
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timing_enabled", [True, False])
def test_trace_while_stuck(tmp_path: Any, timing_enabled: bool) -> None:
    """Seed test_trace_while_stuck (NCCLTraceTest): another thread dumps while the main thread is stuck in wait()."""
    s0, s1 = run_world(_while_stuck, WORLD, tmp_path, env=_env(tmp_path), timing=timing_enabled)
    assert "error" not in s0 and "error" not in s1, (s0, s1)
    assert s0["last"]["profiling_name"] == "nccl:all_reduce"
    assert s0["last"]["collective_seq_id"] == 1
    assert s0["last"]["state"] == "completed"
    last = s1["last"]
    assert last["profiling_name"] == "nccl:all_reduce"
    assert last["collective_seq_id"] == 2
    assert last["state"] == _started_or_scheduled(timing_enabled)
    assert last["time_discovered_completed_ns"] is None
    assert last["retired"] is False


def _send_recv(r: Rank, op_sizes: list[tuple[int, ...]], timing: bool) -> list[dict[str, Any]]:
    pg = r.init()
    if timing:
        pg._enable_collectives_timing()
    for _ in range(10):
        for input_sizes in op_sizes:
            tensor = r.array(np.zeros(input_sizes, np.float32))
            if r.rank == 0:
                dist.recv(tensor, 1)
            elif r.rank == 1:
                tensor *= 2
                dist.send(tensor, 0)
    pg._wait_for_pending_works()
    return _trace()["entries"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timing_enabled", [True, False])
@pytest.mark.parametrize("op_sizes", [[(2, 3)], [(2, 3), (5, 5), (1,)]], ids=["one_size", "three_sizes"])
def test_individual_send_recv(tmp_path: Any, op_sizes: list[tuple[int, ...]], timing_enabled: bool) -> None:
    """Seed test_individual_send_recv (NCCLTraceTest): one entry per send/recv, numbered by p2p_seq_id and op_id."""
    results = run_world(_send_recv, WORLD, tmp_path, env=_env(tmp_path), op_sizes=op_sizes, timing=timing_enabled)
    for rank, t in enumerate(results):
        assert len(t) == 10 * len(op_sizes)
        profiling_name = "nccl:recv 0<-1" if rank == 0 else "nccl:send 1->0"
        for seq, e in enumerate(t):
            input_sizes = list(op_sizes[seq % len(op_sizes)])
            assert e["profiling_name"] == profiling_name
            assert e["p2p_seq_id"] == seq + 1
            assert e["op_id"] == seq + 1
            assert e["collective_seq_id"] == 0
            assert e["is_p2p"] is True
            assert e["input_sizes"] == [input_sizes]
            assert e["output_sizes"] == [input_sizes]
            assert e["state"] == "completed"
            if timing_enabled:
                assert e["duration_ms"] >= 0
            else:
                assert "duration_ms" not in e


def _coalescing_manager(r: Rank, timing: bool) -> dict[str, Any]:
    pg = r.init()
    if timing:
        pg._enable_collectives_timing()
    output_tensors = np.zeros((2, 2), np.float32)
    input_tensors = [np.ones((2, 2), np.float32) for _ in range(r.world_size)]
    assert r.world_size == 2
    with dist._coalescing_manager():
        for i in range(r.world_size):
            dist.reduce_scatter_tensor(output_tensors[i], input_tensors[i])
    np.testing.assert_array_equal(output_tensors, input_tensors[r.rank] * r.world_size)
    pg._wait_for_pending_works()
    return _trace()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timing_enabled", [True, False])
def test_coalescing_manager_collective(tmp_path: Any, timing_enabled: bool) -> None:
    """Seed test_coalescing_manager_collective (NCCLTraceTest): one "reduce_scatter_tensor_coalesced" entry."""
    t = run_world(_coalescing_manager, WORLD, tmp_path, env=_env(tmp_path), timing=timing_enabled)[0]
    assert len(t["entries"]) == 1
    e = t["entries"][0]
    assert e["profiling_name"] == "nccl:reduce_scatter_tensor_coalesced"
    assert e["collective_seq_id"] == 1
    assert e["input_sizes"] == [[2, 2], [2, 2]]
    assert e["output_sizes"] == [[2], [2]]
    assert e["state"] == "completed"
    if timing_enabled:
        assert e["duration_ms"] >= 0
    else:
        assert "duration_ms" not in e


# --- dump options (no seed of their own: the keyword arguments of _dump_nccl_trace) ---------------


def _options(r: Rank) -> dict[str, Any]:
    pg = r.init()
    a = r.full((3, 4), 1.0)
    pg.allreduce(a).wait()
    pending = pg.allreduce(a) if r.rank == 1 else None  # in flight until rank 0 joins
    if pending is not None:
        _wait_until(lambda: len(_trace()["entries"]) == 2, "the second all_reduce in the recorder")
    out = {"default": _trace(), "no_stacks": _trace(include_stack_traces=False), "active": _trace(only_active=True),
           "json": json.loads(dump_flight_recorder_json(only_active=True))}
    r.store().set(f"dumped/{r.rank}", "1")
    if r.rank == 0:
        r.store().wait(["dumped/1"], timedelta(seconds=30))
        pg.allreduce(a).wait()
    else:
        assert pending is not None
        pending.wait()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stacks", [True, False])
def test_dump_options_only_active_and_stack_traces(tmp_path: Any, stacks: bool) -> None:
    """Seed _dump_nccl_trace keywords (NCCLTraceTest): only_active, include_stack_traces; NCCL_PG_TRACE_STACKS frames."""
    results = run_world(_options, WORLD, tmp_path, env=_env(tmp_path, NCCL_PG_TRACE_STACKS=str(int(stacks))))
    d = results[1]
    frames = d["default"]["entries"][-1]["frames"]
    if stacks:
        assert frames and {"name", "filename", "line"} <= set(frames[0])
        assert any(f["filename"].endswith(THIS_FILE) and f["name"] == "_options" for f in frames)
        assert not any(f["filename"].endswith(os.path.join("nccl_pg", "flight_recorder.py")) for f in frames)
    else:
        assert frames == []
    assert all(e["frames"] == [] for e in d["no_stacks"]["entries"])
    assert [e["collective_seq_id"] for e in d["active"]["entries"]] == [2]
    assert results[0]["active"]["entries"] == []
    j = d["json"]
    assert j["version"] == "2.10" and j["pg_config"]["0"]["desc"] == "default_pg"
    (entry,) = j["entries"]
    assert entry["state"] == "scheduled" and entry["time_discovered_completed_ns"] == 0
    assert entry["process_group"] == ["0", "default_pg"]


def _recorder_off(r: Rank) -> dict[str, Any]:
    pg = r.init()
    pg.allreduce(r.full((3, 4), 1.0)).wait()
    return _trace()


@pytest.mark.timeout(60)
def test_recorder_off(tmp_path: Any) -> None:
    """Seed: none (NCCL_PG_TRACE_BUFFER_SIZE=0, torch's "0 disables it"): no entries, the group config still dumped."""
    t = run_world(_recorder_off, WORLD, tmp_path, env=_env(tmp_path, NCCL_PG_TRACE_BUFFER_SIZE="0"))[0]
    assert t["entries"] == []
    assert t["pg_config"]["0"]["ranks"] == "[0, 1]"
    assert t["pg_status"]["0"]["last_completed_collective"] == 1


# --- NCCLTraceTestDumpOnTimeout, NCCLTraceTestTimeoutDumpOnStuckRanks, NcclErrorDumpTest ----------
# These ranks end with SIGABRT, as the seed's: plain interpreters, exit codes checked.

_PRELUDE = '''
import os, sys, time
import numpy as np
import nccl_pg as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.FileStore(os.environ["TEST_STORE"], world)
prefix = os.environ["NCCL_PG_DEBUG_INFO_TEMP_FILE"]

def wait_for(path, timeout=30.0):
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no {path} after {timeout} s")
        time.sleep(0.05)
'''


def spawn_world(body: str, world: int, tmp_path: Any, env: Mapping[str, str],
                rank_env: Mapping[int, Mapping[str, str]] | None = None,
                timeout: float = 45.0) -> list[tuple[int, str]]:
    """Run ``body`` (after _PRELUDE) in ``world`` interpreters; returns each
    rank's (exit code, output). Ranks still running at ``timeout`` are
    killed (and the test fails)."""
    script = tmp_path / "rank.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    return run_scripts(script, world, {**env, "TEST_STORE": str(tmp_path / f"store.{time.monotonic_ns()}")},
                       rank_env, timeout)


def _load(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)


_TIMEOUT_BODY = '''
dist.init_process_group("host", store=store, rank=rank, world_size=world, timeout=1)
pg = dist.distributed._get_default_group()
if os.environ.get("TIMING") == "1":
    pg._enable_collectives_timing()
a = np.full((3, 4), float(rank), np.float32)
pg.allreduce(a).wait()
if rank == 0:
    pg.allreduce(a).wait()  # rank 1 never joins: times out, dumps, ends the process (mode 3)
    sys.exit(7)  # not reached
'''


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timing_enabled", [True, False])
def test_timeout_dumps(tmp_path: Any, timing_enabled: bool) -> None:
    """Seed test_timeout_dumps (NCCLTraceTestDumpOnTimeout): rank 0 times out, dumps, aborts (-6); rank 1 exits 0.

    Divergence: the seed's rank 1 has exited before the timeout and leaves no
    dump; here leaving would break rank 0's connection (an error, not a
    timeout), so rank 1 stays until the store signal has made it dump too."""
    body = _TIMEOUT_BODY + '''
else:
    wait_for(prefix + "1")  # written when rank 0's timeout signals every rank
'''
    env = _env(tmp_path, TIMING=str(int(timing_enabled)), NCCL_PG_ASYNC_ERROR_HANDLING="3")
    (rc0, out0), (rc1, out1) = spawn_world(body, WORLD, tmp_path, env, rank_env={
        1: {"NCCL_PG_ASYNC_ERROR_HANDLING": "0"}})
    assert rc0 == -6, out0
    assert rc1 == 0, out1
    t = _load(str(tmp_path / "trace_0"))
    assert "timeout" in t["reason"]
    entries = t["entries"]
    assert len(entries) == 2
    assert entries[0]["collective_seq_id"] == 1
    assert entries[0]["state"] == "completed"
    assert entries[1]["collective_seq_id"] == 2
    assert entries[1]["state"] == _started_or_scheduled(timing_enabled)
    t1 = _load(str(tmp_path / "trace_1"))
    assert t1["reason"].startswith("signalled: timeout of all_reduce #2")
    assert [e["collective_seq_id"] for e in t1["entries"]] == [1]


@pytest.mark.timeout(60)
def test_timeout_dumps_on_stuck_ranks(tmp_path: Any) -> None:
    """Seed test_timeout_dumps_on_stuck_ranks (NCCLTraceTestTimeoutDumpOnStuckRanks): the idle rank dumps on the signal.

    Divergence: the seed's rank 1 is then ended (-6) by torch's heartbeat
    monitor, which terminates every process that dumped on a signal; our
    watchdog only dumps (the job decides), so rank 1 exits 0 once its dump
    is there."""
    body = _TIMEOUT_BODY + '''
else:
    wait_for(prefix + "1")  # idle, not in any collective: dumps when rank 0's timeout signals
'''
    env = _env(tmp_path, NCCL_PG_ASYNC_ERROR_HANDLING="3")
    (rc0, out0), (rc1, out1) = spawn_world(body, WORLD, tmp_path, env)
    assert rc0 == -6, out0
    assert rc1 == 0, out1
    assert os.path.exists(tmp_path / "trace_0") and os.path.exists(tmp_path / "trace_1")
    assert len(_load(str(tmp_path / "trace_0"))["entries"]) == 2
    t = _load(str(tmp_path / "trace_1"))["entries"]
    assert len(t) == 1
    assert t[0]["collective_seq_id"] == 1
    assert t[0]["state"] == "completed"


@pytest.mark.timeout(60)
def test_nccl_errors_dump(tmp_path: Any) -> None:
    """Seed test_nccl_errors_dump (NcclErrorDumpTest): rank 1 exits (1); rank 0's all_reduce fails, it dumps and aborts (-6)."""
    body = '''
pg = dist.ProcessGroupHost(store, rank, world, dist.Options(timeout=10))
pg.allreduce(np.random.rand(10)).wait()
if rank == 0:
    work = pg.allreduce(np.random.rand(10))
    try:
        work.wait()  # the error ends the process first (mode 1): abort the communicator, SIGABRT
    except dist.DistBackendError:
        pass
    time.sleep(10)
    sys.exit(7)  # not reached
else:
    del pg
    sys.exit(1)
'''
    env = _env(tmp_path, TORCH_NCCL_ASYNC_ERROR_HANDLING="1", TORCH_NCCL_TRACE_BUFFER_SIZE="1000",
               TORCH_NCCL_DUMP_ON_TIMEOUT="1")
    for name in ("NCCL_PG_TRACE_BUFFER_SIZE", "NCCL_PG_DUMP_ON_TIMEOUT"):
        del env[name]
    (rc0, out0), (rc1, out1) = spawn_world(body, WORLD, tmp_path, env)
    assert rc0 == -6, out0
    assert rc1 == 1, out1
    assert os.path.exists(tmp_path / "trace_0")
    t = _load(str(tmp_path / "trace_0"))
    assert "lost the connection to rank 1" in t["reason"]
    assert [(e["collective_seq_id"], e["state"]) for e in t["entries"]] == [(1, "completed"), (2, "scheduled")]

"""Stragglers before hangs (issue 24 item 6): from the flight recorder's
timestamps, the rank that is consistently last at collectives is named,
with how late it is, and a job without one names nobody.

Real jobs of three processes on the host backend: rank 1 delayed on purpose
(a slow step before each all_reduce: the fault under test), the same job
without the delay, and the delayed job with timing on (start and end events,
the duration path that GPU jobs take; on the host backend the events are its
streams', so this proves the arithmetic, not GPU behaviour). Clock offsets
between hosts cannot be made real on one machine: that case is built by
hand.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from harness.trace_dumps import NCCL_PG, entry, run_trace, spawn_world, torch_dump, write

from nccl_pg.diagnostics import trace
from nccl_pg.diagnostics.trace import stragglers

_STEPS = 12
_DELAY_S = 0.05

# Each rank runs _STEPS all_reduces; the rank named in LATE_RANK sleeps DELAY_S before each (its slow step).
# Every rank then writes its dump the library's way (host, pid, threads).
_JOB = NCCL_PG + '''
from nccl_pg.group import watchdog
dist.init_process_group("host", store=store, rank=rank, world_size=world, timeout=30)
a = np.ones(1024, np.float32)
delay = float(os.environ["DELAY_S"]) if rank == int(os.environ["LATE_RANK"]) else 0.0
for _ in range(int(os.environ["STEPS"])):
    time.sleep(delay)  # the slow step of the late rank (0 for the others)
    dist.all_reduce(a)
dist.barrier()
watchdog.get().write_dump("end of run", rank)
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each job run once: {name: dump folder}."""
    root = tmp_path_factory.mktemp("stragglers")
    out = {}
    for name, delay, timing in (("late", _DELAY_S, "0"), ("healthy", 0.0, "0"), ("late_timed", _DELAY_S, "1")):
        env = {"DELAY_S": str(delay), "LATE_RANK": "1", "STEPS": str(_STEPS), "NCCL_PG_ENABLE_TIMING": timing}
        results = spawn_world(_JOB, 3, root / name, env=env, timeout=60)
        assert [c for c, _ in results] == [0, 0, 0], results
        out[name] = root / name
    return out


def _find(directory: Path) -> stragglers.Stragglers:
    dumps, unreadable = trace.load(trace.find_dumps(str(directory))[0])
    assert not unreadable and sorted(dumps) == [0, 1, 2]
    return stragglers.find(dumps)


@pytest.mark.timeout(120)
def test_delayed_rank_is_named(jobs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1, 50 ms late before every all_reduce, is named by issue times: last at nearly every collective,
    by about 50 ms; the others are not. The trace report says so."""
    found = _find(jobs["late"])
    assert found.method == "issue times" and found.collectives == _STEPS + 1  # the barrier too
    (late,) = found.stragglers
    assert late.rank == 1 and late.host == socket.gethostname() and late.pid is not None
    assert late.last >= _STEPS - 1 and 0.8 * _DELAY_S * 1e3 <= late.median_ms <= 4 * _DELAY_S * 1e3, late
    assert found.clock_offsets_ms == {socket.gethostname(): 0.0}  # one host: one clock, nothing taken out
    code, out = run_trace(jobs["late"], capsys=capsys)
    assert code == 0  # a straggler is not (yet) a problem: the job is consistent
    assert f"  straggler: rank 1 (host {socket.gethostname()}, pid {late.pid}) arrived last at {late.last} of " \
           f"{late.collectives} collectives of group '0', {late.median_ms:.1f} ms after the first rank" in out, out
    assert late.group == "0" and late.straggler and 0.0 <= late.score < 0.5, late  # its group waits for it


@pytest.mark.timeout(120)
def test_job_without_delay_names_nobody(jobs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The same job without the delay: no straggler, and the report says who was most often last, by how little."""
    found = _find(jobs["healthy"])
    assert found.collectives == _STEPS + 1 and found.stragglers == [], found.as_dict()
    assert all(r.median_ms < stragglers.THRESHOLD_MS for r in found.ranks.values()), found.as_dict()
    _, out = run_trace(jobs["healthy"], capsys=capsys)
    assert "  none: no rank is consistently last at a group's collectives; most often last: rank " in out, out


@pytest.mark.timeout(120)
def test_delayed_rank_is_named_from_durations(jobs: dict[str, Path]) -> None:
    """With timing on, every entry has a duration between its start and end events: the late rank spent the
    least time in each collective, and is named from that alone (no clock compared)."""
    found = _find(jobs["late_timed"])
    assert found.method == "gpu events", found.as_dict()
    (late,) = found.stragglers
    assert late.rank == 1 and late.last >= _STEPS - 1 and late.median_ms >= 0.8 * _DELAY_S * 1e3, late


def _timed(record_id: int, seq: int, created_ms: float, completed_ms: float) -> dict[str, object]:
    return entry(record_id, seq, time_created_ns=int(created_ms * 1e6),
                 time_discovered_completed_ns=int(completed_ms * 1e6))


@pytest.mark.timeout(30)
def test_hand_built_clock_offset_between_hosts(tmp_path: Path) -> None:
    """HAND-BUILT: host "b"'s clock is 10 s ahead of host "a"'s. Rank 1 (on a) arrives 30 ms late at every
    collective; the offset is estimated from the completion times and taken out, so rank 2 (on b, whose raw
    issue times are 10 s later) is not named, rank 1 is. Without completion times nothing can tell the
    offset: the clocks are taken as synchronized (so host b's rank looks late) and a note says so."""
    skew, step = 10_000.0, 100.0
    dumps = {}
    for rank, host, late, offset in ((0, "a", 0.0, 0.0), (1, "a", 30.0, 0.0), (2, "b", 0.0, skew)):
        entries = [_timed(i, i + 1, i * step + late + offset + 0.1 * rank, i * step + 50 + offset) for i in range(8)]
        dumps[rank] = {**torch_dump(entries), "host": host, "rank": rank}
    loaded, _ = trace.load(trace.find_dumps(str(write(tmp_path / "skew", dumps)))[0])
    found = stragglers.find(loaded)
    assert [s.rank for s in found.stragglers] == [1] and abs(found.stragglers[0].median_ms - 30) < 1
    assert abs(found.clock_offsets_ms["b"] - skew) < 1 and found.clock_offsets_ms["a"] == 0.0
    for d in dumps.values():
        for e in d["entries"]:
            e["time_discovered_completed_ns"] = None
    loaded, _ = trace.load(trace.find_dumps(str(write(tmp_path / "blind", dumps)))[0])
    found = stragglers.find(loaded)
    assert [s.rank for s in found.stragglers] == [2]  # what synchronized clocks would mean
    assert any("taken as synchronized" in n for n in found.notes), found.notes

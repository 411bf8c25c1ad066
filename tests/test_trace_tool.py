"""``nccl-pg trace`` (nccl_pg/diagnostics/trace/) on the dumps of real runs.

Faulty runs are real worlds of processes on the host backend (a rank that
skips a collective, ranks that disagree on a size, a rank killed); the dumps
come from the library itself (dump on timeout, on error, through the store
signal) or from ``dump_flight_recorder()`` at the end of a healthy run. The
verdict must name the right rank and operation, and the exit status must say
whether anything is wrong. PyTorch interop: a dump written by torch's own
(Gloo) flight recorder is read, and torch's analyzer reads ours, when torch
is installed (skipped otherwise: CI has no torch); a dump built by hand to
PyTorch's documented layout is read always.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness.trace_dumps import NCCL_PG, entry, problems, report_of, run_trace, spawn_world, torch_dump, write
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nccl_pg.cli import main as cli
from nccl_pg.diagnostics import trace

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="needs torch (make install-test installs its CPU build)")


# --- runs ------------------------------------------------------------------------------------

_CONSISTENT = NCCL_PG + '''
dist.init_process_group("host", store=store, rank=rank, world_size=world, timeout=30)
sub = dist.new_group([0, 1])
a = np.full((3, 4), float(rank), np.float32)
dist.all_reduce(a)
dist.broadcast(a, src=0)
dist.all_gather([np.zeros((3, 4), np.float32) for _ in range(world)], a)
dist.reduce_scatter_tensor(np.zeros(3, np.float32), np.ones(3 * world, np.float32))
if rank in (0, 1):
    dist.all_reduce(a, group=sub)
right, left = (rank + 1) % world, (rank - 1) % world
works = dist.batch_isend_irecv([dist.P2POp(dist.isend, np.ones(4, np.float32), right),
                                dist.P2POp(dist.irecv, np.zeros(4, np.float32), left)])
for w in works:
    w.wait()
if rank == 0:
    dist.send(np.ones(2, np.float32), 2)
elif rank == 2:
    dist.recv(np.zeros(2, np.float32), 0)
with dist._coalescing_manager():
    dist.all_reduce(a)
    dist.all_reduce(a)
dist.barrier()
dist._get_default_group()._wait_for_pending_works()
if rank == 2:  # one rank as JSON: the tool reads both
    with open(prefix + "2.json", "w") as f:
        f.write(dump_flight_recorder_json())
else:
    with open(prefix + str(rank), "wb") as f:
        f.write(dump_flight_recorder())
dist.destroy_process_group()
'''

# Rank 2 skips the world's second all_reduce and enters the second all_reduce of group [1, 2]
# instead, which rank 1 never issues: both time out (2 s) and every rank dumps.
_SKIP = NCCL_PG + '''
dist.init_process_group("host", store=store, rank=rank, world_size=world, timeout=30)
sub = dist.new_group([1, 2])
a = np.full((3, 4), float(rank), np.float32)
dist.all_reduce(a)
if rank in (1, 2):
    dist.all_reduce(a, group=sub)  # the communicators exist: what follows times out in the collectives
dist._set_pg_timeout(2)
dist._set_pg_timeout(2, sub)
w = dist.all_reduce(a, group=sub, async_op=True) if rank == 2 else dist.all_reduce(a, async_op=True)
try:
    w.wait()
except dist.DistBackendError as exc:
    print("expected:", exc)
wait_for([prefix + str(r) for r in range(world)])
'''

# Rank 1's second all_reduce has 5 elements, the others' 4: the host backend fails it; every rank dumps.
_SIZES = NCCL_PG + '''
dist.init_process_group("host", store=store, rank=rank, world_size=world, timeout=10)
dist.all_reduce(np.ones(4, np.float32))
try:
    dist.all_reduce(np.ones(5 if rank == 1 else 4, np.float32))
except dist.DistBackendError as exc:
    print("expected:", exc)
wait_for([prefix + str(r) for r in range(world)])
'''

# Rank 2 is killed (SIGKILL) after the first all_reduce; the others' second one fails: they dump, it cannot.
_KILLED = NCCL_PG + '''
import signal
dist.init_process_group("host", store=store, rank=rank, world_size=world, timeout=3)
dist.all_reduce(np.ones(4, np.float32))
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    dist.all_reduce(np.ones(4, np.float32))
except dist.DistBackendError as exc:
    print("expected:", exc)
wait_for([prefix + str(r) for r in range(2)])
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[tuple[int, str]]]]:
    """Each scenario run once: {name: (dump directory, per-rank (exit code, output))}."""
    root = tmp_path_factory.mktemp("trace_runs")
    return {name: (root / name, spawn_world(body, 3, root / name))
            for name, body in (("consistent", _CONSISTENT), ("skip", _SKIP), ("sizes", _SIZES),
                               ("killed", _KILLED))}


def _ran(run: tuple[Path, list[tuple[int, str]]], codes: list[int]) -> Path:
    directory, results = run
    assert [c for c, _ in results] == codes, "\n".join(f"--- rank {r}: {c}\n{o}" for r, (c, o) in enumerate(results))
    return directory


@pytest.mark.timeout(90)
def test_consistent_run_exits_0(runs: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A healthy run (collectives, a subgroup, p2p, coalescing; one dump as JSON): no problem, exit 0."""
    directory = _ran(runs["consistent"], [0, 0, 0])
    code, out = run_trace(directory, capsys=capsys)
    assert code == 0, out
    assert "OK:" in out
    code, report = report_of(directory, capsys=capsys)
    assert code == 0 and report["ok"] and report["problems"] == []
    assert sorted(os.listdir(directory)) == ["trace_0", "trace_1", "trace_2.json"]  # no pipe or temp file left
    assert report["ranks"] == [0, 1, 2] and report["ranks_without_dump"] == []
    assert {g["name"]: g["ranks"] for g in report["groups"]}["0"] == [0, 1, 2]
    assert sorted(g["ranks"] for g in report["groups"]) == [[0, 1], [0, 1, 2]]


@pytest.mark.timeout(90)
def test_rank_skipping_a_collective(runs: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 2 skips all_reduce #2 of the world for a subgroup's: named missing, and where it is instead."""
    directory = _ran(runs["skip"], [0, 0, 0])
    code, report = report_of(directory, capsys=capsys)
    assert code == 1
    missing = {(p["group"], p["seq"], p["op"]): p for p in problems(report, "ranks_missing")}
    sub = next(g["name"] for g in report["groups"] if g["ranks"] == [1, 2])
    world = missing[("0", 2, "all_reduce")]
    assert world["ranks"] == [2] and world["present"] == [0, 1]
    (where,) = world["where"]
    assert where["current"]["group"] == sub and where["current"]["op"] == "all_reduce"
    assert where["current"]["state"] != "completed"
    assert where["last_on_group"] == {"op": "all_reduce", "seq": 1, "state": "completed"}
    crossed = missing[(sub, 2, "all_reduce")]
    assert crossed["ranks"] == [1] and crossed["where"][0]["current"]["group"] == "0"
    assert {(p["group"], p["seq"]) for p in problems(report, "not_completed")} == {("0", 2), (sub, 2)}
    assert report["first_incomplete"]["seq"] == 2
    code, out = run_trace(directory, capsys=capsys)
    assert code == 1
    assert "rank 2 never joined all_reduce #2 on group '0' (default_pg), which ranks 0, 1 have issued" in out
    assert f"rank 2 (host {socket.gethostname()}, pid {where['pid']}) is in all_reduce #2 on group {sub!r}" in out
    # where rank 2 is now: the user's line that waits on the collective, in the script the ranks ran
    script = directory.parent / "skip.py"
    line = script.read_text().splitlines().index("    w.wait()") + 1
    assert (where["at"]["file"], where["at"]["line"], where["at"]["source"]) == (str(script), line, "python")
    assert f"at {script}:{line} in <module>: w.wait()" in out
    assert "first collective that did not complete anywhere" in out
    assert f"rank 2 (host {socket.gethostname()}, pid {where['pid']}, at {script}:{line} in <module>): missing " \
           f"from all_reduce #2 on group '0'" in report["verdict"], report["verdict"]


@pytest.mark.timeout(90)
def test_mismatched_sizes(runs: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1 all_reduces 5 elements where the others have 4: a size mismatch naming rank 1 and all_reduce #2."""
    directory = _ran(runs["sizes"], [0, 0, 0])
    code, report = report_of(directory, capsys=capsys)
    assert code == 1
    (size,) = problems(report, "size_mismatch")
    assert size["ranks"] == [1] and size["op"] == "all_reduce" and size["seq"] == 2
    assert size["values"] == {"0": [[4]], "1": [[5]], "2": [[4]]}
    assert problems(report, "ranks_missing") == [] and problems(report, "op_mismatch") == []
    (stuck,) = problems(report, "not_completed")
    assert stuck["seq"] == 2 and "failed" in stuck["states"].values()
    _, out = run_trace(directory, capsys=capsys)
    assert "all_reduce #2 on group '0' (default_pg): input sizes differ between ranks (ranks 0, 2: [[4]]; " \
           "rank 1: [[5]])" in out
    assert report["verdict"].startswith("look at rank 1: sizes of all_reduce #2 on group '0'")


@pytest.mark.timeout(90)
def test_killed_rank_has_no_dump(runs: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 2 killed: reported as a rank without a dump; the all_reduce it left behind did not complete."""
    directory = _ran(runs["killed"], [0, 0, -9])
    code, report = report_of(directory, capsys=capsys)
    assert code == 1
    assert report["ranks"] == [0, 1] and report["expected_ranks"] == [0, 1, 2]
    assert report["ranks_without_dump"] == [2]
    (no_dump,) = problems(report, "no_dump")
    assert no_dump["ranks"] == [2]
    (stuck,) = problems(report, "not_completed")
    assert (stuck["op"], stuck["seq"]) == ("all_reduce", 2) and set(stuck["states"].values()) <= {"failed",
                                                                                                   "scheduled"}
    code, report = report_of(directory, "--allow-incomplete-ranks", capsys=capsys)
    assert code == 1 and problems(report, "no_dump") == []  # the incomplete collective is still a problem
    assert any("rank 2 left no dump" in n for n in report["notes"])
    _, out = run_trace(directory, capsys=capsys)
    assert "rank 2 left no dump" in out and "verdict: look at rank 2: no dump" in out


@pytest.mark.timeout(90)
def test_chrome_trace(runs: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--chrome-trace writes trace-event JSON: a process (track) per rank, a slice per entry."""
    directory = _ran(runs["skip"], [0, 0, 0])
    out_file = tmp_path / "timeline.json"
    code, out = run_trace(directory, "--chrome-trace", str(out_file), capsys=capsys)
    assert code == 1 and str(out_file) in out
    doc = json.loads(out_file.read_text())
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    slices = [e for e in events if e["ph"] in ("X", "i")]
    dumps, _ = trace.load(trace.find_dumps(str(directory))[0])
    assert len(slices) == sum(len(d.entries) for d in dumps.values())
    for e in slices:
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and e["tid"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    done = [e for e in slices if e["args"]["state"] == "completed"]
    assert done and all(e["ph"] == "X" for e in done)
    # no two slices overlap on one track (Perfetto wants them nested or apart)
    by_track: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in slices:
        by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e.get("dur", 0)))
    for spans in by_track.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


# --- hand-built dumps: the analyzer's rules (PyTorch's documented layout, no torch needed) ----------



@pytest.mark.timeout(30)
def test_hand_built_pytorch_dump_missing_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HAND-BUILT to PyTorch's documented layout (reference §2), torch's file names: rank 1 missing from all_reduce #3."""
    d = write(tmp_path, {
        0: torch_dump([entry(0, 1), entry(1, 2, "nccl:broadcast"), entry(2, 3, state="scheduled")]),
        1: torch_dump([entry(0, 1), entry(1, 2, "nccl:broadcast")]),
        2: torch_dump([entry(0, 1), entry(1, 2, "nccl:broadcast"), entry(2, 3, state="started")]),
    })
    code, report = report_of(d, capsys=capsys)
    assert code == 1 and report["prefix"] == "nccl_trace_rank_"
    (missing,) = problems(report, "ranks_missing")
    assert (missing["ranks"], missing["op"], missing["seq"]) == ([1], "all_reduce", 3)
    assert missing["where"][0]["current"] == {"op": "broadcast", "seq": 2, "p2p": False, "group": "0",
                                              "state": "completed"}
    assert report["first_incomplete"]["seq"] == 3


@pytest.mark.timeout(30)
def test_hand_built_op_and_dtype_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HAND-BUILT: rank 2 skipped broadcast #2 (op mismatch, with the skip named); a dtype mismatch on rank 0."""
    ok = [entry(0, 1, dtype="Float"), entry(1, 2, "nccl:broadcast"), entry(2, 3, "nccl:all_gather",
                                                                           state="scheduled")]
    d = write(tmp_path / "op", {0: torch_dump(ok), 1: torch_dump(ok),
                                 2: torch_dump([entry(0, 1), entry(1, 2, "nccl:all_gather", state="scheduled")])})
    code, report = report_of(d, capsys=capsys)
    assert code == 1
    (op,) = problems(report, "op_mismatch")
    assert op["ranks"] == [2] and op["seq"] == 2 and op["ops"] == {"0": "broadcast", "1": "broadcast",
                                                                   "2": "all_gather"}
    assert "rank 2 seems to have skipped broadcast #2" in op["message"]
    d = write(tmp_path / "dtype", {0: torch_dump([entry(0, 1, dtype="Half")]),
                                    1: torch_dump([entry(0, 1)]), 2: torch_dump([entry(0, 1)])})
    code, report = report_of(d, capsys=capsys)
    (dt,) = problems(report, "dtype_mismatch")
    assert code == 1 and dt["ranks"] == [0] and dt["op"] == "all_reduce"


@pytest.mark.timeout(30)
def test_hand_built_ring_wrap_and_p2p(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HAND-BUILT: rank 0's ring wrapped (first record_id 3): older entries are not blamed; a send without recv is."""
    r0 = [entry(i, i + 1) for i in range(3, 6)] + [
        entry(6, 0, "nccl:send 0->1", state="scheduled", p2p_seq=1)]
    r1 = [entry(i, i + 1) for i in range(0, 6)]
    d = write(tmp_path, {0: torch_dump(r0, "[0, 1]"), 1: torch_dump(r1, "[0, 1]")})
    code, report = report_of(d, capsys=capsys)
    assert code == 1
    assert problems(report, "ranks_missing") == [] and problems(report, "op_mismatch") == []
    (p2p,) = problems(report, "p2p_unmatched")
    assert p2p["ranks"] == [1] and p2p["op"] == "send" and p2p["peer"] == 0
    assert any("older entries dropped" in n for n in report["notes"])
    # without the stray send: consistent, exit 0
    d = write(tmp_path / "ok", {0: torch_dump(r0[:-1], "[0, 1]"), 1: torch_dump(r1, "[0, 1]")})
    code, report = report_of(d, capsys=capsys)
    assert code == 0, report["problems"]


@pytest.mark.timeout(30)
def test_hand_built_send_recv_pairing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HAND-BUILT: the k-th send a->b pairs with the k-th recv at b; sizes compared; a recv with no send is blamed on the sender."""
    r0 = [entry(0, 0, "nccl:send 0->1", p2p_seq=1), entry(1, 0, "nccl:send 0->1", state="scheduled", p2p_seq=2,
                                                            sizes=((4,),))]
    r1 = [entry(0, 0, "nccl:recv 1<-0", p2p_seq=1), entry(1, 0, "nccl:recv 1<-0", state="scheduled", p2p_seq=2,
                                                            sizes=((5,),)),
          entry(2, 0, "nccl:recv 1<-0", state="scheduled", p2p_seq=3)]
    d = write(tmp_path, {0: torch_dump(r0, "[0, 1]"), 1: torch_dump(r1, "[0, 1]")})
    code, report = report_of(d, capsys=capsys)
    assert code == 1
    (mismatch,) = problems(report, "p2p_mismatch")
    assert mismatch["ranks"] == [0, 1] and mismatch["p2p_seq"] == {"send": 2, "recv": 2}
    (unmatched,) = problems(report, "p2p_unmatched")
    assert unmatched["ranks"] == [0] and unmatched["op"] == "recv" and unmatched["p2p_seq"] == 3
    assert "rank 1's recv #3 from rank 0" in unmatched["message"]
    (stuck,) = problems(report, "not_completed")
    assert stuck["op"] == "send/recv" and stuck["states"] == {"0": "scheduled", "1": "scheduled"}


@pytest.mark.timeout(30)
def test_no_dumps_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty directory (or a wrong --prefix): exit 2 and a message, not a crash."""
    assert cli.main(["trace", str(tmp_path)]) == 2
    write(tmp_path, {0: torch_dump([entry(0, 1)], "[0]")})
    assert cli.main(["trace", str(tmp_path), "--prefix", "other_"]) == 2
    assert "no readable dump" in capsys.readouterr().err
    assert cli.main(["trace", str(tmp_path)]) == 0


# --- PyTorch itself -------------------------------------------------------------------------

_GLOO = '''
import pickle
from datetime import timedelta
import torch, torch.distributed as dist
store = dist.FileStore(os.environ["TEST_STORE"], world)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=2))
x = torch.ones(3, 4)
dist.all_reduce(x)
dist.broadcast(x, src=0)
if rank == 0:
    try:
        dist.all_reduce(x)  # rank 1 never joins
    except RuntimeError as exc:
        print("expected:", str(exc)[:200])
with open(prefix + str(rank), "wb") as f:
    f.write(torch._C._distributed_c10d._dump_fr_trace())  # torch 2.13's recorder, Gloo on CPU
wait_for([prefix + str(r) for r in range(world)])
'''


@needs_torch
@pytest.mark.timeout(90)
def test_pytorch_gloo_dump_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """PRODUCED BY PYTORCH (torch 2.13 CPU, Gloo's flight recorder, TORCH_FR_BUFFER_SIZE): rank 1 missing from all_reduce #3."""
    d = tmp_path / "gloo"
    results = spawn_world(_GLOO, 2, d, env={"TORCH_FR_BUFFER_SIZE": "100"}, timeout=80)
    assert [c for c, _ in results] == [0, 0], results
    raw = pickle.loads((d / "trace_0").read_bytes())
    assert raw["version"] == "2.10" and raw["entries"][0]["profiling_name"] == "gloo:all_reduce"
    code, report = report_of(d, capsys=capsys)
    assert code == 1
    (missing,) = problems(report, "ranks_missing")
    assert (missing["ranks"], missing["op"], missing["seq"]) == ([1], "all_reduce", 3)
    # torch's dumps hold no thread stacks, but each entry's stack at issue: where rank 1 issued its last one
    script = d.parent / "gloo.py"
    line = script.read_text().splitlines().index("dist.broadcast(x, src=0)") + 1
    at = missing["where"][0]["at"]
    assert (at["file"], at["line"], at["source"]) == (str(script), line, "issue"), at
    assert report["groups"][0]["ranks"] == [0, 1]  # Gloo's pg_config names the group "", its entries "0"
    # Gloo's recorder leaves every state "scheduled" and retires an op when it ends, failed or not: the
    # tool takes retired for completed there, so the timed-out all_reduce is not "not completed".
    assert problems(report, "op_mismatch") == [] and problems(report, "size_mismatch") == []


@needs_torch
@pytest.mark.timeout(90)
def test_pytorch_analyzer_reads_our_dumps(runs: Any) -> None:
    """PyTorch's own analyzer (torch.distributed.flight_recorder.fr_trace) on our dumps of the skip run."""
    directory = _ran(runs["skip"], [0, 0, 0])
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(directory),
                          "--prefix", "trace_"], capture_output=True, text=True, timeout=80)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "Not all ranks joining collective" in text and "missing ranks: {2}" in text


# --- malformed dumps: every file is untrusted input (issue 14 item 18) -------------------------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=12), st.binary(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                       max_leaves=12)


def _mangled(draw: Any, e: dict[str, Any]) -> Any:
    """An entry with some fields replaced by anything (or, now and then, the whole of it)."""
    for k in draw(st.lists(st.sampled_from(sorted(e)), max_size=3)):
        e[k] = draw(_values)
    return draw(_values) if draw(st.integers(0, 9)) == 0 else e


@st.composite
def _dump_file(draw: Any) -> bytes:
    """The bytes of one file in a dump folder: a dump of PyTorch's layout with parts mangled, its JSON form,
    a truncated pickle, or bytes of any kind."""
    kind = draw(st.sampled_from(["dump", "dump", "json", "truncated", "bytes", "value"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "value":
        return pickle.dumps(draw(_values))
    names = ["nccl:all_reduce", "nccl:broadcast", "nccl:send 0->1", "nccl:recv 1<-0", "gloo:all_reduce", "?", ""]
    entries = [entry(i, draw(st.integers(0, 4)), draw(st.sampled_from(names)),
                      state=draw(st.sampled_from(["completed", "scheduled", "started"])))
               for i in range(draw(st.integers(0, 4)))]
    d: dict[str, Any] = torch_dump(entries, ranks=draw(st.sampled_from(["[0, 1]", "[0, 1, 2]", "[0,", "[]", "x"])))
    d["entries"] = [_mangled(draw, e) for e in entries]
    d.update(host="h", pid=1, threads={"MainThread (1)": ['  File "/u/t.py", line 3, in f\n    x()\n']})
    for k in draw(st.lists(st.sampled_from(["pg_config", "entries", "version", "rank", "reason", "time", "host",
                                            "pid", "threads"]), max_size=2)):
        d[k] = draw(_values)
    if kind == "json":
        return json.dumps(d, default=repr).encode()
    raw = pickle.dumps(d)
    return raw[:draw(st.integers(0, len(raw)))] if kind == "truncated" else raw


_STACKS_HEAD = (b"# nccl_pg C-level stacks: rank 0, pid 2, host h, main thread 0x1\n"
                b"Current thread 0x0000000000000001 (most recent call first):\n")


@pytest.mark.timeout(120)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=st.lists(_dump_file(), min_size=1, max_size=4),
       stacks=st.lists(st.one_of(st.none(), st.binary(max_size=200), st.binary(max_size=200).map(_STACKS_HEAD.__add__),
                                 st.text(max_size=200).map(lambda t: _STACKS_HEAD + f'  File "{t}", line 1 in f\n'
                                                           .encode())), min_size=5, max_size=5))
def test_trace_survives_malformed_dumps(files: list[bytes], stacks: list[bytes | None]) -> None:
    """``nccl-pg trace`` on folders of mangled dumps (and C-level stacks files, also of ranks without a
    dump): never a traceback; each file is either read or reported as not a readable dump (naming it), the
    others analyzed; the exit status is 0, 1 or 2."""
    import contextlib
    import io
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for r, data in enumerate(files):
            (Path(tmp) / f"trace_{r}").write_bytes(data)
        (Path(tmp) / "c_stacks").mkdir()
        for r, data in enumerate(stacks):  # where the library keeps them; the header names rank 0, pid 2
            if data is not None:
                (Path(tmp) / "c_stacks" / f"rank{r}.2.txt").write_bytes(data)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["trace", tmp, "--json", "--stacks", "--chrome-trace", os.path.join(tmp, "timeline.json")])
        assert code in (trace.EXIT_OK, trace.EXIT_PROBLEMS, trace.EXIT_NO_DUMPS)
        if code == trace.EXIT_NO_DUMPS:
            assert err.getvalue().count("not a readable dump") == len(files), err.getvalue()
            return
        report = json.loads(out.getvalue())
        unreadable = [p for p in report["problems"] if p["kind"] == "unreadable"]
        assert all("not a readable dump" in p["message"] or "not used" in p["message"] for p in unreadable)
        assert len(report["dumps"]) + len(unreadable) == len(files), report
        assert trace.format_text(report)  # the words too

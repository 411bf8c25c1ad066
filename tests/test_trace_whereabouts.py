"""``nccl-pg trace`` says who each culprit is and where it is now (issue 24
item 5): host and pid, the top of its stack (file:line in function, from
the thread stacks its dump holds, or from faulthandler's C-level stacks),
stacks on demand (``--stacks``), and filters by rank and group.

Real worlds of processes on the host backend; the C-level stacks come from
a real process holding the GIL in C (a regular expression backtracking),
written by the library's own writer (``diagnostics.stacks``: the file in
``<dump dir>/c_stacks/``, faulthandler on ``NCCL_PG_STACKS_SIGNAL``), signalled
by the test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harness.trace_dumps import NCCL_PG, entry, report_of, run_trace, spawn_world, torch_dump, write

# Rank 1 is busy in user code between two all_reduces (it polls for a file the test's ranks make once every
# dump is written); ranks 0 and 2 time out in the second all_reduce (2 s) and every rank dumps.
_SLEEPER = NCCL_PG + '''
print("pid", os.getpid())
dist.init_process_group("host", store=store, rank=rank, world_size=world, timeout=30)
a = np.ones(4, np.float32)
dist.all_reduce(a)
dist._set_pg_timeout(2)
done = os.environ["DONE"]
if rank == 1:
    while not os.path.exists(done):
        time.sleep(0.05)  # user code: rank 1 is late
else:
    try:
        dist.all_reduce(a)
    except dist.DistBackendError as exc:
        print("expected:", exc)
    wait_for([prefix + str(r) for r in range(world)])
    open(done, "w").close()
'''


@pytest.fixture(scope="module")
def sleeper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, int], int]:
    """The run: (dump folder, {rank: pid}, the line rank 1 sleeps on)."""
    root = tmp_path_factory.mktemp("whereabouts")
    directory = root / "sleeper"
    results = spawn_world(_SLEEPER, 3, directory, env={"DONE": str(root / "done")})
    assert [c for c, _ in results] == [0, 0, 0], results
    pids = {r: int(out.split("pid ", 1)[1].split()[0]) for r, (_, out) in enumerate(results)}
    line = (root / "sleeper.py").read_text().splitlines().index("        time.sleep(0.05)  # user code: rank 1 is late")
    return directory, pids, line + 1


@pytest.mark.timeout(90)
def test_culprit_busy_in_user_code_is_located(sleeper: tuple[Path, dict[int, int], int],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1 sleeps between two all_reduces: the report names its host and pid and the line it is on, where
    it used to say only "rank 1 has nothing pending"."""
    directory, pids, line = sleeper
    script, host = directory.parent / "sleeper.py", socket.gethostname()
    code, out = run_trace(directory, capsys=capsys)
    assert code == 1
    at = f"at {script}:{line} in <module>: time.sleep(0.05)  # user code: rank 1 is late"
    assert f"rank 1 (host {host}, pid {pids[1]}) is in no operation: it is {at}; its newest operation is " \
           f"all_reduce #1" in out, out
    assert "has nothing pending" not in out
    assert f"culprits (where each is now):\n  rank 1 (host {host}, pid {pids[1]}): in no operation; {at}" in out
    code, report = report_of(directory, capsys=capsys)
    (culprit,) = report["rank_details"]
    assert (culprit["rank"], culprit["host"], culprit["pid"], culprit["culprit"]) == (1, host, pids[1], True)
    assert {k: culprit["at"][k] for k in ("file", "line", "function", "thread", "source")} == {
        "file": str(script), "line": line, "function": "<module>", "thread": "MainThread", "source": "python"}
    assert "stacks" not in culprit  # only on demand
    assert report["verdict"].startswith(f"look at rank 1 (host {host}, pid {pids[1]}, at {script}:{line} in "
                                        f"<module>): missing from all_reduce #2 on group '0'"), report["verdict"]


@pytest.mark.timeout(90)
def test_stacks_and_filters(sleeper: tuple[Path, dict[int, int], int], capsys: pytest.CaptureFixture[str]) -> None:
    """--ranks shows the ranks asked for (rank 0 waits in the all_reduce, at the user's line that issued it);
    --stacks adds every thread's stack; --groups keeps the problems of the groups named."""
    directory, pids, line = sleeper
    script = directory.parent / "sleeper.py"
    code, report = report_of(directory, "--ranks", "0", capsys=capsys)
    assert code == 1 and report["filters"] == {"ranks": [0], "groups": None}
    (zero,) = report["rank_details"]
    assert (zero["rank"], zero["pid"], zero["culprit"]) == (0, pids[0], False)
    assert zero["in"]["op"] == "all_reduce" and zero["in"]["seq"] == 2
    issued = script.read_text().splitlines().index("        dist.all_reduce(a)") + 1
    assert (zero["at"]["file"], zero["at"]["line"]) == (str(script), issued)
    assert all(0 in p["ranks"] + p.get("present", []) + [int(r) for r in p.get("states", {})]
               for p in report["problems"])
    code, out = run_trace(directory, "--stacks", capsys=capsys)
    section = out.split("culprits (where each is now):\n", 1)[1]
    assert "    stack of thread MainThread (" in section and f"      {script}:{line} in <module>" in section
    assert "stack of thread nccl_pg-" in section  # the library's threads too
    code, out = run_trace(directory, "--groups", "no-such-group", capsys=capsys)
    assert code == 0 and "no problem concerns what is shown." in out
    code, report = report_of(directory, "--groups", "default_pg", capsys=capsys)
    assert code == 1 and {p["kind"] for p in report["problems"]} == {"ranks_missing", "not_completed"}


# A rank holding the GIL in C: its Python threads cannot answer, faulthandler's C-level handler can. The library
# keeps its C-level stacks (<dump dir>/c_stacks/rank<rank>.<pid>.txt, a header line naming rank, pid, host and
# main thread, then what faulthandler appends on NCCL_PG_STACKS_SIGNAL, SIGUSR2 by default), armed here for the
# rank given as the test harness arms it (its one-rank group is rank 0); it writes its flight recorder first
# (torch's layout: no thread stacks) unless told not to.
_SPINNER = '''
import os, pickle, re, sys
import numpy as np
import nccl_pg as dist
from nccl_pg.diagnostics import stacks
from nccl_pg.diagnostics.flight_recorder import dump_flight_recorder
prefix, rank, write_dump = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "dump"
assert stacks.this_process().open(rank)
dist.init_process_group("host", store=dist.HashStore(), rank=0, world_size=1, timeout=30)
dist.all_reduce(np.ones(2))
if write_dump:
    d = pickle.loads(dump_flight_recorder())
    d["rank"] = rank
    with open(f"{prefix}{rank}", "wb") as f:
        pickle.dump(d, f)
print("ready", flush=True)
re.match(r"(a+)+$", "a" * 64 + "b")  # backtracks for ages inside C, holding the GIL
'''


def _spin(tmp_path: Path, rank: int, write_dump: bool) -> tuple[Path, Path, int, int]:
    """Run the spinner until its C-level stacks show it inside re.match: (script, dump prefix, line, pid)."""
    script, prefix = tmp_path / "spinner.py", tmp_path / "dumps" / "trace_"
    prefix.parent.mkdir(exist_ok=True)
    script.write_text(textwrap.dedent(_SPINNER))
    line = script.read_text().splitlines().index('re.match(r"(a+)+$", "a" * 64 + "b")  # backtracks for ages '
                                                 'inside C, holding the GIL') + 1
    argv = [sys.executable, str(script), str(prefix), str(rank), "dump" if write_dump else "no-dump"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_PG_", "TORCH_"))}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                            env={**env, "NCCL_PG_DEBUG_INFO_TEMP_FILE": str(prefix)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        stacks = prefix.parent / "c_stacks" / f"rank{rank}.{proc.pid}.txt"
        deadline = time.monotonic() + 30
        # Signal until a dump shows the rank inside re.match (the first may land while it is still printing);
        # each signal appends one, and the reader must take the latest, and in it the script's line.
        while f"line {line} in <module>" not in stacks.read_text():
            assert time.monotonic() < deadline, f"faulthandler wrote {stacks.read_text()!r}"
            proc.send_signal(signal.SIGUSR2)
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(10)
    return script, prefix, line, proc.pid


@pytest.mark.timeout(60)
def test_c_level_stacks_of_a_rank_holding_the_gil(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank spinning in C with the GIL held: its C-level stacks file (next to its dump, which holds no thread
    stacks) says where it is, and who (from the file's header)."""
    script, prefix, line, pid = _spin(tmp_path, 0, write_dump=True)
    code, report = report_of(prefix.parent, "--ranks", "0", "--stacks", capsys=capsys)
    (zero,) = report["rank_details"]
    assert (zero["host"], zero["pid"], zero["at"]["source"], zero["at"]["thread"]) == (
        socket.gethostname(), pid, "c", "MainThread"), zero
    assert (zero["at"]["file"], zero["at"]["line"], zero["at"]["function"]) == (str(script), line, "<module>")
    frames = zero["stacks"][0]["frames"]  # the main thread's, outermost first: the script, then re.match
    assert zero["stacks"][0]["source"] == "c" and (frames[-2]["line"], frames[-1]["function"]) == (line, "match")
    _, out = run_trace(prefix.parent, "--ranks", "0", capsys=capsys)
    assert f"at {script}:{line} in <module> (C-level stack)" in out


@pytest.mark.timeout(60)
def test_rank_with_only_c_level_stacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank that wrote no dump (it held the GIL) but left its C-level stacks: the missing dump is reported
    with where the rank is and who it is. Rank 0's dump, which expects ranks 0 and 1, is built by hand."""
    script, prefix, line, pid = _spin(tmp_path, 1, write_dump=False)
    write(prefix.parent, {0: torch_dump([entry(0, 1), entry(1, 2, state="scheduled")], "[0, 1]")}, prefix="trace_")
    code, report = report_of(prefix.parent, capsys=capsys)
    assert code == 1 and report["ranks"] == [0] and report["ranks_without_dump"] == [1]
    (missing,) = [p for p in report["problems"] if p["kind"] == "no_dump"]
    host, c_stacks = socket.gethostname(), prefix.parent / "c_stacks" / f"rank1.{pid}.txt"
    assert f"its C-level stacks ({c_stacks}) put rank 1 (host {host}, pid {pid}) at {script}:{line} " \
           f"in <module> (C-level stack)" in missing["message"], missing["message"]
    (one,) = report["rank_details"]
    assert (one["rank"], one["dump"], one["at"]["line"]) == (1, False, line)
    assert report["verdict"].startswith(f"look at rank 1 (host {host}, pid {pid}, at {script}:{line} in "
                                        f"<module>): no dump"), report["verdict"]


@pytest.mark.timeout(30)
def test_hand_built_c_level_stacks_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HAND-BUILT: a stacks file written to twice (the latest block of each thread wins; the header names the
    main thread); a stacks file that is a symbolic link is not followed, and a note says so."""
    text = ("# nccl_pg C-level stacks: rank 1, pid 4242, host node7, main thread 0x0000000000000001\n"
            "Current thread 0x0000000000000001 (most recent call first):\n"
            '  File "/home/u/train.py", line 30 in step\n\n'
            "Thread 0x0000000000000007 (most recent call first):\n"
            '  File "/lib/python3.11/threading.py", line 327 in wait\n'
            '  File "/home/u/train.py", line 88 in loader\n\n'
            "Current thread 0x0000000000000001 (most recent call first):\n"
            '  File "/home/u/model.py", line 12 in spin\n'
            '  File "/home/u/train.py", line 40 in step\n')
    d = write(tmp_path / "dumps", {r: torch_dump([entry(0, 1)], "[0, 1]") for r in (0, 1)}, prefix="trace_")
    (d / "c_stacks").mkdir()
    (d / "c_stacks" / "rank1.4242.txt").write_text(text)
    (tmp_path / "elsewhere").write_text(text.replace("rank 1, pid 4242", "rank 0, pid 4343"))
    (d / "c_stacks" / "rank0.4343.txt").symlink_to(tmp_path / "elsewhere")
    code, report = report_of(d, "--ranks", "0", "1", "--stacks", capsys=capsys)
    by_rank = {r["rank"]: r for r in report["rank_details"]}
    one = by_rank[1]
    assert (one["host"], one["pid"], one["at"]["file"], one["at"]["line"], one["at"]["thread"]) == (
        "node7", 4242, "/home/u/model.py", 12, "MainThread"), one
    assert [t["thread"] for t in one["stacks"]] == ["MainThread", "0x7"]
    assert by_rank[0]["at"]["source"] is None and by_rank[0]["host"] is None
    assert any(f"{d / 'c_stacks' / 'rank0.4343.txt'}: not read (a symbolic link (not followed))" in n
               for n in report["notes"]), report["notes"]


@pytest.mark.timeout(30)
def test_c_level_stacks_are_chosen_by_pid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HAND-BUILT: a folder where rank 1 ran twice (two C-level stacks files, as a restarted rank leaves): the one of
    the pid its dump names is used, not the newer one; for a dump without a pid (torch's) the newest is used and a
    note says there were several; a file whose header names another rank than its name is not read."""
    def stacks_text(rank: int, pid: int, line: int) -> str:
        return (f"# nccl_pg C-level stacks: rank {rank}, pid {pid}, host node7, main thread 0x0000000000000001\n"
                "Current thread 0x0000000000000001 (most recent call first):\n"
                f'  File "/home/u/train.py", line {line} in step\n')

    ours = {r: {**torch_dump([entry(0, 1)], "[0, 1, 2]"), "rank": r, "pid": 100 + r, "host": "node7"} for r in (0, 1)}
    d = write(tmp_path / "dumps", {**ours, 2: torch_dump([entry(0, 1)], "[0, 1, 2]")}, prefix="trace_")
    folder = d / "c_stacks"
    folder.mkdir()
    (folder / "rank1.101.txt").write_text(stacks_text(1, 101, 11))
    (folder / "rank1.999.txt").write_text(stacks_text(1, 999, 99))  # newer, of another process
    (folder / "rank2.200.txt").write_text(stacks_text(2, 200, 20))
    (folder / "rank2.201.txt").write_text(stacks_text(2, 201, 21))
    os.utime(folder / "rank2.200.txt", (1, 1))  # the older of rank 2's
    (folder / "rank0.100.txt").write_text(stacks_text(3, 100, 30))  # its header says rank 3
    code, report = report_of(d, "--ranks", "0", "1", "2", capsys=capsys)
    at = {r["rank"]: r["at"] for r in report["rank_details"]}
    assert (at[1]["line"], at[1]["source"]) == (11, "c") and (at[2]["line"], at[2]["source"]) == (21, "c"), at
    assert at[0]["source"] is None
    notes = "\n".join(report["notes"])
    assert f"rank 2: 2 C-level stacks files and no pid in its dump to choose by; using the newest, " \
           f"{folder / 'rank2.201.txt'}" in notes, notes
    assert f"{folder / 'rank0.100.txt'}: not read (its header says rank 3, pid 100, unlike its name)" in notes, notes

"""``nccl-pg trace`` says who each culprit is and where it is now (issue 24
item 5): host and pid, the top of its stack (file:line in function, from
the thread stacks its dump holds, or from faulthandler's C-level stacks),
stacks on demand (``--stacks``), and filters by rank and group.

Real worlds of processes on the host backend; the C-level stacks come from
a real process holding the GIL in C (a regular expression backtracking),
signalled by the test.
"""

from __future__ import annotations

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


# A rank holding the GIL in C: its Python threads cannot answer, faulthandler's C-level handler can. Its dump
# (written before, torch's layout: no thread stacks) names the file faulthandler writes to on SIGUSR1.
_SPINNER = '''
import faulthandler, os, pickle, re, signal, sys
import numpy as np
import nccl_pg as dist
from nccl_pg.diagnostics.flight_recorder import dump_flight_recorder
prefix = sys.argv[1]
dist.init_process_group("host", store=dist.HashStore(), rank=0, world_size=1, timeout=30)
dist.all_reduce(np.ones(2))
stacks = open(prefix + "0.cstacks", "w")
faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
d = pickle.loads(dump_flight_recorder())
d.update(rank=0, pid=os.getpid(), host="spinner-host", c_stacks_file="trace_0.cstacks")
with open(prefix + "0", "wb") as f:
    pickle.dump(d, f)
print("ready", flush=True)
re.match(r"(a+)+$", "a" * 64 + "b")  # backtracks for ages inside C, holding the GIL
'''


@pytest.mark.timeout(60)
def test_c_level_stacks_of_a_rank_holding_the_gil(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank spinning in C with the GIL held: faulthandler's stacks (a file its dump names) say where it is."""
    script, prefix = tmp_path / "spinner.py", tmp_path / "dumps" / "trace_"
    prefix.parent.mkdir()
    script.write_text(textwrap.dedent(_SPINNER))
    line = script.read_text().splitlines().index('re.match(r"(a+)+$", "a" * 64 + "b")  # backtracks for ages '
                                                 'inside C, holding the GIL') + 1
    proc = subprocess.Popen([sys.executable, str(script), str(prefix)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        stacks = Path(f"{prefix}0.cstacks")
        deadline = time.monotonic() + 30
        # Signal until a dump shows the rank inside re.match (the first may land while it is still printing);
        # each signal appends one, and the reader must take the latest, and in it the script's line.
        while f'line {line} in <module>' not in stacks.read_text():
            assert time.monotonic() < deadline, f"faulthandler wrote {stacks.read_text()!r}"
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(10)
    code, report = report_of(prefix.parent, "--ranks", "0", "--stacks", capsys=capsys)
    (zero,) = report["rank_details"]
    assert (zero["host"], zero["pid"], zero["at"]["source"]) == ("spinner-host", proc.pid, "c"), zero
    assert (zero["at"]["file"], zero["at"]["line"], zero["at"]["function"]) == (str(script), line, "<module>")
    frames = zero["stacks"][0]["frames"]  # the main thread's, outermost first: the script, then re.match
    assert zero["stacks"][0]["source"] == "c" and (frames[-2]["line"], frames[-1]["function"]) == (line, "match")
    _, out = run_trace(prefix.parent, "--ranks", "0", capsys=capsys)
    assert f"at {script}:{line} in <module> (C-level stack)" in out


@pytest.mark.timeout(30)
def test_hand_built_c_stacks_text_and_a_file_outside_the_folder(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """HAND-BUILT: faulthandler's text in the dump itself is read; a ``c_stacks_file`` naming a path outside
    the dump's folder is looked for in the folder only (by its base name), and a note says it was not read."""
    text = ('Thread 0x0000000000000007 (most recent call first):\n'
            '  File "/lib/python3.11/threading.py", line 327 in wait\n'
            '  File "/home/u/train.py", line 88 in loader\n\n'
            'Current thread 0x0000000000000001 (most recent call first):\n'
            '  File "/home/u/model.py", line 12 in spin\n'
            '  File "/home/u/train.py", line 40 in step\n')
    outside = tmp_path / "secret.txt"
    outside.write_text('Current thread 0x1 (most recent call first):\n  File "/leak.py", line 1 in leak\n')
    r0 = torch_dump([entry(0, 1), entry(1, 2, state="scheduled")], "[0, 1]")
    r1 = {**torch_dump([entry(0, 1)], "[0, 1]"), "c_stacks": text}
    r1["entries"][0]["thread_id"] = 1
    r0["c_stacks_file"] = str(outside)
    d = write(tmp_path / "dumps", {0: r0, 1: r1})
    code, report = report_of(d, "--ranks", "0", "1", capsys=capsys)
    by_rank = {r["rank"]: r for r in report["rank_details"]}
    assert (by_rank[1]["at"]["file"], by_rank[1]["at"]["line"], by_rank[1]["at"]["source"]) == (
        "/home/u/model.py", 12, "c")
    assert by_rank[0]["at"]["source"] is None and "/leak.py" not in str(report)
    assert any(f"{d / 'secret.txt'}: not read" in n for n in report["notes"]), report["notes"]

"""`nccl-pg why` where it used to be wrong (issue 32): a healthy job with jitter (items 1), a job started with
another TMPDIR (item 9), forged answers in the store (item 13).

The jittery job: 4 ranks under `nccl-pg run`, each computing 50-90 ms a step (rank 1 now and then 0.2 s more), then
an all_reduce on the world and one on a pair subgroup; a snapshot often catches a rank a moment behind. A hang is
named only once it persists (diagnostics/verdicts.py: ``stuck``), so every call exits 0.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness.procs import clean_env

from nccl_pg.cli import main as cli
from nccl_pg.diagnostics import findings, incidents, inquiry
from nccl_pg.store import TCPStore, TCPStoreServer

JITTER_JOB = '''\
import os, pathlib, random, time
import numpy as np
import nccl_pg as dist

DIR = pathlib.Path(os.environ["TEST_DIR"])
dist.init_process_group("host", init_method="env://", timeout=60)
rank = dist.get_rank()
pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
rng = random.Random(rank)
x = np.ones(1024, np.float32)
step = 0
while True:
    time.sleep(rng.uniform(0.05, 0.09))  # computing: 50-90 ms a step
    if rank == 1 and step % 7 == 6:
        time.sleep(0.2)  # now and then 0.2 s late
    done = np.array([float(rank == 0 and (DIR / "done").exists())], np.float32)
    dist.all_reduce(done)  # the world's collective (and every rank learns when to stop)
    dist.all_reduce(x, group=pairs[rank // 2])
    step += 1
    if step == 5:
        (DIR / f".ready.{rank}").write_text(str(os.getpid()))
        (DIR / f".ready.{rank}").rename(DIR / f"ready.{rank}")
    if done[0]:
        break
dist.destroy_process_group()
'''


@pytest.fixture
def jittery(tmp_path: Path):
    (tmp_path / "job.py").write_text(JITTER_JOB)
    env = clean_env({"TEST_DIR": str(tmp_path), "TMPDIR": str(tmp_path)})
    proc = subprocess.Popen([sys.executable, "-m", "nccl_pg.cli.main", "run", "--nproc", "4", "--autopsy-time", "0",
                             str(tmp_path / "job.py")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready.{r}").exists() for r in range(4)):
        if proc.poll() is not None:
            pytest.fail(f"the launcher exited {proc.returncode}: {proc.communicate()}")
        assert time.monotonic() < deadline, "ranks not ready"
        time.sleep(0.02)
    yield proc, env
    (tmp_path / "done").write_text("")
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


@pytest.mark.timeout(120)
def test_twenty_whys_on_a_healthy_jittery_job_all_exit_0(jittery, tmp_path: Path, monkeypatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """20 `nccl-pg why --job PID` calls (in this process: the same code as the command) on the healthy job all exit
    0: what a first look catches in flight is looked at again, and it has moved ("in progress"); none is called a
    hang. Then (item 9) `why` run with another TMPDIR still finds the job, by its launcher's pid."""
    proc, env = jittery
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    second = 0
    for i in range(20):
        code = cli.main(["why", "--job", str(proc.pid)])
        out = capsys.readouterr().out
        assert code == 0, f"call {i + 1}: {out}"
        assert re.search(r"^  (no problem|in progress): ", out, re.M), out
        second += "looked again" in out
    print(f"{second} of 20 calls looked twice")  # (for the record: how often a snapshot caught a rank behind)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "why", "--job", str(proc.pid), "--json"],
                         env={**env, "TMPDIR": str(elsewhere)}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and json.loads(res.stdout)["ok"], res


@pytest.mark.timeout(30)
def test_why_with_no_job_says_where_it_looked(tmp_path: Path) -> None:
    env = clean_env({"TMPDIR": str(tmp_path), "NCCL_PG_RUNTIME_DIR": str(tmp_path / "run")})
    res = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "why"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 2, res
    assert f"looked for launchers' records in {tmp_path / 'run'}" in res.stderr, res.stderr


@pytest.mark.timeout(60)
def test_forged_answers_cannot_cost_memory_recursion_or_the_terminal() -> None:
    """A writer holding the store's secret forges the inquiry's keys (item 13): a world of 16777215 ranks (asked at
    most MAX_WORLD, quickly), a report nested 60,000 deep (not a report, no RecursionError), and strings with ESC,
    BEL and OSC sequences (printed escaped)."""
    server = TCPStoreServer("127.0.0.1", 0).start()
    try:
        store = TCPStore("127.0.0.1", server.port, timeout=10)
        evil = "\x1b]0;owned\x07\x1b[2J\x1b]52;c;cm0gLXJmIH4=\x07\x9b31m"
        good = json.dumps({"rank": 2, "ranks": [2], "world": 3, "pid": 7, "host": "h" + evil, "where": {
            "file": "x.py" + evil, "line": 3, "func": "f"}, "threads": [{"name": "MainThread", "main": True,
                                                                        "frames": [["x.py", 3, "f", "pass"]]}],
            "groups": [{"name": "0", "ranks": list(range(50)) + [1 << 40], "rank": 2, "issued": 1, "completed": 1}]})

        def forger() -> None:
            s = TCPStore("127.0.0.1", server.port, timeout=10)
            s.wait([incidents.signal_key(1)], 10)
            s.set(incidents.report_key(1, 0), "[" * 60_000 + "]" * 60_000)
            s.set(incidents.report_key(1, 2), good)
            s.set(incidents.reports_world_key(1), b"16777215")
            s.set(incidents.reports_all_key(1), b"1")
            s.close()

        t = threading.Thread(target=forger)
        t.start()
        t0 = time.monotonic()
        inq = findings.one_look(inquiry.inquire(store, "test", 5.0, cap=1 << 20))
        took = time.monotonic() - t0
        t.join(10)
        store.close()
    finally:
        server.stop()
    assert took < 20, took
    assert inq.world == inquiry.MAX_WORLD and any("asking at most" in n for n in inq.notes), inq.notes
    assert sorted(r for r, k in inq.ranks.items() if k.answered) == [2]
    assert any("not a report" in n for n in inq.notes), inq.notes
    text = findings.format_text(inq)
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text, repr(text[:500])
    assert "\\x1b]0;owned\\x07" in text, text[:2000]
    assert max(inq.ranks) < inquiry.MAX_WORLD

"""`nccl-pg run` whose own stdout nobody reads (issue 32, item 12): `| less` left on a page, a terminal paused with
Ctrl-S, a slow log collector. The launcher's loop must keep its deadlines and its signals whatever its output does:
--max-time and SIGTERM stop the job, and the lines that did not fit are dropped and counted, not waited for."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.procs import clean_env

from nccl_pg.cli import output

JOB = '''\
import os, pathlib, sys, time
rank = int(os.environ["RANK"])
pathlib.Path(os.environ["TEST_DIR"], f"ready.{rank}").write_text(str(os.getpid()))
if rank == 0:
    while True:  # floods its output
        print("x" * 200, flush=True)
time.sleep(1000)  # stuck
'''


def _start(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    (tmp_path / "job.py").write_text(JOB)
    env = clean_env({"TEST_DIR": str(tmp_path), "TMPDIR": str(tmp_path)})
    # stdout: a pipe this test never reads (it fills at 64 KiB); stderr: a file, so that the launcher's own lines
    # can be read afterwards
    err = open(tmp_path / "err", "wb")  # noqa: SIM115 - closed below, once the launcher has it
    try:
        return subprocess.Popen([sys.executable, "-m", "nccl_pg.cli.main", "run", "--nproc", "3", "--grace-period",
                                 "1", "--autopsy-time", "0", *args, str(tmp_path / "job.py")], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=err)
    finally:
        err.close()


def _ready(tmp_path: Path, proc: subprocess.Popen[bytes]) -> list[int]:
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"ready.{r}").exists() for r in range(3)):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()
        time.sleep(0.02)
    return [int((tmp_path / f"ready.{r}").read_text()) for r in range(3)]


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def _alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(p)
        except FileNotFoundError:
            pass
    return out


@pytest.mark.timeout(60)
def test_max_time_holds_when_nobody_reads_the_launchers_output(tmp_path: Path) -> None:
    proc = _start(tmp_path, "--max-time", "3")
    pids = _ready(tmp_path, proc)
    t0 = time.monotonic()
    code = _wait(proc, 20)
    took = time.monotonic() - t0
    proc.stdout.close()  # type: ignore[union-attr]
    err = (tmp_path / "err").read_text()
    assert code == 124, (code, err)
    assert took < 12, took  # 3 s, the 1 s grace period, and the kill: not held by the full pipe
    assert "--max-time 3 s expired" in err, err
    assert _alive(pids) == []


@pytest.mark.timeout(60)
def test_sigterm_holds_when_nobody_reads_the_launchers_output(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    pids = _ready(tmp_path, proc)
    time.sleep(0.5)  # rank 0 fills the pipe (64 KiB) and the launcher's buffer keeps taking its lines
    proc.send_signal(signal.SIGTERM)
    code = _wait(proc, 15)
    unread = proc.stdout.read()  # type: ignore[union-attr]  # now read: the lines queued, then the note
    proc.stdout.close()  # type: ignore[union-attr]
    assert code == 128 + signal.SIGTERM, (code, (tmp_path / "err").read_text())
    assert _alive(pids) == []
    assert unread.startswith(b"[rank0]: xxx"), unread[:100]


@pytest.mark.timeout(30)
def test_a_sink_drops_and_counts_what_does_not_fit_and_says_so() -> None:
    """The launcher's output buffer: writes never block; past its limit lines are dropped and counted; once the
    reader drains it, a line says how many were dropped, and what follows is written."""
    r, w = os.pipe()
    sink = output.Sink(w, "test", limit=1000)
    os.close(w)  # the sink writes to its own duplicate
    try:
        t0 = time.monotonic()
        kept = [sink.write(b"y" * 99 + b"\n") for _ in range(2000)]  # 200 kB into a 64 KiB pipe nobody reads
        assert time.monotonic() - t0 < 2
        assert not all(kept) and sink.dropped_total == kept.count(False) > 0
        got = b""
        os.set_blocking(r, False)
        deadline = time.monotonic() + 10
        while not sink.flush(0.05) and time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                got += os.read(r, 1 << 16)
        assert sink.write(b"after\n")
        assert sink.close(5)
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(r, 1 << 16):
                got += chunk
    finally:
        os.close(r)
    assert got.count(b"y" * 99 + b"\n") == kept.count(True)
    assert got.endswith(b"nccl-pg run: %d line(s) of output dropped here: this output was not read fast enough "
                        b"(a full pipe or a paused terminal)\nafter\n" % sink.dropped_total), got[-300:]

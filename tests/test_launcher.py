"""`nccl-pg run` and `nccl-pg store` with real processes and real signals.

Rank behaviour comes from small scripts written to tmp_path. A rank tells the
test that it is up by creating ``ready.<rank>`` (holding its pid, and its
child's pid where it starts one), so no test relies on a sleep being long
enough; the polling below only bounds how long the test waits.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nccl_pg.comm import backends

PRELUDE = '''\
import os, pathlib, signal, subprocess, sys, time
RANK = int(os.environ["RANK"])
DIR = pathlib.Path(os.environ["TEST_DIR"])

def ready(*pids):
    """Tell the test this rank is up: ready.<rank> holds our pid and any others."""
    tmp = DIR / f".ready.{RANK}"
    tmp.write_text(" ".join(map(str, (os.getpid(), *pids))))
    tmp.rename(DIR / f"ready.{RANK}")

def wait_for(*names):
    while not all((DIR / n).exists() for n in names):
        time.sleep(0.01)
'''


def write_job(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return path


@pytest.fixture
def start(tmp_path: Path):
    """Starts `nccl-pg run ARGS` in tmp_path; whatever is still running at
    teardown gets SIGTERM (which the launcher passes on), then SIGKILL."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        env = {**os.environ, "TEST_DIR": str(tmp_path)}
        proc = subprocess.Popen([sys.executable, "-m", "nccl_pg.cli.main", "run", *args], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def wait_ready(tmp_path: Path, ranks: list[int], proc: subprocess.Popen[str], timeout: float = 20) -> list[int]:
    """Pids written by the given ranks once all of them are up."""
    deadline = time.monotonic() + timeout
    files = [tmp_path / f"ready.{r}" for r in ranks]
    while not all(f.exists() for f in files):
        if proc.poll() is not None:
            pytest.fail(f"launcher exited {proc.returncode} before the ranks were ready: {proc.communicate()}")
        if time.monotonic() > deadline:
            pytest.fail(f"ranks {ranks} not ready after {timeout} s")
        time.sleep(0.01)
    return [int(pid) for f in files for pid in f.read_text().split()]


def recorded_pids(tmp_path: Path) -> list[int]:
    return [int(pid) for f in tmp_path.glob("ready.*") for pid in f.read_text().split()]


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_gone(pids: list[int], timeout: float = 5) -> None:
    """SIGKILL is delivered asynchronously, so allow the kernel a moment."""
    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [p for p in pids if running(p)] == []


def rank_lines(text: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"\[rank(\d+)\]: (.*)", line)
        assert match, f"line without a rank prefix: {line!r}"
        lines.setdefault(int(match[1]), []).append(match[2])
    return lines


# --- success -----------------------------------------------------------------

@pytest.mark.timeout(30)
def test_ranks_get_env_args_and_a_listening_store(tmp_path: Path, start, monkeypatch) -> None:
    monkeypatch.delenv("NCCL_PG_STORE_SECRET", raising=False)  # so the launcher makes one up
    write_job(tmp_path, '''
        import json, socket
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "NCCL_PG_USE_AGENT_STORE", "NCCL_PG_STORE_SECRET", "PYTHONUNBUFFERED",
                "TORCHELASTIC_USE_AGENT_STORE"]
        socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=10).close()
        print(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:]}))
    ''')
    code, out, err = finish(start("--nproc", "3", "job.py", "--flag", "value with spaces"))
    assert code == 0, err
    seen = {rank: json.loads(lines[0]) for rank, lines in rank_lines(out).items()}
    assert sorted(seen) == [0, 1, 2]
    for rank, info in seen.items():
        assert info["argv"] == ["--flag", "value with spaces"]
        e = info["env"]
        assert (e["RANK"], e["LOCAL_RANK"]) == (str(rank), str(rank))
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == ("3", "3", "0")
        assert (e["NCCL_PG_USE_AGENT_STORE"], e["PYTHONUNBUFFERED"]) == ("1", "1")
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # torch's env:// uses the launcher's store (issue 31)
    assert {i["env"]["MASTER_ADDR"] for i in seen.values()} == {"127.0.0.1"}
    ports = {i["env"]["MASTER_PORT"] for i in seen.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    secrets = {i["env"]["NCCL_PG_STORE_SECRET"] for i in seen.values()}
    assert len(secrets) == 1 and len(secrets.pop()) == 32  # token_hex(16)


@pytest.mark.timeout(30)
def test_given_secret_and_port_are_passed_on(tmp_path: Path, start, monkeypatch) -> None:
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("NCCL_PG_STORE_SECRET", "s3cret")
    write_job(tmp_path, 'print(os.environ["MASTER_PORT"], os.environ["NCCL_PG_STORE_SECRET"])\n')
    code, out, err = finish(start("--nproc", "2", "--master-port", str(port), "job.py"))
    assert code == 0, err
    assert rank_lines(out) == {0: [f"{port} s3cret"], 1: [f"{port} s3cret"]}


@pytest.mark.timeout(30)
def test_store_outlives_rank_0(tmp_path: Path, start) -> None:
    # The launcher hosts the store: rank 1 still meets it after rank 0 has
    # exited (successfully, so the job goes on).
    write_job(tmp_path, '''
        if RANK == 0:
            ready()
            sys.exit(0)
        wait_for("ready.0")
        rank0 = pathlib.Path(f"/proc/{(DIR / 'ready.0').read_text()}")
        while rank0.exists():  # until the launcher has reaped rank 0
            time.sleep(0.01)
        from nccl_pg.store.rendezvous import rendezvous
        store = rendezvous("env://", timeout=10).store
        store.set("k", "v")
        print(store.get("k").decode(), store.add("n", 2))
    ''')
    code, out, err = finish(start("--nproc", "2", "job.py"))
    assert code == 0, err
    assert rank_lines(out) == {1: ["v 2"]}


@pytest.mark.timeout(30)
def test_output_is_prefixed_by_rank_in_whole_lines(tmp_path: Path, start) -> None:
    # Each line is written in three pieces with flushes between them, so that
    # pieces of different ranks would interleave if the launcher did not
    # reassemble lines; the last line has no newline at all.
    write_job(tmp_path, '''
        for i in range(200):
            for piece in (f"rank{RANK} line{i} ", "x" * (500 + i), f" end{i}\\n"):
                os.write(1, piece.encode())
        os.write(2, f"rank{RANK} to stderr\\n".encode())
        os.write(1, f"rank{RANK} last".encode())
    ''')
    code, out, err = finish(start("--nproc", "4", "job.py"))
    assert code == 0, err
    lines = rank_lines(out)
    assert sorted(lines) == [0, 1, 2, 3]
    for rank, got in lines.items():
        want = [f"rank{rank} line{i} {'x' * (500 + i)} end{i}" for i in range(200)] + [f"rank{rank} last"]
        assert got == want
    assert sorted(line for line in err.splitlines() if line.startswith("[rank")) == [
        f"[rank{r}]: rank{r} to stderr" for r in range(4)]


@pytest.mark.timeout(30)
def test_no_prefix_passes_output_through(tmp_path: Path, start) -> None:
    # One write per line: unprefixed output is passed through untouched, so two
    # ranks' lines are whole only if each rank writes each line at once (an
    # unbuffered print() writes the text and the newline separately).
    write_job(tmp_path, 'os.write(1, f"plain {RANK}\\n".encode())\n')
    code, out, err = finish(start("--nproc", "2", "--no-prefix", "job.py"))
    assert code == 0, err
    assert sorted(out.splitlines()) == ["plain 0", "plain 1"]


# --- failures ----------------------------------------------------------------

@pytest.mark.timeout(30)
def test_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path: Path, start) -> None:
    # The others fail too once stopped, but the first failure sets the status.
    write_job(tmp_path, '''
        if RANK == 1:
            wait_for("ready.0", "ready.2")
            sys.exit(3)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))
        ready()
        time.sleep(1000)
    ''')
    proc = start("--nproc", "3", "--grace-period", "20", "job.py")
    pids = wait_ready(tmp_path, [0, 2], proc)
    code, _, err = finish(proc)
    assert code == 3
    assert re.search(r"rank 1 \(pid \d+\) exited with code 3; sending SIGTERM to 2 running rank", err), err
    assert "grace period; sending SIGKILL" not in err  # SIGTERM sufficed
    assert_gone(pids)


@pytest.mark.timeout(30)
def test_rank_killed_by_a_signal_gives_128_plus_the_signal(tmp_path: Path, start) -> None:
    write_job(tmp_path, '''
        if RANK == 0:
            wait_for("ready.1")
            os.kill(os.getpid(), signal.SIGKILL)
        ready()
        time.sleep(1000)
    ''')
    proc = start("--nproc", "2", "job.py")
    pids = wait_ready(tmp_path, [1], proc)
    code, _, err = finish(proc)
    assert code == 128 + signal.SIGKILL
    assert re.search(r"rank 0 \(pid \d+\) was killed by signal SIGKILL \(9\)", err), err
    assert_gone(pids)


@pytest.mark.timeout(30)
def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path, start) -> None:
    write_job(tmp_path, '''
        if RANK == 1:
            wait_for("ready.0")
            sys.exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ready()
        time.sleep(1000)
    ''')
    proc = start("--nproc", "2", "--grace-period", "1", "job.py")
    pids = wait_ready(tmp_path, [0], proc)
    ready_at = (tmp_path / "ready.0").stat().st_mtime  # not after rank 1 failed (coarse clock lags)
    code, _, err = finish(proc)
    assert code == 1
    assert time.time() - ready_at >= 1.0
    assert re.search(r"rank 0 \(pid \d+\) still running after the 1 s grace period; sending SIGKILL", err), err
    assert_gone(pids)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["max-time", "SIGTERM", "SIGINT"])
def test_nothing_outlives_the_launcher_when_a_rank_must_be_killed(tmp_path: Path, start, how: str) -> None:
    """Issue 25 item 9: rank 1 ignores SIGTERM and SIGINT and has started a worker in a session of its own that
    ignores them too. After --max-time, SIGTERM or SIGINT the launcher must kill rank 1 after the grace period:
    its guard kills the rank and the worker. Before, the launcher SIGKILLed the rank's process group, the guard
    (the worker's subreaper) with it, and the worker lived on under init."""
    write_job(tmp_path, '''
        if RANK == 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            worker = subprocess.Popen(["sleep", "1000"], start_new_session=True)  # inherits the ignored signals
            ready(worker.pid)
        else:
            ready()
        time.sleep(1000)
    ''')
    args = ["--nproc", "2", "--grace-period", "1"] + (["--max-time", "3"] if how == "max-time" else [])
    proc = start(*args, "job.py")
    pids = wait_ready(tmp_path, [0, 1], proc)
    assert len(pids) == 3 and all(running(p) for p in pids)
    if how != "max-time":
        proc.send_signal(getattr(signal, how))
    code, _, err = finish(proc, timeout=40)
    assert code == (124 if how == "max-time" else 128 + getattr(signal, how)), err
    assert re.search(r"rank 1 \(pid \d+\) still running after the 1 s grace period; sending SIGKILL", err), err
    assert [p for p in pids if running(p)] == []  # at once: the launcher waited for the guard to kill them


@pytest.mark.timeout(30)
def test_ranks_die_with_a_sigkilled_launcher(tmp_path: Path, start) -> None:
    """A launcher killed outright cannot forward anything; the kernel's
    parent-death signal still takes its ranks down, so none is orphaned."""
    write_job(tmp_path, '''
        ready()
        time.sleep(1000)
    ''')
    proc = start("--nproc", "2", "job.py")
    pids = wait_ready(tmp_path, [0, 1], proc)
    proc.kill()
    proc.wait(10)
    assert_gone(pids)


@pytest.mark.timeout(30)
def test_the_ranks_own_children_die_with_a_sigkilled_launcher(tmp_path: Path, start) -> None:
    """The ranks' children die too: one in the rank's process group, and one
    that left it for a session of its own (as a daemonizing helper does).
    Before, the parent-death signal reached the ranks only; their children
    were orphaned and kept running."""
    write_job(tmp_path, '''
        same_group = subprocess.Popen(["sleep", "1000"])
        own_session = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        ready(same_group.pid, own_session.pid)
        time.sleep(1000)
    ''')
    proc = start("--nproc", "2", "job.py")
    pids = wait_ready(tmp_path, [0, 1], proc)
    assert len(pids) == 6 and all(running(p) for p in pids)
    proc.kill()
    proc.wait(10)
    assert_gone(pids)


def test_rank_guard_refuses_when_the_launcher_is_already_gone(tmp_path: Path) -> None:
    """The guard's own check covers the launcher dying before prctl takes effect."""
    result = subprocess.run([sys.executable, "-m", "nccl_pg.cli._rank_guard", "1", sys.executable, "-c", "print('ran')"],
                            capture_output=True, text=True, timeout=20)
    assert result.returncode == 1 and "ran" not in result.stdout
    assert "launcher exited before this rank started" in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_signal_is_forwarded_and_no_process_is_left(tmp_path: Path, start, signum: signal.Signals) -> None:
    # Each rank starts a child that ignores the signal (SIG_IGN survives
    # exec): the launcher must still remove it once its rank has exited.
    write_job(tmp_path, f'''
        signal.signal({signum.value}, signal.SIG_IGN)
        child = subprocess.Popen(["sleep", "1000"])

        def on_signal(signum, frame):
            (DIR / f"got.{{RANK}}").write_text(str(signum))
            sys.exit(0)

        signal.signal({signum.value}, on_signal)
        ready(child.pid)
        time.sleep(1000)
    ''')
    proc = start("--nproc", "3", "--grace-period", "20", "job.py")
    pids = wait_ready(tmp_path, [0, 1, 2], proc)
    proc.send_signal(signum)
    code, _, err = finish(proc, timeout=15)  # well inside the grace period: no SIGKILL needed
    assert code == 128 + signum
    assert f"received {signum.name}; sending {signum.name} to 3 running rank(s)" in err
    assert [(tmp_path / f"got.{r}").read_text() for r in range(3)] == [str(signum.value)] * 3
    assert_gone(pids)


@pytest.mark.timeout(30)
def test_max_time_stops_the_job_with_124(tmp_path: Path, start) -> None:
    write_job(tmp_path, '''
        ready()
        time.sleep(1000)
    ''')
    proc = start("--nproc", "2", "--max-time", "2", "job.py")
    code, _, err = finish(proc)
    assert code == 124
    assert "--max-time 2 s expired; sending SIGTERM" in err
    assert_gone(recorded_pids(tmp_path))


@pytest.mark.timeout(30)
def test_store_that_cannot_bind_is_reported(tmp_path: Path, start) -> None:
    write_job(tmp_path, 'print("never runs")\n')
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, out, err = finish(start("--master-port", str(port), "job.py"))
    assert code == 1
    assert "cannot start the rendezvous store" in err and f"127.0.0.1:{port}" in err
    assert out == ""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, message", [
    (["--nproc", "0", "job.py"], "must be >= 1"),
    (["--nproc", "two", "job.py"], "expected an integer"),
    (["missing.py"], "script not found: missing.py"),
    (["--master-port", "70000", "job.py"], "must be a TCP port"),
    (["--grace-period", "-1", "job.py"], "must be a finite duration > 0 s"),
    (["--max-time", "0", "job.py"], "must be a finite duration > 0 s"),
    ([], "the following arguments are required: TARGET"),
])
def test_bad_arguments_are_refused(tmp_path: Path, start, args: list[str], message: str) -> None:
    write_job(tmp_path, 'print("never runs")\n')
    code, out, err = finish(start(*args))
    assert code == 2
    assert "error:" in err and message in err, err
    assert out == ""


# --- the demo and the standalone store ------------------------------------------

@pytest.mark.timeout(60)
def test_demo_with_four_ranks(tmp_path: Path, start) -> None:
    code, out, err = finish(start("--nproc", "4", "-m", "nccl_pg.cli.demo"), timeout=50)
    assert code == 0, err
    lines = rank_lines(out)
    assert sorted(lines) == [0, 1, 2, 3]
    reports = {rank: got[0] for rank, got in lines.items()}
    pids = {rank: int(re.search(r"pid (\d+)", text)[1]) for rank, text in reports.items()}
    for rank, text in reports.items():
        assert text.startswith(f"rank {rank}/4 (local rank {rank}, pid {pids[rank]}")
        for peer in set(pids) - {rank}:
            assert f"{peer}=" in text and str(pids[peer]) in text
    for rank, got in lines.items():  # then every collective through the module API, each checked
        assert got[1] == f"rank {rank}: 10/10 collectives correct on the host backend", got[1]
    table = lines[0][2:]
    assert table[0] == "all 4 ranks met:"
    rows = [row.split() for row in table[2:6]]
    assert [(cells[0], cells[3]) for cells in rows] == [(str(r), str(pids[r])) for r in range(4)]
    collectives = table[6:]
    assert collectives[0] == "10 collectives on 4 ranks (host backend: no GPU here):"
    names = [row.split("  ")[0].strip() for row in collectives[2:]]
    assert names == ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
                     "gather+scatter", "send/recv", "objects", "subgroups async"]
    assert all(row.endswith("correct on every rank") for row in collectives[2:]), collectives


@pytest.mark.gpu
@pytest.mark.skipif(backends.gpu_count() == 0, reason="needs a GPU")
@pytest.mark.timeout(240)
def test_demo_runs_on_nccl_where_there_is_a_gpu(tmp_path: Path, start) -> None:
    """The main job picks the NCCL backend (CuPy arrays) on a GPU machine;
    two ranks share GPU 0 when there is one GPU."""
    pytest.importorskip("cupy", reason="the demo runs on NCCL with CuPy arrays")
    code, out, err = finish(start("--nproc", "2", "-m", "nccl_pg.cli.demo"), timeout=220)
    assert code == 0, err
    lines = rank_lines(out)
    for rank in (0, 1):
        assert f"rank {rank}: 10/10 collectives correct on the nccl backend" in lines[rank], lines[rank]
    assert any(line.startswith("10 collectives on 2 ranks (nccl backend: ") for line in lines[0])


@pytest.mark.timeout(30)
def test_store_command_reports_a_taken_port(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "store", "--host", "127.0.0.1", "--port",
                                 str(port)], cwd=tmp_path, capture_output=True, text=True, timeout=20)
    assert result.returncode == 1
    assert result.stderr.startswith("nccl-pg store: ") and f"127.0.0.1:{port}" in result.stderr


@pytest.mark.timeout(30)
def test_store_command_serves_until_sigterm(tmp_path: Path) -> None:
    from nccl_pg.store import TCPStore

    env = {**os.environ, "NCCL_PG_STORE_SECRET": "s3cret"}
    proc = subprocess.Popen([sys.executable, "-m", "nccl_pg.cli.main", "store", "--host", "127.0.0.1", "--port", "0"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        match = re.fullmatch(r"nccl-pg store: listening on 127\.0\.0\.1:(\d+), authentication on \(\S+\)\n", banner)
        assert match, (banner, proc.stderr.read() if proc.poll() is not None else "")
        store = TCPStore("127.0.0.1", int(match[1]), secret="s3cret", timeout=10)
        store.set("key", b"value")
        assert store.get("key") == b"value"
        store.close()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "received SIGTERM, stopping" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

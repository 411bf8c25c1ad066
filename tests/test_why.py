"""`nccl-pg why`, the launcher's autopsy and the C-level stacks (issue 24
items 2, 3, 4), on live jobs of real processes under `nccl-pg run` (host
backend). A rank says it is in place by creating ``ready.<rank>`` in the
test's folder, after it has issued what the test looks for; the waits below
only bound how long the test waits.

Each test runs with TMPDIR and NCCL_PG_RUNTIME_DIR set to its own folder, so
that the launcher's job records (and `nccl-pg why` with no arguments) see
only this test's job.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import why_scenarios as W
from harness.procs import World, clean_env

from nccl_pg.diagnostics import incidents, inquiry
from nccl_pg.store import TCPStore, TCPStoreServer

JOB = '''\
import itertools, os, pathlib, sys, time
import numpy as np
import nccl_pg as dist

DIR = pathlib.Path(os.environ["TEST_DIR"])

def ready():
    (DIR / f".ready.{dist.get_rank()}").write_text(str(os.getpid()))
    (DIR / f".ready.{dist.get_rank()}").rename(DIR / f"ready.{dist.get_rank()}")

def eval_step():
    if os.environ["STUCK"] == "sleep":
        ready()
        time.sleep(1000)  # STUCK HERE (sleep)
    stacks = pathlib.Path(os.environ["NCCL_PG_DEBUG_INFO_TEMP_FILE"]).parent / "c_stacks" / f"rank1.{os.getpid()}.txt"
    while not stacks.exists():  # the watchdog opens it at its first poll with a group
        time.sleep(0.01)
    ready()
    sum(itertools.repeat(0, 10**13))  # STUCK HERE (spin)

def train_step():
    work = dist.all_reduce(np.ones(4, np.float32), async_op=True)
    ready()
    work.wait()

dist.init_process_group("host", init_method="env://", timeout=float(os.environ.get("TIMEOUT", "600")))
dist.all_reduce(np.ones(4, np.float32))
if dist.get_rank() == 1:
    eval_step()
train_step()
'''


def _line(text: str, marker: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if marker in line)


class Job:
    """`nccl-pg run --nproc 4 job.py` in ``folder`` (``script``: JOB by default), its dumps (and the autopsy's
    report) in folder/dumps."""

    def __init__(self, folder: Path, stuck: str, *launcher_args: str, timeout: float = 600, script: str = JOB) -> None:
        self.dir = folder
        self.script = folder / "job.py"
        self.script.write_text(script)
        self.dumps = folder / "dumps"
        self.env = clean_env({"TEST_DIR": str(folder), "TMPDIR": str(folder), "NCCL_PG_RUNTIME_DIR": str(folder / "run"),
                              "STUCK": stuck, "TIMEOUT": str(timeout),
                              "NCCL_PG_DEBUG_INFO_TEMP_FILE": str(self.dumps / "trace_")})
        self.proc = subprocess.Popen([sys.executable, "-m", "nccl_pg.cli.main", "run", "--nproc", "4",
                                      *launcher_args, str(self.script)], cwd=folder, env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout: float = 30) -> list[int]:
        deadline = time.monotonic() + timeout
        files = [self.dir / f"ready.{r}" for r in range(4)]
        while not all(f.exists() for f in files):
            if self.proc.poll() is not None:
                pytest.fail(f"the launcher exited {self.proc.returncode}: {self.proc.communicate()}")
            assert time.monotonic() < deadline, "ranks not ready"
            time.sleep(0.01)
        return [int(f.read_text()) for f in files]

    def why(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "why", *args], cwd=self.dir, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def finish(self, timeout: float = 60) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


@pytest.fixture
def job(tmp_path: Path):
    made: list[Job] = []

    def start(stuck: str, *args: str, timeout: float = 600, script: str = JOB) -> Job:
        made.append(Job(tmp_path, stuck, *args, timeout=timeout, script=script))
        return made[-1]

    yield start
    for j in made:
        j.close()


def _gone(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                 Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        if not alive:
            return []
        time.sleep(0.02)
    return alive


@pytest.mark.timeout(90)
def test_why_names_the_stuck_rank_and_its_line(job):
    """4 ranks; rank 1 sleeps in eval_step while the others are in all_reduce #2: `nccl-pg why` with no argument
    finds the job (the launcher's record), and within seconds names rank 1 alone, with its host, pid and
    file:line, as a verdict line and in --json."""
    j = job("sleep", "--autopsy-time", "0")
    pids = j.wait_ready()
    t0 = time.monotonic()
    res = j.why()
    took = time.monotonic() - t0
    line = _line(JOB, "STUCK HERE (sleep)")
    assert res.returncode == 1, res  # a problem was found
    verdict = res.stdout.splitlines()[2]
    assert re.fullmatch(rf"  stuck in user code: rank 1 \(\S+, pid {pids[1]}\) never joined all_reduce #2 of group 0 "
                        rf"\(default_pg\), which ranks 0, 2, 3 issued; at {re.escape(str(j.script))}:{line} in eval_step",
                        verdict), \
        res.stdout
    assert "4 of 4 ranks answered" in res.stdout, res.stdout
    assert took < 10, took
    data = json.loads(j.why("--json").stdout)
    first = data["verdicts"][0]
    assert (first["kind"], first["class"], first["ranks"]) == ("stuck_in_user_code", "stuck in user code", [1]), \
        data["verdicts"]
    assert data["ranks"]["1"]["where"]["func"] == "eval_step" and data["ranks"]["1"]["pid"] == pids[1]
    assert data["silent"] == [] and data["ranks"]["0"]["pending"] == ["all_reduce #2 of group 0 for " +
                                                                    data["ranks"]["0"]["pending"][0].split("for ")[1]]


@pytest.mark.timeout(120)
def test_max_time_autopsy_prints_the_verdict_and_leaves_a_report(job):
    """--max-time on the same job: before stopping the ranks the launcher asks them why, prints the verdict
    naming rank 1 and its line, and writes the report (Markdown and JSON) beside the dumps, which the ranks
    wrote; the job ends with 124 and nothing of it left."""
    j = job("sleep", "--max-time", "7", "--autopsy-time", "4", "--grace-period", "2")
    pids = j.wait_ready()
    code, _, err = j.finish(timeout=90)
    line = _line(JOB, "STUCK HERE (sleep)")
    assert code == 124, err
    assert "--max-time 7 s expired; asking the ranks why (at most 4 s) before stopping them" in err, err
    assert re.search(r"nccl-pg run: autopsy \(--max-time 7 s expired\): incident \d+, 4 of 4 ranks answered", err), err
    assert re.search(rf"nccl-pg run:   stuck in user code: rank 1 \(\S+, pid {pids[1]}\) never joined all_reduce #2 of "
                     rf"group 0 \(default_pg\), which ranks 0, 2, 3 issued; at \S+job.py:{line} in eval_step", err), err
    # the verdict comes before the ranks are stopped
    assert err.index("never joined") < err.index("--max-time 7 s expired; sending SIGTERM"), err
    reports = sorted(j.dumps.glob("nccl_pg_autopsy_*.report.*"))
    assert [p.suffix for p in reports] == [".json", ".md"], reports
    data = json.loads(reports[0].read_text())
    assert data["verdicts"][0]["ranks"] == [1] and data["reason"] == "--max-time 7 s expired"
    md = reports[1].read_text()
    assert "## Verdict" in md and f"job.py:{line} in eval_step" in md and "time.sleep(1000)" in md, md
    assert oct(reports[0].stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in j.dumps.glob("trace_?")) == [f"trace_{r}" for r in range(4)]
    assert _gone(pids) == []


@pytest.mark.timeout(120)
def test_first_failure_autopsy_names_the_culprit_from_the_dumps_of_the_dead(job):
    """With a 3 s timeout, ranks 0, 2 and 3 fail ("ranks [1] never issued this collective") and exit: on the first
    failure the launcher asks why; the failed ranks cannot answer any more, but the dumps they wrote at their
    timeout join rank 1's answer in the analysis: rank 1 is named, with its line, and the others as ended."""
    j = job("sleep", "--autopsy-time", "4", "--grace-period", "2", timeout=3.0)
    pids = j.wait_ready()
    code, _, err = j.finish(timeout=90)
    line = _line(JOB, "STUCK HERE (sleep)")
    assert code == 1, err
    first = re.search(r"nccl-pg run: rank (\d) \(pid \d+\) exited with code 1; asking the ranks why", err)
    assert first and first[1] in "023", err
    assert re.search(rf"nccl-pg run:   stuck in user code: rank 1 \(\S+, pid {pids[1]}\) never joined all_reduce #2 of "
                     rf"group 0 \(default_pg\), which ranks 0, 2, 3 issued; at \S+job.py:{line} in eval_step", err), err
    r = int(first[1])  # gone before the autopsy began (the others may still answer as they end): a victim, one line
    victims = re.search(r"nccl-pg run:   failed waiting: ranks? ([\d, ]+) then exited with code 1, each as its operation "
                        r"timed out waiting for rank 1", err)
    assert victims and str(r) in victims[1].split(", ") and "1" not in victims[1].split(", "), err
    assert f"rank {r} (pid {pids[r]}) exited with code 1" in err, err  # the rank's own pid, not its guard's
    assert _gone(pids) == []


@pytest.mark.timeout(120)
def test_a_rank_spinning_in_c_with_the_gil_held_leaves_its_stack(job):
    """Rank 1 spins in C (sum over an iterator: the GIL is never released), so its Python threads cannot answer:
    `nccl-pg why` sends it the C-level stack signal and names it at its line, saying it answered only that way;
    the launcher's autopsy (on SIGTERM) does the same."""
    j = job("spin", "--autopsy-time", "5", "--grace-period", "2")
    pids = j.wait_ready()
    res = j.why("--timeout", "2", "--json")
    line = _line(JOB, "STUCK HERE (spin)")
    data = json.loads(res.stdout)
    r1 = data["ranks"]["1"]
    assert data["silent"] == [1] and r1["answered"] == "c-stack", data
    assert (r1["where"]["file"], r1["where"]["line"], r1["where"]["func"]) == (str(j.script), line, "eval_step")
    assert r1["c_stack_file"] == str(j.dumps / "c_stacks" / f"rank1.{pids[1]}.txt")
    assert [v["kind"] for v in data["verdicts"]] == ["stuck_in_c"], data["verdicts"]
    assert re.fullmatch(rf"stuck in C with the GIL held: rank 1 \(\S+, pid {pids[1]}\) did not answer within [\d.]+ s: its "
                        rf"GIL is held, or it is stuck in C; all_reduce #2 of group 0 \(default_pg\), which ranks 0, 2, 3 "
                        rf"issued, waits for it; its C-level stack has it; at {re.escape(str(j.script))}:{line} in "
                        rf"eval_step", data["verdicts"][0]["text"]), data["verdicts"]
    j.proc.send_signal(signal.SIGTERM)
    code, _, err = j.finish(timeout=60)
    assert code == 128 + signal.SIGTERM
    assert re.search(rf"nccl-pg run:   stuck in C with the GIL held: rank 1 \(\S+, pid {pids[1]}\) did not answer within "
                     rf"[\d.]+ s: its GIL is held, or it is stuck in C; .*; its C-level stack has it; at \S+job.py:{line} in "
                     rf"eval_step", err), err
    assert _gone(pids) == []


@pytest.mark.timeout(90)
def test_the_deadline_timer_writes_the_stack_of_a_rank_stuck_in_c(tmp_path):
    """Rank 1 issues an all_reduce rank 0 never joins (timeout 2 s), then spins in C with the GIL held: soon after
    the operation's deadline (the margin left to the Python diagnosis) the C-level timer appends its stack to its
    file, with nobody asking."""
    with World(2, W.spin_after_issue, tmp_path, args={"timeout": 2.0}) as w:
        w.wait_key("spinning", timeout=30)
        path = tmp_path / "c_stacks" / f"rank1.{w.procs[1].pid}.txt"
        deadline = time.monotonic() + 40
        # Until the main thread's frames are there: faulthandler writes the threads one after the other, and a read
        # on a loaded machine can land between the header and the last thread (a false failure in CI, issue 30).
        while not re.search(r"Timeout \(.*in spin_after_issue", path.read_text(), re.S) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        text = path.read_text()
    assert text.startswith("# nccl_pg C-level stacks: rank 1, pid "), text
    assert "Timeout (0:00:0" in text and re.search(r'File ".*why_scenarios.py", line \d+ in spin_after_issue', text), \
        text


# Rank 2 takes a slow step (200 ms) before each of 7 world all_reduces, and every step also runs an all_reduce on a
# pair subgroup ([0, 1] and [2, 3]), right after the world's (issue 32 item 2: counted over every group at once, the
# pair collectives, where rank 2 is on time, diluted it); then every rank waits in user code, its groups idle, until
# the test is done asking.
STRAGGLER_JOB = '''\
import os, pathlib, time
import numpy as np
import nccl_pg as dist

DIR = pathlib.Path(os.environ["TEST_DIR"])
dist.init_process_group("host", init_method="env://", timeout=60)
rank = dist.get_rank()
pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
x = np.ones(1024, np.float32)
for _ in range(7):
    if rank == 2:
        time.sleep(0.2)  # rank 2's slow step, on purpose
    dist.all_reduce(x)
    dist.all_reduce(x, group=pairs[rank // 2])
(DIR / f".ready.{rank}").write_text(str(os.getpid()))
(DIR / f".ready.{rank}").rename(DIR / f"ready.{rank}")
while not (DIR / "done").exists():
    time.sleep(0.05)
dist.destroy_process_group()
'''


@pytest.mark.timeout(120)
def test_why_stragglers_and_trace_name_the_rank_late_at_the_world_among_subgroups(job):
    """A live 4-rank job where rank 2 is 200 ms late at each of 7 world all_reduces, each followed by an all_reduce on
    a pair subgroup: `nccl-pg why --stragglers` names rank 2 alone, with its host and pid, last at nearly every
    collective of group 0 by about 200 ms, from the timestamps of the recorders the ranks send with their answers;
    nothing is in flight, so no problem (exit 0). The dumps the ranks then write (--dump) give `nccl-pg trace` the
    same straggler, by the same rule. Without the option the words say nothing of stragglers; --json always holds
    them, with each rank's score per group."""
    j = job("none", "--autopsy-time", "0", script=STRAGGLER_JOB)
    pids = j.wait_ready()
    res = j.why("--stragglers", "--dump")
    assert res.returncode == 0 and "  no problem: 4 process(es) answered" in res.stdout, res
    pattern = (r"  straggler: rank (\d) \(host \S+, pid (\d+)\) arrived last at (\d+) of (\d+) collectives of "
               r"group '0', ([\d.]+) ms after the first rank")
    named = re.findall(pattern, res.stdout)
    assert len(named) == 1, res.stdout
    rank, pid, last, compared, late = named[0]
    assert (int(rank), int(pid)) == (2, pids[2]) and int(compared) >= 7 and int(last) >= int(compared) - 1, res.stdout
    assert 150.0 <= float(late) <= 600.0, res.stdout
    plain = j.why()
    assert plain.returncode == 0 and "\nstragglers (" not in plain.stdout, plain.stdout
    data = json.loads(j.why("--json").stdout)
    assert [(s["rank"], s["group"]) for s in data["stragglers"]["stragglers"]] == [(2, "0")], data["stragglers"]
    score = next(s for s in data["stragglers"]["scores"] if (s["rank"], s["group"]) == (2, "0"))
    assert score["straggler"] and score["score"] < 0.5, score  # its group waits for it most of each step
    trace = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "trace", str(j.dumps)], env=j.env,
                           capture_output=True, text=True, timeout=60)
    assert trace.returncode == 0, trace
    assert [(int(r), int(p)) for r, p, *_ in re.findall(pattern, trace.stdout)] == [(2, pids[2])], trace.stdout
    (j.dir / "done").write_text("")
    code, _, err = j.finish(timeout=60)
    assert code == 0, err
    assert _gone(pids) == []


@pytest.mark.timeout(60)
def test_job_records_are_private_removed_at_exit_and_read_as_untrusted(job, tmp_path):
    """The launcher's record: 0600 in a 0700 folder while the job runs, gone after. `nccl-pg why` skips files
    that are not records (a link, garbage) with a note, and removes a record whose launcher is gone."""
    j = job("sleep", "--autopsy-time", "0")
    j.wait_ready()
    folder = tmp_path / "run"
    record = folder / f"run-{j.proc.pid}.json"
    assert oct(folder.stat().st_mode & 0o777) == "0o700" and oct(record.stat().st_mode & 0o777) == "0o600"
    assert json.loads(record.read_text())["launcher_pid"] == j.proc.pid
    (folder / "run-1.json").write_text("{")
    (folder / "run-2.json").symlink_to(record)
    stale = dict(json.loads(record.read_text()), launcher_pid=2**22 + 1)
    (folder / "run-3.json").write_text(json.dumps(stale))
    res = j.why("--json")
    assert json.loads(res.stdout)["verdicts"][0]["ranks"] == [1]
    assert "run-1.json: not a job record" in res.stderr and "run-2.json: not a job record (a symbolic link)" in \
        res.stderr, res.stderr
    assert not (folder / "run-3.json").exists()
    j.close()
    assert not record.exists()


@pytest.mark.timeout(60)
def test_why_with_the_store_given(job, tmp_path):
    """A job not found through the records (torchrun, SLURM): --store HOST:PORT, or MASTER_ADDR/MASTER_PORT, with
    the secret from NCCL_PG_STORE_SECRET; a wrong secret is refused (exit 2, saying it cannot ask)."""
    j = job("sleep", "--autopsy-time", "0")
    j.wait_ready()
    record = json.loads((tmp_path / "run" / f"run-{j.proc.pid}.json").read_text())
    elsewhere = tmp_path / "elsewhere"  # no records there
    elsewhere.mkdir()
    env = {**j.env, "TMPDIR": str(elsewhere), "NCCL_PG_RUNTIME_DIR": str(elsewhere), "NCCL_PG_STORE_SECRET": record["secret"]}
    run = [sys.executable, "-m", "nccl_pg.cli.main", "why", "--json"]
    by_option = subprocess.run([*run, "--store", f"127.0.0.1:{record['port']}"], env=env, capture_output=True,
                               text=True, timeout=30)
    by_env = subprocess.run(run, env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(record["port"]),
                                      "WORLD_SIZE": "4"}, capture_output=True, text=True, timeout=30)
    for res in (by_option, by_env):
        assert res.returncode == 1, res.stdout + res.stderr
        assert json.loads(res.stdout)["verdicts"][0]["ranks"] == [1], res.stdout
    wrong = subprocess.run([*run, "--store", f"127.0.0.1:{record['port']}", "--timeout", "1"],
                           env={**env, "NCCL_PG_STORE_SECRET": "not the secret"}, capture_output=True, text=True,
                           timeout=30)
    assert wrong.returncode == 2 and "cannot ask" in wrong.stderr, wrong
    none = subprocess.run(run, env={k: v for k, v in env.items() if not k.startswith("MASTER_")},
                          capture_output=True, text=True, timeout=30)
    assert none.returncode == 2 and "no job to ask" in none.stderr, none


TORCH_JOB = '''\
import os, pathlib, time
import torch
import torch.distributed as dist
import nccl_pg.torch  # noqa: F401

def eval_step():
    time.sleep(1000)  # STUCK HERE

dist.init_process_group("nccl_pg")
x = torch.ones(2)
dist.all_reduce(x)
work = dist.all_reduce(x, async_op=True) if dist.get_rank() != 1 else None
pathlib.Path(os.environ["TEST_DIR"], f"ready.{dist.get_rank()}").write_text(str(os.getpid()))
if work is None:
    eval_step()
work.wait()
'''


@pytest.mark.timeout(120)
def test_why_on_a_torchrun_job_on_the_nccl_pg_backend(tmp_path):
    """torchrun's store is torch's: `nccl-pg why --torch` asks through torch's client, in the namespace torch gives
    the default group (found in the store's keys), and names rank 1 at its line."""
    pytest.importorskip("torch", reason="needs torch (pip install torch)")
    import socket

    script = tmp_path / "job.py"
    script.write_text(TORCH_JOB)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = clean_env({"TEST_DIR": str(tmp_path), "TMPDIR": str(tmp_path)})
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                            str(port), str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready.{r}").exists() for r in range(4)):
            assert run.poll() is None and time.monotonic() < deadline, "torchrun's ranks not ready"
            time.sleep(0.05)
        pids = [int((tmp_path / f"ready.{r}").read_text()) for r in range(4)]
        res = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "why", "--torch", "--json"],
                             env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, capture_output=True,
                             text=True, timeout=60)
    finally:
        run.send_signal(signal.SIGTERM)  # torchrun stops its workers (each in a session of its own)
        try:
            run.wait(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)
            for f in tmp_path.glob("ready.*"):  # a worker torchrun left behind
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(f.read_text()), signal.SIGKILL)
    data = json.loads(res.stdout)
    assert data["verdicts"][0]["kind"] == "stuck_in_user_code" and data["verdicts"][0]["ranks"] == [1], data["verdicts"]
    assert data["ranks"]["1"]["pid"] == pids[1] and data["ranks"]["1"]["answered"] == "store"
    assert (data["ranks"]["1"]["where"]["line"], data["ranks"]["1"]["where"]["func"]) == (
        _line(TORCH_JOB, "STUCK HERE"), "eval_step")


@pytest.mark.timeout(30)
def test_reports_are_untrusted_input():
    """Reports are read back with a size cap per rank and types checked: an oversized report and garbage are
    noted and skipped, a well-formed one is used; nothing else is taken from the store."""
    server = TCPStoreServer("127.0.0.1", 0).start()
    try:
        store = TCPStore("127.0.0.1", server.port, timeout=10)
        good = json.dumps({"rank": 2, "ranks": [2], "world": 3, "pid": 7, "host": "h", "where": {
            "file": "x.py", "line": 3, "func": "f"}, "threads": [{"name": "MainThread", "main": True,
                                                                   "frames": [["x.py", 3, "f", "pass"]]}]})

        def forger() -> None:  # answers the inquiry's signal as three processes would, two of them badly
            store2 = TCPStore("127.0.0.1", server.port, timeout=10)
            store2.wait([incidents.signal_key(1)], 10)
            store2.set(incidents.report_key(1, 0), b"\x00not json")
            store2.set(incidents.report_key(1, 1), json.dumps({"rank": 1, "pad": "x" * 5000}))
            store2.set(incidents.report_key(1, 2), good)
            store2.set(incidents.reports_world_key(1), b"3")
            store2.set(incidents.reports_all_key(1), b"1")
            store2.close()

        t = threading.Thread(target=forger)
        t.start()
        inq = inquiry.inquire(store, "test", 5.0, cap=4096)
        t.join(10)
        store.close()
    finally:
        server.stop()
    assert sorted(r for r, k in inq.ranks.items() if k.answered) == [2]
    assert inq.silent == [0, 1] and inq.ranks[2].at() == "x.py:3 in f"
    assert sum("not a report (or over 4096 bytes)" in n for n in inq.notes) == 2, inq.notes


@pytest.mark.timeout(30)
def test_the_report_that_completes_the_count_names_the_world():
    """Three processes report; the first counts its report but has not yet named the world size when the other two
    have counted theirs (it was descheduled between its two requests). The inquirer, woken by "all in", still
    learns the world size and reads all three reports (before: it found no size and read none, and `why` said
    "no problem: 0 process(es) answered" about a hung job)."""
    server = TCPStoreServer("127.0.0.1", 0).start()
    try:
        store = TCPStore("127.0.0.1", server.port, timeout=10)

        def reporters() -> None:
            store2 = TCPStore("127.0.0.1", server.port, timeout=10)
            store2.wait([incidents.signal_key(1)], 10)
            for r in range(3):
                store2.set(incidents.report_key(1, r), json.dumps({
                    "rank": r, "ranks": [r], "world": 3, "pid": 7 + r, "host": "h",
                    "where": {"file": "x.py", "line": 3, "func": "f"},
                    "threads": [{"name": "MainThread", "main": True, "frames": [["x.py", 3, "f", "pass"]]}]}))
            store2.add(incidents.reports_count_key(1), 1)  # the first, paused before it names the world
            incidents.count_report(store2, 1, 1, 3)
            incidents.count_report(store2, 1, 1, 3)
            store2.close()

        t = threading.Thread(target=reporters)
        t.start()
        inq = inquiry.inquire(store, "test", 5.0)
        t.join(10)
        store.close()
    finally:
        server.stop()
    assert inq.world == 3 and sorted(r for r, k in inq.ranks.items() if k.answered == "store") == [0, 1, 2], \
        (inq.world, inq.notes)

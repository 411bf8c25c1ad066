"""Diagnosis of real jobs under `nccl-pg run` in the cases issue 32 found wrong: two hanging jobs at once (items 3,
7, 11), a survivor holding the GIL in C when the others time out (item 5), a rank killed by SIGKILL and a mismatch
that ends the job (item 6). Each job is small (3 ranks, host backend) and serves several checks: the launcher's
lines, `nccl-pg trace` on the folder it leaves, and what is left there.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.procs import clean_env

JOB = '''\
import os, pathlib, re, signal, time
import numpy as np
import nccl_pg as dist

DIR = pathlib.Path(os.environ["TEST_DIR"])
MODE, CULPRIT = os.environ["MODE"], int(os.environ.get("CULPRIT", "1"))


def ready(rank=None):
    name = f"ready.{os.environ['JOB_NAME']}.{dist.get_rank() if rank is None else rank}"
    (DIR / f".{name}").write_text(str(os.getpid()))
    (DIR / f".{name}").rename(DIR / name)


def eval_step():
    if MODE == "sleep":
        ready()
        time.sleep(1000)  # STUCK HERE (sleep)
    stacks = pathlib.Path(os.environ["NCCL_PG_DEBUG_INFO_TEMP_FILE"]).parent / "c_stacks" / f"rank1.{os.getpid()}.txt"
    while not stacks.exists():  # the watchdog opens it at its first poll with a group
        time.sleep(0.01)
    ready()
    re.match(r"(a+)+$", "a" * 64 + "b")  # STUCK HERE (spin)


dist.init_process_group("host", init_method="env://", timeout=float(os.environ.get("TIMEOUT", "600")))
rank = dist.get_rank()
x = np.ones(4, np.float32)
dist.all_reduce(x)
if MODE == "kill":
    if rank == 2:
        work = dist.all_reduce(x, async_op=True)
        time.sleep(0.5)  # its watchdog sees the all_reduce in flight
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.5)
    dist.all_reduce(x)
elif MODE == "mismatch":
    dist.all_reduce(np.ones(5 if rank == 1 else 4, np.float32))  # MISMATCH HERE
elif MODE == "mismatch-linger":  # ranks 1 and 2 still alive, their group gone, when rank 0 ends the job
    try:
        dist.all_reduce(np.ones(5 if rank == 1 else 4, np.float32))
    except dist.DistBackendError:
        if dist.is_initialized():  # (error handling may have destroyed it)
            dist.destroy_process_group()
        if rank == 0:
            while not all((DIR / f"ready.{os.environ['JOB_NAME']}.{r}").exists() for r in (1, 2)):
                time.sleep(0.01)
            raise
        ready(rank)
        time.sleep(1000)
else:
    if rank == CULPRIT:
        eval_step()
    work = dist.all_reduce(x, async_op=True)
    ready()
    work.wait()
'''


def _line(marker: str) -> int:
    return next(i for i, line in enumerate(JOB.splitlines(), 1) if marker in line)


class Run:
    """`nccl-pg run --nproc 3 job.py` with MODE (and the given launcher options) in ``folder``, no dump prefix
    given: the dumps go to the job's own folder under ``folder``'s TMPDIR."""

    def __init__(self, folder: Path, name: str, mode: str, *args: str, **env: str) -> None:
        self.folder, self.name = folder, name
        script = folder / "job.py"
        if not script.exists():
            script.write_text(JOB)
        self.script = script
        self.env = clean_env({"TEST_DIR": str(folder), "TMPDIR": str(folder), "NCCL_PG_RUNTIME_DIR": str(folder / "run"),
                              "MODE": mode, "JOB_NAME": name, **env})
        self.proc = subprocess.Popen([sys.executable, "-m", "nccl_pg.cli.main", "run", "--nproc", "3", "--grace-period",
                                      "1", *args, str(script)], cwd=folder, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def pids(self, ranks: range = range(3), timeout: float = 60) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        files = {r: self.folder / f"ready.{self.name}.{r}" for r in ranks}
        while not all(f.exists() for f in files.values()):
            assert self.proc.poll() is None, self.proc.communicate()
            assert time.monotonic() < deadline, "ranks not ready"
            time.sleep(0.02)
        return {r: int(f.read_text()) for r, f in files.items()}

    def finish(self, timeout: float = 90) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
            pytest.fail(f"the launcher did not end: {err}")
        return self.proc.returncode, err

    def job_folder(self) -> Path:
        """The job's dump folder, from the launcher's last line about it (or the only one)."""
        found = sorted((self.folder / f"nccl_pg-{os.getuid()}").glob("job-*"))
        mine = [f for f in found if f.name.endswith(f"-{self.proc.pid}")]
        assert len(mine) == 1, found
        return mine[0]


def trace(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "trace", str(folder), *args],
                          capture_output=True, text=True, timeout=60, env=clean_env())


@pytest.fixture
def runs(tmp_path: Path):
    made: list[Run] = []

    def start(name: str, mode: str, *args: str, **env: str) -> Run:
        made.append(Run(tmp_path, name, mode, *args, **env))
        return made[-1]

    yield start
    for r in made:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGKILL)
            r.proc.communicate()


def _verdicts(text: str) -> list[tuple[str, int]]:
    """(class, rank) of each canonical verdict line naming one rank."""
    return [(m[1], int(m[2])) for m in re.finditer(r"^\s*(?:nccl-pg run:\s+)?([a-zA-Z .-]+?): rank (\d+) \(", text,
                                                   re.M)]


@pytest.mark.timeout(150)
def test_two_hanging_jobs_at_once_each_in_its_folder_each_culprit_its_own(runs, tmp_path: Path) -> None:
    """Two jobs hang at once under one TMPDIR, rank 1 of one, rank 2 of the other: each job's dumps go to a folder
    of its own (its job id); `nccl-pg trace` on each names that job's culprit alone, in the catalogue's words. While
    they hang, each launcher says so once, from its ranks' progress files (--stall-warning), naming the waiting ranks
    and `nccl-pg why`. Afterwards no dump pipe, progress file or header-only stacks file is left, and torch's
    torchfrtrace reads the folder. A folder holding two jobs' dumps is analyzed one job at a time, saying so."""
    a = runs("a", "sleep", "--max-time", "8", "--stall-warning", "1", "--autopsy-time", "3", CULPRIT="1")
    b = runs("b", "sleep", "--max-time", "8", "--stall-warning", "1", "--autopsy-time", "3", CULPRIT="2")
    pids = {"a": a.pids(), "b": b.pids()}
    ends = {"a": a.finish(), "b": b.finish()}
    line = _line("STUCK HERE (sleep)")
    for run, culprit, (code, err) in ((a, 1, ends["a"]), (b, 2, ends["b"])):
        assert code == 124, err
        waiting = ", ".join(str(r) for r in range(3) if r != culprit)
        assert re.search(rf"nccl-pg run: no collective has completed for 1 s: ranks {waiting} wait in all_reduce #2 "
                         rf"of group 0; rank {culprit} has nothing in flight; `nccl-pg why --job {run.proc.pid}` "
                         "says why", err), err
        assert err.count("no collective has completed for") == 1, err
        folder = run.job_folder()
        res = trace(folder)
        assert res.returncode == 1, res
        assert _verdicts(res.stdout) == [("stuck in user code", culprit)], res.stdout
        assert re.search(rf"stuck in user code: rank {culprit} \(\S+, pid {pids[run.name][culprit]}\) never joined "
                         rf"all_reduce #2 of group 0 \(default_pg\), which ranks {waiting} issued; at "
                         rf"{re.escape(str(run.script))}:{line} in eval_step", res.stdout), res.stdout
        left = [p for p in folder.rglob("*")]
        assert not [p for p in left if stat.S_ISFIFO(p.lstat().st_mode)], left
        assert not [p for p in left if p.name == "progress"], left
        for p in (folder / "c_stacks").glob("*.txt") if (folder / "c_stacks").exists() else ():
            assert len(p.read_text().splitlines()) > 1, p  # written to, or removed
    fr = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(a.job_folder()),
                         "-p", "nccl_pg_trace_rank_"], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in fr.stderr and "invalid literal" not in fr.stderr, fr.stderr[-2000:]
    mixed = tmp_path / "mixed"
    shutil.copytree(a.job_folder(), mixed)
    shutil.copy2(b.job_folder() / "nccl_pg_trace_rank_0", mixed / "nccl_pg_trace_rank_0")
    res = trace(mixed)
    assert re.search(r"note: this folder holds the dumps of 2 jobs: analyzing job \S+ \(ranks \[", res.stdout), res.stdout


@pytest.mark.timeout(120)
def test_a_survivor_holding_the_gil_is_named_at_its_line_when_the_others_time_out(runs) -> None:
    """Rank 1 spins in C holding the GIL between two all_reduces; the others' operation timeout (2 s) is far shorter
    than --max-time (40 s): they time out and exit, and the job ends with a verdict naming rank 1 at its line (the
    launcher asks even though no listener can answer: rank 1's C-level stack). The survivors' own timeout message
    names it there too, and its stacks file holds its stack."""
    r = runs("gil", "spin", "--max-time", "40", "--autopsy-time", "4", TIMEOUT="2")
    pids = r.pids()
    code, err = r.finish()
    line = _line("STUCK HERE (spin)")
    assert code == 1, err
    where = rf"at {re.escape(str(r.script))}:{line} in eval_step"
    assert re.search(rf"nccl-pg run:   stuck in C with the GIL held: rank 1 \(\S+, pid {pids[1]}\) did not answer.*"
                     rf"{where}", err), err
    # a survivor's own error, before it exited
    assert re.search(rf"verdict: stuck in C with the GIL held: rank 1 \(\S+, pid {pids[1]}\) did not answer the "
                     rf"diagnosis of all_reduce #2 of group 0: its GIL is held, or it is stuck in C; its C-level stack "
                     rf"has it; {where}", err), err
    folder = r.job_folder()
    stacks = folder / "c_stacks" / f"rank1.{pids[1]}.txt"
    assert "eval_step" in stacks.read_text(), stacks.read_text()
    res = trace(folder)
    assert ("stuck in C with the GIL held", 1) in _verdicts(res.stdout), res.stdout


@pytest.mark.timeout(120)
def test_what_the_launcher_knew_of_a_killed_rank_and_of_a_mismatch(runs) -> None:
    """Rank 2 is killed by SIGKILL inside all_reduce #2: the launcher names it dead, by its own pid, with the
    collective it was in, and writes how each rank ended; `nccl-pg trace` says the same from there (not "left no
    dump" alone). A mismatch that ends the whole job (rank 1 reduces 5 elements, the others 4) still gets a verdict
    naming the odd rank out of three, though no rank is left to ask; no "no verdict within" for a job that ended."""
    k = runs("kill", "kill", "--autopsy-time", "3")
    m = runs("mismatch", "mismatch", "--autopsy-time", "3")
    code, err = k.finish()
    assert code == 128 + signal.SIGKILL, err
    own = re.search(r"nccl-pg run: rank 2 \(pid (\d+)\) was killed by signal SIGKILL", err)
    assert own and int(own[1]) != k.proc.pid, err
    dead = rf"dead: rank 2 \(\S+, pid {own[1]}\) was killed by signal SIGKILL \(9\) in all_reduce #2 of group 0"
    assert re.search(rf"nccl-pg run:   {dead}", err), err
    assert "no verdict within" not in err, err
    res = trace(k.job_folder())
    assert re.search(dead, res.stdout), res.stdout
    code, err = m.finish()
    assert code == 1, err
    # quiet (item 10): one line per dump, no dump named rank -1, no "not destroyed" warning from a rank ending on
    # an exception
    for r in range(3):
        assert err.count(f"[rank{r}]: nccl_pg: rank {r} wrote a debug dump") <= 1, err
    assert "rank_-1" not in err and "was not destroyed before exit" not in err, err
    assert re.search(r"nccl-pg run:   collective mismatch: rank 1 \(\S+, pid \d+\): all_reduce #2 on group '0' "
                     r"\(default_pg\): input sizes differ between ranks", err), err
    assert "no verdict within" not in err, err
    res = trace(m.job_folder())
    assert [v for v in _verdicts(res.stdout) if v[0] == "collective mismatch"] == [("collective mismatch", 1)], \
        res.stdout


@pytest.mark.timeout(120)
def test_a_mismatch_is_named_while_the_other_ranks_are_still_alive(runs) -> None:
    """The mismatch again, rank 0 ending the job while ranks 1 and 2 are still alive, their group destroyed (no
    listener: nobody is asked). Their C-level stacks say where they are; their dumps, written at the failure, still
    join the analysis: the verdict names rank 1. Before, a live rank's C-level stack kept its dump out, and the
    autopsy said the ranks "exited with code 1 before they answered" (seen when ranks were looked at while they
    unwound the mismatch, in a fresh-clone run)."""
    r = runs("linger", "mismatch-linger", "--autopsy-time", "3")
    code, err = r.finish()
    assert code == 1, err
    pids = {k: int((r.folder / f"ready.linger.{k}").read_text()) for k in (1, 2)}
    assert "no rank can be asked" in err, err
    assert re.search(rf"nccl-pg run:   collective mismatch: rank 1 \(\S+, pid {pids[1]}\): all_reduce #2 on group '0' "
                     r"\(default_pg\): input sizes differ between ranks", err), err
    assert not re.search(r"nccl-pg run:   (dead|no answer|stuck)", err), err

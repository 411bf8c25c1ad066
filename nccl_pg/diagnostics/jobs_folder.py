"""One dump folder per job, and how each rank of a job ended.

A job has an id (``job_id``): ``NCCL_PG_JOB_ID``, which `nccl-pg run` and
the test harness set for their ranks, else torchelastic's run id (torchrun)
or SLURM's job and step, made safe as a folder name. Every dump, report and
C-level stacks file carries it, so that `nccl-pg trace` never mixes two
jobs; and the default dump folder is the job's own,
``<tmp>/nccl_pg-<uid>/job-<id>/`` (``folder``), so that two jobs at once
never write into one another's files. Without an id (a plain env://
launch), dumps go to ``<tmp>/nccl_pg-<uid>/`` as before.

The launcher (and the test harness) writes how each rank ended, once the
job is over (``write_endings``): its pid, its exit code or signal, when, and
the collective it was in or last completed (from its progress file,
heartbeat.py). ``nccl-pg trace`` reads it (``read_endings``) to name a rank
that left no dump, and to tell a culprit from its victims.

Old job folders are pruned (``prune``): beyond the newest ``KEEP``, only
folders of this user's named ``job-*``, none written to in the last
``MIN_AGE`` seconds (a job that still runs keeps writing to its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from . import dump
from .dump import job_id

__all__ = ["Ending", "folder", "job_id", "new_id", "prune", "read_endings", "write_endings"]

PREFIX = dump.JOB_FOLDER
KEEP = 20  # job folders kept per user
MIN_AGE = 600.0  # seconds since a folder was last written before it may go
# No dump prefix in it (torch's analyzer reads names with the prefix), no rank-like number before its suffix
# (`nccl-pg trace` takes <stem><number>[.json] for a dump).
ENDINGS = "nccl_pg_job_{job}_endings.json"
_ENDINGS = re.compile(r"nccl_pg_job_([A-Za-z0-9._-]{1,64})_endings\.json")
MAX_ENDINGS_BYTES = 4 << 20


def new_id() -> str:
    """A fresh job id: when and by which process it started (sorts by time)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def folder(job: str) -> str:
    """The job's dump folder, ``<tmp>/nccl_pg-<uid>/job-<id>`` (made 0700, refused unless this user's)."""
    return dump.job_folder(job)


def prune(keep: int = KEEP, min_age: float = MIN_AGE, parent: str | None = None,
          prefix: str = PREFIX) -> list[str]:
    """Remove this user's job folders (``<parent>/<prefix>*``) beyond the
    newest ``keep``, of those not written to for ``min_age`` seconds; returns
    the paths removed. Errors are skipped (another process may prune too)."""
    parent = parent or dump.private_dir()
    found: list[tuple[float, str]] = []
    with contextlib.suppress(OSError):
        for n in os.listdir(parent):
            if not n.startswith(prefix):
                continue
            p = os.path.join(parent, n)
            with contextlib.suppress(OSError):
                st = os.lstat(p)
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                    found.append((st.st_mtime, p))
    found.sort(reverse=True)
    now = time.time()
    gone = []
    for mtime, p in found[keep:]:
        if now - mtime >= min_age:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


@dataclass(frozen=True)
class Ending:
    """How one rank of a job ended: ``how`` in words ("exited with code 1",
    "was killed by signal SIGKILL"), its exit code (None when a signal
    ended it) or signal, when (wall clock), and ``last_op``: the collective
    it was in when it ended ("in all_reduce #5 of group 0") or the last it
    completed ("after all_reduce #4 of group 0"), "" when unknown."""

    rank: int
    pid: int | None
    how: str
    code: int | None
    signal: str | None
    time: float
    last_op: str = ""
    where: str = ""  # where it raised, when known ("test.py:25 in step": the test harness knows)
    stopped: bool = False  # ended by the launcher (or the harness) stopping the job, not on its own
    host: str = field(default_factory=socket.gethostname)  # where it ran (the writer's host: ranks are local)


def write_endings(dump_dir: str, job: str, endings: list[Ending]) -> str | None:
    """The job's endings file in ``dump_dir`` (0600, written whole); its
    path, or None if it could not be written."""
    path = os.path.join(dump_dir, ENDINGS.format(job=job))
    body = json.dumps({"job": job, "ranks": [asdict(e) for e in endings]}, indent=1).encode()
    try:
        dump.write_whole(path, lambda f: f.write(body), ".nccl_pg_endings.")
    except OSError:
        return None
    return path


def read_endings(dump_dir: str) -> dict[str, dict[int, Ending]]:
    """Every job's endings file in ``dump_dir``: {job: {rank: Ending}}, read as
    untrusted input (no link followed, this user's regular file, bounded;
    fields of the wrong type drop the record)."""
    out: dict[str, dict[int, Ending]] = {}
    names: list[str] = []
    with contextlib.suppress(OSError):
        names = [n for n in os.listdir(dump_dir) if _ENDINGS.fullmatch(n)]
    for n in names:
        try:
            data = json.loads(dump.read_bytes(os.path.join(dump_dir, n), MAX_ENDINGS_BYTES))
        except (ValueError, RecursionError, dump.NotADump):
            continue
        job = data.get("job") if isinstance(data, dict) else None
        if not isinstance(job, str) or not isinstance(data.get("ranks"), list):
            continue
        for r in data["ranks"]:
            e = _ending(r)
            if e is not None:
                out.setdefault(job, {})[e.rank] = e
    return out


def _ending(r: Any) -> Ending | None:
    if not isinstance(r, dict):
        return None
    rank, pid, code = r.get("rank"), r.get("pid"), r.get("code")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 1 << 24:
        return None
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool)):
        return None
    if code is not None and (not isinstance(code, int) or isinstance(code, bool)):
        return None
    how, sig, last, where = r.get("how"), r.get("signal"), r.get("last_op", ""), r.get("where", "")
    t = r.get("time")
    if not isinstance(how, str) or (sig is not None and not isinstance(sig, str)) or not isinstance(last, str) \
            or not isinstance(where, str) or isinstance(t, bool) or not isinstance(t, (int, float)):
        return None
    host = r["host"] if isinstance(r.get("host"), str) else ""
    return Ending(rank, pid, how[:300], code, None if sig is None else sig[:32], float(t), last[:200], where[:500],
                  r.get("stopped") is True, host[:255])

"""What `nccl-pg run` keeps of a job besides its processes: the job's id and
dump folder, each rank's progress file, the line that says a job hangs, how
each rank ended, and the cleaning up after it.

- The job's id (``NCCL_PG_JOB_ID``, given to every rank) names its dump
  folder, ``<tmp>/nccl_pg-<uid>/job-<id>/`` unless
  ``NCCL_PG_DEBUG_INFO_TEMP_FILE`` says otherwise; every dump, report and
  stacks file carries it (diagnostics/jobs_folder.py).
- Each rank's watchdog keeps ``<job folder>/progress/<n>`` (heartbeat.py).
  Every second the launcher reads them; when some rank has waited in an
  operation that did not complete for ``--stall-warning`` seconds, it
  prints one line naming the ranks that wait, those with nothing in flight,
  those whose watchdog stopped polling (their GIL held), and `nccl-pg why`.
  Once, until the job moves again. No store traffic.
- When the job fails, how each rank ended (pid, exit code or signal, time,
  the collective it was in) goes into the job's folder for `nccl-pg trace`.
- At the end: the progress files go; so do the dump pipes and the C-level
  stacks files that hold only their header; a job that ended well leaves
  nothing in a folder made for it; job folders beyond the newest 20 are
  pruned at the start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .. import env
from ..diagnostics import dump, heartbeat, jobs_folder, stacks

STALL_WARNING = 60.0  # seconds, by default
CHECK_EVERY = 1.0  # seconds between two reads of the progress files


@dataclass
class RankFiles:
    index: int  # the launcher's number for the process (its rank; a replacement: its member number)
    progress: str
    last: heartbeat.Progress | None = None


@dataclass
class JobFiles:
    """One job's files (see the module's docstring)."""

    job: str
    dump_prefix: str  # NCCL_PG_DEBUG_INFO_TEMP_FILE of the ranks
    own_folder: bool  # the folder was made for this job (the default), not chosen by the user
    stall_warning: float  # 0: no such line
    launcher_pid: int = field(default_factory=os.getpid)
    ranks: dict[int, RankFiles] = field(default_factory=dict)
    warned: bool = False
    next_check: float = 0.0

    @classmethod
    def start(cls, stall_warning: float, environ: Mapping[str, str]) -> JobFiles:
        job = env.JOB_ID.get(environ) or jobs_folder.new_id()
        configured = env.DUMP_FILE.get(environ)
        if configured is None:
            jobs_folder.prune()
            prefix = os.path.join(jobs_folder.folder(job), "nccl_pg_trace_rank_")
        else:
            prefix = configured
        return cls(job, prefix, configured is None, stall_warning)

    @property
    def folder(self) -> str:
        return os.path.dirname(self.dump_prefix) or "."

    def _progress_dir(self) -> str:
        return os.path.join(self.folder, "progress")

    def rank_env(self, index: int) -> dict[str, str]:
        """What rank ``index``'s environment gets for its job."""
        out = {env.JOB_ID.name: self.job, env.DUMP_FILE.name: self.dump_prefix}
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            folder = dump.own_folder(self._progress_dir())
        except OSError:
            return out  # no stall line for this rank; the job runs
        path = os.path.join(folder, str(index))
        self.ranks[index] = RankFiles(index, path)
        return {**out, env.PROGRESS_FILE.name: path}

    def read(self, index: int) -> heartbeat.Progress | None:
        f = self.ranks.get(index)
        if f is None:
            return None
        got = heartbeat.read(f.progress)
        if got is not None:
            f.last = got
        return f.last

    def uses_groups(self) -> bool:
        """Whether some rank made a process group (its watchdog wrote its progress file)."""
        return any(self.read(i) is not None for i in self.ranks)

    # -- the stall line -------------------------------------------------------

    def check(self, live: Sequence[int], now: float | None = None) -> str | None:
        """The line to print when the job seems to hang (at most once until it
        moves again), else None; ``live``: the indices of the ranks running."""
        now = time.monotonic() if now is None else now
        if not self.stall_warning or now < self.next_check:
            return None
        self.next_check = now + CHECK_EVERY
        seen = {i: p for i in live if (p := self.read(i)) is not None}
        limit = self.stall_warning
        if not any(p.in_flight and now - p.changed >= limit for p in seen.values()):
            self.warned = False  # moving (or nobody waits): warn again at the next stall
            return None
        if self.warned:
            return None
        self.warned = True
        waiting = sorted(i for i, p in seen.items() if p.in_flight)
        quiet = sorted(i for i, p in seen.items() if not p.in_flight)
        frozen = sorted(i for i, p in seen.items() if now - p.polled >= limit)
        silent = sorted(i for i in live if i not in seen)
        ops = sorted({seen[i].oldest_op for i in waiting if seen[i].oldest_op})
        line = (f"no collective has completed for {limit:g} s: {_ranks(waiting)} wait in "
                f"{', '.join(ops) or 'an operation'}")
        if quiet:
            line += f"; {_ranks(quiet)} {'has' if len(quiet) == 1 else 'have'} nothing in flight"
        if frozen:
            line += f"; {_ranks(frozen)} did not poll in that time (the GIL held, or stuck in C)"
        if silent:
            line += f"; {_ranks(silent)} made no process group yet"
        return line + f"; `nccl-pg why --job {self.launcher_pid}` says why (--stall-warning 0: no such line)"

    # -- the end ---------------------------------------------------------------

    def ending(self, index: int, pid: int | None, returncode: int, how: str, stopped: bool) -> jobs_folder.Ending:
        p = self.read(index)
        sig = None
        if returncode < 0:
            with contextlib.suppress(ValueError):
                sig = signal.Signals(-returncode).name
        if p is not None and p.raised:  # it ended on its own exception (a stop may have caught it exiting)
            how, stopped = f"raised {p.raised}", False
        return jobs_folder.Ending(index, pid, how, None if returncode < 0 else returncode, sig, time.time(),
                                  "" if p is None else p.describe(), "" if p is None else p.raised_at,
                                  stopped=stopped)

    def finish(self, failed: bool, endings: Sequence[jobs_folder.Ending], pids: Callable[[], Sequence[int]]
               ) -> str | None:
        """At the end of the job: how each rank ended (when it failed), and the
        cleaning up (see the module's docstring). Returns the endings file's
        path, if written."""
        shutil.rmtree(self._progress_dir(), ignore_errors=True)
        folder = self.folder
        for n in _listdir(folder):
            p = os.path.join(folder, n)
            if n.endswith(".pipe") and n.startswith(os.path.basename(self.dump_prefix)):
                with contextlib.suppress(OSError):
                    if stat.S_ISFIFO(os.lstat(p).st_mode):
                        os.unlink(p)
        _remove_header_only(folder, set(pids()))
        path = jobs_folder.write_endings(folder, self.job, list(endings)) if failed and endings else None
        if self.own_folder and not failed:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(folder, stacks.FOLDER))
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only when nothing else is left in it
        return path


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _remove_header_only(folder: str, pids: set[int]) -> None:
    """The C-level stacks files of these processes that hold only their header (a rank killed before its exit
    handler could remove its own)."""
    for paths in stacks.find(folder).values():
        for p in paths:
            with contextlib.suppress(OSError, dump.NotADump):
                written = stacks.read(p, 4096 + 1)
                if written.about.get("pid") in pids and not written.text.strip():
                    os.unlink(p)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.join(folder, stacks.FOLDER))

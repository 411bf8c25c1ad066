"""The launcher's autopsy: before `nccl-pg run` stops a job (``--max-time``,
the first rank to fail, SIGTERM/SIGINT/SIGHUP), it asks the ranks why,
through the incident channel of the store it hosts (diagnostics/inquiry.py:
each rank reports its state and stacks and writes its debug dump; the ranks
that do not answer are sent the C-level stack signal), prints the verdict
and writes a report beside the dumps, JSON and Markdown:
``<dump dir>/nccl_pg_autopsy_<time>_<launcher pid>.report.{json,md}``, with
the answers as dumps in ``...answers/`` (`nccl-pg trace` reads them).
The launcher starts one only when someone can answer: a process group's
listener has a wait parked on its store.

It runs on a thread of its own, bounded by ``--autopsy-time``, while the
launcher's loop goes on passing the ranks' output through (a rank blocked
writing to a full pipe could not answer).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping

from .. import env
from ..diagnostics import dump, findings, inquiry, stacks
from ..store import TCPStore

AUTOPSY_TIME = 5.0  # seconds, by default, between the reason to stop and the stop
_MARGIN = 0.5  # of the autopsy's time, kept for reading the answers and writing the report


class Autopsy:
    def __init__(self, addr: str, port: int, secret: str, nproc: int, reason: str, seconds: float,
                 report_dir: str | None, wake: Callable[[], None], gone: Callable[[], dict[int, str]],
                 started: float, dump_prefix: str | None = None, listening: bool = True,
                 local: Mapping[int, int] | None = None) -> None:
        """``gone``: how the ranks that ended did ({rank: "exited with code 1"});
        ``started``: the job's start (wall clock): older dumps are not its own;
        ``dump_prefix``: the ranks' (default: this process's); ``listening``:
        a process group's listener is parked on the store (else nobody is
        asked: the C-level stacks of ``local``, {rank: pid} of those still
        running, and the dumps speak)."""
        self.addr, self.port, self.secret, self.nproc = addr, port, secret, nproc
        self.reason, self.seconds, self.report_dir, self._wake = reason, seconds, report_dir, wake
        self._gone, self._started = gone, started
        self._prefix = dump_prefix or dump.prefix()
        self._listening, self._local = listening, dict(local or {})
        self.deadline = time.monotonic() + seconds + 1.0  # the thread's own bounds, and a second to spare
        self.lines: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nccl_pg-autopsy", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._done.is_set()

    def _run(self) -> None:
        try:
            self.lines = self._ask()
        except Exception as exc:
            self.lines = [f"autopsy failed: {type(exc).__name__}: {exc}"]
        finally:
            self._done.set()
            self._wake()

    def _ask(self) -> list[str]:
        answers = max(0.5, self.seconds - inquiry.STACKS_WAIT - _MARGIN)
        store = TCPStore(self.addr, self.port, secret=self.secret, timeout=self.seconds + 5.0,
                         connect_timeout=min(self.seconds, 5.0))
        try:
            folder = self._folder()
            signum = env.STACKS_SIGNAL.get()
            looks = 0

            def look() -> inquiry.Inquiry:
                nonlocal looks
                looks += 1  # the first look asks for the dumps (fresh ones, before the ranks are stopped)
                wait = max(0.5, min(answers, self.deadline - 1.0 - _MARGIN - inquiry.STACKS_WAIT - time.monotonic()))
                return inquiry.inquire(store, f"autopsy by nccl-pg run: {self.reason}", wait, world=self.nproc,
                                       dump=looks == 1, local=self._ranks_here(signum), signum=signum,
                                       dumps_dir=None if folder is None else f"{folder}.answers",
                                       gone=self._gone, dump_of=self._dump_of, ask=self._listening,
                                       known=self._local)

            if self._listening:
                inq = findings.ask(look, max(0.0, self.deadline - 1.0 - _MARGIN - time.monotonic()))
            else:
                inq = findings.one_look(look())
        finally:
            store.close()
        answered = len(inq.ranks) - len(inq.silent)
        lines = [f"autopsy ({self.reason}): incident {inq.incident}, {answered} of {self.nproc} ranks answered in "
                 f"{inq.waited:.2f} s"]
        lines += [f"  {v['text']}" for v in inq.verdicts]
        lines += [f"  note: {n}" for n in inq.notes]
        if folder is not None:
            lines += self._write(folder, inq)
        return lines

    def _ranks_here(self, signum: int) -> Callable[[], Mapping[int, int]]:
        """{rank: pid} of the job's ranks still running, for their C-level stacks: the launcher's own list,
        else those found by their environment."""
        def find() -> Mapping[int, int]:
            alive = {r: p for r, p in self._local.items() if r not in self._gone()}
            return alive or stacks.find_ranks(self.addr, self.port, signum)
        return find

    def _dump_of(self, rank: int) -> str | None:
        """The debug dump a rank that did not answer wrote during this job (say, at its own timeout)."""
        try:
            path = f"{self._prefix}{rank}"
            return path if os.stat(path).st_mtime >= self._started else None
        except OSError:
            return None

    def _folder(self) -> str | None:
        """The report's path without its suffix: beside the dumps, unless --report-dir."""
        try:
            where = self.report_dir or os.path.dirname(self._prefix) or "."
            os.makedirs(where, mode=0o700, exist_ok=True)
        except OSError:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return os.path.join(where, f"nccl_pg_autopsy_{stamp}_{os.getpid()}")

    def _write(self, stem: str, inq: inquiry.Inquiry) -> list[str]:
        out = []
        for suffix, text in ((".report.json", json.dumps({"reason": self.reason, **findings.to_json(inq)}, indent=1)),
                             (".report.md", findings.to_markdown(inq, f"nccl-pg run autopsy: {self.reason}"))):
            path = stem + suffix
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                out.append(path)
            except OSError as exc:
                return [f"  could not write the report {path}: {exc}"]
        return [f"  report: {out[1]} (and {os.path.basename(out[0])})"]

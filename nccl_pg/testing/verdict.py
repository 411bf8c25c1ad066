"""The verdict on a run of process ranks: the results, a skip, or
``RanksFailed`` naming the culprits (the ranks that failed on their own,
and those a diagnosed timeout blamed, rather than the ranks that timed out
waiting for them), where each is in its code, and what it printed."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
import unittest
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..diagnostics import frames, jobs_folder, stacks
from ..diagnostics.printable import safe
from ..diagnostics.verdicts import format_verdict, who
from ..errors import Culprit
from .failures import RanksFailed, report
from .rank_main import ENTRY, Failure

# Lines of a rank's output shown in the error (all of it is in its file).
TAIL_LINES = 20
# Lines of each rank's output echoed to this process's stdout after a run.
ECHO_LINES = 1000


@dataclass
class Outcome:
    """What the harness saw of one job on every rank."""

    timeout: float
    grace: float
    failed_early: bool  # the wait ended a grace after a failure, not at the deadline
    answers: dict[int, tuple[Any, ...]]  # ("ok", result) or (kind, Failure)
    stuck: dict[int, stacks.Written | None]  # ranks still running when the harness gave up: their C-level stacks
    exitcodes: dict[int, int | None]
    pids: list[int]
    host: str
    outputs: dict[int, str]
    output_files: dict[int, str]
    dump_dir: str


# The most of a rank's output the harness holds in memory (its tail); all of it stays in the rank's file.
TAIL_BYTES = 1 << 20


def read_from(path: str, offset: int) -> str:
    """A rank's output from ``offset`` (this job's), at most its last
    ``TAIL_BYTES``: a rank that prints 200 MB must not cost this process as
    much (a first line says how much more the file holds)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(offset, size - TAIL_BYTES)
            f.seek(start)
            tail = f.read(TAIL_BYTES).decode(errors="replace")
    except OSError:
        return ""
    if start > offset:
        cut = tail.find("\n") + 1  # from a whole line
        return f"[... {start + cut - offset} earlier bytes in {path}]\n" + tail[cut:]
    return tail


def main_frames(written: stacks.Written | None) -> list[frames.Frame]:
    """A stuck rank's main thread in its C-level stacks, outermost first,
    without the harness's own frames (those of rank_main.py and below)."""
    threads = written.threads() if written is not None else []
    main = next((t for t in threads if t.name == "MainThread"), threads[0] if threads else None)
    found = main.frames if main is not None else []
    ours = [i for i, f in enumerate(found) if os.path.abspath(f.file) == ENTRY]
    return found[ours[-1] + 1:] if ours else found


def unreadable(exc: BaseException) -> Failure:
    """A rank's answer that this process could not unpickle."""
    return Failure(f"its answer could not be read here: {type(exc).__name__}: {exc}",
                   "".join(traceback.format_exception(exc)))


def prefixed(rank: int, text: str, last: int | None = None) -> str:
    lines = text.splitlines()
    cut = lines[-last:] if last is not None else lines
    return "".join(f"[rank {rank}] {line}\n" for line in cut)


def echo(outcome: Outcome) -> None:
    """Every rank's output of this run, prefixed with its rank, to this
    process's stdout (which pytest captures and shows with a failure)."""
    for r in sorted(outcome.outputs):
        text = outcome.outputs[r]
        if text:
            lines = text.count("\n") + (not text.endswith("\n"))
            if lines > ECHO_LINES:
                sys.stdout.write(f"[rank {r}] ... ({lines - ECHO_LINES} earlier lines in {outcome.output_files[r]})\n")
            sys.stdout.write(prefixed(r, text, ECHO_LINES))
    sys.stdout.flush()


def _exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"exit code {code}: killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def failure_kind(f: Failure | None, code: int | None) -> str:
    """The catalogue's class (diagnostics/verdicts.py) of a rank that failed on its own."""
    text = f.summary if f is not None else ""
    if text.startswith("NanError"):
        return "nan"
    if "aborted" in text[:200] and "timeout" not in text[:60]:
        return "aborted"
    if text.startswith("DistStoreError") or "rendezvous" in text[:200]:
        return "init_timeout" if "timeout" in text.lower()[:200] or "timed out" in text.lower()[:200] else \
            "store_unreachable"
    return "exception" if f is not None and f.trace else "dead"


def comm_kind(f: Failure | None) -> str:
    """The class of a communication error that names no culprit (its own words say why)."""
    text = f.summary if f is not None else ""
    if "join the communicator" in text or "rendezvous" in text:
        return "init_timeout"
    if "every rank issued it" in text:
        return "slow_link"
    if "from the store" in text or "store did not answer" in text:
        return "store_unreachable"
    if "aborted" in text[:200]:
        return "aborted"
    return "no_answer"


def unexplained(o: Outcome) -> bool:
    """Whether every failure is a communication error that names no culprit (a mismatch, a point-to-point
    deadlock, a lost link): then the ranks' dumps can tell (``judge``'s ``from_dumps``)."""
    answers = [m for m in o.answers.values() if m[0] != "ok"]
    return bool(answers) and not o.stuck and all(m[0] == "comm_error" and isinstance(m[1], Failure)
                                                 and not m[1].culprits for m in answers)


def judge(o: Outcome, from_dumps: Sequence[Mapping[str, Any]] = ()) -> list[Any] | RanksFailed | unittest.SkipTest:
    """The results, a skip, or RanksFailed; ``from_dumps``: the verdicts of
    the trace analysis of the run's dumps (diagnostics/classify.py), used
    when the failures are communication errors that name nobody."""
    n = len(o.pids)
    kind = {r: m[0] for r, m in o.answers.items()}
    failure = {r: m[1] for r, m in o.answers.items() if m[0] != "ok" and isinstance(m[1], Failure)}
    bad = [r for r in range(n) if r in o.stuck or kind.get(r) != "ok" or o.exitcodes[r] not in (0, None)]
    if not bad:
        return [o.answers[r][1] for r in range(n)]
    own = [r for r in bad if r not in o.stuck and kind.get(r) not in ("comm_error", "skip")]
    named: dict[int, tuple[Culprit, list[int]]] = {}
    for r, f in sorted(failure.items()):
        for c in f.culprits if kind[r] == "comm_error" else ():
            named.setdefault(c.rank, (c, []))[1].append(r)
    skips = [r for r in bad if kind.get(r) == "skip"]
    if skips and not own:
        return unittest.SkipTest(f"{failure[skips[0]].summary} (rank {skips[0]})")
    comm = [r for r in bad if kind.get(r) == "comm_error"]
    dumped = [v for v in from_dumps if v.get("problem") and v.get("ranks")] if not own and not named else []
    blamed = sorted(set(own) | set(named)) or sorted(o.stuck) or sorted({r for v in dumped for r in v["ranks"]}) \
        or comm
    when = f"{o.grace:g} s after the first failure" if o.failed_early else f"at the timeout of {o.timeout:g} s"

    culprits, lines = [], []
    for r in blamed:
        where = failure[r].where if r in failure else None
        if r in o.stuck:
            where = frames.user_frame(main_frames(o.stuck[r])) or where
        reasons = []
        if r in own:
            code = o.exitcodes[r]
            reasons.append(f"raised {failure[r].summary}" if r in failure else
                           f"ended ({_exit(code)}) without a result or a traceback")
            cls = failure_kind(failure.get(r), code)
        elif r in named:
            c, by = named[r]
            reasons.append(f"{c.reason} (named by the timeout diagnosis on ranks {by})")
            cls = c.kind or "never_joined"
            if where is None and c.file is not None:
                where = frames.Frame(c.file, c.line or 0, c.function or "?")
        else:
            cls = comm_kind(failure.get(r))
        if r in o.stuck:
            reasons.append(f"still running {when}, killed")
            if r not in own and r not in named:
                cls = "stuck_in_user_code"
        culprit = Culprit(r, "; ".join(reasons), o.host, o.pids[r], where.file if where else None,
                          where.line if where else None, where.function if where else None, kind=cls)
        culprits.append(culprit)
        if r in own:
            code = o.exitcodes[r]
            sig = f", killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else ""
            status = " (still running: a warm rank)" if code is None else f" (exit code {code}{sig})"
            lines.append(format_verdict(cls, f"{who(r, o.host, o.pids[r])} failed{status}"
                                        + (f": {failure[r].summary}" if r in failure else ""), culprit.where or ""))
        elif r in named:
            lines.append(format_verdict(cls, f"{who(r, o.host, o.pids[r])} {reasons[0]}", culprit.where or "")
                         + (f"; still running {when}, killed" if r in o.stuck else ""))
    stuck_only = [r for r in blamed if r not in own and r not in named]
    if dumped and not o.stuck:  # the dumps name them: in the trace analysis's words, which are everyone's
        lines += [str(v["text"]) for v in dumped]
        kinds = {r: str(v["kind"]) for v in dumped for r in v["ranks"]}
        culprits = [Culprit(c.rank, c.reason, c.host, c.pid, c.file, c.line, c.function, kind=kinds.get(c.rank, c.kind))
                    for c in culprits]
    elif stuck_only and all(r in o.stuck for r in stuck_only):
        at = "; ".join(f"rank {c.rank} at {c.where}" for c in culprits if c.rank in stuck_only and c.where)
        lines.append(format_verdict("stuck_in_user_code", f"ranks {stuck_only} were still running {when} and were "
                                    "killed" + (f" ({at})" if at else "")))
    elif stuck_only:  # only communication errors, nobody named: the ranks that failed are all there is
        lines += [format_verdict(c.kind, f"{who(c.rank, o.host, o.pids[c.rank])} failed with a communication error"
                                 + (f": {failure[c.rank].summary}" if c.rank in failure else ""))
                  for c in culprits if c.rank in stuck_only]
    echoes = [r for r in comm if r not in blamed]
    if echoes:
        lines.append(format_verdict("victim", f"ranks {', '.join(map(str, echoes))} then failed with communication "
                                    "errors, waiting for the ranks above"))
    others = [r for r in sorted(o.stuck) if r not in blamed]
    early = any(not f.started for f in failure.values())
    if others:
        lines.append(f"ranks {others} were waiting for them to start and were killed" if early else
                     f"ranks {others} were still running {when} and were killed")

    failures = {r: "killed: waiting at the start for the ranks that failed\n" if early and r in others else
                _section(o, r, failure.get(r), r in blamed, bool(named) and r in echoes) for r in bad}
    message = "; ".join(lines) + f"\n(output and dumps in {o.dump_dir})\n" + report(failures, blamed)
    return RanksFailed(safe(message), blamed, failures, culprits, o.dump_dir)


def endings(o: Outcome, last_ops: Mapping[int, str]) -> list[jobs_folder.Ending]:
    """How each rank of a failed run ended, in the launcher's form (jobs_folder.py), for `nccl-pg trace`."""
    out = []
    answers = {r: m[1] for r, m in o.answers.items() if m[0] != "ok" and isinstance(m[1], Failure)}
    for r, code in sorted(o.exitcodes.items()):
        f = answers.get(r)
        if r in o.stuck:
            how = "was still running when the harness gave up, and was killed"
            found = frames.user_frame(main_frames(o.stuck[r]))
            where = found.where if found else ""
        else:
            how = (f"raised {f.summary}" if f is not None and f.summary else
                   "exited" if code == 0 else _exit(code).replace("exit code", "exited with code", 1))
            where = f.where.where if f is not None and f.where is not None else ""
        sig = signal.Signals(-code).name if code is not None and code < 0 else None
        out.append(jobs_folder.Ending(r, o.pids[r], how[:300], None if code is None or code < 0 else code, sig,
                                      time.time(), last_ops.get(r, ""), where, stopped=r in o.stuck))
    return out


def _section(o: Outcome, r: int, f: Failure | None, blamed: bool, victim: bool = False) -> str:
    """Rank ``r``'s part of the report: how it ended, its stack or traceback
    (one line for a victim of a named culprit: the rest is in its output
    file), its last output."""
    out = []
    if r in o.stuck:
        written, main = o.stuck[r], main_frames(o.stuck[r])
        out.append("killed: still running; its main thread (C-level stack, most recent call last"
                   + (f"; every thread in {written.path}" if written is not None else "") + "):\n"
                   + ("".join(frames.format_traceback(main)) if main else "  (no stack written)\n"))
    else:
        out.append(_exit(o.exitcodes[r]) + ("" if f is not None else ", without a result or a traceback") + "\n")
    if f is not None and victim:
        out.append(f"{f.summary} (its traceback: {o.output_files[r]})\n")
    elif f is not None:
        out.append(f.trace)
    if o.outputs.get(r) and (blamed or f is None):
        out.append(f"its last output (all of it in {o.output_files[r]}):\n" + prefixed(r, o.outputs[r], TAIL_LINES))
    return "".join(out)

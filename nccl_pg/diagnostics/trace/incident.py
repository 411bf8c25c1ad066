"""Which dumps of a folder ``nccl-pg trace`` analyzes together, and what it
knows of each rank besides its recorder.

- One job at a time: every dump (and C-level stacks file) of ours carries
  its job's id (``NCCL_PG_JOB_ID``); a folder that holds dumps of several
  jobs (two jobs given one ``NCCL_PG_DEBUG_INFO_TEMP_FILE``, a folder copied
  together) is never analyzed as one: the newest job is picked, unless
  ``--job`` names one, and a note says which and what else is there. Dumps
  without an id (torch's, older ones) are a job of their own, "unknown".
- One incident: a dump written more than ``STALE_S`` seconds before the
  newest of its job shows where its rank *was* (a rank that dumped at
  another's first failure signal and went on, or died early): it is said
  so ("was in X when it dumped"), and an operation in flight only in such
  dumps is a note, never "the first collective that did not complete".
- How each rank ended, when the launcher or the test harness wrote it
  (``jobs_folder.read_endings``): a rank that left no dump is named dead
  with its exit status and the collective it was in, and the ranks that
  failed waiting for it are not blamed; a rank that ended raising an
  exception is placed where it raised it (``locate``), whatever stack a
  dump it wrote earlier shows.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import jobs_folder
from ..classify import Facts, victim_of
from ..frames import Frame
from ..verdicts import who
from .loading import Dump, Folder
from .whereabouts import locate

STALE_S = 3.0
UNKNOWN = "unknown"  # the job of dumps that carry no id


@dataclass
class Incident:
    job: str | None
    notes: list[str] = field(default_factory=list)
    newest: float | None = None  # the newest dump's time (wall clock)
    stale: dict[int, float] = field(default_factory=dict)  # rank -> seconds its dump is older than the newest
    endings: dict[int, jobs_folder.Ending] = field(default_factory=dict)


def _when(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "?"


def pick(folder: Folder, job: str | None = None) -> Incident:
    """Keep in ``folder`` the dumps of one job (see the module's docstring);
    the others are dropped from it, with a note."""
    by_job: dict[str, dict[int, Dump]] = collections.defaultdict(dict)
    for r, d in folder.dumps.items():
        by_job[d.job or UNKNOWN][r] = d
    for d in folder.stacks_only.values():
        by_job.setdefault(d.job or UNKNOWN, {})
    newest = {j: max((d.time or 0.0 for d in ds.values()), default=0.0) for j, ds in by_job.items()}
    notes = []
    if job is not None:
        chosen = job if job in by_job else None
        if chosen is None:
            notes.append(f"no dump of job {job!r} here; jobs here: {', '.join(sorted(by_job)) or 'none'}")
    elif len(by_job) > 1:
        chosen = max(by_job, key=lambda j: (newest[j], j != UNKNOWN))
        others = ", ".join(f"{j} (ranks {sorted(by_job[j])}, dumped at {_when(newest[j])})"
                           for j in sorted(by_job) if j != chosen)
        notes.append(f"this folder holds the dumps of {len(by_job)} jobs: analyzing job {chosen} (ranks "
                     f"{sorted(by_job[chosen])}, the newest, dumped at {_when(newest[chosen])}); the others: {others} "
                     "(--job to choose)")
    else:
        chosen = next(iter(by_job), None)
    keep = by_job.get(chosen, {}) if chosen is not None else {}
    folder.dumps = dict(sorted(keep.items()))
    folder.stacks_only = {r: d for r, d in folder.stacks_only.items() if (d.job or UNKNOWN) == chosen}
    inc = Incident(None if chosen in (None, UNKNOWN) else chosen, notes)
    times = {r: d.time for r, d in folder.dumps.items() if d.time is not None}
    if inc.job is not None:
        inc.endings = jobs_folder.read_endings(folder.directory).get(inc.job, {})
    for r, ending in inc.endings.items():
        if r in folder.dumps and ending.how.startswith("raised ") and not ending.stopped:
            folder.dumps[r].raised_at = Frame.of_where(ending.where)
    if times:
        inc.newest = max(times.values())
        for r, t in times.items():
            # older than the newest dump, or than its own end when it ended on its own: it went on after dumping
            e = inc.endings.get(r)
            ref = max(inc.newest, e.time if e is not None and not e.stopped else 0.0)
            if ref - t > STALE_S:
                inc.stale[r] = ref - t
    return inc


def facts(inc: Incident, dumps: Mapping[int, Dump], stacks_only: Mapping[int, Dump]) -> dict[int, Facts]:
    """What ``classify`` needs of each rank: who, how it ended, whether its dump is older than the incident."""
    out: dict[int, Facts] = {}
    for r in sorted(set(dumps) | set(stacks_only) | set(inc.endings)):
        d = dumps.get(r) or stacks_only.get(r)
        e = inc.endings.get(r)
        f = Facts(who(r, (d.host if d else None) or (e.host if e else None), (d.pid if d else None) or (e.pid if e else None)),
                  "dump" if r in dumps else "c-stack" if r in stacks_only else None)
        if d is not None:
            at = locate(d)
            if at.get("source") in ("python", "c") and at.get("file"):
                f.where = f"{at['file']}:{at['line']} in {at['function']}"
        if e is not None and not e.stopped:  # a rank the launcher stopped did not end on its own
            f.gone, f.last_op = e.how, e.last_op
            f.where = e.where or f.where
            f.victim = victim_of(str(d.data.get("reason") or "") if d is not None else "", e.how)
        if r in inc.stale:
            f.stale = f"its dump is {inc.stale[r]:.1f} s older than the newest of this job's"
        out[r] = f
    return out


def settle(report: dict[str, Any], inc: Incident) -> None:
    """An operation in flight only in dumps older than the incident is not
    known to be stuck: its "did not complete" becomes a note."""
    if not inc.stale:
        return
    kept = []
    for p in report["problems"]:
        ranks = [r for r in p.get("ranks", []) if isinstance(r, int)]
        if p.get("kind") == "not_completed" and ranks and all(r in inc.stale for r in ranks):
            report["notes"].append(f"{p['message']}: it was in flight when {'they' if len(ranks) > 1 else 'it'} "
                                   f"dumped, {min(inc.stale[r] for r in ranks):.1f} s or more before the newest dump "
                                   "of this job or their own end: not known to be stuck")
            if report.get("first_incomplete") is p:
                report["first_incomplete"] = None
            continue
        kept.append(p)
    report["problems"] = kept
    report["ok"] = not kept

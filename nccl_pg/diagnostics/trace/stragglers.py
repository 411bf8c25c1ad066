"""Stragglers before they become hangs: per rank, how late it arrives at the
collectives its flight recorder holds, and which ranks are consistently
last and by how much.

Only what the recorder already keeps is used (no store traffic, nothing
measured while the job runs): each entry's issue time
(``time_created_ns``, the wall clock of its host), its completion time as
seen by that rank (``time_discovered_completed_ns``) and, with timing on
(``NCCL_PG_ENABLE_TIMING``), its ``duration_ms`` between the start and end
events on the stream.

A collective (same group, same ``collective_seq_id``) is compared when at
least two ranks hold it completed. A rank's lateness at it is its arrival
minus the first rank's arrival, measured one of two ways:

- **GPU events**, when every rank holds a ``duration_ms``: a collective
  ends at about the same moment on every rank (none can finish before the
  last one arrives), so a rank that started later spent less time in it:
  lateness = longest duration − its duration. Each duration is measured on
  one device, so no clocks are compared; it also catches a rank whose GPU
  is late (its CPU may have issued early).
- **Issue times** otherwise: lateness = issue time − the earliest issue
  time, after each host's clock offset is taken out. Ranks on one host
  share a clock. A host's offset to the first rank's host is the median,
  over the collectives both hold, of the difference of their completion
  times (which happen at about the same true moment on both); it is
  reported. Where no completion times allow that, the hosts' clocks are
  taken as synchronized (NTP), and a note says so.

Per group: a rank is named a straggler when it is last at ``MIN_SHARE``
or more of at least ``MIN_COLLECTIVES`` of one group's collectives and its
median lateness there is at least ``threshold_ms`` (default
``THRESHOLD_MS``): ranks of a healthy job are last in turn and by little.
Counting over every group at once would dilute it: a rank late at the world
group's collectives is on time at a pair subgroup's issued right after
them. Each rank's score in each group (``verdicts.StragglerScore``) says how
much of that group's step goes to waiting for it.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..verdicts import StragglerScore, format_verdict, straggler_score, typical_step
from .loading import Dump, outcome

THRESHOLD_MS = 5.0
MIN_SHARE = 0.75
MIN_COLLECTIVES = 5


@dataclass
class Stragglers:
    stragglers: list[StragglerScore]  # named: the worst score first
    ranks: dict[int, StragglerScore]  # each rank's worst group
    collectives: int  # collectives compared
    method: str  # "gpu events", "issue times" or both, or "none"
    threshold_ms: float
    clock_offsets_ms: dict[str, float]  # host -> offset from the first rank's host
    notes: list[str] = field(default_factory=list)
    scores: list[StragglerScore] = field(default_factory=list)  # every rank in every group

    def as_dict(self) -> dict[str, Any]:
        return {"stragglers": [r.as_dict() for r in self.stragglers],
                "ranks": {str(r): v.as_dict() for r, v in sorted(self.ranks.items())},
                "scores": [s.as_dict() for s in self.scores],
                "collectives": self.collectives, "method": self.method, "threshold_ms": self.threshold_ms,
                "clock_offsets_ms": {h: round(v, 3) for h, v in self.clock_offsets_ms.items()},
                "notes": self.notes}

    def text(self) -> list[str]:
        """The report in words: one line per straggler (the catalogue's words), or why there is none."""
        if not self.collectives:
            return ["stragglers: no collective completed on two ranks or more with times to compare"]
        head = (f"stragglers ({self.collectives} collectives compared per group, by {self.method}; named when last "
                f"at {MIN_SHARE:.0%} or more of a group's collectives (at least {MIN_COLLECTIVES}) and "
                f"{self.threshold_ms:g} ms or more late, median):")
        lines = [head]
        lines += [f"  {format_verdict('straggler', s.text())}" for s in self.stragglers]
        if not self.stragglers:
            worst = max(self.scores, key=lambda r: (r.last / max(r.collectives, 1), r.median_ms), default=None)
            detail = (f"; most often last: rank {worst.rank} in group {worst.group!r}, at {worst.last} of "
                      f"{worst.collectives}, {worst.median_ms:.1f} ms late (median)" if worst is not None else "")
            lines.append(f"  none: no rank is consistently last at a group's collectives{detail}")
        if any(self.clock_offsets_ms.values()):
            lines.append("  clock offsets taken out: " + ", ".join(
                f"{h} {v:+.1f} ms" for h, v in sorted(self.clock_offsets_ms.items())))
        lines.extend(f"  note: {n}" for n in self.notes)
        return lines


@dataclass
class _Arrival:
    rank: int
    domain: str  # clock: the host, or the rank when its host is unknown
    created_ns: int
    completed_ns: int | None
    duration_ms: float | None


def find(dumps: Mapping[int, Dump], threshold_ms: float = THRESHOLD_MS) -> Stragglers:
    """The late ranks of each group's collectives that ``dumps`` hold
    completed on two ranks or more, scored per group (a rank late at one
    group's collectives is found whatever the other groups do). ``dumps``
    are checked dumps: ``trace.load``'s (files), or
    ``trace.loading.load_bytes``'s (e.g. ranks' answers through the store)."""
    matched = _matched(dumps)
    domains = {r: (d.host or f"rank {r}") for r, d in dumps.items()}
    notes: list[str] = []
    offsets = _offsets(matched, domains, min(dumps, default=0), notes)
    late: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    margins: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    last: collections.Counter[tuple[str, int]] = collections.Counter()
    firsts: dict[str, list[float]] = collections.defaultdict(list)  # per group: its first arrivals (ms)
    methods: set[str] = set()
    for (group, _seq), arrivals in matched.items():
        at = {a.rank: a.created_ns / 1e6 - offsets.get(a.domain, 0.0) for a in arrivals}
        firsts[group].append(min(at.values()))
        if all(a.duration_ms is not None and a.duration_ms > 0 for a in arrivals):
            methods.add("gpu events")
            longest = max(a.duration_ms or 0.0 for a in arrivals)
            lateness = {a.rank: longest - (a.duration_ms or 0.0) for a in arrivals}
        else:
            methods.add("issue times")
            first = min(at.values())
            lateness = {r: t - first for r, t in at.items()}
        order = sorted(lateness, key=lambda r: lateness[r])
        latest, runner_up = order[-1], order[-2]
        last[(group, latest)] += 1
        margins[(group, latest)].append(lateness[latest] - lateness[runner_up])
        for r, x in lateness.items():
            late[(group, r)].append(x)
    steps = {g: typical_step([t / 1e3 for t in ts]) for g, ts in firsts.items()}
    scores = []
    for (group, r), v in sorted(late.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        median = statistics.median(v)
        step = steps.get(group)
        step_ms = None if step is None else step * 1e3
        named = len(v) >= MIN_COLLECTIVES and last[(group, r)] >= MIN_SHARE * len(v) and median >= threshold_ms
        scores.append(StragglerScore(r, group, len(v), last[(group, r)], median, max(v),
                                     statistics.median(margins[(group, r)]) if margins[(group, r)] else 0.0, step_ms,
                                     straggler_score(median, step_ms), named, dumps[r].host, dumps[r].pid))
    named_ = sorted((s for s in scores if s.straggler), key=lambda s: (s.score, -s.median_ms))
    worst: dict[int, StragglerScore] = {}
    for s in scores:
        if s.rank not in worst or (s.straggler, -s.score, s.median_ms) > (worst[s.rank].straggler,
                                                                          -worst[s.rank].score, worst[s.rank].median_ms):
            worst[s.rank] = s
    method = " and ".join(sorted(methods)) or "none"
    host_offsets = {d: v for d, v in offsets.items() if not d.startswith("rank ")}
    return Stragglers(named_, worst, len(matched), method, threshold_ms, host_offsets, notes, scores)


def _matched(dumps: Mapping[int, Dump]) -> dict[tuple[str, int], list[_Arrival]]:
    """(group, seq) -> each rank's arrival, for the collectives that at
    least two ranks hold completed, with an issue time."""
    found: dict[tuple[str, int], list[_Arrival]] = collections.defaultdict(list)
    for r, d in dumps.items():
        by_seq: dict[tuple[str, int], list[dict[str, Any]]] = collections.defaultdict(list)
        for e in d.entries:
            if not e["_p2p"] and not e["is_p2p"] and e["collective_seq_id"] > 0:
                by_seq[(e["process_group"][0], e["collective_seq_id"])].append(e)
        for key, es in by_seq.items():
            end = es[-1]  # a coalesced group: its parts, then the entry that closes it
            created = min(int(e["time_created_ns"] or 0) for e in es)
            if not created or outcome(end, d.tracks_states) != "completed":
                continue
            found[key].append(_Arrival(r, d.host or f"rank {r}", created, end["time_discovered_completed_ns"] or None,
                                       end["duration_ms"]))
    return {k: v for k, v in found.items() if len(v) >= 2}


def _offsets(matched: Mapping[tuple[str, int], Sequence[_Arrival]], domains: Mapping[int, str], first: int,
             notes: list[str]) -> dict[str, float]:
    """Each clock domain's offset (ms) from the first rank's, from completion
    times (see the module's doc); 0 where they cannot tell."""
    ref = domains.get(first, "")
    samples: dict[str, list[float]] = collections.defaultdict(list)
    for arrivals in matched.values():
        done: dict[str, list[float]] = collections.defaultdict(list)
        for a in arrivals:
            if a.completed_ns:
                done[a.domain].append(a.completed_ns / 1e6)
        if ref not in done:
            continue
        base = statistics.median(done[ref])
        for dom, times in done.items():
            if dom != ref:
                samples[dom].append(statistics.median(times) - base)
    offsets = {ref: 0.0}
    blind = sorted({d for d in domains.values() if d != ref and d not in samples})
    for dom, s in samples.items():
        offsets[dom] = statistics.median(s)
    if blind and len(set(domains.values())) > 1:
        notes.append(f"no completion times to compare the clocks of {', '.join(blind)} with {ref}'s: taken as "
                     f"synchronized")
    return offsets

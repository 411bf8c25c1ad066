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

A rank is named a straggler when it is last at ``MIN_SHARE`` or more of at
least ``MIN_COLLECTIVES`` collectives and its median lateness is at least
``threshold_ms`` (default ``THRESHOLD_MS``): ranks of a healthy job are
last in turn and by little.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .loading import Dump, outcome

THRESHOLD_MS = 5.0
MIN_SHARE = 0.75
MIN_COLLECTIVES = 5


@dataclass
class RankLateness:
    rank: int
    host: str | None
    pid: int | None
    collectives: int  # compared collectives it took part in
    last: int  # of which it arrived last
    median_ms: float  # lateness behind the first arrival
    max_ms: float
    margin_ms: float  # when last: median lead over the next-latest rank
    groups: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "collectives": self.collectives, "last": self.last,
                "median_ms": round(self.median_ms, 3), "max_ms": round(self.max_ms, 3),
                "margin_ms": round(self.margin_ms, 3), "groups": self.groups}


@dataclass
class Stragglers:
    stragglers: list[RankLateness]  # latest first
    ranks: dict[int, RankLateness]
    collectives: int  # collectives compared
    method: str  # "gpu events", "issue times" or both, or "none"
    threshold_ms: float
    clock_offsets_ms: dict[str, float]  # host -> offset from the first rank's host
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"stragglers": [r.as_dict() for r in self.stragglers],
                "ranks": {str(r): v.as_dict() for r, v in sorted(self.ranks.items())},
                "collectives": self.collectives, "method": self.method, "threshold_ms": self.threshold_ms,
                "clock_offsets_ms": {h: round(v, 3) for h, v in self.clock_offsets_ms.items()},
                "notes": self.notes}

    def text(self) -> list[str]:
        """The report in words: one line per straggler, or why there is none."""
        if not self.collectives:
            return ["stragglers: no collective completed on two ranks or more with times to compare"]
        head = (f"stragglers ({self.collectives} collectives compared, by {self.method}; named when last at "
                f"{MIN_SHARE:.0%} or more and {self.threshold_ms:g} ms or more late, median):")
        lines = [head]
        for s in self.stragglers:
            who = ", ".join(p for p in (f"host {s.host}" if s.host else "", f"pid {s.pid}" if s.pid else "") if p)
            lines.append(f"  rank {s.rank}{f' ({who})' if who else ''} arrived last at {s.last} of {s.collectives} collectives "
                         f"(group {', '.join(map(repr, s.groups))}), {s.median_ms:.1f} ms after the first rank "
                         f"(median; at most {s.max_ms:.1f} ms), {s.margin_ms:.1f} ms after the next-latest")
        if not self.stragglers:
            worst = max(self.ranks.values(), key=lambda r: (r.last / max(r.collectives, 1), r.median_ms),
                        default=None)
            detail = (f"; most often last: rank {worst.rank}, at {worst.last} of {worst.collectives}, "
                      f"{worst.median_ms:.1f} ms late (median)" if worst is not None else "")
            lines.append(f"  none: no rank is consistently last{detail}")
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
    """The late ranks of the collectives that ``dumps`` hold completed on two
    ranks or more. ``dumps`` are checked dumps: ``trace.load``'s (files), or
    ``trace.loading.load_bytes``'s (e.g. ranks' answers through the store)."""
    matched = _matched(dumps)
    domains = {r: (d.host or f"rank {r}") for r, d in dumps.items()}
    notes: list[str] = []
    offsets = _offsets(matched, domains, min(dumps, default=0), notes)
    late: dict[int, list[float]] = collections.defaultdict(list)
    margins: dict[int, list[float]] = collections.defaultdict(list)
    last: collections.Counter[int] = collections.Counter()
    groups: dict[int, set[str]] = collections.defaultdict(set)
    methods: set[str] = set()
    for (group, _seq), arrivals in matched.items():
        if all(a.duration_ms is not None and a.duration_ms > 0 for a in arrivals):
            methods.add("gpu events")
            longest = max(a.duration_ms or 0.0 for a in arrivals)
            lateness = {a.rank: longest - (a.duration_ms or 0.0) for a in arrivals}
        else:
            methods.add("issue times")
            at = {a.rank: a.created_ns / 1e6 - offsets.get(a.domain, 0.0) for a in arrivals}
            first = min(at.values())
            lateness = {r: t - first for r, t in at.items()}
        order = sorted(lateness, key=lambda r: lateness[r])
        latest, runner_up = order[-1], order[-2]
        last[latest] += 1
        groups[latest].add(group)
        margins[latest].append(lateness[latest] - lateness[runner_up])
        for r, v in lateness.items():
            late[r].append(v)
    ranks = {r: RankLateness(r, dumps[r].host, dumps[r].pid, len(v), last[r], statistics.median(v), max(v),
                             statistics.median(margins[r]) if margins[r] else 0.0, sorted(groups[r]))
             for r, v in late.items()}
    named = [s for s in ranks.values() if s.collectives >= MIN_COLLECTIVES
             and s.last >= MIN_SHARE * s.collectives and s.median_ms >= threshold_ms]
    named.sort(key=lambda s: -s.median_ms)
    method = " and ".join(sorted(methods)) or "none"
    host_offsets = {d: v for d, v in offsets.items() if not d.startswith("rank ")}
    return Stragglers(named, ranks, len(matched), method, threshold_ms, host_offsets, notes)


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

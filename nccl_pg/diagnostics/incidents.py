"""The incident protocol: its keys in the store, the signal's encoding, and
finding the newest incident.

An incident ``gen`` is raised by creating ``nccl_pg/diag/<gen>/signal``
(``compare_set``, so two raisers never take one number: the later takes the
next). Incidents are numbered 1, 2, ... without gaps, so the keys that exist
are a prefix of that sequence. ``nccl_pg/diag/latest`` is a hint of the
newest, for listeners that start late; it is read as untrusted input (anyone
with write access to the store can set it): a value that is not a number, or
names an incident that was never raised, is reported and replaced by a
search (about 2 log2(n) ``check`` requests for n incidents).

Ranks are asked through the signal for their progress on each group
(``answer``: diagnosis.py), their dump (``dump``), or a report of their
state and stacks (``report``: its size cap in bytes, for ``nccl-pg why``
and the launcher's autopsy: report.py, inquiry.py).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from ..store import Store

log = logging.getLogger(__name__)

NS = "nccl_pg/diag"
LATEST = f"{NS}/latest"  # a hint of the newest incident, for listeners that start late
# The largest report a rank writes, whatever the signal asks (and what a reader accepts per rank).
REPORT_MAX = 1 << 20
_GEN_DIGITS = 18  # an incident number in the hint: at most this many digits (int64)


def signal_key(gen: int) -> str:
    """The key whose creation raises incident ``gen``."""
    return f"{NS}/{gen}/signal"


def answer_key(gen: int, ident: str, rank: int) -> str:
    """Where rank ``rank`` of group ``ident`` answers incident ``gen``."""
    return f"{NS}/{gen}/{ident}/{rank}"


def count_key(gen: int, ident: str) -> str:
    """How many ranks of group ``ident`` answered incident ``gen`` (``add``)."""
    return f"{NS}/{gen}/{ident}/answered"


def all_key(gen: int, ident: str) -> str:
    """Set by the answer that completes ``count_key``: every rank answered."""
    return f"{NS}/{gen}/{ident}/all"


def report_key(gen: int, rank: int) -> str:
    """Where the process whose lowest global rank is ``rank`` reports for incident ``gen``."""
    return f"{NS}/{gen}/report/{rank}"


def reports_count_key(gen: int) -> str:
    """How many global ranks the reports of incident ``gen`` cover (``add``)."""
    return f"{NS}/{gen}/report/count"


def reports_all_key(gen: int) -> str:
    """Set by the report that brings the count to the world size."""
    return f"{NS}/{gen}/report/all"


def reports_world_key(gen: int) -> str:
    """The world size, as the first process to report saw it (and the last, with ``reports_all_key``)."""
    return f"{NS}/{gen}/report/world"


def count_report(store: Store, gen: int, ranks: int, world: int) -> None:
    """Count a report covering ``ranks`` global ranks of a job of ``world``
    toward incident ``gen``. The first to count names the world size (for
    an inquirer that reads a partial count at its deadline); the one that
    completes the count names it again in the request that says all are in,
    since the first may not have named it yet by then."""
    n = store.add(reports_count_key(gen), ranks)
    if n >= world:
        store.multi_set([reports_world_key(gen), reports_all_key(gen)], [str(world), b"1"])
    elif n == ranks:
        store.set(reports_world_key(gen), str(world))


@dataclass
class Signal:
    reason: str
    origin: str  # the raiser's token (a channel's, or an inquiry's)
    answer: bool  # answer with progress per group (timeouts)
    dump: bool  # write a dump
    claims: list[str] = field(default_factory=list)  # timed-out operations it is about: their ranks dumped already
    # groups whose answers are counted (ident -> size): the rank whose answer completes a group's count sets its
    # all_key, one key for the raiser to wait on (a wait on every rank's key would cost the server O(N) per answer)
    counted: dict[str, int] = field(default_factory=dict)
    report: int = 0  # > 0: report state and stacks in at most this many bytes

    def encode(self) -> bytes:
        return json.dumps({"reason": self.reason, "origin": self.origin, "answer": self.answer, "dump": self.dump,
                           "claims": self.claims, "counted": self.counted, "report": self.report,
                           "time": time.time()}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Signal | None:
        """None for anything that is not a signal (the store is shared)."""
        try:
            d = json.loads(raw)
            report = d.get("report", 0)
            if isinstance(report, bool) or not isinstance(report, int):
                return None
            return cls(str(d["reason"]), str(d["origin"]), bool(d["answer"]), bool(d["dump"]),
                       [str(c) for c in d["claims"]], {str(k): int(v) for k, v in d["counted"].items()},
                       max(0, min(report, REPORT_MAX)))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def parse_gen(raw: bytes) -> int | None:
    """An incident number as the hint holds it; None if it is not one."""
    text = raw.decode("ascii", "replace")
    return int(text) if text.isdigit() and text.isascii() and len(text) <= _GEN_DIGITS else None


def newest(store: Store, warned: set[bytes] | None = None) -> int:
    """The newest incident raised on ``store`` (0: none): the hint, checked,
    then forward past any raised since it was written. A hint that is not a
    number, or names an incident that does not exist, is reported (once per
    value in ``warned``) and the newest is searched for instead."""
    raw = store.compare_set(LATEST, "", "0")
    hint = parse_gen(raw)
    if hint is None or (hint > 0 and not store.check([signal_key(hint)])):
        what = "is not an incident number" if hint is None else "names an incident that was never raised"
        if warned is None or raw not in warned:
            log.warning("nccl_pg: the store's %s = %r %s; ignoring it and searching for the newest incident",
                        LATEST, raw[:64], what)
            if warned is not None and len(warned) < 16:
                warned.add(raw)
        hint = _search(store)
    gen = hint
    while store.check([signal_key(gen + 1)]):
        gen += 1
    return gen


def _search(store: Store) -> int:
    """The newest incident without a hint: galloping, then halving (the raised ones are 1..n)."""
    lo, step = 0, 1
    while store.check([signal_key(lo + step)]):
        lo, step = lo + step, step * 2
    hi = lo + step  # signal_key(lo) exists (or lo == 0), signal_key(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if store.check([signal_key(mid)]):
            lo = mid
        else:
            hi = mid
    return lo


def present(store: Store, keys: list[str], deadline: float) -> list[str]:
    """The keys that exist, by halving: about 2 log2(n/k) ``check`` requests
    per missing key. Keys not reached by ``deadline`` count as missing."""
    found: list[str] = []
    todo = [keys] if keys else []
    while todo and time.monotonic() < deadline:
        ks = todo.pop()
        if store.check(ks):
            found += ks
        elif len(ks) > 1:
            todo += [ks[len(ks) // 2:], ks[:len(ks) // 2]]
    return found


def raise_signal(store: Store, signal: Signal, start: int) -> int:
    """Create the first free incident from ``start`` with ``signal``; returns its number."""
    value = signal.encode()
    gen = start
    while store.compare_set(signal_key(gen), "", value) != value:
        gen += 1  # taken by another incident: the next one
    return gen


def note_latest(store: Store, gen: int) -> None:
    """Update the hint (only a hint: a failure is not an error)."""
    try:
        store.set(LATEST, str(gen))
    except Exception as exc:
        log.debug("nccl_pg: could not note incident %d: %s", gen, exc)

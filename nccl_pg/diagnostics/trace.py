"""``nccl-pg trace``: who is where, and who is missing, from the flight-recorder
dumps of every rank.

It reads a directory of dumps (ours, PyTorch's pickles, or either as JSON),
lines the ranks up per process group (by the group's name and member ranks)
and per sequence number (``collective_seq_id`` for collectives; for
point-to-point operations the k-th send from a to b is paired with the k-th
receive at b from a), and reports:

- ranks missing from a collective, and where each of them is instead (its
  newest operation that did not complete, and its last one on that group);
- operation, size and dtype mismatches between the ranks of a collective, and
  send/recv pairs that disagree or have no partner;
- the first collective that did not complete anywhere (a hang or a failure);
- ranks expected by a group's membership that left no dump.

Ring-buffer wrap: entries with a ``record_id`` below the largest first
``record_id`` of any rank are dropped (as PyTorch's analyzer does), and within
a group only the sequence numbers every truncated rank still holds are
compared. Exit status: 0 when everything is consistent, 1 when a problem was
found, 2 when no dump could be read.

Every file is untrusted input (a dump folder may be writable by others):
``dump.read`` runs no code from its bytes and refuses links and files of
other users, and each dump is checked against the layout before analysis;
a file that fails is reported as not a readable dump, saying why, and the
others are analyzed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import dump as _dump

EXIT_OK, EXIT_PROBLEMS, EXIT_NO_DUMPS = 0, 1, 2
_FILE = re.compile(r"^(.*?)(\d+)(\.json)?$")
_P2P_TYPES = ("send", "recv")
# Collectives whose inputs (or outputs) may legitimately differ between ranks.
_ROOTED_IN = {"gather"}  # outputs only on the root
_ROOTED_OUT = {"scatter"}  # inputs only on the root
_UNEVEN = {"all_to_all", "all_to_all_single", "all_to_all_v_single", "all_gather_v", "reduce_scatter_v"}
_NO_SIZES = {"barrier", "all_reduce_barrier", "coalesced"}
_ALL_GATHER = {"all_gather", "_all_gather_base", "_allgather_base", "all_gather_into_tensor_coalesced"}
_REDUCE_SCATTER = {"reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced"}
_SAME_IN_OUT = {"all_reduce", "allreduce_coalesced", "all_reduce_coalesced", "broadcast"}
_MISMATCH_CAP = 10  # size/dtype mismatches reported per group before the rest are only counted


# --- reading ------------------------------------------------------------------------------


@dataclass
class Dump:
    rank: int
    path: str
    data: dict[str, Any]
    entries: list[dict[str, Any]] = field(default_factory=list)
    truncated: bool = False  # entries are missing at its start (ring wrap, only_active, or dropped here)
    tracks_states: bool = True  # False for recorders that never move entries past "scheduled" (Gloo's)


def find_dumps(directory: str, prefix: str | None = None) -> tuple[dict[int, str], str, list[str]]:
    """``{rank: path}`` of the dumps in ``directory``, the prefix used, and notes.
    Without ``prefix`` it is inferred: the file-name stem (before the rank
    number) that most files share."""
    notes: list[str] = []
    names = sorted(n for n in os.listdir(directory)
                   if _file_or_link(os.path.join(directory, n)) and not n.endswith((".pipe", ".tmp"))
                   and not n.startswith("."))
    by_stem: dict[str, dict[int, str]] = collections.defaultdict(dict)
    for n in names:
        if prefix is not None:
            if not n.startswith(prefix):
                continue
            m = re.fullmatch(r"(\d+)(\.json)?", n[len(prefix):])
            if m is None:
                continue
            stem, rank = prefix, int(m.group(1))
        else:
            m = _FILE.match(n)
            if m is None:
                continue
            stem, rank = m.group(1), int(m.group(2))
        if rank in by_stem[stem]:
            notes.append(f"rank {rank}: several dumps ({os.path.basename(by_stem[stem][rank])}, {n}); "
                         f"using the first")
            continue
        by_stem[stem][rank] = os.path.join(directory, n)
    if not by_stem:
        return {}, prefix or "", notes
    stem = prefix if prefix is not None else max(by_stem, key=lambda s: (len(by_stem[s]), s))
    if prefix is None and len(by_stem) > 1:
        others = ", ".join(repr(s) for s in sorted(by_stem) if s != stem)
        notes.append(f"several file-name prefixes in {directory}; using {stem!r} (others: {others}; "
                     f"choose with --prefix)")
    return dict(sorted(by_stem[stem].items())), stem, notes


def _file_or_link(path: str) -> bool:
    """A regular file, or a symbolic link (listed so that it is reported as refused, not silently skipped)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISLNK(mode)


def load(paths: Mapping[int, str]) -> tuple[dict[int, Dump], list[dict[str, Any]]]:
    """Read and check the dumps; a file that is not a readable dump becomes a
    problem saying why, and the rest are read. A dump that names its own
    rank (ours do) wins over the rank in its file name."""
    dumps: dict[int, Dump] = {}
    problems: list[dict[str, Any]] = []
    for rank, path in paths.items():
        try:
            d = _checked(rank, path, _dump.read(path))
        except Exception as exc:  # NotADump, or anything the layout check missed: never the whole run
            why = str(exc) if isinstance(exc, _dump.NotADump) else f"{type(exc).__name__}: {exc}"
            problems.append({"kind": "unreadable", "ranks": [rank], "path": path,
                             "message": f"{path}: not a readable dump ({why})"})
            continue
        if d.rank in dumps:
            problems.append({"kind": "unreadable", "ranks": [d.rank], "path": path,
                             "message": f"{path}: not used: it says it is rank {d.rank}, like "
                                      f"{dumps[d.rank].path}"})
            continue
        dumps[d.rank] = d
    return dumps, problems


# Values checked per file at most: a small pickle can share one list many times over (its memo), and
# walking what it expands to must not run away.
_CHECK_BUDGET = 50_000_000


class _Checker:
    """Checks a dump's decoded data against the layout this tool reads, into
    plain values of known types (NotADump naming the first field that is not)."""

    def __init__(self) -> None:
        self.left = _CHECK_BUDGET

    def _spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise _dump.NotADump(f"more than {_CHECK_BUDGET} values to check")

    def int_(self, v: Any, what: str, default: int | None = 0) -> int:
        self._spend()
        if v is None and default is not None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise _dump.NotADump(f"{what} is {_kind(v)}, not an integer")
        return v

    def opt_int(self, v: Any, what: str) -> int | None:
        return None if v is None else self.int_(v, what)

    def number(self, v: Any, what: str) -> float | None:
        self._spend()
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _dump.NotADump(f"{what} is {_kind(v)}, not a number")
        return float(v)

    def str_(self, v: Any, what: str, default: str | None = None) -> str:
        self._spend()
        if v is None and default is not None:
            return default
        if not isinstance(v, str):
            raise _dump.NotADump(f"{what} is {_kind(v)}, not a string")
        return v

    def list_(self, v: Any, what: str) -> list[Any]:
        self._spend()
        if v is None:
            return []
        if not isinstance(v, (list, tuple)):
            raise _dump.NotADump(f"{what} is {_kind(v)}, not a list")
        self._spend(len(v))
        return list(v)

    def sizes(self, v: Any, what: str) -> list[Any]:
        out: list[Any] = []
        for i, s in enumerate(self.list_(v, what)):
            if isinstance(s, (list, tuple)):
                out.append([self.int_(d, f"{what}[{i}]", None) for d in self.list_(s, f"{what}[{i}]")])
            else:
                out.append(self.int_(s, f"{what}[{i}]", None))
        return out

    def entry(self, e: Any, i: int) -> dict[str, Any]:
        what = f"entries[{i}]"
        if not isinstance(e, dict):
            raise _dump.NotADump(f"{what} is {_kind(e)}, not a dict")
        pg = self.list_(e.get("process_group") or ["?", "?"], f"{what}.process_group")
        out: dict[str, Any] = {
            "record_id": self.int_(e.get("record_id"), f"{what}.record_id"),
            "process_group": (self.str_(pg[0] if pg else "?", f"{what}.process_group[0]"),
                              self.str_(pg[1] if len(pg) > 1 else "", f"{what}.process_group[1]")),
            "profiling_name": self.str_(e.get("profiling_name"), f"{what}.profiling_name", "?"),
            "state": self.str_(e.get("state"), f"{what}.state", "scheduled"),
            "retired": bool(e.get("retired")),
            "is_p2p": bool(e.get("is_p2p")),
            "time_created_ns": self.int_(e.get("time_created_ns"), f"{what}.time_created_ns"),
            "time_discovered_completed_ns": self.opt_int(e.get("time_discovered_completed_ns"),
                                                         f"{what}.time_discovered_completed_ns"),
            "duration_ms": self.number(e.get("duration_ms"), f"{what}.duration_ms"),
        }
        for k in ("collective_seq_id", "p2p_seq_id", "op_id"):
            out[k] = self.int_(e.get(k), f"{what}.{k}")
        for k in ("input_sizes", "output_sizes"):
            out[k] = self.sizes(e.get(k), f"{what}.{k}")
        for k in ("input_dtypes", "output_dtypes"):
            out[k] = [self.str_(x, f"{what}.{k}") for x in self.list_(e.get(k), f"{what}.{k}")]
        return out

    def pg_config(self, v: Any) -> dict[str, dict[str, Any]]:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise _dump.NotADump(f"pg_config is {_kind(v)}, not a dict")
        self._spend(len(v))
        out: dict[str, dict[str, Any]] = {}
        for k, cfg in v.items():
            name = cfg.get("name", k) if isinstance(cfg, dict) else k
            if isinstance(name, bool) or not isinstance(name, (str, int)):
                raise _dump.NotADump(f"pg_config has a group named by {_kind(name)}")
            name = str(name)
            if not isinstance(cfg, dict):
                out[name] = {"desc": "", "ranks": None}
                continue
            out[name] = {"desc": self.str_(cfg.get("desc"), f"pg_config[{name!r}].desc", ""),
                         "ranks": self.ranks(cfg.get("ranks"), f"pg_config[{name!r}].ranks")}
        return out

    def ranks(self, v: Any, what: str) -> list[int] | None:
        """Members as torch writes them (a string of a list, e.g. "[0, 1]") or a list; None if neither."""
        if isinstance(v, str):
            self._spend(len(v))
            if not re.fullmatch(r"\s*\[[\d,\s]*\]\s*", v):
                return None
            v = json.loads(v)
        if isinstance(v, (list, tuple)):
            return [self.int_(r, what, None) for r in self.list_(v, what)]
        return None


def _kind(v: Any) -> str:
    return "missing" if v is None else f"a {type(v).__name__}"


def _checked(rank: int, path: str, data: dict[str, Any]) -> Dump:
    c = _Checker()
    r = data.get("rank", rank)
    r = r if isinstance(r, int) and not isinstance(r, bool) and r >= 0 else rank
    raw = c.list_(data.get("entries"), "entries")
    entries = [_normal(c.entry(e, i)) for i, e in enumerate(raw)]
    entries.sort(key=lambda e: e["record_id"])
    plain = {"version": c.str_(data.get("version"), "version", "?"),
             "reason": data.get("reason") if isinstance(data.get("reason"), str) else None,
             "time": c.number(data.get("time"), "time"),
             "pg_config": c.pg_config(data.get("pg_config"))}
    return Dump(r, path, plain, entries)


def _normal(e: dict[str, Any]) -> dict[str, Any]:
    """A checked entry plus its parsed name."""
    name = e["profiling_name"]
    lib, _, rest = name.partition(":") if ":" in name else ("", "", name)
    kind, _, meta = rest.partition(" ")
    e["_lib"], e["_kind"], e["_meta"] = lib, kind, meta
    e["_p2p"] = kind in _P2P_TYPES
    return e


# --- analysis -----------------------------------------------------------------------------


@dataclass
class Group:
    name: str
    desc: str
    members: list[int]  # global ranks, in group-rank order
    known: bool  # members from pg_config (else: the ranks whose entries name it)


@dataclass
class Op:
    """One rank's record of one collective (or coalesced group) of a group."""

    rank: int
    seq: int
    entries: list[dict[str, Any]]
    outcome: str  # completed / failed / started / scheduled

    @property
    def last(self) -> dict[str, Any]:
        return self.entries[-1]

    @property
    def kind(self) -> str:
        return self.last["_kind"]

    @property
    def signature(self) -> tuple[str, ...]:
        """What must agree between ranks: the operation, and for a coalesced
        group the kinds of its parts."""
        return (self.kind, *(e["_kind"] for e in self.entries[:-1]))

    def sizes(self, which: str) -> list[Any]:
        parts = self.entries[:-1] if len(self.entries) > 1 else self.entries
        return [s for e in parts for s in e[which]] or self.last[which]

    @property
    def time_created_ns(self) -> int:
        return min(int(e.get("time_created_ns") or 0) for e in self.entries)


def _outcome(e: dict[str, Any], tracks_states: bool) -> str:
    if e["state"] == "completed" or (e["retired"] and not tracks_states):
        return "completed"
    if e["retired"]:
        return "failed"
    return str(e["state"])


def _numel(sizes: Iterable[Any]) -> int:
    total = 0
    for s in sizes:
        n = 1
        for d in s if isinstance(s, (list, tuple)) else (s,):
            n *= int(d)
        total += n
    return total


def _fmt_ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Analysis:
    def __init__(self, dumps: dict[int, Dump], allow_incomplete_ranks: bool = False) -> None:
        self.dumps = dumps
        self.allow_incomplete = allow_incomplete_ranks
        self.problems: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.groups: dict[str, Group] = {}
        self.incomplete: list[dict[str, Any]] = []  # first incomplete collective of each group
        self.group_stats: dict[str, dict[str, Any]] = {}

    # --- preparation

    def _align_wrap(self) -> None:
        """Drop what not every rank can still show: record ids below the
        largest first record id (the ring wrapped on that rank)."""
        firsts = {r: d.entries[0]["record_id"] for r, d in self.dumps.items() if d.entries}
        cut = max(firsts.values(), default=0)
        for r, d in self.dumps.items():
            kept = [e for e in d.entries if e["record_id"] >= cut]
            d.truncated = bool(d.entries) and (d.entries[0]["record_id"] > 0 or len(kept) < len(d.entries))
            if len(kept) < len(d.entries):
                self.notes.append(f"rank {r}: {len(d.entries) - len(kept)} older entries dropped "
                                  f"(record_id < {cut}: another rank's ring buffer wrapped)")
            d.entries = kept
            states = {e["state"] for e in d.entries}
            gloo = bool(d.entries) and all(e["_lib"] == "gloo" for e in d.entries)
            d.tracks_states = not (gloo and states <= {"scheduled"})

    def _build_groups(self) -> None:
        configs: dict[str, list[tuple[int, str, list[int] | None]]] = collections.defaultdict(list)
        for r, d in self.dumps.items():
            named: dict[str, dict[str, Any]] = dict(d.data["pg_config"])
            used = {e["process_group"][0] for e in d.entries}
            unknown = used - set(named)
            if unknown and len(named) == 1 and next(iter(named)) not in used:
                # Gloo's recorder names its one group "" in pg_config while its entries say "0".
                named = {name: next(iter(named.values())) for name in unknown}
            for name, cfg in named.items():
                configs[name].append((r, str(cfg.get("desc", "")), cfg.get("ranks")))
        users: dict[str, set[int]] = collections.defaultdict(set)
        descs: dict[str, str] = {}
        for r, d in self.dumps.items():
            for e in d.entries:
                users[e["process_group"][0]].add(r)
                descs.setdefault(e["process_group"][0], e["process_group"][1])
        for name in sorted(set(configs) | set(users), key=_group_order):
            seen = [c for c in configs.get(name, []) if c[2] is not None]
            memberships = {tuple(c[2]) for c in seen if c[2] is not None}
            if len(memberships) > 1:
                detail = "; ".join(f"rank {r}: {m}" for r, _, m in seen)
                self._problem("membership_mismatch", sorted({r for r, _, _ in seen}),
                              f"group {name!r}: the ranks disagree on its members ({detail})", group=name)
            if memberships:
                members = list(max(memberships, key=lambda m: sum(tuple(c[2]) == m for c in seen if c[2])))
                known = True
            else:
                members, known = sorted(users.get(name, ())), False
            desc = descs.get(name) or next((c[1] for c in configs.get(name, []) if c[1]), "")
            self.groups[name] = Group(name, desc, members, known)

    # --- the checks

    def run(self) -> None:
        self._align_wrap()
        self._build_groups()
        expected = sorted({r for g in self.groups.values() if g.known for r in g.members} | set(self.dumps))
        self.expected = expected
        absent = [r for r in expected if r not in self.dumps]
        if absent:
            where = ", ".join(f"{g.name!r} ({g.desc})" for g in self.groups.values()
                              if set(absent) & set(g.members))
            text = (f"{_fmt_ranks(absent)} left no dump (expected by group {where}): crashed, killed, or "
                    f"hung without dumping")
            if self.allow_incomplete:
                self.notes.append(text + " (--allow-incomplete-ranks: not counted as a problem)")
            else:
                self._problem("no_dump", absent, text)
        for g in self.groups.values():
            self._collectives(g)
            self._p2p(g)
        self.first_incomplete = min(self.incomplete, key=lambda p: p["time_created_ns"], default=None)
        if self.first_incomplete is not None:
            self.first_incomplete["first"] = True

    def _problem(self, kind: str, ranks: Sequence[int], message: str, **extra: Any) -> dict[str, Any]:
        p = {"kind": kind, "ranks": sorted(ranks), "message": message, **extra}
        self.problems.append(p)
        return p

    def _ops(self, g: Group, rank: int) -> dict[int, Op]:
        d = self.dumps[rank]
        by_seq: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
        for e in d.entries:
            if e["process_group"][0] == g.name and not e["_p2p"] and not (e["_kind"] == "coalesced"
                                                                          and e.get("is_p2p")):
                by_seq[e["collective_seq_id"]].append(e)
        return {s: Op(rank, s, es, _outcome(es[-1], d.tracks_states)) for s, es in by_seq.items()}

    def _describe(self, g: Group, kind: str, seq: int) -> str:
        return f"{kind} #{seq} on group {g.name!r} ({g.desc})" if g.desc else f"{kind} #{seq} on group {g.name!r}"

    def _where(self, g: Group, rank: int, ops: dict[int, Op]) -> dict[str, Any]:
        """Where a rank missing from a collective of ``g`` is instead: its
        newest operation that has not completed (else its newest one), and
        its last one on ``g``."""
        d = self.dumps[rank]
        last = ops[max(ops)] if ops else None
        info: dict[str, Any] = {"rank": rank, "last_on_group": None, "current": None}
        if last is not None:
            info["last_on_group"] = {"op": last.kind, "seq": last.seq, "state": last.outcome}
            on_group = f"its last operation on group {g.name!r} is {last.kind} #{last.seq} ({last.outcome})"
        else:
            on_group = (f"it has no operation on group {g.name!r} in its dump"
                        + (" (its buffer wrapped)" if d.truncated else ""))
        pending = [e for e in d.entries if _outcome(e, d.tracks_states) != "completed"]
        now = pending[-1] if pending else (d.entries[-1] if d.entries else None)
        if now is None:
            info["text"] = f"rank {rank}: its dump has no entries; {on_group}"
            return info
        seq = now["p2p_seq_id"] if now["_p2p"] else now["collective_seq_id"]
        gname = now["process_group"][0]
        state = _outcome(now, d.tracks_states)
        info["current"] = {"op": f"{now['_kind']} {now['_meta']}".strip(), "seq": seq, "p2p": now["_p2p"],
                           "group": gname, "state": state}
        grp = self.groups.get(gname)
        what = (f"{now['_kind']} {now['_meta']}".strip() + (f" (p2p #{seq})" if now["_p2p"] else f" #{seq}")
                + f" on group {gname!r}" + (f" ({grp.desc})" if grp and grp.desc else ""))
        same = last is not None and not now["_p2p"] and gname == g.name and seq == last.seq
        if pending:
            text = f"rank {rank} is in {what} ({state})"
        else:
            text = f"rank {rank} has nothing pending; its newest operation is {what} (completed)"
        info["text"] = text if same else f"{text}; {on_group}"
        return info

    def _collectives(self, g: Group) -> None:
        members = [r for r in g.members if r in self.dumps] if g.known else sorted(
            r for r in self.dumps if any(e["process_group"][0] == g.name for e in self.dumps[r].entries))
        ops = {r: self._ops(g, r) for r in members}
        # A truncated rank with nothing on this group says nothing about it.
        considered = [r for r in members if ops[r] or not self.dumps[r].truncated]
        skipped = [r for r in members if r not in considered]
        if skipped:
            self.notes.append(f"group {g.name!r}: {_fmt_ranks(skipped)} hold no entry of it after their ring "
                              f"buffer wrapped; not compared")
        truncated = [r for r in considered if self.dumps[r].truncated and ops[r]]
        seqs = sorted({s for r in considered for s in ops[r]})
        lo = max((min(ops[r]) for r in truncated), default=seqs[0] if seqs else 0)
        seqs = [s for s in seqs if s >= lo]
        hi = {r: max(ops[r], default=0) for r in considered}
        self.group_stats[g.name] = {"last_collective_seq": {str(r): hi[r] for r in considered},
                                    "compared_from_seq": lo if seqs else None}
        reported_missing: set[int] = set()
        mismatches, stopped = 0, False
        first_incomplete_seen = False
        for seq in seqs:
            present = [r for r in considered if seq in ops[r]]
            here = {r: ops[r][seq] for r in present}
            buckets: dict[tuple[str, ...], list[int]] = collections.defaultdict(list)
            for r, op in here.items():
                buckets[op.signature].append(r)
            major_sig = max(buckets, key=lambda s: (len(buckets[s]), -min(buckets[s])))
            kind = here[buckets[major_sig][0]].kind
            desc = self._describe(g, kind, seq)
            # ranks that never got here
            behind = [r for r in considered if r not in here and hi[r] < seq and r not in reported_missing]
            if behind and not stopped:
                reported_missing.update(behind)
                later = max(s for s in seqs) - seq
                where = [self._where(g, r, ops[r]) for r in behind]
                text = (f"{_fmt_ranks(behind)} never joined {desc}, which {_fmt_ranks(present)} "
                        f"{'has' if len(present) == 1 else 'have'} issued"
                        + (f" (nor the {later} later collective{'s' if later > 1 else ''} on this group)"
                           if later else ""))
                self._problem("ranks_missing", behind, text, group=g.name, seq=seq, op=kind, present=present,
                              where=where)
            # does everyone here agree?
            if len(buckets) > 1 and not stopped:
                odd = sorted(r for s, rs in buckets.items() if s != major_sig for r in rs)
                detail = "; ".join(f"{_fmt_ranks(rs)}: {'+'.join(s)}" for s, rs in
                                   sorted(buckets.items(), key=lambda kv: -len(kv[1])))
                hint = self._skip_hint(g, ops, seq, major_sig, buckets)
                self._problem("op_mismatch", odd if len(buckets[major_sig]) > len(odd) else sorted(here),
                              f"collective #{seq} on group {g.name!r}: the ranks issued different operations "
                              f"({detail})" + (f"; {hint}" if hint else ""),
                              group=g.name, seq=seq, op=kind, ops={str(r): here[r].kind for r in sorted(here)})
                stopped = True
                self.notes.append(f"group {g.name!r}: collectives after #{seq} were not compared (the ranks' "
                                  f"sequences no longer line up)")
            elif not stopped:
                for p in self._compare(g, seq, kind, here):
                    mismatches += 1
                    if mismatches <= _MISMATCH_CAP:
                        self.problems.append(p)
            # did it complete anywhere?
            outcomes = {r: op.outcome for r, op in here.items()}
            if "completed" not in outcomes.values() and not first_incomplete_seen:
                first_incomplete_seen = True
                failed = [r for r, o in outcomes.items() if o == "failed"]
                states = ", ".join(f"rank {r}: {o}" for r, o in sorted(outcomes.items()))
                text = f"{desc} did not complete on any rank ({states})"
                if failed:
                    text += f"; it failed or timed out on {_fmt_ranks(failed)}"
                missing_here = [r for r in considered if r not in here]
                if missing_here:
                    text += f"; {_fmt_ranks(missing_here)} never issued it"
                undumped = [r for r in g.members if r not in self.dumps] if g.known else []
                if undumped:
                    text += f"; no dump from {_fmt_ranks(undumped)} (its part unknown)"
                p = self._problem("not_completed", sorted(here), text, group=g.name, seq=seq, op=kind,
                                  states={str(r): o for r, o in sorted(outcomes.items())},
                                  missing=missing_here,
                                  time_created_ns=min(op.time_created_ns for op in here.values()))
                self.incomplete.append(p)
            elif "completed" in outcomes.values() and len(set(outcomes.values())) > 1:
                self.notes.append(f"{desc}: states differ between ranks ("
                                  + ", ".join(f"rank {r}: {o}" for r, o in sorted(outcomes.items())) + ")")
        if mismatches > _MISMATCH_CAP:
            self.notes.append(f"group {g.name!r}: {mismatches - _MISMATCH_CAP} more size/dtype mismatches "
                              f"not listed")

    def _skip_hint(self, g: Group, ops: dict[int, dict[int, Op]], seq: int, major: tuple[str, ...],
                   buckets: Mapping[tuple[str, ...], list[int]]) -> str:
        """If a minority rank's sequence is the majority's shifted by a few
        collectives, say which ones it skipped (or added)."""
        majority = buckets[major]
        if len(buckets) != 2 or len(majority) < 2:
            return ""
        odd = next(rs for s, rs in buckets.items() if s != major)
        ref = majority[0]
        hints = []
        for r in odd:
            for k in (1, 2, 3):
                if seq + k in ops[ref] and ops[ref][seq + k].signature == ops[r][seq].signature:
                    skipped = ", ".join(f"{ops[ref][seq + i].kind} #{seq + i}" for i in range(k))
                    hints.append(f"rank {r} seems to have skipped {skipped}")
                    break
                if seq + k in ops[r] and ops[r][seq + k].signature == major:
                    extra = ", ".join(ops[r][seq + i].kind for i in range(k))
                    hints.append(f"rank {r} seems to have issued {k} extra collective{'s' if k > 1 else ''} "
                                 f"({extra}) before {ops[ref][seq].kind} #{seq}")
                    break
        return "; ".join(hints)

    def _compare(self, g: Group, seq: int, kind: str, here: Mapping[int, Op]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        desc = self._describe(g, kind, seq)

        def disagree(what: str, values: Mapping[int, Any], problem: str) -> None:
            buckets: dict[str, list[int]] = collections.defaultdict(list)
            for r, v in values.items():
                buckets[json.dumps(v)].append(r)
            if len(buckets) < 2:
                return
            ordered = sorted(buckets.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
            majority = ordered[0][1]
            odd = sorted(r for _, rs in ordered[1:] for r in rs)
            culprits = odd if len(majority) > len(odd) else sorted(values)
            detail = "; ".join(f"{_fmt_ranks(rs)}: {json.loads(v)}" for v, rs in ordered)
            out.append({"kind": problem, "ranks": culprits, "group": g.name, "seq": seq, "op": kind,
                        "values": {str(r): values[r] for r in sorted(values)},
                        "message": f"{desc}: {what} differ between ranks ({detail})"})

        if kind not in _NO_SIZES:
            if kind in _UNEVEN:
                ins = sum(_numel(op.sizes("input_sizes")) for op in here.values())
                outs = sum(_numel(op.sizes("output_sizes")) for op in here.values())
                if len(here) == len(g.members) and ins != outs:
                    out.append({"kind": "size_mismatch", "ranks": sorted(here), "group": g.name, "seq": seq,
                                "op": kind, "message": f"{desc}: the ranks send {ins} elements in all but "
                                                       f"receive {outs}"})
            else:  # outputs only when the inputs agree: one report for an in-place collective
                if kind not in _ROOTED_OUT:
                    disagree("input sizes", {r: op.sizes("input_sizes") for r, op in here.items()}, "size_mismatch")
                if kind not in _ROOTED_IN and not out:
                    disagree("output sizes", {r: op.sizes("output_sizes") for r, op in here.items()},
                             "size_mismatch")
                if not out:
                    out.extend(self._shape_rules(g, seq, kind, here))
        dtypes = {r: sorted(set(op.sizes("input_dtypes")) | set(op.sizes("output_dtypes")))
                  for r, op in here.items()}
        disagree("dtypes", {r: v for r, v in dtypes.items() if v}, "dtype_mismatch")
        return out

    def _shape_rules(self, g: Group, seq: int, kind: str, here: Mapping[int, Op]) -> list[dict[str, Any]]:
        """What each rank's own sizes must satisfy (every rank then agrees on
        them, so the first rank stands for all)."""
        r, op = next(iter(sorted(here.items())))
        ins, outs, n = _numel(op.sizes("input_sizes")), _numel(op.sizes("output_sizes")), len(g.members)
        rule = None
        if kind in _SAME_IN_OUT and op.sizes("input_sizes") and op.sizes("output_sizes") and ins != outs:
            rule = f"input ({ins} elements) and output ({outs}) differ"
        elif kind in _ALL_GATHER and ins and outs and outs != ins * n:
            rule = f"output ({outs} elements) is not input ({ins}) × group size {n}"
        elif kind in _REDUCE_SCATTER and ins and outs and ins != outs * n:
            rule = f"input ({ins} elements) is not output ({outs}) × group size {n}"
        if rule is None:
            return []
        return [{"kind": "size_mismatch", "ranks": sorted(here), "group": g.name, "seq": seq, "op": kind,
                 "message": f"{self._describe(g, kind, seq)}: {rule} on every rank"}]

    def _p2p(self, g: Group) -> None:
        """Pair the k-th send from a to b with the k-th recv at b from a."""
        sends: dict[tuple[int, int], list[tuple[int, dict[str, Any]]]] = collections.defaultdict(list)
        recvs: dict[tuple[int, int], list[tuple[int, dict[str, Any]]]] = collections.defaultdict(list)
        for r, d in self.dumps.items():
            for e in d.entries:
                if e["process_group"][0] != g.name or not e["_p2p"]:
                    continue
                pair = self._peers(g, e)
                if pair is None:
                    self.notes.append(f"rank {r}: cannot read the peers of {e.get('profiling_name')!r}")
                    continue
                (sends if e["_kind"] == "send" else recvs)[pair].append((r, e))
        for pair in sorted(set(sends) | set(recvs)):
            src, dst = pair
            s_list, r_list = sends.get(pair, []), recvs.get(pair, [])
            if src not in self.dumps or dst not in self.dumps:
                continue  # reported as a missing dump already
            if self.dumps[src].truncated or self.dumps[dst].truncated:
                self._p2p_tail(g, src, dst, s_list, r_list)
                continue
            for k in range(max(len(s_list), len(r_list))):
                s = s_list[k][1] if k < len(s_list) else None
                rv = r_list[k][1] if k < len(r_list) else None
                if s is None or rv is None:
                    have, lone = (src, s) if s is not None else (dst, rv)
                    assert lone is not None
                    self._unmatched(g, have, dst if s is not None else src, lone, f"#{k + 1} ")
                    continue
                sizes_s, sizes_r = s["input_sizes"], rv["output_sizes"] or rv["input_sizes"]
                types_s, types_r = s["input_dtypes"], rv["output_dtypes"] or rv["input_dtypes"]
                if _numel(sizes_s) != _numel(sizes_r) or types_s != types_r:
                    self._problem("p2p_mismatch", [src, dst],
                                  f"send #{k + 1} from rank {src} to rank {dst} on group {g.name!r}: the send "
                                  f"has {sizes_s} {types_s}, the recv {sizes_r} {types_r}",
                                  group=g.name, op="send/recv", p2p_seq={"send": s["p2p_seq_id"],
                                                                          "recv": rv["p2p_seq_id"]})
                so = _outcome(s, self.dumps[src].tracks_states)
                ro = _outcome(rv, self.dumps[dst].tracks_states)
                if so != "completed" and ro != "completed":
                    p = self._problem("not_completed", [src, dst],
                                      f"send #{k + 1} from rank {src} to rank {dst} on group {g.name!r} did not "
                                      f"complete on either side (send: {so}, recv: {ro})",
                                      group=g.name, op="send/recv", seq=None,
                                      states={str(src): so, str(dst): ro},
                                      time_created_ns=min(int(s.get("time_created_ns") or 0),
                                                          int(rv.get("time_created_ns") or 0)))
                    self.incomplete.append(p)

    def _unmatched(self, g: Group, have: int, lacking: int, e: dict[str, Any], nth: str = "") -> None:
        state = _outcome(e, self.dumps[have].tracks_states)
        op, other = ("send", "recv") if e["_kind"] == "send" else ("recv", "send")
        text = (f"rank {have}'s {op} {nth}{'to' if op == 'send' else 'from'} rank {lacking} "
                f"(p2p #{e['p2p_seq_id']} on group {g.name!r}, {state}) has no matching {other} on rank {lacking}")
        if state == "completed":
            self.notes.append(text)
            return
        where = self._where(g, lacking, self._ops(g, lacking))
        self._problem("p2p_unmatched", [lacking], f"{text}; {where['text']}", group=g.name, op=op,
                      p2p_seq=e["p2p_seq_id"], peer=have, where=[where])

    def _p2p_tail(self, g: Group, src: int, dst: int, s_list: list[tuple[int, dict[str, Any]]],
                  r_list: list[tuple[int, dict[str, Any]]]) -> None:
        """A buffer wrapped, so counts no longer pair sends with recvs: only
        an operation still pending on one side while the other side has
        nothing pending for the pair, and nothing created after it, is
        reported (creation times are compared across ranks)."""
        def pending(lst: list[tuple[int, dict[str, Any]]], rank: int) -> list[dict[str, Any]]:
            return [e for _, e in lst if _outcome(e, self.dumps[rank].tracks_states) != "completed"]

        for mine, theirs, have, lacking in ((s_list, r_list, src, dst), (r_list, s_list, dst, src)):
            waiting, other = pending(mine, have), pending(theirs, lacking)
            if not waiting or other:
                continue
            first = waiting[0]
            t = int(first.get("time_created_ns") or 0)
            if any(int(e.get("time_created_ns") or 0) >= t for _, e in theirs):
                self.notes.append(f"group {g.name!r}: send/recv {src}->{dst} not paired (a ring buffer wrapped)")
                continue
            self._unmatched(g, have, lacking, first)

    def _peers(self, g: Group, e: dict[str, Any]) -> tuple[int, int] | None:
        """(src, dst) global ranks of a send or recv (its name holds group ranks)."""
        m = re.fullmatch(r"\s*(\d+)\s*(->|<-)\s*(\d+)\s*", e["_meta"])
        if m is None:
            return None
        a, b = int(m.group(1)), int(m.group(3))
        src, dst = (a, b) if m.group(2) == "->" else (b, a)
        if g.known:
            if not (0 <= src < len(g.members) and 0 <= dst < len(g.members)):
                return None
            return g.members[src], g.members[dst]
        return src, dst

    # --- output

    def _verdict(self) -> str:
        """One line: whom to look at first, and the first thing stuck."""
        if not self.problems:
            return "consistent: nothing missing, nothing mismatched, everything completed"
        blame: dict[int, list[str]] = collections.defaultdict(list)
        why = {"no_dump": "no dump", "ranks_missing": "missing from {op} #{seq} on group {group!r}",
               "op_mismatch": "different op at #{seq} on group {group!r}",
               "size_mismatch": "sizes of {op} #{seq} on group {group!r}",
               "dtype_mismatch": "dtypes of {op} #{seq} on group {group!r}",
               "p2p_unmatched": "no {op} partner on group {group!r}", "p2p_mismatch": "send/recv sizes",
               "membership_mismatch": "group membership", "unreadable": "unreadable dump"}
        for p in self.problems:
            if p["kind"] in why and (p["kind"] != "size_mismatch" or len(p["ranks"]) < len(self.dumps)):
                for r in p["ranks"]:
                    reason = why[p["kind"]].format(**{k: p.get(k) for k in ("op", "seq", "group")})
                    if reason not in blame[r]:
                        blame[r].append(reason)
        parts = [f"rank {r}: {', '.join(rs[:3])}" for r, rs in sorted(blame.items())]
        text = ("look at " + "; ".join(parts)) if parts else f"{len(self.problems)} problem(s)"
        first = self.first_incomplete
        if first is not None:
            where = f"{first['op']} #{first['seq']}" if first.get("seq") is not None else first["op"]
            text += f"; first stuck: {where} on group {first['group']!r}"
        return text

    def report(self) -> dict[str, Any]:
        versions = {str(r): d.data.get("version") for r, d in sorted(self.dumps.items())}
        if len(set(versions.values())) > 1:
            self.notes.append(f"dump versions differ: {versions}")
        return {
            "ok": not self.problems,
            "verdict": self._verdict(),
            "ranks": sorted(self.dumps),
            "expected_ranks": self.expected,
            "ranks_without_dump": [r for r in self.expected if r not in self.dumps],
            "versions": versions,
            "dumps": {str(r): {"path": d.path, "entries": len(d.entries), "reason": d.data.get("reason"),
                               "truncated": d.truncated} for r, d in sorted(self.dumps.items())},
            "groups": [{"name": g.name, "desc": g.desc, "ranks": g.members, "ranks_from_config": g.known,
                        **self.group_stats.get(g.name, {})} for g in self.groups.values()],
            "problems": self.problems,
            "first_incomplete": self.first_incomplete,
            "notes": self.notes,
        }


def _group_order(name: str) -> tuple[int, Any]:
    return (0, int(name)) if name.isdigit() else (1, name)


def analyze(dumps: dict[int, Dump], allow_incomplete_ranks: bool = False,
            extra_problems: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The report (a JSON-ready dict) for loaded dumps."""
    a = Analysis(dumps, allow_incomplete_ranks)
    a.problems.extend(extra_problems)
    a.run()
    return a.report()


def analyze_dir(directory: str, prefix: str | None = None, allow_incomplete_ranks: bool = False) -> dict[str, Any]:
    paths, prefix, notes = find_dumps(directory, prefix)
    dumps, unreadable = load(paths)
    report = analyze(dumps, allow_incomplete_ranks, unreadable)
    report["dir"], report["prefix"] = directory, prefix
    report["notes"][:0] = notes
    return report


def format_text(report: Mapping[str, Any]) -> str:
    """The report in plain words."""
    lines = [f"nccl-pg trace: {len(report['ranks'])} dump(s) in {report.get('dir', '?')} "
             f"(prefix {report.get('prefix', '')!r}), ranks {_span(report['ranks'])}"
             + (f" of {_span(report['expected_ranks'])} expected" if report["ranks_without_dump"] else "")]
    for g in report["groups"]:
        last = g.get("last_collective_seq") or {}
        tail = ", ".join(f"{r}:{s}" for r, s in last.items())
        lines.append(f"  group {g['name']!r} ({g['desc'] or '?'}): ranks {g['ranks']}"
                     + (f"; last collective per rank {tail}" if tail else ""))
    problems = report["problems"]
    if not problems:
        lines.append("OK: every collective and send/recv lines up across the ranks, and every one completed.")
    else:
        lines.append(f"{len(problems)} problem(s):")
        first = report.get("first_incomplete")
        for i, p in enumerate(problems, 1):
            mark = "  <- first collective that did not complete anywhere" if p is first or p.get("first") else ""
            lines.append(f"  {i}. [{p['kind']}] {p['message']}{mark}")
            for w in p.get("where") or ():
                if p["kind"] == "ranks_missing":
                    lines.append(f"       {w['text']}")
    for n in report["notes"]:
        lines.append(f"  note: {n}")
    if problems:
        lines.append(f"verdict: {report['verdict']}")
    return "\n".join(lines)


def _span(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, ranks)) + "]"


# --- timeline -----------------------------------------------------------------------------


def chrome_trace(dumps: Mapping[int, Dump]) -> dict[str, Any]:
    """A Chrome trace-event document (Perfetto, chrome://tracing): a process
    per rank, a track (thread) per group and lane within it, a slice per
    entry from its creation to its completion (or to the dump's time when it
    had not completed; an instant when neither is known)."""
    events: list[dict[str, Any]] = []
    starts = [int(e.get("time_created_ns") or 0) for d in dumps.values() for e in d.entries]
    t0 = min((t for t in starts if t), default=0)

    def us(ns: int) -> float:
        return round((ns - t0) / 1000.0, 3)

    for rank, d in sorted(dumps.items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        dumped_at = d.data.get("time")
        lanes: dict[str, list[float]] = collections.defaultdict(list)  # group -> end time of each lane
        group_ids: dict[str, int] = {}
        for e in d.entries:
            gname, gdesc = e["process_group"]
            gid = group_ids.setdefault(gname, len(group_ids))
            created = int(e.get("time_created_ns") or 0)
            if not created:
                continue
            outcome = _outcome(e, d.tracks_states)
            end_ns = e.get("time_discovered_completed_ns") or None
            dur_us: float | None = None
            if end_ns and end_ns >= created:
                dur_us = (end_ns - created) / 1000.0
            elif e.get("duration_ms") is not None:
                dur_us = float(e["duration_ms"]) * 1000.0
            elif outcome != "completed" and isinstance(dumped_at, (int, float)) and dumped_at * 1e9 > created:
                dur_us = (dumped_at * 1e9 - created) / 1000.0
            seq = e["p2p_seq_id"] if e["_p2p"] else e["collective_seq_id"]
            name = f"{e['_kind']} {e['_meta']}".strip() + (f" p2p#{seq}" if e["_p2p"] else f" #{seq}")
            args = {"group": gname, "desc": gdesc, "state": outcome, "record_id": e["record_id"],
                    "collective_seq_id": e["collective_seq_id"], "p2p_seq_id": e["p2p_seq_id"],
                    "op_id": e["op_id"], "input_sizes": e["input_sizes"], "input_dtypes": e["input_dtypes"],
                    "output_sizes": e["output_sizes"], "output_dtypes": e["output_dtypes"]}
            if e.get("duration_ms") is not None:
                args["duration_ms"] = e["duration_ms"]
            start = us(created)
            lane_ends = lanes[gname]
            lane = next((i for i, end in enumerate(lane_ends) if end <= start), len(lane_ends))
            end = start + (dur_us or 0.0)
            if lane == len(lane_ends):
                lane_ends.append(end)
                tid = gid * 100 + lane
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                               "args": {"name": f"group {gname} ({gdesc})" + (f" #{lane + 1}" if lane else "")}})
            else:
                lane_ends[lane] = max(lane_ends[lane], end)
            tid = gid * 100 + lane
            if dur_us is None:
                events.append({"ph": "i", "s": "t", "name": name, "cat": outcome, "pid": rank, "tid": tid,
                               "ts": start, "args": args})
            else:
                events.append({"ph": "X", "name": name, "cat": outcome, "pid": rank, "tid": tid, "ts": start,
                               "dur": round(dur_us, 3), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "nccl-pg trace", "time_origin_ns": t0}}


# --- command line -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace_dir", metavar="DIR", help="directory holding one dump per rank")
    parser.add_argument("-p", "--prefix", default=None,
                        help="file-name prefix of the dumps, before the rank number (default: inferred; ours "
                             "are named after NCCL_PG_DEBUG_INFO_TEMP_FILE)")
    parser.add_argument("-j", "--json", action="store_true", help="print the report as JSON instead of words")
    parser.add_argument("--chrome-trace", metavar="OUT.json", default=None,
                        help="also write a Chrome trace-event timeline (one process per rank) for Perfetto")
    parser.add_argument("--allow-incomplete-ranks", action="store_true",
                        help="ranks without a dump are a note, not a problem")


EXIT_STATUS_HELP = ("exit status: 0 all consistent and complete, 1 problems found, 2 no readable dump "
                    "(or bad arguments)")


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.trace_dir):
        print(f"nccl-pg trace: {args.trace_dir}: not a directory", file=sys.stderr)
        return EXIT_NO_DUMPS
    paths, prefix, notes = find_dumps(args.trace_dir, args.prefix)
    dumps, unreadable = load(paths)
    if not dumps:
        what = f"with prefix {args.prefix!r} " if args.prefix else ""
        print(f"nccl-pg trace: no readable dump {what}in {args.trace_dir}", file=sys.stderr)
        for p in unreadable:
            print(f"  {p['message']}", file=sys.stderr)
        return EXIT_NO_DUMPS
    report = analyze(dumps, args.allow_incomplete_ranks, unreadable)
    report["dir"], report["prefix"] = args.trace_dir, prefix
    report["notes"][:0] = notes
    if args.chrome_trace:
        with open(args.chrome_trace, "w") as f:
            json.dump(chrome_trace(dumps), f)
    try:
        print(json.dumps(report, indent=1, default=str) if args.json else format_text(report))
        if args.chrome_trace and not args.json:
            print(f"timeline: {args.chrome_trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into head: the verdict is the exit status
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_PROBLEMS if report["problems"] else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nccl-pg trace", description=__doc__.split("\n\n")[0],
                                     epilog=EXIT_STATUS_HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

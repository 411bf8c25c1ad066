"""The cross-rank analysis of ``nccl-pg trace``: the ranks lined up per
process group and per sequence number, and the problems found (ranks
missing from a collective and where they are instead, mismatched operations,
sizes and dtypes, unpaired sends and receives, the first collective that did
not complete anywhere, ranks that left no dump)."""

from __future__ import annotations

import collections
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..classify import classify
from . import incident, rules, stragglers, whereabouts
from . import report as _report
from .loading import Dump, Folder, Limits, load_dir, outcome
from .rules import Group, Op, describe, fmt_ranks

MISMATCH_CAP = 10  # size/dtype mismatches reported per group before the rest are only counted


class Analysis:
    def __init__(self, dumps: dict[int, Dump], allow_incomplete_ranks: bool = False,
                 stacks_only: Mapping[int, Dump] | None = None) -> None:
        self.dumps = dumps
        self.stacks_only = dict(stacks_only or {})  # ranks without a dump that left C-level stacks
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
            text = (f"{fmt_ranks(absent)} left no dump (expected by group {where}): crashed, killed, or "
                    f"hung without dumping")
            seen = [self._stacks_where(r) for r in absent if r in self.stacks_only]
            text += "".join(f"; {w['text']}" for w in seen)
            if self.allow_incomplete:
                self.notes.append(text + " (--allow-incomplete-ranks: not counted as a problem)")
            else:
                self._problem("no_dump", absent, text, where=seen)
        for g in self.groups.values():
            self._collectives(g)
            self._p2p(g)
        self.first_incomplete = min(self.incomplete, key=lambda p: p["time_created_ns"], default=None)
        if self.first_incomplete is not None:
            self.first_incomplete["first"] = True

    def _stacks_where(self, rank: int) -> dict[str, Any]:
        """Where a rank that left no dump is, by its C-level stacks file."""
        d = self.stacks_only[rank]
        at = whereabouts.locate(d)
        return {"rank": rank, "host": d.host, "pid": d.pid, "at": at,
                "text": f"its C-level stacks ({d.c_stacks_path}) put {whereabouts.who(d)} {at['text']}"}

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
        return {s: Op(rank, s, es, outcome(es[-1], d.tracks_states)) for s, es in by_seq.items()}

    def _where(self, g: Group, rank: int, ops: dict[int, Op]) -> dict[str, Any]:
        """Where a rank missing from a collective of ``g`` is instead: its
        newest operation that has not completed (else its newest one), and
        its last one on ``g``."""
        d = self.dumps[rank]
        last = ops[max(ops)] if ops else None
        info: dict[str, Any] = {"rank": rank, "host": d.host, "pid": d.pid, "at": whereabouts.locate(d, g.name),
                                "last_on_group": None, "current": None}
        who, at = whereabouts.who(d), info["at"]
        if last is not None:
            info["last_on_group"] = {"op": last.kind, "seq": last.seq, "state": last.outcome}
            on_group = f"its last operation on group {g.name!r} is {last.kind} #{last.seq} ({last.outcome})"
        else:
            on_group = (f"it has no operation on group {g.name!r} in its dump"
                        + (" (its buffer wrapped)" if d.truncated else ""))
        pending = [e for e in d.entries if outcome(e, d.tracks_states) != "completed"]
        now = pending[-1] if pending else (d.entries[-1] if d.entries else None)
        if now is None:
            info["text"] = f"{who}: its dump has no entries; " + (
                f"it is {at['text']}; " if at["source"] in ("python", "c") else "") + on_group
            return info
        seq = now["p2p_seq_id"] if now["_p2p"] else now["collective_seq_id"]
        gname = now["process_group"][0]
        state = outcome(now, d.tracks_states)
        info["current"] = {"op": f"{now['_kind']} {now['_meta']}".strip(), "seq": seq, "p2p": now["_p2p"],
                           "group": gname, "state": state}
        grp = self.groups.get(gname)
        what = (f"{now['_kind']} {now['_meta']}".strip() + (f" (p2p #{seq})" if now["_p2p"] else f" #{seq}")
                + f" on group {gname!r}" + (f" ({grp.desc})" if grp and grp.desc else ""))
        same = last is not None and not now["_p2p"] and gname == g.name and seq == last.seq
        if pending:
            text = f"{who} is in {what} ({state})" + (f", {at['text']}" if at["source"] else "")
        elif at["source"] in ("python", "c"):
            text = f"{who} is in no operation: it is {at['text']}; its newest operation is {what} (completed)"
        else:
            text = f"{who} has nothing pending; its newest operation is {what} (completed)" + (
                f"; it {at['text']}" if at["source"] else "")
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
            self.notes.append(f"group {g.name!r}: {fmt_ranks(skipped)} hold no entry of it after their ring "
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
            desc = describe(g, kind, seq)
            # ranks that never got here
            behind = [r for r in considered if r not in here and hi[r] < seq and r not in reported_missing]
            if behind and not stopped:
                reported_missing.update(behind)
                later = max(s for s in seqs) - seq
                where = [self._where(g, r, ops[r]) for r in behind]
                text = (f"{fmt_ranks(behind)} never joined {desc}, which {fmt_ranks(present)} "
                        f"{'has' if len(present) == 1 else 'have'} issued"
                        + (f" (nor the {later} later collective{'s' if later > 1 else ''} on this group)"
                           if later else ""))
                self._problem("ranks_missing", behind, text, group=g.name, seq=seq, op=kind, present=present,
                              where=where)
            # does everyone here agree?
            if len(buckets) > 1 and not stopped:
                odd = sorted(r for s, rs in buckets.items() if s != major_sig for r in rs)
                detail = "; ".join(f"{fmt_ranks(rs)}: {'+'.join(s)}" for s, rs in
                                   sorted(buckets.items(), key=lambda kv: -len(kv[1])))
                hint = rules.skip_hint(ops, seq, major_sig, buckets)
                self._problem("op_mismatch", odd if len(buckets[major_sig]) > len(odd) else sorted(here),
                              f"collective #{seq} on group {g.name!r}: the ranks issued different operations "
                              f"({detail})" + (f"; {hint}" if hint else ""),
                              group=g.name, seq=seq, op=kind, ops={str(r): here[r].kind for r in sorted(here)})
                stopped = True
                self.notes.append(f"group {g.name!r}: collectives after #{seq} were not compared (the ranks' "
                                  f"sequences no longer line up)")
            elif not stopped:
                for p in rules.compare(g, seq, kind, here):
                    mismatches += 1
                    if mismatches <= MISMATCH_CAP:
                        self.problems.append(p)
            # did it complete anywhere?
            outcomes = {r: op.outcome for r, op in here.items()}
            if "completed" not in outcomes.values() and not first_incomplete_seen:
                first_incomplete_seen = True
                failed = [r for r, o in outcomes.items() if o == "failed"]
                states = ", ".join(f"rank {r}: {o}" for r, o in sorted(outcomes.items()))
                text = f"{desc} did not complete on any rank ({states})"
                if failed:
                    text += f"; it failed or timed out on {fmt_ranks(failed)}"
                missing_here = [r for r in considered if r not in here]
                if missing_here:
                    text += f"; {fmt_ranks(missing_here)} never issued it"
                undumped = [r for r in g.members if r not in self.dumps] if g.known else []
                if undumped:
                    text += f"; no dump from {fmt_ranks(undumped)} (its part unknown)"
                p = self._problem("not_completed", sorted(here), text, group=g.name, seq=seq, op=kind,
                                  states={str(r): o for r, o in sorted(outcomes.items())},
                                  missing=missing_here,
                                  time_created_ns=min(op.time_created_ns for op in here.values()))
                self.incomplete.append(p)
            elif "completed" in outcomes.values() and len(set(outcomes.values())) > 1:
                self.notes.append(f"{desc}: states differ between ranks ("
                                  + ", ".join(f"rank {r}: {o}" for r, o in sorted(outcomes.items())) + ")")
        if mismatches > MISMATCH_CAP:
            self.notes.append(f"group {g.name!r}: {mismatches - MISMATCH_CAP} more size/dtype mismatches "
                              f"not listed")

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
                if rules.numel(sizes_s) != rules.numel(sizes_r) or types_s != types_r:
                    self._problem("p2p_mismatch", [src, dst],
                                  f"send #{k + 1} from rank {src} to rank {dst} on group {g.name!r}: the send "
                                  f"has {sizes_s} {types_s}, the recv {sizes_r} {types_r}",
                                  group=g.name, op="send/recv", p2p_seq={"send": s["p2p_seq_id"],
                                                                          "recv": rv["p2p_seq_id"]})
                so = outcome(s, self.dumps[src].tracks_states)
                ro = outcome(rv, self.dumps[dst].tracks_states)
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
        state = outcome(e, self.dumps[have].tracks_states)
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
            return [e for _, e in lst if outcome(e, self.dumps[rank].tracks_states) != "completed"]

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

    def report(self) -> dict[str, Any]:
        versions = {str(r): d.data.get("version") for r, d in sorted(self.dumps.items())}
        if len(set(versions.values())) > 1:
            self.notes.append(f"dump versions differ: {versions}")
        return {
            "ok": not self.problems,
            "verdict": _report.verdict(self.problems, len(self.dumps), self.first_incomplete),
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
            extra_problems: Sequence[dict[str, Any]] = (), *, stacks: bool = False,
            ranks: Sequence[int] | None = None, groups: Sequence[str] | None = None,
            straggler_ms: float = stragglers.THRESHOLD_MS,
            stacks_only: Mapping[int, Dump] | None = None) -> dict[str, Any]:
    """The report (a JSON-ready dict) for loaded dumps. Besides the problems:
    ``rank_details``, who and where each culprit is (every rank of ``ranks``
    when given), with its threads' stacks when ``stacks``; ``stragglers``
    (``stragglers.find``). ``ranks`` and ``groups`` (names or descriptions)
    keep only the problems that name one of those ranks, or are on one of
    those groups; the analysis itself always uses every dump. ``stacks_only``:
    ranks without a dump that left C-level stacks (``loading.stacks_only``):
    where they are is said with their missing dump."""
    a = Analysis(dumps, allow_incomplete_ranks, stacks_only)
    a.problems.extend(extra_problems)
    a.run()
    report = a.report()
    report["notes"] += [n for d in dumps.values() for n in d.notes]
    if groups is not None or ranks is not None:
        _select(report, a, ranks, groups)
    blamed = _report.blame(report["problems"], len(dumps))
    known = {**a.stacks_only, **dumps}
    shown = sorted(set(ranks) & set(known)) if ranks is not None else [r for r in blamed if r in known]
    first_group = {r: p.get("group") for p in reversed(report["problems"]) for r in p["ranks"]}
    report["rank_details"] = [{**whereabouts.summary(known[r], first_group.get(r), stacks), "culprit": r in blamed,
                               "blame": blamed.get(r, []), "dump": r in dumps} for r in shown]
    found = stragglers.find(dumps, straggler_ms)
    report["stragglers"] = {**found.as_dict(), "summary": found.text()}
    return report


def _select(report: dict[str, Any], a: Analysis, ranks: Sequence[int] | None, groups: Sequence[str] | None) -> None:
    """Keep the problems and groups that the filters name (see ``analyze``)."""
    names = {g.name for g in a.groups.values() if groups is None or g.name in groups or (g.desc and g.desc in groups)}
    members = {r for g in a.groups.values() if g.name in names for r in g.members}

    def wanted(p: Mapping[str, Any]) -> bool:
        if groups is not None and (p["group"] not in names if p.get("group") is not None
                                   else not set(p["ranks"]) & members):
            return False
        named = set(p["ranks"]) | set(p.get("present") or ()) | {int(r) for r in p.get("states") or {}}
        return ranks is None or bool(named & set(ranks))

    report["problems"] = [p for p in report["problems"] if wanted(p)]
    report["groups"] = [g for g in report["groups"] if g["name"] in names]
    first = report["first_incomplete"]
    report["first_incomplete"] = first if first is not None and any(p is first for p in report["problems"]) else None
    report["ok"] = not report["problems"]
    report["verdict"] = _report.verdict(report["problems"], len(a.dumps), report["first_incomplete"])
    report["filters"] = {"ranks": sorted(ranks) if ranks is not None else None,
                         "groups": list(groups) if groups is not None else None}


def analyze_dir(directory: str, prefix: str | None = None, allow_incomplete_ranks: bool = False,
                limits: Limits | None = None, **options: Any) -> dict[str, Any]:
    """``analyze`` on the dumps in ``directory`` (``loading.load_dir``);
    ``options`` are ``analyze``'s keyword arguments."""
    return analyze_folder(load_dir(directory, prefix, limits), allow_incomplete_ranks, **options)


def analyze_folder(folder: Folder, allow_incomplete_ranks: bool = False, job: str | None = None,
                   **options: Any) -> dict[str, Any]:
    """``analyze`` on a folder read (``loading.load_dir``): the dumps of one
    job (``incident.pick``: ``job``, else the newest), with what is known of
    how its ranks ended; ``verdicts``: the catalogue's (classify.py)."""
    inc = incident.pick(folder, job)
    report = analyze(folder.dumps, allow_incomplete_ranks, folder.unreadable, stacks_only=folder.stacks_only,
                     **options)
    report["dir"], report["prefix"], report["job"] = folder.directory, folder.prefix, inc.job
    report["notes"][:0] = folder.notes + inc.notes
    incident.settle(report, inc)
    report["verdict"] = _report.verdict(report["problems"], len(folder.dumps), report["first_incomplete"])
    report["verdicts"] = [v.as_dict() for v in classify(report, incident.facts(inc, folder.dumps,
                                                                                folder.stacks_only))]
    return report

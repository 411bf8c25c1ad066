"""What the ranks of one collective must agree on, as the analysis checks it:
the operation (a rank that skipped or added one is named), input and output
sizes and dtypes, and each collective's own size rule."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..verdicts import group_desc

# Collectives whose inputs (or outputs) may legitimately differ between ranks.
ROOTED_IN = {"gather"}  # outputs only on the root
ROOTED_OUT = {"scatter"}  # inputs only on the root
UNEVEN = {"all_to_all", "all_to_all_single", "all_to_all_v_single", "all_gather_v", "reduce_scatter_v"}
NO_SIZES = {"barrier", "all_reduce_barrier", "coalesced"}
ALL_GATHER = {"all_gather", "_all_gather_base", "_allgather_base", "all_gather_into_tensor_coalesced"}
REDUCE_SCATTER = {"reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced"}
SAME_IN_OUT = {"all_reduce", "allreduce_coalesced", "all_reduce_coalesced", "broadcast"}


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


def numel(sizes: Iterable[Any]) -> int:
    total = 0
    for s in sizes:
        n = 1
        for d in s if isinstance(s, (list, tuple)) else (s,):
            n *= int(d)
        total += n
    return total


def fmt_ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe(g: Group, kind: str, seq: int) -> str:
    desc = group_desc(g.desc, g.members)
    return f"{kind} #{seq} on group {g.name!r} ({desc})" if desc else f"{kind} #{seq} on group {g.name!r}"


def skip_hint(ops: dict[int, dict[int, Op]], seq: int, major: tuple[str, ...],
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


def compare(g: Group, seq: int, kind: str, here: Mapping[int, Op]) -> list[dict[str, Any]]:
    """The size and dtype problems of collective ``seq`` of ``g`` among the
    ranks ``here`` that issued the same operation (the minority blamed)."""
    out: list[dict[str, Any]] = []
    desc = describe(g, kind, seq)

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
        detail = "; ".join(f"{fmt_ranks(rs)}: {json.loads(v)}" for v, rs in ordered)
        out.append({"kind": problem, "ranks": culprits, "group": g.name, "seq": seq, "op": kind,
                    "values": {str(r): values[r] for r in sorted(values)},
                    "message": f"{desc}: {what} differ between ranks ({detail})"})

    if kind not in NO_SIZES:
        if kind in UNEVEN:
            ins = sum(numel(op.sizes("input_sizes")) for op in here.values())
            outs = sum(numel(op.sizes("output_sizes")) for op in here.values())
            if len(here) == len(g.members) and ins != outs:
                out.append({"kind": "size_mismatch", "ranks": sorted(here), "group": g.name, "seq": seq,
                            "op": kind, "message": f"{desc}: the ranks send {ins} elements in all but "
                                                   f"receive {outs}"})
        else:  # outputs only when the inputs agree: one report for an in-place collective
            if kind not in ROOTED_OUT:
                disagree("input sizes", {r: op.sizes("input_sizes") for r, op in here.items()}, "size_mismatch")
            if kind not in ROOTED_IN and not out:
                disagree("output sizes", {r: op.sizes("output_sizes") for r, op in here.items()},
                         "size_mismatch")
            if not out:
                out.extend(shape_rules(g, seq, kind, here))
    dtypes = {r: sorted(set(op.sizes("input_dtypes")) | set(op.sizes("output_dtypes")))
              for r, op in here.items()}
    disagree("dtypes", {r: v for r, v in dtypes.items() if v}, "dtype_mismatch")
    return out


def shape_rules(g: Group, seq: int, kind: str, here: Mapping[int, Op]) -> list[dict[str, Any]]:
    """What each rank's own sizes must satisfy (every rank then agrees on
    them, so the first rank stands for all)."""
    r, op = next(iter(sorted(here.items())))
    ins, outs, n = numel(op.sizes("input_sizes")), numel(op.sizes("output_sizes")), len(g.members)
    rule = None
    if kind in SAME_IN_OUT and op.sizes("input_sizes") and op.sizes("output_sizes") and ins != outs:
        rule = f"input ({ins} elements) and output ({outs}) differ"
    elif kind in ALL_GATHER and ins and outs and outs != ins * n:
        rule = f"output ({outs} elements) is not input ({ins}) × group size {n}"
    elif kind in REDUCE_SCATTER and ins and outs and ins != outs * n:
        rule = f"input ({ins} elements) is not output ({outs}) × group size {n}"
    if rule is None:
        return []
    return [{"kind": "size_mismatch", "ranks": sorted(here), "group": g.name, "seq": seq, "op": kind,
             "message": f"{describe(g, kind, seq)}: {rule} on every rank"}]

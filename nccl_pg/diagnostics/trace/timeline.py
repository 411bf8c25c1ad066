"""``nccl-pg trace --chrome-trace``: the dumps as a Chrome trace-event
timeline (Perfetto, chrome://tracing)."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

from .loading import Dump, outcome


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
            state = outcome(e, d.tracks_states)
            end_ns = e.get("time_discovered_completed_ns") or None
            dur_us: float | None = None
            if end_ns and end_ns >= created:
                dur_us = (end_ns - created) / 1000.0
            elif e.get("duration_ms") is not None:
                dur_us = float(e["duration_ms"]) * 1000.0
            elif state != "completed" and isinstance(dumped_at, (int, float)) and dumped_at * 1e9 > created:
                dur_us = (dumped_at * 1e9 - created) / 1000.0
            seq = e["p2p_seq_id"] if e["_p2p"] else e["collective_seq_id"]
            name = f"{e['_kind']} {e['_meta']}".strip() + (f" p2p#{seq}" if e["_p2p"] else f" #{seq}")
            args = {"group": gname, "desc": gdesc, "state": state, "record_id": e["record_id"],
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
                events.append({"ph": "i", "s": "t", "name": name, "cat": state, "pid": rank, "tid": tid,
                               "ts": start, "args": args})
            else:
                events.append({"ph": "X", "name": name, "cat": state, "pid": rank, "tid": tid, "ts": start,
                               "dur": round(dur_us, 3), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "nccl-pg trace", "time_origin_ns": t0}}


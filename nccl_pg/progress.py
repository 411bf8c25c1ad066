"""Per-group progress shared through the store, so that a timeout can name
the ranks that never reached the collective instead of just "timed out".

Each rank's watchdog publishes, for every group, the last sequence number it
issued and the last it saw complete (only when they change, from the
reporter thread). A rank whose collective times out reads everyone's.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .process_group import ProcessGroup


@dataclass(frozen=True)
class Progress:
    issued: int
    completed: int
    p2p_issued: int
    pid: int
    host: str
    time: float


def _key(pg: ProcessGroup, rank: int) -> str:
    return f"{pg.group_name}/progress/{rank}"


def snapshot(pg: ProcessGroup) -> Progress:
    return Progress(pg._seq, pg._completed_seq, pg._seq_p2p, os.getpid(), socket.gethostname(), time.time())


def publish(pg: ProcessGroup, progress: Progress) -> None:
    pg._store.set(_key(pg, pg.rank()), json.dumps(asdict(progress)))


def read_all(pg: ProcessGroup) -> dict[int, Progress | None]:
    """Every rank's last published progress (None: never published)."""
    keys = [_key(pg, r) for r in range(pg.size())]
    if pg._store.check(keys):
        values: list[bytes | None] = list(pg._store.multi_get(keys))
    else:
        values = [pg._store.get(k) if pg._store.check([k]) else None for k in keys]
    return {r: None if v is None else Progress(**json.loads(v)) for r, v in enumerate(values)}


def explain(pg: ProcessGroup, seq: int, progress: dict[int, Progress | None]) -> str:
    """Who is to blame for collective ``seq`` not completing, in words."""
    def name(r: int) -> str:
        g = pg._global_rank_of(r)
        return f"{r}" if g == r else f"{r} (global {g})"

    issued = {r: (p.issued if p else 0) for r, p in progress.items()}
    behind = sorted(r for r, s in issued.items() if s < seq)
    if behind:
        last = ", ".join(f"rank {name(r)}: {issued[r]}" for r in behind)
        return (f"ranks {[pg._global_rank_of(r) for r in behind]} never issued this collective "
                f"(last sequence number they issued on this group: {last})")
    stuck = sorted(r for r, p in progress.items() if p is not None and p.completed < seq)
    return (f"every rank issued it; it has not completed on ranks {[pg._global_rank_of(r) for r in stuck]}: "
            "a rank stopped making progress inside it (hung or frozen process, or a network problem)")

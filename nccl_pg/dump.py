"""Debug dumps: what this process was doing when something went wrong.

A dump is one JSON file per rank (``NCCL_PG_DEBUG_INFO_TEMP_FILE`` + rank):
the reason, every live group's progress and pending operations, and the
Python stack of every thread. Written on a timeout (on every rank, through
a store signal), by the heartbeat monitor before it ends the process, and on
request.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from . import env

if TYPE_CHECKING:
    from .process_group import ProcessGroup


def _group(pg: ProcessGroup) -> dict[str, Any]:
    now = time.monotonic()
    return {
        "uid": pg.uid, "desc": pg.group_desc, "name": pg.group_name, "rank": pg.rank(), "size": pg.size(),
        "backend": pg.backend_name, "issued": pg._seq, "completed": pg._completed_seq, "p2p_issued": pg._seq_p2p,
        "state": pg._closed or "open",
        "pending": [{"op": w.op_type.name, "seq": w.seq, "age_s": round(now - w._issued_mono, 3)}
                    for w in sorted(list(pg._pending), key=lambda w: w.seq)],
    }


def _threads() -> dict[str, list[str]]:
    names = {t.ident: t.name for t in threading.enumerate()}
    return {f"{names.get(ident, '?')} ({ident})": traceback.format_stack(frame)
            for ident, frame in sys._current_frames().items()}


def write(reason: str, rank: int, groups: Iterable[ProcessGroup]) -> str:
    """Write this rank's dump; returns its path."""
    path = f"{env.DUMP_FILE.get()}{rank}"
    report = {"reason": reason, "rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
              "time": time.time(), "groups": [_group(g) for g in groups], "threads": _threads()}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)  # a reader never sees half a dump
    return path

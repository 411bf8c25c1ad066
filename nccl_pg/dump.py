"""Debug dumps: what this process was doing when something went wrong.

A dump is one file per rank, ``NCCL_PG_DEBUG_INFO_TEMP_FILE`` + global rank:
a pickled dict in PyTorch's flight-recorder layout (version, pg_config,
pg_status, entries), so PyTorch's analyzer and ``nccl-pg trace`` both read
it, plus our own keys: the reason, every live group's pending operations
with their age, and the Python stack of every thread. Written on a timeout
(on every rank, through a store signal), by the heartbeat monitor before it
ends the process, when a byte is written to ``<prefix><rank>.pipe``, and on
request (``write``).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import env, flight_recorder

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


def report(reason: str, rank: int, groups: Sequence[ProcessGroup]) -> dict[str, Any]:
    """The dump as a dict (the flight recorder's layout plus our keys)."""
    out = flight_recorder.get().dump(groups)
    out.update({"reason": reason, "rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
                "time": time.time(), "groups": [_group(g) for g in groups], "threads": _threads()})
    return out


def path_for(rank: int) -> str:
    return f"{env.DUMP_FILE.get()}{rank}"


_last_written: float | None = None  # time.monotonic() of this process's last dump


def written_within(seconds: float) -> bool:
    """Whether this process wrote a dump in the last ``seconds``."""
    return _last_written is not None and time.monotonic() - _last_written < seconds


def write(reason: str, rank: int, groups: Sequence[ProcessGroup]) -> str:
    """Write this rank's dump; returns its path."""
    global _last_written
    path = path_for(rank)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    # Per thread (two may dump at once), and not named after the dumps: a reader globbing for
    # <prefix><rank> (PyTorch's analyzer) must not trip over one left by a process ending mid-write.
    tmp = os.path.join(os.path.dirname(path) or ".", f".nccl_pg_dump.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(report(reason, rank, groups), f)
    os.replace(tmp, path)  # a reader never sees half a dump
    _last_written = time.monotonic()
    return path


def read(path: str) -> dict[str, Any]:
    """A dump written by us or by PyTorch (pickle), or a JSON dump."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:1] in (b"{", b"["):
        import json

        return json.loads(data)
    return pickle.loads(data)

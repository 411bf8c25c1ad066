"""Counts what one collective does on the hot path, in a fresh process.

    python3 tests/hot_path_counts.py null|host1|hooks [ops]

Runs ``ops`` in-place all_reduces of 1 KB through ``nccl_pg.all_reduce``
(after a warm-up that fills the flight recorder's ring) on the null
communicator (world 2), the host backend (world 1), or the null
communicator with a completion hook registered ("hooks"), and prints one
JSON line of totals over those ops:

- ``store``: requests the group's store received;
- ``woken``: times a thread other than the caller's woke up (its voluntary
  context switches, from /proc; null where /proc has no per-thread status),
  and ``woken_by``: the same per thread name;
- ``blocked``: times the caller's thread blocked;
- ``locks``: lock acquisitions by the caller's thread (every lock and
  condition made after this module started counts them);
- ``calls``: Python and builtin function calls on the caller's thread;
- ``peak``: the most bytes one op had allocated at once (tracemalloc), and
  ``net``: bytes still allocated after all the ops (leaks).

The watchdog polls every 30 s here and the heartbeat monitor is off, so that
their own periodic wake-ups stay out of the counts; nothing else is changed.
Used by tests/test_hot_path.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
from typing import Any

MAIN = threading.get_ident()
_acquired = 0
_real_lock, _real_rlock = threading.Lock, threading.RLock


class _CountingLock:
    """A lock that counts its acquisitions by the main thread."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        global _acquired
        if threading.get_ident() == MAIN:
            _acquired += 1
        return bool(self._lock.acquire(blocking, timeout))

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return bool(self._lock.locked())

    def _is_owned(self) -> bool:  # what Condition asks; without it, it would probe with an acquire
        return bool(self._lock.locked())


class _CountingRLock(_CountingLock):
    def _is_owned(self) -> bool:
        return bool(self._lock._is_owned())

    def _release_save(self) -> Any:
        return self._lock._release_save()

    def _acquire_restore(self, state: Any) -> None:
        self._lock._acquire_restore(state)


threading.Lock = lambda: _CountingLock(_real_lock())  # type: ignore[assignment,misc,return-value]
threading.RLock = lambda *a, **k: _CountingRLock(_real_rlock())  # type: ignore[assignment,misc,return-value]
DUMPS = tempfile.mkdtemp(prefix="nccl_pg_hot_path_")  # this run's own dump folder (see _poller_set_up)
os.environ.update(NCCL_PG_WATCHDOG_INTERVAL="30", NCCL_PG_ENABLE_MONITORING="0",
                  NCCL_PG_DEBUG_INFO_TEMP_FILE=os.path.join(DUMPS, "nccl_pg_trace_rank_"))

import numpy as np  # noqa: E402

import nccl_pg as dist  # noqa: E402
from nccl_pg.store import HashStore  # noqa: E402
from nccl_pg.testing import register_null_backend  # noqa: E402

WARMUP = 2500  # more than the flight recorder's 2000 entries: its ring is full, allocation is steady


class CountingStore(HashStore):
    requests = 0

    def __getattribute__(self, name: str) -> Any:
        if name in ("set", "get", "add", "compare_set", "wait", "check", "delete_key", "num_keys", "multi_get",
                    "multi_set", "append"):
            CountingStore.requests += 1
        return super().__getattribute__(name)


def _switches() -> dict[int, int] | None:
    """Voluntary context switches per native thread id (Linux /proc)."""
    out = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        out[int(tid)] = int(line.split()[1])
    except OSError:
        return None
    return out


def _poller_set_up() -> None:
    """Wait (10 s at most) for the watchdog's first poll with a group, which opens the rank's C-level stacks
    file and registers faulthandler (70 KiB of signal stack, once): off the hot path, but on another thread
    whenever it comes, so it must not come inside the counted ops (tracemalloc counts every thread)."""
    folder = os.path.join(DUMPS, "c_stacks")
    deadline = time.monotonic() + 10
    while not (os.path.isdir(folder) and os.listdir(folder)):
        assert time.monotonic() < deadline, "the watchdog did not open the C-level stacks file within 10 s"
        time.sleep(0.01)


def count(backend: str, ops: int) -> dict[str, Any]:
    store = CountingStore()
    if backend == "host1":
        dist.init_process_group("host", store=store, rank=0, world_size=1)
    else:
        dist.init_process_group(register_null_backend(), store=store, rank=0, world_size=2)
    if backend == "hooks":
        pg = dist.group.WORLD
        assert pg is not None
        pg._register_on_completion_hook(lambda info: None)
    x = np.zeros(256, np.float32)
    for _ in range(WARMUP):
        dist.all_reduce(x)
    _poller_set_up()
    main_tid = threading.get_native_id()

    store_before, locks_before, sw_before = CountingStore.requests, _acquired, _switches()
    for _ in range(ops):
        dist.all_reduce(x)
    store_n, locks_n, sw_after = CountingStore.requests - store_before, _acquired - locks_before, _switches()
    woken = blocked = woken_by = None
    if sw_before is not None and sw_after is not None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        woken_by = {names.get(tid, str(tid)): n - sw_before.get(tid, 0) for tid, n in sw_after.items()
                    if tid != main_tid}
        woken = sum(woken_by.values())
        blocked = sw_after[main_tid] - sw_before[main_tid]

    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profile)
    for _ in range(ops):
        dist.all_reduce(x)
    sys.setprofile(None)

    tracemalloc.start()
    for _ in range(WARMUP):  # allocations made under tracing (caches, the ring's slots) settle first
        dist.all_reduce(x)
    peak = 0
    start, _ = tracemalloc.get_traced_memory()
    for _ in range(ops):
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        dist.all_reduce(x)
        peak = max(peak, tracemalloc.get_traced_memory()[1] - before)
    net = tracemalloc.get_traced_memory()[0] - start
    tracemalloc.stop()
    dist.destroy_process_group()
    return {"ops": ops, "store": store_n, "woken": woken, "woken_by": woken_by, "blocked": blocked, "locks": locks_n,
            "calls": calls, "peak": peak, "net": net}


if __name__ == "__main__":
    try:
        print(json.dumps(count(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1000)))
    finally:
        shutil.rmtree(DUMPS, ignore_errors=True)

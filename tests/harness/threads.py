"""Ranks as threads of this process for the communicator-level host tests:
communicators of one group over a HashStore, one stream each, and the
collective matrix run on them (harness.cases)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from harness.cases import Case, run_cases_threads
from nccl_pg.comm.base import CommConfig
from nccl_pg.comm.host import HostCommunicator
from nccl_pg.store import HashStore, PrefixStore, Store


def parallel(n: int, fn: Callable[[int], Any], timeout: float = 30.0) -> list[Any]:
    """Run ``fn(rank)`` for every rank in its own thread; return the results
    in rank order, re-raising the first exception. Never waits past
    ``timeout``."""
    pool = ThreadPoolExecutor(max_workers=max(n, 1), thread_name_prefix="rank")
    try:
        futures = [pool.submit(fn, r) for r in range(n)]
        deadline = time.monotonic() + timeout
        return [f.result(timeout=max(deadline - time.monotonic(), 0.01)) for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def on_threads(fns: Sequence[Callable[[], Any]], timeout: float = 30.0,
               setup: Callable[[], object] | None = None) -> list[Any]:
    """Each function on a thread of its own (named rank<i>, ``setup()`` first): their results, or the
    exceptions they raised, in order. Fails if one is still running ``timeout`` s after it was joined."""
    out: list[Any] = [None] * len(fns)

    def call(i: int) -> None:
        if setup is not None:
            setup()
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[i] = exc

    threads = [threading.Thread(target=call, args=(i,), daemon=True, name=f"rank{i}") for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank is still running"
    return out


_names = iter(range(1 << 62))


def unique(prefix: str = "comm") -> str:
    return f"{prefix}{next(_names)}"


def create_comms(n: int, store: Store | None = None, timeout: float = 30.0, name: str | None = None,
                 **config: Any) -> list[HostCommunicator]:
    """n communicators of one group, created (blocking) by n threads."""
    store = store if store is not None else HashStore(timeout=timeout)
    name = name or unique()
    cfg = CommConfig(timeout=timeout, **config)
    return parallel(n, lambda r: HostCommunicator.create(PrefixStore(name, store), n, r, cfg), timeout + 5)


def destroy_all(comms: Sequence[HostCommunicator | None]) -> None:
    for c in comms:
        if c is not None:
            c.destroy()


class ThreadWorld:
    """n ranks as threads of this process: communicators and one stream each."""

    def __init__(self, n: int, timeout: float = 30.0) -> None:
        self.n = n
        self.comms = create_comms(n, timeout=timeout)
        self.streams = [c.new_stream() for c in self.comms]

    def healthy(self) -> bool:
        return all(c.async_error() is None for c in self.comms)

    def run_cases(self, cases: Sequence[Case], timeout: float = 60.0, shape: tuple[int, ...] | None = None) -> list[str]:
        return run_cases_threads(self.comms, self.streams, cases, timeout, shape=shape)

    def sync(self, timeout: float = 30.0) -> None:
        for r, s in enumerate(self.streams):
            assert s.synchronize(timeout), f"rank {r}: stream did not drain in {timeout} s"
        errors = [c.async_error() for c in self.comms if c.async_error() is not None]
        assert not errors, errors

    def close(self) -> None:
        destroy_all(self.comms)


def start_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``target`` in a thread; the list receives its result or exception."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(target())
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def returns_within(seconds: float, fn: Callable[[], object]) -> object:
    """Call fn in a thread; fail if it has not returned within ``seconds``."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"call did not return within {seconds} s"
    box["elapsed"] = time.monotonic() - t0
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")

"""``monitored_barrier``: a barrier that names the ranks that did not arrive.

torch's (Gloo's) semantics and messages: rank 0 waits at most ``timeout``
for the others and raises "[Rank 0]: Rank 1 failed to pass monitoredBarrier
in 2000 ms" (with ``wait_all_ranks``: "Ranks 1, 3 failed ..."); the others
wait for rank 0's verdict and raise "Rank 2 successfully reached
monitoredBarrier, but received errors while waiting for send/recv from rank
0" when it is a failure. Beyond Gloo: the others learn rank 0's verdict at
once (and the message carries it) instead of waiting for a send that never
comes, and rank 0 names every rank missing even without ``wait_all_ranks``.

It runs over the group's store, not its communicator: a communicator stuck
in the very collective being debugged cannot hold it up. Each rank makes a
constant number of store requests, whatever the world size: ranks 1..N-1
append their rank to one key and count themselves in with ``add``, the last
one sets an "all arrived" key, and each waits for rank 0's verdict; rank 0
waits for that key, reads the arrivals only on failure, writes the verdict,
and deletes the previous barrier's keys (every rank has passed it by then).
"""

from __future__ import annotations

import time

from ..errors import DistBackendError
from ..store import Store

_KEYS = ("arrived", "count", "all", "verdict")
_OK = b"ok"


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


def monitored_barrier(store: Store, rank: int, size: int, generation: int, timeout: float,
                      wait_all_ranks: bool, reply_limit: float) -> None:
    """One monitored barrier, the ``generation``-th on this group (every rank
    counts the same). ``store`` is private to the group; ranks other than 0
    wait at most ``reply_limit`` seconds for rank 0's verdict."""
    if size == 1:
        return
    keys = [f"{generation}/{k}" for k in _KEYS]
    arrived, count, everyone, verdict = keys
    if rank != 0:
        store.append(arrived, f"{rank},")
        if store.add(count, 1) == size - 1:
            store.set(everyone, b"")
        _await_verdict(store, rank, verdict, reply_limit)
        return
    began = time.monotonic()
    if not _wait(store, everyone, timeout):
        came = sorted(int(r) for r in store.get(arrived).decode().split(",") if r) if store.check([arrived]) else []
        missing = [r for r in range(1, size) if r not in came]
        if missing:  # else the last one to arrive is just setting the key
            message = _failure(came, missing, timeout, wait_all_ranks, time.monotonic() - began)
            store.set(verdict, message)
            raise DistBackendError(message)
    store.set(verdict, _OK)
    if generation > 1:
        for key in _KEYS:
            store.delete_key(f"{generation - 1}/{key}")


def _wait(store: Store, key: str, timeout: float) -> bool:
    """Whether ``key`` appeared within ``timeout`` seconds (0: is it there now)."""
    if timeout <= 0:
        return store.check([key])
    deadline = time.monotonic() + timeout
    try:
        store.wait([key], timeout)
        return True
    except RuntimeError:  # DistStoreError; a torch store under TorchStore may raise a plain "Wait timeout"
        if time.monotonic() < deadline - 0.01:
            raise  # the store itself failed, not our deadline
        return False


def _failure(arrived: list[int], missing: list[int], timeout: float, wait_all_ranks: bool, waited: float) -> str:
    """Rank 0's message: torch's wording first, then what we know besides."""
    if timeout <= 0:
        done = (f"Successfully processed ranks: {', '.join(map(str, arrived))}" if arrived
                else "No ranks successfully processed in monitoredBarrier.")
        return f"Rank 0 timed out in monitoredBarrier after {_ms(timeout)} ms.\n{done}\n timeout: ranks {missing} " \
               "had not arrived"
    detail = f": timeout after {waited:.3f} s; ranks {missing} never arrived"
    if wait_all_ranks:
        return f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in " \
               f"{_ms(timeout)} ms{detail}"
    return f"[Rank 0]: Rank {missing[0]} failed to pass monitoredBarrier in {_ms(timeout)} ms{detail}"


def _await_verdict(store: Store, rank: int, key: str, limit: float) -> None:
    head = (f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting for send/recv "
            "from rank 0. Please check rank 0 logs for faulty rank.")
    if not _wait(store, key, limit):
        raise DistBackendError(f"{head}\n Timed out after {limit:.3f} s waiting for rank 0's verdict: rank 0 has "
                               "not reached monitoredBarrier, or is stuck")
    got = store.get(key)
    if got != _OK:
        raise DistBackendError(f"{head}\n Rank 0 reported: {got.decode(errors='replace')}")

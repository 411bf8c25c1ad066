"""Ranks as real processes (isolation, crashes and exit codes): ``run_ranks``
and ``ProcessRanks``, over a TCPStore served by the calling process."""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..distributed import _world, destroy_process_group, init_process_group, is_initialized
from ..errors import DistError
from ..store import TCPStore, TCPStoreServer
from .failures import DEFAULT_TIMEOUT, RanksFailed, abort_groups, report, traceback_of

T = TypeVar("T")

# After one rank fails, how long the others get to exit on their own
# (they usually fail at once, having lost a peer) before they are killed.
_FAILURE_GRACE = 2.0
# How long a killed rank gets to be reaped.
_REAP_GRACE = 10.0


def _die_with_parent(parent: int) -> None:
    """A rank must not outlive a parent killed outright (SIGKILL on a CI
    timeout): it would hold its CPU and ports. Linux only; elsewhere the
    parent's kill at its own exit is the only guard."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _process_rank_main(fn: Callable[..., Any], rank: int, world_size: int, backend: str, address: tuple[str, int],
                       timeout: float, args: Sequence[Any], conn: multiprocessing.connection.Connection,
                       parent: int) -> None:
    """A rank process: rendezvous, ``fn``, teardown; the result (or the
    traceback) goes back through ``conn``, and the exit code says which."""
    _die_with_parent(parent)
    try:
        store = TCPStore(*address, timeout=timeout)
        try:
            init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
            try:
                result = fn(rank, world_size, *args)
            except BaseException:
                # Abort rather than flush: peers blocked on this rank fail at once instead of at the timeout.
                abort_groups([_world()], set())
                raise
            finally:
                if is_initialized():
                    destroy_process_group()
        finally:
            store.close()
        conn.send(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        # A communication error may just be the echo of a peer's failure: the parent blames the others first.
        conn.send(("comm_error" if isinstance(exc, DistError) else "error", traceback_of(exc)))
        conn.close()
        sys.exit(1)
    conn.close()


class ProcessRanks:
    """``world_size`` processes (multiprocessing's "spawn"), each calling
    ``fn(rank, world_size, *args)`` after ``init_process_group`` over a
    TCPStore hosted here. ``fn`` and ``args`` must be picklable (a
    module-level function), and so must ``fn``'s return value.

    Start with the constructor; ``pids`` lets a test signal ranks; ``join()``
    returns the results; leaving the ``with`` block, or ``close()``, kills
    whatever still runs, so no process outlives the test."""

    def __init__(self, fn: Callable[..., Any], world_size: int, backend: str = "host",
                 timeout: float = DEFAULT_TIMEOUT, args: Sequence[Any] = ()) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size, self.timeout = world_size, timeout
        self._deadline = time.monotonic() + timeout
        self._closed = False
        self._server = TCPStoreServer("127.0.0.1", 0).start()
        ctx = multiprocessing.get_context("spawn")
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_process_rank_main, name=f"nccl_pg-rank-{rank}",
                                   args=(fn, rank, world_size, backend, ("127.0.0.1", self._server.port), timeout,
                                         tuple(args), writer, os.getpid()))
                self._procs.append(proc)
                self._conns.append(reader)
                proc.start()
                writer.close()  # the child's copy stays open: EOF here means the child is gone
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def join(self) -> list[Any]:
        """Wait for every rank (bounded by the timeout given at start); return
        the results in rank order, or raise RanksFailed with each failing
        rank's exit code and traceback and the ranks killed."""
        messages: dict[int, tuple[str, Any]] = {}
        running = set(range(self.world_size))
        failed_at: float | None = None
        while running:
            limit = self._deadline if failed_at is None else min(self._deadline, failed_at + _FAILURE_GRACE)
            left = limit - time.monotonic()
            if left <= 0:
                break
            waitables: list[Any] = [self._procs[r].sentinel for r in running]
            waitables += [self._conns[r] for r in running if r not in messages and not self._conns[r].closed]
            multiprocessing.connection.wait(waitables, left)
            for r in sorted(running):
                self._receive(r, messages)
                if self._procs[r].exitcode is not None:
                    self._receive(r, messages, last=True)  # a result sent just before exiting
                    running.discard(r)
                    if self._procs[r].exitcode != 0 and failed_at is None:
                        failed_at = time.monotonic()
        killed = sorted(running)
        self.close()
        failures = {r: self._failure(r, messages.get(r)) for r in range(self.world_size)
                    if r not in killed and (self._procs[r].exitcode != 0 or messages.get(r, ("",))[0] != "ok")}
        if not failures and not killed:
            return [messages[r][1] for r in range(self.world_size)]
        echoes = [r for r in failures if messages.get(r, ("",))[0] == "comm_error"]
        blamed = [r for r in failures if r not in echoes] or list(failures) or killed
        parts = [f"rank {r} failed (exit code {self._procs[r].exitcode})" for r in blamed if r in failures]
        if echoes and blamed != echoes:
            parts.append(f"then ranks {echoes} failed with communication errors")
        if killed:
            why = f"at the timeout of {self.timeout:g} s" if failed_at is None else \
                f"{_FAILURE_GRACE:g} s after the first failure"
            parts.append(f"ranks {killed} were still running {why} and were killed")
            failures.update({r: "killed: still running\n" for r in killed})
        raise RanksFailed(f"{'; '.join(parts)}\n{report(failures, blamed)}", blamed, failures)

    def _receive(self, rank: int, messages: dict[int, tuple[str, Any]], last: bool = False) -> None:
        conn = self._conns[rank]
        if rank in messages or conn.closed:
            return
        try:
            if conn.poll(0.1 if last else 0):
                messages[rank] = conn.recv()
        except (EOFError, OSError):
            conn.close()  # gone without a word: the exit code will tell

    def _failure(self, rank: int, message: tuple[str, Any] | None) -> str:
        code = self._procs[rank].exitcode
        if message is not None and message[0] != "ok":
            return f"exit code {code}\n{message[1]}"
        if code is not None and code < 0:
            return f"exit code {code}: killed by signal {signal.Signals(-code).name}, no traceback\n"
        return f"exit code {code}, without a result or a traceback\n"

    def close(self) -> None:
        """Kill every rank still running and reap them all (no zombies), then
        stop the store. Safe to call again."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            if p.exitcode is None and p.pid is not None:
                p.kill()
        for p in self._procs:
            if p.pid is not None:
                p.join(_REAP_GRACE)
        for c in self._conns:
            c.close()
        self._server.stop()

    def __enter__(self) -> ProcessRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(fn: Callable[..., T], world_size: int, backend: str = "host", timeout: float = DEFAULT_TIMEOUT,
              args: Sequence[Any] = ()) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes with
    an initialized default group; return the results in rank order. Raise
    RanksFailed with each failing rank's exit code and traceback; at the
    timeout every rank still running is killed and named."""
    with ProcessRanks(fn, world_size, backend, timeout, args) as ranks:
        return ranks.join()

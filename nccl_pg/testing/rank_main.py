"""A rank process of ``ProcessRanks`` and ``WarmRanks``: started by the
harness as ``python -c`` with one end of a socket pair, its output going to
a file of the harness's.

What travels on the socket: the harness sends ``Start`` (plain data: the
parent's ``sys.path`` and main module as multiprocessing's spawn gives them,
the store's address, the rank), then pickled ``Job`` bytes (unpickled here,
inside a ``try``: a test module that fails to import is reported with its
traceback); the rank answers ``("ready",)`` once connected to the store and
starts the test at ``("go",)``, so that the slowest rank's start-up counts
against the test's deadline, never against an operation's timeout. Each job
ends with ``("ok", result)`` or ``(kind, Failure)``. A warm set's ranks then
wait for the next job, keeping their default group.

A rank is its descendants' subreaper and ends them after each job; it dies
with the harness (PR_SET_PDEATHSIG) (``nccl_pg.process_tree``). It arms the
library's C-level stacks (``diagnostics.stacks``: NCCL_PG_STACKS_SIGNAL,
SIGUSR2 by default, makes faulthandler write every thread's stack to
``<dump dir>/c_stacks/rank<rank>.<pid>.txt``; C, needs no GIL) as soon as it
knows its rank, before its group exists, so that the harness can ask a rank
stuck anywhere, also before or during its rendezvous."""

from __future__ import annotations

import faulthandler
import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import re
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import process_tree
from ..diagnostics import frames, stacks
from ..errors import Culprit, DistError, NanError
from .failures import culprits_of, is_skip

# The harness's own entry point in a rank process: the bottom of the rank's main thread.
ENTRY = os.path.abspath(__file__)
_READY, _GO = "nccl_pg/testing/ready", "nccl_pg/testing/go"
_END_WITHIN = 1.0  # seconds to end a job's descendants
_started = threading.Event()  # every rank is up: the test may have started on some
_importing_main: str | None = None  # the main module's path while a rank imports it (spawn's prepare)


def importing_main() -> str | None:
    """The test's main module, while this process (a rank) imports it: a
    ``run_ranks`` called then is one at a script's module level, which every
    rank would call again, without end."""
    return _importing_main


@dataclass(frozen=True)
class Start:
    """Plain data (nothing of the test's modules): what the rank needs
    before it can unpickle the test function."""

    preparation: dict[str, Any]  # multiprocessing.spawn.get_preparation_data's
    address: tuple[str, int]  # the harness's TCPStore
    rank: int
    world_size: int
    backend: str
    op_timeout: float  # the group's timeout: every operation's
    store_timeout: float  # the rendezvous', bounded by the test's deadline
    gpus: int  # GPUs given to the test (CUDA_VISIBLE_DEVICES): the NCCL backend's device is picked among them
    warm: bool  # keep the group and wait for more jobs


@dataclass(frozen=True)
class Job:
    fn: Callable[..., Any]
    args: Sequence[Any]
    dump_prefix: str  # NCCL_PG_DEBUG_INFO_TEMP_FILE for this job's dumps


@dataclass(frozen=True)
class Failure:
    """How a job failed on this rank (also a skip)."""

    summary: str  # "ValueError: ..." (for a skip: its reason)
    trace: str
    culprits: tuple[Culprit, ...] = ()  # the ranks its timeout diagnosis blamed
    where: frames.Frame | None = None  # where it was raised, in the test's code
    started: bool = True  # False: before every rank was up (its peers are still waiting for it at the start)


# A communicator's own abort as the first failure (no lost peer, no timeout before it): this process asked for it.
_ABORTED_HERE = re.compile(r"communicator aborted on rank \d+$")


def _own_doing(exc: DistError) -> bool:
    """A distributed error this rank caused rather than suffered: a NaN in
    its own input, or an abort it requested before anything else failed."""
    first = frames.raised_line(exc)
    return isinstance(exc, NanError) or (_ABORTED_HERE.search(first) is not None and "lost the connection" not in first)


def failure(exc: BaseException) -> tuple[str, Failure]:
    kind = "skip" if is_skip(exc) else "comm_error" if isinstance(exc, DistError) and not _own_doing(exc) else \
        "error"
    summary = str(exc) if kind == "skip" else frames.raised_line(exc)
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == ENTRY:
        tb = tb.tb_next  # the harness's frames that called the test's code
    trace = "".join(traceback.format_exception(type(exc), exc, tb))
    return kind, Failure(summary, trace, culprits_of(exc), frames.raised_at(exc), _started.is_set())


def _send(conn: multiprocessing.connection.Connection, message: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(message))


def _load(conn: multiprocessing.connection.Connection) -> Job | None:
    """The next job (None: the harness said to stop); a job that cannot be
    unpickled (the test module fails to import) raises here."""
    raw = conn.recv_bytes()
    job = pickle.loads(raw)
    return job if isinstance(job, Job) else None


def _run(job: Job, start: Start) -> tuple[Any, ...]:
    """Call the job's function; its result (pickled here, so that an
    unpicklable result is this rank's failure) or its failure."""
    from ..distributed.world import current_world  # noqa: PLC0415 - the test's modules are loaded first
    from .failures import abort_groups  # noqa: PLC0415

    os.environ["NCCL_PG_DEBUG_INFO_TEMP_FILE"] = job.dump_prefix
    try:
        result = job.fn(start.rank, start.world_size, *job.args)
        pickle.dumps(result)
        return ("ok", result)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the harness
        # Abort rather than flush: peers blocked on this rank fail at once instead of at the timeout.
        abort_groups([current_world()], set())
        return failure(exc)
    finally:
        process_tree.end_descendants(_END_WITHIN)


def _serve(conn: multiprocessing.connection.Connection, start: Start) -> int:
    from ..comm import backends  # noqa: PLC0415
    from ..distributed import destroy_process_group, init_process_group, is_initialized  # noqa: PLC0415
    from ..distributed.world import current_world  # noqa: PLC0415
    from ..store import TCPStore  # noqa: PLC0415

    job = _load(conn)
    if job is None:
        return 0
    store = TCPStore(*start.address, timeout=start.store_timeout)
    try:
        # Every rank connected before any starts: start-up counts against the deadline, not an operation's timeout.
        if store.add(_READY, 1) == start.world_size:
            store.set(_GO, b"1")
        store.wait([_GO], start.store_timeout)
        _started.set()
        device = backends.pick_gpu(start.rank, start.rank, start.world_size) if start.backend == "nccl" else None
        init_process_group(start.backend, store=store, rank=start.rank, world_size=start.world_size,
                           timeout=start.op_timeout, device_id=device)
        while job is not None:
            message = _run(job, start)
            if message[0] == "ok":
                world = current_world()  # a warm set keeps its default group, not the test's subgroups
                for pg in sorted((g for g in world.groups if g is not world.default_pg), key=lambda g: -g.uid):
                    destroy_process_group(pg)
            _send(conn, message)
            if message[0] != "ok":
                return 0 if message[0] == "skip" else 1
            job = _load(conn) if start.warm else None
        return 0
    finally:
        try:
            if is_initialized():
                destroy_process_group()
        finally:
            store.close()


def main(fd: int, parent: int) -> None:
    process_tree.die_with_parent()
    if os.getppid() != parent:  # the harness died before prctl took effect
        os._exit(1)
    process_tree.adopt_orphans()
    faulthandler.enable()  # a crash (segfault, abort) leaves its stack in the rank's output
    conn = multiprocessing.connection.Connection(fd)
    code = 1
    try:
        start = conn.recv()
        assert isinstance(start, Start), start
        stacks.this_process().open(start.rank)  # the library's, which its watchdog then keeps (its timer)
        global _importing_main
        _importing_main = str(start.preparation.get("init_main_from_path") or start.preparation.get(
            "init_main_from_name") or "the main module")
        try:
            multiprocessing.spawn.prepare(start.preparation)
        finally:
            _importing_main = None
        code = _serve(conn, start)
    except BaseException as exc:  # noqa: BLE001 - an import error, a lost harness: reported if it can be
        kind, report = failure(exc)
        code = 0 if kind == "skip" else 1
        try:
            _send(conn, (kind, report))
        except (OSError, EOFError, pickle.PicklingError):
            traceback.print_exc()
    finally:
        process_tree.end_descendants(_END_WITHIN)
        sys.stdout.flush()
        sys.stderr.flush()
    conn.close()
    sys.exit(code)

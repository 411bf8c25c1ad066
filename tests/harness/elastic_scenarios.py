"""Scenarios of membership changes (tests/test_reconfigure.py): ranks as
fresh interpreters around the test's TCPStore (harness/procs.py). The init
handles travel through that store, as a job's would: each process publishes
its own and reads everyone's in one request."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from harness.procs import Ctx


def _sum(dist) -> tuple[float, int, int]:
    """all_reduce of (rank + 1) over the default group: (sum, rank, size)."""
    a = np.full(4, dist.get_rank() + 1.0)
    dist.all_reduce(a)
    assert (a == a[0]).all()
    return float(a[0]), dist.get_rank(), dist.get_world_size()


def handles(ctx: Ctx, stage: str, mine: str, who: list[int]) -> list[str]:
    """Publish this process's handle for ``stage``; everyone's (of ``who``) in order."""
    ctx.store.set(f"{stage}/handle/{ctx.rank}", mine)
    keys = [f"{stage}/handle/{r}" for r in who]
    ctx.store.wait(keys, timeout=30)
    return [v.decode() for v in ctx.store.multi_get(keys)]


def kill_shrink_grow(ctx: Ctx) -> dict | None:
    """Ranks 0..n-2 start; ``victim`` SIGKILLs itself inside an all_reduce;
    the survivors reconfigure to themselves (shrink), then rank n-1 (a
    process outside any group so far) joins them (grow)."""
    import nccl_pg as dist  # noqa: PLC0415

    n, victim = ctx.n, ctx.args["victim"]
    original = list(range(n - 1))
    res: dict = {}
    if ctx.rank in original:
        dist.init_process_group("host", store=ctx.store, rank=ctx.rank, world_size=n - 1, timeout=20)
        res["before"] = _sum(dist)
        ctx.die_inside_the_next_collective(victim, n - 1)
        try:
            dist.all_reduce(np.ones(4))
            res["failed"] = None
        except dist.DistBackendError as exc:
            res["failed"] = str(exc)
        survivors = [r for r in original if r != victim]
        t0 = time.monotonic()
        old = dist.get_init_handle()
        hs = handles(ctx, "shrink", old, survivors)
        g = dist.reconfigure(1, hs, timeout=20)
        res["shrunk"] = _sum(dist)
        res["shrink_s"] = time.monotonic() - t0
        res["shrunk_native"] = ".shrink" in g._comm.name
        hs = handles(ctx, "grow", dist.get_init_handle(), survivors + [n - 1])
    else:
        hs = handles(ctx, "grow", dist.get_init_handle(), [r for r in original if r != victim] + [n - 1])
    g = dist.reconfigure(2, hs, timeout=20, store=ctx.store if ctx.rank == n - 1 else None)
    res["grown"] = _sum(dist)
    res["comm"] = g._comm.name
    res["uuid"] = g.uuid
    res["handle"] = dist.get_init_handle()
    dist.destroy_process_group()
    return res


def both_at_once(ctx: Ctx) -> dict | None:
    """Ranks 0..3 start; rank 1 dies; in one reconfigure the survivors drop
    it and take rank 4 (a process in no group) in: shrink and grow."""
    import nccl_pg as dist  # noqa: PLC0415

    res: dict = {}
    if ctx.rank < 4:
        dist.init_process_group("host", store=ctx.store, rank=ctx.rank, world_size=4, timeout=20)
        res["before"] = _sum(dist)
        if ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(np.ones(4))
        except dist.DistBackendError:
            res["failed"] = True
        old = dist._get_default_group()
        calls: list[str] = []
        comm = old._comm
        for name in ("abort", "finalize", "destroy"):
            setattr(comm, name, _spy(calls, name, getattr(comm, name)))
    hs = handles(ctx, "both", dist.get_init_handle(), [0, 2, 3, 4])
    g = dist.reconfigure(5, hs, timeout=20, store=ctx.store if ctx.rank == 4 else None)
    res["after"] = _sum(dist)
    res["comm"] = g._comm.name
    if ctx.rank < 4:
        res["old_state"] = old.diag.state()
        res["old_comm_calls"] = calls
    dist.destroy_process_group()
    return res


def _spy(calls: list[str], name: str, method):
    """``method``, noting its name in ``calls`` when called."""
    def spy(*args, **kwargs):
        calls.append(name)
        return method(*args, **kwargs)
    return spy


def identity(ctx: Ctx) -> dict:
    """Every rank in, nobody new: a healthy group stays itself (same
    communicator); a revoked one gets a fresh communicator of the same ranks."""
    import nccl_pg as dist  # noqa: PLC0415

    dist.init_process_group("host", store=ctx.store, rank=ctx.rank, world_size=ctx.n, timeout=20)
    _sum(dist)
    g0 = dist._get_default_group()
    comm0 = g0._comm
    g1 = dist.reconfigure(1, handles(ctx, "id1", dist.get_init_handle(), list(range(ctx.n))), timeout=20)
    res = {"same_group": g1 is g0, "same_comm": g1._comm is comm0, "uuid": g1.uuid, "sum1": _sum(dist)}
    dist.revoke_process_group()
    g2 = dist.reconfigure(2, handles(ctx, "id2", dist.get_init_handle(), list(range(ctx.n))), timeout=20)
    res.update(new_group=g2 is not g1, old_state=g1.diag.state(), sum2=_sum(dist), rank2=dist.get_rank(),
               default=dist._get_default_group() is g2)
    dist.destroy_process_group()
    return res


def _raises(fn, exc: type, text: str) -> str:
    try:
        fn()
    except exc as e:
        assert text in str(e), (text, str(e))
        return type(e).__name__
    raise AssertionError(f"no {exc.__name__} ({text})")


def bad_input(ctx: Ctx) -> dict:
    """Every bad argument raises before anything collective starts; the
    group works afterwards."""
    import nccl_pg as dist  # noqa: PLC0415

    dist.init_process_group("host", store=ctx.store, rank=ctx.rank, world_size=2, timeout=20)
    hs = handles(ctx, "bad", dist.get_init_handle(), [0, 1])
    stranger = "nccl_pg:-1:-1:" + "ab" * 8
    other = dist.get_init_handle().rsplit(":", 1)[0] + ":" + "cd" * 8
    seen = [
        _raises(lambda: dist.reconfigure(0, hs), ValueError, "was used before"),
        _raises(lambda: dist.reconfigure(-1, hs), ValueError, ">= 0"),
        _raises(lambda: dist.reconfigure(True, hs), TypeError, "must be an int"),
        _raises(lambda: dist.reconfigure(3, "x"), TypeError, "a list or a set"),
        _raises(lambda: dist.reconfigure(3, []), ValueError, "is empty"),
        _raises(lambda: dist.reconfigure(3, [*hs, "nccl:0:1:xyz"]), ValueError, "is not an nccl_pg init handle"),
        _raises(lambda: dist.reconfigure(3, [*hs, 7]), TypeError, "must be a str"),
        _raises(lambda: dist.reconfigure(3, [*hs, hs[0]]), ValueError, "again"),
        _raises(lambda: dist.reconfigure(3, [hs[1 - ctx.rank]]), ValueError, "is not in init_handles"),
        _raises(lambda: dist.reconfigure(3, [*hs, other]), ValueError, "claim rank"),
        _raises(lambda: dist.reconfigure(3, [*hs, "nccl_pg:-1:-1:" + hs[ctx.rank].rsplit(":", 1)[1]]),
                ValueError, "two handles of one process"),
        _raises(lambda: dist.reconfigure(3, [*hs, "nccl_pg:0:7:" + "ef" * 8]), ValueError, "has 2 ranks"),
        _raises(lambda: dist.reconfigure(3, [*hs, "nccl_pg:3:0:" + "ef" * 8]), ValueError, "each reconfigure takes"),
        _raises(lambda: dist.reconfigure(3, [*hs, stranger], group=dist.new_group([0, 1])), ValueError,
                "join the default group only"),
        _raises(lambda: dist.reconfigure(3, hs, backend="host"), ValueError, "for a process that joins"),
    ]
    res = {"seen": seen, "sum": _sum(dist), "size": dist.get_world_size()}
    dist.destroy_process_group()
    res["no_store"] = _raises(lambda: dist.reconfigure(4, [dist.get_init_handle()]), ValueError, "store=")
    return res


def joiner_never_comes(ctx: Ctx) -> dict:
    """The handles name a new process that never starts: the members' grow
    fails at the deadline, naming the missing rank, and leaves them in no
    group (their next handle is a new process's)."""
    import nccl_pg as dist  # noqa: PLC0415

    dist.init_process_group("host", store=ctx.store, rank=ctx.rank, world_size=ctx.n, timeout=20)
    _sum(dist)
    hs = handles(ctx, "late", dist.get_init_handle(), list(range(ctx.n)))
    t0 = time.monotonic()
    try:
        dist.reconfigure(1, [*hs, "nccl_pg:-1:-1:" + "ab" * 8], timeout=ctx.args["timeout"])
        error = None
    except dist.DistBackendError as exc:
        error = str(exc)
    return {"failure": error, "took": time.monotonic() - t0, "initialized": dist.is_initialized(),
            "handle": dist.get_init_handle()}


def other_handles(ctx: Ctx) -> dict:
    """Ranks 0, 1 (members) and 2 (joining) are given different handles:
    the joiner sees it from the coordinator's record and says so."""
    import nccl_pg as dist  # noqa: PLC0415

    if ctx.rank < 2:
        dist.init_process_group("host", store=ctx.store, rank=ctx.rank, world_size=2, timeout=20)
    hs = handles(ctx, "other", dist.get_init_handle(), [0, 1, 2])
    mine = [*hs, "nccl_pg:-1:-1:" + "ab" * 8] if ctx.rank == 2 else hs
    try:
        dist.reconfigure(1, mine, timeout=ctx.args["timeout"], store=ctx.store if ctx.rank == 2 else None)
        error = None
    except dist.DistBackendError as exc:
        error = str(exc)
    return {"failure": error}


def timeout_race(ctx: Ctx) -> dict:
    """Ranks 0 and 1 issue an all_reduce that rank 2 (slow, healthy on its
    own) does not; after their timeout all three reconfigure to the same
    handles. They must agree on "same group or fresh": all fresh, one
    group, right sums. Then ranks 0 and 1 reconfigure again while rank 2
    never does: the error names rank 2 as the one that never called it."""
    import nccl_pg as dist  # noqa: PLC0415

    dist.init_process_group("host", store=ctx.store, rank=ctx.rank, world_size=3, timeout=2)
    _sum(dist)
    g0 = dist._get_default_group()
    res: dict = {}
    if ctx.rank < 2:
        try:
            dist.all_reduce(np.ones(4))
        except dist.DistBackendError as exc:
            res["timed_out"] = "timeout" in str(exc)
        ctx.store.set(f"race/timed_out/{ctx.rank}", "1")
    else:  # rank 2 goes on only once both others timed out
        ctx.store.wait(["race/timed_out/0", "race/timed_out/1"], timeout=30)
    res["healthy_before"] = g0.healthy()
    g1 = dist.reconfigure(1, handles(ctx, "race", dist.get_init_handle(), [0, 1, 2]), timeout=10)
    res.update(kept_old=g1 is g0, sum=_sum(dist), comm=g1._comm.name)
    if ctx.rank < 2:
        t0 = time.monotonic()
        try:
            dist.reconfigure(2, [*handles(ctx, "late", dist.get_init_handle(), [0, 1]),
                                 ctx.store.get("late/rank2").decode()], timeout=3)
        except dist.DistBackendError as exc:
            res["late_error"], res["late_took"] = str(exc), time.monotonic() - t0
    else:
        ctx.store.set("late/rank2", dist.get_init_handle())  # its handle, but it never calls reconfigure
    return res

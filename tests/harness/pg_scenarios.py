"""Scenarios on process groups for harness.procs worlds: error handling
(tests/test_error_handling.py), fork safety (tests/test_fork_safety.py) and
diagnosis on demand (tests/test_diagnosis.py). Each is a function of the
rank's ``Ctx``; what it returns is published as the rank's result."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time

import numpy as np

from harness.procs import Ctx, attempt, in_thread, ones


def _die(how: str) -> None:
    if how == "exit0":
        sys.exit(0)
    if how == "exit1":
        sys.exit(1)
    if how == "abort":
        os.abort()
    if how in ("kill", "term"):
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGTERM)
        time.sleep(30)
    if how != "none":
        raise ValueError(how)


# --- scenarios: the seeds' NcclErrorHandlingTest (3 ranks, groups made directly) ------------------

def errors_nonblocking(ctx: Ctx) -> dict | None:
    """Error handling off (mode 0): rank 0's collective that its peers never
    join stays pending; the process is not torn down, not even once the
    group timeout has failed the collective."""
    pg = ctx.pg()
    pg.allreduce(ones()).wait()
    if ctx.rank != 0:
        ctx.wait("done")
        return {}
    res: dict = {}
    work = pg.allreduce(ones())
    res["short_wait"] = attempt(lambda: work.wait(timeout=0.2))
    res["pending_after_short_wait"] = not work.is_completed()
    t, res["thread"] = in_thread(lambda: pg.allreduce(ones()).wait())  # the seed's _run_all_reduce
    t.join(0.5)
    res["thread_alive"] = t.is_alive()
    res["group_timeout"] = attempt(work.wait)  # the watchdog fails it at the group timeout
    t.join(10)
    res["comm_error"] = repr(pg._comm.async_error())
    res["comm_state"] = pg._comm.state.value
    res["closed"] = pg.diag.state()
    ctx.publish(res)
    ctx.set("done")
    return None  # exit without destroying the group (the seed does not either)


def errors_blocking(ctx: Ctx) -> dict | None:
    """Blocking wait: rank 1 drops its group and ends (``how``); rank 0's
    ``wait(timeout=3 s)`` raises DistBackendError, and the group is aborted."""
    pg = ctx.pg()
    pg.allreduce(ones()).wait()
    if ctx.rank == 1:
        ctx.wait("issued")
        del pg
        _die(ctx.args["how"])
        return {}
    if ctx.rank == 2:
        ctx.wait("done")
        return {}
    res: dict = {}
    work = pg.allreduce(ones())
    ctx.set("issued")
    res["wait"] = attempt(lambda: work.wait(timeout=ctx.args["op_timeout"]))
    a = np.random.rand(10)  # the seed's "some GPU ops" after the failure: this process still computes
    res["compute_ok"] = bool(np.isfinite(a.sum()))
    res["later"] = attempt(lambda: pg.allreduce(ones()).wait())
    ctx.set("done")
    return res


def blocking_wait_with_barrier(ctx: Ctx) -> dict | None:
    pg = ctx.pg()
    pg.barrier().wait()
    if ctx.rank != 0:
        ctx.wait("done")
        return {}
    res = {"barrier": attempt(lambda: pg.barrier().wait(timeout=ctx.args["op_timeout"])),
           "later": attempt(lambda: pg.barrier().wait())}
    ctx.set("done")
    return res


def nccl_timeout(ctx: Ctx) -> dict | None:
    pg = ctx.pg()
    pg.allreduce(ones()).wait(timeout=5)
    res: dict = {}
    if ctx.rank == 0:
        res["wait"] = attempt(lambda: pg.allreduce(ones()).wait(timeout=0.1))
    res["side_barrier"] = attempt(lambda: ctx.barrier("gloo", timeout=10))
    return res


# --- scenarios: ProcessGroupNCCLGroupTest (2 ranks, the default group) ---------------------------

def abort_pg(ctx: Ctx) -> dict | None:
    """Rank 0 issues an all_reduce rank 1 never joins, queues a copy of its
    buffer behind it on the group's stream (the seed's ``t.cpu()``) and
    blocks in wait(); another thread aborts the group."""
    import nccl_pg as dist  # noqa: PLC0415

    pg = ctx.init()
    t = np.random.rand(10, 10)
    dist.all_reduce(t)
    if ctx.rank == 1:
        ctx.wait("done")
        res = {"later": attempt(lambda: dist.all_reduce(t))}  # rank 0 aborted: its connections are gone
        dist.destroy_process_group()
        return res
    res = {}
    work = dist.all_reduce(t, async_op=True)
    t_cpu = np.zeros(100)
    pg._backend.copy(t_cpu, t.reshape(-1), pg._stream)  # a "device-to-host copy" behind the stuck collective
    copied = pg._stream.record()

    def copy_done() -> None:
        if not copied.synchronize(30):
            raise TimeoutError("the copy behind the stuck collective never ran")

    copier, res["copy"] = in_thread(copy_done)
    waiter, res["wait"] = in_thread(work.wait)
    time.sleep(0.3)
    res["blocked"] = copier.is_alive() and waiter.is_alive()
    aborter = threading.Thread(target=pg.abort)
    res["t_abort"] = time.monotonic()
    aborter.start()
    aborter.join(5)
    res["abort_s"] = time.monotonic() - res["t_abort"]
    copier.join(5)
    waiter.join(5)
    res["later"] = {"all_reduce": attempt(lambda: dist.all_reduce(t)), "barrier": attempt(dist.barrier)}
    t0 = time.monotonic()
    dist.destroy_process_group()
    res["destroy_s"] = time.monotonic() - t0
    ctx.set("done")
    return res


def close_pg(ctx: Ctx) -> dict | None:
    """The seeds' test_close_pg and test_abort_in_destroy_pg (same body): an
    all_reduce not waited on, destroy, then the group refuses work."""
    import nccl_pg as dist  # noqa: PLC0415

    pg = ctx.init()
    t = np.full((10, 10), ctx.rank + 1.0)
    work = pg.allreduce(t)
    t0 = time.monotonic()
    dist.destroy_process_group()
    res = {"destroy_s": time.monotonic() - t0, "flushed": work.is_success(), "sum": float(t[0, 0]),
           "comm_state": pg._comm.state.value, "after": attempt(functools.partial(pg.allreduce, [t]))}
    res["stream_threads"] = [th.name for th in threading.enumerate() if th.name.startswith("nccl_pg-pg")]
    del pg
    return res


def destruct_before_terminate_pg(ctx: Ctx) -> dict | None:
    """``del pg`` on the default group, no destroy: the process exits."""
    pg = ctx.init()
    pg.allreduce(np.random.rand(10, 10))
    del pg
    ctx.set(f"t_end/{ctx.rank}", repr(time.monotonic()))
    return None


def close_multi_pg_unordered(ctx: Ctx) -> dict | None:
    import nccl_pg as dist  # noqa: PLC0415

    pg = ctx.init()
    pg.allreduce(np.random.rand(10, 10)).wait()
    new_pg1 = dist.new_group([0, 1])
    new_pg2 = dist.new_group([0, 1])
    new_pg1.allreduce(np.random.rand(10, 10)).wait()
    new_pg2.allreduce(np.random.rand(10, 10)).wait()
    t0 = time.monotonic()
    if ctx.rank == 0:
        dist.destroy_process_group(new_pg2)
        del new_pg2
        dist.destroy_process_group(new_pg1)
        del new_pg1
    else:
        dist.destroy_process_group(new_pg1)
        del new_pg1
        dist.destroy_process_group(new_pg2)
        del new_pg2
    dist.destroy_process_group()
    return {"destroy_s": time.monotonic() - t0}


def abort_in_destroy_multi_pgs(ctx: Ctx) -> dict | None:
    """Default group and two subgroups used, each with an all_reduce still
    un-waited at destroy: destroy flushes them, then frees every
    communicator; every group refuses later work."""
    import nccl_pg as dist  # noqa: PLC0415

    empty = ctx.args["empty"]  # the mixed_empty_pgs variant: new_pg1 never used
    pg = ctx.init()
    pg.allreduce(np.random.rand(10, 10)).wait()
    new_pg1 = dist.new_group([0, 1])
    new_pg2 = dist.new_group([0, 1])
    if not empty:
        new_pg1.allreduce(np.random.rand(10, 10)).wait()
    new_pg2.allreduce(np.random.rand(10, 10)).wait()
    res: dict = {"split_count": pg.comm_split_count()}
    if ctx.rank == 1:
        time.sleep(0.3)  # rank 0's operations are still pending when it destroys
    groups = [pg, new_pg2] if empty else [pg, new_pg1, new_pg2]
    bufs = [np.full(4, ctx.rank + 1.0) for _ in groups]
    works = [g.allreduce(b) for g, b in zip(groups, bufs, strict=True)]
    t0 = time.monotonic()
    dist.destroy_process_group()
    res["destroy_s"] = time.monotonic() - t0
    res["flushed"] = [w.is_success() for w in works]
    res["sums"] = [float(b[0]) for b in bufs]
    res["after"] = [attempt(lambda g=g: g.allreduce(ones())) for g in (pg, new_pg1, new_pg2)]
    res["comm_states"] = [None if g._comm is None else g._comm.state.value for g in (pg, new_pg1, new_pg2)]
    return res


# --- scenario: DistributedDataParallelTest.test_nccl_propagate_error_reason (2 ranks) --------------

def propagate_error_reason(ctx: Ctx) -> dict | None:
    pg = ctx.pg(timeout=ctx.args["timeout"])
    pg.barrier().wait(timeout=5)
    res: dict = {}
    if ctx.rank == 0:
        ctx.wait("release")  # the seed's rank 0 blocked in a gloo barrier
        res["later"] = attempt(lambda: pg.allreduce(ones(2)).wait(timeout=5))  # the seed's TODO
        return res
    res["timed_out"] = attempt(lambda: pg.allreduce(ones(1)).wait(timeout=ctx.args["wait"]))
    res["later"] = attempt(lambda: pg.allreduce(ones(2)).wait())
    ctx.set("release")
    return res


# --- scenarios: our own ---------------------------------------------------------------------------

def timeout_report(ctx: Ctx) -> dict | None:
    """Phase 1, a subgroup {1, 2} ("pair"): global rank 2 skips a collective,
    so rank 1 times out; every rank dumps (the timeout signal). Phase 2, the
    default group: rank 2 skips again, ranks 0 and 1 time out."""
    import nccl_pg as dist  # noqa: PLC0415

    pg = ctx.init()
    dist.all_reduce(ones())
    pair = dist.new_group([1, 2], group_desc="pair")
    if ctx.rank in (1, 2):
        dist.all_reduce(ones(), group=pair)
    res: dict = {}
    if ctx.rank == 1:
        res["pair"] = attempt(lambda: dist.all_reduce(ones(), group=pair))
    ctx.set(f"phase1/{ctx.rank}")
    ctx.wait("phase2")
    if ctx.rank != 2:
        res["default"] = attempt(lambda: dist.all_reduce(ones()))
    ctx.set(f"phase2/{ctx.rank}")
    ctx.wait("exit")
    res["seq"] = pg._get_sequence_number_for_group()
    dist.destroy_process_group()
    return res


def error_handling_mode(ctx: Ctx) -> dict | None:
    """Rank 1 skips the second all_reduce; rank 0's times out under the
    mode in its environment."""
    import nccl_pg as dist  # noqa: PLC0415

    pg = ctx.init()
    dist.all_reduce(ones())
    if ctx.rank == 1:
        ctx.wait("exit", timeout=60)
        return {}
    res: dict = {"t_issue": time.monotonic()}
    ctx.publish(res)  # modes 1 and 3 end this process: the parent needs the stamp before
    res["wait"] = attempt(lambda: dist.all_reduce(ones()))
    ctx.publish(res)
    if ctx.args["ends"]:
        time.sleep(ctx.args["timeout"] + 30)  # the error handling must end this process first
        sys.exit(17)
    res["closed"] = pg.diag.state()
    res["comm_state"] = pg._comm.state.value
    res["later"] = attempt(lambda: dist.all_reduce(ones(), async_op=True).wait(timeout=0.3))
    res["alive"] = True
    t0 = time.monotonic()
    dist.destroy_process_group()
    res["destroy_s"] = time.monotonic() - t0
    return res


def heartbeat_stuck(ctx: Ctx) -> dict | None:
    """The watchdog's poller gets stuck (a group's ``check_comm`` sleeps):
    the monitor must dump and end the process with SIGABRT."""
    pg = ctx.pg()
    pg.allreduce(ones()).wait()
    pg.check_comm = lambda: time.sleep(120)
    ctx.set("stuck", repr(time.monotonic()))
    time.sleep(60)
    sys.exit(17)


def heartbeat_busy(ctx: Ctx) -> dict | None:
    """A healthy job that is merely busy: a collective that waits 2 s for a
    late rank, then large all_reduces for about 1.5 s, the main thread
    computing meanwhile; with a heartbeat timeout of 1 s nothing fires."""
    import nccl_pg as dist  # noqa: PLC0415

    ctx.init()
    x = ones(1 << 20)
    dist.all_reduce(x)
    t0 = time.monotonic()
    if ctx.rank == 1:
        time.sleep(2.0)
    dist.all_reduce(ones())
    res: dict = {"late_s": time.monotonic() - t0, "big": 0}
    t1 = time.monotonic()
    big = np.ones(1 << 22, np.float32)
    while True:  # both ranks agree on when to stop: rank 0 decides, through a broadcast
        stop = np.array([1.0 if time.monotonic() - t1 > 1.5 else 0.0])
        dist.broadcast(stop, src=0)
        if stop[0]:
            break
        w = dist.all_reduce(big, async_op=True)
        np.linalg.svd(np.random.rand(200, 200))  # the main thread is busy too
        w.wait()
        res["big"] += 1
    res["busy_s"] = time.monotonic() - t1
    dist.destroy_process_group()
    return res


def abort_process_group(ctx: Ctx) -> dict | None:
    """Rank 0: a stuck collective on the default group and on a subgroup,
    a waiter thread on each; abort the subgroup, then every group."""
    import nccl_pg as dist  # noqa: PLC0415

    pg = ctx.init()
    sub = dist.new_group([0, 1])
    dist.all_reduce(ones())
    dist.all_reduce(ones(), group=sub)
    if ctx.rank == 1:
        ctx.wait("done")
        dist.destroy_process_group()
        return {}
    res: dict = {}
    w_sub, res["sub"] = in_thread(lambda: dist.all_reduce(ones(), group=sub))
    w_def, res["default"] = in_thread(lambda: dist.all_reduce(ones()))
    time.sleep(0.3)
    res["blocked"] = w_sub.is_alive() and w_def.is_alive()
    res["t_abort_sub"] = time.monotonic()
    dist.abort_process_group(sub)
    w_sub.join(5)
    time.sleep(0.3)
    res["default_still_blocked"] = w_def.is_alive()
    res["t_abort_all"] = time.monotonic()
    dist.abort_process_group()
    res["abort_s"] = time.monotonic() - res["t_abort_all"]
    w_def.join(5)
    res["later"] = {"default": attempt(lambda: dist.all_reduce(ones())),
                    "sub": attempt(lambda: dist.all_reduce(ones(), group=sub)),
                    "barrier": attempt(dist.barrier)}
    t0 = time.monotonic()
    dist.destroy_process_group()
    res["destroy_s"] = time.monotonic() - t0
    res["closed"] = [pg.diag.state(), sub.diag.state()]
    ctx.set("done")
    return res


def destroy_flushes_pending(ctx: Ctx) -> dict | None:
    """Un-waited operations at destroy: flushed (completed, right values,
    completion hooks run) before destroy returns."""
    import nccl_pg as dist  # noqa: PLC0415

    pg = ctx.init()
    seen: list[str] = []
    pg._register_on_completion_hook(lambda info: seen.append(info.op_type.name))
    dist.all_reduce(ones())
    if ctx.rank == 1:
        time.sleep(0.5)  # rank 0 destroys while its operations wait for this rank
    a = np.full(4, ctx.rank + 1.0)
    b = np.full(4, 10.0 * (ctx.rank + 1))
    g = [np.zeros(2) for _ in range(ctx.n)]
    works = [dist.all_reduce(a, async_op=True), dist.broadcast(b, src=1, async_op=True),
             dist.all_gather(g, np.full(2, float(ctx.rank)), async_op=True)]
    t0 = time.monotonic()
    dist.destroy_process_group()
    return {"destroy_s": time.monotonic() - t0, "done": [w.is_success() for w in works], "a": a.tolist(),
            "b": b.tolist(), "g": [x.tolist() for x in g], "hooks": list(seen)}


def destroy_stuck(ctx: Ctx) -> dict | None:
    """Rank 0 destroys its groups with a collective rank 1 never joins on
    each: the subgroup's (timeout 1 s) and the default group's, issued
    under a 30 s timeout since lowered to 1 s: each flush gives up after
    1 s, warns and aborts."""
    import warnings  # noqa: PLC0415

    import nccl_pg as dist  # noqa: PLC0415

    pg = ctx.init(timeout=30)
    sub = dist.new_group([0, 1], timeout=1.0)
    dist.all_reduce(ones())
    dist.all_reduce(ones(), group=sub)
    if ctx.rank == 1:
        ctx.wait("done")
        dist.destroy_process_group()
        return {}
    w_def = dist.all_reduce(ones(), async_op=True)
    w_sub = dist.all_reduce(ones(), group=sub, async_op=True)
    dist._set_pg_timeout(1.0)
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.destroy_process_group()
    res = {"destroy_s": time.monotonic() - t0, "warnings": [str(w.message) for w in caught],
           "def": attempt(w_def.wait), "sub": attempt(w_sub.wait), "later": attempt(lambda: pg.allreduce(ones())),
           "states": [pg._comm.state.value, sub._comm.state.value]}
    ctx.set("done")
    return res


def exit_without_destroy(ctx: Ctx) -> dict | None:
    """A group made directly and dropped (``del``) frees its communicator's
    threads at once; then rank 0 exits with a collective still pending on
    the default group, never destroyed."""
    import gc  # noqa: PLC0415

    import nccl_pg as dist  # noqa: PLC0415

    ctx.init()
    dist.all_reduce(ones())
    direct = ctx.pg()
    direct.allreduce(ones()).wait()
    streams = [s._thread for s in direct._comm._streams]  # the stream threads of its communicator

    def threads() -> list[str]:
        return [t.name for t in streams if t.is_alive()]

    res: dict = {"threads_before": threads()}
    del direct
    gc.collect()
    deadline = time.monotonic() + 3
    while threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    res["threads_after"] = threads()
    if ctx.rank == 1:
        ctx.wait("exited")
        return res
    dist.all_reduce(ones(), async_op=True)  # rank 1 never joins it
    res["t_end"] = time.monotonic()
    return res


# --- scenario: shrink after a peer is SIGKILLed (tests/test_shrink.py, 3 ranks) ----------------------

def shrink_after_sigkill(ctx: Ctx) -> dict | None:
    """Rank 2 kills itself inside the survivors' all_reduce; they see the
    error and shrink the default group to the two of them."""
    import nccl_pg as dist  # noqa: PLC0415

    rank, store = ctx.rank, ctx.store
    dist.init_process_group("host", store=store, rank=rank, world_size=3, timeout=20)
    a = np.full(4, rank + 1.0, dtype=np.float32)
    dist.all_reduce(a)
    assert a[0] == 6.0
    store.add("ready", 1)
    ctx.die_inside_the_next_collective(2, 3)
    t0 = time.monotonic()
    try:
        dist.all_reduce(np.ones(4, dtype=np.float32))
        failed = None
    except dist.DistBackendError as exc:
        failed = str(exc)
    detect = time.monotonic() - t0
    old = dist._get_default_group()
    comm_state = old._comm.state.value
    new = dist.shrink_group([2], shrink_flags=dist.SHRINK_ABORT)
    b = np.full(4, rank + 1.0, dtype=np.float32)
    dist.all_reduce(b)
    res = {"failed": failed, "detect": detect, "comm_state": comm_state, "sum": float(b[0]),
           "size": dist.get_world_size(), "rank": dist.get_rank(), "comm": new._comm.name}
    dist.destroy_process_group()
    return res

"""Groups and the enqueue of the simulated NCCL (group.cc, enqueue.cc @
v2.30.7-1): thread-local groups, blocking groups launched inline (the
caller's device saved and restored), nonblocking groups on a thread of their
own, runtime connection, kernel launches, and the references captured plans
hold on their communicator. It proves our logic against NCCL's code as read
there, never GPU behaviour.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from . import cuda_memory, cuda_state, graph_events, nccl_collconfig
from .cuda_state import UserObject
from .nccl_kernels import GraphKernel, Task, kernel, ticket
from .nccl_state import (
    DTYPES,
    IN_PROGRESS,
    INTERNAL,
    INVALID_ARGUMENT,
    INVALID_USAGE,
    NUM_OPS,
    NUM_TYPES,
    REMOTE,
    SUCCESS,
    UNHANDLED_CUDA,
    Call,
    GroupJob,
    SimComm,
    World,
    async_error,
    ensure_ready,
    live_comm,
    raise_,
)
from .net import Aborted, PeerLost

Job = Callable[[bool], int]  # an async job; its argument: whether it runs inline (a blocking group)


def group_start(w: World) -> None:
    w.group().depth += 1


def group_err(w: World, ret: int) -> int:
    """group.h ncclGroupErrCheck: an error inside a group is the group's."""
    g = w.group()
    if ret != SUCCESS and g.depth > 0 and g.error == SUCCESS:
        g.error = ret
    return ret


def add_job(w: World, c: SimComm, job: Job) -> None:
    """group.cc ncclAsyncLaunch inside the implicit group of an init/split/finalize/destroy/abort/revoke call: a
    job of a communicator being destroyed makes the group blocking; kinds may not mix."""
    g = w.group()
    blocking = 1 if c.destroy_flag else c.blocking
    if c.destroy_flag:
        g.blocking = 1
    elif g.blocking == -1:
        g.blocking = blocking
    elif g.blocking != blocking:  # "Blocking and nonblocking communicators are not allowed in the same group."
        g.error = INVALID_ARGUMENT
        return
    g.jobs.append((c, job))


def group_end(w: World) -> int:
    """group.cc ncclGroupEndInternal."""
    g = w.group()
    if g.depth == 0:
        return INVALID_USAGE  # "ncclGroupEnd: not in a group call."
    g.depth -= 1
    if g.depth > 0:
        return SUCCESS
    tasks, jobs, err, blocking = g.tasks, g.jobs, g.error, g.blocking
    g.tasks, g.jobs, g.error, g.blocking = {}, [], SUCCESS, -1
    for c, _ in list(tasks.values()) + jobs:
        if c.freed is not None:
            w.violations.record(f"use after free: ncclGroupEnd on thread {threading.current_thread().name!r} walks "
                                f"communicator 0x{c.handle:x}, freed by {c.freed} while in this thread's group")
            return INVALID_USAGE
    if err == SUCCESS:
        err = _launch_events_checked(tasks)
    if err != SUCCESS:
        for c, _ in list(tasks.values()) + [(j[0], None) for j in jobs]:
            if c.blocking == 0:
                c.async_result = err
        return err
    if not tasks and not jobs:
        return SUCCESS
    comms = {c.handle: c for c, _ in tasks.values()} | {j[0].handle: j[0] for j in jobs}
    s = cuda_state.sim()
    if blocking == 0:
        gj = GroupJob()
        for c in comms.values():
            c.async_result = IN_PROGRESS
            if c.group_job is None:
                c.group_job = gj
                gj.refs += 1
        dev = s.device()

        def run() -> None:
            s.tl.device = dev  # NCCL's job thread starts on the caller's device
            gj.result = group_launch(w, tasks, jobs, gj)

        gj.thread = w.start_thread(run, "simnccl-group-job")
        return IN_PROGRESS
    saved = s.device()  # blocking group: cudaGetDevice(&savedDev) ... cudaSetDevice(savedDev)
    ret = group_launch(w, tasks, jobs, None)
    s.set_device(saved, "ncclGroupEnd (a blocking group restores the caller's device: cudaSetDevice(savedDev))")
    return ret


def _launch_events_checked(tasks: dict[int, tuple[SimComm, list[Task]]]) -> int:
    """nccl.h 2.32.3, launchCompletionEvent: "At most one non-NULL event per communicator is supported in a
    group" (enqueue.cc counts them per group: ncclRecordCollConfigLaunchCompletionEvent)."""
    for _, ts in tasks.values():
        if sum(1 for t in ts if t.config is not None and t.config.event) > 1:
            return INVALID_USAGE
    return SUCCESS


def group_launch(w: World, tasks: dict[int, tuple[SimComm, list[Task]]], jobs: list[tuple[SimComm, Job]],
                 gj: GroupJob | None) -> int:
    """group.cc groupLaunch: async jobs, then connections, then kernel launches; nonblocking comms get the
    result. Each works on its communicator's device (cudaSetDevice(comm->cudaDev))."""
    s = cuda_state.sim()
    inline = gj is None
    ret = SUCCESS
    if len(jobs) == 1:
        c, job = jobs[0]
        s.set_device(c.device, "an NCCL job (cudaSetDevice(comm->cudaDev))")
        ret = job(inline)
    elif jobs:
        results: list[int] = []

        def one(c: SimComm, job: Job) -> None:
            s.set_device(c.device, "an NCCL job (cudaSetDevice(comm->cudaDev))")
            results.append(job(False))

        threads = [threading.Thread(target=one, args=(c, job), daemon=True) for c, job in jobs]
        w.threads_started += len(threads)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ret = next((r for r in results if r != SUCCESS), SUCCESS)
    for c, ts in tasks.values():
        if ret != SUCCESS:
            break
        s.set_device(c.device, "groupLaunch (cudaSetDevice(comm->cudaDev))")
        ret = _connect(w, c, ts)
        if ret == SUCCESS:
            ret = _launch(w, c, ts)
    for c, _ in jobs:
        if c.blocking == 0 and not tasks and not c.destroy_flag:
            c.async_result = ret
    for c, _ in tasks.values():
        if c.blocking == 0:
            c.async_result = ret
    return ret


def _connect(w: World, c: SimComm, tasks: list[Task]) -> int:
    """Runtime connection (NCCL_RUNTIME_CONNECT=1, env.rst): the first operation needing a peer connects to it,
    which needs the peer to reach its own first such operation; the abort flag stops the wait."""
    need: list[tuple[str, int]] = []
    if any(t.kind not in ("send", "recv") for t in tasks) and not c.coll_connected:
        need += [("coll", p) for p in range(c.nranks) if p != c.rank]
    for t in tasks:
        if t.kind in ("send", "recv") and t.peer not in c.p2p_connected and ("p2p", t.peer) not in need:
            need.append(("p2p", t.peer))
    if c.proxy_peers is not None and any(p >= c.proxy_peers for _, p in need):
        # A grow of a parent that shares resources reuses the parent's proxy (init.cc initTransportsRank: "if
        # (parent && parent->shareResources) comm->proxyState = parent->sharedRes->proxyState"), whose peer table
        # has the parent family's size: proxy.cc ncclProxyConnect, "peerIndex %d out of bounds" (v2.30.7-1, the same
        # at v2.31.2-1). Conservative here: every connection beyond that size fails; on a GPU one through a proxy
        # rank beyond it does.
        return INTERNAL
    for kind, p in need:
        if not w.net.send(c.peers[p], (c.key, "conn", kind, c.rank, p), 1):
            return REMOTE
    for kind, p in need:
        try:
            w.net.recv((c.key, "conn", kind, p, c.rank), c.peers[p], c.aborted)
        except Aborted:
            return INTERNAL  # an aborted connection attempt: the call fails
        except PeerLost:
            return REMOTE
        c.connected_peers.add(p)
        if kind == "p2p":
            c.p2p_connected.add(p)
    if any(k == "coll" for k, _ in need):
        c.coll_connected = True
    return SUCCESS


def _reclaim(w: World, c: SimComm) -> None:
    """enqueue.cc reclaimPlan: a captured plan gives its reference back (``localPersistentRefs -= 1``). The graph's
    destructor (enqueue.cc persistentDestructor) reads ``plan->comm`` and queues onto ``comm->callbackQueue``: a
    communicator freed before its graphs were destroyed is written after its free. Only a revoked one can be
    (init.cc v2.30.7-1 ncclCommRevoke sets ``finalizeCalled``, so commReclaim skips commDestroySync, the wait for
    ``localPersistentRefs``; the same in the newest stored init.cc)."""
    if c.freed:
        w.violations.record(f"a CUDA graph that captured operations of communicator 0x{c.handle:x} was destroyed "
                            f"after the communicator was freed ({c.freed}): enqueue.cc persistentDestructor writes "
                            "into the freed communicator (init.cc: a revoked communicator is freed without waiting "
                            "for its graphs)")
    with c.cv:
        c.local_refs -= 1
        c.cv.notify_all()


def _launch(w: World, c: SimComm, tasks: list[Task]) -> int:
    """The group's operations on ``c`` as one kernel per stream (doLaunches). A launch into a capture is a
    persistent plan: it holds a reference on its communicator until the graph is destroyed (enqueue.cc
    ncclLaunchPrepare: ``comm->localPersistentRefs += nPlans`` and ncclCudaGraphAddDestructor)."""
    s = cuda_state.sim()
    by_stream: dict[int, list[Task]] = {}
    for t in tasks:
        by_stream.setdefault(t.stream, []).append(t)
    for handle, ts in by_stream.items():
        st = s.stream(handle)
        if st is None:
            w.violations.record(f"NCCL operation on stream 0x{handle:x}, which is not a live stream")
            return UNHANDLED_CUDA
        if st.device != c.device:
            w.violations.record(f"NCCL operation of a communicator on device {c.device} issued on a stream of "
                                f"device {st.device}")
        reads, writes = [], []
        for t in ts:
            size = DTYPES[t.dtype].itemsize
            n_in, n_out = _extent(t, c.nranks)
            if t.send and n_in:
                reads += cuda_memory.allocs(t.send, n_in * size)
            if t.recv and n_out:
                writes += cuda_memory.allocs(t.recv, n_out * size)
        name = f"nccl kernel ({', '.join(t.name for t in ts)})"
        if st.capture is not None:  # a graph node: launched (and counted) at each cudaGraphLaunch
            with c.cv:
                c.local_refs += 1
            st.capture.user_objects.append(UserObject(lambda: _reclaim(w, c)))
            if any(t.config is not None and t.config.event for t in ts):
                w.violations.record("a launchCompletionEvent on a captured collective is not simulated")
            st.enqueue(name, GraphKernel(w, c, ts), reads, writes)
        else:
            pos = st.enqueue(name, kernel(w, c, ts, ticket(c)), reads, writes)
            for t in ts:
                if t.config is not None and t.config.event:
                    _launch_completed(w, t.config.event, st, pos)
    return SUCCESS


def _launch_completed(w: World, handle: int, st: cuda_state.Stream, pos: int) -> None:
    """enqueue.cc ncclLaunchKernel: the caller's launchCompletionEvent is recorded when the kernel's launch
    completes (CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT), or before the launch below CUDA 12.3: either way it
    completes once the work queued before the kernel has run, as the kernel starts."""
    ev = cuda_state.sim().events.get(handle)
    if ev is None or ev.destroyed:
        w.violations.record(f"launchCompletionEvent 0x{handle:x} is not a live event (nccl.h: \"Keep the event alive "
                            "through all queued waits\")")
        return
    graph_events.mark(ev, st, pos - 1)


def _extent(t: Task, n: int) -> tuple[int, int]:
    """Elements read from send and written to recv on this rank."""
    k = t.kind
    if k in ("all_gather", "gather"):
        return t.count, t.count * n
    if k in ("reduce_scatter", "scatter"):
        return t.count * n, t.count
    if k == "allto_all":
        return t.count * n, t.count * n
    if k == "send":
        return t.count, 0
    if k == "recv":
        return 0, t.count
    return t.count, t.count


def run_job(w: World, c: SimComm, job: Job) -> None:
    """An init/split/finalize/revoke job in the call's implicit group; a nonblocking communicator answers with
    its async error (ncclInProgress while the job runs)."""
    group_start(w)
    add_job(w, c, job)
    ret = group_end(w)
    if c.blocking == 0:
        ret = async_error(c)
    raise_(ret)


# --- enqueue (enqueue.cc ncclEnqueueCheck) ------------------------------------------------------------------

_BUILTIN = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}


def enqueue(w: World, name: str, comm: object, task: Task) -> None:
    c = live_comm(w, comm, name)
    with Call(w, name, c):
        if c.revoked:  # "communicator was revoked"
            raise_(group_err(w, INVALID_USAGE))
        group_start(w)
        ret = ensure_ready(c)
        if ret == SUCCESS and c.suspended:  # comms.rst, ncclCommSuspend (nccl_suspend.py)
            w.violations.record(f"{name} on communicator 0x{c.handle:x} while it is suspended (comms.rst: \"The "
                                "communicator cannot be used for any NCCL operations while suspended\"): on a GPU its "
                                "kernel would touch unmapped memory")
            ret = UNHANDLED_CUDA
        if ret == SUCCESS:
            ret = _args_check(c, task)
        if ret == SUCCESS and nccl_collconfig.alg_refused(task.config, task.kind):
            ret = INVALID_ARGUMENT  # taskAppend: ncclCollConfigGetAlgMask with forceAlgSelection
        if ret == SUCCESS:
            g = w.group()
            if g.blocking == -1:
                g.blocking = c.blocking
            elif g.blocking != c.blocking:  # "Blocking and nonblocking communicators are not allowed in the same group."
                ret = INVALID_ARGUMENT
        if ret == SUCCESS:
            w.group().tasks.setdefault(c.handle, (c, []))[1].append(task)
        elif c.blocking == 0:
            c.async_result = ret
        group_err(w, ret)
        end = group_end(w)
        if ret == SUCCESS:
            ret = end
        if c.blocking == 0 and c.freed is None:
            ret = async_error(c)
        raise_(ret)


def _args_check(c: SimComm, t: Task) -> int:
    """argcheck.cc ArgsCheck."""
    if not 0 <= t.dtype < NUM_TYPES or t.dtype not in DTYPES:
        return INVALID_ARGUMENT
    if t.kind in ("all_reduce", "reduce", "reduce_scatter"):
        if 0 <= t.op < NUM_OPS:
            t.redop = (_BUILTIN[t.op], None)
        else:
            op = c.user_ops.get(t.op)
            if op is None:
                return INVALID_ARGUMENT
            dtype, scalar, is_ptr = op
            if dtype != t.dtype:
                return INVALID_ARGUMENT
            if is_ptr:
                scalar = cuda_memory.view(scalar, DTYPES[dtype].itemsize, "PreMulSum scalar").copy().view(
                    DTYPES[dtype])[0]
            t.redop = ("premul", scalar)
    if t.kind in ("broadcast", "reduce", "gather", "scatter") and not 0 <= t.root < c.nranks:
        return INVALID_ARGUMENT
    if t.kind in ("send", "recv") and not 0 <= t.peer < c.nranks:
        return INVALID_ARGUMENT
    if t.count and ((t.kind != "recv" and t.send == 0) or (t.kind != "send" and t.recv == 0)):
        return INVALID_ARGUMENT
    return SUCCESS

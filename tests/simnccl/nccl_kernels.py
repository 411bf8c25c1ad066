"""The device side of the simulated NCCL: one kernel per launch, collectives
computed in numpy over the transport (net.py), in each communicator's launch
order; a captured kernel is launched anew at each graph replay. Its results
prove our logic, never GPU behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import cuda_memory, cuda_state
from .nccl_state import DTYPES, REMOTE, SLICE, SUCCESS, SimComm, World
from .net import Aborted


class Task:
    __slots__ = ("kind", "send", "recv", "count", "dtype", "op", "root", "peer", "stream", "name", "redop", "config")

    def __init__(self, kind: str, name: str, send: int, recv: int, count: int, dtype: int, op: int, root: int,
                 peer: int, stream: int, config: Any = None) -> None:
        self.kind, self.name, self.send, self.recv, self.count = kind, name, send, recv, count
        self.dtype, self.op, self.root, self.peer, self.stream = dtype, op, root, peer, stream
        self.redop: tuple[str, Any] = ("sum", None)
        self.config = config  # nccl_collconfig.CollConfig of a nccl*Config call, else None


# --- kernels: the collectives over the transport ---------------------------------------------------------

def ticket(c: SimComm) -> int:
    """A kernel's place among its communicator's launches (taken when the host launches it)."""
    with c.cv:
        c.pending += 1
        c.launched += 1
        return c.launched


class GraphKernel:
    """A captured NCCL kernel: each replay launches it anew, in host launch order with the communicator's
    other operations (cudagraph.rst: mixing captured and eager operations is supported)."""

    def __init__(self, w: World, c: SimComm, tasks: list[Task]) -> None:
        self.w, self.c, self.tasks = w, c, tasks

    def instance(self) -> Callable[[], None]:
        if self.c.freed:  # its plan's device memory and the communicator's went with commFree (_reclaim)
            self.w.violations.record(f"a replay launched a kernel of communicator 0x{self.c.handle:x}, freed "
                                     f"({self.c.freed}) while the graph that captured it was alive")
        return kernel(self.w, self.c, self.tasks, ticket(self.c))

    def __call__(self) -> None:
        raise cuda_state.SimError("a captured kernel runs only through a graph launch")


def kernel(w: World, c: SimComm, tasks: list[Task], place: int) -> Callable[[], None]:
    """The device side of one launch. Kernels of one communicator run in the order the host launched them
    (NCCL orders its launches per communicator through its internal streams), whatever streams they are on."""
    def run() -> None:
        try:
            with c.cv:
                while c.executed != place - 1 and not c.abort.set:
                    c.cv.wait(SLICE)
            if c.abort.set:
                return
            plan = []
            for t in tasks:  # sequence numbers at execution: graph replays number like eager launches
                if t.kind in ("send", "recv"):
                    seqs = c.send_seq if t.kind == "send" else c.recv_seq
                    seqs[t.peer] = seqs.get(t.peer, 0) + 1
                    plan.append((t, seqs[t.peer]))
                else:
                    c.coll_seq += 1
                    plan.append((t, c.coll_seq))
            for t, seq in plan:
                _post(w, c, t, seq)
            results = [(t, _gather(w, c, t, seq)) for t, seq in plan]
            for t, data in results:
                if data is not None:
                    n = data.nbytes
                    cuda_memory.view(t.recv, n, t.name)[:] = data.view(np.uint8).reshape(-1)
        except Aborted:
            return  # an aborted kernel exits without finishing (the abort flag, as on a GPU)
        finally:
            with c.cv:
                c.pending -= 1
                c.executed = max(c.executed, place)
                c.cv.notify_all()

    return run


def _read(t: Task, start: int, count: int) -> np.ndarray:
    dt = DTYPES[t.dtype]
    raw = cuda_memory.view(t.send + start * dt.itemsize, count * dt.itemsize, t.name)
    return raw.copy().view(dt)


def _signature(t: Task) -> tuple[Any, ...] | None:
    return None if t.config is None else t.config.signature()


def _send(w: World, c: SimComm, peer: int, key: tuple[Any, ...], data: np.ndarray, t: Task) -> None:
    """A collective's data carries its per-call settings, for the receiver to compare (``_recv``)."""
    sig = _signature(t)
    payload = data.tobytes() if sig is None else (sig, data.tobytes())
    if not w.net.send(c.peers[peer], (c.key, *key), payload) and c.proxy_error == SUCCESS:
        c.proxy_error = REMOTE


def _post(w: World, c: SimComm, t: Task, seq: int) -> None:
    n, me, k = c.nranks, c.rank, t.kind
    if k == "send":
        _send(w, c, t.peer, ("p2p", me, t.peer, seq), _read(t, 0, t.count), t)
    elif k in ("all_reduce", "all_gather", "reduce") or (k == "broadcast" and me == t.root) or \
            (k == "gather" and me != t.root):
        data = _read(t, 0, t.count)
        targets = [t.root] if k in ("reduce", "gather") else range(n)
        for p in targets:
            if p != me:
                _send(w, c, p, ("c", seq, me, p), data, t)
    elif k in ("reduce_scatter", "allto_all") or (k == "scatter" and me == t.root):
        for p in range(n):
            if p != me:
                _send(w, c, p, ("c", seq, me, p), _read(t, p * t.count, t.count), t)


def _recv(w: World, c: SimComm, key: tuple[Any, ...], peer: int, dt: np.dtype, t: Task) -> np.ndarray:
    got = w.net.recv((c.key, *key), c.peers[peer], c.aborted, fail_on_lost=False)
    theirs, raw = got if isinstance(got, tuple) else (None, got)
    mine = _signature(t)
    if theirs != mine:  # nccl.h 2.32.3: "The same configuration must be set on every rank; NCCL validates it
        # only locally" and "Every rank must provide a non-NULL event or every rank must provide NULL"
        w.violations.record(f"{t.name} of communicator 0x{c.handle:x}: rank {c.rank} passed the per-call config "
                            f"{mine}, rank {peer} {theirs}; NCCL checks it only locally: undefined on a GPU (a hang or "
                            "wrong results)")
    return np.frombuffer(raw, dt)


def _gather(w: World, c: SimComm, t: Task, seq: int) -> np.ndarray | None:
    n, me, k, dt = c.nranks, c.rank, t.kind, DTYPES[t.dtype]
    if k == "send":
        return None
    if k == "recv":
        return _recv(w, c, ("p2p", t.peer, me, seq), t.peer, dt, t)

    def part(p: int, start: int = 0) -> np.ndarray:
        return _read(t, start, t.count) if p == me else _recv(w, c, ("c", seq, p, me), p, dt, t)

    if k == "all_reduce" or (k == "reduce" and me == t.root):
        return _reduce(t, [part(p) for p in range(n)], n)
    if k == "reduce":
        return None
    if k == "broadcast":
        return _read(t, 0, t.count) if me == t.root else part(t.root)
    if k == "all_gather" or (k == "gather" and me == t.root):
        return np.concatenate([part(p) for p in range(n)])
    if k == "gather":
        return None
    if k == "reduce_scatter":
        return _reduce(t, [part(p, me * t.count) for p in range(n)], n)
    if k == "allto_all":
        return np.concatenate([part(p, me * t.count) for p in range(n)])
    if k == "scatter":
        return _read(t, me * t.count, t.count) if me == t.root else part(t.root)
    raise cuda_state.SimError(k)


def _reduce(t: Task, parts: list[np.ndarray], n: int) -> np.ndarray:
    kind, scalar = t.redop
    dt = parts[0].dtype
    if kind == "premul":
        parts = [(p * np.array(scalar, dt)).astype(dt) for p in parts]
        kind = "sum"
    acc = parts[0].copy()
    for p in parts[1:]:
        if kind in ("sum", "avg"):
            acc = (acc + p).astype(dt)
        elif kind == "prod":
            acc = (acc * p).astype(dt)
        elif kind == "max":
            acc = np.maximum(acc, p)
        else:
            acc = np.minimum(acc, p)
    if kind == "avg":
        if dt.kind in "iu":
            acc = (np.trunc(acc.astype(np.float64) / n)).astype(dt)
        else:
            acc = (acc / np.array(n, dt)).astype(dt)
    return acc



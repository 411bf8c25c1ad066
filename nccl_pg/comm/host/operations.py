"""The operations of a host communicator (a mixin of communicator.py, like
membership.py: the state it reads is HostCommunicator's): the collectives,
point-to-point with its lanes, and groups, each checked at the call and
enqueued on its stream (``_enqueue``) as a function of the mesh
(algorithms.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...reduce_op import ReduceOp
from ..base import Stream, all_to_all_counts, check_dtype, check_reduction
from . import algorithms as alg
from .stream import HostStream
from .transport import Mesh, Recv, Send


def _flat(a: Any, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what}: the host backend takes numpy arrays, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: array must be contiguous")
    check_dtype(a.dtype, what)
    return a if a.ndim == 1 else a.reshape(-1)


def _out(a: Any, what: str) -> np.ndarray:
    """An array the operation writes."""
    flat = _flat(a, what)
    if not flat.flags.writeable:
        raise ValueError(f"{what}: the output array is read-only")
    return flat


@dataclass
class Branch:
    """A point-to-point operation moved onto a lane, not yet joined back."""

    lane: HostStream
    key: tuple[int | None, bool]  # (peer or None: any source, is a send)
    buf: np.ndarray

    def orders(self, key: tuple[int | None, bool], buf: np.ndarray) -> bool:
        """Must an operation (``key``, ``buf``) issued after this one wait for it?"""
        if not key[1] and not self.key[1] and (key[0] is None or self.key[0] is None):
            return True  # receives from any source and from one peer match messages in issue order
        return not (key[1] and self.key[1]) and bool(np.may_share_memory(buf, self.buf))


class Operations:
    """The operations of HostCommunicator (a mixin: the state it reads is HostCommunicator's)."""

    if TYPE_CHECKING:
        rank: int
        nranks: int
        _lock: threading.Lock
        _lanes: dict[tuple[int | None, bool], HostStream]
        _branched: dict[HostStream, list[Branch]]
        _group: list[tuple[HostStream, str, Callable[[Mesh], None] | tuple[list[Send], list[Recv]]]]
        _group_depth: int

        def new_stream(self, high_priority: bool = False) -> HostStream: ...
        def _usable(self) -> None: ...
        def _stream(self, stream: Stream) -> HostStream: ...
        def _enqueue(self, stream: Stream, kind: str, fn: Callable[[Mesh], None], nbytes: int | None = None) -> None: ...

    def _root(self, root: int) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.nranks:
            raise ValueError(f"root {root!r} out of range for {self.nranks} ranks")
        return int(root)

    def _peer(self, peer: int) -> int:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.nranks or peer == self.rank:
            raise ValueError(f"peer {peer!r} must be another rank in 0..{self.nranks - 1} (this is rank {self.rank})")
        return int(peer)

    @staticmethod
    def _same(send: np.ndarray, recv: np.ndarray, op: str, send_size: int, recv_size: int) -> None:
        if send.dtype != recv.dtype:
            raise TypeError(f"{op}: send dtype {send.dtype} differs from recv dtype {recv.dtype}")
        if send.size != send_size or recv.size != recv_size:
            raise ValueError(f"{op}: send has {send.size} elements and recv {recv.size}; expected "
                             f"{send_size} and {recv_size}")

    # --- operations -------------------------------------------------------------------

    def all_reduce(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None:
        r = _out(recv, "all_reduce recv")
        if send is not recv:  # in place (most calls): one array, checked once
            s = _flat(send, "all_reduce send")
            self._same(s, r, "all_reduce", s.size, s.size)
        else:
            s = r
        check_reduction(s.dtype, op, scale, "all_reduce")
        self._enqueue(stream, "all_reduce", lambda m: alg.all_reduce(m, s, r, op, scale), r.nbytes)

    def broadcast(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = self._root(root)
        r = _out(recv, "broadcast recv") if self.rank != root else _flat(recv, "broadcast recv")
        s = _flat(send, "broadcast send") if self.rank == root else r
        self._same(s, r, "broadcast", r.size, r.size)
        self._enqueue(stream, "broadcast", lambda m: alg.broadcast(m, s, r, root), r.nbytes)

    def reduce(self, send: Any, recv: Any, op: ReduceOp, root: int, stream: Stream,
               scale: float | None = None) -> None:
        root = self._root(root)
        s = _flat(send, "reduce send")
        r = _out(recv, "reduce recv") if self.rank == root else None
        if r is not None:
            self._same(s, r, "reduce", s.size, s.size)
        check_reduction(s.dtype, op, scale, "reduce")
        self._enqueue(stream, "reduce", lambda m: alg.reduce(m, s, r, op, root, scale), s.nbytes)

    def all_gather(self, send: Any, recv: Any, stream: Stream) -> None:
        s, r = _flat(send, "all_gather send"), _out(recv, "all_gather recv")
        self._same(s, r, "all_gather", s.size, s.size * self.nranks)
        self._enqueue(stream, "all_gather", lambda m: alg.all_gather(m, s, r), r.nbytes)

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None:
        s, r = _flat(send, "reduce_scatter send"), _out(recv, "reduce_scatter recv")
        self._same(s, r, "reduce_scatter", r.size * self.nranks, r.size)
        check_reduction(s.dtype, op, scale, "reduce_scatter")
        self._enqueue(stream, "reduce_scatter", lambda m: alg.reduce_scatter(m, s, r, op, scale), s.nbytes)

    def all_to_all(self, send: Any, recv: Any, stream: Stream, send_counts: Sequence[int] | None = None,
                   recv_counts: Sequence[int] | None = None) -> None:
        s, r = _flat(send, "all_to_all send"), _out(recv, "all_to_all recv")
        sc, rc = all_to_all_counts(self.nranks, s.size, r.size, send_counts, recv_counts)
        self._same(s, r, "all_to_all", sum(sc), sum(rc))
        self._enqueue(stream, "all_to_all", lambda m: alg.all_to_all(m, s, r, sc, rc), max(s.nbytes, r.nbytes))

    def gather(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = self._root(root)
        s = _flat(send, "gather send")
        r = _out(recv, "gather recv") if self.rank == root else None
        if r is not None:
            self._same(s, r, "gather", s.size, s.size * self.nranks)
        self._enqueue(stream, "gather", lambda m: alg.gather(m, s, r, root), s.nbytes * self.nranks)

    def scatter(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = self._root(root)
        r = _out(recv, "scatter recv")
        s = _flat(send, "scatter send") if self.rank == root else None
        if s is not None:
            self._same(s, r, "scatter", r.size * self.nranks, r.size)
        self._enqueue(stream, "scatter", lambda m: alg.scatter(m, s, r, root), r.nbytes * self.nranks)

    def send(self, buf: Any, peer: int, stream: Stream) -> None:
        self._p2p(stream, [(self._peer(peer), alg.u8(_flat(buf, "send buf")))], [])

    def recv(self, buf: Any, peer: int, stream: Stream) -> None:
        self._p2p(stream, [], [(self._peer(peer), alg.u8(_out(buf, "recv buf")), None)])

    supports_recv_any = True

    def recv_any(self, buf: Any, stream: Stream) -> Callable[[], int | None]:
        target = alg.u8(_flat(buf, "recv buf"))
        if self._group_depth:
            raise ValueError("a receive from any source cannot be part of a group (group_start/group_end)")
        source: list[int] = []
        self._enqueue(stream, "recv from any source",
                      lambda m: source.append(m.recv_any(alg.KIND["send/recv"], target)))
        return lambda: source[0] if source else None

    # --- point-to-point lanes ---------------------------------------------------------

    def p2p_stream(self, stream: Stream, peer: int | None, send: bool, buf: Any) -> HostStream:
        """Each peer and direction has a lane (a stream of its own): a send
        never waits behind a receive from another peer or direction, as with
        Gloo, which torch's batch_isend_irecv relies on for a Python process
        group (it issues the ops one by one, receives first). What NCCL's
        stream order guarantees and programs rely on is kept: the lane starts
        after the work issued before on ``stream``; ops of one peer and
        direction stay in order; an op whose buffer overlaps that of a
        pending op on another lane (one of them writing) waits for it; a
        receive from any source is ordered with every receive; and the next
        non-p2p work on ``stream`` waits for the lanes (``join_p2p``)."""
        hs = self._stream(stream)
        key = (None if peer is None else self._peer(peer), send)
        arr = _flat(buf, "send buf" if send else "recv buf")
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = self.new_stream()
            if not hs.query():
                lane.wait_event(hs.record())
            pending = [b for b in self._branched.get(hs, []) if not b.lane.query()]
            for other in dict.fromkeys(b.lane for b in pending if b.lane is not lane and b.orders(key, arr)):
                lane.wait_event(other.record())
            self._branched[hs] = [*pending, Branch(lane, key, arr)]
        return lane

    def join_p2p(self, stream: Stream) -> None:
        if not self._branched:
            return
        hs = self._stream(stream)
        with self._lock:
            pending = self._branched.pop(hs, [])
        for lane in dict.fromkeys(b.lane for b in pending):
            if not lane.query():
                hs.wait_event(lane.record())

    def _p2p(self, stream: Stream, sends: list[Send], recvs: list[Recv]) -> None:
        self._usable()
        hs = self._stream(stream)
        if self._group_depth:
            self._group.append((hs, "send/recv", (sends, recvs)))
            return
        self._enqueue(hs, "send/recv", lambda m: m.exchange(alg.KIND["send/recv"], sends, recvs))

    # --- groups ----------------------------------------------------------------------

    def group_start(self) -> None:
        self._group_depth += 1

    def group_end(self) -> None:
        if self._group_depth == 0:
            raise RuntimeError("group_end() without group_start()")
        self._group_depth -= 1
        if self._group_depth:
            return
        group, self._group = self._group, []
        if not group:
            return
        streams = list(dict.fromkeys(hs for hs, _, _ in group))
        main = streams[0]
        for other in streams[1:]:  # the group starts when all its streams reach it...
            main.wait_event(other.record())
        collectives = [fn for _, _, fn in group if callable(fn)]
        sends = [x for _, _, fn in group if not callable(fn) for x in fn[0]]
        recvs = [x for _, _, fn in group if not callable(fn) for x in fn[1]]

        def run_group(mesh: Mesh) -> None:
            for fn in collectives:
                fn(mesh)
            if sends or recvs:  # all point-to-point ops progress together: paired sends never deadlock
                mesh.exchange(alg.KIND["send/recv"], sends, recvs)

        self._enqueue(main, "group", run_group)
        done = main.record()
        for other in streams[1:]:  # ...and they go on only after it
            other.wait_event(done)

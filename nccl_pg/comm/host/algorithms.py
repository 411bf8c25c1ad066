"""Collectives on numpy arrays over a Mesh.

Small messages take one round (every rank sends its data where it is needed
and reduces locally); large ones take a ring (reduce-scatter then all-gather,
each step split in chunks that are reduced as they arrive, while the kernel
buffers the next) or a pipelined chain (broadcast). Reductions combine inputs
in a fixed order that does not depend on the receiving rank, so every rank
ends with bit-identical results, as with NCCL.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ...reduce_op import ReduceOp
from .transport import Mesh, Recv, Send
from .wire import ANY, EMPTY, NO_ROOT, NO_SIZE, Meta, WireNames, empty_target

# Kinds of operation, sent in every message header (names for error messages).
OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
       "send/recv")
KIND = {name: i for i, name in enumerate(OPS)}
# Element types and reductions by their code in message headers (a dtype not listed goes unchecked).
DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64", "float128", "complex64", "complex128", "complex256", "bfloat16", "float8_e4m3fn", "float8_e5m2",
          "float8_e4m3", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4", "float8_e8m0fnu")
_DTYPE_CODE = {name: i for i, name in enumerate(DTYPES)}
_OP_CODE = {op: i for i, op in enumerate(ReduceOp)}
WIRE_NAMES = WireNames(OPS, DTYPES, tuple(op.name for op in ReduceOp))


class Tag(NamedTuple):
    """What every message of one collective carries for the peers to check."""

    kind: int
    meta: Meta
    number: int  # the collective's, on this communicator
    rooted: bool  # its exchanges watch the connections they do not read (see transport)


_code_of: dict[np.dtype, int] = {}  # dtype -> its code, by the dtype itself (``dtype.name`` costs microseconds)


def tag(mesh: Mesh, kind: str, dtype: np.dtype, size: int = NO_SIZE, op: ReduceOp | None = None,
        root: int = NO_ROOT) -> Tag:
    """The tag of a collective beginning now; ``size``: the bytes of its
    buffer that every rank must give alike."""
    code = _code_of.get(dtype)
    if code is None:
        code = _code_of[dtype] = _DTYPE_CODE.get(dtype.name, ANY)
    return Tag(KIND[kind], (code, ANY if op is None else _OP_CODE[op], root, size), mesh.next_collective(),
               root != NO_ROOT)


def _x(mesh: Mesh, t: Tag, sends: list[Send], recvs: list[Recv]) -> None:
    mesh.exchange(t.kind, sends, recvs, t.meta, number=t.number, watch=t.rooted)


def _to_root(root: int) -> list[Send]:
    """A non-root's empty message to the root of a collective that sends it nothing back to check against."""
    return [(root, EMPTY)]


def _from_others(mesh: Mesh, root: int) -> list[Recv]:
    """The root's receipt of every other rank's empty message."""
    return [(p, empty_target(), None) for p in range(mesh.nranks) if p != root]

SMALL_BYTES = 64 * 1024  # below this, one-round algorithms win on latency
CHUNK_BYTES = 1 << 20  # ring/chain chunk


def u8(a: np.ndarray) -> memoryview:
    """A flat byte view of a contiguous array (works for ml_dtypes types too)."""
    return a.reshape(-1).view(np.uint8).data


def segments(count: int, n: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``n`` contiguous (start, stop) parts."""
    base, extra = divmod(count, n)
    out, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def chunks(start: int, stop: int, itemsize: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // max(itemsize, 1))
    return [(s, min(s + step, stop)) for s in range(start, stop, step)] or [(start, stop)]


# --- reduction ----------------------------------------------------------------------


_BOOL_UFUNC = {ReduceOp.SUM: np.logical_or, ReduceOp.PRODUCT: np.logical_and, ReduceOp.MIN: np.logical_and,
               ReduceOp.MAX: np.logical_or}
_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PREMUL_SUM: np.add, ReduceOp.PRODUCT: np.multiply,
          ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


def combiner(op: ReduceOp, dtype: np.dtype) -> Callable[[np.ndarray, np.ndarray], None]:
    """acc <- acc (op) x, in place. SUM/AVG/PREMUL_SUM all add here; AVG
    divides and PREMUL_SUM scales around the reduction."""
    fn = (_BOOL_UFUNC if dtype == np.bool_ else _UFUNC)[op]

    def combine(acc: np.ndarray, x: np.ndarray) -> None:
        fn(acc, x, out=acc)

    return combine


def prescale(data: np.ndarray, op: ReduceOp, scale: float | None) -> np.ndarray:
    """The local contribution: PREMUL_SUM multiplies it by ``scale`` first."""
    if op is ReduceOp.PREMUL_SUM:
        return (data * np.asarray(scale).astype(data.dtype)).astype(data.dtype, copy=False)
    return data


def finish(acc: np.ndarray, op: ReduceOp, nranks: int) -> None:
    """AVG: divide the sum by the number of ranks (integers truncate, as NCCL)."""
    if op is not ReduceOp.AVG:
        return
    if np.issubdtype(acc.dtype, np.integer):
        # Round toward zero without abs(), which overflows on the most negative value.
        q = acc // nranks
        if acc.dtype.kind == "i":
            q += ((acc < 0) & (acc % nranks != 0)).astype(acc.dtype)
        np.copyto(acc, q)
    elif acc.dtype.kind == "c":  # like NCCL on the real view: each component divided on its own
        real = acc.view(acc.real.dtype)
        np.divide(real, np.asarray(nranks).astype(real.dtype), out=real)
    else:
        np.divide(acc, np.asarray(nranks).astype(acc.dtype), out=acc)


def _reduce_in_rank_order(parts: Sequence[np.ndarray], out: np.ndarray, combine: Callable) -> None:
    np.copyto(out, parts[0])
    for p in parts[1:]:
        combine(out, p)


# --- collectives ----------------------------------------------------------------------


def _alone(mine: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
    """A reduction over one rank: its own contribution (nothing to exchange)."""
    if mine is not recv:
        np.copyto(recv, mine)
    finish(recv, op, 1)


def all_reduce(mesh: Mesh, send: np.ndarray, recv: np.ndarray, op: ReduceOp, scale: float | None) -> None:
    n, me = mesh.nranks, mesh.rank
    mine = prescale(send, op, scale)
    if n == 1:
        _alone(mine, recv, op)
        return
    t = tag(mesh, "all_reduce", send.dtype, send.nbytes, op)
    combine = combiner(op, send.dtype)
    if send.nbytes <= SMALL_BYTES * max(1, n // 2):
        parts = _all_gather_small(mesh, t, mine)
        _reduce_in_rank_order(parts, recv, combine)
    else:
        if mine is not recv:
            np.copyto(recv, mine)
        _ring_reduce_scatter(mesh, t, recv, segments(recv.size, n), combine)
        _ring_all_gather(mesh, t, recv, segments(recv.size, n), owner_shift=1)
    finish(recv, op, n)
    del me


def _all_gather_small(mesh: Mesh, t: Tag, mine: np.ndarray) -> list[np.ndarray]:
    """Everyone's array, in rank order, in one round."""
    n, me = mesh.nranks, mesh.rank
    theirs = np.empty((n, mine.size), dtype=mine.dtype)
    peers = [p for p in range(n) if p != me]
    _x(mesh, t, [(p, u8(mine)) for p in peers], [(p, u8(theirs[p]), None) for p in peers])
    theirs[me] = mine
    return list(theirs)


def _ring_reduce_scatter(mesh: Mesh, t: Tag, buf: np.ndarray, segs: list[tuple[int, int]],
                         combine: Callable) -> None:
    """After n-1 steps, rank r holds the full reduction of segment (r+1) % n.
    Each step: send the segment reduced so far to the next rank, receive the
    previous rank's into scratch, combine chunk by chunk as chunks land."""
    n, me = mesh.nranks, mesh.rank
    nxt, prv = (me + 1) % n, (me - 1) % n
    # The transport fills receives one after the other and runs each on_done before it reads
    # the next byte, so one chunk of scratch serves every chunk (no segment-sized allocation).
    scratch = np.empty(min(max(b - a for a, b in segs), max(1, CHUNK_BYTES // buf.itemsize)), dtype=buf.dtype)
    for step in range(n - 1):
        s_lo, s_hi = segs[(me - step) % n]
        r_lo, r_hi = segs[(me - step - 1) % n]
        recvs: list[Recv] = []
        for c_lo, c_hi in chunks(r_lo, r_hi, buf.itemsize):
            view = scratch[:c_hi - c_lo]
            recvs.append((prv, u8(view), functools.partial(combine, buf[c_lo:c_hi], view)))
        sends: list[Send] = [(nxt, u8(buf[a:b])) for a, b in chunks(s_lo, s_hi, buf.itemsize)]
        _x(mesh, t, sends, recvs)


def _ring_all_gather(mesh: Mesh, t: Tag, buf: np.ndarray, segs: list[tuple[int, int]], owner_shift: int) -> None:
    """Rank r starts owning segment (r + owner_shift) % n; each step forwards
    the segment received last to the next rank."""
    n, me = mesh.nranks, mesh.rank
    nxt, prv = (me + 1) % n, (me - 1) % n
    for step in range(n - 1):
        s_lo, s_hi = segs[(me + owner_shift - step) % n]
        r_lo, r_hi = segs[(me + owner_shift - step - 1) % n]
        sends: list[Send] = [(nxt, u8(buf[a:b])) for a, b in chunks(s_lo, s_hi, buf.itemsize)]
        recvs: list[Recv] = [(prv, u8(buf[a:b]), None) for a, b in chunks(r_lo, r_hi, buf.itemsize)]
        _x(mesh, t, sends, recvs)


def broadcast(mesh: Mesh, send: np.ndarray, recv: np.ndarray, root: int) -> None:
    """Every non-root also sends the root an empty message (in the exchange
    that receives its data: no round trip), so that the root hears from
    every rank and a disagreement on the root or the size fails there too."""
    n, me = mesh.nranks, mesh.rank
    t = tag(mesh, "broadcast", recv.dtype, recv.nbytes, root=root)
    if me == root and send is not recv:
        np.copyto(recv, send)
    if n == 1:
        return
    if recv.nbytes <= SMALL_BYTES:
        if me == root:
            _x(mesh, t, [(p, u8(recv)) for p in range(n) if p != root], _from_others(mesh, root))
        else:
            _x(mesh, t, _to_root(root), [(root, u8(recv), None)])
        return
    if mesh.tree_broadcast:
        _tree_broadcast(mesh, t, recv, root)
        return
    # A chain root -> root+1 -> ...: while receiving chunk k, forward chunk k-1. The root only
    # sends and the last rank only receives, so each posts all its chunks in one exchange.
    pos = (me - root) % n
    nxt, prv = (me + 1) % n, (me - 1) % n
    parts = chunks(0, recv.size, recv.itemsize)
    if pos == 0:
        _x(mesh, t, [(nxt, u8(recv[a:b])) for a, b in parts], _from_others(mesh, root))
        return
    if pos == n - 1:
        _x(mesh, t, _to_root(root), [(prv, u8(recv[a:b]), None) for a, b in parts])
        return
    for k in range(len(parts) + 1):
        sends: list[Send] = [(nxt, u8(recv[slice(*parts[k - 1])]))] if k > 0 else _to_root(root)
        recvs: list[Recv] = [(prv, u8(recv[slice(*parts[k])]), None)] if k < len(parts) else []
        _x(mesh, t, sends, recvs)


def _tree_broadcast(mesh: Mesh, t: Tag, buf: np.ndarray, root: int) -> None:
    """Binomial tree, whole buffer per step: ceil(log2 n) steps. Slower than
    the chain when every rank has its own core, but when a host's ranks
    outnumber its CPUs the chain's many handoffs between time-sliced ranks
    cost more than the extra steps (measured in docs/BENCHMARKS.md). A
    non-root's empty message to the root goes with its receive; the root
    collects them with its last send."""
    n, v = mesh.nranks, (mesh.rank - root) % mesh.nranks
    mask = 1
    while mask < n:
        if v < mask and v + mask < n:
            last = v == 0 and 2 * mask >= n
            _x(mesh, t, [((v + mask + root) % n, u8(buf))], _from_others(mesh, root) if last else [])
        elif mask <= v < 2 * mask:
            _x(mesh, t, _to_root(root), [((v - mask + root) % n, u8(buf), None)])
        mask <<= 1


def reduce(mesh: Mesh, send: np.ndarray, recv: np.ndarray | None, op: ReduceOp, root: int,
           scale: float | None) -> None:
    """``recv`` is only written on the root."""
    n, me = mesh.nranks, mesh.rank
    mine = prescale(send, op, scale)
    if n == 1:
        assert recv is not None
        _alone(mine, recv, op)
        return
    t = tag(mesh, "reduce", send.dtype, send.nbytes, op, root)
    combine = combiner(op, send.dtype)
    if send.nbytes <= SMALL_BYTES:  # (the root sends every rank an empty message: see gather)
        if me != root:
            _x(mesh, t, [(root, u8(mine))], [(root, empty_target(), None)])
            return
        theirs = np.empty((n, send.size), dtype=send.dtype)
        peers = [p for p in range(n) if p != root]
        _x(mesh, t, [(p, EMPTY) for p in peers], [(p, u8(theirs[p]), None) for p in peers])
        theirs[root] = mine
        assert recv is not None
        _reduce_in_rank_order(list(theirs), recv, combine)
        finish(recv, op, n)
        return
    # Large: ring reduce-scatter in scratch, then every owner sends its segment to the root.
    work = np.array(mine, copy=True)
    segs = segments(work.size, n)
    _ring_reduce_scatter(mesh, t, work, segs, combine)
    own = (me + 1) % n
    if me != root:
        _x(mesh, t, [(root, u8(work[segs[own][0]:segs[own][1]]))], [])
        return
    assert recv is not None
    np.copyto(recv[segs[own][0]:segs[own][1]], work[segs[own][0]:segs[own][1]])
    owners = [((p + 1) % n, p) for p in range(n) if p != root]
    _x(mesh, t, [], [(p, u8(recv[segs[s][0]:segs[s][1]]), None) for s, p in owners])
    finish(recv, op, n)


def all_gather(mesh: Mesh, send: np.ndarray, recv: np.ndarray) -> None:
    """``recv`` holds n blocks of send.size, in rank order."""
    n, me = mesh.nranks, mesh.rank
    t = tag(mesh, "all_gather", send.dtype, send.nbytes)
    blocks = recv.reshape(n, send.size)
    if blocks[me].ctypes.data != send.ctypes.data:
        np.copyto(blocks[me], send)
    if n == 1:
        return
    if send.nbytes <= SMALL_BYTES:
        peers = [p for p in range(n) if p != me]
        _x(mesh, t, [(p, u8(send)) for p in peers], [(p, u8(blocks[p]), None) for p in peers])
        return
    segs = [(i * send.size, (i + 1) * send.size) for i in range(n)]
    _ring_all_gather(mesh, t, recv, segs, owner_shift=0)


def reduce_scatter(mesh: Mesh, send: np.ndarray, recv: np.ndarray, op: ReduceOp, scale: float | None) -> None:
    """``send`` holds n blocks of recv.size; rank r gets the reduction of block r."""
    n, me = mesh.nranks, mesh.rank
    mine = prescale(send, op, scale).reshape(n, recv.size)
    if n == 1:
        _alone(mine[0], recv, op)
        return
    t = tag(mesh, "reduce_scatter", send.dtype, recv.nbytes, op)
    combine = combiner(op, send.dtype)
    if recv.nbytes <= SMALL_BYTES:
        theirs = np.empty((n, recv.size), dtype=recv.dtype)
        peers = [p for p in range(n) if p != me]
        _x(mesh, t, [(p, u8(mine[p])) for p in peers], [(p, u8(theirs[p]), None) for p in peers])
        theirs[me] = mine[me]
        _reduce_in_rank_order(list(theirs), recv, combine)
    else:
        # Ring with segment i = block (i+1) % n so that rank r ends owning block r.
        work = np.array(mine, copy=True).reshape(-1)
        order = [(me_b - 1) % n for me_b in range(n)]
        segs = [(order[i] * recv.size, (order[i] + 1) * recv.size) for i in range(n)]
        _ring_reduce_scatter(mesh, t, work, segs, combine)
        np.copyto(recv, work[me * recv.size:(me + 1) * recv.size])
    finish(recv, op, n)


def all_to_all(mesh: Mesh, send: np.ndarray, recv: np.ndarray, send_counts: Sequence[int],
               recv_counts: Sequence[int]) -> None:
    n, me = mesh.nranks, mesh.rank
    if np.may_share_memory(send, recv):  # in place: a block may be received before it has been sent
        send = send.copy()
    s_off = np.concatenate([[0], np.cumsum(send_counts)]).astype(int)
    r_off = np.concatenate([[0], np.cumsum(recv_counts)]).astype(int)
    if recv[r_off[me]:r_off[me + 1]].ctypes.data != send[s_off[me]:s_off[me + 1]].ctypes.data:
        np.copyto(recv[r_off[me]:r_off[me + 1]], send[s_off[me]:s_off[me + 1]])
    peers = [p for p in range(n) if p != me]
    _x(mesh, tag(mesh, "all_to_all", send.dtype), [(p, u8(send[s_off[p]:s_off[p + 1]])) for p in peers],
                  [(p, u8(recv[r_off[p]:r_off[p + 1]]), None) for p in peers])


def gather(mesh: Mesh, send: np.ndarray, recv: np.ndarray | None, root: int) -> None:
    """The root also sends every rank an empty message (in the same
    exchange: no round trip), so that a rank that only sends hears from the
    root and a disagreement on the root or the size fails there too."""
    n, me = mesh.nranks, mesh.rank
    t = tag(mesh, "gather", send.dtype, send.nbytes, root=root)
    if me != root:
        _x(mesh, t, [(root, u8(send))], [(root, empty_target(), None)])
        return
    assert recv is not None
    blocks = recv.reshape(n, send.size)
    np.copyto(blocks[me], send)
    peers = [p for p in range(n) if p != me]
    _x(mesh, t, [(p, EMPTY) for p in peers], [(p, u8(blocks[p]), None) for p in peers])


def scatter(mesh: Mesh, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
    """Every non-root also sends the root an empty message (see broadcast)."""
    n, me = mesh.nranks, mesh.rank
    t = tag(mesh, "scatter", recv.dtype, recv.nbytes, root=root)
    if me != root:
        _x(mesh, t, _to_root(root), [(root, u8(recv), None)])
        return
    assert send is not None
    blocks = send.reshape(n, recv.size)
    np.copyto(recv, blocks[me])
    _x(mesh, t, [(p, u8(blocks[p])) for p in range(n) if p != me], _from_others(mesh, root))

"""Helpers for the host-backend tests: ranks as threads (HashStore) or as
processes (TCPStore), deterministic test cases with numpy references, and the
scenarios that child processes run.

A child process is started as ``python -c BOOT <scenario> <port> <rank> <n>``;
it connects to the parent's TCPStore, reads its arguments (JSON) from the key
``args``, runs ``SCENARIOS[scenario]`` and publishes a JSON result under
``result/<rank>``.
Everything that crosses a process boundary synchronises on store keys, never
on sleeps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np

from nccl_pg.comm.base import CommConfig
from nccl_pg.comm.host import HostCommunicator, HostStream
from nccl_pg.errors import DistBackendError
from nccl_pg.reduce_op import ReduceOp
from nccl_pg.store import HashStore, PrefixStore, Store, TCPStore

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
HOST = "127.0.0.1"

# --- dtypes --------------------------------------------------------------------------

INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
COMPLEX_DTYPES = ("complex64", "complex128")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
REDUCIBLE_DTYPES = ("bool", *INT_DTYPES, *FLOAT_DTYPES, *COMPLEX_DTYPES)
ALL_DTYPES = (*REDUCIBLE_DTYPES, *FP8_DTYPES)
ALL_OPS = tuple(ReduceOp)
COMPLEX_OPS = (ReduceOp.SUM, ReduceOp.AVG)  # as NCCL on the real view
BOOL_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)  # AVG/PREMUL_SUM make no sense

_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52,
        "complex64": 2.0**-23, "complex128": 2.0**-52}


def dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if name == "bfloat16" or name in FP8_DTYPES else np.dtype(name)


def ops_for(dtype_name: str) -> tuple[ReduceOp, ...]:
    if dtype_name in COMPLEX_DTYPES:
        return COMPLEX_OPS
    return BOOL_OPS if dtype_name == "bool" else ALL_OPS


# --- test cases ------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v",
               "gather", "scatter")
REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class Case:
    """One collective call on every rank. ``count`` is the per-rank element
    count: the array length for all_reduce/reduce/broadcast, the block length
    for the others (all_gather sends ``count``, reduce_scatter receives it,
    all_to_all has ``count`` per peer; all_to_all_v draws counts up to
    ``2*count`` per pair)."""

    op: str
    dtype: str
    count: int
    inplace: bool = False
    redop: ReduceOp | None = None
    root: int = 0
    flavor: str = "exact"  # "exact": results must equal numpy's bit for bit; "noisy": random floats, tolerance
    seed: int = 0

    def key(self) -> str:
        red = self.redop.name if self.redop else "-"
        return (f"{self.op}/{self.dtype}/{self.count}/{'in' if self.inplace else 'out'}/{red}/root{self.root}/"
                f"{self.flavor}/{self.seed}")

    def to_json(self) -> list:
        return [self.op, self.dtype, self.count, self.inplace, self.redop.name if self.redop else None, self.root,
                self.flavor, self.seed]

    @classmethod
    def from_json(cls, j: list) -> Case:
        op, dt, count, inplace, red, root, flavor, seed = j
        return cls(op, dt, count, inplace, ReduceOp[red] if red else None, root, flavor, seed)

    @property
    def identical_everywhere(self) -> bool:
        """Every rank's output is the same array."""
        return self.op in ("all_reduce", "broadcast", "all_gather")


def scale_for(case: Case) -> float | None:
    if case.redop is not ReduceOp.PREMUL_SUM:
        return None
    if case.dtype in INT_DTYPES or case.dtype == "bool":
        return 3
    return 0.3 if case.flavor == "noisy" else 0.5


def a2av_counts(case: Case, n: int) -> np.ndarray:
    """counts[p][q]: elements rank p sends to rank q."""
    rng = np.random.default_rng([case.seed, n, 77])
    return rng.integers(0, 2 * case.count + 1, size=(n, n))


def input_size(case: Case, n: int, rank: int) -> int:
    c = case.count
    if case.op in ("reduce_scatter", "all_to_all", "scatter"):
        return n * c
    if case.op == "all_to_all_v":
        return int(a2av_counts(case, n)[rank].sum())
    return c


def _rng(case: Case, n: int, rank: int) -> np.random.Generator:
    return np.random.default_rng([case.seed, n, rank, zlib.crc32(case.key().encode())])


def make_input(case: Case, n: int, rank: int) -> np.ndarray:
    """The deterministic input of ``rank`` (any process can build anyone's)."""
    size, dt, rng = input_size(case, n, rank), dtype(case.dtype), _rng(case, n, rank)
    if case.dtype == "bool":
        p = 0.85 if case.redop in (ReduceOp.PRODUCT, ReduceOp.MIN) else 0.5
        return rng.random(size) < p
    if case.op not in REDUCTIONS:  # data movement only: any bit pattern
        return rng.integers(0, 256, size * dt.itemsize, dtype=np.uint8).view(dt)
    if case.dtype in INT_DTYPES:
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size, dtype=dt, endpoint=True)
    if case.flavor == "noisy":
        x = rng.standard_normal(size)
        if case.dtype in COMPLEX_DTYPES:
            x = x + 1j * rng.standard_normal(size)
        return x.astype(dt)
    # exact: small integers so that every sum and product is exact in every float type
    if case.redop is ReduceOp.PRODUCT:
        x = rng.choice(np.array([-2.0, -1.0, 1.0, 2.0]), size)
    else:
        x = rng.integers(-4, 5, size).astype(np.float64)
    if case.dtype in COMPLEX_DTYPES:
        x = x + 1j * rng.integers(-4, 5, size)
    return x.astype(dt)


def _trunc_div(s: np.ndarray, n: int) -> np.ndarray:
    """Integer division rounding toward zero, without overflow (NCCL's integer AVG)."""
    wide = s.astype(object) if s.dtype.itemsize == 8 else s.astype(np.int64)
    q = np.where(wide < 0, -((-wide) // n), wide // n)
    return q.astype(s.dtype)


def reduce_ref(xs: Sequence[np.ndarray], op: ReduceOp, scale: float | None) -> np.ndarray:
    """The reduction of the ranks' inputs, folded in rank order with numpy."""
    n, dt = len(xs), xs[0].dtype
    if dt == np.bool_:
        fn = np.logical_and if op in (ReduceOp.PRODUCT, ReduceOp.MIN) else np.logical_or
    else:
        if op is ReduceOp.PREMUL_SUM:
            xs = [(x * np.asarray(scale).astype(dt)).astype(dt) for x in xs]
        fn = {ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}.get(op, np.add)
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = fn(acc, x).astype(dt, copy=False)
    if op is ReduceOp.AVG and dt != np.bool_:
        if dt.kind in "iu":
            acc = _trunc_div(acc, n)
        elif dt.kind == "c":
            real = acc.view(np.float32 if dt == np.complex64 else np.float64)
            acc = (real / real.dtype.type(n)).view(dt)
        else:
            acc = (acc / np.asarray(n).astype(dt)).astype(dt)
    return acc


def expected(case: Case, inputs: Sequence[np.ndarray], rank: int,
             cache: dict | None = None) -> np.ndarray | None:
    """What ``rank`` must hold after the case (None: nothing, e.g. a non-root
    of reduce). ``cache`` keeps the full reduction between the ranks' calls."""
    n, c = len(inputs), case.count
    if case.op in REDUCTIONS:
        cache = {} if cache is None else cache
        if "full" not in cache:
            cache["full"] = reduce_ref(inputs, case.redop, scale_for(case))
        full = cache["full"]
    if case.op == "all_reduce":
        return full
    if case.op == "reduce":
        return full if rank == case.root else None
    if case.op == "reduce_scatter":
        return full[rank * c:(rank + 1) * c]
    if case.op == "broadcast":
        return inputs[case.root]
    if case.op == "all_gather":
        return np.concatenate(inputs)
    if case.op == "gather":
        return np.concatenate(inputs) if rank == case.root else None
    if case.op == "scatter":
        return inputs[case.root][rank * c:(rank + 1) * c]
    if case.op == "all_to_all":
        return np.concatenate([x[rank * c:(rank + 1) * c] for x in inputs])
    if case.op == "all_to_all_v":
        counts = a2av_counts(case, n)
        parts = []
        for p in range(n):
            off = int(counts[p][:rank].sum())
            parts.append(inputs[p][off:off + counts[p][rank]])
        return np.concatenate(parts)
    raise ValueError(case.op)


def _garbage(size: int, dt: np.dtype) -> np.ndarray:
    a = np.empty(size, dtype=dt)
    if dt == np.bool_:
        a[:] = True
    else:
        a.view(np.uint8)[:] = 0xA5
    return a


@dataclasses.dataclass
class Issued:
    """Buffers of one issued case on one rank, read back after the stream is synchronised."""

    out: np.ndarray | None
    unchanged: list[tuple[str, np.ndarray, bytes]]  # buffers the op must not write


class _Shaped:
    """Passes the communicator arrays of ``shape`` (count elements) or
    ``(n, *shape)`` instead of flat ones: the backend takes any contiguous shape."""

    def __init__(self, comm: HostCommunicator, count: int, shape: tuple[int, ...]) -> None:
        self._comm, self._count, self._shape = comm, count, shape

    def _v(self, a: Any) -> Any:
        if not isinstance(a, np.ndarray):
            return a
        if a.size == self._count:
            return a.reshape(self._shape)
        if a.size == self._comm.nranks * self._count:
            return a.reshape((self._comm.nranks, *self._shape))
        return a

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr
        return lambda *args, **kw: attr(*[self._v(a) for a in args], **kw)


def issue(comm: HostCommunicator, stream: HostStream, case: Case, mine: np.ndarray,
          shape: tuple[int, ...] | None = None) -> Issued:
    """Enqueue ``case`` on this rank (``mine`` is its input, copied here);
    with ``shape``, the arrays are passed in that shape instead of flat."""
    n, r, c, root = comm.nranks, comm.rank, case.count, case.root
    if shape is not None:
        comm = _Shaped(comm, c, shape)  # type: ignore[assignment]
    dt = mine.dtype
    send = mine.copy()
    keep: list[tuple[str, np.ndarray, bytes]] = []

    def const(name: str, a: np.ndarray) -> None:
        keep.append((name, a, a.tobytes()))

    op, scale = case.op, scale_for(case)
    if op == "all_reduce":
        recv = send if case.inplace else _garbage(c, dt)
        if not case.inplace:
            const("send", send)
        comm.all_reduce(send, recv, case.redop, stream, scale=scale)
        return Issued(recv, keep)
    if op == "broadcast":
        recv = send if case.inplace and r == root else _garbage(c, dt)
        if case.inplace:
            send = recv
        else:
            const("send", send)
        comm.broadcast(send, recv, root, stream)
        return Issued(recv, keep)
    if op == "reduce":
        if case.inplace:
            recv = send
            if r != root:
                const("send", send)
        else:
            recv = _garbage(c, dt)
            const("send", send)
            if r != root:
                const("recv on a non-root", recv)
        comm.reduce(send, recv, case.redop, root, stream, scale=scale)
        return Issued(recv if r == root else None, keep)
    if op == "all_gather":
        recv = _garbage(n * c, dt)
        if case.inplace:
            recv[r * c:(r + 1) * c] = send
            send = recv[r * c:(r + 1) * c]
        else:
            const("send", send)
        comm.all_gather(send, recv, stream)
        return Issued(recv, keep)
    if op == "reduce_scatter":
        if case.inplace:
            recv = send[r * c:(r + 1) * c]
        else:
            recv = _garbage(c, dt)
            const("send", send)
        comm.reduce_scatter(send, recv, case.redop, stream, scale=scale)
        return Issued(recv, keep)
    if op in ("all_to_all", "all_to_all_v"):
        if op == "all_to_all_v":
            counts = a2av_counts(case, n)
            sc, rc = list(counts[r]), list(counts[:, r])
            recv = _garbage(int(sum(rc)), dt)
            const("send", send)
            comm.all_to_all(send, recv, stream, send_counts=sc, recv_counts=rc)
            return Issued(recv, keep)
        recv = send if case.inplace else _garbage(n * c, dt)
        if not case.inplace:
            const("send", send)
        comm.all_to_all(send, recv, stream)
        return Issued(recv, keep)
    if op == "gather":
        if r == root:
            recv = _garbage(n * c, dt)
            if case.inplace:
                recv[r * c:(r + 1) * c] = send
                send = recv[r * c:(r + 1) * c]
            else:
                const("send", send)
        else:
            recv = _garbage(n * c, dt)
            const("send", send)
            const("recv on a non-root", recv)
        comm.gather(send, recv, root, stream)
        return Issued(recv if r == root else None, keep)
    if op == "scatter":
        if r == root:
            if case.inplace:
                recv = send[r * c:(r + 1) * c]
            else:
                recv = _garbage(c, dt)
                const("send", send)
        else:
            recv = _garbage(c, dt)
            if not case.inplace:
                const("send on a non-root", send)
        comm.scatter(send if r == root or not case.inplace else recv, recv, root, stream)
        return Issued(recv, keep)
    raise ValueError(op)


def check_unchanged(case: Case, rank: int, issued: Issued) -> str | None:
    for name, arr, before in issued.unchanged:
        if arr.tobytes() != before:
            return f"{case.key()} rank {rank}: {name} was modified"
    return None


def check(case: Case, inputs: Sequence[np.ndarray], rank: int, issued: Issued, cache: dict | None = None) -> str | None:
    """None if rank's result is right, else a message."""
    want = expected(case, inputs, rank, cache)
    msg = check_unchanged(case, rank, issued)
    if msg:
        return msg
    got = issued.out
    if want is None:
        return None
    if got is None or got.shape != want.shape or got.dtype != want.dtype:
        return f"{case.key()} rank {rank}: got {None if got is None else (got.dtype, got.shape)}, want " \
               f"{(want.dtype, want.shape)}"
    if case.flavor == "exact" or case.redop in (ReduceOp.MIN, ReduceOp.MAX) or case.op not in REDUCTIONS:
        if got.tobytes() != want.tobytes():
            bad = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))
            idx = int(bad[0]) // got.itemsize
            return (f"{case.key()} rank {rank}: {len(bad)} bytes differ from numpy; first at element {idx}: "
                    f"got {got[idx]!r} want {want[idx]!r}")
        return None
    # noisy floats: rounding depends on the reduction order; bound the error
    n = len(inputs)
    scale = scale_for(case)
    mag = sum(np.abs(x.astype(np.complex128)) for x in inputs) * (abs(scale) if scale else 1.0)
    if case.redop is ReduceOp.AVG:
        mag = mag / n
    if case.op == "reduce_scatter":
        mag = mag[rank * case.count:(rank + 1) * case.count]
    tol = 3 * (n + 1) * _EPS[case.dtype] * mag + 1e-30
    err = np.abs(got.astype(np.complex128) - want.astype(np.complex128))
    if not np.all(err <= tol):
        idx = int(np.argmax(err - tol))
        return f"{case.key()} rank {rank}: error {err[idx]} > {tol[idx]} at element {idx} (got {got[idx]} want {want[idx]})"
    return None


def digest(a: np.ndarray | None) -> str | None:
    return None if a is None else hashlib.sha1(a.tobytes()).hexdigest()


# --- sizes --------------------------------------------------------------------------------

SMALL_BYTES = 64 * 1024
CHUNK_BYTES = 1 << 20


def large_count(op: str, dt: np.dtype, n: int) -> int:
    """A count just above the small-message threshold of ``op`` (so the ring or
    chain path runs), never a multiple of ``n``."""
    limit = SMALL_BYTES * max(1, n // 2) if op == "all_reduce" else SMALL_BYTES
    count = limit // dt.itemsize + n + 1
    while n > 1 and count % n == 0:
        count += 1
    return count


def matrix_cases(n: int, ops: Sequence[str] = COLLECTIVES, dtypes: Sequence[str] = ALL_DTYPES,
                 seed: int = 0, large: bool = True, large_dtypes: Sequence[str] | None = None) -> list[Case]:
    """Every op x dtype x ReduceOp x in-place/out-of-place, with small sizes
    (0, 1, not multiples of n) cycled through the combinations, plus the
    large (ring/chain) path: every dtype with one ReduceOp, every ReduceOp on
    a few dtypes, and noisy floats (where only a fixed reduction order gives
    every rank the same bits)."""
    smalls = [n + 1, 0, 997, 1, 2 * n + 3, 33]
    cases: list[Case] = []
    i = 0
    for op in ops:
        for dt in dtypes:
            if op in REDUCTIONS and dt in FP8_DTYPES:
                continue
            redops: Sequence[ReduceOp | None] = ops_for(dt) if op in REDUCTIONS else [None]
            for j, red in enumerate(redops):
                for inplace in (False, True):
                    if op == "all_to_all_v" and inplace:
                        continue
                    i += 1
                    root = i % n
                    count = smalls[i % len(smalls)]
                    if op == "all_to_all_v":
                        count = (1, 5, 40)[i % 3]
                    cases.append(Case(op, dt, count, inplace, red, root, "exact", seed + i))
                    big_red = red is None or j == 0 or dt in ("float32", "int32", "bfloat16", "uint8")
                    big_dt = large_dtypes is None or dt in large_dtypes
                    if large and big_dt and big_red and op != "all_to_all_v" and (
                            inplace or dt in ("float32", "int64", "bool") or j == 0):
                        lc = large_count(op, dtype(dt), n)
                        if op in ("all_to_all", "gather", "scatter"):
                            lc = max(1, lc // n)
                        cases.append(Case(op, dt, lc, inplace, red, (root + 1) % n, "exact", seed + i + 1000))
    if large:
        for op in [o for o in REDUCTIONS if o in ops]:
            for dt in [d for d in ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")
                       if d in dtypes and (large_dtypes is None or d in large_dtypes)]:
                for red in [r for r in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM) if r in ops_for(dt)]:
                    i += 1
                    lc = large_count(op, dtype(dt), n) if i % 2 else 997
                    cases.append(Case(op, dt, lc, i % 3 == 0, red, i % n, "noisy", seed + i))
    return cases


def huge_cases(n: int) -> list[Case]:
    """Several chunks per ring segment / pipelined chain: the multi-chunk paths."""
    seg = CHUNK_BYTES * 2 + 4 * 13  # bytes per segment: three chunks, the last a partial one
    return [
        Case("all_reduce", "float32", (seg // 4) * n + 1, False, ReduceOp.SUM, 0, "noisy", 1),
        Case("all_reduce", "int8", seg * n + n - 1, True, ReduceOp.MAX, 0, "exact", 2),
        Case("broadcast", "float64", seg // 8 + 3, False, None, n - 1, "exact", 3),
        Case("reduce", "int32", (seg // 4) * n + 5, True, ReduceOp.SUM, n // 2, "exact", 4),
        Case("reduce_scatter", "uint16", seg // 2 + 1, False, ReduceOp.PRODUCT, 0, "exact", 5),
        Case("all_gather", "float16", seg // 2 + 1, True, None, 0, "exact", 6),
        Case("all_to_all", "int64", CHUNK_BYTES // 8 + 7, True, None, 0, "exact", 7),
    ]


# --- running cases -------------------------------------------------------------------------


def run_cases_threads(comms: Sequence[HostCommunicator], streams: Sequence[HostStream], cases: Sequence[Case],
                      timeout: float = 60.0, batch: int = 24, shape: tuple[int, ...] | None = None) -> list[str]:
    """Enqueue each case on every rank (back to back, from this thread: ops
    return at once), synchronise, compare with numpy and across ranks.
    Returns the failures."""
    n = len(comms)
    failures: list[str] = []
    for start in range(0, len(cases), batch):
        group = cases[start:start + batch]
        inputs = [[make_input(c, n, r) for r in range(n)] for c in group]
        issued = [[issue(comms[r], streams[r], c, inputs[k][r], shape) for r in range(n)] for k, c in enumerate(group)]
        deadline = time.monotonic() + timeout
        for r, s in enumerate(streams):
            if not s.synchronize(max(deadline - time.monotonic(), 0.01)):
                raise TimeoutError(f"rank {r}: stream did not drain within {timeout} s; cases "
                                   f"{[c.key() for c in group]}")
        errors = [(r, c.async_error()) for r, c in enumerate(comms) if c.async_error() is not None]
        if errors:
            raise AssertionError(f"async errors {errors} during cases {[c.key() for c in group]}")
        for k, c in enumerate(group):
            cache: dict = {}
            for r in range(n):
                msg = check(c, inputs[k], r, issued[k][r], cache)
                if msg:
                    failures.append(msg)
            if c.identical_everywhere:
                ds = {digest(issued[k][r].out) for r in range(n)}
                if len(ds) != 1:
                    failures.append(f"{c.key()}: ranks got different bits")
    return failures


# --- ranks as threads ------------------------------------------------------------------------


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


# --- ranks as processes -----------------------------------------------------------------------

BOOT = f"import sys; sys.path.insert(0, {TESTS_DIR!r}); import host_harness; host_harness.child_main(sys.argv[1:])"


# multiprocessing's own service processes, which live for the whole session by design
_SERVICES = (b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")


def live_children(pid: int | None = None) -> list[int]:
    """Processes whose parent is ``pid`` (default: this process) and that are
    not zombies, nor multiprocessing's forkserver or resource tracker."""
    pid = os.getpid() if pid is None else pid
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z" and not any(s in cmdline for s in _SERVICES):
            out.append(int(entry))
    return out


class ProcWorld:
    """n ranks as processes. The parent (the test) runs the TCPStore server;
    each child runs one scenario of SCENARIOS and publishes its result."""

    def __init__(self, n: int, scenario: str, args: dict | None = None, store_timeout: float = 30.0,
                 env: dict[str, str] | None = None, ranks: Sequence[int] | None = None) -> None:
        self.n = n
        self.store = TCPStore(HOST, 0, is_master=True, timeout=store_timeout)
        self._dir = tempfile.TemporaryDirectory(prefix="host_harness_")
        self.procs: dict[int, subprocess.Popen] = {}
        self._logs: dict[int, Any] = {}
        self.store.set("args", json.dumps(args or {}))  # may be too long for a command line
        full_env = {**os.environ, **(env or {})}
        for r in (range(n) if ranks is None else ranks):
            log = open(os.path.join(self._dir.name, f"rank{r}.log"), "w+")
            self._logs[r] = log
            self.procs[r] = subprocess.Popen(
                [sys.executable, "-c", BOOT, scenario, str(self.store.port), str(r), str(n)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=full_env)

    def log(self, r: int) -> str:
        f = self._logs[r]
        f.flush()
        f.seek(0)
        return f.read()[-4000:]

    def wait_key(self, key: str, timeout: float = 30.0) -> bytes:
        """Wait for a store key, failing early (with logs) if a child dies first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.store.wait([key], timeout=0.05)
                return self.store.get(key)
            except Exception:
                pass
            for r, p in self.procs.items():
                if p.poll() is not None and p.returncode != 0 and not self.store.check([f"result/{r}"]):
                    raise AssertionError(f"rank {r} exited with {p.returncode} while waiting for {key!r}:\n"
                                         f"{self.log(r)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timeout waiting for store key {key!r}\n" + self.logs())

    def logs(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{self.log(r)}" for r in self.procs)

    def join(self, timeout: float = 30.0, ranks: Sequence[int] | None = None) -> dict[int, Any]:
        """Wait for the children to exit (all of them, or ``ranks``) and
        return their results; a child that hangs is killed and fails the test."""
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        for r in (self.procs if ranks is None else ranks):
            p = self.procs[r]
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise AssertionError(f"rank {r} did not exit within {timeout} s\n{self.logs()}") from None
            if self.store.check([f"result/{r}"]):
                results[r] = json.loads(self.store.get(f"result/{r}"))
            else:
                results[r] = None
            if p.returncode != 0 or results[r] is None or "error" in results[r]:
                raise AssertionError(f"rank {r} failed (exit {p.returncode}): "
                                     f"{results[r] and results[r].get('error')}\n{self.log(r)}")
        return results

    def kill(self, r: int, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[r].pid, sig)
        self.procs[r].wait(10)

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait(10)

    def close(self) -> None:
        self.kill_all()
        for f in self._logs.values():
            f.close()
        self._dir.cleanup()
        self.store.close()

    def __enter__(self) -> ProcWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- child side ---------------------------------------------------------------------------


@dataclasses.dataclass
class Ctx:
    store: TCPStore
    rank: int
    n: int
    args: dict

    def comm(self, name: str = "comm", **config: Any) -> HostCommunicator:
        cfg = CommConfig(**{"timeout": 30.0, **config})
        return HostCommunicator.create(PrefixStore(name, self.store), self.n, self.rank, cfg)


SCENARIOS: dict[str, Callable[[Ctx], dict]] = {}


def scenario(fn: Callable[[Ctx], dict]) -> Callable[[Ctx], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn


def child_main(argv: list[str]) -> None:
    name, port, rank, n = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    store = TCPStore(HOST, port, timeout=30)
    args = json.loads(store.get("args"))
    try:
        result = SCENARIOS[name](Ctx(store, rank, n, args))
    except BaseException:
        store.set(f"result/{rank}", json.dumps({"error": traceback.format_exc()}))
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    store.set(f"result/{rank}", json.dumps(result))
    store.close()


@scenario
def matrix(ctx: Ctx) -> dict:
    """Run the given cases on this rank. Exact cases report the digest of the
    result (the parent compares it with numpy's, computed once); noisy ones
    (tolerance) and the checks that send buffers stay unchanged run here."""
    comm = ctx.comm()
    stream = comm.new_stream()
    cases = [Case.from_json(j) for j in ctx.args["cases"]]
    n, r = ctx.n, ctx.rank
    out: dict = {"failures": [], "digests": {}}
    for start in range(0, len(cases), 32):
        group = cases[start:start + 32]
        issued = [issue(comm, stream, c, make_input(c, n, r)) for c in group]
        if not stream.synchronize(60):
            raise TimeoutError("stream did not drain")
        if comm.async_error() is not None:
            raise comm.async_error()
        for c, iss in zip(group, issued, strict=True):
            out["digests"][c.key()] = digest(iss.out)
            if c.flavor == "noisy":
                msg = check(c, [make_input(c, n, p) for p in range(n)], r, iss)
            else:
                msg = check_unchanged(c, r, iss)
            if msg:
                out["failures"].append(msg)
    comm.finalize(10)
    comm.destroy()
    return out


def check_matrix_results(cases: Sequence[Case], n: int, results: dict[int, dict]) -> list[str]:
    """The parent's side of ``matrix``: every exact result equals numpy's bit
    for bit; identical-everywhere results are the same on every rank."""
    failures = [f for r in range(n) for f in results[r]["failures"]]
    for c in cases:
        got = [results[r]["digests"][c.key()] for r in range(n)]
        if c.identical_everywhere and len(set(got)) != 1:
            failures.append(f"{c.key()}: ranks got different bits")
        if c.flavor == "noisy":
            continue
        inputs = [make_input(c, n, p) for p in range(n)]
        cache: dict = {}
        for r in range(n):
            if got[r] != digest(expected(c, inputs, r, cache)):
                failures.append(f"{c.key()} rank {r}: result differs from numpy")
    return failures


@scenario
def p2p_all_pairs(ctx: Ctx) -> dict:
    """In one group, every rank sends a large buffer to every other and receives from every other."""
    comm = ctx.comm()
    s = comm.new_stream()
    n, r, size = ctx.n, ctx.rank, ctx.args["size"]
    bufs = {p: np.empty(size, np.int32) for p in range(n) if p != r}
    comm.group_start()
    for p in range(n):
        if p != r:
            comm.send(np.full(size, 100 * r + p, np.int32), p, s)
            comm.recv(bufs[p], p, s)
    comm.group_end()
    assert s.synchronize(60) and comm.async_error() is None, comm.async_error()
    ok = all(bool((b == 100 * p + r).all()) for p, b in bufs.items())
    comm.destroy()
    return {"ok": ok}


# --- fault scenarios (see test_host_faults.py) ----------------------------------------------


@scenario
def killed_peer(ctx: Ctx) -> dict:
    """Enqueue many large all_reduces; publish progress; the parent kills
    ``victim``; survivors time when async_error() appears and when the
    stream drains."""
    comm = ctx.comm()
    s = comm.new_stream()
    size, count = ctx.args["size"], ctx.args["count"]
    bufs = [np.full(size, ctx.rank + 1, np.float32) for _ in range(2)]
    first = None
    for i in range(count):
        comm.all_reduce(bufs[i % 2], bufs[i % 2], ReduceOp.MAX, s)
        if i == 0:
            first = s.record()
    end = s.record()
    assert first is not None and first.synchronize(30), "the first all_reduce did not complete"
    ctx.store.set(f"progress/{ctx.rank}", b"1")
    if ctx.rank == ctx.args["victim"]:
        time.sleep(60)  # the parent kills us here, mid-stream
        return {}
    t_err = t_drain = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (t_err is None or t_drain is None):
        if t_err is None and comm.async_error() is not None:
            t_err = time.monotonic()
        if t_drain is None and end.query():
            t_drain = time.monotonic()
        time.sleep(0.001)
    err = comm.async_error()
    state = comm.state.value
    # ops issued after the failure raise at once
    t0 = time.monotonic()
    try:
        comm.all_reduce(bufs[0], bufs[0], ReduceOp.SUM, s)
        raised = None
    except Exception as exc:
        raised = repr(exc)
    after = time.monotonic() - t0
    t0 = time.monotonic()
    comm.destroy()
    return {"t_err": t_err, "t_drain": t_drain, "err": repr(err), "err_type": type(err).__name__,
            "err_is_backend_error": isinstance(err, DistBackendError), "raised_after": raised, "raise_s": after,
            "state": state, "destroy_s": time.monotonic() - t0}


@scenario
def hung_peer(ctx: Ctx) -> dict:
    """Large all_reduces; the parent stops ``victim`` with SIGSTOP (no EOF:
    survivors block); each survivor sees its stream stuck, aborts from
    another thread and times how fast the stream drains."""
    comm = ctx.comm()
    s = comm.new_stream()
    size, count = ctx.args["size"], ctx.args["count"]
    buf = np.ones(size, np.float32)
    first = None
    for i in range(count):
        comm.all_reduce(buf, buf, ReduceOp.MAX, s)
        if i == 0:
            first = s.record()
    end = s.record()
    assert first is not None and first.synchronize(30)
    ctx.store.set(f"progress/{ctx.rank}", b"1")
    if ctx.rank == ctx.args["victim"]:
        time.sleep(60)  # stopped, then killed, by the parent
        return {}
    ctx.store.wait(["stopped"], timeout=30)
    stuck = not end.synchronize(0.5) and comm.async_error() is None
    # No survivor aborts before every survivor has checked: an early abort
    # would close sockets and give the other a "lost connection" instead.
    ctx.store.set(f"checked/{ctx.rank}", b"1")
    ctx.store.wait([f"checked/{r}" for r in range(ctx.n) if r != ctx.args["victim"]], timeout=30)
    t0 = time.monotonic()
    aborter = threading.Thread(target=comm.abort)
    aborter.start()
    drained = end.synchronize(5)
    drain_s = time.monotonic() - t0
    aborter.join(5)
    result = {"stuck": stuck, "drained": drained, "drain_s": drain_s, "err": repr(comm.async_error()),
              "state": comm.state.value}
    t0 = time.monotonic()
    comm.destroy()
    result["destroy_s"] = time.monotonic() - t0
    return result


@scenario
def abort_blocked_recv(ctx: Ctx) -> dict:
    """Rank 1 posts a recv that rank 0 never matches; another thread aborts it."""
    comm = ctx.comm()
    s = comm.new_stream()
    if ctx.rank == 0:
        ctx.store.wait(["done"], timeout=30)  # never sends; then waits for rank 1, which has aborted
        buf = np.zeros(10, np.float32)
        comm.recv(buf, 1, s)
        drained = s.synchronize(5)
        ctx.store.set("peer_checked", b"1")
        err = comm.async_error()
        comm.destroy()
        return {"peer_err": repr(err), "peer_drained": drained}
    buf = np.zeros(1 << 20, np.float32)
    comm.recv(buf, 0, s)
    ev = s.record()
    blocked = not ev.synchronize(0.3)  # the recv is stuck (bounded wait, not a correctness sleep)
    times: dict[str, float] = {}

    def aborter() -> None:
        times["abort_start"] = time.monotonic()
        comm.abort()
        times["abort_end"] = time.monotonic()

    t = threading.Thread(target=aborter)
    t.start()
    drained = ev.synchronize(5)
    t_drain = time.monotonic()
    t.join(5)
    later = {}
    for what, call in (("all_reduce", lambda: comm.all_reduce(buf, buf, ReduceOp.SUM, s)),
                       ("recv", lambda: comm.recv(buf, 0, s)),
                       ("split", lambda: comm.split(0, 0))):
        try:
            call()
            later[what] = None
        except Exception as exc:
            later[what] = f"{type(exc).__name__}: {exc}"
    ctx.store.set("done", b"1")
    ctx.store.wait(["peer_checked"], timeout=30)  # stay alive: rank 0 must see the abort, not our exit
    result = {"blocked": blocked, "drained": drained, "abort_s": times["abort_end"] - times["abort_start"],
              "drain_s": t_drain - times["abort_start"], "err": repr(comm.async_error()),
              "state": comm.state.value, "later": later, "stream_query": s.query(),
              "sync_after": s.synchronize(1)}
    t0 = time.monotonic()
    comm.destroy()
    result["destroy_s"] = time.monotonic() - t0
    return result


@scenario
def abort_during_init(ctx: Ctx) -> dict:
    """Nonblocking init whose peers never come; abort it. Run alone (the other ranks never start)."""
    comm = HostCommunicator.create(PrefixStore("comm", ctx.store), ctx.n, ctx.rank,
                                   CommConfig(blocking=False, timeout=30))
    state0 = comm.state.value
    if ctx.rank == 0:
        ctx.store.wait(["comm/addr/0"], timeout=10)  # rank 0 is accepting; others wait for addresses
    t0 = time.monotonic()
    comm.abort()
    abort_s = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        comm.wait_ready(5)
        ready_err = None
    except Exception as exc:
        ready_err = f"{type(exc).__name__}: {exc}"
    wait_s = time.monotonic() - t0
    t0 = time.monotonic()
    comm.destroy()
    destroy_s = time.monotonic() - t0
    # the init thread has finished: nothing of this communicator is left running
    deadline = time.monotonic() + 2
    while any(t.name.startswith("nccl_pg-init") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    left = [t.name for t in threading.enumerate() if t.name.startswith("nccl_pg")]
    return {"state0": state0, "abort_s": abort_s, "ready_err": ready_err, "wait_s": wait_s, "destroy_s": destroy_s,
            "state": comm.state.value, "threads_left": left}


class _FreezeOnPeerAddresses(PrefixStore):
    """The store of a rank that freezes (SIGSTOP to itself) once it has read
    rank 0's address: its own is published and its listener is up (the
    kernel accepts connections for it), but it never takes part in the
    connection handshake."""

    def _freeze(self, keys: Sequence[str]) -> None:
        if "addr/0" in keys:
            self.underlying_store.set("frozen", b"1")
            os.kill(os.getpid(), signal.SIGSTOP)

    def get(self, key: str) -> bytes:
        value = super().get(key)
        self._freeze([key])
        return value

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        values = super().multi_get(keys)
        self._freeze(keys)
        return values


@scenario
def frozen_in_init(ctx: Ctx) -> dict:
    """The victim: joins the communicator's rendezvous, then freezes before
    the connections are made. The parent kills it."""
    HostCommunicator.create(_FreezeOnPeerAddresses("comm", ctx.store), ctx.n, ctx.rank,
                            CommConfig(timeout=60))
    return {}


@scenario
def destroy_pending(ctx: Ctx) -> dict:
    """Rank 0 has ops pending on several streams (a recv rank 1 never
    matches, collectives behind it, a stream waiting on its event); destroy()
    must return promptly. Rank 1 just waits."""
    comm = ctx.comm()
    if ctx.rank == 1:
        ctx.store.wait(["done"], timeout=30)
        comm.destroy()
        return {}
    s1, s2 = comm.new_stream(), comm.new_stream()
    buf = np.zeros(1 << 20, np.float32)
    comm.recv(buf, 1, s1)
    for _ in range(5):
        comm.all_reduce(buf, buf, ReduceOp.SUM, s1)
    ev = s1.record()
    s2.wait_event(ev)
    comm.all_reduce(np.ones(10), np.ones(10), ReduceOp.SUM, s2)
    ev2 = s2.record()
    pending = not ev.query() and not ev2.query()
    t0 = time.monotonic()
    comm.destroy()
    destroy_s = time.monotonic() - t0
    drained = ev.synchronize(2) and ev2.synchronize(2)
    ctx.store.set("done", b"1")
    return {"pending": pending, "destroy_s": destroy_s, "drained": drained, "state": comm.state.value,
            "err": repr(comm.async_error())}

"""The collective test cases of the host-backend tests: dtypes, ops and
sizes, deterministic inputs, numpy references, issuing a case on a
communicator and checking the result (bit for bit, or within a rounding
bound for noisy floats)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
import zlib
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from nccl_pg.comm.host import HostCommunicator, HostStream
from nccl_pg.reduce_op import ReduceOp

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

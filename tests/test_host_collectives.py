"""The host backend's collectives (nccl_pg.comm.host) against numpy: the
dtype x op x size matrix on thread ranks and, for a representative subset,
on process ranks; the dtype and ReduceOp rules; property-based checks.

Real sockets throughout; waits are bounded and synchronise on events and
store keys, never on sleeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from harness import cases as H
from harness import comm_scenarios as S
from harness.procs import World, live_children
from harness.threads import ThreadWorld, destroy_all, parallel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nccl_pg.comm.base import CommConfig, CommState
from nccl_pg.comm.host import HostCommunicator
from nccl_pg.errors import DistBackendError
from nccl_pg.reduce_op import ReduceOp

pytestmark = pytest.mark.timeout(60)

SUM = ReduceOp.SUM

# World sizes above 5 run the large (ring/chain) path on a rotating subset of
# dtypes, to keep the file fast; sizes 1..5 (and processes, below) run it for all.
LARGE_SUBSET = {
    6: ("bool", "int8", "uint32", "float16", "float32", "complex128", "float8_e4m3fn"),
    7: ("uint8", "int16", "int64", "bfloat16", "float64", "complex64", "float8_e5m2"),
    8: ("uint16", "int32", "uint64", "float16", "bfloat16", "float32", "complex128"),
}


# --- correctness against numpy -----------------------------------------------------


@pytest.mark.parametrize("op", H.COLLECTIVES)
@pytest.mark.parametrize("n", range(1, 9))
def test_collectives_match_numpy_threads(worlds: Callable[[int], ThreadWorld], n: int, op: str) -> None:
    """Every dtype x ReduceOp x in-place/out-of-place, small sizes (0, 1, not
    multiples of n) and the large ring/chain path; exact bits against numpy,
    and the same bits on every rank."""
    cases = H.matrix_cases(n, ops=[op], seed=1000 * n, large_dtypes=LARGE_SUBSET.get(n))
    assert worlds(n).run_cases(cases) == []


@pytest.mark.parametrize("n", [2, 3])
def test_multichunk_paths_threads(worlds: Callable[[int], ThreadWorld], n: int) -> None:
    """Segments of several 1 MiB chunks (pipelined ring and chain), odd sizes, in place too."""
    assert worlds(n).run_cases(H.huge_cases(n)) == []


@pytest.mark.parametrize("algo", ["chain", "tree"])
def test_large_broadcast_algorithms(monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    """Both large-broadcast algorithms, forced (auto picks the tree when ranks
    outnumber CPUs, as on a 2-core CI machine), from every root, multi-chunk."""
    monkeypatch.setenv("NCCL_PG_HOST_BROADCAST", algo)
    n = 4
    w = ThreadWorld(n)
    try:
        assert all(c._mesh.tree_broadcast is (algo == "tree") for c in w.comms)
        big = (H.CHUNK_BYTES * 2 + 13) // 8
        cases = [H.Case("broadcast", "float64", big + root, root % 2 == 0, None, root, "exact", 50 + root)
                 for root in range(n)]
        assert w.run_cases(cases) == []
    finally:
        w.close()


@pytest.mark.timeout(60)
def test_ranks_agree_on_the_broadcast_algorithm() -> None:
    """Each rank's preference depends on its own host and environment; the
    communicator must still pick one algorithm for all (tree if any wants it)."""
    prefer = {r: {"NCCL_PG_HOST_BROADCAST": algo} for r, algo in enumerate(("chain", "tree"))}
    with World(2, S.agree_on_broadcast, rank_env=prefer) as w:
        results = w.results(timeout=50)
    assert results == {r: {"tree": True, "ok": True} for r in (0, 1)}


def test_invalid_broadcast_algorithm_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_PG_HOST_BROADCAST", "star")
    with pytest.raises(DistBackendError, match="NCCL_PG_HOST_BROADCAST"):
        ThreadWorld(2)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [3, 5])
def test_collectives_match_numpy_processes(n: int) -> None:
    """The full matrix (every op, dtype, ReduceOp, in/out of place, small,
    large and multi-chunk sizes) with each rank a separate process."""
    cases = H.matrix_cases(n, seed=7 * n) + (H.huge_cases(n) if n == 3 else [])
    with World(n, S.matrix, args={"cases": [c.to_json() for c in cases]}) as w:
        results = w.results(timeout=80)
        failures = H.check_matrix_results(cases, n, results)
    assert failures == []
    assert live_children() == []


@pytest.mark.parametrize("n", range(1, 9))
def test_rooted_ops_every_root(worlds: Callable[[int], ThreadWorld], n: int) -> None:
    cases = []
    for root in range(n):
        for op in ("broadcast", "reduce", "gather", "scatter"):
            for inplace in (False, True):
                red = ReduceOp.MAX if op == "reduce" else None
                cases.append(H.Case(op, "int32", 3 + root, inplace, red, root, "exact", root))
    assert worlds(n).run_cases(cases) == []


def test_noisy_float_sums_are_identical_on_every_rank(worlds: Callable[[int], ThreadWorld]) -> None:
    """Random floats, large path: the reduction order is fixed, so every
    rank gets the same bits (run_cases asserts it) and numpy agrees within rounding."""
    n = 5
    cases = [H.Case("all_reduce", dt, H.large_count("all_reduce", H.dtype(dt), n) * 3 + 1, inplace, red, 0, "noisy", i)
             for i, (dt, red, inplace) in enumerate(
                 (d, r, ip) for d in ("float16", "bfloat16", "float32", "float64", "complex64")
                 for r in H.ops_for(d) if r in (SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM) for ip in (False,))]
    assert worlds(n).run_cases(cases) == []


# --- dtype and ReduceOp rules -----------------------------------------------------------


@pytest.mark.parametrize("dt", H.FP8_DTYPES)
def test_float8_reductions_raise_data_movement_works(worlds: Callable[[int], ThreadWorld], dt: str) -> None:
    w = worlds(2)
    c, s = w.comms[0], w.streams[0]
    x = np.zeros(8, dtype=H.dtype(dt))
    for op in ReduceOp:
        scale = 2.0 if op is ReduceOp.PREMUL_SUM else None
        msg = "Float8 dtypes are not supported for NCCL reductions"
        with pytest.raises(TypeError, match=msg):
            c.all_reduce(x, x, op, s, scale=scale)
        with pytest.raises(TypeError, match=msg):
            c.reduce(x, x, op, 0, s, scale=scale)
        with pytest.raises(TypeError, match=msg):
            c.reduce_scatter(x, x[:4], op, s, scale=scale)
    cases = [H.Case(op, dt, 1000 + k, k % 2 == 1, None, k % 2, "exact", k)
             for k, op in enumerate(("broadcast", "all_gather", "broadcast", "all_gather", "all_to_all", "gather",
                                     "scatter", "all_to_all_v"))]
    cases.append(H.Case("broadcast", dt, 200_001, False, None, 1, "exact", 99))  # chain path
    cases.append(H.Case("all_gather", dt, 70_001, True, None, 0, "exact", 98))  # ring path
    assert w.run_cases(cases) == []


@pytest.mark.parametrize("dt", H.COMPLEX_DTYPES)
def test_complex_only_sum_like_reductions(worlds: Callable[[int], ThreadWorld], dt: str) -> None:
    w = worlds(2)
    c, s = w.comms[0], w.streams[0]
    x = np.zeros(8, dtype=dt)
    for op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PREMUL_SUM):
        scale = 2.0 if op is ReduceOp.PREMUL_SUM else None
        with pytest.raises(TypeError, match="complex"):
            c.all_reduce(x, x, op, s, scale=scale)
        with pytest.raises(TypeError, match="complex"):
            c.reduce(x, x, op, 1, s, scale=scale)
        with pytest.raises(TypeError, match="complex"):
            c.reduce_scatter(x, x[:4], op, s, scale=scale)
    # SUM and AVG work, as NCCL on the real view
    cases = [H.Case("all_reduce", dt, 11, False, op, 0, "exact", i) for i, op in enumerate(H.COMPLEX_OPS)]
    assert w.run_cases(cases) == []


def test_bool_refuses_avg_and_premul_sum(worlds: Callable[[int], ThreadWorld]) -> None:
    w = worlds(2)
    c, s = w.comms[0], w.streams[0]
    x = np.zeros(8, dtype=bool)
    with pytest.raises(TypeError, match="ReduceOp.AVG with boolean"):
        c.all_reduce(x, x, ReduceOp.AVG, s)
    with pytest.raises(TypeError, match="ReduceOp.PREMUL_SUM with boolean"):
        c.reduce_scatter(x, x[:4], ReduceOp.PREMUL_SUM, s, scale=2.0)


def test_integer_avg_rounds_toward_zero(worlds: Callable[[int], ThreadWorld]) -> None:
    """NCCL's integer AVG truncates toward zero, also at the most negative value."""
    w = worlds(3)
    for dt in H.INT_DTYPES:
        info = np.iinfo(dt)
        lo = -7 if info.min < 0 else 7
        vals = [np.array([info.min, lo, info.min // 2, 0, 7, info.max], dtype=dt),
                np.array([0, lo // 7, info.min // 2, 0, 1, 0], dtype=dt),
                np.array([0, 0, 1, 0, 0, info.max], dtype=dt)]
        recv = [np.empty(6, dtype=dt) for _ in range(3)]
        for r in range(3):
            w.comms[r].all_reduce(vals[r], recv[r], ReduceOp.AVG, w.streams[r])
        w.sync()
        span = 1 << (8 * np.dtype(dt).itemsize)
        wrapped = [(sum(int(v[i]) for v in vals) - int(info.min)) % span + int(info.min) for i in range(6)]
        want = np.array([-((-t) // 3) if t < 0 else t // 3 for t in wrapped], dtype=dt)
        for r in range(3):
            assert recv[r].tolist() == want.tolist(), (dt, recv[r], want)


def test_argument_errors(worlds: Callable[[int], ThreadWorld]) -> None:
    """Bad arguments raise at once, before anything is enqueued (the world stays usable)."""
    w = worlds(2)
    c, s = w.comms[0], w.streams[0]
    f = np.zeros(8, np.float32)
    with pytest.raises(TypeError, match="dtype"):
        c.all_reduce(f, np.zeros(8, np.float64), SUM, s)
    with pytest.raises(ValueError, match="elements"):
        c.all_reduce(f, np.zeros(9, np.float32), SUM, s)
    with pytest.raises(ValueError, match="contiguous"):
        c.all_reduce(np.zeros(16, np.float32)[::2], f, SUM, s)
    with pytest.raises(TypeError, match="numpy"):
        c.all_reduce([0.0] * 8, f, SUM, s)
    with pytest.raises(TypeError, match="ReduceOp"):
        c.all_reduce(f, f, "sum", s)
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        c.all_reduce(f, f, ReduceOp.PREMUL_SUM, s)
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        c.all_reduce(f, f, SUM, s, scale=2.0)
    for root in (-1, 2, 1.0):
        with pytest.raises(ValueError, match="root"):
            c.broadcast(f, f, root, s)
    for peer in (0, 2, -1):
        with pytest.raises(ValueError, match="peer"):
            c.send(f, peer, s)
    with pytest.raises(ValueError):
        c.all_gather(f, np.zeros(8, np.float32), s)
    with pytest.raises(ValueError):
        c.reduce_scatter(f, np.zeros(8, np.float32), SUM, s)
    with pytest.raises(ValueError, match="divisible"):
        c.all_to_all(np.zeros(7, np.float32), np.zeros(7, np.float32), s)
    with pytest.raises(ValueError, match="both"):
        c.all_to_all(f, f, s, send_counts=[4, 4])
    with pytest.raises(ValueError, match="non-negative"):
        c.all_to_all(f, f, s, send_counts=[8, 0, 0], recv_counts=[4, 4, 0])
    with pytest.raises(ValueError, match="non-negative"):
        c.all_to_all(f, f, s, send_counts=[9, -1], recv_counts=[4, 4])
    with pytest.raises(ValueError, match="elements"):
        c.all_to_all(f, f, s, send_counts=[4, 3], recv_counts=[4, 4])
    with pytest.raises(TypeError, match="HostStream"):
        c.all_reduce(f, f, SUM, object())
    with pytest.raises(RuntimeError, match="group_end"):
        c.group_end()
    with pytest.raises(ValueError, match="color"):
        c.split(-2, 0)
    w.sync()
    assert w.healthy()


# --- property-based ------------------------------------------------------------------------

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                print_blob=True)


@st.composite
def collective_cases(draw: st.DrawFn) -> tuple[int, H.Case, tuple[int, ...]]:
    n = draw(st.integers(1, 5))
    op = draw(st.sampled_from([o for o in H.COLLECTIVES if o != "all_to_all_v"]))
    dt = draw(st.sampled_from(H.REDUCIBLE_DTYPES if op in H.REDUCTIONS else H.ALL_DTYPES))
    red = draw(st.sampled_from(H.ops_for(dt))) if op in H.REDUCTIONS else None
    if draw(st.integers(0, 5)) == 0:  # now and then a large message (ring/chain path)
        shape = (draw(st.sampled_from([9_001, 40_000, 70_001])), *draw(st.lists(st.integers(1, 2), max_size=1)))
    else:
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    noisy = dt in H.FLOAT_DTYPES + H.COMPLEX_DTYPES and red in H.COMPLEX_OPS and draw(st.booleans())
    case = H.Case(op, dt, math.prod(shape), draw(st.booleans()), red, draw(st.integers(0, n - 1)),
                  "noisy" if noisy else "exact", draw(st.integers(0, 2**32 - 1)))
    return n, case, shape


@FAST
@given(collective_cases())
def test_random_collectives(worlds: Callable[[int], ThreadWorld], drawn: tuple[int, H.Case, tuple[int, ...]]) -> None:
    """Random op, dtype, ReduceOp, multi-dimensional shape, root, in/out of place."""
    n, case, shape = drawn
    assert worlds(n).run_cases([case], shape=shape) == []


@st.composite
def uneven_counts(draw: st.DrawFn) -> tuple[np.ndarray, str]:
    n = draw(st.integers(1, 5))
    big = draw(st.integers(0, 3)) == 0  # now and then some blocks larger than the kernel's buffers
    each = st.one_of(st.integers(0, 40), st.integers(40_000, 100_000)) if big else st.integers(0, 40)
    counts = np.array(draw(st.lists(each, min_size=n * n, max_size=n * n))).reshape(n, n)
    return counts, draw(st.sampled_from(["int8", "float32", "complex128", "bfloat16", "bool"]))


@FAST
@given(uneven_counts())
def test_random_uneven_all_to_all(worlds: Callable[[int], ThreadWorld], drawn: tuple[np.ndarray, str]) -> None:
    """counts[p][q] elements go from rank p to rank q; blocks packed in rank order."""
    counts, dt = drawn
    n = len(counts)
    w = worlds(n)
    dtype = H.dtype(dt)
    rng = np.random.default_rng(int(counts.sum()))
    sends = [rng.integers(0, 2, int(counts[r].sum())).astype(bool) if dt == "bool" else
             rng.integers(0, 256, int(counts[r].sum()) * dtype.itemsize, dtype=np.uint8).view(dtype)
             for r in range(n)]
    recvs = [np.empty(int(counts[:, r].sum()), dtype=dtype) for r in range(n)]
    for r in range(n):
        w.comms[r].all_to_all(sends[r], recvs[r], w.streams[r], send_counts=counts[r].tolist(),
                              recv_counts=counts[:, r].tolist())
    w.sync()
    for r in range(n):
        want = np.concatenate([sends[p][counts[p][:r].sum():counts[p][:r].sum() + counts[p][r]] for p in range(n)])
        assert recvs[r].tobytes() == want.tobytes()


def check_split(parents: list[HostCommunicator], colors: list[int | None], keys: list[int]) -> None:
    n = len(parents)
    before = [p.split_count for p in parents]
    children = parallel(n, lambda r: parents[r].split(colors[r], keys[r]), timeout=30)
    try:
        assert [p.split_count for p in parents] == [b + 1 for b in before]
        for r in range(n):
            if colors[r] is None:
                assert children[r] is None
                continue
            members = sorted((keys[q], q) for q in range(n) if colors[q] == colors[r])
            order = [q for _, q in members]
            child = children[r]
            assert (child.nranks, child.rank) == (len(order), order.index(r))
        # each child group: all_gather of parent ranks gives the (key, rank) order
        live = [r for r in range(n) if children[r] is not None]
        streams = {r: children[r].new_stream() for r in live}
        got = {r: np.empty(children[r].nranks, np.int64) for r in live}
        for r in live:
            children[r].all_gather(np.array([r], np.int64), got[r], streams[r])
        for r in live:
            assert streams[r].synchronize(30) and children[r].async_error() is None
            order = [q for _, q in sorted((keys[q], q) for q in range(n) if colors[q] == colors[r])]
            assert got[r].tolist() == order
    finally:
        destroy_all(children)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_split(worlds: Callable[[int], ThreadWorld], data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 6))
    colors = data.draw(st.lists(st.one_of(st.none(), st.integers(0, 2)), min_size=n, max_size=n))
    keys = data.draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n))
    check_split(worlds(n).comms, colors, keys)


def test_split_colors_keys_and_nested(worlds: Callable[[int], ThreadWorld]) -> None:
    w = worlds(6)
    colors: list[int | None] = [1, 0, 1, None, 0, 1]
    keys = [5, 0, -1, 3, 0, 5]  # ties break by parent rank
    before = [c.split_count for c in w.comms]
    children = parallel(6, lambda r: w.comms[r].split(colors[r], keys[r]), timeout=30)
    try:
        assert children[3] is None
        assert [(c.rank, c.nranks) if c else None for c in children] == [
            (1, 3), (0, 2), (0, 3), None, (1, 2), (2, 3)]
        assert [c.split_count for c in w.comms] == [b + 1 for b in before]
        # a split of a child: color 1's three ranks split by child rank parity
        members = [0, 2, 5]
        grand = parallel(3, lambda i: children[members[i]].split(children[members[i]].rank % 2,
                                                                    -children[members[i]].rank), timeout=30)
        try:
            assert [children[m].split_count for m in members] == [1, 1, 1]
            assert [(g.rank, g.nranks) for g in grand] == [(0, 1), (1, 2), (0, 2)]  # child ranks 1, 0, 2
            # the parent, the children and the grandchildren all still work
            groups = [w.comms, [children[r] for r in (0, 2, 5)], [children[r] for r in (1, 4)], [grand[0]],
                      [grand[1], grand[2]]]
            streams = [[c.new_stream() for c in g] for g in groups]
            bufs = [[np.full(5, 1 + c.rank, np.int64) for c in g] for g in groups]
            for g, ss, bs in zip(groups, streams, bufs, strict=True):
                for c, s, b in zip(g, ss, bs, strict=True):
                    c.all_reduce(b, b, SUM, s)
            for g, ss, bs in zip(groups, streams, bufs, strict=True):
                for c, s, b in zip(g, ss, bs, strict=True):
                    assert s.synchronize(30) and c.async_error() is None
                    assert (b == len(g) * (len(g) + 1) // 2).all()
        finally:
            destroy_all(grand)
    finally:
        destroy_all(children)


def test_split_nonblocking_child(worlds: Callable[[int], ThreadWorld]) -> None:
    w = worlds(3)
    cfg = CommConfig(blocking=False, timeout=20)
    children = parallel(3, lambda r: w.comms[r].split(0, r, cfg), timeout=30)
    try:
        for c in children:
            assert c.state in (CommState.INITIALIZING, CommState.READY)
        streams = [c.new_stream() for c in children]
        bufs = [np.full(3, r, np.int32) for r in range(3)]
        for c, s, b in zip(children, streams, bufs, strict=True):  # may run before READY: waits for init
            c.all_reduce(b, b, ReduceOp.MAX, s)
        for c, s, b in zip(children, streams, bufs, strict=True):
            c.wait_ready(20)
            assert c.state is CommState.READY
            assert s.synchronize(20) and (b == 2).all()
    finally:
        destroy_all(children)

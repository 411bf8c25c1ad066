"""The host backend (nccl_pg.comm.host): correctness against numpy and the
semantics of the Communicator contract (../shared/DESIGN.md, issue 3).

Ranks are threads of this process (HashStore) for the big dtype x op matrix
and the semantics, and separate processes (TCPStore) for a representative
subset. Real sockets throughout; waits are bounded and synchronise on events
and store keys, never on sleeps. Fault tests with killed processes live in
test_host_faults.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from harness import cases as H
from harness import comm_scenarios as S
from harness.procs import World, live_children
from harness.threads import ThreadWorld, create_comms, destroy_all, parallel, unique
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nccl_pg.comm.base import CommConfig, CommState
from nccl_pg.comm.host import HostCommunicator, HostEvent, HostStream
from nccl_pg.errors import DistBackendError
from nccl_pg.reduce_op import ReduceOp
from nccl_pg.store import HashStore, PrefixStore, TCPStore

pytestmark = pytest.mark.timeout(60)

SUM = ReduceOp.SUM

# World sizes above 5 run the large (ring/chain) path on a rotating subset of
# dtypes, to keep the file fast; sizes 1..5 (and processes, below) run it for all.
LARGE_SUBSET = {
    6: ("bool", "int8", "uint32", "float16", "float32", "complex128", "float8_e4m3fn"),
    7: ("uint8", "int16", "int64", "bfloat16", "float64", "complex64", "float8_e5m2"),
    8: ("uint16", "int32", "uint64", "float16", "bfloat16", "float32", "complex128"),
}


@pytest.fixture(scope="module")
def worlds() -> Iterator[Callable[[int], ThreadWorld]]:
    """Thread worlds of n ranks, built once per module (rebuilt if broken)."""
    cache: dict[int, ThreadWorld] = {}

    def get(n: int) -> ThreadWorld:
        w = cache.get(n)
        if w is None or not w.healthy():
            if w is not None:
                w.close()
            w = cache[n] = ThreadWorld(n)
        return w

    yield get
    for w in cache.values():
        w.close()


@pytest.fixture
def make_comms() -> Iterator[Callable[..., list[HostCommunicator]]]:
    """Fresh communicators for tests that break or block them; destroyed at teardown."""
    made: list[HostCommunicator] = []

    def make(n: int, **config: object) -> list[HostCommunicator]:
        comms = create_comms(n, **config)
        made.extend(comms)
        return comms

    yield make
    destroy_all(made)


def returns_within(seconds: float, fn: Callable[[], object]) -> object:
    """Call fn in a thread; fail if it has not returned within ``seconds``."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"call did not return within {seconds} s"
    box["elapsed"] = time.monotonic() - t0
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


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


AGREE_RANK = """
import sys, numpy as np
from nccl_pg.comm import CommConfig
from nccl_pg.comm.host import HostCommunicator
from nccl_pg.store import PrefixStore, TCPStore
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = TCPStore("127.0.0.1", port, timeout=30)
comm = HostCommunicator.create(PrefixStore("agree", store), 2, rank, CommConfig(timeout=30))
s = comm.new_stream()
x = np.arange(300_000, dtype=np.float64) if rank == 0 else np.zeros(300_000)
comm.broadcast(x, x, 0, s)
ok = s.synchronize(30) and comm.async_error() is None and bool((x == np.arange(300_000)).all())
print(comm._mesh.tree_broadcast, ok, flush=True)
store.set(f"done/{rank}", "1"); store.wait(["done/0", "done/1"])
comm.destroy()
"""


@pytest.mark.timeout(60)
def test_ranks_agree_on_the_broadcast_algorithm() -> None:
    """Each rank's preference depends on its own host and environment; the
    communicator must still pick one algorithm for all (tree if any wants it)."""
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    try:
        procs = [subprocess.Popen([sys.executable, "-c", AGREE_RANK, str(r), str(master.port)], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "NCCL_PG_HOST_BROADCAST": algo})
                 for r, algo in enumerate(("chain", "tree"))]
        outs = [p.communicate(timeout=50)[0].split() for p in procs]
    finally:
        master.close()
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [["True", "True"], ["True", "True"]]


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


# --- groups and point-to-point -------------------------------------------------------------------

BIG = 1 << 20  # 4 MiB of int32/float32 per message: more than the kernel buffers both ways


def test_group_all_pairs_large_threads(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    """Every rank sends to and receives from every other, large, in one group: no deadlock."""
    n = 4
    comms = make_comms(n)
    streams = [c.new_stream() for c in comms]
    got = {(r, p): np.empty(BIG, np.int32) for r in range(n) for p in range(n) if p != r}
    for r, c in enumerate(comms):
        c.group_start()
        for p in range(n):
            if p != r:
                c.send(np.full(BIG, 100 * r + p, np.int32), p, streams[r])
                c.recv(got[(r, p)], p, streams[r])
        c.group_end()
    for r in range(n):
        assert streams[r].synchronize(30) and comms[r].async_error() is None
    for (r, p), buf in got.items():
        assert (buf == 100 * p + r).all()


@pytest.mark.timeout(60)
def test_group_all_pairs_large_processes() -> None:
    with World(3, S.p2p_all_pairs, args={"size": BIG}) as w:
        results = w.results(timeout=50)
    assert all(r["ok"] for r in results.values())


def test_group_ring_of_sends(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    """Each rank sends to the next and receives from the previous, inside group_start/group_end."""
    n = 5
    comms = make_comms(n)
    streams = [c.new_stream() for c in comms]
    got = [np.empty(BIG, np.float32) for _ in range(n)]
    for r, c in enumerate(comms):
        c.group_start()
        c.send(np.full(BIG, r, np.float32), (r + 1) % n, streams[r])
        c.recv(got[r], (r - 1) % n, streams[r])
        c.group_end()
    for r in range(n):
        assert streams[r].synchronize(30) and comms[r].async_error() is None
        assert (got[r] == (r - 1) % n).all()


def test_group_with_collectives_nested_and_two_streams(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    """Collectives and p2p in one (nested) group, the sends on one stream and
    the receives on another: the group runs as one and both streams wait for it."""
    n = 3
    comms = make_comms(n)
    s1 = [c.new_stream() for c in comms]
    s2 = [c.new_stream() for c in comms]
    sums = [np.full(10, r + 1, np.int64) for r in range(n)]
    bcast = [np.full(7, 50 if r == 2 else -1, np.int16) for r in range(n)]
    got = [np.empty(BIG // 2, np.int32) for _ in range(n)]
    for r, c in enumerate(comms):
        c.group_start()
        c.all_reduce(sums[r], sums[r], SUM, s1[r])
        c.group_start()
        c.broadcast(bcast[r], bcast[r], 2, s2[r])
        c.send(np.full(BIG // 2, r, np.int32), (r + 1) % n, s1[r])
        c.group_end()
        c.recv(got[r], (r - 1) % n, s2[r])
        c.group_end()
    after = [s.record() for s in s2]
    for r in range(n):
        assert after[r].synchronize(30) and s1[r].synchronize(30) and comms[r].async_error() is None
        assert (sums[r] == 6).all() and (bcast[r] == 50).all() and (got[r] == (r - 1) % n).all()


def test_p2p_messages_arrive_in_order(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    a, b = make_comms(2)
    sa, sb = a.new_stream(), b.new_stream()
    outs = [np.full(100 + i, i, np.int32) for i in range(5)]
    ins = [np.empty(100 + i, np.int32) for i in range(5)]
    for i in range(5):
        a.send(outs[i], 1, sa)
    for i in range(5):
        b.recv(ins[i], 0, sb)
    assert sa.synchronize(10) and sb.synchronize(10)
    assert [x[0] for x in ins] == list(range(5)) and all((x == x[0]).all() for x in ins)


# --- streams and events ------------------------------------------------------------------------


def test_enqueue_returns_at_once_while_the_peer_is_absent(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0, s1 = c0.new_stream(), c1.new_stream()
    x0, x1 = np.ones(4 * BIG, np.float32), np.full(4 * BIG, 2, np.float32)
    returns_within(2.0, lambda: c0.all_reduce(x0, x0, SUM, s0))  # rank 1 has issued nothing yet
    ev = s0.record()
    assert not ev.query() and not s0.query()
    assert ev.synchronize(0.2) is False  # it waits for rank 1
    c1.all_reduce(x1, x1, SUM, s1)
    assert ev.synchronize(30) and s1.synchronize(30)
    assert s0.query() and (x0 == 3).all() and (x1 == 3).all()


def test_stream_runs_in_order(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0, s1 = c0.new_stream(), c1.new_stream()
    x0, x1 = np.ones(1000, np.int64), np.ones(1000, np.int64)
    c0.all_reduce(x0, x0, SUM, s0)
    e1 = s0.record()
    c0.all_reduce(x0, x0, SUM, s0)
    e2 = s0.record()
    assert not e1.query() and not e2.query()
    c1.all_reduce(x1, x1, SUM, s1)  # rank 1 joins the first only
    assert e1.synchronize(10)
    assert not e2.synchronize(0.1)  # the second still waits for rank 1
    assert (x0 == 2).all()
    c1.all_reduce(x1, x1, SUM, s1)
    assert e2.synchronize(10) and s1.synchronize(10)
    assert (x0 == 4).all() and e1.time_ns <= e2.time_ns
    # many dependent ops: each runs once, in order
    for _ in range(40):
        c0.all_reduce(x0, x0, SUM, s0)
        c1.all_reduce(x1, x1, SUM, s1)
    assert s0.synchronize(30) and s1.synchronize(30)
    assert (x0 == 4 << 40).all() and (x1 == 4 << 40).all()


def test_event_query_never_blocks(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0, s1 = c0.new_stream(), c1.new_stream()
    assert HostEvent().query() and c0.new_event().query()  # never recorded: complete, as in CUDA
    x0, x1 = np.ones(10), np.ones(10)
    c0.all_reduce(x0, x0, SUM, s0)
    ev = s0.record()
    t0 = time.monotonic()
    answers = {ev.query() for _ in range(1000)}
    assert answers == {False} and time.monotonic() - t0 < 0.5
    c1.all_reduce(x1, x1, SUM, s1)
    assert ev.synchronize(10) and ev.query()
    # an event recorded again is pending again, then complete
    c0.all_reduce(x0, x0, SUM, s0)
    assert s0.record(ev) is ev and not ev.query()
    c1.all_reduce(x1, x1, SUM, s1)
    assert ev.synchronize(10)


def test_synchronize_times_out_while_a_peer_has_not_joined() -> None:
    """Rank 1 does not exist yet: rank 0's nonblocking init and collective wait for it, boundedly."""
    store, name = HashStore(), unique()
    cfg = CommConfig(blocking=False, timeout=20)
    c0 = HostCommunicator.create(PrefixStore(name, store), 2, 0, cfg)
    try:
        s0 = c0.new_stream()
        x0 = np.ones(10, np.float32)
        c0.all_reduce(x0, x0, SUM, s0)
        ev = s0.record()
        t0 = time.monotonic()
        assert ev.synchronize(0.3) is False and s0.synchronize(0.05) is False
        assert 0.3 <= time.monotonic() - t0 < 2.0
        c1 = HostCommunicator.create(PrefixStore(name, store), 2, 1, cfg)
        try:
            s1 = c1.new_stream()
            x1 = np.ones(10, np.float32)
            c1.all_reduce(x1, x1, SUM, s1)
            assert ev.synchronize(10) and s1.synchronize(10) and (x0 == 2).all()
        finally:
            c1.destroy()
    finally:
        c0.destroy()


def test_elapsed_ms(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0, s1 = c0.new_stream(), c1.new_stream()
    x0, x1 = np.ones(10), np.ones(10)
    t_before = time.perf_counter_ns()
    start = s0.record()
    c0.all_reduce(x0, x0, SUM, s0)
    end = s0.record()
    assert start.synchronize(10)
    with pytest.raises(RuntimeError, match="complete"):
        start.elapsed_ms(end)  # end is still pending
    assert not end.synchronize(0.2)  # at least 200 ms pass between start and end
    c1.all_reduce(x1, x1, SUM, s1)
    assert end.synchronize(10)
    wall_ms = (time.perf_counter_ns() - t_before) / 1e6
    ms = start.elapsed_ms(end)
    assert 199 <= ms <= wall_ms
    assert end.elapsed_ms(start) == pytest.approx(-ms)
    with pytest.raises(TypeError):
        start.elapsed_ms(object())  # type: ignore[arg-type]


def test_wait_event_orders_streams(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    """Stream B (of a one-rank communicator, whose ops need no peer) waits for
    an event of stream A; its copy sees A's result."""
    c0, c1 = make_comms(2)
    (solo,) = make_comms(1)
    a0, a1 = c0.new_stream(), c1.new_stream()
    b = solo.new_stream()
    x0, x1 = np.ones(1000, np.float32), np.ones(1000, np.float32)
    y = np.zeros(1000, np.float32)
    c0.all_reduce(x0, x0, SUM, a0)
    ev_a = a0.record()
    b.wait_event(ev_a)
    solo.broadcast(x0, y, 0, b)  # a copy of x0, once A is done
    ev_b = b.record()
    assert not ev_b.synchronize(0.2)  # held back by A, which waits for rank 1
    c1.all_reduce(x1, x1, SUM, a1)
    assert ev_b.synchronize(10)
    assert (y == 2).all() and ev_a.time_ns <= ev_b.time_ns
    # two streams of one communicator ordered by an event
    c0b, c1b = c0.new_stream(), c1.new_stream()
    for c, sa, sb, x in ((c0, a0, c0b, x0), (c1, a1, c1b, x1)):
        c.all_reduce(x, x, SUM, sa)
        sb.wait_event(sa.record())
        c.all_reduce(x, x, SUM, sb)
    assert all(s.synchronize(10) for s in (a0, a1, c0b, c1b))
    assert (x0 == 8).all() and (x1 == 8).all()


def test_finalize_flushes_and_times_out(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0, s1 = c0.new_stream(), c1.new_stream()
    x0, x1 = np.ones(10), np.ones(10)
    c0.all_reduce(x0, x0, SUM, s0)
    c1.all_reduce(x1, x1, SUM, s1)
    parallel(2, lambda r: (c0, c1)[r].finalize(10))
    assert (x0 == 2).all() and (x1 == 2).all()
    c0.all_reduce(x0, x0, SUM, s0)  # rank 1 never joins
    t0 = time.monotonic()
    with pytest.raises(DistBackendError, match="timeout"):
        c0.finalize(0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0


def test_destroy_with_pending_ops_and_use_after(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0 = c0.new_stream()
    x = np.ones(BIG, np.float32)
    c0.all_reduce(x, x, SUM, s0)  # never matched
    c0.recv(x, 1, s0)
    ev = s0.record()
    returns_within(2.0, c0.destroy)
    assert ev.synchronize(2)
    assert c0.state is CommState.DESTROYED
    with pytest.raises(DistBackendError, match="destroyed"):
        c0.all_reduce(x, x, SUM, s0)
    c0.destroy()  # idempotent
    # the peer sees the connection end
    s1 = c1.new_stream()
    c1.all_reduce(x, x, SUM, s1)
    assert s1.synchronize(5)
    assert isinstance(c1.async_error(), DistBackendError) and "rank 0" in str(c1.async_error())


def test_abort_unblocks_a_stream_waiting_on_an_event(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    """A stream held by wait_event on an event that will never complete drains after abort."""
    c0, c1 = make_comms(2)
    (solo,) = make_comms(1)
    s0, sb = c0.new_stream(), solo.new_stream()
    x = np.ones(10)
    c0.all_reduce(x, x, SUM, s0)  # never matched
    sb.wait_event(s0.record())
    solo.all_reduce(x, x, SUM, sb)
    ev = sb.record()
    assert not ev.synchronize(0.1)
    t0 = time.monotonic()
    solo.abort()
    assert ev.synchronize(1.0) and time.monotonic() - t0 < 1.0
    assert solo.state is CommState.ABORTED and "aborted" in str(solo.async_error())
    c0.abort()
    assert s0.synchronize(1.0)


def test_abort_from_another_thread_unblocks_recv(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s1 = c1.new_stream()
    buf = np.zeros(BIG, np.float32)
    c1.recv(buf, 0, s1)  # rank 0 never sends
    ev = s1.record()
    assert not ev.synchronize(0.2)
    t0 = time.monotonic()
    aborter = threading.Thread(target=c1.abort)
    aborter.start()
    assert ev.synchronize(1.0) and time.monotonic() - t0 < 1.0
    aborter.join(1.0)
    assert c1.state is CommState.ABORTED
    with pytest.raises(DistBackendError, match="aborted"):
        c1.recv(buf, 0, s1)
    with pytest.raises(DistBackendError, match="aborted"):
        c1.split(0, 0)


# --- nonblocking init ----------------------------------------------------------------------------


def test_nonblocking_init_ops_before_ready() -> None:
    """create returns at once (INITIALIZING while peers are missing); ops
    issued before READY run after init."""
    n, store, name = 3, HashStore(), unique()
    cfg = CommConfig(blocking=False, timeout=20)
    comms: list[HostCommunicator] = []
    try:
        c0 = returns_within(1.0, lambda: HostCommunicator.create(PrefixStore(name, store), n, 0, cfg))
        comms.append(c0)
        assert c0.state is CommState.INITIALIZING
        s0 = c0.new_stream()
        x0 = np.full(100_000, 1, np.int64)
        returns_within(1.0, lambda: c0.all_reduce(x0, x0, SUM, s0))
        ev = s0.record()
        assert not ev.synchronize(0.1) and c0.state is CommState.INITIALIZING
        with pytest.raises(DistBackendError, match="timeout"):
            c0.wait_ready(0.05)
        for r in (1, 2):
            comms.append(HostCommunicator.create(PrefixStore(name, store), n, r, cfg))
        xs = [x0] + [np.full(100_000, r + 1, np.int64) for r in (1, 2)]
        streams = [s0] + [c.new_stream() for c in comms[1:]]
        for r in (1, 2):
            comms[r].all_reduce(xs[r], xs[r], SUM, streams[r])
        for c, s, x in zip(comms, streams, xs, strict=True):
            c.wait_ready(20)
            assert c.state is CommState.READY and s.synchronize(20) and (x == 6).all()
    finally:
        destroy_all(comms)


def test_nonblocking_init_timeout_names_missing_ranks() -> None:
    """Rank 1 of 3 never comes: ranks 0 and 2 reach ERROR with a "timeout"
    DistBackendError naming rank 1, at the deadline."""
    store, name, timeout = HashStore(), unique(), 1.0
    cfg = CommConfig(blocking=False, timeout=timeout)
    t0 = time.monotonic()
    comms = {r: HostCommunicator.create(PrefixStore(name, store), 3, r, cfg) for r in (0, 2)}
    try:
        streams = {r: c.new_stream() for r, c in comms.items()}
        for r, c in comms.items():
            c.all_reduce(np.ones(4), np.ones(4), SUM, streams[r])  # enqueued before the failure
        for r, c in comms.items():
            with pytest.raises(DistBackendError, match="timeout") as info:
                c.wait_ready(timeout + 5)
            elapsed = time.monotonic() - t0
            assert timeout * 0.9 <= elapsed < timeout + 1.5, elapsed
            assert c.state is CommState.ERROR and c.async_error() is info.value
            assert "1" in str(info.value)
            assert streams[r].synchronize(timeout + 5)  # the pending op is dropped; the stream drains
            with pytest.raises(DistBackendError, match="timeout"):
                c.all_reduce(np.ones(4), np.ones(4), SUM, streams[r])
        assert "[1]" in str(comms[2].async_error())  # rank 2 knows exactly who is missing
    finally:
        destroy_all(list(comms.values()))


def test_blocking_init_timeout_raises() -> None:
    t0 = time.monotonic()
    with pytest.raises(DistBackendError, match=r"timeout.*\[1\]"):
        HostCommunicator.create(PrefixStore("x", HashStore()), 2, 0, CommConfig(timeout=0.5))
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(DistBackendError, match=r"timeout.*\[0\]"):
        HostCommunicator.create(PrefixStore("y", HashStore()), 2, 1, CommConfig(timeout=0.5))


def test_abort_during_nonblocking_init_threads() -> None:
    """Abort while the other ranks never came: waiters are released at once
    and the init thread ends too (it must not wait for the missing ranks'
    addresses after the abort woke the rendezvous)."""
    before = set(threading.enumerate())
    for n, rank in ((2, 0), (3, 2)):
        c = HostCommunicator.create(PrefixStore(unique(), HashStore()), n, rank,
                                    CommConfig(blocking=False, timeout=30))
        s = c.new_stream()
        c.all_reduce(np.ones(3), np.ones(3), SUM, s)
        returns_within(1.0, c.abort)
        with pytest.raises(DistBackendError, match="aborted"):
            returns_within(1.0, lambda c=c: c.wait_ready(1.0))
        assert c.state is CommState.ABORTED and s.synchronize(1.0)
        returns_within(2.0, c.destroy)
    for t in set(threading.enumerate()) - before:
        if t.name.startswith("nccl_pg-init"):
            t.join(2.0)
            assert not t.is_alive(), f"{t.name} still running after abort"


# --- diagnostics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("op1, op2, size", [("all_reduce", "broadcast", 10), ("reduce", "all_reduce", 300_000),
                                            ("all_gather", "send/recv", 1000)])
def test_mismatched_ops_are_named(make_comms: Callable[..., list[HostCommunicator]], op1: str, op2: str,
                                  size: int) -> None:
    """Rank 0 and rank 1 issue different collectives: an error naming both, no hang."""
    comms = make_comms(2)
    streams = [c.new_stream() for c in comms]
    for r, (c, op) in enumerate(zip(comms, (op1, op2), strict=True)):
        x = np.ones(size, np.float32)
        if op == "all_reduce":
            c.all_reduce(x, x, SUM, streams[r])
        elif op == "broadcast":
            c.broadcast(x, x, 0, streams[r])
        elif op == "reduce":
            c.reduce(x, x, SUM, 0, streams[r])
        elif op == "all_gather":
            c.all_gather(x, np.ones(2 * size, np.float32), streams[r])
        else:
            c.group_start()
            c.send(x, 1 - r, streams[r])
            c.recv(x, 1 - r, streams[r])
            c.group_end()
    for s in streams:
        assert s.synchronize(10), "a mismatch must not hang"
    errors = [str(c.async_error()) for c in comms]
    assert any(op1 in e and op2 in e for e in errors), errors
    for c, s in zip(comms, streams, strict=True):  # every rank ends up failed, none hangs
        try:
            c.all_reduce(np.ones(4), np.ones(4), SUM, s)
        except DistBackendError:
            pass
        assert s.synchronize(10) and isinstance(c.async_error(), DistBackendError)


@pytest.mark.parametrize("sizes", [(10, 12), (400_000, 400_008)])
def test_mismatched_sizes_are_named(make_comms: Callable[..., list[HostCommunicator]], sizes: tuple[int, int]) -> None:
    comms = make_comms(2)
    streams = [c.new_stream() for c in comms]
    for c, s, size in zip(comms, streams, sizes, strict=True):
        x = np.ones(size, np.float32)
        c.all_reduce(x, x, SUM, s)
    for s in streams:
        assert s.synchronize(10), "a mismatch must not hang"
    errors = [str(c.async_error()) for c in comms]
    assert any("sizes differ" in e for e in errors), errors
    if sizes[0] < 100:
        assert any("40" in e and "48" in e for e in errors), errors  # the byte counts of both sides


@pytest.mark.parametrize("field, size", [("dtype", 10), ("dtype", 300_000), ("op", 10), ("op", 300_000),
                                         ("root", 300_000)])
def test_mismatched_dtype_op_and_root_fail_every_rank_naming_both_values(
        make_comms: Callable[..., list[HostCommunicator]], field: str, size: int) -> None:
    """Ranks agree on the operation and the byte count but not on its dtype
    (float32 vs int32), its reduction (SUM vs MAX) or its root: before, the
    result was silently wrong. Now every rank fails, within a second, with a
    message naming both ranks' values (the ranks that did not read the
    mismatch themselves learn it from the goodbye of one that did)."""
    n = 3 if field == "root" else 2
    comms = make_comms(n)
    streams = [c.new_stream() for c in comms]
    values = {"dtype": ("float32", "int32"), "op": ("SUM", "MAX"), "root": ("root 0", "root 1")}[field]
    t0 = time.monotonic()
    for r, (c, s) in enumerate(zip(comms, streams, strict=True)):
        odd = r == n - 1
        if field == "root":  # a large reduce: a ring through every rank, then the root collects
            x = np.ones(size, np.float32)
            c.reduce(x, x, SUM, 1 if odd else 0, s)
        else:
            x = np.ones(size, np.int32 if field == "dtype" and odd else np.float32)
            c.all_reduce(x, x, ReduceOp.MAX if field == "op" and odd else SUM, s)
    for c, s in zip(comms, streams, strict=True):
        assert s.synchronize(10), "a mismatch must not hang"
        error = str(c.async_error())
        assert all(v in error for v in values), error
    assert time.monotonic() - t0 < 1.0


# --- misc -----------------------------------------------------------------------------------------


def test_new_stream_and_repr(worlds: Callable[[int], ThreadWorld]) -> None:
    w = worlds(1)
    s = w.comms[0].new_stream(high_priority=True)
    assert isinstance(s, HostStream) and s.query() and s.synchronize(1)
    assert "rank 0/1" in repr(w.comms[0])

"""Rooted collectives whose ranks disagree on the root, the size or the dtype
are detected in the operation that has them, on the host backend, with no
extra round trip (issue 25 item 10): every rank whose call disagrees with a
peer it depends on raises a DistBackendError naming both values, no rank
hangs, and a rank that completes holds exactly the data of the root it named
(never a silent wrong result, never an error only at the next operation).

Before: a root only sent and a non-root of gather/reduce only sent, so two
ranks that each took themselves for the root of a broadcast both completed,
each keeping its own data; a broadcast of 3 MiB into 2 MiB completed with
the first 2 MiB; the error came at the next operation, or never. Ranks are
threads of this process over real sockets (make_comms)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from nccl_pg.comm.host import HostCommunicator
from nccl_pg.reduce_op import ReduceOp

pytestmark = pytest.mark.timeout(60)

SUM = ReduceOp.SUM
SMALL, LARGE = 16, 3 * 2**18  # float32 elements: one message; 3 MiB (chunked, the chain or the tree)
HUGE = 2**23  # 32 MiB: more than the socket buffers hold, so a send nobody reads blocks
BOUND = 5.0  # seconds for every stream to end (a hang would last until the test's timeout)

Issue = Callable[[HostCommunicator, int, object], np.ndarray | None]


def run(make_comms: Callable[..., list[HostCommunicator]], n: int, issue: Issue) -> list[tuple[str | None, object]]:
    """Each rank issues its collective; (its error or None, its output) per rank, once every stream ended."""
    comms = make_comms(n)
    streams = [c.new_stream() for c in comms]
    outs = [issue(c, r, s) for r, (c, s) in enumerate(zip(comms, streams, strict=True))]
    t0 = time.monotonic()
    for r, s in enumerate(streams):
        assert s.synchronize(BOUND), f"rank {r} hangs"
    assert time.monotonic() - t0 < BOUND
    return [(None if c.async_error() is None else str(c.async_error()), out)
            for c, out in zip(comms, outs, strict=True)]


def data(r: int, size: int) -> np.ndarray:
    return np.full(size, 10.0 + r, np.float32)


def broadcast(roots: list[int], sizes: list[int] | int = SMALL) -> Issue:
    def issue(c: HostCommunicator, r: int, s: object) -> np.ndarray:
        x = data(r, sizes if isinstance(sizes, int) else sizes[r])
        c.broadcast(x, x, roots[r], s)  # type: ignore[arg-type]
        return x
    return issue


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["small", "chunked"])
def test_two_ranks_that_each_take_themselves_for_the_root(make_comms: Callable, size: int) -> None:
    """Before: both completed, each keeping its own data."""
    for error, _ in run(make_comms, 2, broadcast([0, 1], size)):
        assert error is not None and "root 0" in error and "root 1" in error, error


@pytest.mark.parametrize("roots", [[0, 0, 1], [0, 0, 2, 2], [1, 0, 0], [2, 2, 0]])
@pytest.mark.parametrize("size", [SMALL, LARGE, HUGE], ids=["small", "chunked", "beyond-buffers"])
def test_disagreeing_roots_never_hang_or_complete_with_another_roots_data(
        make_comms: Callable, roots: list[int], size: int) -> None:
    """Three or four ranks, some naming another root (in [0, 0, 1] and
    [1, 0, 0] a rank names one that does not take itself for the root): no
    rank hangs; a rank that completes holds its named root's data, and that
    root agreed with it; every rank whose root does not take itself for the
    root fails (its data cannot come), and so does every rank that takes
    itself for the root; the disagreement is named, with both roots. (A
    rank that agreed with its root may also fail, as a consequence: its
    root failed.)"""
    results = run(make_comms, len(roots), broadcast(roots, size))
    for r, (error, out) in enumerate(results):
        root = roots[r]
        if error is None:
            assert roots[root] == root, f"rank {r} completed although its root {root} named {roots[root]}"
            assert isinstance(out, np.ndarray) and (out == 10.0 + root).all(), (r, out)
        if roots[root] != root or (root == r and len(set(roots)) > 1):
            assert error is not None, f"rank {r} (root {root}, which named {roots[root]}) completed"
    named = [e for e, _ in results if e is not None and "ranks disagree on its root" in e]
    assert named, [e for e, _ in results]
    for error in named:
        assert sum(f"root {r}" in error for r in set(roots)) == 2, error


@pytest.mark.parametrize("sizes", [[3 * 2**18, 2 * 2**18], [SMALL, SMALL + 1], [2 * 2**18, 3 * 2**18]],
                         ids=["3MiB-into-2MiB", "small", "2MiB-into-3MiB"])
def test_broadcast_of_another_size_fails_on_both_sides(make_comms: Callable, sizes: list[int]) -> None:
    """Before: 3 MiB broadcast into 2 MiB completed on both ranks (the
    receiver got the first two chunks, the root never heard of it)."""
    for error, _ in run(make_comms, 2, broadcast([0, 0], sizes)):
        assert error is not None and "sizes differ" in error, error
        assert str(sizes[0] * 4) in error and str(sizes[1] * 4) in error, error


def test_broadcast_of_another_dtype_fails_on_the_root_too(make_comms: Callable) -> None:
    """Before: the receiver failed, the root completed."""
    def issue(c: HostCommunicator, r: int, s: object) -> np.ndarray:
        x = np.ones(SMALL, np.float32 if r == 0 else np.int32)
        c.broadcast(x, x, 0, s)  # type: ignore[arg-type]
        return x

    for error, _ in run(make_comms, 2, issue):
        assert error is not None and "float32" in error and "int32" in error, error


@pytest.mark.parametrize("op", ["gather", "scatter", "reduce"])
def test_gather_scatter_reduce_with_two_roots(make_comms: Callable, op: str) -> None:
    """Each rank names itself the root. Before: gather and reduce (each
    root only receives... from a rank that only sends) hung, scatter
    completed with each rank's own block."""
    def issue(c: HostCommunicator, r: int, s: object) -> None:
        if op == "gather":
            c.gather(data(r, SMALL), np.zeros(2 * SMALL, np.float32), r, s)  # type: ignore[arg-type]
        elif op == "scatter":
            c.scatter(data(r, 2 * SMALL), np.zeros(SMALL, np.float32), r, s)  # type: ignore[arg-type]
        else:
            c.reduce(data(r, SMALL), np.zeros(SMALL, np.float32), SUM, r, s)  # type: ignore[arg-type]

    for error, _ in run(make_comms, 2, issue):
        assert error is not None and "root 0" in error and "root 1" in error, error


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_gather_and_scatter_of_another_size(make_comms: Callable, op: str) -> None:
    def issue(c: HostCommunicator, r: int, s: object) -> None:
        size = SMALL + r
        if op == "gather":
            c.gather(data(r, size), np.zeros(2 * size, np.float32), 0, s)  # type: ignore[arg-type]
        else:
            c.scatter(data(r, 2 * size), np.zeros(size, np.float32), 0, s)  # type: ignore[arg-type]

    for error, _ in run(make_comms, 2, issue):
        assert error is not None and "sizes differ" in error, error


def test_agreeing_rooted_collectives_still_work_back_to_back(make_comms: Callable) -> None:
    """The checks cost no correctness: every root, every rooted op, small and
    chunked, back to back on one stream (a fast rank's next operation
    arrives while a slow one is still in the previous)."""
    n = 3
    comms = make_comms(n)
    streams = [c.new_stream() for c in comms]
    outs: list[list[np.ndarray]] = [[] for _ in range(n)]
    for root in range(n):
        for size in (SMALL, LARGE):
            for r, (c, s) in enumerate(zip(comms, streams, strict=True)):
                x = data(r, size)
                c.broadcast(x, x, root, s)
                g = np.zeros(n * size, np.float32) if r == root else None
                c.gather(data(r, size), g, root, s)
                y = np.zeros(size, np.float32)
                c.scatter(np.concatenate([data(p, size) for p in range(n)]) if r == root else None, y, root, s)
                z = np.zeros(size, np.float32) if r == root else None
                c.reduce(data(r, size), z, SUM, root, s)
                outs[r].append(x)
                outs[r].extend(a for a in (g, y, z) if a is not None)
    for r, s in enumerate(streams):
        assert s.synchronize(30), r
        assert comms[r].async_error() is None, comms[r].async_error()
    for r in range(n):
        k = 0
        for root in range(n):
            for size in (SMALL, LARGE):
                assert (outs[r][k] == 10.0 + root).all()
                k += 1
                if r == root:
                    assert (outs[r][k] == np.concatenate([data(p, size) for p in range(n)])).all()
                    k += 1
                assert (outs[r][k] == 10.0 + r).all()
                k += 1
                if r == root:
                    assert (outs[r][k] == sum(10.0 + p for p in range(n))).all()
                    k += 1

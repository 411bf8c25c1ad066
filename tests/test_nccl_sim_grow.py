"""The NCCL backend's grow (issue 26: the Communicator contract's
get_unique_id, grow and Backend.join_grow over ncclCommGetUniqueId and
ncclCommGrow), on the simulation through the real nccl4py binding; ranks are
threads of this test. What tests/test_grow.py checks on the host backend,
with NCCL's rules (tests/simnccl/nccl_grow.py cites them), under both
NCCL_PG_NCCL_OPS variants. It proves our logic against NCCL's sources as the
simulation reads them, never GPU behaviour."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import simnccl
from harness.sim_threads import DEVICE
from harness.threads import on_threads

from nccl_pg import DistBackendError, ReduceOp
from nccl_pg.comm.base import CommConfig, CommState
from nccl_pg.comm.nccl import NcclCommunicator
from nccl_pg.comm.nccl.backend import NCCL
from nccl_pg.store import HashStore, PrefixStore

pytestmark = [pytest.mark.simnccl, pytest.mark.timeout(90), pytest.mark.usefixtures("simnccl_installed")]
CFG = CommConfig(timeout=10)


@pytest.fixture(params=["nonblocking"])
def variant(request, monkeypatch):
    """The variants that grow natively: the blocking one refuses (test_the_blocking_variant_refuses_to_grow)."""
    monkeypatch.setenv("NCCL_PG_NCCL_OPS", request.param)
    return request.param


@pytest.fixture(autouse=True)
def _clean():
    simnccl.select_device(DEVICE)
    simnccl.clear()
    live = simnccl.live_communicators()
    yield
    assert simnccl.violations() == [], simnccl.violations()
    assert simnccl.live_communicators() == live, "communicators left"
    simnccl.clear()


def _run(fns: list[Callable[[], Any]], timeout: float = 30) -> list[Any]:
    """Each function on a thread of its own (a rank, on simulated GPU DEVICE); results or exceptions, in order."""
    return on_threads(fns, timeout, setup=lambda: simnccl.select_device(DEVICE))


def _comms(n: int, cfg: CommConfig = CFG) -> list[NcclCommunicator]:
    store = PrefixStore(f"c{time.monotonic_ns()}", HashStore())
    out = _run([lambda r=r: NcclCommunicator.create(store, n, r, cfg, device=DEVICE) for r in range(n)])
    assert all(isinstance(c, NcclCommunicator) for c in out), out
    return out


def _grow(old: list[Any], joiners: list[int], size: int, coordinator: int = 0, pass_id: bool = False,
          cfg: CommConfig = CFG) -> list[Any]:
    uid = old[coordinator].get_unique_id()
    fns = [lambda c=c: c.grow(size, uid if (pass_id and c.rank == coordinator) else None, cfg) for c in old]
    fns += [lambda r=r: NCCL.join_grow(None, uid, size, r, cfg, DEVICE) for r in joiners]
    return _run(fns)


def _sum(comm: Any) -> float:
    from simnccl import xp

    s = comm.new_stream()
    a = xp.full(4, comm.rank + 1.0, dtype=np.float32)
    b = xp.zeros(4, dtype=np.float32)
    NCCL.wait_for_caller(s, DEVICE)
    comm.all_reduce(NCCL.flat(a, "a"), NCCL.flat(b, "b"), ReduceOp.SUM, s)
    assert s.synchronize(10)
    assert comm.async_error() is None
    return float(b.get()[0])


def _destroy(*comms: Any) -> None:
    for c in comms:
        if isinstance(c, NcclCommunicator):
            c.destroy()


@pytest.mark.parametrize(("coordinator", "pass_id"), [(0, False), (1, True), (2, False)],
                         ids=["rank0-none", "middle-passes-id", "last-none"])
def test_grow_keeps_ranks_and_adds_new_ones(variant, coordinator, pass_id):
    """3 ranks grow to 5: existing ranks keep 0..2, new ones are 3 and 4, an all_reduce sums over the five; the
    parents are destroyed after the grow (finalized: they are healthy)."""
    old = _comms(3)
    grown = _grow(old, [3, 4], 5, coordinator, pass_id)
    assert all(isinstance(g, NcclCommunicator) for g in grown), grown
    assert [(g.rank, g.nranks, g.state) for g in grown] == [(r, 5, CommState.READY) for r in range(5)]
    assert _run([lambda g=g: _sum(g) for g in grown]) == [15.0] * 5
    mark = len(simnccl.call_log())
    _destroy(*old)
    assert "ncclCommAbort" not in [c for c, _ in simnccl.call_log()[mark:]]
    _destroy(*grown)


def test_a_single_rank_grows_and_the_grown_one_again(variant):
    """One rank grows to 2 (NCCL needs the coordinator's id there: the backend passes the id it holds, given or
    not), then that communicator to 3; each grow needs a fresh id."""
    (solo,) = _comms(1)
    two = _grow([solo], [1], 2)
    three = _grow(two, [2], 3)
    assert _run([lambda g=g: _sum(g) for g in three]) == [6.0] * 3
    _destroy(solo, *two, *three)


def test_grow_ids_are_single_use(variant):
    """A second id before a grow used the first is refused here (NCCL would hang on it); an id whose grow
    completed is refused to a late joiner by NCCL (its root closed: ncclSystemError)."""
    old = _comms(2)
    uid = old[0].get_unique_id()
    with pytest.raises(DistBackendError, match="already holds a grow id"):
        old[0].get_unique_id()
    grown = _run([lambda c=c: c.grow(3, None, CFG) for c in old] + [lambda: NCCL.join_grow(None, uid, 3, 2, CFG,
                                                                                           DEVICE)])
    assert all(isinstance(g, NcclCommunicator) for g in grown), grown
    with pytest.raises(DistBackendError, match="system error"):
        NCCL.join_grow(None, uid, 3, 2, CFG, DEVICE)
    assert old[0].get_unique_id() != uid  # the first was used: a new one may be made
    _destroy(*old, *grown)


def test_grow_argument_checks(variant):
    old = _comms(2)
    uid = old[0].get_unique_id()
    with pytest.raises(ValueError, match="larger than this communicator's 2 ranks"):
        old[0].grow(2)
    for rank in (0, 4, -1):
        with pytest.raises(ValueError, match="out of range for a grown communicator of 4 ranks"):
            NCCL.join_grow(None, uid, 4, rank, CFG, DEVICE)
    with pytest.raises(ValueError, match="a grow id is the 128 bytes"):
        NCCL.join_grow(None, b"x" * 16, 3, 2, CFG, DEVICE)
    with pytest.raises(DistBackendError, match="only the coordinator passes its own id"):
        old[1].grow(3, uid)  # rank 1 did not make it
    with pytest.raises(DistBackendError, match="only the coordinator passes its own id"):
        old[0].grow(3, b"\0" * 128)
    old[1].abort()
    with pytest.raises(DistBackendError, match="needs a ready communicator"):
        old[1].grow(3)
    old[0].revoke()
    with pytest.raises(DistBackendError, match="needs a ready communicator; on rank 0 it is revoked"):
        old[0].grow(3)  # comms.rst: a revoked communicator is safe for destroy, split and shrink only
    _destroy(*old)


def test_a_nonblocking_grow_returns_at_once_and_is_polled(variant):
    """config.blocking=False: grow and join_grow return INITIALIZING; wait_ready polls the new communicator out
    of ncclInProgress (communicators.rst, "Growing a communicator", step 4)."""
    cfg = CommConfig(timeout=10, blocking=False)
    old = _comms(2)
    grown = _grow(old, [2], 3, cfg=cfg)
    assert all(isinstance(g, NcclCommunicator) for g in grown), grown
    for g in grown:
        g.wait_ready(15)
    assert [(g.rank, g.state) for g in grown] == [(r, CommState.READY) for r in range(3)]
    assert _run([lambda g=g: _sum(g) for g in grown]) == [6.0] * 3
    _destroy(*old, *grown)


@pytest.mark.parametrize("missing", ["new-rank", "member"])
def test_a_rank_that_never_comes_fails_the_grow_by_its_deadline(variant, missing):
    """The grow waits (polled) for a rank that never joins (a new one, or a member that died in between): at the
    deadline it fails, its parent aborted first. With a member missing, the last member's part of NCCL's job
    waits on the parent's bootstrap, which only the parent's abort flag stops: aborting the new communicator
    alone would join a job that never ends (the simulation would record it)."""
    old = _comms(3 if missing == "member" else 2)
    old[0].get_unique_id()
    growing = [c for c in old if not (missing == "member" and c.rank == 1)]
    t0 = time.monotonic()
    out = _run([lambda c=c: c.grow(len(old) + 1, None, CommConfig(timeout=1.5)) for c in growing])
    took = time.monotonic() - t0
    assert all(isinstance(e, DistBackendError) and "timeout" in str(e) and "grow" in str(e) for e in out), out
    assert 1.5 <= took < 8, took
    assert [c.state for c in growing] == [CommState.ABORTED] * len(growing)
    _destroy(*old)


@pytest.mark.parametrize("how", ["blocking-variant", "split-share"])
def test_the_blocking_variant_refuses_to_grow(monkeypatch, how):
    """A grow of a communicator whose split shared its resources reuses its proxy, sized for its own ranks (init.cc
    initTransportsRank; the simulation's rule: test_nccl_sim_rules_2_32, and the grown communicator's first
    collective fails there): the blocking variant's control communicator always shared with its operations one,
    a split_share group's may. The backend refuses, saying why; the group layer grows through a fresh
    communicator (test_nccl_sim_issue36)."""
    monkeypatch.setenv("NCCL_PG_NCCL_OPS", "blocking" if how == "blocking-variant" else "nonblocking")
    cfg = CommConfig(timeout=10, split_share=how == "split-share")
    (c,) = _comms(1, cfg)
    assert not c.supports_grow
    with pytest.raises(DistBackendError, match="would reuse its proxy"):
        c.get_unique_id()
    with pytest.raises(DistBackendError, match="would reuse its proxy"):
        c.grow(2)
    _destroy(c)


def test_grow_needs_nccl_2_29_2(variant):
    """Below 2.29.2 (nccl.h.in declares ncclCommGetUniqueId/ncclCommGrow from v2.29.2-1) the backend says it
    cannot grow, and the calls say why; the group layer then builds a fresh communicator."""
    simnccl.set_version(22809)
    try:
        (c,) = _comms(1)
        assert not c.supports_grow
        with pytest.raises(DistBackendError, match=r"needs NCCL >= 2\.29\.2; this is 2\.28\.9"):
            c.get_unique_id()
        with pytest.raises(DistBackendError, match=r"needs NCCL >= 2\.29\.2"):
            c.grow(2)
        with pytest.raises(DistBackendError, match=r"needs NCCL >= 2\.29\.2"):
            NCCL.join_grow(None, b"\0" * 128, 2, 1, CFG, DEVICE)
        simnccl.set_version(22902)
        (d,) = _comms(1)
        assert d.supports_grow
    finally:
        simnccl.set_version(simnccl.SIM_VERSION)
    _destroy(c, d)

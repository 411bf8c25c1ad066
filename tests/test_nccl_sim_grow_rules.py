"""The simulation's rules for ncclCommGetUniqueId and ncclCommGrow (issue 26),
each on a small case against the NCCL source it cites (v2.30.7-1: init.cc
ncclCommGetUniqueId/ncclCommGrow, bootstrap.cc bcastGrowHandle/bootstrapInit/
bootstrapRoot, nccl.h.in; the user guide's comms.rst and communicators.rst;
the version gate from v2.29.2-1's nccl.h.in). Ranks are communicators of this
process, driven through the real nccl4py binding over the stub libnccl.so.2.
They check that tests/simnccl follows NCCL, not our code; none of this is
evidence of GPU behaviour.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import simnccl
from simnccl import cuda_state, ncclsim

pytestmark = [pytest.mark.simnccl, pytest.mark.timeout(60), pytest.mark.usefixtures("simnccl_installed")]

real: Any = pytest.importorskip("nccl.bindings.nccl")
DEV = 1
IN_PROGRESS, SUCCESS = ncclsim.IN_PROGRESS, ncclsim.SUCCESS


@pytest.fixture(autouse=True)
def _clean():
    simnccl.select_device(DEV)
    simnccl.clear()
    yield
    simnccl.clear()


def _config(blocking: int = 0) -> Any:
    c = real.Config()
    c.blocking = blocking
    return c


def _poll(comm: Any, limit: float = 10.0) -> int:
    deadline = time.monotonic() + limit
    while (code := real.comm_get_async_error(comm)) == IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.001)
    return code


def _parent(n: int) -> list[Any]:
    """A nonblocking communicator of ``n`` ranks, all in this process."""
    uid = real.get_unique_id()
    comms = [real.comm_init_rank_config(n, uid, r, _config()) for r in range(n)]
    assert [_poll(c) for c in comms] == [SUCCESS] * n
    return comms


def _abort(*comms: Any) -> None:
    for c in comms:
        if c is not None and c.handle:
            real.comm_abort(c)


def _status(exc_info: Any) -> int:
    return int(exc_info.value.status)


# --- the version gate: nccl.h.in declares both from v2.29.2-1 (not in v2.28.9-1) ---------------------------

def test_both_exist_from_2_29_2() -> None:
    from nccl.bindings._internal import utils

    parent = _parent(1)
    simnccl.set_version(22809)
    try:
        with pytest.raises(utils.FunctionNotFoundError):
            real.comm_get_unique_id(parent[0])
        with pytest.raises(utils.FunctionNotFoundError):
            real.comm_grow(parent[0], 2, 0, -1, _config())
        simnccl.set_version(22902)
        uid = real.comm_get_unique_id(parent[0])
        grown = [real.comm_grow(parent[0], 2, uid, -1, _config()), real.comm_grow(real.Comm(0), 2, uid, 1, _config())]
        assert [_poll(g) for g in grown] == [SUCCESS, SUCCESS]
    finally:
        simnccl.set_version(simnccl.SIM_VERSION)
    _abort(*grown, *parent)
    assert simnccl.violations() == []


# --- the protocol (init.cc ncclCommGrow; comms.rst, communicators.rst "Growing a communicator") ----------------

@pytest.mark.parametrize("coordinator", [0, 1, 2], ids=["rank0", "middle", "last"])
@pytest.mark.parametrize("passes_id", [True, False], ids=["passes-id", "passes-null"])
def test_existing_ranks_keep_theirs_new_ranks_take_theirs(coordinator: int, passes_id: bool) -> None:
    """Any rank may coordinate; init.cc takes the id or NULL from it (the boundary ranks 0 and N-1 use the handle
    bcastGrowHandle brought them either way, the others need none). ``*newcomm`` is written at once; the new
    communicator is ncclInProgress until every rank, old and new, has joined; existing ranks keep their rank."""
    parent = _parent(3)
    uid = real.comm_get_unique_id(parent[coordinator])
    grown = [real.comm_grow(p, 5, uid if passes_id and r == coordinator else 0, -1, _config())
             for r, p in enumerate(parent)]
    assert all(g.handle for g in grown)
    time.sleep(0.1)
    assert [real.comm_get_async_error(g) for g in grown] == [IN_PROGRESS] * 3  # the new ranks are not there yet
    grown += [real.comm_grow(real.Comm(0), 5, uid, r, _config()) for r in (3, 4)]
    assert [_poll(g) for g in grown] == [SUCCESS] * 5
    assert [real.comm_user_rank(g) for g in grown] == [0, 1, 2, 3, 4]
    assert [real.comm_count(g) for g in grown] == [5] * 5
    log = [(call, d["rank"], d["id"]) for call, d in simnccl.call_log()[-5:]]
    assert log == [("ncclCommGrow", -1, passes_id and r == coordinator) for r in range(3)] + \
        [("ncclCommGrow", 3, True), ("ncclCommGrow", 4, True)]
    _abort(*grown, *parent)
    assert simnccl.violations() == []


def test_a_blocking_grow_runs_inline() -> None:
    """A blocking config: the job runs in the caller's group end (the new communicator ready on return)."""
    parent = _parent(1)
    uid = real.comm_get_unique_id(parent[0])
    new: list[Any] = []
    t = threading.Thread(target=lambda: (simnccl.select_device(DEV),
                                         new.append(real.comm_grow(real.Comm(0), 2, uid, 1, _config(1)))))
    t.start()
    old = real.comm_grow(parent[0], 2, uid, -1, _config(1))
    t.join(10)
    assert real.comm_get_async_error(old) == SUCCESS and real.comm_get_async_error(new[0]) == SUCCESS
    _abort(old, new[0], *parent)


@pytest.mark.parametrize(("who", "nranks", "rank", "with_id"), [
    ("existing", 3, 0, False),   # "existing ranks must pass rank=-1"
    ("existing", 2, -1, False),  # "total ranks %d is less than current ranks"
    ("existing", 0, -1, False),  # "total ranks must be positive"
    ("new", 3, 2, False),        # "new ranks must pass non-NULL uniqueId"
    ("new", 3, -1, True),        # "new ranks must pass valid rank >= 0"
    ("new", 3, 3, True),         # "new rank %d exceeds total ranks"
], ids=["existing-rank-not-minus-1", "not-larger", "no-ranks", "new-without-id", "new-negative", "new-too-large"])
def test_arguments_ncclcommgrow_refuses(who: str, nranks: int, rank: int, with_id: bool) -> None:
    parent = _parent(2)
    uid = real.comm_get_unique_id(parent[0])
    comm = parent[1] if who == "existing" else real.Comm(0)
    with pytest.raises(real.NCCLError) as err:
        real.comm_grow(comm, nranks, uid if with_id else 0, rank, _config())
    assert _status(err) == ncclsim.INVALID_ARGUMENT
    assert real.comm_get_async_error(parent[1]) == SUCCESS  # the parent is left as it was
    _abort(*parent)


def test_nccl_comm_id_set_is_invalid_usage(monkeypatch: pytest.MonkeyPatch) -> None:
    """bootstrap.cc bootstrapGetUniqueId: "ncclCommGetUniqueId should not be called when NCCL_COMM_ID is set"."""
    parent = _parent(1)
    monkeypatch.setenv("NCCL_COMM_ID", "127.0.0.1:1234")
    with pytest.raises(real.NCCLError) as err:
        real.comm_get_unique_id(parent[0])
    assert _status(err) == ncclsim.INVALID_USAGE
    _abort(*parent)


def test_a_one_rank_parent_grows_only_with_its_id() -> None:
    """bcastGrowHandle: "Single rank parent already has the handle" (nothing is sent): the one rank must pass its
    id. With NULL it never checks in with the root and its ring connects to an address it never received
    (ncclSocketInit refuses family 0): its grow fails with ncclInternalError, while the new rank waits at the root
    until it is aborted. (torchcomms passes NULL from every existing rank, hence its "commGrow will fail" for a
    one-rank quorum.)"""
    parent = _parent(1)
    uid = real.comm_get_unique_id(parent[0])
    old = real.comm_grow(parent[0], 2, 0, -1, _config())
    new = real.comm_grow(real.Comm(0), 2, uid, 1, _config())
    assert _poll(old) == ncclsim.INTERNAL
    assert real.comm_get_async_error(new) == IN_PROGRESS
    _abort(new, old)
    uid = real.comm_get_unique_id(parent[0])
    old = real.comm_grow(parent[0], 2, uid, -1, _config())
    new = real.comm_grow(real.Comm(0), 2, uid, 1, _config())
    assert [_poll(old), _poll(new)] == [SUCCESS, SUCCESS]
    _abort(new, old, *parent)
    assert simnccl.violations() == []


def test_an_id_serves_one_grow() -> None:
    """nccl.h.in: "Each UID can only be used once": the root answers one grow and closes its listener, so a rank
    that comes with the id again is refused (ncclSocketConnect gives up: ncclSystemError)."""
    parent = _parent(1)
    uid = real.comm_get_unique_id(parent[0])
    grown = [real.comm_grow(parent[0], 2, uid, -1, _config()), real.comm_grow(real.Comm(0), 2, uid, 1, _config())]
    assert [_poll(g) for g in grown] == [SUCCESS, SUCCESS]
    late = real.comm_grow(real.Comm(0), 2, uid, 1, _config())
    assert _poll(late) == ncclsim.SYSTEM
    _abort(late, *grown, *parent)


def test_a_new_rank_below_the_parents_size_fails() -> None:
    """comms.rst: new ranks "must be >= parent communicator size"; init.cc does not check it, and bootstrapInit
    gives such a rank no root (rootIdFromRank: rank < offset): ncclInternalError."""
    parent = _parent(2)
    uid = real.comm_get_unique_id(parent[0])
    bad = real.comm_grow(real.Comm(0), 3, uid, 1, _config())
    assert _poll(bad) == ncclsim.INTERNAL
    _abort(bad, *parent)


# --- what NCCL does not refuse but would hang on (violations) ---------------------------------------------------

def test_one_id_at_a_time() -> None:
    """nccl.h.in: "Cannot generate a new UID while a previous UID is unconsumed"."""
    parent = _parent(1)
    real.comm_get_unique_id(parent[0])
    assert simnccl.violations() == []
    real.comm_get_unique_id(parent[0])
    assert any("previous grow id is unconsumed" in v for v in simnccl.violations()), simnccl.violations()
    simnccl.clear()
    _abort(*parent)


def test_two_coordinators() -> None:
    """comms.rst: ncclCommGetUniqueId "must be called by only one rank (the coordinator)"."""
    parent = _parent(2)
    uid = real.comm_get_unique_id(parent[0])
    real.comm_get_unique_id(parent[1])
    grown = [real.comm_grow(p, 3, 0, -1, _config()) for p in parent] + [real.comm_grow(real.Comm(0), 3, uid, 2,
                                                                                        _config())]
    assert any("two ncclCommGetUniqueId handles" in v for v in simnccl.violations()), simnccl.violations()
    simnccl.clear()
    _abort(*grown, *parent)


def test_a_boundary_rank_blocks_until_the_coordinators_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """bcastGrowHandle: ranks 0 and N-1 receive the handle in ncclCommGrow itself, in the caller's thread, for a
    nonblocking communicator too: the call returns once the coordinator's ncclCommGetUniqueId sent it. Without it,
    a hang on a GPU: recorded here past the simulation's patience."""
    monkeypatch.setattr(cuda_state, "SYNC_PATIENCE", 0.5)
    parent = _parent(3)
    out: list[Any] = []
    t = threading.Thread(target=lambda: (simnccl.select_device(DEV),
                                         out.append(real.comm_grow(parent[2], 4, 0, -1, _config()))))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not out  # rank N-1 is inside ncclCommGrow, waiting for the handle
    uid = real.comm_get_unique_id(parent[1])
    t.join(10)
    assert out and out[0].handle
    grown = [out[0]] + [real.comm_grow(parent[r], 4, 0, -1, _config()) for r in (0, 1)] + \
        [real.comm_grow(real.Comm(0), 4, uid, 3, _config())]
    assert [_poll(g) for g in grown] == [SUCCESS] * 4
    assert simnccl.violations() == []
    with pytest.raises(real.NCCLError) as err:  # nobody calls ncclCommGetUniqueId: rank 0 waits for good
        real.comm_grow(grown[1], 5, 0, -1, _config())
    assert _status(err) == ncclsim.INTERNAL
    assert any("blocked 0.5 s in bcastGrowHandle" in v for v in simnccl.violations()), simnccl.violations()
    simnccl.clear()
    _abort(*grown, *parent)


def _stuck_grow() -> tuple[list[Any], list[Any]]:
    """A 3-rank parent growing to 4 with its rank 1 missing: rank 2's job (the last existing rank) waits for rank
    1's information on the parent's bootstrap, rank 0's at the root."""
    parent = _parent(3)
    real.comm_get_unique_id(parent[0])
    grown = [real.comm_grow(parent[r], 4, 0, -1, _config()) for r in (0, 2)]
    time.sleep(0.1)
    assert [real.comm_get_async_error(g) for g in grown] == [IN_PROGRESS] * 2
    return parent, grown


def test_a_grow_job_is_stopped_by_its_parents_abort() -> None:
    """The existing ranks' part of the job works on the parent's bootstrap, which only the parent's abort flag
    stops (bootstrap.cc bootstrapInit: bootstrapSend/Recv on parent->bootstrap): aborting the parent ends it, then
    the new communicator goes (communicators.rst's order for stopping a split: the parent, then the new one).
    Finalizing the parent meanwhile is a violation (comms.rst: destroy it "after the grow operation completes")."""
    parent, grown = _stuck_grow()
    real.comm_finalize(parent[2])
    assert any("while a grow of it is in progress" in v for v in simnccl.violations()), simnccl.violations()
    simnccl.clear()
    real.comm_abort(parent[2])
    assert _poll(grown[1]) == ncclsim.INTERNAL
    real.comm_abort(grown[1])
    real.comm_abort(grown[0])  # rank 0 waited at the root, on the new communicator's own sockets: its flag ends it
    _abort(parent[0], parent[1])
    assert simnccl.violations() == []


def test_aborting_only_the_new_communicator_joins_a_job_that_does_not_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """ncclCommAbort of the new communicator joins its job (ncclCommEnsureReady -> ncclGroupJobAbort), which
    waits on the parent's bootstrap and does not see that flag: a hang on a GPU, recorded here."""
    monkeypatch.setattr(cuda_state, "SYNC_PATIENCE", 0.5)
    parent, grown = _stuck_grow()
    real.comm_abort(grown[1])
    assert any("joining an NCCL job that does not end" in v for v in simnccl.violations()), simnccl.violations()
    simnccl.clear()
    _abort(parent[2], grown[0], parent[0], parent[1])  # the parent's flag ends the job the abort gave up on


def test_a_revoked_parent_is_not_grown() -> None:
    """comms.rst, ncclCommRevoke: after a revoke a communicator is "safe for destroy, split, and shrink"; grow is
    not among them and init.cc does not check it: recorded."""
    parent = _parent(1)
    real.comm_revoke(parent[0], 0)
    assert _poll(parent[0]) == SUCCESS
    uid = real.comm_get_unique_id(parent[0])
    grown = [real.comm_grow(parent[0], 2, uid, -1, _config()), real.comm_grow(real.Comm(0), 2, uid, 1, _config())]
    assert any("which was revoked" in v for v in simnccl.violations()), simnccl.violations()
    simnccl.clear()
    for g in grown:
        _poll(g)
    _abort(*grown, *parent)


def test_nothing_may_be_outstanding() -> None:
    """comms.rst: ncclCommGetUniqueId "should only be called when there are no outstanding NCCL operations on the
    communicator" (ncclCommGrow likewise, "to avoid potential deadlocks")."""
    from nccl_pg.comm.nccl import _lib

    rt = _lib.cudart()
    parent = _parent(2)
    streams = [rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)[1] for _ in parent]
    bufs = [rt.cudaMalloc(64)[1] for _ in parent]
    for c, s, b in zip(parent, streams, bufs, strict=True):  # both ranks: connected, done
        real.all_reduce(b, b, 4, 7, 0, c, int(s))
    assert [_poll(c) for c in parent] == [SUCCESS, SUCCESS]
    for s in streams:
        rt.cudaStreamSynchronize(s)
    real.all_reduce(bufs[0], bufs[0], 4, 7, 0, parent[0], int(streams[0]))  # rank 0 alone: its kernel waits
    assert _poll(parent[0]) == SUCCESS
    real.comm_get_unique_id(parent[1])  # rank 1 has nothing in flight
    assert simnccl.violations() == []
    real.comm_get_unique_id(parent[0])
    assert any("with NCCL operations still outstanding" in v for v in simnccl.violations()), simnccl.violations()
    simnccl.clear()
    _abort(*parent)


def test_a_parent_in_error_or_aborted() -> None:
    """ncclCommGrow's ncclCommEnsureReady returns the parent's error (here a lost network peer, the proxy's
    asyncResult: ncclRemoteError), as ncclCommGetUniqueId's does; an aborted parent is freed (use after free)."""
    parent = _parent(2)
    ncclsim.world().comms[int(parent[0].handle)].proxy_error = ncclsim.REMOTE
    for call in (lambda: real.comm_get_unique_id(parent[0]), lambda: real.comm_grow(parent[0], 3, 0, -1, _config())):
        with pytest.raises(real.NCCLError) as err:
            call()
        assert _status(err) == ncclsim.REMOTE
    real.comm_abort(parent[1])
    with pytest.raises(real.NCCLError) as err:
        real.comm_grow(parent[1], 3, 0, -1, _config())
    assert _status(err) == ncclsim.INVALID_ARGUMENT
    assert any("use after free: ncclCommGrow" in v for v in simnccl.violations()), simnccl.violations()
    simnccl.clear()
    real.comm_abort(parent[0])

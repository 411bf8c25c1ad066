"""reconfigure and get_init_handle (issue 26 item 2): torchcomms' shape
(reconfigure(uuid, init_handles, timeout), get_init_handle()) taking a group
from any membership to any other — identity, some left (revoke, then an
abortive shrink; the parent aborted, never finalized), some joined (grow),
both — within one deadline. Real processes around a real TCPStore
(harness/procs.py), a real SIGKILL; the plan (who gets which rank) on its
own below."""

from __future__ import annotations

import signal

import pytest
from harness import elastic_scenarios as E
from harness.procs import World, live_children

from nccl_pg.group.handles import Handle, make_plan

pytestmark = pytest.mark.timeout(90)

T = "0123456789abcdef"


def h(uuid: int, rank: int, token: str) -> str:
    return f"nccl_pg:{uuid}:{rank}:{(token * 16)[:16]}"


# --- the plan, alone ----------------------------------------------------------------------------------

def test_plan_members_keep_their_order_and_new_ranks_come_after():
    """Members of configuration 3 (ranks 0, 2, 3 of 4) become 0, 1, 2 in the
    order of their old ranks, whatever the order given; new processes take
    3 and 4 in list order; rank 1 left."""
    hs = [h(-1, -1, "e"), h(3, 3, "d"), h(3, 0, "a"), h(-1, -1, "f"), h(3, 2, "c")]
    for mine, rank in ((hs[2], 0), (hs[4], 1), (hs[1], 2), (hs[0], 3), (hs[3], 4)):
        plan = make_plan(4, hs, mine, 4 if rank < 3 else None)
        assert (plan.rank, plan.size, plan.quorum, plan.survivors) == (rank, 5, 3, (0, 2, 3))
        assert plan.member == (rank < 3)
        assert plan.joiners == (hs[0], hs[3])
    assert make_plan(4, hs, hs[2], 4).left(4) == [1]
    assert len({make_plan(4, hs, m, None).digest for m in hs}) == 1  # every process computes the same plan


def test_plan_from_a_set_is_the_same_on_every_process():
    """A set carries no order: new ranks follow the handles' text, so two
    processes (with different hash seeds) agree."""
    hs = {h(1, 0, "a"), h(-1, -1, "9"), h(-1, -1, "1"), h(1, 1, "b")}
    plan = make_plan(2, hs, h(-1, -1, "1"), None)
    assert plan.joiners == (h(-1, -1, "1"), h(-1, -1, "9")) and plan.rank == 2
    assert make_plan(2, frozenset(hs), h(-1, -1, "9"), None).rank == 3


def test_plan_quorum_is_the_largest_configuration():
    """A process from an older configuration (5) while most are in 6 joins
    as a new one; nobody in any configuration: everyone starts afresh."""
    hs = [h(6, 0, "a"), h(6, 1, "b"), h(5, 0, "c")]
    plan = make_plan(7, hs, hs[2], 1)
    assert (plan.quorum, plan.member, plan.rank) == (6, False, 2)
    fresh = make_plan(1, [h(-1, -1, "a"), h(-1, -1, "b")], h(-1, -1, "b"), None)
    assert (fresh.quorum, fresh.rank, fresh.size) == (None, 1, 2)


@pytest.mark.parametrize("handles,error,text", [
    ("nccl_pg:0:0:" + T, TypeError, "a list or a set"),
    ([h(0, 0, "a"), "nccl_pg:0:0:zz"], ValueError, "not an nccl_pg init handle"),
    ([h(0, 0, "a"), "nccl_pg:0:-1:" + T], ValueError, "both a uuid and a rank"),
    ([h(0, 0, "a"), h(0, 0, "a")], ValueError, "again"),
    ([h(0, 0, "a"), h(0, 1, "a")], ValueError, "two handles of one process"),
    ([h(0, 0, "a"), h(0, 0, "b")], ValueError, "claim rank 0"),
    ([h(0, 0, "a"), h(2, 0, "b")], ValueError, "each reconfigure takes a uuid never used"),
    ([h(0, 0, "a"), h(0, 5, "b")], ValueError, "ranks [5] of configuration 0"),
    ([h(0, 1, "b")], ValueError, "is not in init_handles"),
])
def test_plan_refuses_bad_handles(handles, error, text):
    with pytest.raises(error, match=text.replace("[", r"\[").replace("]", r"\]")):
        make_plan(2, handles, h(0, 0, "a"), 2)


def test_handle_round_trip():
    assert str(Handle.parse(h(7, 3, "a"), "x")) == h(7, 3, "a")


# --- real processes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("env", [{}, {"NCCL_PG_ASYNC_ERROR_HANDLING": "0"}, {"NCCL_PG_USE_COMM_NONBLOCKING": "1"}],
                         ids=["mode2", "mode0", "nonblocking"])
def test_kill_then_shrink_then_grow(tmp_path, env):
    """Rank 2 of 4 is SIGKILLed inside an all_reduce; the survivors
    reconfigure to themselves (3 ranks, kept in order: their communicator
    shrinks itself), then take a process that was in no group in (4 ranks:
    it is rank 3, the members keep theirs: their communicator grows)."""
    with World(5, E.kill_shrink_grow, tmp_path, args={"victim": 2}, env={"NCCL_PG_DUMP_ON_TIMEOUT": "0", **env}) as w:
        out = w.results(timeout=60, expect_rc={2: -signal.SIGKILL})
    assert set(out) == {0, 1, 3, 4}
    for old, new in ((0, 0), (1, 1), (3, 2)):
        r = out[old]
        assert r["before"] == [10.0, old, 4] and r["failed"] and "rank 2" in r["failed"]
        assert r["shrunk"] == [6.0, new, 3]
        assert r["grown"] == [10.0, new, 4]
        assert r["comm"].endswith(".grow1") and ".shrink" in r["comm"], r["comm"]  # no fresh rendezvous
        assert r["handle"].startswith(f"nccl_pg:2:{new}:")
    assert out[4]["grown"] == [10.0, 3, 4] and out[4]["comm"] == "host.joined3" and out[4]["uuid"] == 2
    assert not live_children()


def test_left_and_joined_in_one_call(tmp_path):
    """Rank 1 dies; one reconfigure drops it and takes a new process in.
    The old group's communicator was aborted before it was destroyed, and
    never finalized."""
    with World(5, E.both_at_once, tmp_path, env={"NCCL_PG_DUMP_ON_TIMEOUT": "0"}) as w:
        out = w.results(timeout=60, expect_rc={1: -signal.SIGKILL})
    for old, new in ((0, 0), (2, 1), (3, 2), (4, 3)):
        assert out[old]["after"] == [10.0, new, 4], out[old]
    for old in (0, 2, 3):
        assert out[old]["old_state"] == "destroyed"
        calls = out[old]["old_comm_calls"]
        assert "finalize" not in calls and "abort" in calls and calls.index("abort") < calls.index("destroy"), calls
        assert ".shrink1.grow1" in out[old]["comm"]


def test_identity(tmp_path):
    """Nobody leaves, nobody joins: a healthy group is returned as it is
    (same communicator); after a revoke, a fresh communicator of the same
    ranks replaces the broken one."""
    with World(3, E.identity, tmp_path) as w:
        out = w.results(timeout=60)
    for r, res in out.items():
        assert res["same_group"] and res["same_comm"] and res["uuid"] == 1 and res["sum1"] == [6.0, r, 3]
        assert res["new_group"] and res["old_state"] == "destroyed" and res["default"]
        assert res["sum2"] == [6.0, r, 3]


def test_bad_input_raises_before_anything_happens(tmp_path):
    with World(2, E.bad_input, tmp_path) as w:
        out = w.results(timeout=60)
    for res in out.values():
        assert len(res["seen"]) == 15
        assert res["sum"][0] == 3.0 and res["size"] == 2
        assert res["no_store"] == "ValueError"


def test_a_joiner_that_never_comes_times_out(tmp_path):
    """The deadline is the whole reconfigure's; the error names the rank
    that never came; the members are left in no group (so the next
    reconfigure takes them in as new processes)."""
    with World(2, E.joiner_never_comes, tmp_path, args={"timeout": 4.0}) as w:
        out = w.results(timeout=60)
    for res in out.values():
        assert res["failure"] and "timeout" in res["failure"] and "[2]" in res["failure"], res
        assert 3.0 < res["took"] < 15.0, res
        assert not res["initialized"] and res["handle"].startswith("nccl_pg:-1:-1:")


def test_a_joiner_given_other_handles_says_so(tmp_path):
    with World(3, E.other_handles, tmp_path, args={"timeout": 4.0}) as w:
        out = w.results(timeout=60)
    assert "other init_handles" in out[2]["failure"], out[2]
    assert all(out[r]["failure"] and "timeout" in out[r]["failure"] for r in (0, 1)), out


def test_a_timeout_race_gives_no_split(tmp_path):
    """Issue 33: after ranks 0 and 1 time out on an all_reduce that rank 2
    never issued, the three reconfigure to the same handles: rank 2 (its
    group healthy on its own) agrees with the others on a fresh group, so
    all three are in one group with the right sums (before, rank 2 kept its
    old group and the others failed with "ranks [2] never joined"). A
    member that never calls reconfigure is named as such."""
    with World(3, E.timeout_race, tmp_path, env={"NCCL_PG_DUMP_ON_TIMEOUT": "0"}) as w:
        out = w.results(timeout=60)
    assert out[0]["timed_out"] and out[1]["timed_out"] and out[2]["healthy_before"], out
    for r, res in out.items():
        assert not res["kept_old"] and res["sum"] == [6.0, r, 3] and res["comm"] == out[0]["comm"], out
    for r in (0, 1):
        assert "ranks [2] of configuration 1 never called reconfigure" in out[r]["late_error"], out[r]
        assert out[r]["late_took"] < 10, out[r]

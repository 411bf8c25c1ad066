"""reconfigure on the NCCL backend (issue 26), on the simulation: real rank
processes (harness/procs.py) around a real TCPStore, each driving the NCCL
backend through the real nccl4py binding over the stub libnccl.so.2 into
tests/simnccl; a real SIGKILL. The membership changes of
tests/test_reconfigure.py (some left, some joined, both, identity), checked
for the NCCL calls that reach the simulation, in NCCL's documented order:
ncclCommRevoke, ncclCommShrink with NCCL_SHRINK_ABORT (the revoked parent then
aborted, never finalized), ncclCommGetUniqueId on the coordinator only,
ncclCommGrow on every rank (rank -1 for members, an id only from the
coordinator and the new ranks), the grown group's parent destroyed after the
grow; results right after each change, no violation recorded, no
communicator left. After a rank's SIGKILL the survivors' communicator reports
the lost peer (the proxy's asyncResult) and NCCL's ncclCommShrink refuses it
(init.cc ncclCommInitChildComm -> ncclCommEnsureReady): they agree on a fresh
communicator instead, then grow. It proves our logic against NCCL's sources as
the simulation reads them, never GPU behaviour."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from harness import nccl_elastic_scenarios as S
from harness.procs import World, live_children

pytestmark = [pytest.mark.simnccl, pytest.mark.timeout(150)]

QUIET = {"NCCL_PG_DUMP_ON_TIMEOUT": "0"}
VARIANTS = [{"NCCL_PG_NCCL_OPS": "nonblocking"}, {"NCCL_PG_NCCL_OPS": "blocking"},
            {"NCCL_PG_NCCL_OPS": "nonblocking", "NCCL_PG_USE_COMM_NONBLOCKING": "1"}]
VARIANT_IDS = ["nonblocking-ops", "blocking-ops", "nonblocking-config"]
GROW_ORDER = ("ncclCommRevoke", "ncclCommShrink", "ncclCommInitRankConfig", "ncclCommGetUniqueId", "ncclCommGrow")


def order(calls: list[list[Any]]) -> list[str]:
    """The membership calls of a change, in order (the blocking variant's operations splits, finalize, destroy
    and abort left out)."""
    return [c[0] for c in calls if c[0] in GROW_ORDER]


def clean(res: dict) -> None:
    assert res["violations"] == [], res["violations"]
    assert res["live"] == 0, f"{res['live']} communicators left"


def torn_down_by_abort(calls: list[list[Any]], handle: int) -> None:
    """The communicator ``handle`` (a revoked one) was aborted, never finalized nor destroyed."""
    mine = [c[0] for c in calls if c[1] == handle]
    assert "ncclCommAbort" in mine and "ncclCommFinalize" not in mine and "ncclCommDestroy" not in mine, mine


def grows_natively(env: dict[str, str]) -> bool:
    """The blocking variant never grows natively (a grow of its control communicator would reuse a proxy sized
    for its ranks: docs/NCCL_BACKEND.md, "Grow"): its members and new ranks build a fresh communicator."""
    return env.get("NCCL_PG_NCCL_OPS") != "blocking"


def grow_calls(calls: list[list[Any]], coordinator: bool) -> None:
    """ncclCommGetUniqueId on the coordinator only, then its ncclCommGrow (rank -1, its id); the others' with
    rank -1 and no id; the parent destroyed after the grow, never before."""
    grows = [c for c in calls if c[0] == "ncclCommGrow"]
    assert len(grows) == 1 and grows[0][2]["rank"] == -1 and grows[0][2]["id"] == coordinator, grows
    parent = grows[0][1]
    ids = [i for i, c in enumerate(calls) if c[0] == "ncclCommGetUniqueId"]
    assert ids == ([i for i, c in enumerate(calls) if c[0] == "ncclCommGetUniqueId" and c[1] == parent]
                   if coordinator else []), calls
    at = calls.index(grows[0])
    assert not ids or ids[0] < at
    teardown = [i for i, c in enumerate(calls) if c[1] == parent and c[0] in ("ncclCommDestroy", "ncclCommAbort")]
    assert teardown and min(teardown) > at, calls


# The suite runs each variant once and each mode at least once; `make test-elastic` (ELASTIC_MATRIX=1) every pair.
SIGKILL_CASES = ([(m, v) for m in ("0", "2") for v in range(3)] if os.environ.get("ELASTIC_MATRIX")
                 else [("0", 1), ("2", 0), ("2", 2)])


@pytest.mark.parametrize(("mode", "env"), [(m, VARIANTS[v]) for m, v in SIGKILL_CASES],
                         ids=[f"mode{m}-{VARIANT_IDS[v]}" for m, v in SIGKILL_CASES])
def test_sigkill_then_shrink_then_grow(tmp_path, env, mode):
    """Rank 2 of 4 is SIGKILLed inside an all_reduce; the survivors reconfigure to themselves (revoke; the
    shrink NCCL refuses after the loss: a fresh communicator, agreed), then a process that was in no group joins
    (ncclCommGetUniqueId on rank 0, ncclCommGrow everywhere), under both NCCL_PG_NCCL_OPS variants, a
    nonblocking config, and error handling 0 and 2 (which aborts the communicator at the failure)."""
    with World(5, S.kill_shrink_grow, tmp_path, args={"victim": 2},
               env={**QUIET, **env, "NCCL_PG_ASYNC_ERROR_HANDLING": mode}) as w:
        out = w.results(timeout=120, expect_rc={2: -signal.SIGKILL})
    assert set(out) == {0, 1, 3, 4}
    for old, new in ((0, 0), (1, 1), (3, 2)):
        r = out[old]
        clean(r)
        assert r["before"] == [10.0, old, 4] and r["failed"], r
        assert r["shrunk"] == [6.0, new, 3] and r["grown"] == [10.0, new, 4], r
        shrink = r["shrink_calls"]
        if mode == "0":
            assert order(shrink) == ["ncclCommRevoke", "ncclCommInitRankConfig"], shrink
            torn_down_by_abort(shrink, shrink[0][1])
        else:  # the failure's error handling aborted the communicator already: nothing to revoke
            assert order(shrink) == ["ncclCommInitRankConfig"], shrink
            assert "ncclCommFinalize" not in [c[0] for c in shrink if c[1] < shrink[-1][1]], shrink
        if not grows_natively(env):
            assert order(r["grow_calls"]) == ["ncclCommInitRankConfig"], r["grow_calls"]
            continue
        assert order(r["grow_calls"]) == (["ncclCommGetUniqueId"] if new == 0 else []) + ["ncclCommGrow"]
        grow_calls(r["grow_calls"], new == 0)
    clean(out[4])
    assert out[4]["grown"] == [10.0, 3, 4] and out[4]["uuid"] == 2 and out[4]["handle"].startswith("nccl_pg:2:3:")
    grows = [c for c in out[4]["grow_calls"] if c[0] == "ncclCommGrow"]
    assert [(g[1], g[2]["rank"], g[2]["nranks"], g[2]["id"]) for g in grows] == \
        ([(0, 3, 4, True)] if grows_natively(env) else [])
    assert not live_children()


def change(tmp_path: Any, n: int, env: dict[str, str] | None = None, expect_rc: dict | None = None,
           **args: Any) -> dict[int, dict]:
    with World(n, S.membership, tmp_path, args=args, env={**QUIET, **(env or {})}) as w:
        out = w.results(timeout=120, expect_rc=expect_rc)
    for r in out.values():
        clean(r)
    assert not live_children()
    return out


@pytest.mark.parametrize("env", VARIANTS[:2], ids=VARIANT_IDS[:2])
def test_some_left(tmp_path, env):
    """Ranks 1 and 3 of 4 leave (alive: a scale-down): revoke, ncclCommShrink(NCCL_SHRINK_ABORT) of the group's
    own communicator, the revoked one aborted, never finalized; ranks 0 and 2 become 0 and 1."""
    out = change(tmp_path, 4, env, old=[0, 1, 2, 3], new=[0, 2])
    for old, new in ((0, 0), (2, 1)):
        r = out[old]
        assert r["before"] == [10.0, old, 4] and r["after"] == [3.0, new, 2], r
        assert order(r["calls"]) == ["ncclCommRevoke", "ncclCommShrink"], r["calls"]
        shrink = next(c for c in r["calls"] if c[0] == "ncclCommShrink")
        assert shrink[2]["flags"] == 1  # NCCL_SHRINK_ABORT
        torn_down_by_abort(r["calls"], shrink[1])
        assert not r["same_group"] and r["old_state"] == "destroyed"


@pytest.mark.parametrize("env", VARIANTS, ids=VARIANT_IDS)
def test_some_joined(tmp_path, env):
    """Ranks 2 and 3, in no group, join ranks 0 and 1: no revoke, no shrink; ncclCommGetUniqueId on rank 0, its
    ncclCommGrow with its id, rank 1's with none; the new ranks' with the id and ranks 2 and 3 (the blocking
    variant: a fresh communicator of the four)."""
    out = change(tmp_path, 4, env, old=[0, 1], new=[0, 1, 2, 3])
    for r in range(4):
        assert out[r]["after"] == [10.0, r, 4], out[r]
    if not grows_natively(env):
        assert all(order(out[r]["calls"]) == ["ncclCommInitRankConfig"] for r in range(4)), out
        return
    for r in (0, 1):
        assert order(out[r]["calls"]) == (["ncclCommGetUniqueId"] if r == 0 else []) + ["ncclCommGrow"]
        grow_calls(out[r]["calls"], r == 0)
    for r in (2, 3):
        grows = [(c[1], c[2]["rank"], c[2]["id"]) for c in out[r]["calls"] if c[0] == "ncclCommGrow"]
        assert grows == [(0, r, True)] and order(out[r]["calls"]) == ["ncclCommGrow"]


@pytest.mark.parametrize("dead", [False, *([True] if os.environ.get("ELASTIC_MATRIX") else [])],
                         ids=["left-alive", *(["sigkilled"] if os.environ.get("ELASTIC_MATRIX") else [])])
def test_left_and_joined_in_one_call(tmp_path, dead):
    # (SIGKILLed, the survivors' fresh communicator: also test_several_left_and_joined_in_one_call's suite case)
    """Rank 1 of 4 leaves (alive, or SIGKILLed inside an all_reduce) and rank 4 joins, in one reconfigure:
    revoke, then ncclCommShrink(NCCL_SHRINK_ABORT) (alive) or a fresh communicator of the survivors (SIGKILLed:
    NCCL refuses to shrink a communicator that lost a network peer), then ncclCommGetUniqueId and ncclCommGrow:
    NCCL's documented order."""
    out = change(tmp_path, 5, {"NCCL_PG_ASYNC_ERROR_HANDLING": "0"}, expect_rc={1: -signal.SIGKILL} if dead else None,
                 old=[0, 1, 2, 3], dead=[1] if dead else [], new=[0, 2, 3, 4])
    for old, new in ((0, 0), (2, 1), (3, 2), (4, 3)):
        assert out[old]["after"] == [10.0, new, 4], out[old]
    for old, new in ((0, 0), (2, 1), (3, 2)):
        calls = out[old]["calls"]
        middle = "ncclCommInitRankConfig" if dead else "ncclCommShrink"
        assert order(calls) == ["ncclCommRevoke", middle] + (["ncclCommGetUniqueId"] if new == 0 else []) + \
            ["ncclCommGrow"], calls
        torn_down_by_abort(calls, calls[0][1])
        grow_calls(calls, new == 0)
        if dead:
            assert out[old]["failed"]
        comm = out[old]["comm"]  # the names tests/test_gpu_reconfigure.py reads on a GPU
        assert comm.endswith(".grow") and (".shrink" in comm) != dead, comm
    assert order(out[4]["calls"]) == ["ncclCommGrow"]


def test_survivors_agree_on_a_fresh_communicator_when_one_cannot_shrink(tmp_path):
    """Rank 3 leaves; only rank 0's communicator reports an error (as only the lost rank's network neighbours'
    proxies would): NCCL would refuse rank 0's shrink and wait in the others' for it, so all survivors agree on a
    fresh communicator."""
    out = change(tmp_path, 4, {"NCCL_PG_ASYNC_ERROR_HANDLING": "0"}, old=[0, 1, 2, 3], new=[0, 1, 2],
                 lost_peer_seen=[0])  # error handling 0: the watchdog, seeing the error, does not abort it first
    for r in (0, 1, 2):
        assert out[r]["after"] == [6.0, r, 3], out[r]
        assert order(out[r]["calls"]) == ["ncclCommRevoke", "ncclCommInitRankConfig"], out[r]["calls"]


def test_identity(tmp_path):
    """Nobody leaves, nobody joins: a healthy group is returned as it is (no NCCL call); after a revoke, a fresh
    communicator of the same ranks replaces the broken one (the revoked one aborted, never finalized)."""
    out = change(tmp_path, 3, old=[0, 1, 2], new=[0, 1, 2], then_revoke=True)
    for r, res in out.items():
        assert res["same_group"] and res["calls"] == [] and res["after"] == [6.0, r, 3], res
        again = res["again_calls"]
        assert res["again_new_group"] and res["again"] == [6.0, r, 3]
        assert order(again) == ["ncclCommRevoke", "ncclCommInitRankConfig"], again
        torn_down_by_abort(again, again[0][1])


def test_below_2_29_2_a_grow_is_a_fresh_communicator(tmp_path):
    """NCCL 2.28.7 (revoke, no ncclCommGrow: nccl.h.in declares it from v2.29.2-1): the same change through a
    fresh communicator of all four ranks; no ncclCommGetUniqueId, no ncclCommGrow."""
    out = change(tmp_path, 4, old=[0, 1], new=[0, 1, 2, 3], version=22807)
    for r in range(4):
        assert out[r]["after"] == [10.0, r, 4], out[r]
        assert order(out[r]["calls"]) == ["ncclCommInitRankConfig"], out[r]["calls"]


if os.environ.get("ELASTIC_MATRIX"):  # `make test-elastic` (about 50 s of CPU: the suite's budget)
    def test_bench_elastic_nccl_sim_rows(tmp_path):
        """tools/bench_elastic.py --nccl-sim on a small case: the call sequence of each step (the simulation's, as
        docs/BENCHMARKS.md records it) and store requests per rank that do not grow with the ranks."""
        import json
        import subprocess
        import sys
        from pathlib import Path

        repo = Path(__file__).resolve().parents[1]
        out = tmp_path / "rows.json"
        subprocess.run([sys.executable, "tools/bench_elastic.py", "--nccl-sim", "--sizes", "3", "5", "--json", str(out),
                        "--logs", str(tmp_path)], cwd=repo, check=True, timeout=140, capture_output=True)
        rows = {(r["mode"], r["n"]): r for r in json.loads(out.read_text())}

        def order(calls: list[str]) -> list[str]:  # the tool records names only
            return [c for c in calls if c in GROW_ORDER]

        for n in (3, 5):
            kill, leave = rows[("kill", n)], rows[("leave", n)]
            assert order(kill["coordinator"]["shrink"]) == ["ncclCommRevoke", "ncclCommInitRankConfig"]
            assert order(leave["coordinator"]["shrink"]) == ["ncclCommRevoke", "ncclCommShrink"]
            for row in (kill, leave):
                assert order(row["coordinator"]["grow"]) == ["ncclCommGetUniqueId", "ncclCommGrow"]
                assert order(row["member"]["grow"]) == order(row["new"]["grow"]) == ["ncclCommGrow"]
        for way in ("kill", "leave"):
            for step in ("shrink_requests_per_rank", "grow_requests_per_rank"):
                assert rows[(way, 3)][step] == rows[(way, 5)][step], (way, step, rows)


SITE = """\
import atexit, json, os, sys
sys.path.insert(0, {tests!r})
import simnccl  # every Python process of the job (the launcher too) runs NCCL on the simulation
simnccl.install()


def _report():
    member = os.environ.get("NCCL_PG_ELASTIC_MEMBER")
    if member is not None:  # a rank: what reached the simulation
        with open(os.path.join({report!r}, f"member{{member}}.json"), "w") as f:
            json.dump({{"violations": simnccl.violations(), "live": simnccl.live_communicators(),
                       "calls": [c for c, _ in simnccl.call_log()]}}, f)


atexit.register(_report)
"""


@pytest.mark.parametrize("victims", ["0,1", *(["2"] if os.environ.get("ELASTIC_MATRIX") else [])],
                         ids=["ranks 0 and 1 at once", *(["rank 2"] if os.environ.get("ELASTIC_MATRIX") else [])])
def test_the_worked_example_on_nccl(tmp_path, victims):
    """examples/elastic.py's NCCL variant (CuPy arrays: simnccl.xp, on simulated GPUs LOCAL_RANK % 2) under
    `nccl-pg run --nproc 4 --elastic`, every process importing the simulation through a sitecustomize, one rank
    or two at once (rank 0, the coordinator, among them) SIGKILLed: exit 0, the survivors went on without them,
    every replacement came in, every rank's checksum that of the undisturbed run; no violation of NCCL's rules as
    the simulation reads them, no communicator left. The calls: after a peer's SIGKILL the survivors' communicator
    lost a network peer, which NCCL does not shrink (a fresh ncclCommInitRankConfig); a replacement's record then
    revokes the group (the record watch), and NCCL grows no revoked communicator (comms.rst: "safe for destroy,
    split, and shrink"), so the grow is a fresh communicator too. ncclCommShrink excluding several ranks and
    ncclCommGrow by several, on a group that can: test_several_left_and_joined_in_one_call."""
    import json
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    site, report = tmp_path / "site", tmp_path / "report"
    site.mkdir()
    report.mkdir()
    (site / "sitecustomize.py").write_text(SITE.format(tests=str(repo / "tests"), report=str(report)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_PG_", "TORCH_NCCL_"))}
    env.update(PYTHONPATH=str(site), NCCL_PG_DEBUG_INFO_TEMP_FILE=str(tmp_path / "trace_"))
    dead = [int(v) for v in victims.split(",")]
    p = subprocess.run([str(Path(sys.executable).parent / "nccl-pg"), "run", "--nproc", "4", "--elastic",
                        "examples/elastic.py", "--backend", "nccl", "--kill-ranks", victims, "--kill-step", "10",
                        "--step-time", "0.25", "--steps", "60"],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stdout + p.stderr
    reference = subprocess.run([sys.executable, "examples/elastic.py", "--reference", "--steps", "60"], cwd=repo,
                               capture_output=True, text=True, timeout=60, check=True).stdout.split()[-1]
    finals = dict(re.findall(r"\[(?:rank\d+\|)?(member\d+)\]: final ([0-9a-f]+)", p.stdout))
    replacements = {f"member{4 + i}" for i in range(len(dead))}
    assert finals == dict.fromkeys({f"member{r}" for r in range(4) if r not in dead} | replacements, reference), \
        p.stdout
    assert re.search(rf"membership: uuid \d+: world size {4 - len(dead)}", p.stdout), p.stdout  # went on without them
    reports = {f.stem: json.loads(f.read_text()) for f in report.glob("member*.json")}
    assert set(reports) == {f"member{r}" for r in range(4 + len(dead)) if r not in dead}, reports
    for who, r in reports.items():
        assert r["violations"] == [] and r["live"] == 0, (who, r)
        assert set(order([[c] for c in r["calls"]])) <= {"ncclCommRevoke", "ncclCommInitRankConfig", "ncclCommShrink",
                                                        "ncclCommGetUniqueId", "ncclCommGrow"}, (who, r["calls"])


@pytest.mark.parametrize("dead", [True, *([False] if os.environ.get("ELASTIC_MATRIX") else [])],
                         ids=["sigkilled", *(["left-alive"] if os.environ.get("ELASTIC_MATRIX") else [])])
def test_several_left_and_joined_in_one_call(tmp_path, dead):
    """Issue 33: ranks 1 and 2 of 4 leave together (alive, or both SIGKILLed inside an all_reduce) and two new
    processes join, in one reconfigure: revoke, then ncclCommShrink(NCCL_SHRINK_ABORT) excluding both (alive) or a
    fresh communicator of the survivors (SIGKILLed), then ncclCommGetUniqueId on the coordinator and ncclCommGrow
    from 2 ranks to 4: NCCL's order, by several at once (the alive case in `make test-elastic`; the suite's
    test_some_left and test_some_joined shrink and grow by two on their own)."""
    out = change(tmp_path, 6, {"NCCL_PG_ASYNC_ERROR_HANDLING": "0"},
                 expect_rc={1: -signal.SIGKILL, 2: -signal.SIGKILL} if dead else None,
                 old=[0, 1, 2, 3], dead=[1, 2] if dead else [], new=[0, 3, 4, 5])
    for old, new in ((0, 0), (3, 1), (4, 2), (5, 3)):
        assert out[old]["after"] == [10.0, new, 4], out[old]
    for old, new in ((0, 0), (3, 1)):
        calls = out[old]["calls"]
        middle = "ncclCommInitRankConfig" if dead else "ncclCommShrink"
        assert order(calls) == ["ncclCommRevoke", middle] + (["ncclCommGetUniqueId"] if new == 0 else []) + \
            ["ncclCommGrow"], calls
        if not dead:
            shrink = next(c for c in calls if c[0] == "ncclCommShrink")
            assert shrink[2]["flags"] == 1 and sorted(shrink[2]["exclude"]) == [1, 2], shrink
        grow = next(c for c in calls if c[0] == "ncclCommGrow")
        assert grow[2]["nranks"] == 4, grow
        torn_down_by_abort(calls, calls[0][1])
        grow_calls(calls, new == 0)
    for r in (4, 5):
        assert order(out[r]["calls"]) == ["ncclCommGrow"], out[r]["calls"]

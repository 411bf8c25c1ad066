"""`nccl-pg run --elastic` with the worked example (issue 26 items 3, 4a):
the commands of the issue's "done when", run as they are, with a real SIGKILL;
the launcher's membership records; the library piece's errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nccl_pg import TCPStore, elastic
from nccl_pg.cli.elastic import ElasticOptions, Membership

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/elastic.py"
NCCL_PG = str(Path(sys.executable).parent / "nccl-pg")  # the console script of this environment
RUN_LIMIT = 120  # seconds a whole job may take here (it takes about 3 s alone)

pytestmark = pytest.mark.timeout(RUN_LIMIT + 30)


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``nccl-pg run ARGS`` from the repository's root (so that
    examples/elastic.py is found as the issue writes it); the ranks' dumps go
    to tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_PG_", "TORCH_NCCL_"))}
    env["NCCL_PG_DEBUG_INFO_TEMP_FILE"] = str(tmp_path / "trace_")
    return subprocess.run([NCCL_PG, "run", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=RUN_LIMIT)


def reference() -> str:
    out = subprocess.run([sys.executable, EXAMPLE, "--reference"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return out.split()[-1]


def lines(stdout: str, pattern: str) -> dict[str, str]:
    """The first capture of ``pattern`` in each member's output, by member label ("member3": the launcher's
    prefix is "[rank1|member3]: ", or "[member3]: " until the member's rank is known)."""
    found: dict[str, str] = {}
    for line in stdout.splitlines():
        m = re.match(rf"\[(?:rank\d+\|)?(member\d+)\]: {pattern}", line)
        if m:
            found.setdefault(m.group(1), m.group(2) if m.lastindex and m.lastindex > 1 else "")
    return found


def test_the_worked_example_survives_two_sigkills_at_once(tmp_path):
    """The issue's command: `nccl-pg run --nproc 4 --elastic
    examples/elastic.py --kill-ranks 1,2 --kill-step 20` exits 0; the
    survivors went on as 2 (rank 0 of configuration 2 being the old rank 0),
    each replacement came in when it was ready (configurations 3 and 4, or
    one configuration with both), and the four ranks of the end print the
    same checksum, that of a run nothing disturbed. (Rank 0's death, hung
    ranks, deaths during a recovery: tests/test_elastic_recovery.py.)"""
    p = run(tmp_path, "--nproc", "4", "--elastic", EXAMPLE, "--kill-ranks", "1,2", "--kill-step", "20",
            "--step-time", "0.15")
    out = p.stdout + p.stderr  # the launcher's lines (who died, who replaced whom) are on stderr
    assert p.returncode == 0, out
    finals = lines(p.stdout, r"final ([0-9a-f]+)")
    assert set(finals) == {"member0", "member3", "member4", "member5"}, out
    assert set(finals.values()) == {reference()}, out
    assert lines(p.stdout, "member (\\d+): SIGKILL at step 20") == {"member1": "1", "member2": "2"}
    sizes = [(int(u), int(n)) for u, n in re.findall(r"\[(?:rank\d+\|)?member0\]: membership: uuid (\d+): world size (\d+)",
                                                      p.stdout)]
    assert sizes[0] == (0, 4) and sizes[-1][1] == 4 and (2 in {n for _, n in sizes}), out  # 4, 2, ..., 4
    assert re.search(r"membership: uuid \d+: world size 4, rank 3 \(joined", p.stdout)
    assert "starting member 4 in its place" in p.stderr and "starting member 5 in its place" in p.stderr
    # Each line says the member's rank when it was printed (as its watchdog last wrote it): at the end, the four
    # members are ranks 0..3, the replacements among them.
    labels = re.findall(r"^\[rank(\d+)\|member(\d+)\]: final ", p.stdout, re.M)
    assert sorted(labels) == sorted(set(labels)) and {r for r, _ in labels} == {"0", "1", "2", "3"}, out
    assert {m for _, m in labels} == {"0", "3", "4", "5"}, out


def test_without_elastic_the_same_kill_ends_the_job(tmp_path):
    """The feature's control: without --elastic the SIGKILL ends the job
    with 128+9 and nobody finishes."""
    p = run(tmp_path, "--nproc", "4", EXAMPLE, "--kill-rank", "2", "--kill-step", "20", "--timeout", "20")
    assert p.returncode == 137, p.stdout + p.stderr
    assert not lines(p.stdout, r"final ([0-9a-f]+)")


def test_no_replacement_left_ends_the_job(tmp_path):
    p = run(tmp_path, "--nproc", "3", "--elastic", "--max-replacements", "0", EXAMPLE, "--kill-rank", "1",
            "--kill-step", "5", "--timeout", "20")
    assert p.returncode == 137, p.stdout + p.stderr
    assert "no replacement left (--max-replacements 0)" in p.stderr


def test_bad_max_replacements_is_refused(tmp_path):
    p = run(tmp_path, "--nproc", "2", "--elastic", "--max-replacements", "-1", EXAMPLE)
    assert p.returncode == 2 and "--max-replacements: must be >= 0" in p.stderr


# --- the pieces -----------------------------------------------------------------------------------------------

def test_the_launcher_records(tmp_path):
    """Record 0 at start; deaths reaped together write one configuration
    without them, mark them gone where someone may wait for them, and name
    a replacement each (a new member number, the dead one's LOCAL_RANK, the
    configuration it comes in after); with too few replacements left,
    nothing is written."""
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        m = Membership(ElasticOptions(max_replacements=2), 3, store)
        starts = m.initial()
        assert [(s.member, s.env["RANK"], s.env["LOCAL_RANK"]) for s in starts] == [(0, "0", "0"), (1, "1", "1"),
                                                                                       (2, "2", "2")]
        assert m.records.read(0).members == (0, 1, 2) and store.get(elastic.LATEST_KEY) == b"0"
        m.records.offer(m.records.read(0), 0, "nccl_pg:-1:-1:" + "ab" * 8)  # member 0 came to configuration 0
        new = m.died({1: "was killed by signal SIGKILL (9)", 2: "exited with code 1"})
        assert new is not None
        assert [(s.member, s.env) for s in new] == [
            (3, {"NCCL_PG_ELASTIC_MEMBER": "3", "NCCL_PG_ELASTIC_UUID": "1", "LOCAL_RANK": "1"}),
            (4, {"NCCL_PG_ELASTIC_MEMBER": "4", "NCCL_PG_ELASTIC_UUID": "1", "LOCAL_RANK": "2"})]
        assert m.records.read(1).members == (0,) and "member 1 was killed" in m.records.read(1).why
        slots = m.records.collect(m.records.read(0), time.monotonic() + 5)  # decided: 0 came, 1 and 2 are gone
        assert slots.came() == [0] and sorted(slots.gone) == [1, 2]
        assert m.died({0: "exited with code 1"}) is None and m.records.latest() == 1
        m.close()
    finally:
        store.close()


def test_a_bad_handle_in_the_records_names_its_key_and_member():
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        records = elastic.Records(store)
        config = records.start([0, 1])
        store.set(elastic.slot_key(0, 0), b"nccl_pg:-1:-1:" + b"ab" * 8)
        store.set(elastic.slot_key(0, 1), b"\xff\xfe")
        with pytest.raises(ValueError, match=r"member 1's init handle under nccl_pg/elastic/0/slot/1 is not UTF-8"):
            records.collect(config, time.monotonic() + 5)
        store.set(elastic.slot_key(0, 1), b"nccl_pg:7")
        with pytest.raises(ValueError, match=r"member 1's init handle under nccl_pg/elastic/0/slot/1 .* not an "):
            records.collect(config, time.monotonic() + 5)
        store.set(elastic.config_key(1), b"{\"uuid\": 1, \"members\": [0, 0]}")
        with pytest.raises(ValueError, match=r"nccl_pg/elastic/config/1 holds .* not a membership record"):
            records.newest()
    finally:
        store.close()


def test_elastic_from_env_needs_the_launcher():
    with pytest.raises(ValueError, match="NCCL_PG_ELASTIC_MEMBER is not set"):
        elastic.Elastic.from_env(environ={})
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        elastic.Elastic.from_env(environ={"NCCL_PG_ELASTIC_MEMBER": "4", "NCCL_PG_ELASTIC_UUID": "2"})
    with pytest.raises(ValueError, match="NCCL_PG_ELASTIC_MEMBER"):
        elastic.Elastic.from_env(environ={"NCCL_PG_ELASTIC_MEMBER": "x"})
    with pytest.raises(ValueError, match="member must be"):
        elastic.Elastic(None, -1)


def test_bench_elastic_store_requests_do_not_grow_with_the_ranks(tmp_path):
    """tools/bench_elastic.py on a small case: both ways recover and grow
    (the tool checks every all_reduce's sum), and each rank's store requests
    in each step are the same for 3 ranks as for 6: O(1)."""
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, "tools/bench_elastic.py", "--sizes", "3", "6", "--repeat", "1", "--json",
                    str(out), "--logs", str(tmp_path)], cwd=REPO, check=True, timeout=RUN_LIMIT, capture_output=True)
    rows = {(r["mode"], r["n"]): r for r in json.loads(out.read_text())}
    for mode in ("reconfigure", "recreate"):
        for step in ("shrink_requests_per_rank", "grow_requests_per_rank"):
            assert rows[(mode, 3)][step] == rows[(mode, 6)][step], (mode, step, rows)
    assert rows[("reconfigure", 6)]["shrink_requests_per_rank"] <= 9
    # (+3 since issue 33: the members agree on keeping their group or a fresh one, as the survivors of a shrink do)
    assert rows[("reconfigure", 6)]["grow_requests_per_rank"] <= 15


def test_bench_elastic_kills_measures_from_the_stamps():
    """tools/bench_elastic_kills.py's arithmetic on stamps made by hand: the first victim's kill, the last
    survivor's next step past the kill step, the first full-size step everywhere, a replacement's start to its
    first step (a survivor's step that finished after the kill stamp but before the kill step does not count)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import bench_elastic_kills as K
    finally:
        sys.path.pop(0)
    done = lambda t, step, size: {"e": "done", "t": t, "step": step, "size": size}  # noqa: E731
    stamps = {
        "member0": [done(9.0, 20, 3), done(10.05, 20, 3), done(10.4, 21, 2), done(12.0, 22, 3)],
        "member1": [{"e": "kill", "t": 10.0}],
        "member2": [done(9.0, 20, 3), done(10.5, 21, 2), done(12.0, 22, 3)],
        "member3": [{"e": "spawned", "at": 10.2}, done(11.9, 22, 3)],
    }
    got = K.measure(stamps, 3, 20)
    assert got["survivors_s"] == pytest.approx(0.5) and got["full_size_s"] == pytest.approx(2.0)
    assert got["replacement_s"] == pytest.approx(1.7) and got["killed"] == 1

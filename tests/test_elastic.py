"""`nccl-pg run --elastic` with the worked example (issue 26 items 3, 4a):
the commands of the issue's "done when", run as they are, with a real SIGKILL;
the launcher's membership records; the library piece's errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nccl_pg import TCPStore, elastic
from nccl_pg.cli.elastic import Records

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
    """The first capture of ``pattern`` in each rank's output, by rank label."""
    found: dict[str, str] = {}
    for line in stdout.splitlines():
        m = re.match(rf"\[(rank\d+)\]: {pattern}", line)
        if m:
            found.setdefault(m.group(1), m.group(2) if m.lastindex and m.lastindex > 1 else "")
    return found


@pytest.mark.parametrize("victim", [2, 0])
def test_the_worked_example_survives_a_sigkill(tmp_path, victim):
    """`nccl-pg run --nproc 4 --elastic examples/elastic.py --kill-rank R
    --kill-step 20` exits 0; the survivors shrank to 3, grew back to 4 with
    the replacement (rank 4's process, rank 3 of the group); the four ranks
    of the end print the same checksum, that of a run nothing disturbed.
    Rank 0 dying loses nothing: the store lives in the launcher."""
    p = run(tmp_path, "--nproc", "4", "--elastic", EXAMPLE, "--kill-rank", str(victim), "--kill-step", "20")
    assert p.returncode == 0, p.stdout + p.stderr
    finals = lines(p.stdout, r"final ([0-9a-f]+)")
    survivors = {f"rank{r}" for r in range(4) if r != victim}
    assert set(finals) == survivors | {"rank4"}, p.stdout
    assert set(finals.values()) == {reference()}, p.stdout
    assert lines(p.stdout, "member (\\d+): SIGKILL at step 20") == {f"rank{victim}": str(victim)}
    shrunk = lines(p.stdout, r"membership: uuid 1: world size (\d+)")
    grown = lines(p.stdout, r"membership: uuid 2: world size (\d+)")
    assert shrunk == dict.fromkeys(survivors, "3"), p.stdout
    assert grown == dict.fromkeys(survivors | {"rank4"}, "4"), p.stdout
    assert re.search(r"membership: uuid 2: world size 4, rank 3 \(joined", p.stdout)
    assert f"rank {victim} (pid" in p.stderr and "starting rank 4 in its place (configuration 2" in p.stderr


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
    """Record 0 at start; a death writes the shrunk and the grown record in
    one go and names the replacement (a new member number, the dead one's
    LOCAL_RANK, the configuration it joins); with no replacement left,
    nothing is written."""
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        m = Records(3, 1, "127.0.0.1", store.port, None)
        assert elastic.Config.decode(store.get(elastic.config_key(0))).members == (0, 1, 2)
        new = m.died(1)
        assert new is not None and (new.member, new.uuid, new.local_rank) == (3, 2, 1)
        assert new.env() == {"NCCL_PG_ELASTIC_MEMBER": "3", "NCCL_PG_ELASTIC_UUID": "2", "LOCAL_RANK": "1"}
        assert elastic.Config.decode(store.get(elastic.config_key(1))).members == (0, 2)
        assert elastic.Config.decode(store.get(elastic.config_key(2))).members == (0, 2, 3)
        assert store.get(elastic.LATEST_KEY) == b"2"
        assert m.died(0) is None and store.get(elastic.LATEST_KEY) == b"2"
        m.close()
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
    assert rows[("reconfigure", 6)]["grow_requests_per_rank"] <= 12

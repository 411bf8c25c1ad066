"""Elastic recovery under `nccl-pg run --elastic` (issue 33): several ranks
SIGKILLed at the same step (rank 0, the coordinator, among them), a death
during a recovery (a member after its handle went into the next
configuration; a replacement inside the grow that takes it in), a hung rank
(named by the others' timeout, its stack taken, stopped, replaced), a newer
configuration written while the state is sent to a replacement. Real
processes and signals, the launcher's store, examples/elastic.py (with the
faults of tests/harness/elastic_faults.py put inside the recovery).

Each case must end with exit 0, every rank of the end on the checksum of a
run nothing disturbed, and the world back at its size (every replacement
came in). A case × fault matrix: the suite runs the cases below;
``make test-elastic`` (ELASTIC_MATRIX=1) adds 8 ranks losing 4 and more."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NCCL_PG = str(Path(sys.executable).parent / "nccl-pg")
FAULTS = "tests/harness/elastic_faults.py"
RUN_LIMIT = 150

pytestmark = pytest.mark.timeout(RUN_LIMIT + 30)

# name: (ranks, the example's fault arguments, the harness's in-recovery fault, replacements needed)
CASES = {
    "two at once, rank 0 among them": (4, ["--kill-ranks", "0,1"], "", 2),
    "a member dies after its handle went in": (4, ["--kill-ranks", "2"], "offered:3", 2),
    "a hung rank": (4, ["--hang-rank", "2"], "", 1),
    "a newer configuration while the state is sent": (4, ["--kill-ranks", "2"], "transfer:4", 1),
}
if os.environ.get("ELASTIC_MATRIX"):
    CASES.update({
        "the replacement dies inside its grow": (4, ["--kill-ranks", "2"], "grow:4", 2),
        "four of eight at once": (8, ["--kill-ranks", "1,3,4,6"], "", 4),
        "four of eight, rank 0 among them": (8, ["--kill-ranks", "0,1,2,3"], "", 4),
        "two of four, then one more during the recovery": (4, ["--kill-ranks", "1,2"], "offered:3", 3),
        "a hung rank and a death at once": (4, ["--hang-rank", "1", "--kill-ranks", "3"], "", 2),
    })


def reference(steps: int) -> str:
    out = subprocess.run([sys.executable, "examples/elastic.py", "--reference", "--steps", str(steps)], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return out.split()[-1]


def finals(stdout: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^\[(?:rank\d+\|)?(member\d+)\]: final ([0-9a-f]+)$", stdout, re.M)}


@pytest.mark.parametrize("case", list(CASES))
def test_recovery(tmp_path, case):
    n, fault_args, fault, replacements = CASES[case]
    steps = 40 if n == 4 else 60
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_PG_", "TORCH_NCCL_"))}
    env.update(NCCL_PG_DEBUG_INFO_TEMP_FILE=str(tmp_path / "trace_"), NCCL_PG_TEST_FAULT=fault)
    # Op timeout 4 s (a hung rank is named after it); an attempt 6 s (what a death inside a reconfigure costs).
    p = subprocess.run([NCCL_PG, "run", "--nproc", str(n), "--elastic", "--max-replacements", str(replacements),
                        "--report-dir", str(tmp_path), FAULTS, *fault_args, "--kill-step", "10", "--steps",
                        str(steps), "--step-time", "0.15", "--timeout", "60", "--op-timeout", "4",
                        "--attempt-timeout", "6"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_LIMIT)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    got = finals(p.stdout)
    assert len(got) == n and set(got.values()) == {reference(steps)}, out  # back at n ranks, all on the reference
    assert "finished before this process got in" not in p.stdout, out
    assert len(re.findall(r"starting member \d+ in its place", p.stderr)) == replacements, out
    if fault.startswith("transfer:"):  # its transfer (its first collective) failed; the checksum: a later one came
        member = fault.partition(":")[2]
        assert re.search(rf"member {member}: wrote configuration \d+ before the state came", p.stdout), out
        assert re.search(rf"member {member}: recovering from: ", p.stderr), out
    if "--hang-rank" in fault_args:
        hung = fault_args[fault_args.index("--hang-rank") + 1]
        m = re.search(rf"member {hung} \(pid \d+\) is stuck: .*its stack at \S*elastic\.py:\d+: (\S+);", p.stderr)
        assert m is not None, out
        assert "time.sleep" in Path(m.group(1)).read_text() or "main" in Path(m.group(1)).read_text()

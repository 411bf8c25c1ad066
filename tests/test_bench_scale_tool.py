"""tools/bench_scale.py runs end to end at a small size, so that a change of the store's wire protocol or of the
diagnosis cannot leave the scale benchmark broken (its figures live in docs/BENCHMARKS.md, never here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_bench_scale_small_run(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_scale.py"), "--sizes", "100", "--torch-sizes",
                           "--init-sizes", "4", "--window", "1", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    row = res["sizes"]["100"]
    # What the benchmark exists to show, at N = 100 (1% of ranks silent: one): no steady-state traffic, the culprits named, O(1) init.
    assert row["steady"]["requests"] == 0, row["steady"]
    assert row["diagnosis"]["named_silent_exactly"] and row["diagnosis"]["named_behind_exactly"], row["diagnosis"]
    assert row["diagnosis"]["silent"] >= 1, row["diagnosis"]
    assert res["comm_init"]["4"]["per_rank"] <= 6, res["comm_init"]
    assert res["real_job"]["requests"] == 0 and res["real_job"]["steps"] > 0, res["real_job"]

"""What a job leaves behind, and what the tools print of untrusted files (issue 32, items 10, 11, 13): a clean
job leaves nothing in a folder made for it, old job folders are pruned, `nccl-pg trace` escapes what a dump says."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

from harness.procs import clean_env

from nccl_pg.diagnostics import jobs_folder

CLEAN = '''\
import numpy as np
import nccl_pg as dist
dist.init_process_group("host", init_method="env://")
dist.all_reduce(np.ones(4, np.float32))
dist.destroy_process_group()
'''


def test_a_clean_job_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(CLEAN)
    env = clean_env({"TMPDIR": str(tmp_path), "NCCL_PG_RUNTIME_DIR": str(tmp_path / "run")})
    res = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "run", "--nproc", "2", str(tmp_path / "job.py")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res
    private = tmp_path / f"nccl_pg-{os.getuid()}"
    assert not list(private.glob("job-*")), list(private.rglob("*"))
    assert not list((tmp_path / "run").glob("run-*.json"))


def test_old_job_folders_are_pruned_beyond_the_newest(tmp_path: Path) -> None:
    old = time.time() - 3600
    for i in range(25):
        d = tmp_path / f"job-{i:02d}"
        d.mkdir()
        os.utime(d, (old + i, old + i))
    (tmp_path / "job-live").mkdir()  # written to now: a job that runs
    (tmp_path / "not-a-job").mkdir()
    gone = jobs_folder.prune(keep=20, parent=str(tmp_path))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert sorted(Path(p).name for p in gone) == [f"job-{i:02d}" for i in range(6)]
    assert "job-live" in left and "not-a-job" in left and len([n for n in left if n.startswith("job-")]) == 20


def test_trace_escapes_what_a_dump_says(tmp_path: Path) -> None:
    """A dump is untrusted: its host, reason and stack strings reach the terminal escaped (no ESC, BEL, OSC)."""
    evil = "\x1b]0;owned\x07\x1b[2J"
    for r in range(2):
        (tmp_path / f"trace_{r}").write_bytes(pickle.dumps({
            "version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg" + evil, "ranks": "[0, 1]"}},
            "pg_status": {}, "entries": [], "rank": r, "pid": 100 + r, "host": "h" + evil, "reason": "why" + evil,
            "threads": {f"MainThread ({r})": [f'  File "/x{evil}.py", line 3, in f\n    pass\n']}}))
    res = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "trace", str(tmp_path), "--ranks", "0", "1"],
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout, repr(res.stdout)
    assert "\\x1b" in res.stdout, res.stdout

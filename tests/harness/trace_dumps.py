"""Dumps for the tests of ``nccl-pg trace`` (tests/test_trace_*.py,
test_stragglers.py): worlds of fresh interpreters that write them (the
library's own dumps, on real faults), dumps built by hand to PyTorch's
documented layout, and running the command on a folder in the test's
process."""

from __future__ import annotations

import json
import pickle
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from harness.procs import run_scripts
from nccl_pg.cli import main as cli

PRELUDE = '''
import os, sys, time
import numpy as np
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
prefix = os.environ["DUMP_PREFIX"]

def wait_for(paths, timeout=30.0):
    end = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > end:
            raise TimeoutError(f"missing some of {paths} after {timeout} s")
        time.sleep(0.05)
'''

NCCL_PG = '''
import nccl_pg as dist
from nccl_pg.diagnostics.flight_recorder import dump_flight_recorder, dump_flight_recorder_json
store = dist.FileStore(os.environ["TEST_STORE"], world)
'''


def spawn_world(body: str, world: int, directory: Path, env: Mapping[str, str] | None = None,
                timeout: float = 45.0) -> list[tuple[int, str]]:
    """Run ``body`` in ``world`` interpreters (RANK, WORLD_SIZE, TEST_STORE,
    DUMP_PREFIX set; dumps go to ``directory``); each rank's (exit code,
    output). Ranks still running at ``timeout`` are killed."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory.parent / f"{directory.name}.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    fixed = {"TEST_STORE": str(directory.parent / f"{directory.name}.store"),
             "DUMP_PREFIX": str(directory / "trace_"), "NCCL_PG_DEBUG_INFO_TEMP_FILE": str(directory / "trace_"),
             "NCCL_PG_ASYNC_ERROR_HANDLING": "0"}
    return run_scripts(script, world, {**fixed, **(env or {})}, timeout=timeout)


def run_trace(directory: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``nccl-pg trace DIR ARGS`` in this process: (exit status, stdout)."""
    capsys.readouterr()
    code = cli.main(["trace", str(directory), *args])
    return code, capsys.readouterr().out


def report_of(directory: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code, out = run_trace(directory, "--json", *args, capsys=capsys)
    return code, json.loads(out)


def problems(report: Mapping[str, Any], kind: str) -> list[dict[str, Any]]:
    return [p for p in report["problems"] if p["kind"] == kind]


# --- hand-built dumps (PyTorch's documented layout, no torch needed) -------------------------------


def entry(record_id: int, seq: int, name: str = "nccl:all_reduce", state: str = "completed",
          sizes: Any = ((4,),), dtype: str = "Float", p2p_seq: int = 0, pg: tuple[str, str] = ("0", "default_pg"),
          **extra: Any) -> dict[str, Any]:
    """One entry as PyTorch's recorder (version 2.10) writes it."""
    e = {"record_id": record_id, "pg_id": 0, "process_group": pg, "thread_name": "MainThread", "thread_id": 1,
         "collective_seq_id": seq, "p2p_seq_id": p2p_seq, "op_id": record_id + 1, "profiling_name": name,
         "time_created_ns": 1_700_000_000_000_000_000 + record_id * 1000, "input_sizes": [list(s) for s in sizes],
         "input_dtypes": [dtype] * len(sizes), "output_sizes": [list(s) for s in sizes],
         "output_dtypes": [dtype] * len(sizes), "state": state, "time_discovered_started_ns": None,
         "time_discovered_completed_ns": None, "retired": state == "completed", "timeout_ms": 600000,
         "is_p2p": " " in name, "frames": []}
    e.update(extra)
    return e


def torch_dump(entries: list[dict[str, Any]], ranks: str = "[0, 1, 2]",
               groups: Mapping[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """A whole dump as torch's ``_dump_nccl_trace`` pickles it."""
    groups = groups or {"0": ("default_pg", ranks)}
    return {"version": "2.10", "comm_lib_version": "2.21.5",
            "pg_config": {n: {"name": n, "desc": d, "ranks": r} for n, (d, r) in groups.items()},
            "pg_status": {"0": {"last_enqueued_collective": max((e["collective_seq_id"] for e in entries), default=-1),
                                "last_started_collective": -1, "last_completed_collective": -1}},
            "entries": entries}


def write(directory: Path, dumps: Mapping[int, dict[str, Any]], prefix: str = "nccl_trace_rank_") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, d in dumps.items():
        (directory / f"{prefix}{rank}").write_bytes(pickle.dumps(d))
    return directory


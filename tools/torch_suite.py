"""torch's own distributed test suite (``DistributedTest``, shipped in the torch
wheel) run on gloo and on nccl_pg, and compared.

Each configuration (process-group backend x world size) runs in a worker
process. The suite's decisions stay those it makes for gloo (``BACKEND=gloo``:
which tests skip, which branches run); in the nccl_pg configuration every
process group a test creates with gloo (or with the default) is created with
``backend="nccl_pg"`` instead. Each test spawns its ranks as torch's
``MultiProcessTestCase`` does; a test that runs past ``--deadline`` seconds is
stopped (the suite kills its ranks; if the worker itself stops making
progress, this driver kills the worker, records the test as ``timeout`` and
goes on with the next).

Printed: counts per configuration, and per world size the tests that pass on
one backend and not on the other (with the reason the other gave). Exit
status 1 when a test passes on gloo and not on nccl_pg, unless it is a listed
exception (``EXPECTED``, each with its reason).

    python3 tools/torch_suite.py [--world-sizes 2 3] [--backends gloo nccl_pg] [-k SUBSTR ...]
                                 [--tests NAME ...] [--deadline 120] [--jobs 1] [--json out.json]

Needs torch and expecttest (torch's test utilities import it); run from the
repository root with the checkout on PYTHONPATH (``make torch-suite``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

_MODE = "NCCL_PG_TORCH_SUITE"  # set in a worker and the ranks it spawns: "gloo" or "nccl_pg"
_START = "NCCL_PG_TORCH_SUITE_START"  # how a test starts its ranks: "fork" or "spawn"
_SLACK = 60.0  # the worker's own bookkeeping beyond a test's deadline before the driver steps in

# Tests that pass on gloo and cannot pass on nccl_pg, each with its reason.
EXPECTED: dict[str, str] = {
    "test_get_backend": "asserts dist.get_backend() is the suite's BACKEND ('gloo'); ours says 'nccl_pg'",
}


# --- in a worker and its ranks: the suite, with nccl_pg standing in for gloo ------------------------


def _to_nccl_pg(backend: Any) -> Any:
    """``backend`` with gloo replaced by nccl_pg (also inside "cpu:gloo,cuda:nccl")."""
    if backend is None:
        return None
    parts = [p.split(":") for p in str(backend).lower().split(",")]
    return ",".join(":".join([*p[:-1], "nccl_pg" if p[-1] == "gloo" else p[-1]]) for p in parts)


def _use_nccl_pg() -> None:
    """Every group the suite creates with gloo is created with nccl_pg."""
    import functools

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import nccl_pg.torch  # noqa: F401 - registers the backend (an installed package does it at `import torch`)

    init, new = c10d.init_process_group, c10d._new_group_with_tag

    @functools.wraps(init)
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        return init(_to_nccl_pg(backend), *args, **kwargs)

    @functools.wraps(new)
    def new_group_with_tag(ranks: Any = None, timeout: Any = None, backend: Any = None, *args: Any,
                           **kwargs: Any) -> Any:
        return new(ranks, timeout, _to_nccl_pg(backend), *args, **kwargs)

    c10d.init_process_group = dist.init_process_group = init_process_group
    c10d._new_group_with_tag = new_group_with_tag


if os.environ.get(_MODE):
    # The suite reads these at import; the driver sets them for the worker, the ranks inherit them.
    os.environ["BACKEND"] = "gloo"
    os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())
    import torch
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    if os.environ[_MODE] == "nccl_pg":
        _use_nccl_pg()

    class TorchSuite(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc, name-defined]
        """One test of the suite: its ranks are spawned processes."""

        def setUp(self) -> None:
            super().setUp()
            if os.environ.get(_START) == "spawn":
                self._spawn_processes()
            else:  # forked from this worker, which imported torch and the suite once
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def _worker(names: Sequence[str], out_path: str) -> None:
    """Run ``names`` one by one; one JSON line per test start and end in ``out_path``."""
    import unittest

    suite_cls = globals()["TorchSuite"]

    class Result(unittest.TestResult):
        def __init__(self) -> None:
            super().__init__()
            self.outcome: tuple[str, str] = ("pass", "")

        def addFailure(self, test: Any, err: Any) -> None:  # noqa: N802 (unittest's names)
            self.outcome = ("fail", _last_line("".join(traceback.format_exception(*err))))

        def addError(self, test: Any, err: Any) -> None:  # noqa: N802
            self.outcome = ("error", _last_line("".join(traceback.format_exception(*err))))

        def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:  # noqa: N802
            if err is not None and self.outcome[0] == "pass":
                self.outcome = ("fail", f"{subtest}: {_last_line(''.join(traceback.format_exception(*err)))}")

        def addSkip(self, test: Any, reason: str) -> None:  # noqa: N802
            self.outcome = ("skip", reason)

        def addExpectedFailure(self, test: Any, err: Any) -> None:  # noqa: N802
            self.outcome = ("pass", "expected failure")

        def addUnexpectedSuccess(self, test: Any) -> None:  # noqa: N802
            self.outcome = ("fail", "unexpected success")

    with open(out_path, "a", buffering=1) as out:
        for name in names:
            out.write(json.dumps({"start": name}) + "\n")
            result, began = Result(), time.monotonic()
            suite_cls(name).run(result)
            status, detail = result.outcome
            out.write(json.dumps({"test": name, "status": status, "detail": detail[:300],
                                  "seconds": round(time.monotonic() - began, 2)}) + "\n")


def _last_line(text: str) -> str:
    """The exception line of a formatted traceback (the suite's failure messages end there)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if not ln.startswith(" ") and ("Error" in ln or "Exception" in ln)]
    return (errors[-1] if errors else lines[-1] if lines else "").strip()


# --- the driver ---------------------------------------------------------------------------------


@dataclass
class Config:
    backend: str
    world_size: int
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.backend} x{self.world_size}"


def _worker_env(backend: str, world_size: int, deadline: float, temp: str, start: str = "fork") -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env.update({_MODE: backend, _START: start, "WORLD_SIZE": str(world_size), "TEMP_DIR": temp,
                "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(int(deadline)),
                "PYTHONPATH": root + os.pathsep + env.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
    return env


def list_tests() -> list[str]:
    """The suite's test names (a worker lists them: the suite only imports with its variables set)."""
    with tempfile.TemporaryDirectory() as temp:
        out = subprocess.run([sys.executable, __file__, "--list"], env=_worker_env("gloo", 2, 60, temp),
                             capture_output=True, text=True, timeout=300, check=True).stdout
    return out.split()


def run_config(cfg: Config, names: list[str], deadline: float, start: str, log: Any) -> None:
    """Run ``names`` in a worker; a worker that stops making progress is
    killed, its test recorded as a timeout, and a new one goes on."""
    left = list(names)
    with tempfile.TemporaryDirectory(prefix="nccl_pg-suite-") as temp:
        out_path = os.path.join(temp, "results.jsonl")
        while left:
            open(out_path, "w").close()
            proc = subprocess.Popen([sys.executable, __file__, "--worker", out_path, *left],
                                    env=_worker_env(cfg.backend, cfg.world_size, deadline, temp, start),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            seen, current, last = 0, None, time.monotonic()
            while True:
                time.sleep(0.5)
                with open(out_path) as f:
                    lines = [json.loads(ln) for ln in f if ln.endswith("\n")]
                for rec in lines[seen:]:
                    last = time.monotonic()
                    if "start" in rec:
                        current = rec["start"]
                        continue
                    current = None
                    cfg.results[rec["test"]] = rec
                    left.remove(rec["test"])
                    log(f"[{cfg.name}] {rec['test']}: {rec['status']} ({rec['seconds']} s)")
                seen = len(lines)
                if proc.poll() is not None:
                    if current is not None:  # the worker died inside a test
                        _record(cfg, left, current, "error", f"worker exited with {proc.returncode}", log)
                    elif left and seen == 0:
                        raise RuntimeError(f"{cfg.name}: the worker exited with {proc.returncode} before "
                                           "running a test (is expecttest installed?)")
                    break
                if current is not None and time.monotonic() - last > deadline + _SLACK:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    _record(cfg, left, current, "timeout", f"no result after {deadline + _SLACK:.0f} s", log)
                    break


def _record(cfg: Config, left: list[str], name: str, status: str, detail: str, log: Any) -> None:
    cfg.results[name] = {"test": name, "status": status, "detail": detail, "seconds": None}
    left.remove(name)
    log(f"[{cfg.name}] {name}: {status} ({detail})")


def compare(configs: list[Config]) -> tuple[str, int]:
    """The report, and how many tests pass on gloo and not on nccl_pg outside ``EXPECTED``."""
    lines, unexpected = [], 0
    for cfg in configs:
        counts = Counter(r["status"] for r in cfg.results.values())
        lines.append(f"{cfg.name}: " + ", ".join(f"{counts[s]} {s}" for s in
                                                  ("pass", "fail", "error", "timeout", "skip")))
    by = {(c.backend, c.world_size): c for c in configs}
    for ws in sorted({c.world_size for c in configs}):
        gloo, ours = by.get(("gloo", ws)), by.get(("nccl_pg", ws))
        if gloo is None or ours is None:
            continue
        for a, b in ((gloo, ours), (ours, gloo)):
            diff = sorted(t for t, r in a.results.items()
                          if r["status"] == "pass" and b.results.get(t, {}).get("status") != "pass")
            lines.append(f"\nworld size {ws}: {len(diff)} pass on {a.backend}, not on {b.backend}")
            for t in diff:
                other = b.results.get(t, {"status": "not run", "detail": ""})
                why = f"  [expected: {EXPECTED[t]}]" if a is gloo and t in EXPECTED else ""
                lines.append(f"  {t}: {other['status']}: {other['detail']}{why}")
                if a is gloo and t not in EXPECTED:
                    unexpected += 1
    return "\n".join(lines), unexpected


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--backends", nargs="+", default=["gloo", "nccl_pg"], choices=["gloo", "nccl_pg"])
    ap.add_argument("-k", dest="keywords", action="append", default=[], help="run tests whose name contains this")
    ap.add_argument("--tests", nargs="+", default=[], help="run these tests (exact names)")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds one test may run (default 120)")
    ap.add_argument("--jobs", type=int, default=1, help="configurations run at once (default 1)")
    ap.add_argument("--start-method", choices=["fork", "spawn"], default="fork",
                    help="how a test starts its ranks: fork (default: fast, the worker imported torch once) or "
                         "spawn (as PyTorch's CI, ~5 s more per test)")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("-q", "--quiet", action="store_true", help="no line per test")
    args = ap.parse_args(argv)

    names = args.tests or list_tests()
    if args.keywords:
        names = [n for n in names if any(k in n for k in args.keywords)]
    configs = [Config(b, ws) for ws in args.world_sizes for b in args.backends]
    lock = threading.Lock()

    def log(msg: str) -> None:
        if not args.quiet:
            with lock:
                print(msg, flush=True)

    began = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        for job in [pool.submit(run_config, c, names, args.deadline, args.start_method, log) for c in configs]:
            job.result()
    report, unexpected = compare(configs)
    print(f"\n{len(names)} tests, {len(configs)} configurations, {time.monotonic() - began:.0f} s\n{report}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({c.name: c.results for c in configs}, f, indent=1, sort_keys=True)
    return 1 if unexpected else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--list"]:
        print("\n".join(sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test_"))))
    elif sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[3:], sys.argv[2])
    else:
        sys.exit(main())

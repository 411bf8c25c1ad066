"""torchft's own tests (shipped in the torchft wheel) run with its Gloo groups,
and with nccl_pg's adapter in their place, and compared.

The test files that use torchft's ``ProcessGroupGloo``/``ProcessGroupBabyGloo``
(FILES) run under pytest twice: as shipped, and with the plugin
tools/torchft_on_nccl_pg.py, which puts ``ProcessGroupNcclPg`` and
``ProcessGroupBabyNcclPg`` in their place. Each run is a pytest process of its
own (``--timeout`` per test); a run that dies (a signal, "terminate called")
is reported as a crash with its test, as is one where nccl_pg's exit hook
found threads still inside a store's call (what made such runs abort). Printed: the counts per configuration,
the tests that pass on one and not on the other (with the other's reason),
and the crashes. Exit status 1 when a test passes with Gloo and not with
nccl_pg outside the listed exceptions (``EXPECTED``, each with its reason),
or when any run crashed.

    python3 tools/torchft_suite.py [--backends gloo nccl_pg] [--files F ...] [-k EXPR] [--timeout 120]
                                   [--repeat N] [--json out.json]

``--repeat N`` runs each configuration N times (the exit-crash check of
issue 31: a process that aborts at interpreter exit shows up as a crash).
Run from the repository root with the checkout on PYTHONPATH
(``make torchft-suite``); needs torchft and parameterized.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

import torchft

FILES = ["process_group_test.py", "local_sgd_integ_test.py", "lighthouse_test.py", "parameter_server_test.py",
         "manager_integ_test.py", "checkpointing/pg_transport_test.py"]
TOOLS = Path(__file__).resolve().parent
_PARAM_INDEX = re.compile(r"_\d+_")
ROOT = TOOLS.parent

# Tests that pass with Gloo and cannot with nccl_pg, each with its reason (docs/TORCH.md).
EXPECTED: dict[str, str] = {
    "ProcessGroupTest::test_gloo_timeout": "matches Gloo's exact words for a peer that never comes, torch's store "
    "wait with the whole 10 ms ('timeout after 10ms'); ours name the missing rank and quote the store's words with "
    "the time that was left of the init's deadline ('wait timeout after 9ms')",
}


def run(backend: str, files: list[str], keyword: str | None, timeout: float, workdir: Path) -> dict[str, Any]:
    """One pytest run of ``files`` on ``backend``: {"tests": {id: (outcome, detail)}, "crash": str | None}."""
    base = Path(torchft.__file__).resolve().parent
    report = workdir / f"{backend}.xml"
    plugin = ["-p", "torchft_on_nccl_pg"] if backend == "nccl_pg" else []
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, f"--timeout={timeout:g}",
            f"--junitxml={report}", "-o", "junit_family=xunit1", *(str(base / f) for f in files)]
    if keyword:
        argv += ["-k", keyword]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TOOLS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_TESTRUNUID", None)
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    tests: dict[str, tuple[str, str]] = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            # parameterized.expand numbers its cases in an order that may differ between processes: drop it
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{_PARAM_INDEX.sub('_', case.get('name', ''), 1)}"
            outcome, detail = "pass", ""
            for kind in ("failure", "error", "skipped"):
                node = case.find(kind)
                if node is not None:
                    outcome = "skip" if kind == "skipped" else "fail"
                    detail = (node.get("message") or node.text or "").strip().splitlines()[0][:300] \
                        if (node.get("message") or node.text) else kind
                    break
            tests[name] = (outcome, detail)
    crash = None
    left = "still in a store call at exit" in out  # nccl_pg's exit hook found threads inside a store's call
    if proc.returncode < 0 or "terminate called" in out or proc.returncode not in (0, 1, 5) or left:
        crash = f"exit status {proc.returncode}" + ("; terminate called (SIGABRT)" if "terminate called" in out else "")
        crash += "; threads still inside torch's store at exit (what aborts a process)" if left else ""
        crash += f"; last output: {out.strip()[-600:]}"
    return {"tests": tests, "crash": crash}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=["gloo", "nccl_pg"], choices=["gloo", "nccl_pg"])
    ap.add_argument("--files", nargs="+", default=FILES, help="torchft's test files, relative to its package")
    ap.add_argument("-k", dest="keyword", help="pytest's -k expression")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per test (pytest-timeout)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration (crash check)")
    ap.add_argument("--json", help="write the results there")
    args = ap.parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="torchft-suite-") as tmp:
        for backend in args.backends:
            for i in range(args.repeat):
                workdir = Path(tmp) / f"{backend}-{i}"
                workdir.mkdir()
                res = run(backend, args.files, args.keyword, args.timeout, workdir)
                results.setdefault(backend, []).append(res)
                counts = Counter(o for o, _ in res["tests"].values())
                print(f"{backend} run {i + 1}/{args.repeat}: {counts['pass']} pass, {counts['fail']} fail, "
                      f"{counts['skip']} skip" + (f"; CRASH: {res['crash']}" if res["crash"] else ""), flush=True)
    status = 0
    crashes = [(b, r["crash"]) for b, runs in results.items() for r in runs if r["crash"]]
    for backend, why in crashes:
        print(f"crash ({backend}): {why}")
        status = 1
    if {"gloo", "nccl_pg"} <= set(results):
        gloo, ours = results["gloo"][0]["tests"], results["nccl_pg"][0]["tests"]
        for name in sorted(set(gloo) | set(ours)):
            g, o = gloo.get(name, ("absent", "")), ours.get(name, ("absent", ""))
            if g[0] == "pass" and o[0] != "pass":
                expected = EXPECTED.get(name)
                print(f"gloo only: {name}: nccl_pg {o[0]}: {o[1]}" + (f" [expected: {expected}]" if expected else ""))
                if not expected:
                    status = 1
            elif o[0] == "pass" and g[0] != "pass":
                print(f"nccl_pg only: {name}: gloo {g[0]}: {g[1]}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())

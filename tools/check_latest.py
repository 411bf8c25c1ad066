"""Drift check (`make check-latest`, issue 30): what would the newest releases change?

The suite is validated against the versions in tools/pins/; a fresh clone installs exactly those. This tool
installs the newest releases instead (all but ``--keep``, which stay pinned) in a scratch virtual environment,
runs the CPU suite there, and reports which versions moved and which tests fail. The pins are known to pass (CI
runs them), so a failure here is what a newer release breaks. Exit status: 0 when the suite passes on the newest
releases, 1 when some test fails, 2 when the scratch environment could not be built.

    python tools/check_latest.py --venv build/latest-venv --cuda-major 13 --extras test,test-cu13,torch,torchft,docs
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "tools" / "pins"


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(*files: Path) -> dict[str, str]:
    """``name==version`` lines of constraints files (comments and blank lines skipped), by canonical name."""
    pins: dict[str, str] = {}
    for path in files:
        for number, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, version = line.partition("==")
            if not sep or not name.strip() or not version.strip():
                raise ValueError(f"{path}:{number}: not a `name==version` pin: {raw!r}")
            pins[canonical(name.strip())] = version.strip()
    return pins


@dataclass(frozen=True)
class Move:
    name: str
    pinned: str | None  # None: installed, but pinned nowhere
    latest: str


def moves(pins: dict[str, str], installed: dict[str, str]) -> list[Move]:
    """The installed distributions whose version is not their pin, or that have none (versions compared without
    a local label: the pin ``torch==2.13.0`` is met by ``2.13.0+cpu``, as pip's constraint is). Pins of what
    this install does not contain (another extra's) are not moves."""
    out = []
    for name, latest in sorted(installed.items()):
        pinned = pins.get(name)
        if pinned is None or latest.split("+", 1)[0] != pinned.split("+", 1)[0]:
            out.append(Move(name, pinned, latest))
    return out


@dataclass(frozen=True)
class Failure:
    test: str
    kind: str  # failure or error
    message: str


def failures(junit_xml: str) -> tuple[int, list[Failure]]:
    """(tests run, the failed or errored ones) from pytest's JUnit XML."""
    root = ET.fromstring(junit_xml)
    cases = root.iter("testcase")
    found, total = [], 0
    for case in cases:
        total += 1
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                message = (node.get("message") or node.text or "").strip().splitlines()
                found.append(Failure(test, kind, message[0][:300] if message else ""))
    return total, found


def report(move_list: list[Move], total: int, failed: list[Failure], keep: list[str]) -> str:
    lines = ["# make check-latest", "", "## Versions that moved (pinned -> newest)", ""]
    for m in move_list:
        if m.pinned is None:
            lines.append(f"- {m.name}: not pinned -> {m.latest} (new dependency: pin it)")
        else:
            lines.append(f"- {m.name}: {m.pinned} -> {m.latest}")
    if not move_list:
        lines.append("- none: the pins are the newest releases")
    if keep:
        lines.append(f"- kept at their pins: {', '.join(keep)}")
    lines += ["", f"## Tests on the newest releases: {total} run, {len(failed)} failed", ""]
    lines += [f"- {f.test} ({f.kind}): {f.message}" for f in failed] or ["- none failed"]
    return "\n".join(lines) + "\n"


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, text=True, **kwargs)  # type: ignore[call-overload, no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=ROOT / "build" / "latest-venv")
    parser.add_argument("--cuda-major", choices=("12", "13"), default="13")
    parser.add_argument("--extras", default="test,test-cu13,torch,torchft,docs")
    parser.add_argument("--keep", default="torch", help="names (comma or space separated) that stay pinned")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (0: one process)")
    parser.add_argument("--pytest-args", default="", help="more arguments for pytest, e.g. '-k store'")
    args = parser.parse_args(argv)

    pins = read_pins(PINS / "common.txt", PINS / f"cu{args.cuda_major}.txt")
    keep = [canonical(k) for k in re.split(r"[,\s]+", args.keep) if k]
    unknown = [k for k in keep if k not in pins]
    if unknown:
        parser.error(f"--keep names packages tools/pins/ does not pin: {', '.join(unknown)}")
    venv = args.venv.resolve()
    python = str(venv / "bin" / "python")
    if run([sys.executable, "-m", "venv", "--clear", str(venv)]).returncode:
        return 2
    kept = venv / "kept-pins.txt"
    kept.write_text("".join(f"{k}=={pins[k]}\n" for k in keep))
    install = [python, "-m", "pip", "install", "-q", "--upgrade", "--upgrade-strategy", "eager",
               "-e", f"{ROOT}[{args.extras}]", "-c", str(kept)]
    if run(install, cwd=ROOT).returncode:
        print("check-latest: the newest releases do not install together (pip's error above)", file=sys.stderr)
        return 2
    listed = run([python, "-m", "pip", "list", "--format=json", "--exclude-editable"], capture_output=True)
    installed = {canonical(d["name"]): d["version"] for d in json.loads(listed.stdout) if d["name"] != "pip"}
    junit = venv / "junit.xml"
    # The check that the suite runs on the pins fails by design here: the versions that moved are reported above.
    pytest = [python, "-m", "pytest", "-q", "--gpu-skips-only", f"--junitxml={junit}", "-p", "no:cacheprovider",
              "--deselect", "tests/test_pins.py::test_the_suite_runs_on_the_pinned_versions"]
    if args.workers:
        pytest += ["-n", str(args.workers)]
    pytest += args.pytest_args.split()
    run(pytest, cwd=ROOT)
    if not junit.exists():
        print("check-latest: pytest wrote no report (it failed before running tests)", file=sys.stderr)
        return 2
    total, failed = failures(junit.read_text())
    text = report(moves(pins, installed), total, failed, keep)
    (venv / "report.md").write_text(text)
    print("\n" + text + f"\n(also in {venv / 'report.md'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

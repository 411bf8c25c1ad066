"""tools/gpu_check.sh --plan (no GPU): call 1 fits one device call of 8
minutes, and every stage's command exists: its pytest node ids collect, its
`nccl-pg bench`/`doctor` and tools/*.py arguments parse, its shell functions
are defined. A renamed test or option fails here, not on the lent GPU."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nccl_pg.cli import bench, doctor

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"
LIMIT = 480  # seconds: one device call that ends within 8 minutes


@dataclass
class Stage:
    name: str
    budget: int
    proves: str
    command: str = ""


@dataclass
class Call:
    number: int
    stages: list[Stage] = field(default_factory=list)
    total: int = 0


@pytest.fixture(scope="module")
def plan() -> dict[int, Call]:
    proc = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    calls: dict[int, Call] = {}
    call: Call | None = None
    for line in proc.stdout.splitlines():
        if m := re.match(r"call (\d): ", line):
            call = calls.setdefault(int(m.group(1)), Call(int(m.group(1))))
        elif m := re.match(r"call (\d) total: (\d+) s", line):
            calls[int(m.group(1))].total = int(m.group(2))
        elif m := re.match(r"\s+(\d+) s  (\S+)\s+(.*)$", line):
            assert call is not None, line
            call.stages.append(Stage(m.group(2), int(m.group(1)), m.group(3)))
        elif m := re.match(r"\s+\$ (.*)$", line):
            assert call is not None and call.stages, line
            call.stages[-1].command = m.group(1)
    return calls


def test_call_one_fits_one_device_call_of_eight_minutes(plan: dict[int, Call]) -> None:
    one = plan[1]
    assert sum(s.budget for s in one.stages) == one.total <= LIMIT
    names = [s.name for s in one.stages]
    assert names[:2] == ["wheels", "setup"] and names[2] == "doctor"  # the module load on that driver first
    for needed in ("world1", "same_gpu_multirank", "same_gpu_hostid", "skip_named", "abort_stuck", "destroy_graph",
                   "nan_gbps", "overhead", "bandwidth"):
        assert needed in names
    assert names.index("same_gpu_hostid") < names.index("skip_named") < names.index("abort_stuck") \
        < names.index("destroy_graph") < names.index("nan_gbps") < names.index("overhead") < names.index("bandwidth")
    slot = next(s for s in one.stages if s.name == "family")
    assert slot.proves.startswith("SLOT") and "variant A vs B" in slot.proves


def test_call_two_fits_one_device_call(plan: dict[int, Call]) -> None:
    assert sum(s.budget for s in plan[2].stages) == plan[2].total <= LIMIT
    assert {s.name for s in plan[1].stages} & {s.name for s in plan[2].stages} == {"setup"}


def _argv(command: str) -> list[str]:
    words = shlex.split(command.replace("$OUT", "/tmp/out"))
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
        words.pop(0)
    return words


def _pytest_targets(argv: list[str]) -> tuple[str | None, list[str]]:
    """(-m expression, node ids / files) of a `python3 -m pytest ...` command."""
    marker, targets, it = None, [], iter(argv[3:])
    for word in it:
        if word in ("-m", "--junitxml", "-p", "-k", "-o"):
            value = next(it)
            if word == "-m":
                marker = value
        elif not word.startswith("-"):
            targets.append(word)
    return marker, targets


def _collected(targets: list[str], marker: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *targets]
    if marker:
        cmd += ["-m", marker]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def _tool(path: Path) -> Any:
    """A tools/*.py script as a module (each has parse_args(argv))."""
    spec = importlib.util.spec_from_file_location(f"tool_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_stage_command_exists(plan: dict[int, Call]) -> None:
    script = SCRIPT.read_text()
    node_ids: list[str] = []
    marked: dict[str, list[str]] = {}
    for call in plan.values():
        for stage in call.stages:
            if stage.name == "wheels":
                assert "python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl" \
                    in script.split("set -u", 1)[0]  # the README's install line runs before anything else
                continue
            argv = _argv(stage.command)
            assert argv, stage
            if argv[:3] == ["python3", "-m", "pytest"]:
                marker, targets = _pytest_targets(argv)
                assert targets, stage
                if marker:
                    marked.setdefault(marker, []).extend(targets)
                else:
                    node_ids.extend(targets)
            elif argv[:3] == ["python3", "-m", "nccl_pg.cli.main"]:
                p = argparse.ArgumentParser()
                {"bench": bench.add_arguments, "doctor": doctor.add_arguments}[argv[3]](p)
                p.parse_args(argv[4:])  # raises on an unknown option or a bad value
            elif argv[0] == "python3" and argv[1].startswith("tools/"):
                _tool(ROOT / argv[1]).parse_args(argv[2:])
            else:
                assert re.search(rf"^{re.escape(argv[0])}\(\) \{{", script, re.M), f"{stage}: no function {argv[0]}"
    collected = _collected(node_ids, None)
    for node in node_ids:
        assert any(c == node or (("[" not in node) and c.startswith(node + "[")) for c in collected), \
            f"{node} is not a test"
    for marker, files in marked.items():
        found = _collected(files, marker)
        for f in files:
            assert any(c.startswith(f + "::") for c in found), f"no {marker} test in {f}"

"""The versions the suite is validated against live in tools/pins/ (issue 30), and the suite runs on them;
`make check-latest` (tools/check_latest.py) reports what the newest releases would change."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "tools" / "pins"
spec = importlib.util.spec_from_file_location("check_latest", ROOT / "tools" / "check_latest.py")
assert spec and spec.loader
check_latest = sys.modules["check_latest"] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
spec.loader.exec_module(check_latest)


def cuda_major() -> str:
    """The CUDA major this environment was installed for: that of its nvidia-nccl wheel."""
    for major in ("13", "12"):
        try:
            metadata.version(f"nvidia-nccl-cu{major}")
            return major
        except metadata.PackageNotFoundError:
            pass
    raise AssertionError("no nvidia-nccl wheel installed: `make install-test` installs the suite's needs")


def pins(major: str) -> dict[str, str]:
    return check_latest.read_pins(PINS / "common.txt", PINS / f"cu{major}.txt")


def test_the_suite_runs_on_the_pinned_versions() -> None:
    """Every pinned distribution that is installed has its pinned version: the suite's results are those of
    the pins (`make install-test` installs them whatever was released since)."""
    pinned = pins(cuda_major())
    installed = {check_latest.canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    wrong = [m for m in check_latest.moves(pinned, installed) if m.pinned]
    assert not wrong, "installed versions differ from tools/pins/ (run `make install-test`): " + ", ".join(
        f"{m.name} {m.latest} (pinned {m.pinned})" for m in wrong)


@pytest.mark.parametrize("major", ["12", "13"])
def test_every_dependency_of_the_installs_is_pinned(major: str) -> None:
    """The package's dependencies and every extra a `make` target installs are pinned for both CUDA majors, so
    a new dependency cannot slip in unpinned."""
    extras = ("test", f"test-cu{major}", f"cu{major}", "torch", "torchft", "lint", "docs")
    names = set()
    for line in metadata.requires("nccl_pg") or []:  # pyproject.toml's dependencies, as installed
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
            names.add(check_latest.canonical(req.name))
    assert {"numpy", "nccl4py", f"nvidia-nccl-cu{major}", "torch", "hypothesis", "mypy", "sphinx", "build"} <= names
    assert names - set(pins(major)) == set()
    other = "12" if major == "13" else "13"
    assert not any(name.endswith(f"-cu{other}") for name in pins(major)), "one CUDA major per install"


def test_a_malformed_pin_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "pins.txt"
    bad.write_text("numpy==2.4.6\nhypothesis>=6\n")
    with pytest.raises(ValueError, match=r"pins.txt:2: not a `name==version` pin: 'hypothesis>=6'"):
        check_latest.read_pins(bad)


def test_check_latest_reports_moved_versions_and_failed_tests(tmp_path: Path) -> None:
    """The report's two halves from real inputs: version moves (a local label like +cpu meets its pin) and the
    failures in a JUnit file written by a real pytest run."""
    moves = check_latest.moves({"torch": "2.13.0", "nvidia-nccl-cu13": "2.32.3", "gone": "1.0"},
                               {"torch": "2.13.0+cpu", "nvidia-nccl-cu13": "2.32.6", "newdep": "0.1"})
    assert [(m.name, m.pinned, m.latest) for m in moves] == [("newdep", None, "0.1"),
                                                              ("nvidia-nccl-cu13", "2.32.3", "2.32.6")]
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_header():\n    assert 23206 == 23203, 'the stub follows NCCL 2.32.3'\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('no etcd')\n"
        "def test_needs(broken):\n    pass\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nccl_pg",
                    f"--junitxml={junit}", str(tmp_path / "test_some.py")], cwd=tmp_path, capture_output=True,
                   timeout=50)
    total, failed = check_latest.failures(junit.read_text())
    assert total == 3
    assert [(f.test.rsplit("::", 1)[1], f.kind) for f in failed] == [("test_header", "failure"),
                                                                       ("test_needs", "error")]
    text = check_latest.report(moves, total, failed, ["torch"])
    assert "- nvidia-nccl-cu13: 2.32.3 -> 2.32.6\n" in text
    assert "- newdep: not pinned -> 0.1 (new dependency: pin it)" in text
    assert "3 run, 2 failed" in text and "test_header (failure): " in text and "2.32.3" in text
    assert "kept at their pins: torch" in text

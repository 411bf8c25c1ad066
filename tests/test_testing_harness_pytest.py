"""The pytest plugin as a user's suite meets it: a test file written here
is run by a real pytest (a subprocess, with the plugin loaded from its
entry point, as in any project with nccl_pg installed), and its JUnit XML
and output are read: a skipping rank skips the test; too few GPUs skip it
saying so; a failure's verdict lands in JUnit properties and, on GitHub
Actions, in an error annotation at the culprit's line; a warm set of ranks
is reused across tests; the harness's deadline sits inside the test's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from nccl_pg.errors import Culprit
from nccl_pg.testing import RanksFailed, ci_report

pytestmark = pytest.mark.timeout(240)

USER_TESTS = textwrap.dedent('''
    import os
    import unittest

    import numpy as np
    import pytest

    import nccl_pg as dist


    def skipper(rank, world_size):
        if rank == 1:
            raise unittest.SkipTest("rank 1 cannot run this here")
        dist.barrier()


    def raiser(rank, world_size):
        dist.barrier()
        if rank == 1:
            raise ValueError("rank 1 broke")  # <- culprit line


    def total_and_pid(rank, world_size):
        x = np.ones(1)
        dist.all_reduce(x)
        return float(x[0]), os.getpid()


    WARM_PIDS = []


    @pytest.mark.ranks(2)
    def test_skip(process_ranks):
        process_ranks(skipper)


    @pytest.mark.ranks(2)
    def test_fail(process_ranks):
        process_ranks(raiser)


    @pytest.mark.ranks(2, gpus=1000)
    def test_needs_gpus(process_ranks):
        process_ranks(total_and_pid)


    @pytest.mark.ranks(3)
    def test_warm_a(warm_ranks):
        results = warm_ranks(total_and_pid)
        assert [t for t, _ in results] == [3.0, 3.0, 3.0]
        WARM_PIDS.extend(p for _, p in results)


    @pytest.mark.ranks(3)
    def test_warm_b(warm_ranks):
        assert [p for _, p in warm_ranks(total_and_pid)] == WARM_PIDS  # the same processes


    @pytest.mark.timeout(30)
    def test_deadline(request, process_ranks):
        from nccl_pg.testing.pytest_plugin import harness_timeout

        assert harness_timeout(request.node) == 27.0
        assert process_ranks.start(total_and_pid, 1).timeout == 27.0
''')


@pytest.fixture(scope="module")
def user_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, ET.Element], str]:
    """The user's suite, run once for this module's tests: its folder, its
    JUnit test cases by name, and its output."""
    root = tmp_path_factory.mktemp("user_suite")
    (root / "test_user_suite.py").write_text(USER_TESTS)
    env = {**os.environ, "GITHUB_ACTIONS": "true", "GITHUB_WORKSPACE": str(root)}
    for name in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        env.pop(name, None)  # the user's suite is not a worker of ours: it must not take our worker's GPU share
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "--junitxml",
                          str(root / "junit.xml"), "test_user_suite.py"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=200)
    cases = {c.get("name", ""): c for c in ET.parse(root / "junit.xml").getroot().iter("testcase")}
    return root, cases, out.stdout + out.stderr


def test_a_skipping_rank_skips_the_test(user_run: tuple[Path, dict[str, ET.Element], str]) -> None:
    _, cases, output = user_run
    skipped = cases["test_skip"].find("skipped")
    assert skipped is not None, output
    assert "rank 1 cannot run this here (rank 1)" in (skipped.get("message") or ""), output


def test_too_few_gpus_skip_saying_so(user_run: tuple[Path, dict[str, ET.Element], str]) -> None:
    _, cases, output = user_run
    skipped = cases["test_needs_gpus"].find("skipped")
    assert skipped is not None, output
    assert "needs 1000 GPUs; this machine has" in (skipped.get("message") or ""), output


def test_the_verdict_goes_to_junit_and_github(user_run: tuple[Path, dict[str, ET.Element], str]) -> None:
    root, cases, output = user_run
    case = cases["test_fail"]
    assert case.find("failure") is not None, output
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert re.match(r"exception: rank 1 \(\S+, pid \d+\) failed \(exit code 1\): ValueError: rank 1 broke",
                    props["nccl_pg.verdict"] or ""), props
    [culprit] = json.loads(props["nccl_pg.culprits"] or "")
    line = next(i for i, t in enumerate(USER_TESTS.splitlines(), 1) if t.endswith("# <- culprit line"))
    assert (culprit["rank"], culprit["file"], culprit["line"], culprit["function"]) == \
        (1, str(root / "test_user_suite.py"), line, "raiser")
    annotation = f"::error file=test_user_suite.py,line={line},title=exception%3A rank 1 (test_user_suite.py%3A%3A" \
                 f"test_fail)::rank 1: raised ValueError: rank 1 broke (pid {culprit['pid']} on {culprit['host']})"
    assert annotation in output.splitlines(), output


def test_warm_ranks_are_reused_and_the_deadline_fits(user_run: tuple[Path, dict[str, ET.Element], str]) -> None:
    _, cases, output = user_run
    for name in ("test_warm_a", "test_warm_b", "test_deadline"):
        assert not list(cases[name]), (name, output)  # passed: no failure, error or skip element


def test_github_annotation_escapes_and_falls_back() -> None:
    err = RanksFailed("rank 2 failed: 100% broken, a:b\nmore", [2], {},
                      [Culprit(2, "raised X: 100%\nbad", "h", 7, "/repo/a,b.py", 5, "f", kind="exception"),
                       Culprit(3, "still running", "h", 8)])
    props = ci_report.properties(err)
    assert props[0] == ("nccl_pg.verdict", "rank 2 failed: 100% broken, a:b")
    assert ci_report.github_annotations(props, "t.py::x", "/repo") == [
        "::error file=a%2Cb.py,line=5,title=exception%3A rank 2 (t.py%3A%3Ax)::rank 2: raised X: 100%25%0Abad "
        "(pid 7 on h)"]
    # no culprit line inside the repository: one annotation for the test
    assert ci_report.github_annotations(props, "t.py::x", "/elsewhere") == [
        "::error title=t.py%3A%3Ax::rank 2 failed: 100%25 broken, a:b"]

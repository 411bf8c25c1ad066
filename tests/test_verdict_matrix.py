"""The verdict matrix (issue 32): every failure class of the catalogue (nccl_pg/diagnostics/verdicts.py) that a
scenario produces (tests/harness/verdict_scenarios.py) runs through every tool the catalogue says names it, and
they must agree: the same class, the same culprits, in the same words ("<class>: rank N (host, pid P) ...").

One job per class serves the launcher's tools: `nccl-pg why` while it hangs, the survivors' timeout messages, the
launcher's autopsy, then `nccl-pg trace` on the folder it leaves (no job for a class only the harness names); one
run of the same function serves the test harness. The whole matrix takes about two minutes on two cores: `make verdict-matrix` runs it
(NCCL_PG_VERDICT_MATRIX=all); the suite runs a selection (``SUITE``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.procs import clean_env
from harness.verdict_scenarios import ENV, EXPECTED, JOB, PARTIAL, scenario

from nccl_pg.diagnostics.verdicts import CATALOGUE
from nccl_pg.testing import RanksFailed, run_ranks

TESTS = Path(__file__).resolve().parent
SUITE = ("never_joined", "mismatch", "exception", "nan", "aborted")  # in `make test`; all in `make verdict-matrix`
KINDS = list(EXPECTED) if os.environ.get("NCCL_PG_VERDICT_MATRIX") == "all" else list(SUITE)
_TITLES = "|".join(re.escape(c.title) for c in CATALOGUE.values() if c.problem or c.id == "straggler")
_LINE = re.compile(rf"(?P<title>{_TITLES}): rank (?P<rank>\d+) \(")
OP_TIMEOUT = 8.0  # the job's operation timeout: `why` asks well before it, also on a busy machine


def named(text: str) -> set[tuple[str, int]]:
    """(class, rank) of every verdict a tool printed, in the catalogue's words."""
    ids = {c.title: c.id for c in CATALOGUE.values()}
    return {(ids[m["title"]], int(m["rank"])) for m in _LINE.finditer(text)}


def _launcher_tools(kind: str, folder: Path, tools: tuple[str, ...]) -> dict[str, str]:
    """Run the scenario under `nccl-pg run`; what each launcher-side tool printed."""
    world, _ = EXPECTED[kind]
    job_dir = folder / "job"
    job_dir.mkdir()
    (folder / "job.py").write_text(JOB)
    env = clean_env({"TESTS_DIR": str(TESTS), "TEST_DIR": str(job_dir), "KIND": kind, "TMPDIR": str(folder),
                     "NCCL_PG_RUNTIME_DIR": str(folder / "run"),
                     "TIMEOUT": str(60 if kind == "straggler" else OP_TIMEOUT)})
    proc = subprocess.Popen([sys.executable, "-m", "nccl_pg.cli.main", "run", "--nproc", str(world), "--max-time",
                             "40", "--autopsy-time", "4", "--grace-period", "1", "--stall-warning", "0",
                             str(folder / "job.py")], cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out: dict[str, str] = {}
    try:
        if "why" in tools:
            deadline = time.monotonic() + 30
            while not all((job_dir / f"ready.{r}").exists() for r in range(world)):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.02)
            extra = ["--stragglers", "--dump"] if kind == "straggler" else []
            why = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "why", "--job", str(proc.pid), *extra],
                                 env=env, capture_output=True, text=True, timeout=60)
            out["why"] = why.stdout + why.stderr
            if kind == "straggler":
                (job_dir / "done").write_text("")
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
    out["autopsy"] = "\n".join(line for line in err.splitlines() if line.startswith("nccl-pg run:   "))
    out["timeout"] = "\n".join(line.split("verdict: ", 1)[1] for line in err.splitlines()
                               if line.startswith("[rank") and "verdict: " in line)
    folders = sorted((folder / f"nccl_pg-{os.getuid()}").glob("job-*"))
    assert len(folders) == 1, (folders, err)
    res = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "trace", str(folders[0])], capture_output=True,
                         text=True, timeout=60, env=clean_env())
    out["trace"] = res.stdout.split("\nverdicts:\n", 1)[-1] if "\nverdicts:\n" in res.stdout else \
        "\n".join(line for line in res.stdout.splitlines() if "straggler: " in line)
    out["_stderr"] = err
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_every_tool_names_the_class_and_its_culprits_alike(kind: str, tmp_path: Path) -> None:
    world, culprits = EXPECTED[kind]
    tools = CATALOGUE[kind].tools
    expected = {(kind, r) for r in culprits}
    seen = _launcher_tools(kind, tmp_path, tools) if set(tools) - {"harness"} else {}
    if "harness" in tools:
        folder = tmp_path / "harness"
        folder.mkdir()
        with pytest.raises(RanksFailed) as caught:
            run_ranks(scenario, world, timeout=30, op_timeout=3, args=(kind, str(folder)), echo=False,
                      env=ENV.get(kind))
        seen["harness"] = str(caught.value).split("\n(output and dumps in", 1)[0]
    for tool in tools:
        got = named(seen[tool])
        agree = (got and got <= expected) if tool in PARTIAL.get(kind, ()) else got == expected
        assert agree, f"{tool} said {sorted(got)}, not {sorted(expected)}:\n{seen[tool]}\n---\n" \
                      f"{seen.get('_stderr', '')[-4000:]}"


# (its dump's reason, how it ended) -> why it failed as a victim ("": it did not, or is not known to have).
VICTIMS = {
    "own exception, dumped at another's failure": (
        "signalled: failure on group 0: all_reduce #2 failed: lost the connection to rank 1",
        "raised ValueError: rank 1 broke", ""),
    "own NaN, dumped at another's timeout": ("signalled: timeout of all_reduce #2", "raised NanError: NaN in input", ""),
    "its own timeout": ("timeout: all_reduce #2 ran for 8.0 s", "raised DistBackendError: timeout: ...",
                        "its operation timed out"),
    "dumped at another's timeout, exited": ("signalled: timeout of all_reduce #2 of group 0", "exited with code 1",
                                            "its operation timed out"),
    "its group aborted, still running": ("group 0 aborted by rank 2", "", "its group was aborted"),
    "no dump reason": ("", "raised DistError: store closed", ""),
}


@pytest.mark.parametrize("case", list(VICTIMS))
def test_a_rank_that_raised_its_own_exception_is_no_victim(case: str) -> None:
    """A rank's dump reason makes it a victim (it failed because of another), unless it ended raising an exception
    that is not a distributed error: a rank that raised on its own and dumped at the others' request while it
    unwound is the culprit (before, `trace` called such a rank stuck in user code "and then raised", at random)."""
    from nccl_pg.diagnostics.classify import victim_of

    reason, gone, expected = VICTIMS[case]
    assert victim_of(reason, gone) == expected

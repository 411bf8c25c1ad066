"""The examples in examples/ run as their docstrings say, and do what they claim: the training loop converges to
the weights one process computes on all of the data, on every rank alike; DDP on the "nccl_pg" backend ends with
the same parameters on every rank; the hierarchical all-reduce equals a flat one; the pytest CI file passes on the
host backend and its NCCL tests skip only for want of GPUs. The GPU variants (CuPy on NCCL, CUDA tensors) are
gpu-marked. examples/elastic.py has its own tests (test_elastic.py, test_nccl_sim_reconfigure.py)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from nccl_pg.comm.backends import gpu_count

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NCCL_PG = str(Path(sys.executable).parent / "nccl-pg")


def clean_env(tmp_path: Path) -> dict[str, str]:
    """This environment without the suite's nccl_pg/torch settings and pytest-xdist identity; dumps in tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_PG_", "TORCH_NCCL_", "PYTEST_XDIST_"))}
    env["NCCL_PG_DEBUG_INFO_TEMP_FILE"] = str(tmp_path / "trace_")
    return env


def launch(tmp_path: Path, nproc: int, *args: str) -> str:
    """``nccl-pg run --nproc N examples/...``: its output, after checking that every rank exited 0."""
    p = subprocess.run([NCCL_PG, "run", "--nproc", str(nproc), "--max-time", "100", *args], cwd=ROOT,
                       env=clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def need_gpus(n: int) -> None:
    if gpu_count() < n:
        pytest.skip(f"needs {n} GPUs; this machine has {gpu_count()}")


# --- train.py: a plain training loop (numpy on the host backend; CuPy on NCCL) ---------------------------------


def check_training(out: str, world: int) -> None:
    finals = re.findall(r"\[rank(\d)\]: final loss ([0-9.]+) \(first ([0-9.]+)\); weights ([0-9a-f]+); "
                        r"max \|w - one process's w\| = ([0-9.e+-]+)", out)
    assert sorted(int(f[0]) for f in finals) == list(range(world)), out
    assert len({f[1:4] for f in finals}) == 1, f"the ranks' weights differ:\n{out}"  # same loss and checksum
    rank, last, first, _, distance = finals[0]
    assert float(last) < float(first) / 1000, out
    assert float(distance) < 1e-4, out
    assert re.search(r"\[rank0\]: step 0: loss ", out) and not re.search(r"\[rank[1-9]\]: step", out), out


def test_train_on_the_host_backend(tmp_path: Path) -> None:
    check_training(launch(tmp_path, 2, "examples/train.py", "--steps", "60"), 2)


@pytest.mark.gpu
def test_train_with_cupy_on_nccl(tmp_path: Path) -> None:
    need_gpus(2)
    check_training(launch(tmp_path, 2, "examples/train.py", "--steps", "60", "--backend", "nccl"), 2)


# --- ddp.py: torch DDP on the "nccl_pg" backend ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ddp(tmp_path: Path, *args: str) -> list[str]:
    """examples/ddp.py on 2 ranks started as a launcher that sets torch's env:// variables would (rank 0 hosts
    torch's store): each rank's output."""
    env = {**clean_env(tmp_path), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(EXAMPLES / "ddp.py"), *args], cwd=tmp_path, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    return outs


def check_ddp(outs: list[str]) -> None:
    finals = [re.findall(r"^final loss ([0-9.]+); parameters ([0-9a-f]+); backend (\S+)$", o, re.M) for o in outs]
    assert all(len(f) == 1 for f in finals) and finals[0] == finals[1], outs  # the same parameters on both ranks
    assert finals[0][0][2] == "nccl_pg", outs
    losses = [float(v) for v in re.findall(r"^epoch \d+: loss ([0-9.]+)$", outs[0], re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0] / 2, outs[0]


def test_ddp_on_the_nccl_pg_backend(tmp_path: Path) -> None:
    check_ddp(run_ddp(tmp_path))


@pytest.mark.gpu
def test_ddp_with_cuda_tensors(tmp_path: Path) -> None:
    need_gpus(2)
    check_ddp(run_ddp(tmp_path, "--cuda"))


# --- hierarchical_allreduce.py: subgroups ---------------------------------------------------------------------


def check_hierarchical(out: str, groups: dict[int, str]) -> None:
    lines = dict(re.findall(r"^\[rank(\d)\]: rank \d: (.*)$", out, re.M))
    assert {int(r): v for r, v in lines.items()} == groups, out


def test_hierarchical_all_reduce_with_subgroups(tmp_path: Path) -> None:
    out = launch(tmp_path, 4, "examples/hierarchical_allreduce.py", "--local-size", "2", "--size", "4096")
    tail = "2 nodes x 2: equal to a flat all_reduce"
    check_hierarchical(out, {0: f"node [0, 1], rail [0, 2]; {tail}", 1: f"node [0, 1], rail [1, 3]; {tail}",
                             2: f"node [2, 3], rail [0, 2]; {tail}", 3: f"node [2, 3], rail [1, 3]; {tail}"})


@pytest.mark.gpu
def test_hierarchical_all_reduce_on_nccl(tmp_path: Path) -> None:
    need_gpus(4)
    out = launch(tmp_path, 4, "examples/hierarchical_allreduce.py", "--local-size", "2", "--backend", "nccl")
    assert out.count("2 nodes x 2: equal to a flat all_reduce") == 4, out


# --- test_distributed_ci.py: a pytest CI file on the harness -----------------------------------------------------


def run_ci_file(tmp_path: Path, *select: str) -> dict[str, tuple[str, str]]:
    """pytest on examples/test_distributed_ci.py, as a user's CI runs it: {test: (outcome, skip reason)}."""
    junit = tmp_path / "junit.xml"
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "--junitxml",
                        str(junit), str(EXAMPLES / "test_distributed_ci.py"), *select], cwd=ROOT,
                       env=clean_env(tmp_path), capture_output=True, text=True, timeout=130)
    assert p.returncode == 0, p.stdout + p.stderr
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        skipped = case.find("skipped")
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "skipped" if skipped is not None else "failed" if failed else "passed"
        results[case.get("name", "")] = (outcome, skipped.get("message", "") if skipped is not None else "")
    return results


def expected_on(gpus: int) -> dict[str, tuple[str, str]]:
    """The host tests pass; each NCCL one passes with a GPU per rank, or skips saying how many GPUs it needs."""
    def nccl(n: int) -> tuple[str, str]:
        return ("passed", "") if gpus >= n else ("skipped", f"needs {n} GPUs; this machine has {gpus}")

    return {"test_gradients_are_averaged[host]": ("passed", ""), "test_gradients_are_averaged[nccl]": nccl(2),
            "test_broadcast_inside_subgroups[host]": ("passed", ""), "test_broadcast_inside_subgroups[nccl]": nccl(4),
            "test_a_stuck_rank_is_named": ("passed", "")}


def check_ci_results(results: dict[str, tuple[str, str]], expected: dict[str, tuple[str, str]]) -> None:
    """The same tests and outcomes; a skip's reason starts as expected (the GPUs' ids may follow)."""
    assert {k: v[0] for k, v in results.items()} == {k: v[0] for k, v in expected.items()}, results
    assert all(results[k][1].startswith(v[1]) for k, v in expected.items()), results


def test_the_ci_example_runs_on_the_host_and_skips_only_for_gpus(tmp_path: Path) -> None:
    check_ci_results(run_ci_file(tmp_path), expected_on(gpu_count()))


@pytest.mark.gpu
def test_the_ci_example_on_gpus(tmp_path: Path) -> None:
    need_gpus(2)
    check_ci_results(run_ci_file(tmp_path, "-k", "nccl"),
                     {k: v for k, v in expected_on(gpu_count()).items() if "nccl" in k})

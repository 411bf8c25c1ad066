"""`nccl-pg bench`, `nccl-pg doctor` and tools/bench_nccl_compare.py: the
host-backend benchmark end to end (ranks, --check, table, nccl-tests' bus
bandwidth formulas, --json, --overhead), argument errors, doctor on a machine
without a GPU, the comparison tool's --help; the NCCL paths under marker gpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nccl_pg.cli import bench, bench_cases, bench_report, doctor
from nccl_pg.cli import main as cli
from nccl_pg.comm import backends

ROOT = Path(__file__).resolve().parent.parent
COMPARE = ROOT / "tools" / "bench_nccl_compare.py"
RUN_TIMEOUT = 60
no_gpu = pytest.mark.skipif(backends.gpu_count() > 0, reason="this machine has a GPU")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_cli(*argv: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout, env=_env(), stdin=subprocess.DEVNULL, cwd=ROOT)


def table_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


# --- pure functions ------------------------------------------------------------------


@pytest.mark.parametrize("raw,value", [("8", 8), ("1K", 1024), ("4k", 4096), ("1M", 1 << 20), ("2G", 2 << 30),
                                       ("1KB", 1024), ("64B", 64)])
def test_parse_size(raw: str, value: int) -> None:
    assert bench.parse_size(raw) == value


@pytest.mark.parametrize("op,n,factor", [("all_reduce", 4, 1.5), ("all_reduce", 1, 0.0), ("all_gather", 4, 0.75),
                                         ("reduce_scatter", 2, 0.5), ("all_to_all", 8, 0.875),
                                         ("broadcast", 4, 1.0), ("reduce", 4, 1.0), ("send_recv", 2, 1.0)])
def test_busbw_factor_is_nccl_tests(op: str, n: int, factor: float) -> None:
    assert bench_report.busbw_factor(op, n) == pytest.approx(factor)


def test_layout_counts_per_rank_like_nccl_tests() -> None:
    assert bench_cases.layout("all_reduce", 1024, 4, 4) == bench_cases.Layout(256, 256, 256)
    assert bench_cases.layout("all_gather", 1024, 4, 4) == bench_cases.Layout(64, 64, 256)
    assert bench_cases.layout("reduce_scatter", 1024, 4, 4) == bench_cases.Layout(64, 256, 64)
    assert bench_cases.layout("all_to_all", 1000, 3, 4) == bench_cases.Layout(83, 249, 249)
    assert bench_cases.layout("all_gather", 8, 3, 4).count == 0  # too small: skipped
    assert bench_cases.layout("all_gather", 1024, 4, 4).nbytes(4) == 1024


def test_checker_counts_wrong_elements() -> None:
    want = bench_cases.reduce_expected([bench_cases.pattern(r, 100, np.dtype("float32"), "sum") for r in range(3)],
                                       "sum", np.dtype("float32"))
    got = want.copy()
    assert bench_cases.count_wrong(got, want) == 0
    got[[0, 50, 99]] += 1
    assert bench_cases.count_wrong(got, want) == 3
    ints = bench_cases.pattern(1, 10, np.dtype("int8"), "prod")
    assert bench_cases.count_wrong(ints, ints) == 0 and set(np.unique(ints)) <= {1, 2}


def test_case_check_sees_a_corrupted_result() -> None:
    import nccl_pg as dist
    from nccl_pg.store import HashStore

    dist.init_process_group("host", store=HashStore(), rank=0, world_size=1, timeout=30)
    try:
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
            mode = bench_cases.MODES[op][0]
            case = bench_cases.Case(op, mode, bench_cases.layout(op, 256, 1, 4), 0, 1, np.dtype("float32"), "sum", 0,
                                    np)
            case.fill_inputs()
            case.issue().wait()
            assert case.wrong() == 0, op
            case.recv[5] = -7
            assert case.wrong() == 1, op
    finally:
        dist.destroy_process_group()


# --- the benchmark on the host backend -----------------------------------------------


@pytest.mark.parametrize("op,nproc", [("all_reduce", 2), ("all_gather", 3), ("reduce_scatter", 2),
                                      ("broadcast", 2), ("reduce", 2), ("all_to_all", 2), ("send_recv", 2)])
def test_bench_host_checks_and_reports(op: str, nproc: int, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "--backend", "host", "--nproc", str(nproc), "--op", op, "-b", "64", "-e", "4K", "-f", "8",
                   "-w", "1", "-n", "3", "--check", "--root", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Out of bounds values : 0 OK" in proc.stdout
    rows = table_rows(proc.stdout)
    modes = bench_cases.MODES[op]
    assert [int(r[0]) for r in rows] == [bench_cases.layout(op, s, nproc, 4).nbytes(4) for s in (64, 512, 4096)]
    for r in rows:
        assert len(r) == 5 + 4 * len(modes)
        size, count, dtype = int(r[0]), int(r[1]), r[2]
        assert dtype == "float" and count == bench_cases.layout(op, size, nproc, 4).count
        for k in range(len(modes)):
            t_us, algbw, busbw, wrong = r[5 + 4 * k: 9 + 4 * k]
            assert wrong == "0"
            assert float(algbw) == pytest.approx(size / float(t_us) / 1e3, abs=1.5e-3, rel=1e-2)
    data = json.loads(out.read_text())
    assert data["machine"]["nccl_pg"] and len(data["results"]) == 3 * len(modes)
    for row in data["results"]:
        assert row["op"] == op and row["nranks"] == nproc and row["wrong"] == 0 and row["mode"] in modes
        assert len(row["time_us_ranks"]) == nproc
        assert row["time_us"] == pytest.approx(sum(row["time_us_ranks"]) / nproc)
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * bench_report.busbw_factor(op, nproc))


def test_bench_host_overhead_mode_and_types(tmp_path: Path) -> None:
    out = tmp_path / "oh.json"
    proc = run_cli("bench", "--backend", "host", "--nproc", "2", "-b", "1K", "-e", "1K", "-w", "5", "-n", "50",
                   "--overhead", "--check", "-d", "half", "-o", "max", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "issue(us)" in proc.stdout
    (row,) = json.loads(out.read_text())["results"]
    assert row["type"] == "half" and row["redop"] == "max" and row["wrong"] == 0
    issue = row["issue_us"]
    assert 0 < issue["min"] <= issue["p50"] <= issue["p99"]


def test_bench_one_rank_inplace_only(tmp_path: Path) -> None:
    proc = run_cli("bench", "--backend", "host", "--op", "all_gather", "--inplace", "-b", "1K", "-e", "1K", "-n", "2",
                   "-c")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "in-place" in proc.stdout and "out-of-place" not in proc.stdout
    (row,) = table_rows(proc.stdout)
    assert row[-1] == "0" and float(row[-2]) == 0.0  # one rank: busbw factor 0 for all_gather


@pytest.mark.parametrize("argv,message", [
    (["-b", "1X"], "expected a size such as 8, 1K, 4M or 1G"),
    (["-b", "1K", "-e", "8"], "-e/--maxbytes (8) is smaller than -b/--minbytes (1024)"),
    (["-f", "1"], "the size factor must be >= 2"),
    (["-n", "0"], "must be in 1.."),
    (["-w", "x"], "expected an integer"),
    (["--op", "gather"], "invalid choice: 'gather'"),
    (["--op", "send_recv"], "--op send_recv needs at least 2 ranks"),
    (["--op", "broadcast", "--out-of-place"], "--op broadcast has no out-of-place variant"),
    (["--op", "all_to_all", "--inplace"], "--op all_to_all has no in-place variant"),
    (["--inplace", "--out-of-place"], "not allowed with argument"),
    (["-d", "float128"], "unknown type 'float128'"),
    (["-o", "avg", "-d", "int32"], "-o avg needs a floating-point type"),
    (["--op", "all_gather", "-o", "max"], "-o/--redop applies to all_reduce, reduce_scatter and reduce"),
    (["--nproc", "2", "--root", "2", "--op", "broadcast"], "--root 2 is not a rank of --nproc 2"),
    (["--timeout", "0"], "must be a finite duration > 0 s"),
    (["--graph"], "--graph captures CUDA graphs: it needs --backend nccl"),
])
def test_bench_refuses_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--backend", "host", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_plot_without_matplotlib_is_a_clear_error(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else real(name))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--backend", "host", "--plot", "x.png"])
    assert exc.value.code == 2
    assert "--plot needs matplotlib, which is not installed" in capsys.readouterr().err


@no_gpu
def test_bench_nccl_without_gpu_is_refused(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--backend", "nccl"])
    assert exc.value.code == 2
    assert "--backend nccl needs an NVIDIA GPU, and none was found; use --backend host" in capsys.readouterr().err


# --- doctor --------------------------------------------------------------------------


@no_gpu
def test_doctor_without_gpu_reports_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    proc = run_cli("doctor", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no GPU" in proc.stdout and " 0 failed (no GPU: GPU probes skipped)" in proc.stdout
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert results["nccl_pg"]["status"] == "ok" and results["host sanity"]["status"] == "ok"
    assert results["gpus"]["status"] == "skip" and results["nccl sanity"]["status"] == "skip"
    assert results["kernels"]["status"] in ("skip", "ok", "FAIL")


def test_doctor_isolates_a_failing_probe(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: doctor.Doctor) -> tuple[str, str]:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(doctor.Doctor, "python", boom)
    monkeypatch.setattr(doctor.Doctor, "host_sanity", lambda self: (doctor.OK, "stubbed"))
    assert cli.main(["doctor", "--no-sanity"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] python         RuntimeError: driver exploded" in out
    assert "host sanity" in out.split("[FAIL] python")[1]  # later probes still ran
    assert "1 failed" in out and "failed: python" in out


# --- the comparison tool ---------------------------------------------------------------


def test_compare_tool_help_and_import_safety() -> None:
    proc = subprocess.run([sys.executable, str(COMPARE), "--help"], capture_output=True, text=True, timeout=30,
                          env=_env())
    assert proc.returncode == 0 and "raw nccl4py" in proc.stdout and "--bw-op" in proc.stdout
    code = (f"import runpy, sys; runpy.run_path({str(COMPARE)!r}, run_name='not_main'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'torch', 'nccl', 'cuda')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


@no_gpu
def test_compare_tool_without_gpu_says_so() -> None:
    proc = subprocess.run([sys.executable, str(COMPARE), "--quick"], capture_output=True, text=True, timeout=30,
                          env=_env())
    assert proc.returncode == 2 and "no GPU found" in proc.stderr


# --- the NCCL paths (a lent GPU machine) -------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(backends.gpu_count() == 0, reason="needs a GPU")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"])
def test_gpu_bench_one_rank(op: str, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    proc = run_cli("bench", "--backend", "nccl", "--op", op, "-b", "8", "-e", "1M", "-f", "16", "-n", "5", "--check",
                   "--json", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(r["wrong"] == 0 for r in json.loads(out.read_text())["results"])


@pytest.mark.gpu
@pytest.mark.skipif(backends.gpu_count() == 0, reason="needs a GPU")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_gpu_bench_graph_replays(nproc: str, tmp_path: Path) -> None:
    """--graph: the ops captured into a CUDA graph replay with correct results."""
    out = tmp_path / "g.json"
    proc = run_cli("bench", "--backend", "nccl", "--nproc", nproc, "--graph", "-b", "1K", "-e", "1M", "-f", "32",
                   "-n", "10", "--check", "--json", str(out), timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)


@pytest.mark.gpu
@pytest.mark.skipif(backends.gpu_count() == 0, reason="needs a GPU")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "send_recv"])
def test_gpu_bench_two_ranks_one_gpu(op: str, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    proc = run_cli("bench", "--backend", "nccl", "--nproc", "2", "--op", op, "-b", "1K", "-e", "64K", "-f", "8", "-w",
                   "1", "-n", "3", "--check", "--timeout", "120", "--json", str(out), timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(r["wrong"] == 0 and r["nranks"] == 2 for r in json.loads(out.read_text())["results"])


@pytest.mark.gpu
@pytest.mark.skipif(backends.gpu_count() == 0, reason="needs a GPU")
@pytest.mark.timeout(300)
def test_gpu_doctor_passes(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    proc = run_cli("doctor", "--json", str(out), timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert results["gpus"]["status"] == "ok" and results["nccl"]["status"] == "ok"
    assert any(name.startswith("nccl sanity ") and r["status"] == "ok" for name, r in results.items())


@pytest.mark.gpu
@pytest.mark.skipif(backends.gpu_count() == 0, reason="needs a GPU")
@pytest.mark.timeout(600)
def test_gpu_compare_tool_runs(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, str(COMPARE), "--peers", "nccl_pg", "raw", "--iters", "200", "--rounds",
                           "1", "--repeat", "1", "--bw-max", "4M", "--json", str(out)], capture_output=True, text=True,
                          timeout=580, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    merged = json.loads(out.read_text())["merged"]
    assert "overhead_us" in merged["nccl_pg"] and "overhead_us" in merged["raw"]

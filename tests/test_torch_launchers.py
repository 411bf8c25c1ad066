"""Where torch users already are (issue 31, items 1 and 2): a real torchrun
(torch 2.13's ``torch.distributed.run``, whose agent hosts torch's TCPStore
for the ranks) running nccl_pg's API on the host backend and on the NCCL
backend (simulated NCCL: tests/simnccl), and torch's API on the "nccl_pg"
backend and on Gloo over an nccl_pg store; and torch code on Gloo and on
"nccl_pg" under ``nccl-pg run``, whose store serves torch's own clients.
Each job is one launcher run whose ranks do every step in turn (a launcher
start costs seconds); a step that fails fails the rank, and the test shows
its output.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harness.procs import clean_env
from test_why import TORCH_JOB

pytest.importorskip("torch", reason="the torchrun and torch-script tests need PyTorch (pip install torch)")

pytestmark = pytest.mark.timeout(180)
TESTS = Path(__file__).resolve().parent

# The README's example (nccl_pg's API, env://), then the NCCL backend on the simulation, then torch's API.
TORCHRUN_JOB = '''\
import os, sys
import numpy as np
import nccl_pg
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
total = n * (n + 1) / 2

nccl_pg.init_process_group("host", timeout=60)           # the README's example
x = np.full(4, rank + 1.0)
nccl_pg.all_reduce(x)
assert (x == total).all(), x
nccl_pg.destroy_process_group()

sys.path.insert(0, os.environ["TESTS_DIR"])                # the NCCL backend, on simulated NCCL
import simnccl
simnccl.install()
simnccl.select_device(int(os.environ["LOCAL_RANK"]))
nccl_pg.init_process_group("nccl", timeout=60)
y = simnccl.xp.asarray(np.full(4, rank + 1.0))
nccl_pg.all_reduce(y)
assert (y.get() == total).all(), y.get()
nccl_pg.destroy_process_group()
assert not simnccl.violations(), simnccl.violations()

import torch, torch.distributed as dist                   # torch's API on the "nccl_pg" backend
dist.init_process_group("nccl_pg")
t = torch.full((3,), rank + 1.0)
dist.all_reduce(t)
sub = dist.new_group([0, 1])
dist.all_reduce(t, group=sub)
assert (t == 2 * total).all(), t
dist.destroy_process_group()

from nccl_pg.store import PrefixStore                     # Gloo on nccl_pg's env:// store (item 2)
from nccl_pg.store.rendezvous import rendezvous
from nccl_pg.torch import as_torch_store
ours = rendezvous("env://").store
dist.init_process_group("gloo", store=as_torch_store(PrefixStore("gloo", ours)), rank=rank, world_size=n)
t = torch.full((2,), rank + 1.0)
dist.all_reduce(t)
assert (t == total).all(), t
dist.destroy_process_group()
print(f"OK {rank} {type(ours).__name__}", flush=True)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(argv: list[str], tmp_path: Path, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = clean_env({"TESTS_DIR": str(TESTS), "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


def test_nccl_pg_and_torch_apis_under_torchrun(tmp_path: Path) -> None:
    """torchrun --nproc-per-node 2: env:// finds torchrun's agent store (torch's TCPStore server) and speaks
    its protocol, for nccl_pg's host and NCCL backends and for torch's API, with no store of its own."""
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_JOB)
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(_free_port()), str(script)], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    # (the two ranks' lines may interleave on torchrun's stdout)
    assert sorted(re.findall(r"OK (\d) (TorchWireStore|\w+)", res.stdout)) == [
        ("0", "TorchWireStore"), ("1", "TorchWireStore")], out[-6000:]
    assert "Traceback" not in out and "frame #" not in out, out[-6000:]  # no C++ backtrace at exit (item 7)


# torch code under nccl-pg run: Gloo, then the "nccl_pg" backend, as a torch user writes them.
TORCH_SCRIPT = '''\
import os
import torch, torch.distributed as dist
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
for backend in ("gloo", "nccl_pg"):
    dist.init_process_group(backend)
    t = torch.full((3,), rank + 1.0)
    dist.all_reduce(t)
    assert (t == n * (n + 1) / 2).all(), (backend, t)
    dist.barrier()
    dist.destroy_process_group()
print(f"OK {rank}", flush=True)
'''


def test_torch_script_under_nccl_pg_run(tmp_path: Path) -> None:
    """`nccl-pg run --nproc 2` runs torch's env:// (Gloo, and the "nccl_pg" backend): the launcher's store
    serves torch's own clients (loopback), as torchrun's agent store does."""
    script = tmp_path / "job.py"
    script.write_text(TORCH_SCRIPT)
    res = _run([sys.executable, "-m", "nccl_pg.cli.main", "run", "--nproc", "2", str(script)], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert sorted(line for line in res.stdout.splitlines() if "OK" in line) == ["[rank0]: OK 0", "[rank1]: OK 1"]
    assert "Traceback" not in out and "frame #" not in out, out[-6000:]




def test_why_finds_a_torch_job_under_nccl_pg_run(tmp_path: Path) -> None:
    """A torch job on the "nccl_pg" backend under `nccl-pg run`: `nccl-pg why` finds it from the launcher's
    record, without --torch, and names rank 1 (its groups live in torch's namespace of the store)."""
    script = tmp_path / "job.py"
    script.write_text(TORCH_JOB)  # (test_why's torch job: rank 1 stuck in eval_step)
    # Its own runtime folder: `why` must see this job's record alone, not those of jobs other tests run beside it.
    env = clean_env({"TEST_DIR": str(tmp_path), "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1",
                     "NCCL_PG_RUNTIME_DIR": str(tmp_path / "run")})
    run = subprocess.Popen([sys.executable, "-m", "nccl_pg.cli.main", "run", "--nproc", "2", "--autopsy-time", "0",
                            str(script)], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready.{r}").exists() for r in range(2)):
            assert run.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        res = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "why", "--json"], env=env,
                             capture_output=True, text=True, timeout=60)
    finally:
        run.terminate()
        run.wait(30)
    data = json.loads(res.stdout or "{}")
    assert res.returncode == 1, res.stderr
    assert data["verdicts"][0]["ranks"] == [1], data["verdicts"]
    assert data["ranks"]["1"]["where"]["func"] == "eval_step", data["ranks"]["1"]


def test_torch_init_on_an_nccl_pg_store(tmp_path: Path) -> None:
    """``init_process_group(backend, store=as_torch_store(nccl_pg.TCPStore(...)))`` in two processes, with
    Gloo and then with "nccl_pg": the usual ``store=`` pattern with our store (torch wraps it in its
    PrefixStores; subgroups too)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent('''\
        import sys
        import torch, torch.distributed as dist
        import nccl_pg
        from nccl_pg.torch import as_torch_store
        rank, port = int(sys.argv[1]), int(sys.argv[2])
        store = nccl_pg.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=60)
        for backend in ("gloo", "nccl_pg"):
            dist.init_process_group(backend, store=as_torch_store(nccl_pg.PrefixStore(backend, store)), rank=rank,
                                    world_size=2)
            t = torch.full((2,), rank + 1.0)
            dist.all_reduce(t)
            dist.all_reduce(t, group=dist.new_group([0, 1]))
            assert (t == 6).all(), (backend, t)
            dist.destroy_process_group()
        print("OK", flush=True)
        '''))
    port = _free_port()
    env = clean_env({"OMP_NUM_THREADS": "1"})
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(o.strip().endswith("OK") for o in outs), outs


def test_nccl_pg_torch_imported_before_torch() -> None:
    """``import nccl_pg.torch...`` as a process's first import (a spawned subprocess unpickling torchft's
    ProcessGroupBabyNcclPg does so): torch, imported by it, runs our entry point on a half-imported module,
    which must leave the registration to the module's end rather than fail."""
    code = ("import nccl_pg.torch.torchft\nimport torch.distributed as d\n"
            "assert 'NCCL_PG' in d.Backend._plugins\nprint('registered')\n")
    res = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout == "registered\n", res.stderr[-3000:]

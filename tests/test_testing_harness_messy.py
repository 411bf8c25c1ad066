"""The process harness (nccl_pg.testing) in the cases issue 32 found wrong: torch code in a rank (item 8), a script
calling run_ranks at module level (item 8), a rank dying by SIGSEGV with a grandchild in its own session and a rank
printing tens of megabytes (item 14), and what `nccl-pg trace` makes of the folder a failed run leaves: where a rank
that raised is, and dumps older than the incident (item 4)."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from harness.procs import clean_env

import nccl_pg as dist
from nccl_pg.diagnostics import jobs_folder
from nccl_pg.process_tree import alive
from nccl_pg.testing import RanksFailed, rank_main, run_ranks

HERE = Path(__file__).resolve()


def _line_of(marker: str) -> int:
    return next(i for i, line in enumerate(HERE.read_text().splitlines(), 1) if marker in line and "_line_of" not in line)


def torch_all_reduce(rank: int, world_size: int) -> list[float]:
    import torch
    import torch.distributed as tdist

    import nccl_pg.torch  # noqa: F401 - registers the "nccl_pg" backend

    tdist.init_process_group("nccl_pg")  # env:// as a user writes it: the harness gives MASTER_ADDR, MASTER_PORT
    t = torch.ones(2) * (rank + 1)
    tdist.all_reduce(t)
    if rank == 1 and world_size == 3:
        time.sleep(300)  # <- rank 1 sleeps in torch code
    tdist.all_reduce(t)
    tdist.destroy_process_group()
    return t.tolist()


@pytest.mark.timeout(120)
def test_torch_code_in_run_ranks_passes_and_a_torch_hang_names_only_its_culprit() -> None:
    """A rank function that uses torch.distributed on the nccl_pg backend, with env:// and no port of its own, runs
    under run_ranks; when rank 1 of 3 then hangs, the torch group times out at the harness's operation timeout (not
    torch's 30 minutes) and the verdict names rank 1 alone, at its line."""
    pytest.importorskip("torch", reason="needs torch (make install-test installs its CPU build)")
    assert run_ranks(torch_all_reduce, 2, timeout=60) == [[6.0, 6.0], [6.0, 6.0]]
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as caught:
        run_ranks(torch_all_reduce, 3, timeout=40, op_timeout=3)
    err = caught.value
    assert time.monotonic() - t0 < 40
    assert err.ranks == [1], str(err)
    [culprit] = err.culprits
    assert (culprit.file, culprit.line, culprit.kind) == (str(HERE), _line_of("# <- rank 1 sleeps in torch code"),
                                                         "stuck_in_user_code"), str(err)
    assert str(err).startswith("stuck in user code: rank 1 ("), str(err)


NESTED = '''\
from nccl_pg.testing import run_ranks


def f(rank, world_size):
    return rank


print(run_ranks(f, 2, timeout=30))  # no `if __name__ == "__main__":` guard
'''


@pytest.mark.timeout(60)
def test_run_ranks_at_module_level_is_refused_naming_the_missing_guard(tmp_path: Path) -> None:
    """A script calling run_ranks at module level: each rank imports the main module and would start ranks again;
    the nested call is refused at once with an error that names the missing guard (not a 30 s timeout blaming every
    rank)."""
    (tmp_path / "script.py").write_text(NESTED)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(tmp_path / "script.py")], capture_output=True, text=True, timeout=50,
                         cwd=tmp_path, env=clean_env())
    assert res.returncode != 0 and time.monotonic() - t0 < 25, res
    assert "was called while a rank imported" in res.stderr and 'if __name__ == \\"__main__\\":' in res.stderr \
        or 'if __name__ == "__main__":' in res.stderr, res.stderr[-3000:]


def segv_with_a_grandchild(rank: int, world_size: int, folder: str) -> None:
    if rank == 1:
        code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
                "time.sleep(300)'], start_new_session=True); open(sys.argv[1] + '.tmp', 'w').write(str(p.pid)); "
                "__import__('os').rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(300)")
        subprocess.Popen([sys.executable, "-c", code, os.path.join(folder, "grandchild")])
        while not os.path.exists(os.path.join(folder, "grandchild")):
            time.sleep(0.01)
        sys.stdout.write(("x" * 99 + "\n") * 300_000)  # 30 MB of output
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(300)


@pytest.mark.timeout(90)
def test_a_rank_dying_by_sigsegv_leaves_nothing_and_big_output_costs_little(tmp_path: Path) -> None:
    """Rank 1 starts a child that starts a grandchild in a session of its own, prints 30 MB and dies by SIGSEGV
    (it cannot end its descendants): after the run nothing of it is left (found by the job's id in their
    environment); the harness holds only a bounded tail of its output in memory."""
    tracemalloc.start()
    try:
        with pytest.raises(RanksFailed) as caught:
            run_ranks(segv_with_a_grandchild, 2, timeout=30, args=(str(tmp_path),), echo=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.ranks == [1] and "SIGSEGV" in str(caught.value), str(caught.value)[:2000]
    grandchild = int((tmp_path / "grandchild").read_text())
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)
    assert peak < 16 << 20, peak  # 30 MB printed: held as a tail (1 MiB), not whole


def raise_after_a_collective(rank: int, world_size: int) -> None:
    x = np.ones(4, np.float32)
    dist.all_reduce(x)
    if rank == 1:
        raise ValueError("rank 1 broke")  # <- rank 1 raises here
    dist.all_reduce(x)


def _dump_while_unwinding(folder: Path, rank: int, like: int) -> None:
    """``rank``'s dump as it is when another's failure signal reaches it after its test function raised (its
    exception unwound into the harness: its stack shows only the harness's entry, <string>:1), made from rank
    ``like``'s: its operations up to the one it completed last, its pid from the run's endings."""
    d = pickle.loads((folder / f"nccl_pg_trace_rank_{like}").read_bytes())
    ending = jobs_folder.read_endings(str(folder))[d["job"]][rank]
    done = d["pg_status"]["0"]["last_completed_collective"]
    d.update(rank=rank, pid=ending.pid, time=d["time"] + 0.01,
             reason=f"signalled: failure on group 0: all_reduce #{done + 1} failed: lost the connection to rank {rank}",
             entries=[e for e in d["entries"] if e["collective_seq_id"] <= done],
             pg_status={"0": {**d["pg_status"]["0"], "last_enqueued_collective": done}},
             groups=[{**g, "rank": rank, "issued": done, "pending": []} for g in d["groups"]],
             threads={"MainThread (1)": ['  File "<string>", line 1, in <module>\n',
                                         f'  File "{rank_main.__file__}", line 202, in main\n']})
    (folder / f"nccl_pg_trace_rank_{rank}").write_bytes(pickle.dumps(d))


@pytest.mark.timeout(90)
def test_trace_on_a_failed_runs_folder_places_a_raised_rank_and_reads_old_dumps_as_old(tmp_path: Path) -> None:
    """A run where rank 1 raises: `nccl-pg trace` on the folder it leaves names its exception at the line it raised
    (from how the harness says each rank ended), not at the harness's entry (<string>:1), also when rank 1 dumped
    at the others' failure signal after its exception unwound (a race: made to happen when the run did not show
    it), and places it there in the report's text too. Made older than the rest
    (as a rank that dumped at another's first failure and went on), the others' dumps read as where they were: their
    all_reduce in flight is a note, not the first collective that did not complete."""
    with pytest.raises(RanksFailed) as caught:
        run_ranks(raise_after_a_collective, 3, timeout=30, op_timeout=3, dump_dir=tmp_path)
    assert caught.value.ranks == [1]
    res = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "trace", str(tmp_path)], capture_output=True,
                         text=True, timeout=60, env=clean_env())
    raised = rf"exception: rank 1 \(\S+, pid \d+\) raised ValueError: rank 1 broke.*; at {re.escape(str(HERE))}:" \
             rf"{_line_of('# <- rank 1 raises here')} in raise_after_a_collective"
    assert re.search(raised, res.stdout), res.stdout
    assert "<string>" not in res.stdout, res.stdout
    if not (tmp_path / "nccl_pg_trace_rank_1").exists():  # the race the run may have lost: made to happen
        _dump_while_unwinding(tmp_path, rank=1, like=0)
    res = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "trace", str(tmp_path)], capture_output=True,
                         text=True, timeout=60, env=clean_env())
    assert re.search(raised, res.stdout) and "<string>" not in res.stdout, res.stdout
    assert re.search(rf"rank 1 \(host \S+, pid \d+\) is in no operation: it is at {re.escape(str(HERE))}:\d+ in "
                     "raise_after_a_collective, where it raised the exception it ended on", res.stdout), res.stdout
    for r in (0, 2):  # their dumps, 10 s older than rank 1's
        path = tmp_path / f"nccl_pg_trace_rank_{r}"
        d = pickle.loads(path.read_bytes())
        d["time"] -= 10
        path.write_bytes(pickle.dumps(d))
    res = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "trace", str(tmp_path)], capture_output=True,
                         text=True, timeout=60, env=clean_env())
    assert "first collective that did not complete anywhere" not in res.stdout, res.stdout
    assert re.search(r"note: all_reduce #2 on group '0' .* it was in flight when they dumped, 10\.\d s or more "
                     r"before the newest dump of this job or their own end: not known to be stuck", res.stdout), res.stdout

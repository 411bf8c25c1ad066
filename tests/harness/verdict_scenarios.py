"""One scenario per failure class of the verdict catalogue (nccl_pg/diagnostics/verdicts.py), for the matrix test
(tests/test_verdict_matrix.py): the same rank function runs under the test harness (``run_ranks``) and under
`nccl-pg run` (``JOB`` calls it), so that every tool sees the same failure.

``scenario(rank, world_size, kind, folder)``: ``folder`` is where a rank says it is in place (``ready.<rank>``, for
`nccl-pg why`) and where the test says to finish (``done``, for the straggler, which does not fail).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import time

import numpy as np

import nccl_pg as dist

# What each class's scenario blames: {class: (world size, culprit ranks)}. In the cross-group deadlock of
# never_joined, each group holds up the other, and in the point-to-point deadlock each side the other: a timeout
# message speaks for its own group or side, and the side that times out second may see its peer gone first (a
# lost connection, no timeout), so the timeout messages and the harness (which reads them) name one culprit or
# both (PARTIAL); the tools that see the whole job name both.
EXPECTED = {
    "stuck_in_user_code": (3, [1]),
    "stuck_in_c": (3, [1]),
    "never_joined": (3, [1, 2]),
    "dead": (3, [1]),
    "mismatch": (3, [1]),
    "p2p_deadlock": (2, [0, 1]),
    "no_answer": (3, [1]),
    "straggler": (3, [2]),
    "exception": (3, [1]),
    "nan": (3, [1]),  # run with NCCL_PG_NAN_CHECK=raise (ENV)
    "aborted": (3, [1]),
}
ENV = {"nan": {"NCCL_PG_NAN_CHECK": "raise"}}
PARTIAL = {"never_joined": ("timeout", "harness"), "p2p_deadlock": ("timeout", "harness")}


def _ready(folder: str) -> None:
    name = pathlib.Path(folder) / f"ready.{dist.get_rank()}"
    tmp = pathlib.Path(folder) / f".ready.{dist.get_rank()}"
    tmp.write_text(str(os.getpid()))
    tmp.rename(name)


def _wait_then_ready(work: dist.Work, folder: str) -> None:
    _ready(folder)
    work.wait()


def scenario(rank: int, world_size: int, kind: str, folder: str) -> None:
    x = np.ones(4, np.float32)
    dist.all_reduce(x)
    if kind == "straggler":
        for _ in range(6):
            if rank == 2:
                time.sleep(0.1)  # rank 2's slow step
            dist.all_reduce(x)
        _ready(folder)
        while not os.path.exists(os.path.join(folder, "done")):
            time.sleep(0.05)
        return
    if kind == "never_joined":  # the groups' orders differ: rank 1 enters the pair's collective, rank 2 the world's
        pair = dist.new_group([1, 2])
        if rank in (1, 2):
            dist.all_reduce(x, group=pair)  # its communicator made: what follows waits in collectives, not in init
        if rank == 1:
            _wait_then_ready(dist.all_reduce(x, group=pair, async_op=True), folder)
        else:
            _wait_then_ready(dist.all_reduce(x, async_op=True), folder)
        return
    if kind == "p2p_deadlock":  # both receive first
        _wait_then_ready(dist.irecv(np.zeros(4, np.float32), src=1 - rank), folder)
        return
    if kind == "mismatch":  # rank 1's count differs; it issues last, so every rank has issued it before any fails
        if rank != 1:  # (else a rank still behind when the first fails is, in that moment, one that never joined)
            _wait_then_ready(dist.all_reduce(np.ones(4, np.float32), async_op=True), folder)
            return
        others = [pathlib.Path(folder) / f"ready.{r}" for r in range(world_size) if r != 1]
        deadline = time.monotonic() + 60
        while not all(p.exists() for p in others):
            assert time.monotonic() < deadline, "the other ranks never issued their all_reduce"
            time.sleep(0.01)
        dist.all_reduce(np.ones(5, np.float32))
        return
    if rank == 1:
        if kind == "exception":
            raise ValueError("rank 1 broke")
        if kind == "nan":
            x[2] = np.nan  # the check finds it in rank 1's input of the next all_reduce
        elif kind == "aborted":
            work = dist.all_reduce(x, async_op=True)
            dist.abort_process_group()  # its own request: the all_reduce in flight fails saying so
            work.wait()
        elif kind == "stuck_in_user_code":
            _ready(folder)
            time.sleep(300)  # STUCK (user code)
        elif kind == "stuck_in_c":
            stacks = pathlib.Path(os.environ["NCCL_PG_DEBUG_INFO_TEMP_FILE"]).parent / "c_stacks" / \
                f"rank1.{os.getpid()}.txt"
            while not stacks.exists():  # the watchdog opens it at its first poll with a group
                time.sleep(0.01)
            _ready(folder)
            re.match(r"(a+)+$", "a" * 64 + "b")  # STUCK (C, the GIL held)
        elif kind == "dead":
            dist.all_reduce(x, async_op=True)
            time.sleep(0.5)  # its watchdog sees the all_reduce in flight
            _ready(folder)
            os._exit(3)
        elif kind == "no_answer":
            _ready(folder)
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: it answers nothing, not even a signal for its stacks
    if kind == "dead":
        time.sleep(1.0)
    _wait_then_ready(dist.all_reduce(x, async_op=True), folder)


JOB = '''\
import os, sys
sys.path.insert(0, os.environ["TESTS_DIR"])
import nccl_pg as dist
from harness.verdict_scenarios import scenario

dist.init_process_group("host", init_method="env://", timeout=float(os.environ["TIMEOUT"]))
scenario(dist.get_rank(), dist.get_world_size(), os.environ["KIND"], os.environ["TEST_DIR"])
dist.destroy_process_group()
'''

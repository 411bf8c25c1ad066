"""Several machines (issue 33): `nccl-pg run --elastic` with one launcher per
node (--nnodes 3 --node-rank R), meeting on a real 3-member etcd cluster
(the etcd:// store), two ranks each, examples/elastic.py. Mid-training one
node is lost at once (SIGKILL of its launcher and of its ranks): the other
four ranks go on after one attempt (the lost ranks never come to the next
configuration); a launcher started again for that node brings two new ranks
in (six again); every rank of the end prints the checksum of a run nothing
disturbed and every live launcher exits 0. The same when the lost node held
rank 0, and when the etcd leader dies at the same time as the node (that
one in ``make test-elastic``, ELASTIC_MATRIX=1)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness.etcd_cluster import EtcdCluster, fresh_job

from nccl_pg import process_tree

REPO = Path(__file__).resolve().parents[1]
NCCL_PG = str(Path(sys.executable).parent / "nccl-pg")
STEPS, STEP_TIME = 400, 0.05

pytestmark = pytest.mark.timeout(240)


class Node:
    """One launcher, its output read as it comes."""

    def __init__(self, cluster: EtcdCluster, job: str, node_rank: int, tmp: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_PG_", "TORCH_NCCL_"))}
        env["NCCL_PG_DEBUG_INFO_TEMP_FILE"] = str(tmp / f"node{node_rank}_trace_")
        self.proc = subprocess.Popen(
            [NCCL_PG, "run", "--nproc", "2", "--elastic", "--nnodes", "3", "--node-rank", str(node_rank),
             "--rdzv-endpoint", cluster.url, "--rdzv-id", job, "--autopsy-time", "0",
             "examples/elastic.py", "--steps", str(STEPS), "--step-time", str(STEP_TIME), "--timeout", "90",
             "--op-timeout", "20", "--attempt-timeout", "5"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.lines)

    def kill_at_once(self) -> None:
        """SIGKILL the launcher and all its ranks together, as a machine dies."""
        pids = [self.proc.pid, *process_tree.descendants(self.proc.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)  # none of them acts on the others' deaths first
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)

    def finish(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc


def wait_for(what: str, condition, seconds: float, nodes: list[Node]) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds} s\n" + "\n=====\n".join(n.text()[-4000:] for n in nodes))
        time.sleep(0.1)


def sizes(node: Node) -> list[int]:
    return [int(m) for m in re.findall(r"membership: uuid \d+: world size (\d+)", node.text())]


def reference() -> str:
    out = subprocess.run([sys.executable, "examples/elastic.py", "--reference", "--steps", str(STEPS)], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return out.split()[-1]


@pytest.fixture
def cluster(own_etcd_cluster: EtcdCluster) -> EtcdCluster:
    return own_etcd_cluster  # of this test's own: it kills a member


CASES = {"a node is lost": (1, False)}
if os.environ.get("ELASTIC_MATRIX"):  # `make test-elastic`
    CASES["the node of rank 0 and the etcd leader are lost at once"] = (0, True)


@pytest.mark.parametrize("lost,leader_too", list(CASES.values()), ids=list(CASES))
def test_three_nodes_lose_one_and_take_it_back(tmp_path, cluster, lost, leader_too):
    job = fresh_job()
    nodes = [Node(cluster, job, r, tmp_path) for r in range(3)]
    try:
        wait_for("all six ranks started", lambda: sum(n.text().count("(started)") for n in nodes) == 6, 90, nodes)
        time.sleep(1.0)  # training
        survivors = [n for i, n in enumerate(nodes) if i != lost]
        if leader_too:
            cluster.kill(cluster.leader())
        nodes[lost].kill_at_once()
        wait_for("the survivors went on as 4",
                 lambda: all("world size 4" in n.text() for n in survivors), 60, nodes)
        again = Node(cluster, job, lost, tmp_path)
        nodes.append(again)
        wait_for("six again", lambda: all(sizes(n) and sizes(n)[-1] == 6 for n in [*survivors, again]), 90, nodes)
        rcs = [n.finish(120) for n in [*survivors, again]]
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.kill_at_once()
    out = "\n=====\n".join(n.text()[-6000:] for n in nodes)
    assert rcs == [0, 0, 0], out
    finals = re.findall(r"\[(?:rank\d+\|)?member\d+\]: final ([0-9a-f]+)", "\n".join(n.text() for n in [*survivors, again]))
    assert len(finals) == 6 and set(finals) == {reference()}, out
    assert "joined" in again.text() and "finished before" not in out, out

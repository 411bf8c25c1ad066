"""Healing after SIGKILLs (issue 33): nccl_pg under `nccl-pg run --elastic`
against torchft 0.2.0's Manager over Gloo, on the same toy training, in the
same run (tools/bench_elastic.py --kills drives it; docs/BENCHMARKS.md).

The training: each step sleeps ``--step-time`` (its compute), then one
all_reduce of 8 int64 (nccl_pg: host backend; torchft: its allreduce over
ProcessGroupGloo, then should_commit). At step ``--kill-step`` the victims
SIGKILL themselves, stamping the time first; replacements start at once
(nccl_pg: the launcher; torchft: this driver restarts the replica, as a
scheduler would). Every process stamps, on CLOCK_BOOTTIME (the clock of
/proc/<pid>/stat's start time, which every process of the machine shares),
each completed step with the world size it ran at, into a JSON-lines file of
its own. From the stamps:

  survivors    from the first victim's SIGKILL to the last survivor's next
               completed collective (nccl_pg) or committed step (torchft)
  full size    from that SIGKILL to the first step completed at the full size
               again, on every process (the replacements in)
  replacement  from a replacement's process start to its first completed
               collective / committed step (median over the replacements)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
NCCL_PG = str(Path(sys.executable).parent / "nccl-pg")
WIDTH = 8


def now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def started(pid: int) -> float:
    """When process ``pid`` started, on CLOCK_BOOTTIME (jiffies of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


class Stamps:
    def __init__(self, folder: str, who: str) -> None:
        self.f = open(os.path.join(folder, f"{who}.jsonl"), "a", buffering=1)  # noqa: SIM115 - the process's life

    def __call__(self, event: str, **kw: Any) -> None:
        self.f.write(json.dumps({"e": event, "t": now(), **kw}) + "\n")


# --- the ranks --------------------------------------------------------------------------------------------------

def nccl_pg_rank(args: argparse.Namespace) -> int:
    import nccl_pg as dist  # noqa: PLC0415
    from nccl_pg import elastic  # noqa: PLC0415

    job = elastic.Elastic.from_env(timeout=300, attempt_timeout=60)
    stamp = Stamps(args.out, f"member{job.member}")
    if job.joining:
        stamp("spawned", at=started(os.getppid()))  # the guard the launcher started for it
    rec = job.start("host", timeout=60)
    state = np.zeros(WIDTH, dtype=np.int64)
    step, victim = rec.step, job.member in args.victims
    while True:
        if victim and step == args.kill_step:
            stamp("kill")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_time)
        try:
            job.broadcast_state([state])  # after a start or recovery that needs it (docs/ELASTIC.md)
            total = np.full(WIDTH, step + 1, dtype=np.int64)
            dist.all_reduce(total, async_op=True).wait(120)
            state = (state * 3 + total) % (2**31 - 1)
            step += 1
            stamp("done", step=step, size=dist.get_world_size())
        except dist.DistBackendError as exc:
            step = job.recover(step, exc).step


def torchft_replica(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415
    from torch.distributed import TCPStore  # noqa: PLC0415
    from torchft import Manager  # noqa: PLC0415
    from torchft.process_group import ProcessGroupGloo  # noqa: PLC0415

    stamp = Stamps(args.out, f"replica{args.replica}.{os.getpid()}")
    if args.restarted:
        stamp("spawned", at=started(os.getpid()))
    state = {"w": torch.zeros(WIDTH)}
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedeltas(args.op_timeout)), min_replica_size=1,
                      load_state_dict=lambda sd: state["w"].copy_(sd["w"]), state_dict=lambda: {"w": state["w"]},
                      replica_id=str(args.replica), store_addr="localhost", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=args.lighthouse, timeout=timedeltas(args.op_timeout),
                      quorum_timeout=timedeltas(120), connect_timeout=timedeltas(60))
    victim = args.replica in args.victims and not args.restarted
    while True:
        manager.start_quorum()
        step = manager.current_step()
        if victim and step == args.kill_step:
            stamp("kill")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_time)
        grad = torch.full((WIDTH,), float(step + 1))
        manager.allreduce(grad).wait()
        if manager.should_commit():
            state["w"] += grad
            stamp("done", step=manager.current_step(), size=manager.num_participants())


def commit_rank(args: argparse.Namespace) -> int:
    """One of two ranks of a torchft ProcessGroup (``--way``: nccl_pg's, or torchft's Gloo), configured as a
    Manager would: per step, the allreduce of ``--elements`` float32 waited for, then ``errored()`` (what
    should_commit reads); the medians of each, in microseconds, on stdout as JSON."""
    import statistics  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from torchft.process_group import ProcessGroupGloo  # noqa: PLC0415

    from nccl_pg.torch.torchft import ProcessGroupNcclPg  # noqa: PLC0415

    pg = (ProcessGroupNcclPg if args.way == "nccl_pg" else ProcessGroupGloo)(timeout=timedeltas(30))
    pg.configure(args.lighthouse, f"r{args.replica}", args.replica, 2)
    t = torch.ones(args.elements)
    step_us, errored_us = [], []
    for i in range(args.steps + 20):
        t0 = time.perf_counter()
        pg.allreduce([t], torch.distributed.AllreduceOptions()).wait()
        t1 = time.perf_counter()
        assert pg.errored() is None
        t2 = time.perf_counter()
        if i >= 20:  # warm
            step_us.append((t1 - t0) * 1e6)
            errored_us.append((t2 - t1) * 1e6)
    print(json.dumps({"allreduce_us": statistics.median(step_us), "errored_us": statistics.median(errored_us)}))
    pg.shutdown()
    return 0


def commit_cost(elements: int, steps: int = 300) -> dict[str, dict[str, float]]:
    """The adapter's agreement in errored(), against torchft's Gloo (whose errored() only reads a field)."""
    from torch.distributed import TCPStore  # noqa: PLC0415

    out = {}
    for way in ("nccl_pg", "gloo"):
        store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        addr = f"localhost:{store.port}/{way}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_PG_", "TORCH_NCCL_"))}
        procs = [subprocess.Popen([sys.executable, __file__, "--commit-rank", "--way", way, "--replica", str(r),
                                   "--lighthouse", addr, "--elements", str(elements), "--steps", str(steps)],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) for r in range(2)]
        rows = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
        out[way] = {k: max(r[k] for r in rows) for k in rows[0]}
    return out


def timedeltas(seconds: float) -> Any:
    from datetime import timedelta  # noqa: PLC0415

    return timedelta(seconds=seconds)


# --- the drivers ------------------------------------------------------------------------------------------------

def _load(folder: Path) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for f in folder.glob("*.jsonl"):
        rows = []
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass  # a line cut by the process's death
        out[f.stem] = rows
    return out


def _healed(stamps: dict[str, list[dict[str, Any]]], n: int, k: int, prefix: str) -> bool:
    """Every process alive at the end has done 3 steps at full size, and k replacements started."""
    kills = [r for rows in stamps.values() for r in rows if r["e"] == "kill"]
    spawned = [w for w, rows in stamps.items() if any(r["e"] == "spawned" for r in rows)]
    if len(kills) < k or len(spawned) < k:
        return False
    t_kill = min(r["t"] for r in kills)
    full = [w for w, rows in stamps.items() if w.startswith(prefix)
            and sum(1 for r in rows if r["e"] == "done" and r["t"] > t_kill and r.get("size") == n) >= 3]
    return len(full) >= n


def measure(stamps: dict[str, list[dict[str, Any]]], n: int, kill_step: int) -> dict[str, float]:
    """The figures of the module docstring. A step counts after the kill when it is one the victims never
    reached (a survivor may finish the step before the kill a moment after a victim stamped its death)."""
    kills = [r["t"] for rows in stamps.values() for r in rows if r["e"] == "kill"]
    t_kill = min(kills)
    killed = {w for w, rows in stamps.items() if any(r["e"] == "kill" for r in rows)}
    survivors = [w for w, rows in stamps.items() if w not in killed and not any(r["e"] == "spawned" for r in rows)]
    after = {w: [r for r in rows if r["e"] == "done" and r["step"] > kill_step] for w, rows in stamps.items()}
    first_after = [min(r["t"] for r in after[w]) for w in survivors]
    full = [min(r["t"] for r in after[w] if r["size"] == n) for w in stamps if w not in killed]
    spawned = {w: next(r["at"] for r in rows if r["e"] == "spawned")
               for w, rows in stamps.items() if any(r["e"] == "spawned" for r in rows)}
    first = sorted(min(r["t"] for r in after[w]) - at for w, at in spawned.items())
    return {"survivors_s": max(first_after) - t_kill, "full_size_s": max(full) - t_kill,
            "replacement_s": first[len(first) // 2], "replacement_max_s": first[-1], "killed": len(kills)}


def _wait_healed(folder: Path, n: int, k: int, prefix: str, limit: float, procs: list[subprocess.Popen]) -> dict:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        stamps = _load(folder)
        if _healed(stamps, n, k, prefix):
            return stamps
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    raise RuntimeError(f"not healed within {limit:g} s (logs in {folder})")


def _fresh(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)  # stamps of an earlier run would count
    folder.mkdir(parents=True)


def run_nccl_pg(n: int, k: int, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    _fresh(folder)
    victims = list(range(1, k + 1))  # rank 0 lives: the store is the launcher's anyway
    env = {kk: v for kk, v in os.environ.items() if not kk.startswith(("NCCL_PG_", "TORCH_NCCL_"))}
    env["NCCL_PG_DEBUG_INFO_TEMP_FILE"] = str(folder / "trace_")
    cmd = [NCCL_PG, "run", "--nproc", str(n), "--elastic", "--max-replacements", str(k), "--autopsy-time", "0",
           "--no-prefix", __file__, "--rank", "--out", str(folder), "--victims", *map(str, victims),
           "--kill-step", str(args.kill_step), "--step-time", str(args.step_time)]
    with open(folder / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            stamps = _wait_healed(folder, n, k, "member", args.limit, [proc])
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return measure(stamps, n, args.kill_step)


def run_torchft(n: int, k: int, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    from torchft._torchft import LighthouseServer  # noqa: PLC0415

    _fresh(folder)
    victims = list(range(1, k + 1))
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=args.join_timeout_ms,
                                  heartbeat_timeout_ms=args.heartbeat_ms)
    env = {kk: v for kk, v in os.environ.items() if not kk.startswith(("NCCL_PG_", "TORCH_NCCL_"))}
    env["TORCHFT_LIGHTHOUSE"] = lighthouse.address()

    def start(replica: int, restarted: bool) -> subprocess.Popen:
        log = open(folder / f"replica{replica}{'.restarted' if restarted else ''}.log", "w")  # noqa: SIM115
        return subprocess.Popen([sys.executable, __file__, "--torchft-replica", "--replica", str(replica),
                                 "--lighthouse", lighthouse.address(), "--out", str(folder), "--victims",
                                 *map(str, victims), "--kill-step", str(args.kill_step), "--step-time",
                                 str(args.step_time), "--op-timeout", str(args.op_timeout)]
                                + (["--restarted"] if restarted else []),
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = {r: start(r, False) for r in range(n)}
    try:
        deadline = time.monotonic() + args.limit
        restarted: set[int] = set()
        while time.monotonic() < deadline:
            for r in victims:
                if r not in restarted and procs[r].poll() is not None:  # dead: start it again at once
                    restarted.add(r)
                    procs[r] = start(r, True)
            stamps = _load(folder)
            if _healed(stamps, n, k, "replica"):
                return measure(stamps, n, args.kill_step)
            time.sleep(0.05)
        raise RuntimeError(f"torchft: not healed within {args.limit:g} s (logs in {folder})")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for p in procs.values():
            p.wait()
        lighthouse.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torchft-replica", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--commit-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--way", help=argparse.SUPPRESS)
    parser.add_argument("--elements", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=300, help=argparse.SUPPRESS)
    parser.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--restarted", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--victims", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--op-timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    if args.rank:
        return nccl_pg_rank(args)
    if args.torchft_replica:
        return torchft_replica(args)
    if args.commit_rank:
        return commit_rank(args)
    parser.error("run through tools/bench_elastic.py --kills")
    return 2


if __name__ == "__main__":
    sys.exit(main())

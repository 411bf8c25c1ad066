"""Random create/use/destroy sequences of process groups (issue 5).

Each sequence is a plan drawn from a seeded ``random.Random`` and run by 2-4
thread ranks (each thread its own World, one HashStore): init the default
group (lazy or eager), then a random mix of

- ``new_group`` with random member subsets (sometimes
  ``use_local_synchronization``), some of them never used,
- collectives and sends/recvs on random live groups, results checked, some
  issued async and never waited on (destroy must flush them),
- ``destroy_process_group(g)`` of random groups,

then every rank destroys the groups it still holds in its *own* random order
(ranks disagree on the order), then the default group; half the sequences
re-init the default group afterwards and go round again.

No step may hang (each sequence is bounded; a stuck one fails with every
thread's stack). No thread or open file descriptor that a sequence made may
outlive it: nothing a group creates (stream threads, sockets, listeners)
survives its destroy. The process-wide watchdog (threads and its dump pipe)
is started once, before the first sequence.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import nccl_pg as dist
from nccl_pg.distributed.world import World, set_thread_world
from nccl_pg.group import watchdog
from nccl_pg.store import HashStore

SEQUENCES_PER_SEED = 50
SEEDS = (1, 2, 3, 4)  # 4 x 50 = 200 sequences
SEQUENCE_LIMIT = 60.0  # seconds for one sequence, all ranks
GROUP_TIMEOUT = 20.0  # a lost op fails after this instead of hanging (well inside SEQUENCE_LIMIT)
SETTLE = 10.0  # how long threads and fds get to go after the last destroy

OPS = ("all_reduce", "broadcast", "barrier", "all_gather", "all_to_all", "send_recv")


@dataclass
class Plan:
    seed: int
    world: int
    eager: list[bool] = field(default_factory=list)  # per round (init)
    rounds: list[list[tuple]] = field(default_factory=list)  # steps per round

    def __str__(self) -> str:
        lines = [f"seed {self.seed}: world {self.world}"]
        for i, steps in enumerate(self.rounds):
            lines.append(f"  round {i} (eager={self.eager[i]}): " + "; ".join(map(str, steps)))
        return "\n".join(lines)


def make_plan(seed: int) -> Plan:
    rng = random.Random(seed)
    world = rng.randint(2, 4)
    plan = Plan(seed, world)
    for _ in range(2 if rng.random() < 0.5 else 1):
        plan.eager.append(rng.random() < 0.3)
        steps: list[tuple] = []
        live: dict[int, tuple[int, ...]] = {}  # gid -> members (global ranks), within this round
        gid = 0
        for _ in range(rng.randint(3, 12)):
            roll = rng.random()
            if roll < 0.4 or not live:
                members = tuple(sorted(rng.sample(range(world), rng.randint(1, world))))
                local = rng.random() < 0.25
                steps.append(("new", gid, members, local))
                live[gid] = members
                gid += 1
            elif roll < 0.85:
                g = rng.choice(sorted(live))
                op = rng.choice(OPS if len(live[g]) > 1 else OPS[:5])
                if op == "send_recv" and len(live[g]) < 2:
                    op = "all_reduce"
                wait = rng.random() < 0.8 or op == "send_recv"
                steps.append(("use", g, live[g], op, wait, rng.randrange(1, 100)))
            else:
                g = rng.choice(sorted(live))
                steps.append(("destroy", g, live.pop(g)))
        plan.rounds.append(steps)
    return plan


def _use(group: Any, members: tuple[int, ...], me: int, op: str, wait: bool, salt: int) -> Any:
    """Run ``op`` on ``group`` (this rank is global rank ``me``); check its
    result when waited on. Returns the Work when not waited on."""
    n, i = len(members), members.index(me)
    async_op = not wait
    if op == "all_reduce":
        x = np.full(3, float(me + salt))
        w = dist.all_reduce(x, group=group, async_op=async_op)
        expect = np.full(3, float(sum(members) + n * salt))
    elif op == "broadcast":
        x = np.full(3, float(me + salt))
        w = dist.broadcast(x, src=members[-1], group=group, async_op=async_op)
        expect = np.full(3, float(members[-1] + salt))
    elif op == "barrier":
        return dist.barrier(group=group, async_op=async_op)
    elif op == "all_gather":
        outs = [np.zeros(2) for _ in range(n)]
        w = dist.all_gather(outs, np.full(2, float(me * salt)), group=group, async_op=async_op)
        if wait:
            assert [o[0] for o in outs] == [float(m * salt) for m in members], outs
        return w
    elif op == "all_to_all":
        outs = [np.zeros(2) for _ in range(n)]
        w = dist.all_to_all(outs, [np.full(2, float(100 * me + m)) for m in members], group=group, async_op=async_op)
        if wait:
            assert [o[0] for o in outs] == [float(100 * m + me) for m in members], outs
        return w
    elif op == "send_recv":  # a ring over the members
        nxt, prv = members[(i + 1) % n], members[(i - 1) % n]
        got = np.zeros(2)
        ops = [dist.P2POp(dist.isend, np.full(2, float(me + salt)), nxt, group),
               dist.P2POp(dist.irecv, got, prv, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert (got == prv + salt).all(), (got, prv, salt)
        return None
    else:
        raise ValueError(op)
    if wait:
        assert (x == expect).all(), (op, x, expect)
    return w


def _rank_main(plan: Plan, rank: int, store: HashStore) -> None:
    set_thread_world(World())
    try:
        rng = random.Random(plan.seed * 1000 + rank)  # this rank's own destroy order
        for r, steps in enumerate(plan.rounds):
            dist.init_process_group("host", store=store, rank=rank, world_size=plan.world, timeout=GROUP_TIMEOUT,
                                    device_id=0 if plan.eager[r] else None)
            groups: dict[int, Any] = {}
            unwaited: list[Any] = []
            for step in steps:
                if step[0] == "new":
                    _, gid, members, local = step
                    if local and rank not in members:
                        continue
                    g = dist.new_group(list(members), use_local_synchronization=local)
                    if rank in members:
                        groups[gid] = g
                    else:
                        assert g is dist.GroupMember.NON_GROUP_MEMBER, g
                elif step[0] == "use":
                    _, gid, members, op, wait, salt = step
                    if rank in members:
                        w = _use(groups[gid], members, rank, op, wait, salt)
                        if w is not None:
                            unwaited.append(w)
                elif step[0] == "destroy":
                    _, gid, members = step
                    if rank in members:
                        dist.destroy_process_group(groups.pop(gid))
            # Every rank destroys what is left in its own order (some left to the default group's destroy).
            left = sorted(groups)
            rng.shuffle(left)
            for gid in left[:rng.randint(0, len(left))]:
                dist.destroy_process_group(groups.pop(gid))
            dist.destroy_process_group()
            assert not dist.is_initialized()
            for w in unwaited:  # destroy flushed them: they completed
                assert w.is_completed() and w.exception() is None, (w, w.exception())
    finally:
        set_thread_world(None)


def run_sequence(plan: Plan) -> None:
    store = HashStore()
    errors: dict[int, str] = {}

    def main(rank: int) -> None:
        try:
            _rank_main(plan, rank, store)
        except BaseException:
            errors[rank] = traceback.format_exc()

    threads = [threading.Thread(target=main, args=(r,), name=f"lifecycle-rank{r}", daemon=True)
               for r in range(plan.world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + SEQUENCE_LIMIT
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    stuck = [t for t in threads if t.is_alive()]
    if stuck:
        frames = sys._current_frames()
        stacks = "\n".join(f"--- {t.name} ---\n{''.join(traceback.format_stack(frames[t.ident]))}"
                           for t in stuck if t.ident in frames)
        pytest.fail(f"sequence did not finish within {SEQUENCE_LIMIT} s\n{plan}\n{stacks}")
    if errors:
        pytest.fail(f"{plan}\n" + "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))


def _watchdog_fds() -> set[str]:
    """Link targets of the process-wide watchdog's own fds (its dump pipe),
    opened once like its threads."""
    dog = watchdog.existing()
    pipe = getattr(dog, "_pipe", None)
    return {pipe[2]} if pipe else set()


def open_fds() -> Counter[str]:
    """Open file descriptors of this process, by link target (a socket's or pipe's
    names its inode: unique while open), without the watchdog's own."""
    out: Counter[str] = Counter()
    skip = _watchdog_fds()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the fd listdir itself used
        target = target.removesuffix(" (deleted)")  # another process with the same rank may unlink the FIFO
        if target not in skip and not target.endswith(".pipe"):  # the dump pipe, if it moved meanwhile
            out[target] += 1
    return out


def threads_now() -> set[threading.Thread]:
    """Live threads, without the process-wide watchdog's (started once)."""
    dog = watchdog.existing()
    theirs = {id(t) for t in getattr(dog, "_threads", {}).values()}
    return {t for t in threading.enumerate() if id(t) not in theirs}


def outliving(before_threads: set[threading.Thread],
              before_fds: Counter[str]) -> tuple[list[str], list[str]]:
    """Threads and fds that were not there before the sequence and are still there
    once SETTLE seconds have passed (or none, as soon as none are). By identity,
    not by count: another test's teardown in this worker process (pytest-xdist)
    may end its own threads meanwhile, which must neither hide a leak nor be one."""
    deadline = time.monotonic() + SETTLE
    while True:
        threads = sorted(t.name for t in threads_now() - before_threads)
        fds = sorted((open_fds() - before_fds).elements())
        if (not threads and not fds) or time.monotonic() > deadline:
            return threads, fds
        time.sleep(0.02)


@pytest.fixture(scope="module", autouse=True)
def warm_watchdog() -> None:
    """Start the process-wide watchdog (and let it open its pipe) before any baseline."""
    run_sequence(Plan(0, 2, [False], [[("new", 0, (0, 1), False), ("use", 0, (0, 1), "all_reduce", True, 1)]]))


def test_plans_are_deterministic() -> None:
    assert str(make_plan(7)) == str(make_plan(7))
    assert {make_plan(s).world for s in range(50)} == {2, 3, 4}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_lifecycles(seed: int) -> None:
    """SEQUENCES_PER_SEED sequences from ``seed``; none leaves a thread or an fd behind."""
    assert dist.distributed.world.current_world().default_pg is None  # this (main) thread's world is untouched
    for k in range(SEQUENCES_PER_SEED):
        plan = make_plan(seed * 10_000 + k)
        before_threads, before_fds = threads_now(), open_fds()
        run_sequence(plan)
        threads, fds = outliving(before_threads, before_fds)
        assert not threads, f"threads that outlived sequence {k}: {threads}\n{plan}"
        assert not fds, f"fds that outlived sequence {k}: {fds}\n{plan}"

"""nccl_pg.join: the Join context manager for uneven inputs (port of the
seed test_join.py, on the host backend with ranks as threads).

Each rank thread has its own World and all share one HashStore. A rank that
fails aborts every rank's groups, so the others fail fast instead of hanging
in a collective; the whole run is also bounded by a deadline.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import nccl_pg as dist
from nccl_pg import HashStore, ProcessGroup
from nccl_pg.distributed.world import World, set_thread_world
from nccl_pg.join import Join, Joinable, JoinHook

WORLD_SIZE = 4  # the seed uses min(4, max(2, GPUs)); 4 gives several staggered joins
RUN_DEADLINE = 60.0  # seconds for one multi-rank run
OP_TIMEOUT = 30.0  # seconds per collective: a lost rank fails its peers even without the abort

# Magic constants for the post hooks
BEFORE_CONSTANT = 41
AFTER_CONSTANT = 42

pytestmark = pytest.mark.timeout(90)


# --- thread-rank harness ----------------------------------------------------------------

def run_ranks(fn: Callable[[int], Any], world_size: int = WORLD_SIZE) -> list[Any]:
    """Run ``fn(rank)`` on ``world_size`` thread ranks over a fresh default
    group; returns the results by rank or raises the first failure."""
    store = HashStore()
    worlds = [World() for _ in range(world_size)]
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []
    lock = threading.Lock()
    failed = threading.Event()

    def abort_all() -> None:
        for w in worlds:
            for pg in [w.default_pg, *list(w.groups)]:
                if pg is not None:
                    pg.abort()

    def main(rank: int) -> None:
        set_thread_world(worlds[rank])
        try:
            dist.init_process_group("host", store=store, rank=rank, world_size=world_size, timeout=OP_TIMEOUT)
            if failed.is_set():  # a rank failed before this group existed, so its abort_all missed it
                abort_all()
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            with lock:
                errors.append(e)
            failed.set()  # before abort_all: a rank initializing now either is aborted or sees the flag
            abort_all()
        finally:
            with contextlib.suppress(Exception):
                if dist.is_initialized():
                    dist.destroy_process_group()
            set_thread_world(None)

    threads = [threading.Thread(target=main, args=(r,), name=f"rank{r}", daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RUN_DEADLINE)
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        abort_all()
        for t in threads:
            t.join(5)
        raise AssertionError(f"ranks {stuck} did not finish within {RUN_DEADLINE} s")
    if errors:
        raise errors[0]
    return results


# --- the seed's example Joinable, over numpy arrays --------------------------------------

class AllReducerJoinHook(JoinHook):
    """Join hook for ``AllReducer``: shadows ``num_allreduces`` all-reduces
    per iteration and, if ``run_post_hook``, broadcasts ``AFTER_CONSTANT``
    from the last joiner."""

    def __init__(self, allreducer: AllReducer, num_allreduces: int, run_post_hook: bool) -> None:
        self.allreducer = allreducer
        self.num_allreduces = num_allreduces
        self.run_post_hook = run_post_hook

    def main_hook(self) -> None:
        for _ in range(self.num_allreduces):
            dist.all_reduce(np.zeros(1, np.float32), group=self.allreducer.process_group)

    def post_hook(self, is_last_joiner: bool) -> None:
        if not self.run_post_hook:
            return
        pg = self.allreducer.process_group
        rank = dist.get_rank(pg)
        common_rank = self.allreducer.find_common_rank(rank, is_last_joiner)
        if rank == common_rank:
            self.allreducer.post_hook_tensor = np.array([AFTER_CONSTANT], np.int64)
        dist.broadcast(self.allreducer.post_hook_tensor, group=pg, group_src=common_rank)


class AllReducer(Joinable):
    """Example Joinable whose per-iteration collectives are some number of
    all-reduces of a one-element array of ones."""

    def __init__(self, device: Any, process_group: ProcessGroup) -> None:
        self.device = device
        self.process_group = process_group
        self.post_hook_tensor = np.array([BEFORE_CONSTANT], np.int64)

    def __call__(self, num_allreduces: int = 1) -> int:
        """All-reduces ones ``num_allreduces`` times; returns the total."""
        Join.notify_join_context(self)
        total = 0
        for _ in range(num_allreduces):
            t = np.ones(1, np.float32)
            dist.all_reduce(t, group=self.process_group)
            total += int(t[0])
        return total

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return AllReducerJoinHook(self, kwargs.get("num_allreduces", 1), kwargs.get("run_post_hooks", False))

    @property
    def join_device(self) -> Any:
        return self.device

    @property
    def join_process_group(self) -> ProcessGroup:
        return self.process_group

    def find_common_rank(self, rank: int, to_consider: bool) -> int:
        """The max rank among those to consider, over the process group."""
        common_rank = np.array([rank if to_consider else -1], np.int64)
        dist.all_reduce(common_rank, op=dist.ReduceOp.MAX, group=self.process_group)
        assert common_rank[0] >= 0
        return int(common_rank[0])


# --- the seed's skeleton -------------------------------------------------------------------

BASE_NUM_INPUTS = 3  # inputs every rank gets
OFFSET = 1  # rank i gets i * OFFSET more


def expected_uneven_total(rank: int, world_size: int = WORLD_SIZE) -> int:
    """All-reduce total of one all-reduce per input with uneven inputs: each
    iteration sums a 1 from every rank not yet joined."""
    total = world_size * BASE_NUM_INPUTS
    for num_joined in range(1, rank + 1):
        total += (world_size - num_joined) * OFFSET
    return total


def join_base(uneven_inputs: bool, num_joinables: int, enable: bool, throw_on_early_termination: bool,
              num_allreduces: int, run_post_hooks: bool,
              expected_total: Callable[[int], int] | None = None) -> None:
    """The seed's ``_test_join_base`` on every rank; ``expected_total(rank)``
    (if given) is the all-reduce total that rank must see."""

    def rank_main(rank: int) -> None:
        allreducers = [AllReducer(None, dist.group.WORLD) for _ in range(num_joinables)]
        for allreducer in allreducers:
            assert allreducer.post_hook_tensor[0] == BEFORE_CONSTANT
        n_inputs = BASE_NUM_INPUTS + rank * OFFSET if uneven_inputs else BASE_NUM_INPUTS
        allreduce_total = 0
        # rank 0 has the fewest inputs, so it is the one that exhausts them first
        expected_msg = ("Rank 0 exhausted all inputs." if rank == 0
                        else "Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        with (pytest.raises(RuntimeError, match=expected_msg) if throw_on_early_termination
              else contextlib.nullcontext()):
            with Join(allreducers, enable=enable, throw_on_early_termination=throw_on_early_termination,
                      num_allreduces=num_allreduces, run_post_hooks=run_post_hooks):
                for _ in range(n_inputs):
                    for allreducer in allreducers:
                        allreduce_total += allreducer(num_allreduces)
        if throw_on_early_termination:
            return
        if expected_total is not None:
            assert allreduce_total == expected_total(rank)
        if run_post_hooks:
            for allreducer in allreducers:
                assert allreducer.post_hook_tensor[0] == AFTER_CONSTANT

    run_ranks(rank_main)


# --- the seed's tests ------------------------------------------------------------------------

def test_single_joinable_main_hooks() -> None:
    """Main hooks of one Joinable: a non-joined rank's total is what it
    summed before joining."""
    join_base(uneven_inputs=True, num_joinables=1, enable=True, throw_on_early_termination=False,
              num_allreduces=1, run_post_hooks=False, expected_total=expected_uneven_total)


def test_single_joinable_post_hooks() -> None:
    """Post hooks of one Joinable, main hooks skipped (no all-reduces). As in
    the seed, run_post_hooks stays False: it checks the Join finishes."""
    join_base(uneven_inputs=True, num_joinables=1, enable=True, throw_on_early_termination=False,
              num_allreduces=0, run_post_hooks=False, expected_total=None)


def test_single_joinable() -> None:
    """Main hooks and post hooks of one Joinable together."""
    join_base(uneven_inputs=True, num_joinables=1, enable=True, throw_on_early_termination=False,
              num_allreduces=1, run_post_hooks=True, expected_total=expected_uneven_total)


def test_multiple_joinables() -> None:
    """Main hooks and post hooks of several Joinables together."""
    num_joinables = 3
    join_base(uneven_inputs=True, num_joinables=num_joinables, enable=True, throw_on_early_termination=False,
              num_allreduces=1, run_post_hooks=True,
              expected_total=lambda rank: expected_uneven_total(rank) * num_joinables)


def test_single_joinable_disable() -> None:
    """``enable=False`` with one Joinable and even inputs."""
    join_base(uneven_inputs=False, num_joinables=1, enable=False, throw_on_early_termination=False,
              num_allreduces=1, run_post_hooks=False, expected_total=lambda _: WORLD_SIZE * BASE_NUM_INPUTS)


def test_multiple_joinable_disable() -> None:
    """``enable=False`` with several Joinables and even inputs."""
    num_joinables = 3
    join_base(uneven_inputs=False, num_joinables=num_joinables, enable=False, throw_on_early_termination=False,
              num_allreduces=1, run_post_hooks=False,
              expected_total=lambda _: WORLD_SIZE * BASE_NUM_INPUTS * num_joinables)


def test_single_joinable_throw() -> None:
    """``throw_on_early_termination=True`` with one Joinable: every rank raises."""
    join_base(uneven_inputs=True, num_joinables=1, enable=True, throw_on_early_termination=True,
              num_allreduces=1, run_post_hooks=False)


def test_multiple_joinables_throw() -> None:
    """``throw_on_early_termination=True`` with several Joinables."""
    join_base(uneven_inputs=True, num_joinables=3, enable=True, throw_on_early_termination=True,
              num_allreduces=1, run_post_hooks=False)


def test_join_kwargs() -> None:
    """Keyword arguments of Join reach ``join_hook`` (two all-reduces to shadow)."""
    num_allreduces = 2
    join_base(uneven_inputs=True, num_joinables=1, enable=True, throw_on_early_termination=False,
              num_allreduces=num_allreduces, run_post_hooks=False,
              expected_total=lambda rank: expected_uneven_total(rank) * num_allreduces)


# --- beyond the seed ---------------------------------------------------------------------------

def test_join_multiple_process_groups_raises() -> None:
    """Joinables on different groups cannot share one count: ValueError."""

    def rank_main(rank: int) -> None:
        sub = dist.new_group(list(range(WORLD_SIZE)))
        with pytest.raises(ValueError, match="multiple process groups"):
            Join([AllReducer(None, dist.group.WORLD), AllReducer(None, sub)])

    run_ranks(rank_main)


def test_join_needs_a_joinable() -> None:
    with pytest.raises(ValueError, match="at least one joinable"):
        Join([])


def test_notify_outside_join_is_noop() -> None:
    """Outside a Join (before, after, or disabled), notify issues nothing."""

    def rank_main(rank: int) -> None:
        allreducer = AllReducer(None, dist.group.WORLD)
        assert Join.notify_join_context(allreducer) is None
        with Join([allreducer], enable=False):
            assert Join.notify_join_context(allreducer) is None
        with Join([allreducer]):
            work = Join.notify_join_context(allreducer)
            assert work is not None
            work.wait()
            assert allreducer(1) == 2
        assert Join.notify_join_context(allreducer) is None

    run_ranks(rank_main, world_size=2)


def test_join_on_subgroup_and_last_joiners() -> None:
    """The count runs over the joinables' group (a subgroup here, with group
    ranks differing from global ones); ranks finishing together in the last
    iteration are all last joiners."""
    members = [1, 2, 3]
    inputs = {1: 2, 2: 4, 3: 4}  # group ranks 1 and 2 finish last, together

    class Recorder(AllReducerJoinHook):
        def post_hook(self, is_last_joiner: bool) -> None:
            self.allreducer.last = is_last_joiner

    class RecordingAllReducer(AllReducer):
        def join_hook(self, **kwargs: Any) -> JoinHook:
            return Recorder(self, 1, False)

    def rank_main(rank: int) -> tuple[int, bool] | None:
        sub = dist.new_group(members)
        if rank not in members:
            return None
        allreducer = RecordingAllReducer(None, sub)
        total = 0
        with Join([allreducer]):
            for _ in range(inputs[rank]):
                total += allreducer(1)
        return total, allreducer.last

    results = run_ranks(rank_main)
    assert results == [None, (3 * 2, False), (3 * 2 + 2 * 2, True), (3 * 2 + 2 * 2, True)]


def test_failing_rank_does_not_hang() -> None:
    """A rank that fails inside the Join (never notifying) aborts the group:
    its peers' collectives fail instead of waiting for it."""

    def rank_main(rank: int) -> None:
        allreducer = AllReducer(None, dist.group.WORLD)
        dist.barrier()  # communicators exist before the failure, so the abort is what releases rank 1
        with Join([allreducer]):
            if rank == 0:
                raise KeyError("rank 0 fails")
            for _ in range(3):
                allreducer(1)

    with pytest.raises(KeyError, match="rank 0 fails"):
        run_ranks(rank_main, world_size=2)

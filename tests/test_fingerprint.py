"""The collective fingerprint check of debug mode (NCCL_PG_DEBUG=detail or
TORCH_DISTRIBUTED_DEBUG=DETAIL; issue 14 item 9): ranks that issue
different collectives, or the same one with another dtype, count,
reduction or root, all raise before it runs, naming ranks and fields,
where the backend alone could return garbage or hang. Backend-agnostic
(an all_gather on the group's communicator); tested on the host backend.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import nccl_pg as dist
from nccl_pg import ReduceOp
from nccl_pg.distributed import _get_default_group
from nccl_pg.errors import DistBackendError
from nccl_pg.testing import run_threads

pytestmark = pytest.mark.timeout(60)

Call = Callable[[int], object]

CASES: dict[str, tuple[Call, str]] = {
    # Two roots that each only send (the host backend's headers see it too since issue 25; debug mode sees it first).
    "broadcast roots": (lambda r: dist.broadcast(np.ones(4), src=r), "root 1 vs 0"),
    "dtype of one size": (lambda r: dist.all_reduce(np.ones(4, np.float32 if r == 0 else np.int32)),
                          "dtype int32 vs float32"),
    "reduction": (lambda r: dist.all_reduce(np.ones(4), op=ReduceOp.SUM if r == 0 else ReduceOp.MAX),
                  "reduction MAX vs SUM"),
    "count": (lambda r: dist.all_gather_into_tensor(np.ones(4 * (r + 1)), np.ones(2 * (r + 1))), "count 4 vs 2"),
    "operation": (lambda r: dist.all_reduce(np.ones(4)) if r == 0 else dist.broadcast(np.ones(4), src=0),
                  "operation broadcast vs allreduce"),
    "gather roots": (lambda r: dist.gather(np.ones(2), [np.ones(2), np.ones(2)], dst=r), "root 1 vs 0"),
}


def _run(call: Call) -> list[str]:
    def body(rank: int, world: int) -> str:
        with pytest.raises(DistBackendError, match="fingerprint") as info:
            call(rank)
        seq = _get_default_group()._seq
        x = np.full(3, rank + 1.0)  # the group is intact and nothing was numbered
        dist.all_reduce(x)
        assert (x == 3).all() and _get_default_group()._seq == seq + 1
        return str(info.value)

    return run_threads(body, 2, timeout=30)


@pytest.mark.parametrize("case", list(CASES))
def test_mismatch_raises_on_every_rank_naming_ranks_and_fields(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.setenv("NCCL_PG_DEBUG", "detail")
    call, expected = CASES[case]
    for text in _run(call):
        assert "rank 0 issued" in text and "rank 1 issued" in text and expected in text, text


def test_torch_variable_turns_it_on_and_matching_collectives_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")

    def body(rank: int, world: int) -> None:
        x = np.full(5, rank + 1.0)
        dist.all_reduce(x)
        dist.broadcast(x, src=1)
        out = [np.zeros(5), np.zeros(5)]
        dist.all_gather(out, x)
        dist.barrier()
        assert (x == 3).all() and all((o == 3).all() for o in out)
        with pytest.raises(DistBackendError, match="fingerprint"):
            dist.all_reduce(np.ones(2, np.float32 if rank else np.float64))

    run_threads(body, 2, timeout=30)


def test_off_by_default_headers_still_catch_what_meets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without debug mode no fingerprint is exchanged; the host backend's
    message headers still catch a dtype mismatch (as a backend error)."""
    monkeypatch.delenv("NCCL_PG_DEBUG", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)

    def body(rank: int, world: int) -> str:
        with pytest.raises(DistBackendError) as info:
            dist.all_reduce(np.ones(4, np.float32 if rank == 0 else np.int32))
        return str(info.value)

    for text in run_threads(body, 2, timeout=30):
        assert "fingerprint" not in text and "float32" in text and "int32" in text, text

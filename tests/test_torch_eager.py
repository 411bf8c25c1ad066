"""Eager connection where the caller asks for it (issue 31, item 6): a rank
that never comes fails the call that connects (nccl_pg's
``init_process_group(device_id=)``, a torch group's ``eager_connect``,
torchft's ``configure()``) after the timeout, naming it, as Gloo's
``init_process_group`` does, rather than the first collective; and a group
whose ranks all come is usable when the call returns."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

import nccl_pg

pytestmark = pytest.mark.timeout(60)
torch = pytest.importorskip("torch", reason="the torch tests need PyTorch (pip install torch)")
import torch.distributed as tdist  # noqa: E402


def test_nccl_pg_init_with_device_id_fails_at_init_naming_the_missing_rank() -> None:
    start = time.monotonic()
    with pytest.raises(nccl_pg.DistBackendError, match=r"timeout: .*ranks \[1\] never joined"):
        nccl_pg.init_process_group("host", store=nccl_pg.HashStore(), rank=0, world_size=2, timeout=1.0,
                                   device_id="cpu")
    assert time.monotonic() - start < 10
    with pytest.raises(ValueError, match="not initialized"):
        nccl_pg.destroy_process_group()  # nothing was left initialized


def test_torchft_configure_fails_when_a_replica_never_comes() -> None:
    from nccl_pg.torch.torchft import ProcessGroupNcclPg

    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupNcclPg(timeout=timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(tdist.DistBackendError, match=r"ranks \[1\] never joined.*wait timeout after"):
        pg.configure(f"127.0.0.1:{master.port}/quorum1", "0", 0, 2)
    assert time.monotonic() - start < 10
    pg.abort()


def test_torch_group_connects_eagerly_then_runs() -> None:
    """Two ranks (threads, as torchft's tests run them) of a torch group over a torch store: eager_connect
    returns once both joined, and a collective then runs on the connected group."""
    from nccl_pg.torch.process_group import ProcessGroupTorch

    master = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out: dict[int, float] = {}

    def rank(r: int) -> None:
        store = tdist.PrefixStore("eager", tdist.TCPStore("127.0.0.1", master.port, is_master=False))
        pg = ProcessGroupTorch(store, r, 2, timedelta(seconds=20), group_name="eager")
        pg.eager_connect()
        assert pg._get_backend(torch.device("cpu")) is pg and pg.supports_splitting
        t = torch.full((2,), r + 1.0)
        pg.allreduce([t]).wait()
        out[r] = float(t[0])
        pg.shutdown()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: 3.0, 1: 3.0}

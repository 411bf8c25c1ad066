"""The "nccl_pg" torch.distributed backend: every collective through torch's
API, subgroups, object collectives, coalescing, Works and futures, torch's
exception types, timeouts that name the missing rank and write flight
recorder dumps. Also torch-side ports of test_multi_threaded_pg's collective
scenarios (on process ranks: torch's threaded PG is its own backend).

One world runs many checks: starting a world costs more than the checks.
CPU tensors run on the host backend; the ``gpu`` variants run the same
scenarios on CUDA tensors (NCCL backend, ranks sharing GPU 0).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import warnings
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need PyTorch (pip install torch)")
import torch.distributed as tdist  # noqa: E402
from harness.forked import Rank, run_world  # noqa: E402
from harness.torch_ranks import DEVICES, _need_cuda, device, init  # noqa: E402, F401 - _need_cuda: autouse

import nccl_pg.torch  # noqa: E402
from nccl_pg import errors  # noqa: E402
from nccl_pg.torch.process_group import ProcessGroupTorch  # noqa: E402
from nccl_pg.torch.store import TorchStore  # noqa: E402
from nccl_pg.torch.work import to_torch  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def _s_collectives(r: Rank) -> None:
    pg = init(r)
    dev, rank, n = device(r), r.rank, r.world_size
    assert isinstance(pg, ProcessGroupTorch) and tdist.get_backend() == "nccl_pg"
    assert pg.name() == "nccl_pg" and tdist.get_rank() == rank and tdist.get_world_size() == n

    # all_reduce: every op torch has that we have, several dtypes, in place (no copy)
    for op, want in ((tdist.ReduceOp.SUM, n * (n + 1) / 2), (tdist.ReduceOp.MAX, n), (tdist.ReduceOp.MIN, 1),
                     (tdist.ReduceOp.PRODUCT, 2.0 if n == 2 else 6.0), (tdist.ReduceOp.AVG, (n + 1) / 2)):
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            t = torch.full((5,), float(rank + 1), dtype=dtype, device=dev)
            ptr = t.data_ptr()
            tdist.all_reduce(t, op=op)
            assert t.data_ptr() == ptr and torch.allclose(t.float(), torch.full((5,), float(want), device=dev)), \
                (op, dtype, t)
    i = torch.tensor([rank + 1], dtype=torch.int64, device=dev)
    tdist.all_reduce(i)
    assert i.item() == n * (n + 1) // 2
    with pytest.raises(ValueError, match="BAND is not supported"):
        tdist.all_reduce(i, op=tdist.ReduceOp.BAND)

    # broadcast / reduce from each root
    for root in range(n):
        t = torch.full((3,), float(rank), device=dev)
        tdist.broadcast(t, src=root)
        assert (t == root).all()
        t = torch.full((3,), 1.0, device=dev)
        tdist.reduce(t, dst=root)
        assert (t == (n if rank == root else 1)).all()

    # gathers and scatters
    outs = [torch.empty(2, device=dev) for _ in range(n)]
    tdist.all_gather(outs, torch.full((2,), float(rank), device=dev))
    assert [o[0].item() for o in outs] == list(range(n))
    out = torch.empty(2 * n, device=dev)
    tdist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=dev))
    assert out.tolist() == [float(k) for k in range(n) for _ in range(2)]
    rs = torch.empty(2, device=dev)
    tdist.reduce_scatter(rs, [torch.full((2,), float(k), device=dev) for k in range(n)])
    assert (rs == n * rank).all()
    rs1 = torch.empty(1, device=dev)
    tdist.reduce_scatter_tensor(rs1, torch.arange(n, dtype=torch.float32, device=dev))
    assert rs1.item() == n * rank
    a2a = torch.empty(n, device=dev)
    tdist.all_to_all_single(a2a, torch.arange(n, dtype=torch.float32, device=dev) + 10 * rank)
    assert a2a.tolist() == [10.0 * k + rank for k in range(n)]
    # uneven splits: rank k sends k+1 rows to everyone
    rows_in = [rank + 1] * n
    rows_out = [k + 1 for k in range(n)]
    inp = torch.full((sum(rows_in), 2), float(rank), device=dev)
    got = torch.empty((sum(rows_out), 2), device=dev)
    tdist.all_to_all_single(got, inp, output_split_sizes=rows_out, input_split_sizes=rows_in)
    assert got[:, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    lst_out = [torch.empty(1, device=dev) for _ in range(n)]
    tdist.all_to_all(lst_out, [torch.tensor([float(rank * n + k)], device=dev) for k in range(n)])
    assert [o.item() for o in lst_out] == [float(k * n + rank) for k in range(n)]
    if dev.type == "cpu":  # gather/scatter: NCCL-backed in ours, but torch's own NCCL backend lacks them on CPU
        g = [torch.empty(1) for _ in range(n)] if rank == 0 else None
        tdist.gather(torch.tensor([float(rank)]), g, dst=0)
        assert g is None or [x.item() for x in g] == [float(k) for k in range(n)]
        s = torch.empty(1)
        tdist.scatter(s, [torch.tensor([float(k)]) for k in range(n)] if rank == 0 else None, src=0)
        assert s.item() == rank

    # point to point, plain and batched (coalesced into one Work)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    if rank == 0:
        tdist.send(torch.arange(3.0, device=dev), 1)
    elif rank == 1:
        got = torch.empty(3, device=dev)
        tdist.recv(got, 0)
        assert got.tolist() == [0.0, 1.0, 2.0]
    buf = torch.empty(2, device=dev)
    ops = [tdist.P2POp(tdist.isend, torch.full((2,), float(rank), device=dev), nxt),
           tdist.P2POp(tdist.irecv, buf, prv)]
    for w in tdist.batch_isend_irecv(ops):
        w.wait()
    assert (buf == prv).all()

    # coalescing manager (all_reduce fast path) and the deprecated coalesced API
    ts = [torch.full((k + 1,), 1.0, device=dev) for k in range(3)]
    with tdist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            tdist.all_reduce(t)
    cm.wait()
    assert all((t == n).all() for t in ts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        tdist.all_reduce_coalesced([t.fill_(1.0) for t in ts])
    assert all((t == n).all() for t in ts)

    # Works and futures
    t = torch.ones(4, device=dev)
    w = tdist.all_reduce(t, async_op=True)
    fut = w.get_future()
    assert w.wait() and w.is_completed() and w.is_success() and w.exception() is None
    assert fut.wait()[0] is t and (t == n).all()
    chained = tdist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert (chained.wait() == 2 * n * n).all()

    # layout: channels_last is dense (torch's NCCL accepts it); a strided slice is not
    cl = torch.full((2, 3, 4, 5), float(rank), device=dev).to(memory_format=torch.channels_last)
    tdist.broadcast(cl, src=0)
    assert (cl == 0).all() and cl.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="Tensors must be contiguous"):
        tdist.all_reduce(torch.ones(4, 4, device=dev)[:, 1])

    # object collectives (on CPU tensors)
    objs = [None] * n
    tdist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": k} for k in range(n)]
    lst = [{"from": 0}, "x"] if rank == 0 else [None, None]
    tdist.broadcast_object_list(lst, src=0)
    assert lst == [{"from": 0}, "x"]

    # subgroups: created through our backend (members only), the barrier
    sub = tdist.new_group([0, 1])
    if rank in (0, 1):
        assert isinstance(sub, ProcessGroupTorch) and sub.size() == 2
        t = torch.ones(1, device=dev)
        tdist.all_reduce(t, group=sub)
        assert t.item() == 2
    tdist.barrier()
    tdist.destroy_process_group()


@DEVICES
def test_collectives(tmp_path, backend):
    run_world(_s_collectives, 3, tmp_path, backend=backend, timeout=80)


def _s_timeout(r: Rank) -> str:
    init(r, timeout=2.0)
    t = torch.ones(2, device=device(r))
    tdist.all_reduce(t)  # every rank: seq 1
    if r.rank == 1:
        return "skipped"  # never issues the second collective; stays alive (the harness keeps it) until told
    with pytest.raises(tdist.DistBackendError, match=r"timeout: .*all_reduce #2 .*ranks \[1\] never issued") \
            as info:
        tdist.all_reduce(t)
    return str(info.value)


@DEVICES
def test_timeout_names_the_missing_rank_and_dumps(tmp_path, backend):
    """torch code that catches DistBackendError sees our timeout, naming the
    rank that skipped the collective; every rank writes a flight recorder dump."""
    prefix = str(tmp_path / "trace_")
    results = run_world(_s_timeout, 2, tmp_path, backend=backend, timeout=60,
                        env={"NCCL_PG_DEBUG_INFO_TEMP_FILE": prefix, "NCCL_PG_WATCHDOG_INTERVAL": "0.05"})
    assert "debug dump" in results[0], results[0]
    dumps = sorted(os.path.basename(p) for p in glob.glob(prefix + "*") if not p.endswith(".pipe"))
    assert "trace_0" in dumps, dumps


def _s_nan_check(r: Rank) -> str | None:
    init(r)
    t = torch.ones(8, device=device(r))
    if r.rank == 1:
        t[5] = float("nan")
    error = None
    try:
        tdist.all_reduce(t)  # async mode: the collective runs; only the Work of the rank with the NaN fails
    except tdist.DistBackendError as exc:
        error = str(exc)
    clean = torch.ones(4, device=device(r))
    tdist.all_reduce(clean)  # the group is still usable
    assert clean.tolist() == [2.0] * 4
    tdist.destroy_process_group()
    return error


@DEVICES
def test_nan_check_applies_to_torch_jobs(tmp_path, backend):
    """NCCL_PG_NAN_CHECK=async on a torch job: the rank whose input has a NaN
    gets a DistBackendError naming the rank, the op and the element; the
    others' all_reduce completes; the group stays usable."""
    results = run_world(_s_nan_check, 2, tmp_path, backend=backend, timeout=60, env={"NCCL_PG_NAN_CHECK": "async"})
    assert results[0] is None
    assert "NaN" in results[1] and "all_reduce" in results[1] and "element 5" in results[1], results[1]


def test_group_names_and_subgroup_destroy():
    """torch reads ``group_name`` (e.g. to destroy a subgroup); a Python group
    has no C++ backend to keep it on, so ours keeps it."""
    code = ("import torch, torch.distributed as d, nccl_pg.torch\n"
            "d.init_process_group('nccl_pg', store=d.HashStore(), rank=0, world_size=1)\n"
            "g = d.new_group([0])\n"
            "assert (d.group.WORLD.group_name, g.group_name) == ('0', '1'), (d.group.WORLD.group_name, g.group_name)\n"
            "t = torch.ones(2); d.all_reduce(t, group=g); assert t.tolist() == [1.0, 1.0]\n"
            "d.destroy_process_group(g)\n"
            "assert d.get_world_size() == 1\n"
            "d.destroy_process_group()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_error_types_map_to_torch():
    for ours, theirs in ((errors.DistBackendError("a"), tdist.DistBackendError),
                         (errors.NanError("b"), tdist.DistBackendError),
                         (errors.DistStoreError("c"), tdist.DistStoreError),
                         (errors.DistNetworkError("d"), tdist.DistNetworkError)):
        mapped = to_torch(ours)  # (ours are torch's already, with torch loaded: nccl_pg/errors.py)
        assert isinstance(mapped, theirs) and str(mapped) == str(ours)
    other = ValueError("x")
    assert to_torch(other) is other


def test_store_adapter_keeps_our_deadlines():
    store = TorchStore(tdist.HashStore(), timeout=0.2)
    store.set("a", "1")
    assert store.get("a") == b"1" and store.add("n", 2) == 2 and store.check(["a"])
    assert store.compare_set("a", b"1", b"2") == b"2"
    store.multi_set(["x", "y"], [b"1", b"2"])
    assert store.multi_get(["x", "y"]) == [b"1", b"2"]
    store.append("x", b"3")
    assert store.get("x") == b"13" and store.delete_key("y") and store.num_keys() >= 3
    with pytest.raises(errors.DistStoreError):
        store.get("missing")  # our deadline (0.2 s), not torch's store default
    with pytest.raises(errors.DistStoreError):
        store.wait(["missing"], timedelta(seconds=0.1))


def test_store_adapter_timeouts_of_torchs_file_store_are_store_timeouts(tmp_path):
    """torch's FileStore reports a wait timeout as a plain RuntimeError: the
    adapter makes it our DistStoreError saying "timeout", as for torch's other
    stores, so that a host init over it names who never joined (torch's
    test_barrier_timeout_full_group looks for "Timed out")."""
    store = TorchStore(tdist.FileStore(str(tmp_path / "fs"), 1), timeout=0.2)
    with pytest.raises(errors.DistStoreError, match="Timed out"):
        store.wait(["missing"])
    with pytest.raises(errors.DistStoreError, match="timeout"):
        store.get("missing")


def test_registration():
    """Registered by importing nccl_pg.torch, again (idempotent) by hand and
    by the ``torch.backends`` entry point torch runs at import."""
    nccl_pg.torch.register()
    nccl_pg.torch._autoload()
    assert "nccl_pg" in tdist.Backend.backend_list
    assert tdist.Backend.default_device_backend_map.get("cpu") in ("gloo", "nccl_pg")
    assert tdist.is_backend_available("nccl_pg")
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        points = tomllib.load(f)["project"]["entry-points"]["torch.backends"]
    assert points == {"nccl_pg": "nccl_pg.torch:_autoload"}

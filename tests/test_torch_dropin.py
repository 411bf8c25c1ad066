"""What torch's own DistributedTest found missing or wrong on the "nccl_pg"
backend (issue 17), each checked through torch's API as a torch user calls
it: all_gather_coalesced's layout, receives posted before sends on every
rank, monitored_barrier, receiving from any source, sparse all_reduce and
DDP with sparse gradients, and timeout messages torch's tests match; and
every call form of torch's ProcessGroup methods (issue 31).
"""

from __future__ import annotations

import copy
import re
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need PyTorch (pip install torch)")
import torch.distributed as tdist  # noqa: E402
from harness.forked import Rank, run_world  # noqa: E402
from harness.torch_ranks import init  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def _s_all_gather_coalesced(r: Rank) -> None:
    """output_tensor_lists[k][i] receives rank k's inputs[i] (one list per
    rank, one tensor per input), with counts that differ from the world size
    and with equal ones (which used to come back transposed)."""
    init(r)
    n, me = r.world_size, r.rank
    for count in (n + 1, n):
        inputs = [torch.full((i + 1,), 10.0 * me + i) for i in range(count)]
        outputs = [[torch.empty(i + 1) for i in range(count)] for _ in range(n)]
        tdist.all_gather_coalesced(outputs, inputs)
        for k in range(n):
            for i in range(count):
                assert (outputs[k][i] == 10.0 * k + i).all(), (count, k, i, outputs[k][i])
    with pytest.raises(ValueError, match="each output list must hold 2 tensors"):
        tdist.all_gather_coalesced([[torch.empty(1)] for _ in range(n)], [torch.ones(1), torch.ones(1)])
    tdist.barrier()
    tdist.destroy_process_group()


# Three ranks (an odd world: rings, a bystander); two ranks run in test_torch_suite.py's selection of torch's
# own tests, and both in `make torch-suite`.
@pytest.mark.parametrize("n", [3])
def test_all_gather_coalesced_layout(tmp_path, n):
    run_world(_s_all_gather_coalesced, n, tmp_path, timeout=60)


def _s_batch_recv_first(r: Rank) -> None:
    """torch's batch_isend_irecv hands a Python group its ops one by one; here
    every rank lists its receives first (test_batch_isend_irecv_gloo, _tags)."""
    init(r, timeout=15)
    me, n = r.rank, r.world_size
    ops, got = [], {}
    for peer in range(n):
        if peer != me:
            got[peer] = torch.full((peer + 1,), -1.0)
            ops.append(tdist.P2POp(tdist.irecv, got[peer], peer, tag=peer))
            ops.append(tdist.P2POp(tdist.isend, torch.full((me + 1,), float(me)), peer, tag=me))
    for work in tdist.batch_isend_irecv(ops):
        work.wait()
    assert all((t == p).all() for p, t in got.items())
    tdist.destroy_process_group()


# Three ranks (an odd world: rings, a bystander); two ranks run in test_torch_suite.py's selection of torch's
# own tests, and both in `make torch-suite`.
@pytest.mark.parametrize("n", [3])
def test_batch_isend_irecv_with_receives_first(tmp_path, n):
    run_world(_s_batch_recv_first, n, tmp_path, timeout=60)


def _s_monitored_barrier(r: Rank) -> None:
    """torch.distributed.monitored_barrier (which torch refuses for any backend
    but Gloo) and the group's own method, with Gloo's messages."""
    init(r, timeout=30)
    me = r.rank
    tdist.monitored_barrier(timeout=timedelta(seconds=5))
    tdist.monitored_barrier(timeout=timedelta(seconds=5), wait_all_ranks=True)
    if me == 0:
        with pytest.raises(tdist.DistBackendError, match="Rank 1 failed to pass monitoredBarrier"):
            tdist.monitored_barrier(timeout=timedelta(seconds=0.5))
        with pytest.warns(UserWarning, match="specify timeout arg as a timedelta"), \
                pytest.raises(RuntimeError, match="Ranks 1, 2 failed to pass monitoredBarrier in 100 ms"):
            tdist.monitored_barrier(None, 0.1, wait_all_ranks=True)
        with pytest.raises(RuntimeError, match="Rank 0 timed out in monitoredBarrier"):
            tdist.group.WORLD.monitored_barrier(timedelta(seconds=0))
    elif me == 2:
        with pytest.raises(RuntimeError, match="Rank 2 successfully reached monitoredBarrier, but received errors "
                                               "while waiting for send/recv from rank 0"):
            tdist.monitored_barrier(timeout=timedelta(seconds=0.5))
    r.store().set(f"mb/{me}", b"")  # rank 1 stays until the others are done
    r.store().wait([f"mb/{k}" for k in range(3)])
    tdist.destroy_process_group()


def test_monitored_barrier_through_torch(tmp_path):
    run_world(_s_monitored_barrier, 3, tmp_path, timeout=60)


def _s_any_source(r: Rank) -> list[int]:
    """torch's recv(tensor) with no src returns the sender's global rank;
    irecv's Work answers _source_rank() with its group rank."""
    init(r, timeout=15)
    me, n = r.rank, r.world_size
    senders = []
    if me == 0:
        for _ in range(n - 1):
            t = torch.zeros(3)
            src = tdist.recv(t)
            assert (t == src).all()
            senders.append(src)
        t = torch.zeros(3)
        work = tdist.irecv(t)
        work.wait()
        assert (t == work._source_rank()).all()
        senders.append(work._source_rank())
    else:
        tdist.send(torch.full((3,), float(me)), 0)
        if me == 1:
            tdist.send(torch.full((3,), float(me)), 0)
    tdist.barrier()
    tdist.destroy_process_group()
    return senders


def test_recv_from_any_source_through_torch(tmp_path):
    assert sorted(run_world(_s_any_source, 3, tmp_path, timeout=60)[0]) == [1, 1, 2]


def _sparse(rank: int, n: int, dense_dims: int) -> torch.Tensor:
    """Rank k holds ones at rows 0..k (overlapping across ranks), uncoalesced
    (row 0 twice) to check the input is coalesced first."""
    rows = torch.tensor([[0, *range(rank + 1)]])
    values = torch.ones([rank + 2] + [2] * dense_dims)
    return torch.sparse_coo_tensor(rows, values, [n] + [2] * dense_dims)


def _s_sparse_all_reduce(r: Rank) -> None:
    init(r)
    n = r.world_size
    for dense_dims in (0, 1, 2):
        t = _sparse(r.rank, n, dense_dims)
        tdist.all_reduce(t)
        want = sum((_sparse(k, n, dense_dims) for k in range(n)), torch.zeros([n] + [2] * dense_dims))
        assert t.is_sparse and t.is_coalesced()
        torch.testing.assert_close(t.to_dense(), want)
    empty = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64), torch.zeros(0), (4,))
    mine = empty if r.rank == 0 else torch.sparse_coo_tensor(torch.tensor([[r.rank]]), torch.ones(1), (4,))
    tdist.all_reduce(mine)
    assert mine.to_dense().tolist() == [float(0 < k < n) for k in range(4)]
    with pytest.raises(ValueError, match=r"only ReduceOp\.SUM"):
        tdist.all_reduce(_sparse(r.rank, n, 0), op=tdist.ReduceOp.MAX)
    tdist.destroy_process_group()


# Three ranks (an odd world: rings, a bystander); two ranks run in test_torch_suite.py's selection of torch's
# own tests, and both in `make torch-suite`.
@pytest.mark.parametrize("n", [3])
def test_sparse_all_reduce(tmp_path, n):
    run_world(_s_sparse_all_reduce, n, tmp_path, timeout=60)


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.fc = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).mean(1))


def _s_ddp_sparse(r: Rank, steps: int = 4) -> None:
    """DDP with a sparse embedding gradient on CPU trains to the parameters of
    one process that sees the whole batch."""
    init(r)
    n, me = r.world_size, r.rank
    torch.manual_seed(0)
    ids, y = torch.randint(0, 20, (4 * n, 3)), torch.randn(4 * n, 1)
    ref = _Bag()
    ddp = DDP(copy.deepcopy(ref))
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(ddp.parameters(), lr=0.5)
    mine = slice(4 * me, 4 * (me + 1))
    for _ in range(steps):
        opt_ref.zero_grad()
        nn.functional.mse_loss(ref(ids), y).backward()
        opt_ref.step()
        opt.zero_grad()
        nn.functional.mse_loss(ddp(ids[mine]), y[mine]).backward()
        assert ddp.module.emb.weight.grad.is_sparse
        opt.step()
    for a, b in zip(ref.parameters(), ddp.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    tdist.destroy_process_group()


def test_ddp_with_sparse_gradients_matches_one_process(tmp_path):
    run_world(_s_ddp_sparse, 3, tmp_path, timeout=80)


def _s_barrier_timeout(r: Rank) -> str:
    """torch's test_barrier_timeout_* look for " (Timed out|closed|timeout) "."""
    init(r, timeout=5.0)
    tdist.barrier()
    message = ""
    if r.rank == 0:
        with pytest.raises(tdist.DistBackendError) as info:
            tdist.barrier()
        message = str(info.value)
    r.store().set(f"bt/{r.rank}", b"")
    r.store().wait([f"bt/{k}" for k in range(r.world_size)])
    return message


def test_barrier_timeout_message_matches_torchs_tests(tmp_path):
    message = run_world(_s_barrier_timeout, 2, tmp_path, timeout=60,
                        env={"NCCL_PG_DUMP_ON_TIMEOUT": "0"})[0]
    assert re.search(" (Timed out|closed|timeout) ", message), message


def _s_wait_timeout(r: Rank) -> str:
    """A Work.wait(timeout) that expires says so in the words torch's tests match."""
    init(r, timeout=20)
    tdist.barrier()  # the communicator exists before rank 1 waits on the store
    t = torch.zeros(1)
    message = ""
    if r.rank == 0:
        work = tdist.irecv(t, 1)
        with pytest.raises(tdist.DistBackendError) as info:
            work.wait(timeout=timedelta(milliseconds=300))
        message = str(info.value)
        r.store().set("wt/sent?", b"")
        work.wait()
        assert t.item() == 7.0
    else:
        r.store().wait(["wt/sent?"])
        tdist.send(torch.full((1,), 7.0), 0)
    tdist.barrier()
    tdist.destroy_process_group()
    return message


def test_wait_timeout_message_matches_torchs_tests(tmp_path):
    message = run_world(_s_wait_timeout, 2, tmp_path, timeout=60)[0]
    assert re.search(" (Timed out|closed|timeout) ", message) and "Timed out waiting 300ms" in message, message


def _s_every_form(r: Rank) -> None:
    init(r)
    pg = tdist.group.WORLD
    me, n = r.rank, r.world_size
    total = n * (n + 1) / 2

    def full(v: float, size: int = 2) -> torch.Tensor:
        return torch.full((size,), float(v))

    # allreduce: torch's form, a bare ReduceOp (torchft's wrapper), its RedOpType constant, a bare tensor
    for call in (lambda t: pg.allreduce([t], tdist.AllreduceOptions()),
                 lambda t: pg.allreduce([t], tdist.ReduceOp(tdist.ReduceOp.SUM)),
                 lambda t: pg.allreduce([t], tdist.ReduceOp.SUM),
                 lambda t: pg.allreduce([t], op=tdist.ReduceOp.SUM, timeout=timedelta(seconds=30)),
                 lambda t: pg.allreduce(t, tdist.ReduceOp.SUM),
                 lambda t: pg.allreduce(tensor=t)):
        t = full(me + 1)
        call(t).wait()
        assert (t == total).all(), t
    t = full(me + 1)
    pg.allreduce([t], tdist.ReduceOp.MAX).wait()
    assert (t == n).all()
    with pytest.raises(ValueError, match="BAND is not supported"):
        pg.allreduce([full(1)], tdist.ReduceOp.BAND)
    # broadcast and reduce: options, a bare root (and op), keywords
    for call in (lambda t: pg.broadcast([t], tdist.BroadcastOptions()), lambda t: pg.broadcast(t, 0),
                 lambda t: pg.broadcast(tensor=t, root=0, timeout=timedelta(seconds=30))):
        t = full(me + 7)
        call(t).wait()
        assert (t == 7).all()
    opts = tdist.ReduceOptions()
    opts.rootRank, opts.reduceOp = 1, tdist.ReduceOp.MAX
    for call in (lambda t: pg.reduce([t], opts), lambda t: pg.reduce(t, 1, tdist.ReduceOp.MAX),
                 lambda t: pg.reduce(tensor=t, root=1, op=tdist.ReduceOp.MAX)):
        t = full(me + 1)
        call(t).wait()
        assert me != 1 or (t == n).all()
    # allgather: lists per device, or one list and a bare input
    outs = [[full(-1) for _ in range(n)]]
    pg.allgather(outs, [full(me)]).wait()
    assert [o[0].item() for o in outs[0]] == list(range(n))
    flat = [full(-1) for _ in range(n)]
    pg.allgather(flat, full(me), timedelta(seconds=30)).wait()
    assert [o[0].item() for o in flat] == list(range(n))
    # gather and scatter at root 1
    opts_g = tdist.GatherOptions()
    opts_g.rootRank = 1
    got = [[full(-1) for _ in range(n)]] if me == 1 else []
    pg.gather(got, [full(me)], opts_g).wait()
    assert me != 1 or [g[0].item() for g in got[0]] == list(range(n))
    got_flat = [full(-1) for _ in range(n)] if me == 1 else []
    pg.gather(got_flat, full(me), 1).wait()
    assert me != 1 or [g[0].item() for g in got_flat] == list(range(n))
    opts_s = tdist.ScatterOptions()
    opts_s.rootRank = 1
    out = full(-1)
    pg.scatter([out], [[full(10 + i) for i in range(n)]] if me == 1 else [], opts_s).wait()
    assert out[0].item() == 10 + me
    out = full(-1)
    pg.scatter(out, [full(20 + i) for i in range(n)] if me == 1 else [], 1).wait()
    assert out[0].item() == 20 + me
    # reduce_scatter: lists per device with options, or a bare output, a list and an op
    out = full(-1)
    pg.reduce_scatter([out], [[full(me + i) for i in range(n)]], tdist.ReduceScatterOptions()).wait()
    assert out[0].item() == sum(k + me for k in range(n))
    out = full(-1)
    pg.reduce_scatter(out, [full(1) for _ in range(n)], tdist.ReduceOp.SUM).wait()
    assert out[0].item() == n
    # all_to_all_single / alltoall_base (options or timeout, keywords), alltoall
    inp, res = torch.arange(n, dtype=torch.float32) + 10 * me, torch.empty(n)
    pg.all_to_all_single(res, inp, [], []).wait()
    assert res.tolist() == [10.0 * k + me for k in range(n)]
    res = torch.empty(n)
    pg.alltoall_base(output=res, input=inp, output_split_sizes=[1] * n, input_split_sizes=[1] * n,
                     timeout=timedelta(seconds=30)).wait()
    assert res.tolist() == [10.0 * k + me for k in range(n)]
    outs2 = [full(-1) for _ in range(n)]
    pg.alltoall(outs2, [full(10 * me + k) for k in range(n)]).wait()
    assert [o[0].item() for o in outs2] == [10.0 * k + me for k in range(n)]
    outs2 = [full(-1) for _ in range(n)]
    pg.alltoall(output=outs2, input=[full(10 * me + k) for k in range(n)], timeout=timedelta(seconds=30)).wait()
    assert [o[0].item() for o in outs2] == [10.0 * k + me for k in range(n)]
    # the *_single / *_coalesced ones under their torch names, positional and by torch's keywords
    big = torch.empty(2 * n)
    pg._allgather_base(big, full(me)).wait()
    assert big.tolist() == [float(k) for k in range(n) for _ in range(2)]
    small = full(-1)
    pg._reduce_scatter_base(outputTensor=small, inputTensor=torch.ones(2 * n), opts=None).wait()
    assert (small == n).all()
    # point-to-point by torch's parameter names, and barriers in both forms
    if me == 0:
        pg.send(tensors=[full(5)], dstRank=1, tag=0).wait()
    elif me == 1:
        t = full(-1)
        pg.recv(tensors=[t], srcRank=0, tag=0).wait()
        assert (t == 5).all()
    pg.barrier(tdist.BarrierOptions()).wait()
    pg.barrier(timeout=timedelta(seconds=30)).wait()
    pg.barrier(timedelta(seconds=30)).wait()
    tdist.destroy_process_group()


def test_every_call_form_through_a_group(tmp_path) -> None:
    """Every form of torch 2.13's ProcessGroup methods (tests/test_torch_call_forms.py checks that each
    overload of its stub binds), through a group, with values checked (issue 31, item 4)."""
    run_world(_s_every_form, 2, tmp_path, timeout=60)

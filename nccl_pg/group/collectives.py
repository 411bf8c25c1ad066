"""The collectives and point-to-point operations of a process group, as
torch's ProcessGroup takes them (group ranks; in place where torch is): the
arguments checked and shaped into the flat buffers the Communicator
contract takes (copies in and out run on the same stream)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np

from ..arrays import Array
from ..coll_config import CollConfig
from ..comm.base import Communicator, Stream
from ..errors import DistBackendError
from ..reduce_op import PremulSum, ReduceOp, resolve
from ..store import PrefixStore
from ..timeouts import Timeout, to_seconds
from .fingerprint import Fingerprint
from .issuing import ANY_SOURCE, Issuing
from .monitored_barrier import monitored_barrier
from .work import OpType, Work

Op = ReduceOp | PremulSum
# An array, or torch's one-element list of it (one device per process).
ArrayArg: TypeAlias = Array | Sequence[Array]


def _real(dtype: np.dtype) -> np.dtype:
    """Complex arrays travel as their real view (NCCL has no complex type)."""
    return np.empty(0, dtype).real.dtype if np.issubdtype(dtype, np.complexfloating) else dtype


def _all_reduce_in_place(array: Any, op: ReduceOp, scale: float | None, comm: Communicator, stream: Stream) -> None:
    comm.all_reduce(array, array, op, stream, scale)


def _one(x: Any) -> Any:
    """torch's ProcessGroup methods take a list with one tensor per device;
    a process here drives one device."""
    if isinstance(x, (list, tuple)):
        if len(x) != 1:
            raise ValueError(f"expected one array (one device per process), got {len(x)}")
        return x[0]
    return x


def _one_list(x: Sequence[Any]) -> Sequence[Any]:
    """``[[t0, t1, ...]]`` (torch's per-device nesting) or ``[t0, t1, ...]``."""
    if len(x) == 1 and isinstance(x[0], (list, tuple)):
        return x[0]
    return x


class Collectives(Issuing):
    """The operations (see ProcessGroup)."""

    def _coll_config(self, config: CollConfig | None, collective: str) -> CollConfig | None:
        """``config=`` of a collective, checked before anything is numbered or enqueued (a bad algorithm
        selection found by NCCL inside the enqueue would leave a nonblocking communicator in error)."""
        if config is None:
            return None
        if not isinstance(config, CollConfig):
            raise TypeError(f"{collective}: config must be a nccl_pg.CollConfig, got {type(config).__name__}")
        config.check_for(collective, self.options.config.max_ctas)
        return config

    def _digest(self, config: CollConfig | None) -> int:
        """What the fingerprint check compares of the per-call settings: the config, and whether launch marks
        are on (NCCL: "Every rank must provide a non-NULL event or every rank must provide NULL")."""
        return ((0 if config is None else config.digest()) << 1) | int(self._launch_marks)

    def _flat(self, array: Any, what: str, output: bool = False) -> Any:
        """``array`` as the backend's flat array, or the argument error, raised
        here on the caller's rank before anything is numbered or enqueued.
        ``output``: this rank's operation writes it."""
        return self._backend.checked_flat(array, what, output)

    def _reducible(self, flat: Any, op: ReduceOp, scale: float | None, what: str) -> None:
        self._backend.check_reduction(self._backend.dtype(flat), op, scale, what)

    def _same_dtype(self, flats: Sequence[Any], what: str) -> None:
        dtypes = {_real(self._backend.dtype(f)) for f in flats}
        if len(dtypes) > 1:
            a, b = sorted(str(d) for d in dtypes)[:2]
            raise ValueError(f"{what}: invalid usage of tensors with different dtypes: found {a} and {b}")

    def _moved(self, flat: Any) -> Any:
        """The real view of a complex array (data movement only)."""
        dt = self._backend.dtype(flat)
        return flat.view(_real(dt)) if np.issubdtype(dt, np.complexfloating) else flat

    def _group_rank(self, r: int, what: str) -> int:
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self._size:
            raise ValueError(f"{what} {r!r} out of range for a group of {self._size} ranks")
        return int(r)

    def _list(self, arrays: Sequence[Any], what: str, like: Any, output: bool = False) -> list[Any]:
        if len(arrays) != self._size:
            raise ValueError(f"{what}: expected {self._size} arrays (one per rank), got {len(arrays)}")
        flats = [self._flat(a, f"{what}[{i}]", output) for i, a in enumerate(arrays)]
        self._same_dtype([like, *flats], what)
        for i, f in enumerate(flats):
            if f.size * f.itemsize != like.size * like.itemsize:
                raise ValueError(f"{what}[{i}] has {f.size} elements; expected {like.size} like the input")
        return [self._moved(f) for f in flats]

    def _gathered(self, outs: list[Any], like: Any) -> tuple[Any, Callable[[Stream], None]]:
        """A flat buffer for size x ``like`` and the copy-out into ``outs``."""
        tmp = self._backend.empty(like.size * self._size, like.dtype, self._device)
        n = like.size

        def copy_out(stream: Stream) -> None:
            for i, o in enumerate(outs):
                self._backend.copy(o, tmp[i * n:(i + 1) * n], stream)

        return tmp, copy_out

    def _packed(self, ins: list[Any], like: Any, stream: Stream) -> Any:
        """``ins`` copied (on ``stream``) into one flat buffer, once the
        caller's work writing them (and allocating it) has run."""
        tmp = self._backend.empty(sum(i.size for i in ins), like.dtype, self._device)
        self._backend.wait_for_caller(stream, self._device)
        at = 0
        for i in ins:
            self._backend.copy(tmp[at:at + i.size], i, stream)
            at += i.size
        return tmp

    def allreduce(self, tensor: ArrayArg, op: Op = ReduceOp.SUM, config: CollConfig | None = None) -> Work | None:
        cfg = None if config is None else self._coll_config(config, "all_reduce")
        t, rop, scale = self._backend.in_place_reduction(_one(tensor), op, "all_reduce")
        return self._issue(OpType.ALLREDUCE, [tensor], lambda c, s: c.all_reduce(t, t, rop, s, scale),
                           check=[("tensor", _one(tensor))] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.ALLREDUCE, self._backend.dtype(t), t.size, rop,
                                                                    config=self._digest(cfg)), config=cfg)

    def allreduce_host(self, values: np.ndarray, op: Op = ReduceOp.SUM, timeout: float | None = None) -> np.ndarray:
        """all_reduce of a small numpy array on whatever device this group's backend drives (copied there and
        back): the agreements of the control plane (nccl_pg.elastic's step), on NCCL as on the host; waited
        for on the CPU, at most ``timeout`` seconds (default: the group's timeout)."""
        buf = self._backend.from_host(np.ascontiguousarray(values), self._device)
        work = self.allreduce(buf, op)
        if work is not None:
            work.wait(timeout)
        return np.asarray(self._backend.to_host(buf)).reshape(np.shape(values))

    def allreduce_coalesced(self, tensors: Sequence[Array], op: Op = ReduceOp.SUM) -> Work:
        flats = [self._flat(t, f"all_reduce_coalesced tensors[{i}]", output=True) for i, t in enumerate(tensors)]
        self._same_dtype(flats, "all_reduce_coalesced")
        rop, scale = resolve(op)
        if flats:  # one dtype for all (checked above)
            self._reducible(flats[0], rop, scale, "all_reduce_coalesced")
        self._start_coalescing()
        try:
            self.check_up_front(OpType.ALLREDUCE_COALESCED, [(f"tensors[{i}]", t) for i, t in enumerate(tensors)])
            for i, (f, t) in enumerate(zip(flats, tensors, strict=True)):
                self._issue(OpType.ALLREDUCE, [], functools.partial(_all_reduce_in_place, f, rop, scale),
                            check=[(f"tensors[{i}]", t)] if self._nan is not None else None)
            self._coalesced_outputs = list(tensors)
        except BaseException:
            self.abandon_coalescing()
            raise
        return self._end_coalescing(OpType.ALLREDUCE_COALESCED)

    def broadcast(self, tensor: ArrayArg, root: int = 0, config: CollConfig | None = None) -> Work | None:
        cfg = self._coll_config(config, "broadcast")
        root = self._group_rank(root, "broadcast root")
        t = self._moved(self._flat(_one(tensor), "broadcast tensor", output=self._rank != root))
        # Only the root's array is sent; the others' are overwritten (torch checks the root's too).
        return self._issue(OpType.BROADCAST, [tensor], lambda c, s: c.broadcast(t, t, root, s),
                           check=[("tensor", _one(tensor))] if self._nan is not None and self._rank == root else None,
                           fingerprint=self._detail and Fingerprint(OpType.BROADCAST, self._backend.dtype(t), t.size, root=root,
                                                                    config=self._digest(cfg)), config=cfg)

    def reduce(self, tensor: ArrayArg, root: int = 0, op: Op = ReduceOp.SUM, config: CollConfig | None = None) -> Work | None:
        cfg = self._coll_config(config, "reduce")
        root = self._group_rank(root, "reduce root")
        t = self._flat(_one(tensor), "reduce tensor", output=self._rank == root)
        rop, scale = resolve(op)
        self._reducible(t, rop, scale, "reduce")
        return self._issue(OpType.REDUCE, [tensor], lambda c, s: c.reduce(t, t, rop, root, s, scale),
                           check=[("tensor", _one(tensor))] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.REDUCE, self._backend.dtype(t), t.size, rop, root,
                                                                    config=self._digest(cfg)), config=cfg)

    def allgather(self, output_list: Sequence[Array], tensor: ArrayArg, config: CollConfig | None = None) -> Work | None:
        cfg = self._coll_config(config, "all_gather")
        inp = self._flat(_one(tensor), "all_gather input")
        outs = self._list(_one_list(output_list), "all_gather output list", inp, output=True)
        inp = self._moved(inp)
        tmp, copy_out = self._gathered(outs, inp)
        return self._issue(OpType.ALLGATHER, list(output_list), lambda c, s: c.all_gather(inp, tmp, s),
                           after=copy_out, inputs=[_one(tensor)], check=[("tensor", _one(tensor))] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.ALLGATHER, self._backend.dtype(inp), inp.size,
                                                                    config=self._digest(cfg)), config=cfg)

    def _allgather_base(self, output: ArrayArg, tensor: ArrayArg, config: CollConfig | None = None) -> Work | None:
        cfg = self._coll_config(config, "all_gather")
        inp, out = self._flat(tensor, "all_gather_into_tensor input"), self._flat(output, "all_gather_into_tensor output", output=True)
        self._same_dtype([inp, out], "all_gather_into_tensor")
        if out.size != inp.size * self._size:
            raise ValueError(f"all_gather_into_tensor: output has {out.size} elements; expected "
                             f"{self._size} x {inp.size}")
        inp, out = self._moved(inp), self._moved(out)
        return self._issue(OpType._ALLGATHER_BASE, [output], lambda c, s: c.all_gather(inp, out, s),
                           inputs=[tensor], check=[("input_tensor", tensor)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType._ALLGATHER_BASE, self._backend.dtype(inp), inp.size,
                                                                    config=self._digest(cfg)), config=cfg)

    def reduce_scatter(self, output: ArrayArg, input_list: Sequence[Array], op: Op = ReduceOp.SUM,
                       config: CollConfig | None = None) -> Work | None:
        cfg = self._coll_config(config, "reduce_scatter")
        out = self._flat(_one(output), "reduce_scatter output", output=True)
        ins = self._list(_one_list(input_list), "reduce_scatter input list", out)
        rop, scale = resolve(op)
        self._reducible(out, rop, scale, "reduce_scatter")
        _, stream = self._ready()
        tmp = self._packed(ins, out, stream)
        ins_given = list(_one_list(input_list))
        return self._issue(OpType.REDUCE_SCATTER, [output],
                           lambda c, s: c.reduce_scatter(tmp, out, rop, s, scale), inputs=ins_given,
                           check=[(f"input_list[{i}]", a) for i, a in enumerate(ins_given)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.REDUCE_SCATTER, self._backend.dtype(out), out.size, rop,
                                                                    config=self._digest(cfg)), config=cfg)

    def _reduce_scatter_base(self, output: ArrayArg, tensor: ArrayArg, op: Op = ReduceOp.SUM,
                             config: CollConfig | None = None) -> Work | None:
        cfg = self._coll_config(config, "reduce_scatter")
        out = self._flat(output, "reduce_scatter_tensor output", output=True)
        inp = self._flat(tensor, "reduce_scatter_tensor input")
        self._same_dtype([inp, out], "reduce_scatter_tensor")
        if inp.size != out.size * self._size:
            raise ValueError(f"reduce_scatter_tensor: input has {inp.size} elements; expected "
                             f"{self._size} x {out.size}")
        rop, scale = resolve(op)
        self._reducible(out, rop, scale, "reduce_scatter_tensor")
        return self._issue(OpType._REDUCE_SCATTER_BASE, [output],
                           lambda c, s: c.reduce_scatter(inp, out, rop, s, scale), inputs=[tensor],
                           check=[("input", tensor)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType._REDUCE_SCATTER_BASE, self._backend.dtype(out), out.size,
                                                                    rop, config=self._digest(cfg)), config=cfg)

    def alltoall_base(self, output: ArrayArg, tensor: ArrayArg, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, config: CollConfig | None = None) -> Work | None:
        cfg = self._coll_config(config, "all_to_all")
        out = self._flat(output, "all_to_all_single output", output=True)
        inp = self._flat(tensor, "all_to_all_single input")
        self._same_dtype([inp, out], "all_to_all_single")
        sc = self._counts(tensor, inp, input_split_sizes, "input_split_sizes")
        rc = self._counts(output, out, output_split_sizes, "output_split_sizes")
        k = 2 if np.issubdtype(self._backend.dtype(inp), np.complexfloating) else 1  # complex: 2 reals each
        out, inp = self._moved(out), self._moved(inp)
        sc, rc = [c * k for c in sc], [c * k for c in rc]
        # Split sizes may differ by rank: only the operation and dtype must agree.
        return self._issue(OpType.ALLTOALL_BASE, [output], lambda c, s: c.all_to_all(inp, out, s, sc, rc),
                           inputs=[tensor], check=[("input", tensor)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.ALLTOALL_BASE, self._backend.dtype(inp),
                                                                    config=self._digest(cfg)), config=cfg)

    def _counts(self, array: Any, flat: Any, splits: Sequence[int] | None, what: str) -> list[int]:
        """Element counts per peer from split sizes along the first dimension."""
        rows = array.shape[0] if getattr(array, "shape", ()) else flat.size
        per_row = flat.size // rows if rows else 0
        if splits is None or len(splits) == 0:
            if rows % self._size:
                raise ValueError(f"all_to_all_single: {rows} rows do not split evenly over {self._size} ranks")
            return [rows // self._size * per_row] * self._size
        sizes = [int(x) for x in (splits.tolist() if hasattr(splits, "tolist") else splits)]
        if len(sizes) != self._size or min(sizes) < 0 or sum(sizes) != rows:
            raise ValueError(f"all_to_all_single: {what} {sizes} must be {self._size} non-negative numbers "
                             f"summing to the {rows} rows of the array")
        return [x * per_row for x in sizes]

    def alltoall(self, output_list: Sequence[Array], input_list: Sequence[Array],
                 config: CollConfig | None = None) -> Work | None:
        cfg = self._coll_config(config, "all_to_all")
        if len(output_list) != self._size or len(input_list) != self._size:
            raise ValueError(f"all_to_all: expected {self._size} input and output arrays, got "
                             f"{len(input_list)} and {len(output_list)}")
        outs = [self._flat(a, f"all_to_all output[{i}]", output=True) for i, a in enumerate(output_list)]
        ins = [self._flat(a, f"all_to_all input[{i}]") for i, a in enumerate(input_list)]
        self._same_dtype(outs + ins, "all_to_all")
        outs, ins = [self._moved(o) for o in outs], [self._moved(i) for i in ins]
        _, stream = self._ready()
        tmp_in = self._packed(ins, ins[0], stream)
        tmp_out = self._backend.empty(sum(o.size for o in outs), outs[0].dtype, self._device)
        sc, rc = [i.size for i in ins], [o.size for o in outs]

        def copy_out(s: Stream) -> None:
            at = 0
            for o in outs:
                self._backend.copy(o, tmp_out[at:at + o.size], s)
                at += o.size

        return self._issue(OpType.ALLTOALL, list(output_list),
                           lambda c, s: c.all_to_all(tmp_in, tmp_out, s, sc, rc), after=copy_out,
                           inputs=list(input_list),
                           check=[(f"input_list[{i}]", a) for i, a in enumerate(input_list)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.ALLTOALL, self._backend.dtype(tmp_in),
                                                                    config=self._digest(cfg)), config=cfg)

    def gather(self, tensor: ArrayArg, gather_list: Sequence[Array] | None, root: int = 0,
               config: CollConfig | None = None) -> Work | None:
        cfg = self._coll_config(config, "gather")
        inp = self._flat(tensor, "gather input")
        root = self._group_rank(root, "gather dst")
        if gather_list and self._rank != root:  # dtypes first on every rank (as torch), then roles
            self._same_dtype([inp, *(self._flat(a, "gather gather_list") for a in gather_list)], "gather")
        if self._rank == root:
            if gather_list is None:
                raise ValueError("gather: the destination rank must pass gather_list")
            outs = self._list(gather_list, "gather gather_list", inp, output=True)
            inp = self._moved(inp)
            tmp, copy_out = self._gathered(outs, inp)
            return self._issue(OpType.GATHER, list(gather_list), lambda c, s: c.gather(inp, tmp, root, s),
                               after=copy_out, inputs=[tensor], check=[("tensor", tensor)] if self._nan is not None else None,
                               fingerprint=self._detail and Fingerprint(OpType.GATHER, self._backend.dtype(inp), inp.size, root=root,
                                                                        config=self._digest(cfg)), config=cfg)
        if gather_list:
            raise ValueError("gather: gather_list must be given on the destination rank only")
        inp = self._moved(inp)
        return self._issue(OpType.GATHER, [], lambda c, s: c.gather(inp, None, root, s), inputs=[tensor],
                           check=[("tensor", tensor)] if self._nan is not None else None,
                           fingerprint=self._detail and Fingerprint(OpType.GATHER, self._backend.dtype(inp), inp.size, root=root,
                                                                    config=self._digest(cfg)), config=cfg)

    def scatter(self, tensor: ArrayArg, scatter_list: Sequence[Array] | None, root: int = 0,
                config: CollConfig | None = None) -> Work | None:
        cfg = self._coll_config(config, "scatter")
        out = self._flat(tensor, "scatter output", output=True)
        root = self._group_rank(root, "scatter src")
        if scatter_list and self._rank != root:  # dtypes first on every rank (as torch), then roles
            self._same_dtype([out, *(self._flat(a, "scatter scatter_list") for a in scatter_list)], "scatter")
        if self._rank == root:
            if scatter_list is None:
                raise ValueError("scatter: the source rank must pass scatter_list")
            ins = self._list(scatter_list, "scatter scatter_list", out)
            out = self._moved(out)
            _, stream = self._ready()
            tmp = self._packed(ins, out, stream)
            return self._issue(OpType.SCATTER, [tensor], lambda c, s: c.scatter(tmp, out, root, s),
                               inputs=list(scatter_list),
                               check=[(f"scatter_list[{i}]", a) for i, a in enumerate(scatter_list)] if self._nan is not None else None,
                               fingerprint=self._detail and Fingerprint(OpType.SCATTER, self._backend.dtype(out), out.size, root=root,
                                                                        config=self._digest(cfg)), config=cfg)
        if scatter_list:
            raise ValueError("scatter: scatter_list must be given on the source rank only")
        out = self._moved(out)
        return self._issue(OpType.SCATTER, [tensor], lambda c, s: c.scatter(None, out, root, s),
                           fingerprint=self._detail and Fingerprint(OpType.SCATTER, self._backend.dtype(out), out.size, root=root,
                                                                    config=self._digest(cfg)), config=cfg)

    def send(self, tensor: ArrayArg, dst: int, tag: int = 0) -> Work | None:
        t = self._moved(self._flat(_one(tensor), "send tensor"))
        dst = self._peer(dst, "send dst")
        return self._issue(OpType.SEND, [tensor], lambda c, s: c.send(t, self._rank_in(c, dst), s),
                           name=f"nccl:send {self._rank}->{dst}", peer=dst, check=[("tensor", _one(tensor))] if self._nan is not None else None,
                           buf=t)

    def recv(self, tensor: ArrayArg, src: int, tag: int = 0) -> Work | None:
        t = self._moved(self._flat(_one(tensor), "recv tensor", output=True))
        src = self._peer(src, "recv src")
        return self._issue(OpType.RECV, [tensor], lambda c, s: c.recv(t, self._rank_in(c, src), s),
                           name=f"nccl:recv {self._rank}<-{src}", peer=src, buf=t)

    def recv_anysource(self, tensor: ArrayArg, tag: int = 0) -> Work:
        """Receive from whichever rank sends first (the host backend, as
        Gloo); ``work.source_rank()`` names it (a group rank) once complete.
        Among receives, it takes its turn in issue order."""
        t = self._moved(self._flat(_one(tensor), "recv tensor"))
        comm, _ = self._ready(join=False)
        if not comm.supports_recv_any:
            raise DistBackendError(f"recv from any source: the {self._backend.name} backend cannot receive from "
                                   "any source (NCCL has no wildcard receive); give src")
        if self._coalescing is not None:
            raise ValueError("recv from any source cannot be part of a coalesced group (batch_isend_irecv, "
                             "_coalescing_manager): give src")
        if self._size < 2:
            raise ValueError("recv from any source: this group has no other rank")
        source: list[Callable[[], int | None]] = []
        work = self._issue(OpType.RECV, [tensor], lambda c, s: source.append(c.recv_any(t, s)),
                           name=f"nccl:recvAnySource {self._rank}<-any", peer=ANY_SOURCE, buf=t, source=source)
        assert work is not None and source
        return work

    def _peer(self, peer: int, what: str) -> int:
        peer = self._group_rank(peer, what)
        if peer == self._rank:
            raise ValueError(f"{what}: rank {peer} is this rank; send/recv need another rank")
        return peer

    def monitored_barrier(self, timeout: Timeout | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier over the group's store that names the ranks that did
        not arrive within ``timeout`` (default: the group's), as torch's;
        see nccl_pg/group/monitored_barrier.py. Ranks other than 0 wait for rank
        0's verdict up to the longer of ``timeout`` and the group timeout."""
        limit = self._timeout if timeout is None else to_seconds(timeout, "monitored_barrier timeout", zero=True)
        with self._lock:
            self._check_open()
            self._monitored_barriers += 1
            generation = self._monitored_barriers
        monitored_barrier(PrefixStore(f"{self.group_name}/monitored_barrier", self._store), self._rank, self._size,
                          generation, limit, wait_all_ranks, max(limit, self._timeout))

    def barrier(self) -> Work | None:
        """An all_reduce of one byte: complete once every rank has issued it."""
        buf = self._backend.from_host(np.zeros(1, np.uint8), self._device)
        return self._issue(OpType.BARRIER, [], lambda c, s: c.all_reduce(buf, buf, ReduceOp.SUM, s),
                           fingerprint=self._detail and Fingerprint(OpType.BARRIER))

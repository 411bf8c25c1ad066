"""``ProcessGroupTorch``: torch's ProcessGroup interface over our groups.

One torch group holds up to two of ours, created at first use: a
ProcessGroupHost for CPU tensors and a ProcessGroupNCCL for CUDA tensors
(the NCCL one only on machines with GPUs). Ranks are group ranks, as torch
passes them; tensors go in as zero-copy views (tensors.py); every operation
returns a TorchWork (work.py), so our watchdog, timeouts, error handling and
flight recorder apply to torch jobs unchanged.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from ..group.monitored_barrier import monitored_barrier
from ..group.options import Options
from ..group.process_group import ProcessGroup, ProcessGroupHost, ProcessGroupNCCL
from ..group.work import WorkInfo
from ..reduce_op import ReduceOp
from ..store import PrefixStore
from ..timeouts import Timeout, to_seconds
from . import call_forms as F
from .as_torch import ours_behind
from .sparse import all_reduce_sparse
from .store import TorchStore
from .tensors import as_array, device_type
from .work import Completer, Slot, TorchWork, to_torch

BACKEND_NAME = "nccl_pg"

OpType = torch._C._distributed_c10d.OpType  # type: ignore[attr-defined]  # torch's stub (2.13) omits it
# uids (flight recorder, dumps) for groups torch names by something other than a number.
_extra_uids = itertools.count(1000)


Call = Callable[[ProcessGroup, Callable[[Any, str], Any]], Any]


class ProcessGroupTorch(tdist.ProcessGroup):
    """A torch.distributed ProcessGroup whose collectives run on nccl_pg."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, group_name: str = "0",
                 global_ranks: Sequence[int] = (), options: Options | None = None) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # a constructor torch has; its stub lists another
        seconds = to_seconds(timeout)
        # our own store, where torch was given one of ours (as_torch_store); else our interface over torch's
        self._npg_store = ours_behind(store) or TorchStore(store, seconds)
        self._npg_options = Options(timeout=seconds, is_high_priority_stream=bool(
            options and options.is_high_priority_stream), config=options.config if options else Options().config)
        self._npg_name = group_name
        self._npg_torch_name = group_name  # torch sets the name it registers the group under
        self._npg_uid = int(group_name) if group_name.isdigit() else next(_extra_uids)
        self._npg_global_ranks = list(global_ranks) or None
        self._npg_groups: dict[str, ProcessGroup] = {}
        self._npg_lock = threading.Lock()
        self._npg_coalescing: tuple[ProcessGroup, Slot, list[torch.Tensor]] | None = None
        self._npg_completer = Completer(f"nccl_pg-torch-{group_name}")
        self._npg_hooks: list[Callable[[WorkInfo], None]] = []
        self._npg_monitored_barriers = 0
        if not torch.cuda.is_available():  # a CPU job: its group connects now, as Gloo's (Backend.connects_at_creation)
            self._group("cpu").connect_now()

    def __repr__(self) -> str:
        return f"ProcessGroupTorch(name={self._npg_name!r}, rank={self.rank()}, size={self.size()})"

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    # torch's C++ ProcessGroup keeps its name on its backends, and a Python group has none: without these,
    # ``group_name`` raises "ProcessGroup name not set" and destroy_process_group(subgroup) fails.
    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._npg_torch_name

    def _set_group_name(self, name: str) -> None:
        self._npg_torch_name = name

    # --- our groups -----------------------------------------------------------------------

    def _group(self, kind: str, device: torch.device | None = None) -> ProcessGroup:
        with self._npg_lock:
            pg = self._npg_groups.get(kind)
            if pg is None:
                cls = ProcessGroupNCCL if kind == "cuda" else ProcessGroupHost
                extra = {"device_id": device.index if device is not None else None} if kind == "cuda" else {}
                pg = cls(PrefixStore(kind, self._npg_store), self.rank(), self.size(), self._npg_options,
                         group_name=self._npg_name, group_desc=self.group_desc or "undefined", uid=self._npg_uid,
                         **extra)
                pg._global_ranks = self._npg_global_ranks
                for hook in self._npg_hooks:
                    pg._register_on_completion_hook(hook)
                self._npg_groups[kind] = pg
            return pg

    def _for(self, tensors: Sequence[torch.Tensor], what: str) -> ProcessGroup:
        kind = device_type(list(tensors), what)
        cuda = next((t.device for t in tensors if t.is_cuda), None)
        return self._group(kind, cuda)

    def _run(self, what: str, tensors: Sequence[torch.Tensor], results: list[Any],
             call: Callable[[ProcessGroup], Any]) -> TorchWork:
        """Issue ``call`` on the group for ``tensors``' device; torch's
        exception types for communication failures."""
        pg = self._for(tensors, what) if self._npg_coalescing is None else self._npg_coalescing[0]
        try:
            work = call(pg)
        except BaseException as exc:
            mapped = to_torch(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        if work is None:  # inside a coalescing block: settled at its end
            _, slot, tensors_so_far = self._npg_coalescing  # type: ignore[misc]
            tensors_so_far.extend(results)
            return TorchWork(slot, results, self._npg_completer)
        return TorchWork(Slot(work), results, self._npg_completer)

    # --- collectives (torch's signatures; ranks are group ranks) ---------------------------------
    # Each takes every form torch 2.13's ProcessGroup takes (its stub's overloads; call_forms.py): torch's own
    # (tensors, opts), and the bare-tensor forms with the options' fields as arguments. The stub lists only the
    # overloads of its own class, hence the ``type: ignore[override]``.

    def allreduce(self, tensors: Any = None, opts: Any = None, timeout: Any = None, *,  # type: ignore[override]
                  op: Any = None, tensor: torch.Tensor | None = None) -> TorchWork:
        ts, rop = F.tensors(tensors, tensor, "allreduce tensors"), F.op_of(opts, op)
        if any(t.is_sparse for t in ts):
            return self._allreduce_sparse(ts, rop)
        arrays = [as_array(t, "all_reduce tensor") for t in ts]
        return self._run("all_reduce", ts, ts, lambda pg: pg.allreduce(arrays, rop))

    def _allreduce_sparse(self, tensors: list[torch.Tensor], op: ReduceOp) -> TorchWork:
        """Gloo's sparse all_reduce (sparse.py); complete when it returns."""
        tensor = _single(tensors)
        if self._npg_coalescing is not None:
            raise ValueError("nccl_pg: a sparse all_reduce cannot be part of a coalescing block")
        return self._run("all_reduce", tensors, tensors, lambda pg: all_reduce_sparse(pg, tensor, op))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        op = F.op_of(opts)
        arrays = [as_array(t, f"all_reduce_coalesced tensors[{i}]") for i, t in enumerate(tensors)]
        return self._run("all_reduce_coalesced", tensors, tensors, lambda pg: pg.allreduce_coalesced(arrays, op))

    def broadcast(self, tensors: Any = None, opts: Any = None, timeout: Any = None, *,  # type: ignore[override]
                  tensor: torch.Tensor | None = None, root: int | None = None) -> TorchWork:
        ts, root_rank = F.tensors(tensors, tensor, "broadcast tensors"), F.root_of(opts, root)
        arrays = [as_array(t, "broadcast tensor") for t in ts]
        return self._run("broadcast", ts, ts, lambda pg: pg.broadcast(arrays, root_rank))

    def reduce(self, tensors: Any = None, opts: Any = None, op: Any = None, timeout: Any = None, *,  # type: ignore[override]
               tensor: torch.Tensor | None = None, root: int | None = None) -> TorchWork:
        ts, root_rank = F.tensors(tensors, tensor, "reduce tensors"), F.root_of(opts, root)
        rop = F.op_of(None if isinstance(opts, int) else opts, op)
        arrays = [as_array(t, "reduce tensor") for t in ts]
        return self._run("reduce", ts, ts, lambda pg: pg.reduce(arrays, root_rank, rop))

    def allgather(self, output_tensors: Any, input_tensors: Any = None, opts: Any = None, *,  # type: ignore[override]
                  input_tensor: torch.Tensor | None = None, timeout: Any = None) -> TorchWork:
        output_lists = output_tensors if F.nested(output_tensors) else [list(output_tensors)]
        inputs = F.tensors(input_tensors, input_tensor, "allgather input")
        outs = [as_array(t, f"all_gather output[{i}]") for i, t in enumerate(_single(output_lists))]
        inp = [as_array(t, "all_gather input") for t in inputs]
        work = self._run("all_gather", inputs, output_lists, lambda pg: pg.allgather(outs, inp))
        # The future's value is ProcessGroupNCCL's: one (world, *shape) tensor (torch's per-channel
        # quantization hook indexes it so); made only when the future is asked for.
        work._future_value = lambda: [torch.stack(_single(output_lists))]
        return work

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TorchWork:  # noqa: A002
        out, inp = as_array(output, "all_gather_into_tensor output"), as_array(input, "all_gather_into_tensor input")
        return self._run("all_gather_into_tensor", [input, output], [output], lambda pg: pg._allgather_base(out, inp))

    def all_gather_single_coalesced(self, output_lists: list[torch.Tensor], input_list: list[torch.Tensor],
                                    opts: Any = None) -> TorchWork:
        pairs = [(as_array(o, "all_gather_into_tensor output"), as_array(i, "all_gather_into_tensor input"))
                 for o, i in zip(output_lists, input_list, strict=True)]
        return self._coalesced("all_gather_into_tensor_coalesced", input_list, output_lists,
                               lambda pg: [pg._allgather_base(o, i) for o, i in pairs])

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> TorchWork:
        # output_lists[r][i] receives rank r's input_list[i]: all_gather i collects column i.
        if any(len(outs) != len(input_list) for outs in output_lists):
            raise ValueError(f"all_gather_coalesced: each output list must hold {len(input_list)} tensors, one per "
                             f"input; got {[len(outs) for outs in output_lists]}")
        pairs = [([as_array(outs[i], f"all_gather_coalesced output_tensor_lists[{r}][{i}]")
                   for r, outs in enumerate(output_lists)], as_array(t, f"all_gather_coalesced input[{i}]"))
                 for i, t in enumerate(input_list)]
        return self._coalesced("all_gather_coalesced", input_list, output_lists,
                               lambda pg: [pg.allgather(o, i) for o, i in pairs])

    def reduce_scatter(self, output_tensors: Any = None, input_tensors: Any = None, opts: Any = None,  # type: ignore[override]
                       timeout: Any = None, *, input_tensor: Any = None, op: Any = None) -> TorchWork:
        outputs = F.tensors(output_tensors, None, "reduce_scatter output")
        given = F.one(input_tensors, input_tensor, "reduce_scatter input")
        rop = F.op_of(opts, op)
        out = [as_array(t, "reduce_scatter output") for t in outputs]
        ins = [as_array(t, f"reduce_scatter input[{i}]")
               for i, t in enumerate(_single(given) if F.nested(given) else given)]
        return self._run("reduce_scatter", outputs, outputs, lambda pg: pg.reduce_scatter(out, ins, rop))

    def reduce_scatter_single(self, outputTensor: torch.Tensor, inputTensor: torch.Tensor,  # noqa: N803 (torch's)
                              opts: Any = None) -> TorchWork:
        op = F.op_of(opts)
        out = as_array(outputTensor, "reduce_scatter_tensor output")
        inp = as_array(inputTensor, "reduce_scatter_tensor input")
        return self._run("reduce_scatter_tensor", [inputTensor, outputTensor], [outputTensor],
                         lambda pg: pg._reduce_scatter_base(out, inp, op))

    def reduce_scatter_single_coalesced(self, outputTensors: list[torch.Tensor],  # noqa: N803 (torch's)
                                        inputTensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        op = F.op_of(opts)
        pairs = [(as_array(o, "reduce_scatter_tensor output"), as_array(i, "reduce_scatter_tensor input"))
                 for o, i in zip(outputTensors, inputTensors, strict=True)]
        return self._coalesced("reduce_scatter_tensor_coalesced", inputTensors, outputTensors,
                               lambda pg: [pg._reduce_scatter_base(o, i, op) for o, i in pairs])

    def all_to_all_single(self, output_tensor: Any = None, input_tensor: Any = None,  # type: ignore[override]
                          output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
                          opts: Any = None, *, output: Any = None, input: Any = None,  # noqa: A002
                          timeout: Any = None) -> TorchWork:
        o, i = F.one(output_tensor, output, "all_to_all_single output"), F.one(input_tensor, input, "input")
        out, inp = as_array(o, "all_to_all_single output"), as_array(i, "all_to_all_single input")
        outs, ins = list(output_split_sizes or []), list(input_split_sizes or [])
        return self._run("all_to_all_single", [i, o], [o], lambda pg: pg.alltoall_base(out, inp, outs, ins))

    def alltoall(self, output_tensor: Any = None, input_tensor: Any = None, opts: Any = None, *,  # type: ignore[override]
                 output: Any = None, input: Any = None, timeout: Any = None) -> TorchWork:  # noqa: A002
        outputs = list(F.one(output_tensor, output, "all_to_all output"))
        inputs = list(F.one(input_tensor, input, "all_to_all input"))
        outs = [as_array(t, f"all_to_all output[{i}]") for i, t in enumerate(outputs)]
        ins = [as_array(t, f"all_to_all input[{i}]") for i, t in enumerate(inputs)]
        return self._run("all_to_all", [*inputs, *outputs], outputs, lambda pg: pg.alltoall(outs, ins))

    def gather(self, output_tensors: Any = None, input_tensors: Any = None, opts: Any = None,  # type: ignore[override]
               timeout: Any = None, *, input_tensor: torch.Tensor | None = None, root: int | None = None) -> TorchWork:
        outputs = output_tensors or []
        gathered = _single(outputs) if F.nested(outputs) else list(outputs)
        inputs = F.tensors(input_tensors, input_tensor, "gather input")
        root_rank = F.root_of(opts, root)
        outs = [as_array(t, f"gather gather_list[{i}]") for i, t in enumerate(gathered)] if gathered else None
        inp = as_array(_single(inputs), "gather input")
        results = outputs if F.nested(outputs) else [gathered]
        return self._run("gather", inputs, results, lambda pg: pg.gather(inp, outs, root_rank))

    def scatter(self, output_tensors: Any = None, input_tensors: Any = None, opts: Any = None,  # type: ignore[override]
                timeout: Any = None, *, output_tensor: torch.Tensor | None = None, root: int | None = None) -> TorchWork:
        outputs = F.tensors(output_tensors, output_tensor, "scatter output")
        given = input_tensors or []
        pieces = _single(given) if F.nested(given) else list(given)
        root_rank = F.root_of(opts, root)
        ins = [as_array(t, f"scatter scatter_list[{i}]") for i, t in enumerate(pieces)] if pieces else None
        out = as_array(_single(outputs), "scatter output")
        return self._run("scatter", outputs, outputs, lambda pg: pg.scatter(out, ins, root_rank))

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> TorchWork:  # noqa: N803 (torch's)
        arrays = [as_array(t, "send tensor") for t in tensors]
        return self._run("send", tensors, tensors, lambda pg: pg.send(arrays, dstRank, tag))

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> TorchWork:  # noqa: N803 (torch's)
        arrays = [as_array(t, "recv tensor") for t in tensors]
        return self._run("recv", tensors, tensors, lambda pg: pg.recv(arrays, srcRank, tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> TorchWork:
        """The host backend receives from any source (as Gloo; NCCL cannot)."""
        arrays = [as_array(t, "recv tensor") for t in tensors]
        return self._run("recv", tensors, tensors, lambda pg: pg.recv_anysource(arrays, tag))

    def barrier(self, opts: Any = None, *, timeout: Any = None) -> TorchWork:  # type: ignore[override]
        """On the CUDA group when ``device_ids`` are given or only it exists
        (as ProcessGroupNCCL's barrier), else on the CPU group."""
        ids = F.barrier_device_ids(opts)
        if ids or set(self._npg_groups) == {"cuda"}:
            index = ids[0] if ids else self._npg_groups["cuda"].bound_device_id
            pg = self._group("cuda", torch.device("cuda", index) if index is not None else None)
        else:
            pg = self._group("cpu")
        return self._run("barrier", [], [], lambda _: pg.barrier())

    def monitored_barrier(self, timeout: Timeout | None = None, wait_all_ranks: bool = False) -> None:
        """torch's monitored_barrier (Gloo's semantics and messages) over
        this group's store: independent of the CPU/CUDA communicators, so it
        works while they are stuck (nccl_pg/group/monitored_barrier.py). Default
        timeout: the group's."""
        group_timeout = self._npg_options.timeout
        limit = group_timeout if timeout is None else to_seconds(timeout, "monitored_barrier timeout", zero=True)
        with self._npg_lock:
            self._npg_monitored_barriers += 1
            generation = self._npg_monitored_barriers
        try:
            monitored_barrier(PrefixStore("monitored_barrier", self._npg_store), self.rank(), self.size(),
                              generation, limit, wait_all_ranks, max(limit, group_timeout))
        except BaseException as exc:
            mapped = to_torch(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    # torch < 2.10 calls these by their older names.
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single  # type: ignore[assignment]  # (tensors, opts), as above

    # --- coalescing -----------------------------------------------------------------------------

    def _start_coalescing(self, device: torch.device) -> None:
        if self._npg_coalescing is not None:
            raise RuntimeError("nccl_pg: coalescing already started on this group")
        pg = self._group(torch.device(device).type, torch.device(device))
        pg._start_coalescing()
        self._npg_coalescing = (pg, Slot(), [])

    def _end_coalescing(self, device: torch.device) -> TorchWork:
        if self._npg_coalescing is None:
            raise RuntimeError("nccl_pg: _end_coalescing() without _start_coalescing()")
        (pg, slot, results), self._npg_coalescing = self._npg_coalescing, None
        try:
            slot.work = pg._end_coalescing()
        except BaseException as exc:
            mapped = to_torch(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        return TorchWork(slot, results, self._npg_completer)

    def _coalesced(self, what: str, tensors: Sequence[torch.Tensor], results: list[Any],
                   issue: Callable[[ProcessGroup], Any]) -> TorchWork:
        """Several operations as one group (one Work), like torch's *_coalesced."""
        device = tensors[0].device if tensors else torch.device("cpu")
        self._start_coalescing(device)
        pg, _, so_far = self._npg_coalescing  # type: ignore[misc]
        try:
            issue(pg)
        except BaseException as exc:
            self._npg_coalescing = None
            pg.abandon_coalescing()
            mapped = to_torch(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        so_far.extend(results)
        return self._end_coalescing(device)

    # --- eager connection -------------------------------------------------------------------------

    def eager_connect(self, device: torch.device | str | None = None) -> None:
        """Connect this group for ``device``'s tensors now (default: CPU) and wait until every rank has
        joined, as Gloo's groups do at creation: a rank that never comes fails this call after the group's
        timeout (torch.distributed.DistBackendError naming it), not the first collective."""
        dev = torch.device("cpu" if device is None else device)
        try:
            self._group(dev.type, dev if dev.type == "cuda" else None).eager_init()
        except BaseException as exc:
            mapped = to_torch(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    def eager_connect_single_device(self, device: torch.device) -> None:
        """torch's name: ``init_process_group(..., device_id=device)`` calls it (through ``_get_backend``)."""
        self.eager_connect(device)

    @property
    def supports_splitting(self) -> bool:
        """What torch asks before ``eager_connect_single_device`` (for a ``device_id``)."""
        return True

    def _get_backend(self, device: torch.device) -> ProcessGroupTorch:  # type: ignore[override]
        """torch asks a group for its backend of a device (``device_id``, torchft's abort): this group is its
        own, for CPU and CUDA tensors alike."""
        return self

    # --- state and teardown ---------------------------------------------------------------------

    def _get_sequence_number_for_group(self) -> int:
        return max((pg._get_sequence_number_for_group() for pg in self._npg_groups.values()), default=0)

    def _register_on_completion_hook(self, hook: Callable[[Any], None]) -> None:
        """``hook(info)`` once each operation finishes, on our hook thread;
        ``info`` has torch's WorkInfo fields (``op_type`` is torch's OpType)."""
        def call(info: WorkInfo) -> None:
            hook(WorkInfo(getattr(OpType, info.op_type.name, OpType.UNKNOWN), info.seq, info.time_started,
                          info.time_finished, info.active_duration))

        with self._npg_lock:
            self._npg_hooks.append(call)
            groups = list(self._npg_groups.values())
        for pg in groups:
            pg._register_on_completion_hook(call)

    def _wait_for_pending_works(self) -> None:
        for pg in list(self._npg_groups.values()):
            pg._wait_for_pending_works()

    def nccl_pg_groups(self) -> dict[str, ProcessGroup]:
        """Our groups behind this one, by device type ("cpu", "cuda")."""
        return dict(self._npg_groups)

    def comm_error(self) -> BaseException | None:
        """The first error that broke one of our groups' communicators (a
        peer lost, an abort), or None."""
        for pg in list(self._npg_groups.values()):
            error = pg.comm_error()
            if error is not None:
                return error
        return None

    def abort(self) -> None:
        for pg in list(self._npg_groups.values()):
            pg.abort()

    def shutdown(self) -> None:
        for pg in list(self._npg_groups.values()):
            pg.shutdown()
        self._npg_completer.stop()


def _single(x: Sequence[Any]) -> Any:
    """torch's one-entry-per-device lists: a process here drives one device."""
    if len(x) != 1:
        raise ValueError(f"nccl_pg: expected one tensor (list) per call, one device per process; got {len(x)}")
    return x[0]

"""torchft's Manager over nccl_pg: ``ProcessGroupNcclPg``.

torchft (pytorch/torchft) drives its process group through one call,
``configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
group_world_size, global_ranks)`` (torchft 0.2.0, torchft/process_group.py,
``ProcessGroup.configure``): at every new quorum the Manager
(torchft/manager.py, ``Manager._async_quorum``) hands it a fresh store prefix
(``host:port/torchft/<quorum_id>/<group_rank>``), this replica's rank and the
quorum's size, and the group must be usable when it returns; ``errored()``
reports an async error (``Manager.should_commit``), ``abort()`` drops the
group. torchft's ``ProcessGroupWrapper`` implements that contract around a
``_create_pg(store, rank, world_size)``, as its Gloo and NCCL groups do:
abort the last quorum's group, build the new one on the given store. Here the
new one is nccl_pg's torch group (torch/process_group.py): the host backend
for CPU tensors, NCCL for CUDA ones, with our watchdog, timeouts and flight
recorder. torchft's quorum gives ranks by its own order and a new store per
quorum, so each configure builds a fresh communicator (nccl_pg's
``reconfigure`` keeps the members' order instead, and grows; it is the
primitive for launchers that decide membership themselves).

    from nccl_pg.torch.torchft import ProcessGroupNcclPg
    manager = torchft.Manager(pg=ProcessGroupNcclPg(timeout=timedelta(seconds=30)), ...)

``configure()`` connects the new group before it returns (a replica that
never comes fails it after the timeout, as with Gloo). ``ProcessGroupBabyNcclPg``
runs each quorum's group in a subprocess, as torchft's ``ProcessGroupBabyGloo``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import numpy as np
from torchft.process_group import ProcessGroupBaby, ProcessGroupWrapper

from ..errors import DistError
from ..reduce_op import ReduceOp
from .process_group import ProcessGroupTorch

_BABY_TIMEOUT = timedelta(seconds=60)  # the subprocess group's, as torchft's Baby groups' default


class ProcessGroupNcclPg(ProcessGroupWrapper):
    """A torchft ProcessGroup whose every quorum runs on nccl_pg."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)

    def _create_pg(self, store: Any, rank: int, world_size: int) -> ProcessGroupTorch:
        name = f"torchft_{self._quorum_id}" if self._quorum_id is not None else "torchft"
        return ProcessGroupTorch(store, rank, world_size, self._timeout, group_name=name,
                                 global_ranks=self._global_ranks or ())

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "torchft-nccl_pg"

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None, group_world_size: int | None = None,
                  global_ranks: list[int] | None = None) -> None:
        """torchft's configure, and the group is usable when it returns (its docstring's promise): it connects
        now (CPU), so a replica that never comes fails here after the timeout, as with Gloo, not at the first
        collective."""
        super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
                          global_ranks)
        pg = self._pg
        if isinstance(pg, ProcessGroupTorch):
            pg.eager_connect()

    def errored(self) -> Exception | None:
        """An error of this quorum's group, or of a peer's (torchft reads it
        in ``should_commit``, on every replica at the same point of a step).
        A peer's failure is made visible by one agreement collective (issue
        33): a replica resumed after its peers timed out and aborted can
        complete the step's allreduce from data they had sent before, and
        nothing local says that they failed it; its agreement then fails on
        their aborted communicator, and it does not commit a step they did
        not. Costs one 1-element all_reduce per step (docs/BENCHMARKS.md)."""
        pg = self._pg
        error = pg.comm_error() if isinstance(pg, ProcessGroupTorch) else None
        if error is None and isinstance(pg, ProcessGroupTorch):
            error = _agree_no_error(pg, self._timeout.total_seconds())
        return error if isinstance(error, Exception) or error is None else RuntimeError(str(error))

    def abort(self, errored: bool = True) -> None:
        """torchft drops the group; ours is aborted and freed at once (its
        threads and sockets), not left to the garbage collector."""
        pg = self._pg
        super().abort(errored)
        if isinstance(pg, ProcessGroupTorch):
            pg.shutdown()

    def shutdown(self) -> None:
        pg = self._pg
        super().shutdown()
        if isinstance(pg, ProcessGroupTorch):
            pg.abort()
            pg.shutdown()


def _agree_no_error(pg: ProcessGroupTorch, timeout: float) -> Exception | None:
    """One all_reduce on each of our groups behind ``pg``: None when every
    rank's completed, else the error (a peer that failed the step aborted
    its communicator, so ours fails)."""
    for group in pg.nccl_pg_groups().values():
        try:
            group.allreduce_host(np.zeros(1, dtype=np.int64), ReduceOp.MAX, timeout=timeout)
        except DistError as exc:
            return exc
    return None


class ProcessGroupBabyNcclPg(ProcessGroupBaby):
    """torchft's subprocess-backed group (its ``ProcessGroupBaby``, as
    ``ProcessGroupBabyGloo``) on nccl_pg: each quorum's group lives in a
    spawned subprocess, so a group stuck in a collective is killed with that
    process (``shutdown()``/the next ``configure()``) without killing the
    trainer. CPU tensors travel through shared memory, CUDA tensors as they
    are (torchft's mechanism). The group connects before ``configure()``
    returns: a replica that never comes fails it after the timeout."""

    @classmethod
    def _create_pg(cls, store: Any, rank: int, world_size: int) -> ProcessGroupTorch:
        # (a classmethod, run in the subprocess: torchft passes no timeout here; its own wait is ``timeout``)
        pg = ProcessGroupTorch(store, rank, world_size, _BABY_TIMEOUT, group_name="torchft_baby")
        pg.eager_connect()
        return pg

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "torchft-baby-nccl_pg"

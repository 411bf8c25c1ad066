"""Per-call settings of a collective on NCCL (ncclCollConfig_t, the
``nccl*Config`` entry points): the user's CollConfig (NCCL >= 2.31.2) and
the launch-completion event that gives the watchdog and the flight recorder
an exact "started" mark (``launchCompletionEvent``, NCCL >= 2.32.3: recorded
when the collective's kernel launch completes; before CUDA 12.3 just before
the launch, enqueue.cc ncclLaunchKernel). Both only on collectives NCCL runs
as one call: send/recv have no config.
"""

from __future__ import annotations

from typing import Any

from ...coll_config import CollConfig
from ...errors import DistBackendError
from . import _lib
from ._lib import bindings
from .stream import CudaEvent

# The plain entry point -> its nccl*Config twin in nccl4py.
CONFIG_FN = {"ncclAllReduce": "all_reduce_config", "ncclBroadcast": "broadcast_config", "ncclReduce": "reduce_config",
             "ncclAllGather": "all_gather_config", "ncclReduceScatter": "reduce_scatter_config",
             "ncclAlltoAll": "allto_all_config", "ncclGather": "gather_config", "ncclScatter": "scatter_config"}
# NCCL's name of each entry point's collective (the names CollConfig.check_for takes).
COLLECTIVE = {"ncclAllReduce": "all_reduce", "ncclBroadcast": "broadcast", "ncclReduce": "reduce",
              "ncclAllGather": "all_gather", "ncclReduceScatter": "reduce_scatter", "ncclAlltoAll": "all_to_all",
              "ncclGather": "gather", "ncclScatter": "scatter"}


class CallOptions:
    """What the group set for the next collective (``set_call_options``), and whether it was used."""

    __slots__ = ("config", "launched", "used")

    def __init__(self) -> None:
        self.config: CollConfig | None = None
        self.launched: CudaEvent | None = None
        self.used = False

    def set(self, config: CollConfig | None, launched: Any) -> None:
        if launched is not None and not isinstance(launched, CudaEvent):
            raise TypeError(f"a launch mark must be a CudaEvent, got {type(launched).__name__}")
        self.config, self.launched, self.used = config, launched, False

    def clear(self) -> bool:
        used = self.used
        self.config = self.launched = None
        self.used = False
        return used

    def for_call(self, what: str, version: int, captured: bool, max_ctas: int | None) -> Any:
        """The ncclCollConfig_t for the NCCL call ``what`` (None: the plain entry point). A launch mark goes
        only to an eager call (a captured one is watched through the graph, replays.py)."""
        config, launched = self.config, None if captured else self.launched
        if config is None and launched is None:
            return None
        if version < _lib.V_COLL_CONFIG:
            raise DistBackendError(f"a per-call config (CollConfig) needs NCCL >= 2.31.2 (ncclAllReduceConfig ...); "
                                   f"this is {_lib.version_tuple(version)}")
        c = bindings().CollConfig()
        if config is not None:
            config.check_for(COLLECTIVE[what], max_ctas)
            if config.min_ctas is not None:
                c.min_ctas = config.min_ctas
            if config.max_ctas is not None:
                c.max_ctas = config.max_ctas
            if config.algorithm:
                c.alg_selection = config.algorithm
            c.force_alg_selection = int(config.force_algorithm)
            c.user_profiler_tag = config.profiler_tag
        if launched is not None:
            assert launched.handle is not None  # a live event: its handle goes only when it dies
            c.launch_completion_event_handle = int(launched.handle)
            launched.recorded = True  # NCCL records it at the launch
            self.used = True
        return c

    def refuse_p2p(self, what: str) -> None:
        """``what`` runs as grouped send/recv here, which take no per-call config."""
        if self.config is not None:
            raise ValueError(f"{what}: a per-call config (CollConfig) cannot apply here: NCCL runs it as grouped "
                             "send/recv (uneven splits, or NCCL < 2.28), which take no ncclCollConfig_t")

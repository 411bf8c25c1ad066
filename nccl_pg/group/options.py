"""A process group's options and its timeout (``ProcessGroupNCCL.Options``
in torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from ..timeouts import Timeout, to_seconds

DEFAULT_TIMEOUT = timedelta(minutes=10)  # torch's default for NCCL groups


@dataclass
class NCCLConfig:
    """Communicator settings passed through to ncclConfig_t (the host backend
    keeps but ignores the NCCL-only ones). ``blocking=None``: from
    ``NCCL_PG_USE_COMM_NONBLOCKING``."""

    blocking: bool | None = None
    cga_cluster_size: int | None = None
    min_ctas: int | None = None
    max_ctas: int | None = None
    net_name: str | None = None
    comm_name: str | None = None
    split_share: bool | None = None


@dataclass
class Options:
    """Per-group options (``ProcessGroupNCCL.Options`` in torch).
    ``nan_check``: this group's NaN check mode (off, raise, async, trap);
    None: from ``NCCL_PG_NAN_CHECK``."""

    timeout: float = DEFAULT_TIMEOUT.total_seconds()
    is_high_priority_stream: bool = False
    config: NCCLConfig = field(default_factory=NCCLConfig)
    nan_check: str | None = None

    def __post_init__(self) -> None:
        self.timeout = to_seconds(self.timeout)

    @property
    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout)

    @_timeout.setter
    def _timeout(self, value: Timeout) -> None:
        self.timeout = to_seconds(value)

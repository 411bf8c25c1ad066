"""A process group's options and its timeout rule (``ProcessGroupNCCL.Options``
in torch)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

DEFAULT_TIMEOUT = timedelta(minutes=10)


# The longest deadline every blocking primitive can take (threading waits overflow beyond it, ~292 years).
MAX_TIMEOUT = threading.TIMEOUT_MAX


def seconds(timeout: timedelta | float | int) -> float:
    """A group timeout in seconds: finite and > 0. Every operation of a group
    has a deadline (the watchdog enforces it), so there is no "no limit"
    value; inf, nan and what no deadline can hold are refused here, at the
    call, rather than overflowing at the first collective."""
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float, np.integer, np.floating)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise TypeError(f"timeout must be a number of seconds or a timedelta, got {type(timeout).__name__}")
    if not 0 < value <= MAX_TIMEOUT:  # also False for nan
        raise ValueError(f"timeout must be a finite number of seconds > 0 and <= {MAX_TIMEOUT:.0f}, got {timeout!r}")
    return value


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
        self.timeout = seconds(self.timeout)

    @property
    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout)

    @_timeout.setter
    def _timeout(self, value: timedelta | float) -> None:
        self.timeout = seconds(value)

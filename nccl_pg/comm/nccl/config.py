"""What a communicator is made from: its ncclConfig_t (checked as NCCL checks
it), its unique ids and which ranks create them."""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from ...errors import DistBackendError
from ..base import CommConfig
from ._lib import bindings

UID_BYTES = 128


def _positive(cfg: CommConfig, field: str, least: int) -> int | None:
    value = getattr(cfg, field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
        raise ValueError(f"CommConfig.{field} must be an int >= {least}, got {value!r}")
    return value


def nccl_config(cfg: CommConfig, blocking: bool = False, split_share: bool | None = None) -> Any:
    """A ncclConfig_t with the NCCL fields of ``cfg`` (nonblocking unless
    ``blocking``; ``split_share`` overrides ``cfg.split_share``). CTA limits
    are checked as init.cc parseCommConfig checks them (NCCL answers
    ncclInvalidArgument otherwise): each > 0, ``min_ctas`` <= ``max_ctas``,
    and ``min_ctas`` only with ``max_ctas`` (an unset maxCTAs is
    NCCL_CONFIG_UNDEF_INT, INT_MIN, which any minCTAs exceeds)."""
    cga = _positive(cfg, "cga_cluster_size", 0)  # parseCommConfig: cgaClusterSize < 0 is refused
    lo, hi = _positive(cfg, "min_ctas", 1), _positive(cfg, "max_ctas", 1)
    if lo is not None and hi is None:
        raise ValueError(f"CommConfig.min_ctas={lo} needs CommConfig.max_ctas too: NCCL refuses minCTAs without "
                         "maxCTAs (ncclInvalidArgument)")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"CommConfig.min_ctas={lo} is more than CommConfig.max_ctas={hi}")
    c = bindings().Config()
    c.blocking = int(blocking)
    for field, value in (("cga_cluster_size", cga), ("min_ctas", lo), ("max_ctas", hi)):
        if value is not None:
            setattr(c, field, value)
    share = cfg.split_share if split_share is None else split_share
    if share is not None:
        c.split_share = int(bool(share))
    if cfg.comm_name:
        c.comm_name = str(cfg.comm_name)
    if cfg.net_name:
        c.net_name = str(cfg.net_name)
    return c


def unique_id_bytes() -> bytes:
    """A fresh ncclUniqueId as 128 bytes (ncclGetUniqueId; needs no GPU)."""
    uid = bindings().get_unique_id()
    return ctypes.string_at(uid.ptr, UID_BYTES)


def unique_id(raw: bytes) -> Any:
    if len(raw) != UID_BYTES:
        raise DistBackendError(f"a NCCL unique id is {UID_BYTES} bytes; the store held {len(raw)}")
    return bindings().UniqueId.from_buffer(bytearray(raw))


def root_count(nranks: int, ranks_per_root: int) -> int:
    """How many bootstrap roots (unique ids) a communicator of ``nranks`` uses."""
    return max(1, min(nranks, math.ceil(nranks / ranks_per_root)))


def rank_has_root(rank: int, nranks: int, nroots: int) -> bool:
    """Whether ``rank`` creates one of the ``nroots`` unique ids: ranks spread
    evenly over the roots, as the NCCL user guide recommends for
    ncclCommInitRankScalable ("Creating a communicator using multiple
    ncclUniqueIds", rankHasRoot)."""
    rmr, rpr = nranks % nroots, nranks // nroots
    rlim = rmr * (rpr + 1)
    return rank % (rpr + 1) == 0 if rank < rlim else (rank - rlim) % rpr == 0


def roots(nranks: int, nroots: int) -> list[int]:
    return [r for r in range(nranks) if rank_has_root(r, nranks, nroots)]


def check_root(root: int, nranks: int) -> int:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < nranks:
        raise ValueError(f"root {root!r} out of range for {nranks} ranks")
    return int(root)

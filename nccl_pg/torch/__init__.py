"""nccl_pg as a torch.distributed backend: ``init_process_group("nccl_pg")``.

Importing this module imports torch (``import nccl_pg`` never does) and
registers the backend for "cpu" (host backend) and "cuda" (NCCL backend)
tensors. Installed packages register it without an import, through torch's
``torch.backends`` entry point (``_autoload``), when torch is imported.
See docs/TORCH.md.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any


def _autoload() -> None:
    """The ``torch.backends`` entry point: runs at ``import torch``. Defined
    before this module imports torch: when that import is torch's first, torch
    runs this entry point while the module is still loading, and the module
    registers the backend itself at its end."""
    if "register" in globals() and tdist.is_available():
        register()


import torch.distributed as tdist  # noqa: E402 - after _autoload, which torch looks up while this module imports it

#: The backend's name for ``torch.distributed.init_process_group``.
BACKEND_NAME = "nccl_pg"


def _create(options: Any, pg_options: Any = None) -> Any:
    """torch's creator (extended API): one ProcessGroupTorch per group."""
    from ..group.options import Options  # noqa: PLC0415
    from .process_group import ProcessGroupTorch  # noqa: PLC0415

    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f"nccl_pg: pg_options must be nccl_pg.Options, got {type(pg_options).__name__}")
    return ProcessGroupTorch(options.store, options.group_rank, options.group_size, options.timeout,
                             str(options.group_id), list(options.global_ranks_in_group), pg_options)


def _monitored_barrier(torch_fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch.distributed.monitored_barrier, also for nccl_pg groups (torch's
    refuses every backend but Gloo before it looks at the group)."""

    @functools.wraps(torch_fn)
    def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        from .process_group import ProcessGroupTorch  # noqa: PLC0415

        pg = group
        if pg is None and tdist.is_initialized():
            pg = tdist.distributed_c10d._get_default_group()
        if not isinstance(pg, ProcessGroupTorch):
            return torch_fn(group, timeout, wait_all_ranks)
        if isinstance(timeout, float):  # as torch: seconds, with its warning
            warnings.warn("Please specify timeout arg as a timedelta. Converting current value of "
                          f"{timeout} assuming it represents seconds", stacklevel=2)
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier._nccl_pg = True  # type: ignore[attr-defined]
    return monitored_barrier


def register() -> None:
    """Register the "nccl_pg" backend with torch.distributed (idempotent), and
    teach ``torch.distributed.monitored_barrier`` about its groups."""
    if BACKEND_NAME.upper() not in tdist.Backend._plugins:
        tdist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    if not getattr(tdist.monitored_barrier, "_nccl_pg", False):
        tdist.monitored_barrier = tdist.distributed_c10d.monitored_barrier = _monitored_barrier(
            tdist.distributed_c10d.monitored_barrier)


register()

from .as_torch import TorchStoreOf, as_torch_store  # noqa: E402 (after the registration, as its users expect)

__all__ = ["BACKEND_NAME", "TorchStoreOf", "as_torch_store", "register"]

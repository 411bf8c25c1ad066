"""nccl_pg as a torch.distributed backend: ``init_process_group("nccl_pg")``.

Importing this module imports torch (``import nccl_pg`` never does) and
registers the backend for "cpu" (host backend) and "cuda" (NCCL backend)
tensors. Installed packages register it without an import, through torch's
``torch.backends`` entry point (``_autoload``), when torch is imported.
See docs/TORCH.md.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as tdist

BACKEND_NAME = "nccl_pg"


def _create(options: Any, pg_options: Any = None) -> Any:
    """torch's creator (extended API): one ProcessGroupTorch per group."""
    from ..process_group import Options  # noqa: PLC0415
    from .process_group import ProcessGroupTorch  # noqa: PLC0415

    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f"nccl_pg: pg_options must be nccl_pg.Options, got {type(pg_options).__name__}")
    return ProcessGroupTorch(options.store, options.group_rank, options.group_size, options.timeout,
                             str(options.group_id), list(options.global_ranks_in_group), pg_options)


def register() -> None:
    """Register the "nccl_pg" backend with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() not in tdist.Backend._plugins:
        tdist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def _autoload() -> None:
    """The ``torch.backends`` entry point: runs at ``import torch``."""
    if tdist.is_available():
        register()


register()

__all__ = ["BACKEND_NAME", "register"]

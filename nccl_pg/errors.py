"""Exception types. Names mirror torch.distributed so that user code that
catches them ports unchanged; every message is meant to be acted on."""

from __future__ import annotations


class DistError(RuntimeError):
    """Base class of every error raised by nccl_pg."""


class DistBackendError(DistError):
    """A communication operation failed, timed out or was aborted."""


class DistStoreError(DistError):
    """A rendezvous store operation failed or timed out."""


class DistNetworkError(DistError):
    """A network connection could not be made or was lost."""


class NanError(DistError):
    """A NaN was found in the input of a collective."""

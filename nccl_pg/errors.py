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
    """A NaN was found in the input of a collective or send
    (``NCCL_PG_NAN_CHECK``). Besides the message, it says where: the global
    ``rank``, the ``group`` (uid) and its ``group_desc``, the operation ``op``,
    the ``input`` (argument name, with the list index for lists) and the
    ``index`` of the first NaN element in that array (flat, C order)."""

    def __init__(self, message: str, *, rank: int | None = None, group: int | None = None,
                 group_desc: str | None = None, op: str | None = None, input: str | None = None,
                 index: int | None = None) -> None:
        super().__init__(message)
        self.rank, self.group, self.group_desc = rank, group, group_desc
        self.op, self.input, self.index = op, input, index

"""Exception types. Names mirror torch.distributed so that user code that
catches them ports unchanged; every message is meant to be acted on.

When torch is loaded (before or after nccl_pg; nccl_pg never imports it),
every error created from then on is also an instance of torch.distributed's
class of the same family, so ``except torch.distributed.DistStoreError``
catches our store errors. Python refuses to change the bases of an existing
class to torch's (their instance layouts differ), so the error created is an
instance of a subclass of both, made on first use: ``isinstance`` against
ours and against torch's holds, ``type(exc).__name__`` is unchanged, and it
pickles as our class.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any


class DistError(RuntimeError):
    """Base class of every error raised by nccl_pg."""

    def __new__(cls, *args: Any, **kwargs: Any) -> DistError:
        return super().__new__(_torch_compatible(cls), *args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ours(type(self)), self.args, self.__dict__ or None)


@dataclass(frozen=True)
class Culprit:
    """A rank to blame for a failure: its global ``rank``, ``reason`` (e.g.
    "never issued ALLREDUCE seq 2 on group 0"), and where known its
    ``host`` and ``pid``, the source line it was at (``file``, ``line``,
    ``function``: from its answer to the diagnosis, its C-level stack, or
    the test harness), and its class in the verdict catalogue (``kind``)."""

    rank: int
    reason: str
    host: str | None = None
    pid: int | None = None
    file: str | None = None
    line: int | None = None
    function: str | None = None
    kind: str = ""  # its class in the verdict catalogue (diagnostics/verdicts.py), e.g. "stuck_in_user_code"

    @property
    def where(self) -> str | None:
        """``file:line in function``, when known."""
        if self.file is None:
            return None
        return f"{self.file}:{self.line}" + (f" in {self.function}" if self.function else "")


class DistBackendError(DistError):
    """A communication operation failed, timed out or was aborted. A timeout
    that could be diagnosed names in ``culprits`` the ranks to blame (those
    that never issued the operation, or did not answer the diagnosis, or a
    point-to-point operation's peers), with their host and pid; empty when
    the diagnosis could not tell."""

    culprits: tuple[Culprit, ...] = ()


class DistStoreError(DistError):
    """A rendezvous store operation failed or timed out."""


class QueueEmptyError(DistStoreError):
    """``queue_pop(key, block=False)`` found the queue empty."""


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


# Our class -> torch.distributed's class of the same family (torch raises
# DistBackendError for what its NaN check finds).
_TORCH_NAMES = {DistError: "DistError", DistBackendError: "DistBackendError", DistStoreError: "DistStoreError",
                QueueEmptyError: "QueueEmptyError", DistNetworkError: "DistNetworkError",
                NanError: "DistBackendError"}
_compatible: dict[type, type] = {}  # our class (or a subclass of one) -> the subclass of both
_OURS_ATTR = "_nccl_pg_class"


def _torch_compatible(cls: type) -> type:
    made = _compatible.get(cls)
    if made is not None:
        return made
    tdist = sys.modules.get("torch.distributed")
    if tdist is None or cls.__dict__.get(_OURS_ATTR) is not None:
        return cls
    theirs = next((getattr(tdist, _TORCH_NAMES[base], None) for base in cls.__mro__ if base in _TORCH_NAMES), None)
    if not isinstance(theirs, type):  # torch.distributed still importing, or unavailable
        return cls
    made = type(cls.__name__, (cls, theirs), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                               "__doc__": cls.__doc__, _OURS_ATTR: cls})
    _compatible[cls] = made
    return made


def _ours(cls: type) -> type:
    return cls.__dict__.get(_OURS_ATTR) or cls

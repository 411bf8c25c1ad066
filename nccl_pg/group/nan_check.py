"""NaN checks of the inputs of collectives and sends (``NCCL_PG_NAN_CHECK``).

The group core calls ``NanCheck.check`` with the arrays an operation sends;
the backend scans them (``Backend.find_nan``: a CUDA kernel on the NCCL
backend, numpy on the host backend) and this module turns a finding into a
``NanError`` naming rank, group, operation, input and element. Modes:

- ``raise``: scanned on the caller's stream (host: in the calling thread) and
  waited for before the operation is issued: it is not issued and its
  sequence number is not used, so a caller can fix the input and retry.
- ``async``: scanned on the group's stream just before the operation; the
  operation still runs (peers are not left waiting) and its Work fails with
  the NanError once it completes, through the watchdog. No host sync.
- ``trap``: as PyTorch: a NaN ends the process (``__trap()`` on the device,
  which also destroys the CUDA context; ``os.abort()`` on the host backend).

The scan itself (rules per dtype, lanes, the numpy search, ``NanScan``) is a
primitive of the backends: ``nccl_pg/comm/nan_scan.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import env
from ..comm.nan_scan import NanScan, lane_dtype, locate
from ..diagnostics.verdicts import op_name
from ..errors import DistBackendError, NanError

if TYPE_CHECKING:
    from ..comm.base import Backend, Stream
    from ..diagnostics.group_view import GroupView
    from .work import OpType


@dataclass
class _Target:
    label: str  # "tensor", "input_list[2]", ...
    flat: Any
    shape: tuple[int, ...]
    per: int  # lanes per element


class Pending:
    """Async-mode scans of one Work: read by the watchdog once the Work's
    operation completed (the scans ran before it on the same stream)."""

    def __init__(self, check: NanCheck, op_type: OpType, scan: NanScan, targets: list[_Target]) -> None:
        self._check, self._op_type, self._scan, self._targets = check, op_type, scan, targets

    def error(self, work_op: OpType, seq: int) -> NanError | None:
        """The finding, for the Work ``work_op`` (``seq``): this operation or
        the coalesced group it is part of."""
        lane = self._scan.first()
        self._scan.release(True)
        if lane is None:
            return None
        issued = f" #{seq}" if work_op is self._op_type else f" (in {op_name(work_op.value)} #{seq})"
        return self._check.error(self._op_type, self._targets, lane, "the operation ran (NCCL_PG_NAN_CHECK=async)",
                                 issued)

    def abandon(self) -> None:
        """The Work failed otherwise: its scan's result is not read."""
        self._scan.release(False)


def resolve_mode(option: str | None) -> str:
    """A group's mode: its ``Options.nan_check`` (same values as the
    variable), else ``NCCL_PG_NAN_CHECK``."""
    if option is None:
        return env.NAN_CHECK.get()
    try:
        return env.parse_nan_check(str(option))
    except ValueError as exc:
        raise ValueError(f"Options.nan_check: invalid value {option!r}: {exc}") from None


class NanCheck:
    """One group's NaN check (absent when the mode is off): the group's view
    (for the words of a finding), its backend and device. It holds nothing
    that refers back to the group, so that a dropped group can go at once."""

    def __init__(self, group: GroupView, backend: Backend, device: Any, mode: str) -> None:
        if mode not in env.NAN_CHECK_MODES[1:]:
            raise ValueError(f"NaN check mode must be one of {env.NAN_CHECK_MODES[1:]}, got {mode!r}")
        self._group, self._backend, self._device, self.mode = group, backend, device, mode

    def check(self, op_type: OpType, items: Sequence[tuple[str, Any]], stream: Stream,
              timeout: float) -> Pending | None:
        """Check ``items`` ((label, array) pairs) as the mode says: raise now
        (a scan not done within ``timeout`` seconds raises too), return the
        Work's Pending (async), or arm the trap."""
        backend, device = self._backend, self._device
        targets = []
        for label, array in items:
            flat = backend.flat(array, label)
            kind = lane_dtype(np.dtype(backend.dtype(flat)))
            if kind is not None and flat.size:
                targets.append(_Target(label, flat, tuple(getattr(array, "shape", ())), kind[1]))
        if not targets:
            return None
        flats = [t.flat for t in targets]
        if self.mode == "raise":
            scan = backend.find_nan(flats, None, None, device)
            finished = scan.wait(timeout)
            lane = scan.first() if finished else None
            scan.release(finished)
            if not finished:
                raise DistBackendError(f"timeout: the NaN check of {op_name(op_type.value)}'s inputs on {self._where()} did not "
                               f"finish within {timeout:.1f} s")
            if lane is not None:
                raise self.error(op_type, targets, lane, "the operation was not issued (NCCL_PG_NAN_CHECK=raise)")
            return None
        if self.mode == "trap":
            backend.find_nan(flats, stream, lambda lane: self._trap_text(op_type, targets, lane), device)
            return None
        return Pending(self, op_type, backend.find_nan(flats, stream, None, device), targets)

    def _where(self) -> str:
        g = self._group
        return (f"process group {g.uid} ({g.desc!r}), rank {g.global_rank(g.rank)} "
                f"(group rank {g.rank} of {g.size})")

    def error(self, op_type: OpType, targets: list[_Target], lane: int, outcome: str, issued: str = "") -> NanError:
        """``issued``: which of the group's operations it became, e.g. " #3" (none: it was not issued)."""
        i, at = locate([t.flat.size * t.per for t in targets], lane)
        t = targets[i]
        element = at // t.per
        where = ""
        if len(t.shape) > 1:
            where = f", index {tuple(int(x) for x in np.unravel_index(element, t.shape))} of shape {t.shape}"
        part = "" if t.per == 1 else f" ({'real' if at % 2 == 0 else 'imaginary'} part)"
        g = self._group
        text = (f"NaN in the input of {op_name(op_type.value)}{issued} on {self._where()}: {t.label} element {element}{part}"
                f"{where} ({t.flat.size} x {np.dtype(self._backend.dtype(t.flat)).name}); {outcome}")
        return NanError(text, rank=g.global_rank(g.rank), group=g.uid, group_desc=g.desc,
                        op=op_type.name, input=t.label, index=element)

    def _trap_text(self, op_type: OpType, targets: list[_Target], lane: int) -> str:
        return str(self.error(op_type, targets, lane, "ending the process (NCCL_PG_NAN_CHECK=trap)"))


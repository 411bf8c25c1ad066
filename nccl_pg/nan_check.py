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

Arrays are scanned in "lanes": their real scalars (a complex element is two
lanes). A scan of several arrays reports the first NaN lane of their
concatenation; ``locate`` maps it back to (array, element).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import env
from .errors import DistBackendError, NanError

if TYPE_CHECKING:
    from .comm.base import Stream
    from .process_group import ProcessGroup
    from .work import OpType


@dataclass(frozen=True)
class Rule:
    """A lane holds a NaN iff ``(bits & mask) > largest``: its magnitude bits
    exceed those of infinity (or of the largest finite value, for e4m3fn)."""

    kernel: str  # entry point in kernels/nan_check.cu
    bits: type[np.unsignedinteger]
    mask: int
    largest: int


# By the name of the lane's dtype (ml_dtypes names for bf16 and fp8).
RULES: dict[str, Rule] = {
    "float16": Rule("nan_check_f16", np.uint16, 0x7FFF, 0x7C00),
    "bfloat16": Rule("nan_check_bf16", np.uint16, 0x7FFF, 0x7F80),
    "float32": Rule("nan_check_f32", np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
    "float64": Rule("nan_check_f64", np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    "float8_e4m3fn": Rule("nan_check_e4m3", np.uint8, 0x7F, 0x7E),  # only S.1111.111 is NaN
    "float8_e5m2": Rule("nan_check_e5m2", np.uint8, 0x7F, 0x7C),
}
# Lanes scanned per numpy step: the temporary stays in L2, and per-call costs are amortised (2**20 was the
# fastest of 2**16..2**22 on the benchmark machine, docs/BENCHMARKS.md).
_CHUNK = 1 << 20


def lane_dtype(dtype: np.dtype) -> tuple[np.dtype, int] | None:
    """(lane dtype, lanes per element) of a checked dtype; None for dtypes
    that cannot hold a NaN or have no check (integers, bool, fnuz fp8)."""
    if dtype.kind == "c":
        real = np.dtype(f"f{dtype.itemsize // 2}")
        return (real, 2) if real.name in RULES else None
    return (dtype, 1) if dtype.name in RULES else None


def first_nan(lanes: np.ndarray) -> int | None:
    """Index of the first NaN of a flat numpy array of a ``RULES`` dtype."""
    rule = RULES[lanes.dtype.name]
    if lanes.dtype.kind == "f" and lanes.dtype.itemsize >= 4:
        # max() propagates NaN and runs vectorised without a temporary.
        for at in range(0, lanes.size, _CHUNK):
            chunk = lanes[at:at + _CHUNK]
            if np.isnan(chunk.max()):
                return at + int(np.flatnonzero(np.isnan(chunk))[0])
        return None
    bits = lanes.view(rule.bits)
    mask, largest = rule.bits(rule.mask), rule.bits(rule.largest)
    buf = np.empty(min(_CHUNK, bits.size), rule.bits)
    for at in range(0, bits.size, _CHUNK):
        chunk = bits[at:at + _CHUNK]
        mag = np.bitwise_and(chunk, mask, out=buf[:chunk.size])
        if mag.max() > largest:
            return at + int(np.flatnonzero(mag > largest)[0])
    return None


def first_nan_of(arrays: Sequence[np.ndarray]) -> int | None:
    """The host backend's scan: first NaN lane of the arrays' concatenation."""
    offset = 0
    for a in arrays:
        lane, per = lane_dtype(a.dtype) or (a.dtype, 1)
        hit = first_nan(a.view(lane) if per > 1 else a)
        if hit is not None:
            return offset + hit
        offset += a.size * per
    return None


def locate(counts: Sequence[int], lane: int) -> tuple[int, int]:
    """(array, lane within it) of ``lane`` in the concatenation of arrays of
    ``counts`` lanes."""
    for i, n in enumerate(counts):
        if lane < n:
            return i, lane
        lane -= n
    raise IndexError(f"lane {lane} past the end of the scanned arrays")


class NanScan(Protocol):
    """A backend's scan in flight (``Backend.find_nan``)."""

    def wait(self, timeout: float) -> bool:
        """Block until the scan finished (False: ``timeout`` passed)."""

    def first(self) -> int | None:
        """First NaN lane; read once the scan finished (after ``wait``, or
        once an event recorded after it on its stream completed)."""

    def release(self, finished: bool) -> None:
        """Give back the result memory; ``finished=False``: the scan may still
        write it (an aborted stream), so it is not reused."""


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
        within = "" if work_op is self._op_type else f" in {work_op.name}"
        return self._check.error(self._op_type, self._targets, lane, "the operation ran (NCCL_PG_NAN_CHECK=async)",
                                 f"{within} (seq {seq})")

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
    """One group's NaN check (absent when the mode is off)."""

    def __init__(self, pg: ProcessGroup, mode: str) -> None:
        if mode not in env.NAN_CHECK_MODES[1:]:
            raise ValueError(f"NaN check mode must be one of {env.NAN_CHECK_MODES[1:]}, got {mode!r}")
        # A proxy: the group holds this object, and a reference back would keep a dropped group alive until the
        # cyclic garbage collector runs (its __del__ frees the communicator).
        self._pg, self.mode = weakref.proxy(pg), mode

    def check(self, op_type: OpType, items: Sequence[tuple[str, Any]], stream: Stream) -> Pending | None:
        """Check ``items`` ((label, array) pairs) as the mode says: raise now,
        return the Work's Pending (async), or arm the trap."""
        pg, backend = self._pg, self._pg._backend
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
            scan = backend.find_nan(flats, None, None, pg._device)
            finished = scan.wait(pg._timeout)
            lane = scan.first() if finished else None
            scan.release(finished)
            if not finished:
                raise DistBackendError(f"timeout: the NaN check of {op_type.name}'s inputs on {self._where()} did not "
                               f"finish within {pg._timeout:.1f} s")
            if lane is not None:
                raise self.error(op_type, targets, lane, "the operation was not issued (NCCL_PG_NAN_CHECK=raise)")
            return None
        if self.mode == "trap":
            backend.find_nan(flats, stream, lambda lane: self._trap_text(op_type, targets, lane), pg._device)
            return None
        return Pending(self, op_type, backend.find_nan(flats, stream, None, pg._device), targets)

    def _where(self) -> str:
        pg = self._pg
        return (f"process group {pg.uid} ({pg.group_desc!r}), rank {pg._global_rank_of(pg.rank())} "
                f"(group rank {pg.rank()} of {pg.size()})")

    def error(self, op_type: OpType, targets: list[_Target], lane: int, outcome: str, issued: str = "") -> NanError:
        """``issued``: where the operation went, e.g. " (seq 3)"."""
        i, at = locate([t.flat.size * t.per for t in targets], lane)
        t = targets[i]
        element = at // t.per
        where = ""
        if len(t.shape) > 1:
            where = f", index {tuple(int(x) for x in np.unravel_index(element, t.shape))} of shape {t.shape}"
        part = "" if t.per == 1 else f" ({'real' if at % 2 == 0 else 'imaginary'} part)"
        pg = self._pg
        text = (f"NaN in the input of {op_type.name}{issued} on {self._where()}: {t.label} element {element}{part}"
                f"{where} ({t.flat.size} x {np.dtype(pg._backend.dtype(t.flat)).name}); {outcome}")
        return NanError(text, rank=pg._global_rank_of(pg.rank()), group=pg.uid, group_desc=pg.group_desc,
                        op=op_type.name, input=t.label, index=element)

    def _trap_text(self, op_type: OpType, targets: list[_Target], lane: int) -> str:
        return str(self.error(op_type, targets, lane, "ending the process (NCCL_PG_NAN_CHECK=trap)"))


"""The NaN scan primitives the backends implement (``Backend.find_nan``).

A lane holds a NaN iff its magnitude bits exceed those of infinity: the rules
per lane dtype, the numpy scan the host backend runs, and the ``NanScan``
protocol of a scan in flight. What a finding means for the caller (raise,
fail the Work, end the process) is the group layer's policy
(``nccl_pg/group/nan_check.py``).

Arrays are scanned in "lanes": their real scalars (a complex element is two
lanes). A scan of several arrays reports the first NaN lane of their
concatenation; ``locate`` maps it back to (array, element).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


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

"""The messages between the ranks of a host communicator's mesh.

Each message carries a header with a per-peer sequence number, the
operation's kind, dtype, reduction op, root, size (of the operation's
buffer, whatever the message carries of it) and number (collectives are
numbered in issue order, the same on every rank), so ranks that disagree
(one in all_reduce, another in broadcast; float32 against int32; SUM against
MAX; different roots or sizes) get an error naming the peer and both values,
instead of garbage or a hang (transport.py compares them). A message may
carry no data (``EMPTY``): transport.py says why rooted collectives send
such. Also here: the errors a mesh raises, and a message half sent or half
received.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import DistBackendError

# per-peer seq, op kind, dtype code, reduction-op code, root (in a goodbye: the culprit), payload bytes, the
# operation's size in bytes, the collective's number
HEADER = struct.Struct("<QBBBxiQQI4x")
ANY = 255  # dtype or op code of a message whose dtype or op is not checked (point-to-point, raw bytes)
NO_ROOT = -1
NO_SIZE = 2**64 - 1
NO_NUMBER = 2**32 - 1  # the number of a message outside the collectives (point-to-point, init)
# (dtype code, op code, root, size in bytes) of an operation, checked against every peer's
Meta = tuple[int, int, int, int]
NO_META: Meta = (ANY, ANY, NO_ROOT, NO_SIZE)
_UNSET = NO_META  # a field given as this on either side is not compared
GOODBYE = 255  # op kind of the last frame a rank sends on each connection when it leaves a broken mesh


@dataclass(frozen=True)
class WireNames:
    """Names of the codes in message headers, for error messages."""

    kinds: tuple[str, ...]
    dtypes: tuple[str, ...]
    ops: tuple[str, ...]


class MeshTimeoutError(DistBackendError):
    """Init's deadline passed with ``missing`` ranks not connected."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class PeerLostError(DistBackendError):
    """A peer's connection ended: it exited, crashed or aborted. ``culprit``
    is the rank whose failure started it (the peer itself, or the rank the
    peer's goodbye named), ``reason`` what happened to the culprit."""

    def __init__(self, message: str, culprit: int, reason: str) -> None:
        super().__init__(message)
        self.culprit, self.reason = culprit, reason


EMPTY = memoryview(b"")  # the data of a message that only carries its header (see the module's docstring)


def empty_target() -> memoryview:
    """Where an EMPTY message is received."""
    return memoryview(bytearray())


@dataclass
class Outgoing:
    """A message being sent: what is left of its parts (header, data), and how many bytes went."""

    parts: list[memoryview]
    sent: int = 0


def advance(parts: list[memoryview], n: int) -> int:
    """Drop the first ``n`` bytes (at most all of them) from ``parts``;
    returns how many were dropped."""
    done = 0
    while parts and done < n:
        k = min(n - done, parts[0].nbytes)
        done += k
        if k == parts[0].nbytes:
            parts.pop(0)
        else:
            parts[0] = parts[0][k:]
    return done


@dataclass
class Incoming:
    """A receive in progress: where its data goes, its header and data so far."""

    target: memoryview
    on_done: Callable[[], None] | None
    header: bytearray = field(default_factory=lambda: bytearray(HEADER.size))
    got_header: int = 0
    got: int = 0


def fields_that_differ(theirs: Meta, ours: Meta) -> list[str]:
    """The fields both sides give (not ANY / NO_ROOT / NO_SIZE) that are not equal."""
    return [name for name, a, b, u in zip(("dtype", "reduction", "root", "size"), theirs, ours, _UNSET, strict=True)
            if a != b and a != u and b != u]


def code_name(names: tuple[str, ...], code: int, what: str) -> str:
    """The name of a header's code (``names``: WireNames' kinds, dtypes or ops), or its number."""
    return names[code] if code < len(names) else f"{what} #{code}"


def header_kind(header: bytes) -> int:
    """The operation kind a message header carries."""
    return int(HEADER.unpack(header)[1])

"""Decoding the bytes of an untrusted dump within bounds of memory and work.

A dump folder may be writable by others, so a dump's bytes are a hostile
program's output until checked. Pickles are loaded by an unpickler that
resolves no global (no class or function is ever called), which stops code;
what it does not stop is a few bytes that make the decoder allocate a lot:

- the memo: ``LONG_BINPUT`` with index n makes CPython's unpickler allocate
  and zero a table of 2n pointers (9 bytes of pickle: 1 GiB for n = 2**26,
  32 GiB for n = 2**31), whatever it stores there;
- objects per byte: an empty set is 1 byte of pickle and 216 bytes of
  memory, an empty dict 1 and 64 (JSON: 3 bytes for an empty dict or list);
- sharing: one value memoized once and referenced (2 to 5 bytes each) many
  times over is built once, but whoever walks the result pays per reference
  (a 1.1 MiB dump sharing one entry 600,000 times cost ``nccl-pg trace``
  770 MiB and 15 s). ``Decoded.values`` counts the values a file really
  built, so that a reader can bound its walk by it.

So before a pickle is loaded, its opcodes are scanned (``pickletools``,
nothing built): the memo must grow densely (as every pickler writes it),
the opcodes are limited in number, and the memory the loaded value will
take is estimated from what each opcode builds and refused over a limit.
JSON is estimated from its brackets and separators. Bytes over
``MAX_BYTES`` are refused unread.
"""

from __future__ import annotations

import io
import json
import pickle
import pickletools
from dataclasses import dataclass
from typing import Any

MAX_BYTES = 32 << 20  # a dump file (ours: about 140-190 bytes a recorder entry, so ~2,000 entries ≈ 0.4 MB)
MAX_DECODED_BYTES = 256 << 20  # the estimated memory of what decoding one dump builds
MAX_OPS = 8_000_000  # pickle opcodes of one dump (ours: about 70-100 an entry)

# Estimated bytes that an opcode's new object takes (CPython, 64-bit); singletons (None, True, the empty
# tuple) take none. Each value pushed (a reference too) also takes _SLOT: its pointer in a container plus a
# dict's or set's per-item overhead.
_OBJECT = {
    "EMPTY_LIST": 56, "LIST": 56, "EMPTY_DICT": 64, "DICT": 64, "EMPTY_SET": 216, "FROZENSET": 216,
    "TUPLE": 40, "TUPLE1": 48, "TUPLE2": 56, "TUPLE3": 64, "BINFLOAT": 24, "FLOAT": 24,
    "BININT": 32, "BININT1": 32, "BININT2": 32, "INT": 32, "LONG": 32, "LONG1": 32, "LONG4": 32,
    "SHORT_BINUNICODE": 80, "BINUNICODE": 80, "BINUNICODE8": 80, "UNICODE": 80, "STRING": 80, "BINSTRING": 80,
    "SHORT_BINSTRING": 80, "SHORT_BINBYTES": 33, "BINBYTES": 33, "BINBYTES8": 33, "BYTEARRAY8": 57,
}
_SINGLETONS = {"NONE", "NEWTRUE", "NEWFALSE", "EMPTY_TUPLE"}
_REFS = {"GET", "BINGET", "LONG_BINGET", "DUP"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_SLOT = 40
_MEMO_SLOT = 16  # the unpickler's memo table grows by doubling


class NotADump(ValueError):
    """A file that is not a readable dump (the message says why)."""


@dataclass
class Decoded:
    value: dict[str, Any]
    values: int  # values the bytes built (references to one value not counted again)
    estimated_bytes: int
    size: int  # bytes decoded


class _PlainData(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers; refuses every global
    (a class, a function: the only ways a pickle runs code)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it refers to {module}.{name}; a dump holds plain data only")


def scan_pickle(data: bytes) -> tuple[int, int]:
    """(values built, estimated bytes) of loading ``data``; NotADump when the
    memo is not dense, or the opcodes or the estimate are over the limits.
    Reads opcodes only; builds nothing of the pickle's."""
    values = estimate = memo = ops = 0
    try:
        for op, arg, pos in pickletools.genops(data):
            ops += 1
            if ops > MAX_OPS:
                raise NotADump(f"more than {MAX_OPS} pickle opcodes")
            name = op.name
            if name in _OBJECT:
                values += 1
                estimate += _OBJECT[name] + _SLOT + (len(arg) if isinstance(arg, (str, bytes, bytearray)) else 0)
            elif name in _SINGLETONS:
                values += 1
                estimate += _SLOT
            elif name in _REFS:
                estimate += _SLOT
            elif name == "MEMOIZE":
                memo += 1
                estimate += _MEMO_SLOT
            elif name in _PUTS:
                if not isinstance(arg, int) or arg > memo:
                    raise NotADump(f"pickle memo index {arg} at byte {pos} skips ahead of the {memo} values "
                                   f"memoized (no pickler writes that; it would make the unpickler allocate a "
                                   f"table of {arg} entries)")
                memo += arg == memo
                estimate += _MEMO_SLOT
            if estimate > MAX_DECODED_BYTES:
                raise NotADump(f"decoding it would take over {MAX_DECODED_BYTES >> 20} MiB (estimated at byte "
                               f"{pos} of {len(data)})")
            if name == "STOP":
                break
    except NotADump:
        raise
    except Exception as exc:  # a truncated or malformed opcode stream: say what pickletools says
        raise NotADump(f"pickle: {exc}") from None
    return values, estimate


def estimate_json(data: bytes) -> tuple[int, int]:
    """(values at most, estimated bytes) of ``json.loads(data)``, from its
    brackets and separators (counted in strings too: an upper bound)."""
    containers = data.count(b"{") + data.count(b"[")
    values = containers + data.count(b",") + data.count(b":") + 1
    return values, containers * 64 + values * (_SLOT + 32) + len(data)


def decode(data: bytes) -> Decoded:
    """The dict a dump's bytes hold (JSON or pickle), within the bounds above,
    else NotADump saying why."""
    if len(data) > MAX_BYTES:
        raise NotADump(f"{len(data)} bytes, over the {MAX_BYTES}-byte limit")
    is_json = data[:1] in (b"{", b"[")
    values, estimate = estimate_json(data) if is_json else scan_pickle(data)
    if estimate > MAX_DECODED_BYTES:
        raise NotADump(f"decoding it would take over {MAX_DECODED_BYTES >> 20} MiB (estimated)")
    try:
        value = json.loads(data) if is_json else _PlainData(io.BytesIO(data)).load()
    except RecursionError:
        raise NotADump("nested too deeply") from None
    except MemoryError:
        raise NotADump("too large to decode") from None
    except Exception as exc:
        raise NotADump(f"{'JSON' if is_json else 'pickle'}: {exc}") from None
    if not isinstance(value, dict):
        raise NotADump(f"it holds a {type(value).__name__}, not a dict")
    return Decoded(value, values, estimate, len(data))

"""Collectives of Python objects, built on the array collectives.

Objects are serialized into uint8 arrays on the group's device; sizes travel
first so receivers can allocate. Every size received is checked (not
negative, at most ``NCCL_PG_OBJECT_MAX_BYTES``) before anything is
allocated, and bytes that do not deserialize raise DistBackendError naming
the sender.

The serializer (``serializer=`` per call, else ``NCCL_PG_OBJECT_SERIALIZER``):

- ``"pickle"`` (default): torch's format and reach (any picklable object).
  Unpickling runs code the sender chooses: use it only among trusted ranks.
- ``"safe"``: the same pickle stream, read by ``safe_pickle``, which builds
  plain data only (builtins containers and scalars, complex,
  bytes/bytearray, set/frozenset, slice, OrderedDict, numpy arrays, scalars
  and dtypes) and at most ``NCCL_PG_OBJECT_MAX_BYTES`` of it: no code runs
  and nothing larger is allocated, whatever a peer sends; other objects,
  and payloads that would build more, raise.
- any object with ``dumps(obj) -> bytes`` and ``loads(bytes) -> obj``
  (e.g. a JSON or msgpack codec), the same on every rank.

docs/SECURITY.md says which to use when.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from . import env, safe_pickle
from .distributed.collectives import finish
from .distributed.world import Group, global_rank_of, group_rank_of, resolve
from .errors import DistBackendError
from .group.process_group import ProcessGroup


class Serializer(Protocol):
    def dumps(self, obj: Any) -> bytes: ...

    def loads(self, data: bytes) -> Any: ...


class PickleSerializer:
    """torch's format: any picklable object; loading runs the sender's code."""

    def dumps(self, obj: Any) -> bytes:
        return pickle.dumps(obj)

    def loads(self, data: bytes) -> Any:
        return pickle.loads(data)


class SafeSerializer:
    """Pickle on the wire (torch-compatible on the sending side); loading
    builds plain data only, and at most NCCL_PG_OBJECT_MAX_BYTES of it, so a
    hostile peer can neither run code here nor make this process allocate
    more than that."""

    def dumps(self, obj: Any) -> bytes:
        return pickle.dumps(obj)

    def loads(self, data: bytes) -> Any:
        return safe_pickle.loads(data, env.OBJECT_MAX_BYTES.get(), env.OBJECT_MAX_BYTES.name)


SERIALIZERS: dict[str, Serializer] = {"pickle": PickleSerializer(), "safe": SafeSerializer()}


def _serializer(choice: str | Serializer | None) -> Serializer:
    if choice is None:
        return SERIALIZERS[env.OBJECT_SERIALIZER.get()]
    if isinstance(choice, str):
        if choice not in SERIALIZERS:
            raise ValueError(f"unknown serializer {choice!r}: use one of {sorted(SERIALIZERS)} or an object with "
                             "dumps() and loads()")
        return SERIALIZERS[choice]
    if not (callable(getattr(choice, "dumps", None)) and callable(getattr(choice, "loads", None))):
        raise TypeError(f"serializer must be a name or have dumps() and loads(), got {type(choice).__name__}")
    return choice


def _pack(pg: ProcessGroup, codec: Serializer, obj: Any) -> tuple[Any, int]:
    data = np.frombuffer(codec.dumps(obj), dtype=np.uint8)
    return pg.comm_backend.from_host(data, pg.bound_device_id), data.size


def _loads(codec: Serializer, data: bytes, pg: ProcessGroup, source: int) -> Any:
    try:
        return codec.loads(data)
    except Exception as exc:
        raise DistBackendError(f"object from rank {global_rank_of(pg, source)} cannot be deserialized "
                               f"({type(exc).__name__}: {exc})") from None


def _unpack(pg: ProcessGroup, codec: Serializer, array: Any, size: int, source: int) -> Any:
    return _loads(codec, pg.comm_backend.to_host(array)[:size].tobytes(), pg, source)


def _lengths(pg: ProcessGroup, values: Sequence[int], sources: Sequence[int], what: str) -> list[int]:
    """Byte counts received from peers, checked before anything is sized by
    them: a corrupt or forged count raises here, on every rank that got it."""
    limit = env.OBJECT_MAX_BYTES.get()
    out = []
    for n, source in zip(values, sources, strict=True):
        n = int(n)
        if not 0 <= n <= limit:
            raise DistBackendError(f"{what}: rank {global_rank_of(pg, source)} announced an object of {n} bytes; expected "
                                   f"0..{limit} ({env.OBJECT_MAX_BYTES.name})")
        out.append(n)
    return out


def _sizes(pg: ProcessGroup, values: Sequence[int]) -> Any:
    return pg.comm_backend.from_host(np.asarray(values, dtype=np.int64), pg.bound_device_id)


def _padded(pg: ProcessGroup, array: Any, size: int, length: int) -> Any:
    host = np.zeros(length, np.uint8)
    host[:size] = pg.comm_backend.to_host(array)[:size]
    return pg.comm_backend.from_host(host, pg.bound_device_id)


def _all_sizes(pg: ProcessGroup, size: int, what: str) -> list[int]:
    """Every rank's ``size`` (an all_gather), checked."""
    sizes = [_sizes(pg, [0]) for _ in range(pg.size())]
    finish(pg.allgather(sizes, _sizes(pg, [size])), async_op=False)
    return _lengths(pg, [int(pg.comm_backend.to_host(s)[0]) for s in sizes], range(pg.size()), what)


def _blob(pg: ProcessGroup, packed: list[tuple[Any, int]]) -> Any:
    """The pickles of ``packed`` back to back in one device array."""
    host = np.concatenate([pg.comm_backend.to_host(d) for d, _ in packed]) if packed else np.zeros(0, np.uint8)
    return pg.comm_backend.from_host(host, pg.bound_device_id)


def _unblob(pg: ProcessGroup, codec: Serializer, blob: Any, lengths: list[int], into: list[Any], source: int) -> None:
    host, at = pg.comm_backend.to_host(blob), 0
    for i, n in enumerate(lengths):
        into[i] = _loads(codec, host[at:at + n].tobytes(), pg, source)
        at += n


def all_gather_object(object_list: list[Any], obj: Any, group: Group = None, *,
                      serializer: str | Serializer | None = None) -> None:
    """``object_list[r]`` becomes rank r's ``obj`` (two all_gathers: sizes, bytes)."""
    pg = resolve(group, "all_gather_object")
    if pg is None:
        return
    if len(object_list) != pg.size():
        raise ValueError(f"all_gather_object: object_list has {len(object_list)} entries; expected {pg.size()}")
    codec = _serializer(serializer)
    data, size = _pack(pg, codec, obj)
    lengths = _all_sizes(pg, size, "all_gather_object")
    longest = max(lengths)
    outs = [pg.comm_backend.empty(longest, np.uint8, pg.bound_device_id) for _ in lengths]
    finish(pg.allgather(outs, _padded(pg, data, size, longest)), async_op=False)
    for r, (out, n) in enumerate(zip(outs, lengths, strict=True)):
        object_list[r] = _unpack(pg, codec, out, n, r)


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Group = None,
                          device: Any = None, group_src: int | None = None, *,
                          serializer: str | Serializer | None = None) -> None:
    """Every rank's ``object_list`` becomes the source's (same length everywhere)."""
    pg = resolve(group, "broadcast_object_list")
    if pg is None:
        return
    root = group_rank_of(pg, src, group_src, "broadcast_object_list src")
    codec = _serializer(serializer)
    packed = [_pack(pg, codec, o) for o in object_list] if pg.rank() == root else []
    sizes = _sizes(pg, [n for _, n in packed] if pg.rank() == root else [0] * len(object_list))
    finish(pg.broadcast(sizes, root), async_op=False)
    lengths = _lengths(pg, pg.comm_backend.to_host(sizes), [root] * len(object_list), "broadcast_object_list")
    blob = _blob(pg, packed) if pg.rank() == root else pg.comm_backend.empty(sum(lengths), np.uint8, pg.bound_device_id)
    finish(pg.broadcast(blob, root), async_op=False)
    if pg.rank() != root:
        _unblob(pg, codec, blob, lengths, object_list, root)


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: Group = None, group_dst: int | None = None, *,
                  serializer: str | Serializer | None = None) -> None:
    """On the destination, ``object_gather_list[r]`` becomes rank r's ``obj``."""
    pg = resolve(group, "gather_object")
    if pg is None:
        return
    root = group_rank_of(pg, dst, group_dst, "gather_object dst")
    if pg.rank() == root and (object_gather_list is None or len(object_gather_list) != pg.size()):
        raise ValueError(f"gather_object: the destination needs object_gather_list of {pg.size()} entries")
    codec = _serializer(serializer)
    data, size = _pack(pg, codec, obj)
    lengths = _all_sizes(pg, size, "gather_object")
    longest = max(lengths)
    outs = [pg.comm_backend.empty(longest, np.uint8, pg.bound_device_id) for _ in lengths] if pg.rank() == root else None
    finish(pg.gather(_padded(pg, data, size, longest), outs, root), async_op=False)
    if outs is not None and object_gather_list is not None:
        for r, (out, n) in enumerate(zip(outs, lengths, strict=True)):
            object_gather_list[r] = _unpack(pg, codec, out, n, r)


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: Group = None, group_src: int | None = None, *,
                        serializer: str | Serializer | None = None) -> None:
    """``scatter_object_output_list[0]`` becomes the source's input entry for this rank."""
    pg = resolve(group, "scatter_object_list")
    if pg is None:
        return
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("scatter_object_list: scatter_object_output_list must be a list with at least one entry")
    root = group_rank_of(pg, src, group_src, "scatter_object_list src")
    codec = _serializer(serializer)
    ins: list[Any] | None = None
    counts: list[Any] | None = None
    if pg.rank() == root:
        if scatter_object_input_list is None or len(scatter_object_input_list) != pg.size():
            raise ValueError(f"scatter_object_list: the source needs {pg.size()} input objects")
        packed = [_pack(pg, codec, o) for o in scatter_object_input_list]
        longest = max(n for _, n in packed)
        ins = [_padded(pg, d, n, longest) for d, n in packed]
        counts = [_sizes(pg, [n]) for _, n in packed]
        head = _sizes(pg, [longest])
    else:
        head = _sizes(pg, [0])
    finish(pg.broadcast(head, root), async_op=False)
    (longest,) = _lengths(pg, pg.comm_backend.to_host(head), [root], "scatter_object_list")
    out, count = pg.comm_backend.empty(longest, np.uint8, pg.bound_device_id), _sizes(pg, [0])
    finish(pg.scatter(count, counts, root), async_op=False)
    finish(pg.scatter(out, ins, root), async_op=False)
    (size,) = _lengths(pg, pg.comm_backend.to_host(count), [root], "scatter_object_list")
    if size > longest:
        raise DistBackendError(f"scatter_object_list: rank {global_rank_of(pg, root)} announced {size} bytes for this rank "
                               f"but at most {longest} for any")
    scatter_object_output_list[0] = _unpack(pg, codec, out, size, root)


def send_object_list(object_list: list[Any], dst: int | None = None, group: Group = None, device: Any = None,
                     group_dst: int | None = None, *, serializer: str | Serializer | None = None) -> None:
    """Send the objects of ``object_list`` to rank ``dst`` (a global rank; ``group_dst``: in ``group``),
    which receives them with ``recv_object_list``; ``serializer``: how they are serialized (default:
    ``NCCL_PG_OBJECT_SERIALIZER``)."""
    pg = resolve(group, "send_object_list")
    if pg is None:
        return
    peer = group_rank_of(pg, dst, group_dst, "send_object_list dst")
    packed = [_pack(pg, _serializer(serializer), o) for o in object_list]
    finish(pg.send(_sizes(pg, [n for _, n in packed]), peer), async_op=False)
    # The receiver refuses sizes over the limit after reading them: refuse here too rather than send the bytes.
    _lengths(pg, [n for _, n in packed], [pg.rank()] * len(packed), "send_object_list")
    finish(pg.send(_blob(pg, packed), peer), async_op=False)


def recv_object_list(object_list: list[Any], src: int | None = None, group: Group = None, device: Any = None,
                     group_src: int | None = None, *, serializer: str | Serializer | None = None) -> int:
    """Fills ``object_list`` (same length as the sender's); returns the
    sender's global rank."""
    pg = resolve(group, "recv_object_list")
    if pg is None:
        return -1
    if src is None and group_src is None:
        raise ValueError("recv_object_list: receiving from any source is not supported; give src or group_src")
    peer = group_rank_of(pg, src, group_src, "recv_object_list src")
    codec = _serializer(serializer)
    sizes = _sizes(pg, [0] * len(object_list))
    finish(pg.recv(sizes, peer), async_op=False)
    lengths = _lengths(pg, pg.comm_backend.to_host(sizes), [peer] * len(object_list), "recv_object_list")
    blob = pg.comm_backend.empty(sum(lengths), np.uint8, pg.bound_device_id)
    finish(pg.recv(blob, peer), async_op=False)
    _unblob(pg, codec, blob, lengths, object_list, peer)
    return global_rank_of(pg, peer)

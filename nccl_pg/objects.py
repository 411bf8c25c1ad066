"""Collectives of picklable Python objects, built on the array collectives.

Objects are pickled into uint8 arrays on the group's device; sizes travel
first so receivers can allocate. Unpickling runs code chosen by the sender:
use these only among trusted ranks (as with torch.distributed).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from .distributed import Group, _finish, _global, _in_group, _resolve
from .process_group import ProcessGroup


def _pack(pg: ProcessGroup, obj: Any) -> tuple[Any, int]:
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    return pg._backend.from_host(data, pg._device), data.size


def _unpack(pg: ProcessGroup, array: Any, size: int) -> Any:
    return pickle.loads(pg._backend.to_host(array)[:size].tobytes())


def _sizes(pg: ProcessGroup, values: Sequence[int]) -> Any:
    return pg._backend.from_host(np.asarray(values, dtype=np.int64), pg._device)


def _padded(pg: ProcessGroup, array: Any, size: int, length: int) -> Any:
    host = np.zeros(length, np.uint8)
    host[:size] = pg._backend.to_host(array)[:size]
    return pg._backend.from_host(host, pg._device)


def _all_sizes(pg: ProcessGroup, size: int) -> list[int]:
    """Every rank's ``size`` (an all_gather)."""
    sizes = [_sizes(pg, [0]) for _ in range(pg.size())]
    _finish(pg.allgather(sizes, _sizes(pg, [size])), async_op=False)
    return [int(pg._backend.to_host(s)[0]) for s in sizes]


def _blob(pg: ProcessGroup, packed: list[tuple[Any, int]]) -> Any:
    """The pickles of ``packed`` back to back in one device array."""
    host = np.concatenate([pg._backend.to_host(d) for d, _ in packed]) if packed else np.zeros(0, np.uint8)
    return pg._backend.from_host(host, pg._device)


def _unblob(pg: ProcessGroup, blob: Any, lengths: list[int], into: list[Any]) -> None:
    host, at = pg._backend.to_host(blob), 0
    for i, n in enumerate(lengths):
        into[i] = pickle.loads(host[at:at + n].tobytes())
        at += n


def all_gather_object(object_list: list[Any], obj: Any, group: Group = None) -> None:
    """``object_list[r]`` becomes rank r's ``obj`` (two all_gathers: sizes, bytes)."""
    pg = _resolve(group, "all_gather_object")
    if pg is None:
        return
    if len(object_list) != pg.size():
        raise ValueError(f"all_gather_object: object_list has {len(object_list)} entries; expected {pg.size()}")
    data, size = _pack(pg, obj)
    lengths = _all_sizes(pg, size)
    longest = max(lengths)
    outs = [pg._backend.empty(longest, np.uint8, pg._device) for _ in lengths]
    _finish(pg.allgather(outs, _padded(pg, data, size, longest)), async_op=False)
    for r, (out, n) in enumerate(zip(outs, lengths, strict=True)):
        object_list[r] = _unpack(pg, out, n)


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Group = None,
                          device: Any = None, group_src: int | None = None) -> None:
    """Every rank's ``object_list`` becomes the source's (same length everywhere)."""
    pg = _resolve(group, "broadcast_object_list")
    if pg is None:
        return
    root = _in_group(pg, src, group_src, "broadcast_object_list src")
    if pg.rank() == root:
        packed = [_pack(pg, o) for o in object_list]
        sizes = _sizes(pg, [n for _, n in packed])
    else:
        sizes = _sizes(pg, [0] * len(object_list))
    _finish(pg.broadcast(sizes, root), async_op=False)
    lengths = [int(x) for x in pg._backend.to_host(sizes)]
    blob = _blob(pg, packed) if pg.rank() == root else pg._backend.empty(sum(lengths), np.uint8, pg._device)
    _finish(pg.broadcast(blob, root), async_op=False)
    if pg.rank() != root:
        _unblob(pg, blob, lengths, object_list)


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: Group = None, group_dst: int | None = None) -> None:
    """On the destination, ``object_gather_list[r]`` becomes rank r's ``obj``."""
    pg = _resolve(group, "gather_object")
    if pg is None:
        return
    root = _in_group(pg, dst, group_dst, "gather_object dst")
    if pg.rank() == root and (object_gather_list is None or len(object_gather_list) != pg.size()):
        raise ValueError(f"gather_object: the destination needs object_gather_list of {pg.size()} entries")
    data, size = _pack(pg, obj)
    lengths = _all_sizes(pg, size)
    longest = max(lengths)
    outs = [pg._backend.empty(longest, np.uint8, pg._device) for _ in lengths] if pg.rank() == root else None
    _finish(pg.gather(_padded(pg, data, size, longest), outs, root), async_op=False)
    if outs is not None and object_gather_list is not None:
        for r, (out, n) in enumerate(zip(outs, lengths, strict=True)):
            object_gather_list[r] = _unpack(pg, out, n)


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: Group = None, group_src: int | None = None) -> None:
    """``scatter_object_output_list[0]`` becomes the source's input entry for this rank."""
    pg = _resolve(group, "scatter_object_list")
    if pg is None:
        return
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("scatter_object_list: scatter_object_output_list must be a list with at least one entry")
    root = _in_group(pg, src, group_src, "scatter_object_list src")
    if pg.rank() == root:
        if scatter_object_input_list is None or len(scatter_object_input_list) != pg.size():
            raise ValueError(f"scatter_object_list: the source needs {pg.size()} input objects")
        packed = [_pack(pg, o) for o in scatter_object_input_list]
        longest = max(n for _, n in packed)
        ins = [_padded(pg, d, n, longest) for d, n in packed]
        counts = [_sizes(pg, [n]) for _, n in packed]
        head = _sizes(pg, [longest])
    else:
        ins = counts = None
        head = _sizes(pg, [0])
    _finish(pg.broadcast(head, root), async_op=False)
    longest = int(pg._backend.to_host(head)[0])
    out, count = pg._backend.empty(longest, np.uint8, pg._device), _sizes(pg, [0])
    _finish(pg.scatter(count, counts, root), async_op=False)
    _finish(pg.scatter(out, ins, root), async_op=False)
    scatter_object_output_list[0] = _unpack(pg, out, int(pg._backend.to_host(count)[0]))


def send_object_list(object_list: list[Any], dst: int | None = None, group: Group = None, device: Any = None,
                     group_dst: int | None = None) -> None:
    pg = _resolve(group, "send_object_list")
    if pg is None:
        return
    peer = _in_group(pg, dst, group_dst, "send_object_list dst")
    packed = [_pack(pg, o) for o in object_list]
    _finish(pg.send(_sizes(pg, [n for _, n in packed]), peer), async_op=False)
    _finish(pg.send(_blob(pg, packed), peer), async_op=False)


def recv_object_list(object_list: list[Any], src: int | None = None, group: Group = None, device: Any = None,
                     group_src: int | None = None) -> int:
    """Fills ``object_list`` (same length as the sender's); returns the
    sender's global rank."""
    pg = _resolve(group, "recv_object_list")
    if pg is None:
        return -1
    if src is None and group_src is None:
        raise ValueError("recv_object_list: receiving from any source is not supported; give src or group_src")
    peer = _in_group(pg, src, group_src, "recv_object_list src")
    sizes = _sizes(pg, [0] * len(object_list))
    _finish(pg.recv(sizes, peer), async_op=False)
    lengths = [int(x) for x in pg._backend.to_host(sizes)]
    blob = pg._backend.empty(sum(lengths), np.uint8, pg._device)
    _finish(pg.recv(blob, peer), async_op=False)
    _unblob(pg, blob, lengths, object_list)
    return _global(pg, peer)

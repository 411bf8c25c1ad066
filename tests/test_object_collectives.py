"""Object collectives against a hostile or broken peer (issue 14, items 3 and
16): the ``safe`` serializer builds plain data only, so a peer's pickle
cannot run code; forged or corrupt sizes and bytes raise DistBackendError
naming the sender before anything is allocated from them.

A hostile peer is played by a rank that issues the raw collectives an
object collective is made of, with values of its choosing.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nccl_pg as dist
from nccl_pg import env
from nccl_pg.errors import DistBackendError
from nccl_pg.testing import run_threads

pytestmark = pytest.mark.timeout(60)

PLAIN = [{"a": 1, 2: (3.5, None, True)}, [b"bytes", bytearray(b"ba"), "text", 1 + 2j, {1, 2}, frozenset({3})],
         collections.OrderedDict(x=slice(1, 9, 2)), np.arange(6, dtype=np.float32).reshape(2, 3), np.int16(7),
         np.array([1, "two", None], dtype=object)]

_marks: list[str] = []


def _mark(path: str) -> str:
    """What a hostile pickle makes its receiver call."""
    Path(path).touch()
    _marks.append(path)
    return "owned"


class Hostile:
    """Unpickles into a call of ``_mark``: code chosen by the sender."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _mark, (self.path,)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
    return type(a) is type(b) and a == b


def _healthy(rank: int) -> None:
    x = np.full(2, rank + 1.0)
    dist.all_reduce(x)
    assert (x == 3).all()


@pytest.mark.parametrize("how", ["argument", "env"])
def test_safe_serializer_round_trips_plain_data_through_every_object_collective(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    kw: dict[str, Any] = {"serializer": "safe"} if how == "argument" else {}
    if how == "env":
        monkeypatch.setenv("NCCL_PG_OBJECT_SERIALIZER", "safe")

    def body(rank: int, world: int) -> None:
        everyone: list[Any] = [None, None]
        dist.all_gather_object(everyone, PLAIN[rank::2], **kw)
        assert all(_same(x, y) for r in range(2) for x, y in zip(everyone[r], PLAIN[r::2], strict=True))
        objs = list(PLAIN) if rank == 0 else [None] * len(PLAIN)
        dist.broadcast_object_list(objs, src=0, **kw)
        assert all(_same(x, y) for x, y in zip(objs, PLAIN, strict=True))
        gathered: list[Any] | None = [None, None] if rank == 1 else None
        dist.gather_object(PLAIN[rank], gathered, dst=1, **kw)
        if rank == 1:
            assert gathered is not None and _same(gathered[0], PLAIN[0]) and _same(gathered[1], PLAIN[1])
        out: list[Any] = [None]
        dist.scatter_object_list(out, PLAIN[:2] if rank == 0 else None, src=0, **kw)
        assert _same(out[0], PLAIN[rank])
        if rank == 0:
            dist.send_object_list(PLAIN, dst=1, **kw)
        else:
            got: list[Any] = [None] * len(PLAIN)
            assert dist.recv_object_list(got, src=0, **kw) == 0
            assert all(_same(x, y) for x, y in zip(got, PLAIN, strict=True))

    run_threads(body, 2, timeout=30)


def test_safe_serializer_runs_no_code_a_peer_chose(tmp_path: Path) -> None:
    """Rank 0 broadcasts a pickle that calls a function when loaded. With
    ``safe`` the receiver refuses it, naming the sender and the global;
    with ``pickle`` (torch's behaviour) the function runs."""
    marker = tmp_path / "ran"

    def body(rank: int, world: int) -> str | None:
        objs: list[Any] = [Hostile(str(marker))] if rank == 0 else [None]
        if rank == 0:
            dist.broadcast_object_list(objs, src=0)
            return None
        with pytest.raises(DistBackendError) as info:
            dist.broadcast_object_list(objs, src=0, serializer="safe")
        return str(info.value)

    results = run_threads(body, 2, timeout=30)
    assert not marker.exists(), "the safe serializer ran the sender's code"
    assert "object from rank 0 cannot be deserialized" in results[1] and "_mark" in results[1], results[1]

    def trusting(rank: int, world: int) -> None:
        objs: list[Any] = [Hostile(str(marker))] if rank == 0 else [None]
        dist.broadcast_object_list(objs, src=0, serializer="pickle")
        if rank == 1:
            assert objs == ["owned"]

    run_threads(trusting, 2, timeout=30)
    assert marker.exists()


# --- forged sizes and bytes: a peer issues the raw collectives with values of its choosing -------------

FORGED = [-5, 1 << 40, 2**63 - 1]


@pytest.mark.parametrize("size", FORGED)
def test_forged_sizes_raise_naming_the_sender_before_allocating(size: int) -> None:
    def body(rank: int, world: int) -> list[str]:
        errors = []
        # broadcast_object_list: the source's sizes
        if rank == 0:
            dist.broadcast(np.array([size], np.int64), src=0)
        else:
            with pytest.raises(DistBackendError) as info:
                dist.broadcast_object_list([None], src=0)
            errors.append(str(info.value))
        # all_gather_object: rank 0's size in the first all_gather
        if rank == 0:
            dist.all_gather([np.zeros(1, np.int64), np.zeros(1, np.int64)], np.array([size], np.int64))
        else:
            with pytest.raises(DistBackendError) as info:
                dist.all_gather_object([None, None], "fine")
            errors.append(str(info.value))
        # recv_object_list: the sender's sizes
        if rank == 0:
            dist.send(np.array([size], np.int64), dst=1)
        else:
            with pytest.raises(DistBackendError) as info:
                dist.recv_object_list([None], src=0)
            errors.append(str(info.value))
        # scatter_object_list: the source's longest size
        if rank == 0:
            dist.broadcast(np.array([size], np.int64), src=0)
        else:
            with pytest.raises(DistBackendError) as info:
                dist.scatter_object_list([None], None, src=0)
            errors.append(str(info.value))
        _healthy(rank)
        return errors

    errors = run_threads(body, 2, timeout=30)[1]
    assert len(errors) == 4
    for text in errors:
        assert f"rank 0 announced an object of {size} bytes" in text and "NCCL_PG_OBJECT_MAX_BYTES" in text, text


def test_corrupt_bytes_raise_naming_the_sender() -> None:
    def body(rank: int, world: int) -> str | None:
        blob = np.frombuffer(b"\x80\x05garbage!", np.uint8)
        if rank == 0:
            dist.send(np.array([blob.size], np.int64), dst=1)
            dist.send(blob.copy(), dst=1)
            return None
        with pytest.raises(DistBackendError) as info:
            dist.recv_object_list([None], src=0)
        return str(info.value)

    text = run_threads(body, 2, timeout=30)[1]
    assert text is not None and "object from rank 0 cannot be deserialized" in text, text


def test_objects_over_the_limit_are_refused_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_PG_OBJECT_MAX_BYTES", "1000")

    def body(rank: int, world: int) -> None:
        with pytest.raises(DistBackendError, match=r"rank 1 announced an object of \d+ bytes; expected 0..1000"):
            dist.all_gather_object([None, None], b"x" * (5000 if rank == 1 else 10))
        _healthy(rank)

    run_threads(body, 2, timeout=30)


def test_custom_serializer_and_bad_choices() -> None:
    class Json:
        def dumps(self, obj: Any) -> bytes:
            return json.dumps(obj).encode()

        def loads(self, data: bytes) -> Any:
            return json.loads(data)

    def body(rank: int, world: int) -> None:
        everyone: list[Any] = [None, None]
        dist.all_gather_object(everyone, {"rank": rank}, serializer=Json())
        assert everyone == [{"rank": 0}, {"rank": 1}]
        with pytest.raises(ValueError, match="unknown serializer 'yaml'"):
            dist.all_gather_object(everyone, 1, serializer="yaml")
        with pytest.raises(TypeError, match="dumps"):
            dist.all_gather_object(everyone, 1, serializer=object())  # type: ignore[arg-type]
        _healthy(rank)

    run_threads(body, 2, timeout=30)
    with pytest.raises(ValueError, match="NCCL_PG_OBJECT_SERIALIZER"):
        env.validate_all({"NCCL_PG_OBJECT_SERIALIZER": "marshal"})

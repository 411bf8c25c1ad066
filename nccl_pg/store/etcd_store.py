"""EtcdStore: the Store API on an etcd cluster (v3 API), for jobs whose store
must outlive any of their machines (docs/STORES.md, "EtcdStore").

Layout under ``/nccl_pg/<job>/``, so that jobs share a cluster:

- ``v/<key>``: the value of ``key``;
- ``q/<hex of key>/<id>``: the items of the queue ``key``, oldest first by
  creation revision;
- ``b/<hex of key>/<id>``: the arrivals at barrier ``key``; ``b/<hex of key>``
  is its release;
- ``m/<hex of key>/<writer>``: the marker of one writer (a thread of a
  client) for ``key``: the id of the last conditional write it applied.

In hex a key's queue (or barrier) is a range that no other key's contains,
and hex keeps the order of keys, so a range of keys maps to a range of queues.

**Markers** make every conditional write safe to send twice, which failover
does when a member is lost in flight (etcd_client.py): the write puts the
writer's marker with a fresh id in the same transaction, and its failure
branch reads the marker back. A resend that fails its comparison because the
first attempt was applied finds its own id there, and answers as the first
attempt would have.

A blocking call reads, and when something is missing it watches the missing
keys from the revision it read at: nothing set in between is missed and
nothing polls (a parked wait is one watch whatever it lasts). add, append,
compare_set and the queue operations are transactions (compare-and-swap
where etcd has no atomic operation of its own).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..errors import DistStoreError, QueueEmptyError
from ..timeouts import Timeout, to_seconds
from .base import (
    COUNTED_PREFIX,
    HIDDEN_PREFIX,
    Backoff,
    OwnParking,
    Parking,
    Store,
    Value,
    added,
    check_amount,
    check_key,
    check_keys,
    check_multi_set,
    check_world_size,
    timeout_error,
    to_bytes,
)
from .etcd_client import EtcdClient, Json, StreamLost, b64, unb64
from .etcd_wire import READS_PER_TXN

# etcd's default --max-txn-ops: larger batches are split (reads at one revision, so still one snapshot).
_MAX_TXN_OPS = 128
# The requests inside a blocking call may take this long past its deadline (as TCPStore's answer grace).
_GRACE = 5.0
_MIN_VERSION = (3, 4)  # the gateway's /v3/ paths
T = TypeVar("T")


def _range_end(prefix: bytes) -> bytes:
    """The end of the range of the keys that start with ``prefix`` (which ends with "/")."""
    return prefix[:-1] + bytes((prefix[-1] + 1,))


def _put(key: bytes, value: bytes) -> Json:
    return {"request_put": {"key": b64(key), "value": b64(value)}}


def _range(key: bytes, end: bytes | None = None, **options: object) -> Json:
    request: Json = {"key": b64(key), **options}
    if end is not None:
        request["range_end"] = b64(end)
    return {"request_range": request}


def _delete(key: bytes, end: bytes | None = None) -> Json:
    request = {"key": b64(key)}
    if end is not None:
        request["range_end"] = b64(end)
    return {"request_delete_range": request}


def _equal(key: bytes, target: str, value: int | bytes) -> Json:
    field = {"VERSION": "version", "CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value"}[target]
    return {"key": b64(key), "result": "EQUAL", "target": target,
            field: b64(value) if isinstance(value, bytes) else value}


def _responses(answer: Json) -> list[Json]:
    """The answers of a transaction's operations (each the only value of its dict)."""
    return [next(iter(r.values()), {}) for r in answer.get("responses", [])]


def _applied(response: Json, op: bytes) -> bool:
    """The failure branch's read of the marker found ``op``: this is a resend of
    an attempt that was applied (see "Markers")."""
    kv = _first(response)
    return kv is not None and unb64(kv.get("value", "")) == op


def _count(response: Json) -> int:
    return int(response.get("count", 0))


def _first(response: Json) -> Json | None:
    kvs = response.get("kvs")
    return kvs[0] if kvs else None


def _shaped(method: Callable[..., T]) -> Callable[..., T]:
    """A public operation whose reading of etcd's answers found a field
    missing or of another type (the client checks the types it knows; this
    catches the rest): DistStoreError naming the store, never a KeyError."""

    @functools.wraps(method)
    def run(self: EtcdStore, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except (KeyError, IndexError, AttributeError) as exc:
            raise DistStoreError(f"{self!r}.{method.__name__}: an etcd member of {self._client.address} answered "
                                 f"in a shape etcd does not ({type(exc).__name__}: {exc}); member in use: "
                                 f"{self._client.names[self._client.current]}") from None

    return run


def check_job(job: object) -> str:
    if not isinstance(job, str):
        raise TypeError(f"etcd job name must be str, got {type(job).__name__}")
    if not job or "/" in job or not job.isprintable():
        raise ValueError(f"etcd job name {job!r}: expected a non-empty name without '/' or control characters")
    check_key(job)
    return job


class EtcdStore(Store):
    """A store on the etcd cluster whose members are ``endpoints``
    (``"host:port,host:port"`` or a list), in the namespace of ``job``.

    Every call has a deadline: ``timeout`` for waits, and for any request
    (connecting included; ``connect_timeout`` for the constructor's first
    contact, default ``timeout``). A member that dies is left for the next
    one. etcd >= 3.4 without TLS or authentication.
    """

    def __init__(self, endpoints: str | Sequence[str], job: str, timeout: Timeout = 300.0, *,
                 connect_timeout: Timeout | None = None) -> None:
        super().__init__(timeout)
        self.job = check_job(job)
        self.connect_timeout = self.timeout if connect_timeout is None else to_seconds(connect_timeout,
                                                                                        "connect_timeout")
        self._client = EtcdClient(endpoints)
        root = b"/nccl_pg/" + job.encode() + b"/"
        self._values, self._queues, self._barriers, self._markers = (root + b"v/", root + b"q/", root + b"b/",
                                                                     root + b"m/")
        self._closed = False
        try:
            answer = self._client.version(time.monotonic() + self.connect_timeout)
            version = str(answer.get("etcdserver", ""))
            try:
                numbers = tuple(int(p) for p in version.split(".")[:2])
            except ValueError:
                numbers = ()
            if numbers < _MIN_VERSION:
                raise DistStoreError(f"{self!r}: the cluster answered {answer!r}; EtcdStore needs etcd >= 3.4")
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"EtcdStore({self._client.address}/{self.job})"

    @property
    def requests(self) -> int:
        """Requests this store and its clones sent (watches included), for tests and benchmarks."""
        return self._client.requests

    def local_address(self) -> str:
        """This host's address on its connection to the cluster: the interface
        that reaches the other hosts (the host backend publishes it)."""
        if self._closed:
            raise DistStoreError(f"{self!r} is closed")
        return self._client.local_address(time.monotonic() + self._timeout)

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> EtcdStore:
        """Another EtcdStore object on the same connections."""
        other = object.__new__(EtcdStore)
        other.__dict__.update(self.__dict__)
        other._closed = False
        self._client.share()
        return other

    def parking(self) -> Parking:
        """A wait on connections of its own (one watch however long it
        parks), which ``close()`` ends at once without disturbing the calls
        of other threads."""
        other = object.__new__(EtcdStore)
        other.__dict__.update(self.__dict__)
        other._closed = False
        other._client = EtcdClient(self._client.names)
        return OwnParking(other)

    def close(self) -> None:
        """Release this object's share of the connections (the last user closes them)."""
        if self._closed:
            return
        self._closed = True
        self._client.release()

    # --- requests ------------------------------------------------------------------

    def _request(self, path: str, payload: Json, what: str, deadline: float | None = None) -> Json:
        if self._closed:
            raise DistStoreError(f"{self!r} is closed")
        deadline = time.monotonic() + self._timeout if deadline is None else deadline
        return self._client.request(path, payload, deadline, what)

    def _txn(self, what: str, success: list[Json], compare: Sequence[Json] = (), failure: Sequence[Json] = (),
             deadline: float | None = None) -> Json:
        return self._request("kv/txn", {"compare": list(compare), "success": success, "failure": list(failure)},
                             what, deadline)

    def _reads(self, ranges: list[Json], what: str, deadline: float, per: int = READS_PER_TXN) -> tuple[int, list[Json]]:
        """Range requests in transactions of at most ``per`` (of values:
        READS_PER_TXN, so that an answer stays under etcd_wire.MAX_ANSWER),
        all at one revision; returns it and the answers."""
        revision, out = 0, []
        for i in range(0, len(ranges), per):
            chunk = ranges[i:i + per]
            if revision:
                chunk = [{"request_range": {**r["request_range"], "revision": revision}} for r in chunk]
            answer = self._txn(what, chunk, deadline=deadline)
            revision = revision or int(answer["header"]["revision"])
            out.extend(_responses(answer))
        return revision, out

    def _vkey(self, key: str) -> bytes:
        return self._values + key.encode()

    def _queue(self, key: str) -> bytes:
        return self._queues + key.encode().hex().encode() + b"/"

    def _mark(self, key: str) -> tuple[Json, Json, bytes]:
        """For a conditional write on ``key``: the put of this writer's marker
        with a fresh id, the read of it (for the failure branch), and the id."""
        marker = (self._markers + key.encode().hex().encode() + b"/"
                  + f"{self._client.ident}-{threading.get_ident():x}".encode())
        op = os.urandom(8).hex().encode()
        return _put(marker, op), _range(marker), op

    def _name(self, etcd_key: bytes) -> str | None:
        """The store key whose value or queue item ``etcd_key`` is."""
        if etcd_key.startswith(self._values):
            return etcd_key[len(self._values):].decode(errors="replace")
        if etcd_key.startswith(self._queues):
            return bytes.fromhex(etcd_key[len(self._queues):].split(b"/", 1)[0].decode()).decode(errors="replace")
        return None

    # --- waiting -----------------------------------------------------------------------

    def _values_of(self, keys: list[str], what: str, deadline: float) -> tuple[int, dict[str, bytes]]:
        revision, answers = self._reads([_range(self._vkey(k)) for k in keys], what, deadline)
        return revision, {k: unb64(kv.get("value", "")) for k, a in zip(keys, answers, strict=True)
                          if (kv := _first(a)) is not None}

    def _present(self, keys: list[str], what: str, deadline: float) -> tuple[int, set[str]]:
        """Keys with a value or a non-empty queue (what check and wait look for)."""
        ranges = []
        for k in keys:
            queue = self._queue(k)
            ranges += [_range(self._vkey(k), count_only=True), _range(queue, _range_end(queue), count_only=True,
                                                                      limit=1)]
        revision, answers = self._reads(ranges, what, deadline, _MAX_TXN_OPS)  # counts only: small answers
        return revision, {k for i, k in enumerate(keys) if _count(answers[2 * i]) or _count(answers[2 * i + 1])}

    def _await(self, watches: list[tuple[bytes, bytes]], name_of: Callable[[bytes], str | None], missing: list[str],
               revision: int, deadline: float, where: str, keys: list[str], start: float) -> set[str]:
        """Watch the ranges ``watches`` from ``revision + 1`` until each of
        ``missing`` had a put (``name_of`` maps an etcd key to the store key it
        serves). Returns those seen: all of them, unless a watch ended early
        (then the caller reads again, on another member if need be)."""
        what = f"{where}({keys!r})"
        streams = []
        seen: set[str] = set()
        try:
            for lo, hi in watches:
                streams.append(self._client.watch(lo, hi, revision + 1, deadline + _GRACE, what))
            while len(seen) < len(missing):
                events = self._client.wait_events(streams, deadline)
                if not events:
                    raise timeout_error(where, keys, [k for k in missing if k not in seen],
                                        time.monotonic() - start)
                seen.update(name for e in events if e.put and (name := name_of(e.key)) in missing)
        except StreamLost:
            pass
        finally:
            for stream in streams:
                self._client.end_watch(stream)
        return seen

    def _key_watches(self, missing: list[str], values: bool, queues: bool) -> list[tuple[bytes, bytes]]:
        """One watch over the values of ``missing`` and one over their queues
        (the ranges from the least to the greatest of them)."""
        lo, hi = min(missing), max(missing)
        out = []
        if values:
            out.append((self._vkey(lo), self._vkey(hi) + b"\x00"))
        if queues:
            out.append((self._queue(lo), _range_end(self._queue(hi))))
        return out

    def _get(self, keys: list[str], op: str) -> list[bytes]:
        start = time.monotonic()
        deadline = start + self._timeout
        unique = list(dict.fromkeys(keys))
        where, what = f"{self!r}.{op}", f"{op}({keys!r})"
        backoff = Backoff(deadline)
        while True:
            revision, values = self._values_of(unique, what, deadline + _GRACE)
            missing = [k for k in unique if k not in values]
            if not missing:
                return [values[k] for k in keys]
            if not self._await(self._key_watches(missing, True, False), self._name, missing, revision, deadline,
                               where, keys, start):
                backoff.sleep()  # a watch ended at once (its member lost): do not spin

    # --- operations ------------------------------------------------------------------

    @_shaped
    def set(self, key: str, value: Value) -> None:
        key = check_key(key)
        self._request("kv/put", _put(self._vkey(key), to_bytes(value, key))["request_put"], f"set({key!r})")

    @_shaped
    def get(self, key: str) -> bytes:
        return self._get([check_key(key)], "get")[0]

    @_shaped
    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = check_keys(keys)
        return self._get(keys, "multi_get") if keys else []

    @_shaped
    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """All or nothing: more keys than one transaction takes (etcd's
        --max-txn-ops) go in several, and when one fails, those applied
        before are undone (the previous values put back, new keys deleted,
        each only where nobody wrote since) before the error is raised."""
        keys, data = check_multi_set(keys, values)
        latest = dict(zip(keys, data, strict=True))  # etcd refuses a key twice in one transaction: the last wins
        items = [(self._vkey(k), v) for k, v in latest.items()]
        deadline = time.monotonic() + self._timeout
        what = f"multi_set({keys[:8]!r}{'...' if len(keys) > 8 else ''})"
        if len(items) <= _MAX_TXN_OPS:
            self._txn(what, [_put(k, v) for k, v in items], deadline=deadline)
            return
        applied: list[tuple[list[bytes], int, list[Json]]] = []  # (keys, revision, their put responses)
        try:
            for i in range(0, len(items), _MAX_TXN_OPS):
                chunk = items[i:i + _MAX_TXN_OPS]
                answer = self._txn(what, [{"request_put": {**_put(k, v)["request_put"], "prev_kv": True}}
                                          for k, v in chunk], deadline=deadline)
                applied.append(([k for k, _ in chunk], int(answer["header"]["revision"]), _responses(answer)))
        except BaseException as exc:
            left = self._undo(applied, what, deadline + _GRACE)
            if left:
                raise DistStoreError(f"{what} on {self!r} failed ({exc}) and {len(left)} of the keys it had set "
                                     f"could not be put back (written again since, or the cluster failed): "
                                     f"{left[:8]!r}") from exc
            raise

    def _undo(self, applied: list[tuple[list[bytes], int, list[Json]]], what: str, deadline: float) -> list[str]:
        """Put back what ``multi_set``'s applied transactions replaced; the keys it could not."""
        left: list[str] = []
        for keys, revision, responses in applied:
            ops = []
            for k, r in zip(keys, responses, strict=True):
                prev = r.get("prev_kv")
                ops.append(_put(k, unb64(prev.get("value", ""))) if isinstance(prev, dict) else _delete(k))
            try:
                done = self._txn(f"undoing {what}", ops, [_equal(k, "MOD", revision) for k in keys],
                                 deadline=deadline).get("succeeded")
            except (DistStoreError, ValueError):
                done = False
            if not done:
                left += [k[len(self._values):].decode(errors="replace") for k in keys]
        return left

    @_shaped
    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        keys = check_keys(keys)
        seconds = self._deadline(timeout)
        start = time.monotonic()
        deadline = start + seconds
        unique = list(dict.fromkeys(keys))
        seen: set[str] = set()
        backoff = Backoff(deadline)
        while True:
            todo = [k for k in unique if k not in seen]
            if not todo:
                return
            revision, present = self._present(todo, f"wait({keys!r})", deadline + _GRACE)
            missing = [k for k in todo if k not in present]
            if not missing:
                return
            found = self._await(self._key_watches(missing, True, True), self._name, missing, revision, deadline,
                                f"{self!r}.wait", keys, start)
            if not found:
                backoff.sleep()
            seen |= found

    @_shaped
    def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        if not keys:
            return True
        unique = list(dict.fromkeys(keys))
        return len(self._present(unique, f"check({keys!r})", time.monotonic() + self._timeout)[1]) == len(unique)

    def _update(self, key: str, op: str, first: bytes, then: Callable[[bytes], bytes]) -> bytes:
        """Put ``first`` when the key has no value, else ``then(value)``, by
        compare-and-swap until it wins; returns what it put."""
        k = self._vkey(key)
        what = f"{op}({key!r})"
        start = time.monotonic()
        deadline = start + self._timeout
        mark, read_mark, op_id = self._mark(key)
        compare, new = _equal(k, "VERSION", 0), first
        attempts = 0
        while True:
            if attempts and time.monotonic() > deadline:
                raise DistStoreError(f"timeout: {op}({key!r}) on {self!r} lost its compare-and-swap to other "
                                     f"writers of the key {attempts} times in {time.monotonic() - start:.2f} s")
            attempts += 1
            answer = self._txn(what, [_put(k, new), mark], [compare], [_range(k), read_mark], deadline)
            current, marker = _responses(answer) if not answer.get("succeeded") else ({}, {})
            if answer.get("succeeded") or _applied(marker, op_id):
                return new
            kv = _first(current)
            if kv is None:  # deleted since
                compare, new = _equal(k, "VERSION", 0), first
            else:
                compare, new = _equal(k, "MOD", int(kv["mod_revision"])), then(unb64(kv.get("value", "")))

    @_shaped
    def add(self, key: str, amount: int) -> int:
        key, amount = check_key(key), check_amount(amount)
        return int(self._update(key, "add", str(amount).encode(), lambda old: str(added(key, old, amount)).encode()))

    @_shaped
    def append(self, key: str, value: Value) -> None:
        key = check_key(key)
        tail = to_bytes(value, key)
        self._update(key, "append", tail, lambda old: old + tail)

    @_shaped
    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        key = check_key(key)
        expected, desired = to_bytes(expected, key), to_bytes(desired, key)
        k = self._vkey(key)
        mark, read_mark, op_id = self._mark(key)
        write = [_put(k, desired), mark]
        # A missing key matches an empty ``expected`` (etcd's value comparison fails on a missing key: a
        # nested transaction creates it).
        current = ({"request_txn": {"compare": [_equal(k, "CREATE", 0)], "success": write, "failure": [_range(k)]}}
                   if expected == b"" else _range(k))
        answer = self._txn(f"compare_set({key!r})", write, [_equal(k, "VALUE", expected)], [current, read_mark])
        if answer.get("succeeded"):
            return desired
        inner, marker = _responses(answer)
        if _applied(marker, op_id):
            return desired
        if "responses" in inner:  # the nested transaction
            if inner.get("succeeded"):
                return desired
            inner = _responses(inner)[0]
        kv = _first(inner)
        return expected if kv is None else unb64(kv.get("value", ""))

    @_shaped
    def delete_key(self, key: str) -> bool:
        key = check_key(key)
        k, queue = self._vkey(key), self._queue(key)
        what = f"delete_key({key!r})"
        deadline = time.monotonic() + self._timeout
        mark, read_mark, op_id = self._mark(key)
        while True:  # read what is there, then delete it unless it changed meanwhile (so the answer is exact)
            _, (value, items) = self._reads([_range(k, keys_only=True), _range(queue, _range_end(queue), limit=1,
                                                                             keys_only=True)], what, deadline)
            there = _first(value) or _first(items)
            if there is None:
                return False
            answer = self._txn(what, [_delete(k), _delete(queue, _range_end(queue)), mark],
                               [_equal(unb64(there["key"]), "MOD", int(there["mod_revision"]))], [read_mark],
                               deadline)
            if answer.get("succeeded") or _applied(_responses(answer)[0], op_id):
                return True

    @_shaped
    def num_keys(self) -> int:
        hidden = self._values + HIDDEN_PREFIX.encode()
        answer = self._txn("num_keys()", [_range(self._values, _range_end(self._values), count_only=True),
                                                _range(hidden, _range_end(hidden), count_only=True)])
        everything, ours = (_count(r) for r in _responses(answer))
        return everything - ours

    @_shaped
    def list_keys(self) -> list[str]:
        answer = self._request("kv/range", _range(self._values, _range_end(self._values), keys_only=True)
                               ["request_range"], "list_keys()")
        names = [unb64(kv["key"])[len(self._values):].decode() for kv in answer.get("kvs", [])]
        return [k for k in names if not k.startswith((HIDDEN_PREFIX, COUNTED_PREFIX))]

    # --- queues ----------------------------------------------------------------------

    @_shaped
    def queue_push(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = to_bytes(value, key)
        mark, read_mark, op_id = self._mark(key)
        deadline = time.monotonic() + self._timeout
        while True:  # a fresh random name for the item; again in the unlikely case that it exists
            item = self._queue(key) + os.urandom(8).hex().encode()
            answer = self._txn(f"queue_push({key!r})", [_put(item, value), mark], [_equal(item, "CREATE", 0)],
                               [read_mark], deadline)
            if answer.get("succeeded") or _applied(_responses(answer)[0], op_id):
                return

    @_shaped
    def queue_pop(self, key: str, block: bool = True) -> bytes:
        key = check_key(key)
        queue = self._queue(key)
        what = f"queue_pop({key!r})"
        start = time.monotonic()
        deadline = start + self._timeout
        oldest = _range(queue, _range_end(queue), limit=1, sort_order="ASCEND", sort_target="CREATE")["request_range"]
        backoff = Backoff(deadline)
        mark, read_mark, op_id = self._mark(key)
        while True:
            answer = self._request("kv/range", oldest, what, deadline + _GRACE)
            kv = _first(answer)
            if kv is not None:
                item = unb64(kv["key"])
                taken = self._txn(what, [_delete(item), mark], [_equal(item, "MOD", int(kv["mod_revision"]))],
                                  [read_mark], deadline + _GRACE)
                if taken.get("succeeded") or _applied(_responses(taken)[0], op_id):
                    return unb64(kv.get("value", ""))
                continue  # another consumer took it
            if not block:
                raise QueueEmptyError(f"queue_pop({key!r}) on {self!r}: queue is empty")
            if not self._await(self._key_watches([key], False, True), self._name, [key],
                               int(answer["header"]["revision"]), deadline, f"{self!r}.queue_pop", [key], start):
                backoff.sleep()

    @_shaped
    def queue_len(self, key: str) -> int:
        key = check_key(key)
        queue = self._queue(key)
        return _count(self._request("kv/range", _range(queue, _range_end(queue), count_only=True)["request_range"],
                                    f"queue_len({key!r})"))

    @_shaped
    def barrier(self, key: str, world_size: int, timeout: Timeout | None = None) -> None:
        """As Store.barrier, in O(1) requests per caller: each arrival is a key
        of its own, counted in the same transaction (no contended counter)."""
        key, world_size, seconds = check_key(key), check_world_size(world_size), self._deadline(timeout)
        start = time.monotonic()
        deadline = start + seconds
        release = self._barriers + key.encode().hex().encode()
        arrivals = release + b"/"
        what = f"barrier({key!r})"
        me = arrivals + os.urandom(8).hex().encode()  # random: it exists only if we put it (a resend)
        counts = [_range(arrivals, _range_end(arrivals), count_only=True), _range(release, count_only=True)]
        answer = self._txn(what, [_put(me, b""), *counts], [_equal(me, "CREATE", 0)], counts, deadline + _GRACE)
        arrived, released = _responses(answer)[-2:]
        if _count(released):
            return
        if _count(arrived) >= world_size:
            self._request("kv/put", _put(release, b"1")["request_put"], what, deadline + _GRACE)
            return
        revision = int(answer["header"]["revision"])
        backoff = Backoff(deadline)
        while not self._await([(release, release + b"\x00")], lambda k: key if k == release else None, [key],
                              revision, deadline, f"{self!r}.barrier", [key], start):
            backoff.sleep()  # the watch ended early: read again
            revision, answers = self._reads([_range(release, count_only=True)], what, deadline + _GRACE)
            if _count(answers[0]):
                return

"""The ``safe`` serializer's loader: pickle data read by a small interpreter
of the opcodes plain data needs, which bounds what a payload may build.

The stdlib's unpickler trusts what a pickle says: it allocates the length a
header announces before reading the bytes (BINBYTES8 of 2**40), sizes its
memo by the index a PUT names, and whatever ``find_class`` allows is called
with the sender's arguments (``bytearray(2**30)`` in 46 bytes,
``numpy.ndarray((2**25,), object)`` in 91). Here ``pickletools.genops``
parses the opcodes (it reads each length's bytes, or fails, never
allocating more than the payload holds) and this module runs them:

- only the opcodes of plain data (protocols 2 to 5 without out-of-band
  buffers); any other opcode is refused, as is any global but a few
  constructors of plain data types;
- every object built is charged against ``limit`` bytes (its size as
  ``sys.getsizeof`` counts it, containers by their growth), and a
  constructor that allocates by a number it is given (bytearray(n), numpy
  arrays by shape and dtype, numpy scalars) is charged before it is called:
  a payload that would build more than ``limit`` bytes fails before it does
  (an array's data counts twice while numpy may copy it, once after if it
  did not);
- numpy arrays are only built the way numpy pickles them (``_reconstruct``
  then ``__setstate__``, or ``_frombuffer``), with the data's size checked
  against the shape first; a dtype's state is checked for consistency
  (fields inside the item, no field overlapping an object);
- shared references are kept shared (a memo reference is not a copy), but a
  result whose expansion -- every shared reference counted as a copy, as a
  printer or a JSON encoder would walk it -- has more than ``limit // 8``
  items is refused: sent unshared, it could not fit in ``limit``.

The interpreter's stack adds at most 8 bytes per byte of payload while it
runs. Loading costs about 12 times the C unpickler's time.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np


class PlainDataError(pickle.UnpicklingError):
    """The payload is not plain data, or would build more than allowed."""


# numpy's own pickle helpers, taken from what numpy's reduce returns (their modules are numpy's private ones).
_RECONSTRUCT: Any = np.zeros(1).__reduce__()[0]
_SCALAR: Any = np.float64(0).__reduce__()[0]
_FROMBUFFER: Any = np.zeros(1).__reduce_ex__(5)[0]

_BUILTINS = {"complex": complex, "set": set, "frozenset": frozenset, "bytearray": bytearray, "slice": slice}
_GLOBALS: dict[tuple[str, str], Any] = {
    **{(module, name): f for name, f in _BUILTINS.items() for module in ("builtins", "__builtin__")},  # 3 / 2
    ("collections", "OrderedDict"): OrderedDict,
    ("numpy", "dtype"): np.dtype, ("numpy", "ndarray"): np.ndarray,
    **{(module, "_reconstruct"): _RECONSTRUCT for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(module, "scalar"): _SCALAR for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(module, "_frombuffer"): _FROMBUFFER for module in ("numpy.core.numeric", "numpy._core.numeric")},
}
_DATA_OPS = frozenset({"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "BINFLOAT", "SHORT_BINUNICODE",
                       "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BYTEARRAY8"})
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_CONTAINERS = (list, tuple, dict, set, frozenset, slice)  # OrderedDict is a dict
_SLOT = 8  # bytes a list or tuple slot takes
_ENTRY = 48  # bytes a dict or set entry takes, at most, with its share of the table


def _shape(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(d) is int and d >= 0 for d in value):
        raise PlainDataError(f"{what}: shape {value!r:.80} is not a tuple of non-negative ints")
    return value


def _check_dtype(d: np.dtype) -> None:
    """A dtype built from a pickled state must be one numpy's constructor would make: fields inside the
    item, no field overlapping one that holds objects, a subarray as large as its item, and it says it
    holds objects exactly when it does (numpy takes that from the state's flags)."""
    if d.subdtype is not None:
        base, shape = d.subdtype
        if base.itemsize * math.prod(shape) != d.itemsize or base.hasobject != d.hasobject:
            raise PlainDataError(f"dtype {d!r:.80}: subarray of {base} {shape} in an item of {d.itemsize} bytes")
    if d.fields:
        if any(fd.hasobject for fd, *_ in d.fields.values()) != d.hasobject:
            raise PlainDataError(f"dtype {d!r:.80}: its flags say it holds no objects, its fields do")
        spans = sorted((offset, offset + fd.itemsize, fd.hasobject)
                       for fd, offset, *_ in d.fields.values())
        end, holds_objects = 0, False
        for start, stop, objects in spans:
            if start < 0 or stop > d.itemsize:
                raise PlainDataError(f"dtype {d!r:.80}: a field lies outside its {d.itemsize}-byte item")
            if start < end and (objects or holds_objects):
                raise PlainDataError(f"dtype {d!r:.80}: a field overlaps one that holds objects")
            if stop > end:
                end, holds_objects = stop, objects
            elif objects:
                holds_objects = True


class _Loader:
    def __init__(self, data: bytes, limit: int, limit_name: str) -> None:
        self.data, self.limit, self.left, self.limit_name = data, limit, limit, limit_name
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.shared = False  # a container was referenced twice (the expansion check is needed)

    def charge(self, nbytes: int, what: str | Callable[[], str]) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise PlainDataError(f"loading it would take more than {self.limit} bytes ({self.limit_name}), "
                                 f"at {what if isinstance(what, str) else what()}")

    def push(self, obj: Any) -> None:
        """A new object: charged at its size."""
        self.charge(sys.getsizeof(obj), lambda: type(obj).__name__)
        self.stack.append(obj)

    def pop(self) -> Any:
        if not self.stack or (self.marks and len(self.stack) == self.marks[-1]):
            raise PlainDataError("stack underflow")
        return self.stack.pop()

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise PlainDataError("no mark on the stack")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def top(self, kind: type | tuple[type, ...], op: str) -> Any:
        if not self.stack or (self.marks and len(self.stack) == self.marks[-1]):
            raise PlainDataError(f"{op} with nothing to apply it to")
        target = self.stack[-1]
        if type(target) not in (kind if isinstance(kind, tuple) else (kind,)):
            raise PlainDataError(f"{op} on a {type(target).__name__}: not plain data")
        return target

    def load(self) -> Any:
        stack, memo, getsizeof = self.stack, self.memo, sys.getsizeof
        for op, arg, _ in pickletools.genops(io.BytesIO(self.data)):
            name = op.name
            if name in _DATA_OPS:  # the most frequent opcodes first, inline
                if type(arg) is not int or not -5 <= arg <= 256:  # (small ints are cached by CPython: nothing new)
                    self.left -= getsizeof(arg)
                    if self.left < 0:
                        self.charge(0, type(arg).__name__)
                stack.append(arg)
            elif name == "MEMOIZE":
                memo[len(memo)] = self._top_any(name)
            elif name in ("BINGET", "LONG_BINGET"):
                if arg not in memo:
                    raise PlainDataError(f"memo entry {arg} read before it was written")
                obj = memo[arg]
                self.shared = self.shared or _is_container(obj)
                stack.append(obj)
            elif name in _CONSTANTS:
                stack.append(_CONSTANTS[name])
            elif name in ("BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = self._top_any(name)  # type: ignore[arg-type]
            elif name == "STOP":
                return self.pop()
            else:
                self.structure(name, arg)
        raise PlainDataError("no STOP opcode")  # genops raises first; kept for the type checker

    def _top_any(self, op: str) -> Any:
        if not self.stack or (self.marks and len(self.stack) == self.marks[-1]):
            raise PlainDataError(f"{op} with nothing to store")
        return self.stack[-1]

    def structure(self, name: str, arg: Any) -> None:
        stack = self.stack
        if name in ("PROTO", "FRAME"):
            return  # the whole payload is in memory: frames change nothing
        if name == "MARK":
            self.marks.append(len(stack))
        elif name == "POP":
            self.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            obj = self._top_any(name)
            self.shared = self.shared or _is_container(obj)
            stack.append(obj)
        elif name == "EMPTY_LIST":
            self.push([])
        elif name == "EMPTY_DICT":
            self.push({})
        elif name == "EMPTY_SET":
            self.push(set())
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = [self.pop() for _ in range(n)][::-1]
            self.push(tuple(items))
        elif name in ("TUPLE", "LIST", "FROZENSET"):
            items = self.pop_mark()
            self.charge(len(items) * (_SLOT if name != "FROZENSET" else _ENTRY), name.lower())
            self.push({"TUPLE": tuple, "LIST": list, "FROZENSET": frozenset}[name](items))
        elif name == "DICT":
            items = self.pop_mark()
            self.charge(len(items) // 2 * _ENTRY, "dict")
            self.push(dict(zip(items[::2], items[1::2], strict=True)))
        elif name in ("APPEND", "APPENDS"):
            items = [self.pop()] if name == "APPEND" else self.pop_mark()
            self.charge(len(items) * _SLOT, "list")
            self.top(list, name).extend(items)
        elif name in ("SETITEM", "SETITEMS"):
            items = [self.pop(), self.pop()][::-1] if name == "SETITEM" else self.pop_mark()
            if len(items) % 2:
                raise PlainDataError(f"{name} with an odd number of items")
            self.charge(len(items) // 2 * _ENTRY, "dict")
            target = self.top((dict, OrderedDict), name)
            for i in range(0, len(items), 2):
                target[items[i]] = items[i + 1]
        elif name == "ADDITEMS":
            items = self.pop_mark()
            self.charge(len(items) * _ENTRY, "set")
            self.top(set, name).update(items)
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
            else:
                attr, module = self.pop(), self.pop()
            found = _GLOBALS.get((module, attr)) if type(module) is str and type(attr) is str else None
            if found is None:
                raise PlainDataError(f"{module}.{attr} is not plain data; the safe serializer loads no other types "
                                     "(use serializer='pickle' among trusted ranks)")
            stack.append(found)
        elif name == "REDUCE":
            args = self.pop()
            func = self.pop()
            if type(args) is not tuple:
                raise PlainDataError("REDUCE arguments are not a tuple")
            self.push(self.call(func, args))
        elif name == "BUILD":
            state = self.pop()
            self.build(self._top_any(name), state)
        else:
            raise PlainDataError(f"opcode {name} is not part of plain data")

    # --- the constructors plain data needs, each charged before it allocates -------------------

    def call(self, func: Any, args: tuple) -> Any:
        if func is bytearray:
            if len(args) == 1 and type(args[0]) is int:
                self.charge(args[0], f"bytearray({args[0]})")
            elif len(args) == 1 and type(args[0]) in (bytes, bytearray, list, tuple):
                self.charge(len(args[0]), "bytearray")
            elif len(args) == 2 and type(args[0]) is str and type(args[1]) is str:
                self.charge(4 * len(args[0]), "bytearray")
            elif args:
                raise PlainDataError("bytearray() of something other than bytes, a list of ints or a size")
            return bytearray(*args)
        if func in (set, frozenset, OrderedDict):
            if args and (len(args) > 1 or type(args[0]) not in (list, tuple)):
                raise PlainDataError(f"{func.__name__}() of something other than a list")
            self.charge(len(args[0]) * _ENTRY if args else 0, func.__name__)
            return func(*args)
        if func is complex or func is slice:
            if len(args) > 3 or not all(type(a) in (int, float, type(None)) for a in args):
                raise PlainDataError(f"{func.__name__}() of something other than numbers")
            return func(*args)
        if func is np.dtype:  # a copy (the third argument), never numpy's shared instance, whose state BUILD sets
            if len(args) != 3 or type(args[0]) is not str or type(args[1]) is not bool or args[2] is not True:
                raise PlainDataError(f"numpy.dtype{args!r:.80}: not as numpy pickles a dtype")
            return np.dtype(*args)
        if func is _RECONSTRUCT:
            if len(args) != 3 or args[0] is not np.ndarray or type(args[2]) is not bytes:
                raise PlainDataError("numpy array not reconstructed as numpy pickles one")
            shape = _shape(args[1], "numpy array")
            self.charge(math.prod(shape) * np.dtype(args[2].decode("ascii")).itemsize, "numpy array")
            return func(*args)
        if func is _SCALAR:
            if len(args) not in (1, 2) or not isinstance(args[0], np.dtype):
                raise PlainDataError("numpy scalar not as numpy pickles one")
            dtype = args[0]
            if not dtype.hasobject and (len(args) != 2 or type(args[1]) is not bytes
                                        or len(args[1]) != dtype.itemsize):
                raise PlainDataError(f"numpy scalar of {dtype} without {dtype.itemsize} bytes of data")
            self.charge(dtype.itemsize, f"numpy scalar of {dtype}")
            return func(*args)
        if func is _FROMBUFFER:
            if len(args) != 4 or type(args[0]) not in (bytes, bytearray) or not isinstance(args[1], np.dtype):
                raise PlainDataError("numpy array not rebuilt from a buffer as numpy pickles one")
            shape = _shape(args[2], "numpy array")
            if args[1].hasobject or math.prod(shape) * args[1].itemsize != len(args[0]):
                raise PlainDataError(f"numpy array of shape {shape} and {args[1]} from {len(args[0])} bytes")
            return func(*args)
        raise PlainDataError(f"calling {getattr(func, '__name__', type(func).__name__)} is not plain data")

    def build(self, inst: Any, state: Any) -> None:
        if type(inst) is np.ndarray and type(state) is tuple and len(state) in (4, 5):
            shape, dtype, raw = (state[1], state[2], state[4]) if len(state) == 5 else (state[0], state[1], state[3])
            shape = _shape(shape, "numpy array")
            if not isinstance(dtype, np.dtype):
                raise PlainDataError("numpy array state without a dtype")
            n = math.prod(shape)
            if dtype.hasobject:
                if type(raw) is not list or len(raw) != n:
                    raise PlainDataError(f"numpy array of {n} objects with {len(raw) if type(raw) is list else 0}")
            elif type(raw) not in (bytes, bytearray) or len(raw) != n * dtype.itemsize:
                raise PlainDataError(f"numpy array of shape {shape} and {dtype} without {n * dtype.itemsize} bytes")
            self.charge(n * dtype.itemsize, f"numpy array of shape {shape} and {dtype}")
            inst.__setstate__(state)
            if inst.base is raw:  # numpy kept the bytes it was given rather than copy them
                self.left += n * dtype.itemsize
        elif isinstance(inst, np.dtype) and type(state) is tuple:
            dtype_state: Any = inst  # (numpy's stubs do not declare dtype.__setstate__)
            dtype_state.__setstate__(state)
            _check_dtype(inst)
        else:
            raise PlainDataError(f"setting the state of a {type(inst).__name__} is not plain data")

    # --- after loading ----------------------------------------------------------------------------

    def check_expansion(self, root: Any) -> None:
        """Count the items of ``root`` as a tree (each shared reference as a copy; a cycle's back
        reference as one item), without walking the tree: each container's count is computed once."""
        cap = max(self.limit // _SLOT, 1)
        count: dict[int, int] = {}  # containers only (all alive, held by root): ids are not reused
        todo: list[tuple[Any, bool]] = [(root, False)]
        while todo:
            obj, children_counted = todo.pop()
            if not children_counted:
                if id(obj) in count or not _is_container(obj):
                    continue
                count[id(obj)] = 1  # while in progress: a cycle back to it counts one
                todo.append((obj, True))
                todo.extend((k, False) for k in _children(obj))
                continue
            total = 1 + sum(count.get(id(k), 1) for k in _children(obj))
            if total > cap:
                raise PlainDataError(f"it expands to more than {cap} items ({self.limit_name} / {_SLOT}) when "
                                     "its shared references are counted as copies")
            count[id(obj)] = total


def _is_container(obj: Any) -> bool:
    return type(obj) in _CONTAINERS or isinstance(obj, dict) or (type(obj) is np.ndarray and obj.dtype.hasobject)


def _children(obj: Any) -> list[Any]:
    if type(obj) in (list, tuple, set, frozenset):
        return list(obj)
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if type(obj) is slice:
        return [obj.start, obj.stop, obj.step]
    if type(obj) is np.ndarray and obj.dtype.hasobject:
        flat = obj.reshape(-1)
        return list(flat) if obj.dtype.fields is None else [x for row in flat for x in row]
    return []


def loads(data: bytes, limit: int, limit_name: str = "the limit") -> Any:
    """The plain data in ``data``, building at most ``limit`` bytes (named
    ``limit_name`` in errors); raises PlainDataError (or the ValueError of a
    malformed pickle) otherwise."""
    loader = _Loader(data, limit, limit_name)
    result = loader.load()
    if loader.shared:
        loader.check_expansion(result)
    return result

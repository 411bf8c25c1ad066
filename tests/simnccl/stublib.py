"""The stub ``libnccl.so.2`` (stub/libnccl_stub.c): built with ``cc`` on first
use, cached under stub/build/<hash of source and flags>/ (git-ignored), and
loaded into this process so that the real nccl4py binding calls it instead of
NVIDIA's library.

How nccl4py 0.6.0 finds libnccl: at its first NCCL call it looks every
function up with ``dlsym(RTLD_DEFAULT, name)`` (the process's global scope)
and only for a name not found there loads a library with
``cuda.pathfinder.load_nvidia_dynamic_lib("nccl")``, which first checks for a
``libnccl.so.2`` already loaded. Loading the stub by absolute path with
``RTLD_GLOBAL`` (its soname is libnccl.so.2, and it defines every function the
binding looks up) satisfies both: the binding binds to the stub and NVIDIA's
library is never loaded. It binds once per process, so the stub must be loaded
before the first NCCL call (``load()`` refuses if another libnccl is already
loaded). Forked processes inherit it; spawned ones load it again
(``simnccl.install()``), from the cache.

While the simulation is not installed the stub passes every call on to the
real libnccl of this environment (the nvidia-nccl wheel), so a test process
that preloaded it still reaches real NCCL where a test wants it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).parent / "stub" / "libnccl_stub.c"
FLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-Wl,-soname,libnccl.so.2")
_BUILD_TIMEOUT = 120.0


class StubBuildError(RuntimeError):
    """``cc`` could not build the stub libnccl.so.2 (the message has its output)."""


def build() -> Path:
    """The stub's path, compiled now if this source and these flags have not been built before."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + "\0".join(FLAGS).encode()).hexdigest()[:16]
    out = SOURCE.parent / "build" / key / "libnccl.so.2"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".libnccl.so.2.{os.getpid()}.{threading.get_ident()}")  # concurrent builders never collide
    try:
        proc = subprocess.run(["cc", *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True,
                              timeout=_BUILD_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StubBuildError(f"cannot build the simnccl stub libnccl.so.2 from {SOURCE}: {exc}") from exc
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise StubBuildError(f"cc failed (exit {proc.returncode}) building the simnccl stub libnccl.so.2 from "
                             f"{SOURCE}:\n{proc.stdout}{proc.stderr}")
    os.replace(tmp, out)
    return out


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_py: ctypes.PyDLL | None = None
_keep: list[Any] = []  # the registered callbacks: the stub holds raw pointers to them


def _loaded_libnccl() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if os.path.basename(line.split()[-1]).startswith("libnccl.so")})


def real_libnccl() -> str | None:
    """The NVIDIA libnccl that nccl4py would load here: the nvidia-nccl wheel's, as cuda.pathfinder finds it first."""
    for entry in sys.path:
        candidate = Path(entry or ".") / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        if candidate.is_file():
            return str(candidate.resolve())
    return None


def load() -> ctypes.CDLL:
    """The stub, loaded into this process's global scope (once); raises where nccl4py may be bound to another libnccl."""
    global _lib, _py
    with _lock:
        if _lib is not None:
            return _lib
        path = build()
        others = [p for p in _loaded_libnccl() if not os.path.samefile(p, path)]
        if others:
            raise RuntimeError(f"another libnccl.so.2 is already loaded in this process ({', '.join(others)}): nccl4py "
                               "binds libnccl once per process, so the simnccl stub must be loaded before the first "
                               "NCCL call (simnccl.install() or simnccl.preload() first)")
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        py = ctypes.PyDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)  # simnccl_raise needs the GIL held
        for name, argtypes in (("simnccl_set", [ctypes.c_char_p, ctypes.c_void_p]), ("simnccl_mode", [ctypes.c_int]),
                               ("simnccl_passthrough", [ctypes.c_char_p])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        py.simnccl_raise.argtypes, py.simnccl_raise.restype = [ctypes.py_object], None
        real = real_libnccl()
        if real is not None and not os.path.samefile(real, path):
            lib.simnccl_passthrough(real.encode())
        _lib, _py = lib, py
        _register(lib, "missing", ctypes.CFUNCTYPE(None, ctypes.c_char_p)(_missing))
        import nccl.bindings.nccl as binding  # type: ignore[import-untyped]  # noqa: PLC0415

        bound = binding.get_library_path()
        if not os.path.samefile(bound, path):
            raise RuntimeError(f"nccl4py bound {bound}, not the simnccl stub {path}")
        return lib


def _register(lib: ctypes.CDLL, name: str, callback: Any) -> None:
    if lib.simnccl_set(name.encode(), ctypes.cast(callback, ctypes.c_void_p)) != 0:
        raise RuntimeError(f"the simnccl stub has no function {name}")
    _keep.append(callback)


def register(name: str, callback: Any) -> None:
    """Make ``callback`` (a ctypes CFUNCTYPE object) answer the stub's ``name`` while the simulation is installed."""
    _register(load(), name, callback)


def simulate(on: bool) -> None:
    """Route the stub's calls to the registered handlers (True) or to the real libnccl (False)."""
    load().simnccl_mode(int(on))


def raise_in_caller(exc: BaseException) -> None:
    """From inside a handler: the current NCCL call raises ``exc`` in the binding's caller."""
    assert _py is not None
    _py.simnccl_raise(exc)


def _missing(name: bytes) -> None:
    raise_in_caller(RuntimeError(
        f"{name.decode()}: libnccl.so.2 in this process is the simnccl stub, the simulation is not installed, and "
        "there is no NVIDIA libnccl to pass the call to (install nvidia-nccl-cu12 or -cu13)"))

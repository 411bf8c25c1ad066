"""The CUDA sources in the top-level ``kernels/`` folder, compiled with NVRTC
(cuda-python) for one GPU architecture at first use and cached on disk.

No nvcc is needed at run time: libnvrtc comes from the pip package
``nvidia-cuda-nvrtc`` (cu13) or ``nvidia-cuda-nvrtc-cu12``. A compiled image
is cached under ``NCCL_PG_KERNEL_CACHE`` in a file named by the source's
hash, the architecture and the NVRTC version, so an edited source, another
GPU or another NVRTC compiles afresh. Nothing here imports CUDA before a
compile is asked for.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from . import env

log = logging.getLogger(__name__)

NAN_CHECK = "nan_check.cu"
# Options are part of the cache key (they change the image).
_OPTIONS = ("-std=c++17", "--extra-device-vectorization")


def source_path(name: str) -> Path:
    """A kernel source: inside the installed package (wheels ship
    ``kernels/`` as ``nccl_pg/_kernels``), else the checkout's ``kernels/``."""
    here = Path(__file__).resolve().parent
    for folder in (here / "_kernels", here.parent / "kernels"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"CUDA source {name} not found in {here / '_kernels'} or {here.parent / 'kernels'}")


def _nvrtc() -> Any:
    from cuda.bindings import nvrtc  # noqa: PLC0415 - lazy by design

    return nvrtc


def _check(result: tuple, what: str) -> Any:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"NVRTC {what} failed: {getattr(err, 'name', err)}")
    return result[1] if len(result) == 2 else None


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded libnvrtc; raises RuntimeError naming the
    package to install when it is missing."""
    try:
        err, major, minor = _nvrtc().nvrtcVersion()
    except Exception as exc:
        raise RuntimeError(f"NVRTC could not be loaded ({type(exc).__name__}: {exc}); install nvidia-cuda-nvrtc "
                           "(CUDA 13) or nvidia-cuda-nvrtc-cu12 (the nccl_pg[cu13] / [cu12] extra)") from exc
    if int(err) != 0:
        raise RuntimeError(f"NVRTC nvrtcVersion failed: {getattr(err, 'name', err)}")
    return int(major), int(minor)


@functools.cache
def supported_archs() -> tuple[int, ...]:
    """Compute capabilities (e.g. 90 for sm_90) this NVRTC emits code for."""
    return tuple(int(a) for a in _check(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def compile_source(name: str, arch: str) -> bytes:
    """Compile ``name`` for ``arch``: "sm_90" gives a cubin, "compute_90" PTX
    (which the driver compiles for a GPU newer than this NVRTC knows)."""
    nvrtc = _nvrtc()
    nvrtc_version()
    src = source_path(name).read_bytes()
    prog = _check(nvrtc.nvrtcCreateProgram(src, name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in _OPTIONS)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            text = b" " * int(size)
            nvrtc.nvrtcGetProgramLog(prog, text)
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n{text.decode(errors='replace')}")
        ptx = arch.startswith("compute_")
        get_size, get = (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx else (nvrtc.nvrtcGetCUBINSize,
                                                                                 nvrtc.nvrtcGetCUBIN)
        size = _check(get_size(prog), "get image size")
        image = b" " * int(size)
        _check(get(prog, image), "get image")
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def arch_for(capability: int) -> str:
    """What to compile for a GPU of compute capability ``capability`` (e.g.
    90): its own cubin when this NVRTC knows it, else PTX for the newest
    architecture it knows below it."""
    known = supported_archs()
    if capability in known:
        return f"sm_{capability}"
    older = [a for a in known if a < capability]
    if not older:
        raise RuntimeError(f"NVRTC {nvrtc_version()} cannot compile for compute capability {capability} "
                           f"(it knows {list(known)})")
    return f"compute_{max(older)}"


def cache_dir() -> Path:
    configured = env.KERNEL_CACHE.get()
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nccl_pg" / "kernels"


def cache_path(name: str, arch: str) -> Path:
    """Where the image of ``name`` for ``arch`` is cached: keyed by source
    hash, options, architecture and NVRTC version."""
    digest = hashlib.sha256(source_path(name).read_bytes() + " ".join(_OPTIONS).encode()).hexdigest()[:16]
    major, minor = nvrtc_version()
    suffix = "ptx" if arch.startswith("compute_") else "cubin"
    return cache_dir() / f"{Path(name).stem}-{digest}-{arch}-nvrtc{major}.{minor}.{suffix}"


def image(name: str, arch: str) -> bytes:
    """The compiled image, from the disk cache or compiled (then cached; a
    cache that cannot be written only costs a compile next time)."""
    path = cache_path(name, arch)
    try:
        return path.read_bytes()
    except OSError:
        pass
    data = compile_source(name, arch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a concurrent rank reads a whole image or none
    except OSError as exc:
        log.warning("nccl_pg: could not cache the compiled %s in %s: %s", name, path.parent, exc)
    return data

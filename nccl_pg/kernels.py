"""The CUDA sources in the top-level ``kernels/`` folder, compiled with NVRTC
(cuda-python) for one GPU architecture at first use and cached on disk.

No nvcc is needed at run time: libnvrtc comes from the pip package
``nvidia-cuda-nvrtc`` (cu13) or ``nvidia-cuda-nvrtc-cu12``. A compiled image
is cached under ``NCCL_PG_KERNEL_CACHE`` in a file named by the source's
hash, the architecture and the NVRTC version, so an edited source, another
GPU or another NVRTC compiles afresh. Nothing here imports CUDA before a
compile is asked for.

Which NVRTC: the one of the CUDA runtime's major (``select_nvrtc``). Code
from NVRTC X.y loads only on a driver for CUDA X or newer (NVIDIA, CUDA
Compatibility, "Minor Version Compatibility", table 1: CUDA 13.x needs a
driver >= 580, 12.x >= 525), and PTX from NVRTC X.y needs a driver for CUDA
X.y or newer (the driver JIT-compiles it; ``CUDA_ERROR_UNSUPPORTED_PTX_VERSION``
otherwise). Left to itself, cuda-pathfinder (which ``cuda.bindings.nvrtc``
loads libnvrtc through) takes the newest major it finds, so an install of
CUDA 12 that also holds CUDA 13's NVRTC would build code its CUDA 12 driver
refuses. ``check_loadable`` refuses such a pairing with a message that says
which NVRTC, which driver, and what to install.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import site
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import env

log = logging.getLogger(__name__)

NAN_CHECK = "nan_check.cu"
# Options are part of the cache key (they change the image).
_OPTIONS = ("-std=c++17", "--extra-device-vectorization")

# Where NVIDIA's wheels put each major's libnvrtc under site-packages: the folders cuda-pathfinder searches
# (cuda/pathfinder/_dynamic_libs/descriptor_catalog.py, "nvrtc": site_packages_linux); the file name says the major.
_WHEEL_DIRS = ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib")
# The pip package of each CUDA major's NVRTC (12 and 13: also nccl_pg's cu12 / cu13 extras).
PACKAGES = {13: "nvidia-cuda-nvrtc", 12: "nvidia-cuda-nvrtc-cu12", 11: "nvidia-cuda-nvrtc-cu11"}
# The oldest driver branch that runs code of each CUDA major (CUDA Compatibility, "Minor Version
# Compatibility", table 1: https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html).
MIN_DRIVER = {13: 580, 12: 525, 11: 450}


class KernelLoadError(RuntimeError):
    """The kernels cannot be compiled or loaded here; the message says why and what to install."""


@dataclass(frozen=True)
class Nvrtc:
    """The libnvrtc this process compiles with."""

    version: tuple[int, int]
    path: str  # the library file ("?" where it cannot be told)
    wanted: int  # the CUDA major it was chosen for (the runtime's)
    how: str  # how it came to be the one (for messages and `nccl-pg doctor`)

    def __str__(self) -> str:
        return f"NVRTC {self.version[0]}.{self.version[1]} ({self.path})"


_chosen: Nvrtc | None = None
_choose_lock = threading.Lock()


def _nvrtc() -> Any:
    from cuda.bindings import nvrtc  # noqa: PLC0415 - lazy by design

    return nvrtc


def _check(result: tuple, what: str) -> Any:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"NVRTC {what} failed: {getattr(err, 'name', err)}")
    return result[1] if len(result) == 2 else None


def _loaded_majors(majors: list[int]) -> list[int]:
    """Which of libnvrtc.so.<major> are in the process already (loaded by anyone)."""
    found = []
    for major in majors:
        try:
            ctypes.CDLL(f"libnvrtc.so.{major}", mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        found.append(major)
    return found


def _find(major: int) -> str | None:
    """libnvrtc.so.<major> in a wheel on the path (site-packages, PYTHONPATH), else None."""
    folders = [*sys.path, *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    for folder in dict.fromkeys(folders):
        for rel in _WHEEL_DIRS:
            candidate = Path(folder or ".") / rel / f"libnvrtc.so.{major}"
            if candidate.is_file():
                return str(candidate)
    return None


def _preload(path: str | None, major: int) -> bool:
    """Load libnvrtc.so.<major> (from ``path``, else the system's loader path: a CUDA toolkit install) with its
    builtins library beside it, as cuda-pathfinder would. True when it loaded."""
    try:
        ctypes.CDLL(path or f"libnvrtc.so.{major}", mode=os.RTLD_GLOBAL)
    except OSError:
        return False
    if path is not None:
        for builtins in sorted(Path(path).parent.glob(f"libnvrtc-builtins.so.{major}.*")):
            try:
                ctypes.CDLL(str(builtins), mode=os.RTLD_GLOBAL)
            except OSError as exc:  # NVRTC may still find it itself
                log.debug("nccl_pg: could not preload %s: %s", builtins, exc)
    return True


def _loaded_path(major: int) -> str:
    """The file of the loaded libnvrtc.so.<major>, from the process's memory map (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if Path(path).name.startswith(f"libnvrtc.so.{major}"):
                    return path
    except OSError:
        pass
    return "?"


def _load_version() -> tuple[int, int]:
    try:
        err, major, minor = _nvrtc().nvrtcVersion()
    except Exception as exc:
        raise KernelLoadError(f"NVRTC could not be loaded ({type(exc).__name__}: {exc}); install "
                              f"{PACKAGES[13]} (CUDA 13) or {PACKAGES[12]} (the nccl_pg[cu13] / [cu12] extra)") from exc
    if int(err) != 0:
        raise KernelLoadError(f"NVRTC nvrtcVersion failed: {getattr(err, 'name', err)}")
    return int(major), int(minor)


def select_nvrtc(cuda_major: int) -> Nvrtc:
    """The NVRTC to compile with: libnvrtc.so.<cuda_major> (the major of the
    CUDA runtime in use), loaded before ``cuda.bindings.nvrtc`` loads one:
    cuda-pathfinder returns a libnvrtc the process already holds before it
    searches (load_nvidia_dynamic_lib.py, ``_load_lib_no_cache``:
    ``check_if_already_loaded_from_elsewhere``). Where that major is not
    installed, what cuda-pathfinder finds is used, and ``check_loadable``
    judges it against the driver. A loaded library stays: the first call
    decides for the process, later ones return its choice."""
    global _chosen
    with _choose_lock:
        if _chosen is not None:
            return _chosen
        loaded = _loaded_majors(sorted({cuda_major, *PACKAGES}, reverse=True))
        if loaded:
            how = f"loaded in this process before nccl_pg chose (libnvrtc.so.{loaded[0]})"
        elif _preload(_find(cuda_major), cuda_major):
            how = f"chosen for the CUDA {cuda_major} runtime in use"
        else:
            how = (f"chosen by cuda-pathfinder, as no libnvrtc.so.{cuda_major} (the CUDA {cuda_major} runtime's) "
                   "is installed")
        version = _load_version()
        _chosen = Nvrtc(version, _loaded_path(version[0]), cuda_major, how)
        log.debug("nccl_pg: %s: %s", _chosen, how)
        return _chosen


def _runtime_major() -> int:
    """The CUDA major of cuda-bindings' runtime (it answers without a driver)."""
    import cuda.bindings  # noqa: PLC0415 - lazy by design
    from cuda.bindings import runtime  # noqa: PLC0415

    err, version = runtime.cudaRuntimeGetVersion()
    return int(version) // 1000 if int(err) == 0 else int(cuda.bindings.__version__.split(".")[0])


def nvrtc() -> Nvrtc:
    """The NVRTC in use: chosen for cuda-bindings' own runtime when nothing chose before."""
    return _chosen if _chosen is not None else select_nvrtc(_runtime_major())


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the libnvrtc in use; raises KernelLoadError naming the package to install when none loads."""
    return nvrtc().version


def check_loadable(nv: Nvrtc, driver_version: int, arch: str, runtime_version: int) -> None:
    """Raise KernelLoadError when what ``nv`` compiles for ``arch`` cannot load
    on a driver whose ``cudaDriverGetVersion()`` is ``driver_version`` (0: no
    driver), saying which NVRTC, which driver, and what to install.
    ``runtime_version``: ``cudaRuntimeGetVersion()`` of the runtime in use."""
    if driver_version <= 0:
        raise KernelLoadError(f"no CUDA driver is installed (cudaDriverGetVersion() = {driver_version}): the "
                              f"kernels compile with {nv}, but nothing can load them")
    major, minor = nv.version
    ptx = arch.startswith("compute_")
    need = major * 1000 + minor * 10 if ptx else major * 1000
    if driver_version >= need:
        return
    d_major, d_minor = driver_version // 1000, driver_version % 1000 // 10
    r_major = runtime_version // 1000
    if ptx:
        why = (f"PTX ({arch}) from NVRTC {major}.{minor} needs a driver for CUDA {major}.{minor} or newer (the "
               "driver compiles PTX and refuses an ISA version newer than it knows)")
        older = (f"install an NVRTC no newer than {d_major}.{d_minor} (pip install "
                 f"'{PACKAGES[d_major]}=={d_major}.{d_minor}.*')" if d_major in PACKAGES else None)
        newer = f"upgrade the driver to one for CUDA {major}.{minor} or newer"
    else:
        why = (f"code from NVRTC {major}.x needs a driver for CUDA {major} (R{MIN_DRIVER.get(major, '?')} or newer: "
               "NVIDIA's CUDA minor version compatibility)")
        older = (f"install the NVRTC of CUDA {d_major} (pip install {PACKAGES[d_major]})" if d_major in PACKAGES
                 else None)
        newer = f"upgrade the driver to R{MIN_DRIVER[major]} or newer" if major in MIN_DRIVER else \
            f"upgrade the driver to one for CUDA {major}"
    fixes = []
    if older is not None:
        fixes.append(older if r_major <= d_major else
                     f"use an install of CUDA {d_major}, since the CUDA {r_major} runtime in use needs a newer driver "
                     f"too (nccl_pg[cu{d_major}]: cuda-bindings {d_major}.x and {PACKAGES[d_major]})")
    fixes.append(newer)
    raise KernelLoadError(
        f"the kernels cannot load on this driver: {why}, and this driver supports CUDA {d_major}.{d_minor} "
        f"(cudaDriverGetVersion() = {driver_version}). In use: {nv}, {nv.how}; the CUDA runtime in use is "
        f"{r_major}.{runtime_version % 1000 // 10}. To fix: " + "; or ".join(fixes)
        + " (NCCL_PG_NAN_CHECK=off turns the NaN check off).")


def source_path(name: str) -> Path:
    """A kernel source: inside the installed package (wheels ship
    ``kernels/`` as ``nccl_pg/_kernels``), else the checkout's ``kernels/``."""
    here = Path(__file__).resolve().parent
    for folder in (here / "_kernels", here.parent / "kernels"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"CUDA source {name} not found in {here / '_kernels'} or {here.parent / 'kernels'}")


@functools.cache
def supported_archs() -> tuple[int, ...]:
    """Compute capabilities (e.g. 90 for sm_90) this NVRTC emits code for."""
    nvrtc()  # the library is chosen before cuda.bindings loads one
    return tuple(int(a) for a in _check(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def compile_source(name: str, arch: str) -> bytes:
    """Compile ``name`` for ``arch``: "sm_90" gives a cubin, "compute_90" PTX
    (which the driver compiles for a GPU newer than this NVRTC knows)."""
    nvrtc_version()  # the library is chosen before cuda.bindings loads one
    lib = _nvrtc()
    src = source_path(name).read_bytes()
    prog = _check(lib.nvrtcCreateProgram(src, name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in _OPTIONS)]
        (err,) = lib.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            size = _check(lib.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            text = b" " * int(size)
            lib.nvrtcGetProgramLog(prog, text)
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n{text.decode(errors='replace')}")
        ptx = arch.startswith("compute_")
        get_size, get = ((lib.nvrtcGetPTXSize, lib.nvrtcGetPTX) if ptx
                         else (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN))
        size = _check(get_size(prog), "get image size")
        image = b" " * int(size)
        _check(get(prog, image), "get image")
        return image
    finally:
        lib.nvrtcDestroyProgram(prog)


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

"""`nccl-pg doctor`: check the GPU stack under nccl_pg and report what works.

Probes, each isolated (one that fails or raises prints what failed, and the
others still run): nccl_pg and Python versions, the NCCL library (through
nccl4py), the CUDA driver and runtime versions and NVRTC (cuda.bindings),
the GPUs (name, memory, compute capability), P2P reachability between every
pair of GPUs, the NaN check's kernels (``kernels/nan_check.cu``) compiled by
the NVRTC the check would use and loaded on every GPU as the check loads them
(or exactly why they cannot load: no driver, a driver older than that NVRTC's
code, ...), a one-rank all_reduce on the host backend, and a one-rank
all_reduce on the NCCL backend on each GPU (each in its own process, with a
deadline).

Probes that need a GPU are skipped on a machine without one ("no GPU"), so
the command also runs, and passes, on CPU-only machines.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXIT_STATUS_HELP = "exit status: 0 when every probe that applies passes (skipped ones do not count), 1 otherwise"
OK, SKIP, FAIL, INFO = "ok", "skip", "FAIL", "info"
SANITY_TIMEOUT = 120.0  # seconds for one GPU's one-rank all_reduce, NCCL init included
DEFAULT_ARCH = "sm_80"  # what the kernels compile for where no GPU says which


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="also write every probe's result as JSON")
    p.add_argument("--no-sanity", action="store_true",
                   help="skip the one-rank all_reduce on each GPU (the slowest probe: NCCL init)")
    p.add_argument("--sanity-timeout", type=float, default=SANITY_TIMEOUT, metavar="S",
                   help=f"deadline of one GPU's sanity all_reduce, NCCL init included (default: {SANITY_TIMEOUT:g})")
    p.add_argument("--_sanity-device", dest="sanity_device", type=int, default=None, help=argparse.SUPPRESS)  # internal: the child


# What a probe returns: (status, detail) or (status, detail, data for the JSON report).
Outcome = tuple[str, str] | tuple[str, str, dict[str, Any]]


@dataclass
class Result:
    name: str
    status: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


class _Skip(Exception):
    """A probe that does not apply here."""


class Doctor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: list[Result] = []
        self.gpus: list[dict[str, Any]] = []
        self.gpu_error: str | None = None  # why there are no GPUs
        self.nccl_loaded = False
        self.nvrtc_ok = False

    def probe(self, name: str, fn: Callable[[], Outcome]) -> Result:
        try:
            status, detail, *data = fn()
            res = Result(name, status, detail, data[0] if data else {})
        except _Skip as exc:
            res = Result(name, SKIP, str(exc))
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            where = f" (at {Path(last.filename).name}:{last.lineno})" if last else ""
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            res = Result(name, FAIL, f"{type(exc).__name__}: {first}{where}")
        self.results.append(res)
        _print(res)
        return res

    # --- the probes ----------------------------------------------------------------

    def versions(self) -> Outcome:
        from .. import __version__

        return OK, f"{__version__} ({Path(__file__).resolve().parents[1]})"

    def python(self) -> Outcome:
        import numpy

        return OK, f"{platform.python_version()} ({sys.executable}), numpy {numpy.__version__}, {platform.platform()}"

    def array_libs(self) -> Outcome:
        found = []
        for mod in ("cupy", "torch", "jax", "ml_dtypes"):
            try:
                m = __import__(mod)
                found.append(f"{mod} {getattr(m, '__version__', '?')}")
            except Exception:
                found.append(f"{mod} -")
        return INFO, ", ".join(found)

    def nccl(self) -> Outcome:
        try:
            import nccl as nccl_pkg
            from nccl.bindings import nccl as nb
        except ImportError as exc:
            if not self.gpus:
                raise _Skip(f"nccl4py not importable ({exc}); needed only with a GPU") from None
            raise
        pkg = getattr(nccl_pkg, "__version__", None) or _dist_version("nccl4py")
        try:
            code = nb.get_version()
        except Exception as exc:
            if not self.gpus:  # the library ships with the cu12/cu13 extras, for GPU machines
                msg = str(exc).strip().splitlines()[0]
                raise _Skip(f"NCCL library not loadable ({msg}); needed only with a GPU "
                            f"(pip install 'nccl_pg[cu13]' or nvidia-nccl-cu12)") from None
            raise
        self.nccl_loaded = True
        major, minor, patch = (code // 10000, code // 100 % 100, code % 100) if code >= 10000 else \
            (code // 1000, code // 100 % 10, code % 100)
        nb.get_unique_id()  # the first thing a communicator needs; raises if NCCL cannot make one
        return OK, f"{major}.{minor}.{patch} (code {code}), nccl4py {pkg}, unique id ok", \
            {"version": f"{major}.{minor}.{patch}", "code": code}

    def driver(self) -> Outcome:
        from cuda.bindings import driver

        try:
            err, ver = driver.cuDriverGetVersion()
        except Exception as exc:  # no libcuda: no driver installed
            self.gpu_error = f"no CUDA driver ({str(exc).strip().splitlines()[0]})"
            raise _Skip(f"no GPU: {self.gpu_error}") from None
        _check(err, "cuDriverGetVersion")
        return OK, f"CUDA driver API {ver // 1000}.{ver % 1000 // 10} ({ver})", {"version": ver}

    def runtime(self) -> Outcome:
        import cuda.bindings

        ver = _runtime_version()
        return OK, f"CUDA runtime {ver // 1000}.{ver % 1000 // 10} ({ver}), cuda-bindings {cuda.bindings.__version__}"

    def nvrtc(self) -> Outcome:
        from .. import kernels

        try:  # the NVRTC the NaN check would use: that of the runtime's CUDA major
            nv = kernels.select_nvrtc(_runtime_version() // 1000)
        except kernels.KernelLoadError as exc:
            msg = str(exc).strip().splitlines()[0]
            if not self.gpus:  # CPU machines compile kernels only where the NVRTC wheel is installed (CI)
                raise _Skip(f"{msg}; needed with a GPU, and to compile kernels/") from None
            raise
        self.nvrtc_ok = True
        return OK, f"{nv}, {nv.how}", {"version": ".".join(map(str, nv.version)), "path": nv.path}

    def find_gpus(self) -> Outcome:
        if self.gpu_error:
            raise _Skip(f"no GPU: {self.gpu_error}")
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            self.gpu_error = f"cuInit: {_errname(err)}"
            raise _Skip(f"no GPU: {self.gpu_error}")
        err, count = driver.cuDeviceGetCount()
        _check(err, "cuDeviceGetCount")
        if count == 0:
            self.gpu_error = "the driver sees no device"
            raise _Skip("no GPU: the driver sees no device")
        lines = []
        attr = driver.CUdevice_attribute
        for i in range(count):
            err, dev = driver.cuDeviceGet(i)
            _check(err, "cuDeviceGet")
            err, name = driver.cuDeviceGetName(256, dev)
            _check(err, "cuDeviceGetName")
            name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
            err, mem = driver.cuDeviceTotalMem(dev)
            _check(err, "cuDeviceTotalMem")
            cc = []
            for a in (attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                      attr.CU_DEVICE_ATTRIBUTE_PCI_BUS_ID):
                err, v = driver.cuDeviceGetAttribute(a, dev)
                _check(err, "cuDeviceGetAttribute")
                cc.append(int(v))
            gpu = {"index": i, "name": name, "memory_GiB": round(int(mem) / 2**30, 1), "cc": f"{cc[0]}.{cc[1]}",
                   "pci_bus": cc[2]}
            self.gpus.append(gpu)
            lines.append(f"GPU {i}: {name}, {gpu['memory_GiB']} GiB, compute capability {gpu['cc']}")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return OK, f"{count} GPU(s)" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "") + \
            "".join(f"\n         {x}" for x in lines), {"gpus": self.gpus}

    def p2p(self) -> Outcome:
        if not self.gpus:
            raise _Skip("no GPU")
        if len(self.gpus) < 2:
            return OK, "one GPU: nothing to reach (several ranks on it use the socket transport)"
        from cuda.bindings import driver

        matrix = []
        for a in self.gpus:
            row = []
            for b in self.gpus:
                if a is b:
                    row.append("X")
                    continue
                err, can = driver.cuDeviceCanAccessPeer(a["index"], b["index"])
                _check(err, "cuDeviceCanAccessPeer")
                row.append("1" if can else "0")
            matrix.append(row)
        lines = ["     " + " ".join(f"{g['index']:>2}" for g in self.gpus)]
        lines += [f"  {g['index']:>2} " + " ".join(f"{x:>2}" for x in row) for g, row in zip(self.gpus, matrix, strict=True)]
        missing = sum(x == "0" for row in matrix for x in row)
        detail = ("every pair reachable" if not missing else f"{missing} pair(s) without P2P (NCCL goes through "
                  "host memory there)") + "".join(f"\n       {x}" for x in lines)
        return OK, detail, {"matrix": matrix}

    def kernels(self) -> Outcome:
        from .. import kernels
        from ..comm.nccl import _lib, nan

        if not self.nvrtc_ok:
            if not self.gpus:
                raise _Skip("not compiled: no NVRTC here (see the nvrtc probe)")
            raise RuntimeError("not compiled: NVRTC not loadable (see the nvrtc probe)")
        rt = _lib.cudart()
        driver = int(rt.cudaDriverGetVersion()[1] or 0)
        err, count = rt.cudaGetDeviceCount()
        if driver == 0 or int(err) != 0 or not count:  # compile only, and say why nothing loads them
            why = ("no CUDA driver (cudaDriverGetVersion() = 0)" if driver == 0 else
                   f"no GPU (cudaGetDeviceCount: {_errname(err) if int(err) else 0})")
            nv = kernels.nvrtc()
            size = len(kernels.compile_source(kernels.NAN_CHECK, DEFAULT_ARCH))
            raise _Skip(f"{kernels.NAN_CHECK} compiles with {nv} for {DEFAULT_ARCH} ({size} bytes); not loaded: {why}")
        reports = [nan.load_kernels(device) for device in range(int(count))]
        return OK, "\n         ".join(str(r) for r in reports), \
            {"loaded": [{"device": r.device, "arch": r.arch, "nvrtc": ".".join(map(str, r.nvrtc.version)),
                         "nvrtc_path": r.nvrtc.path, "driver": r.driver_version, "runtime": r.runtime_version,
                         "functions": r.functions} for r in reports]}

    def host_sanity(self) -> Outcome:
        import numpy as np

        import nccl_pg as dist
        from nccl_pg.store import HashStore

        if dist.is_initialized():
            raise _Skip("a default group exists in this process")
        t0 = time.perf_counter()
        dist.init_process_group("host", store=HashStore(), rank=0, world_size=1, timeout=30)
        try:
            x = np.arange(1024, dtype=np.float32)
            dist.all_reduce(x)
            if not np.array_equal(x, np.arange(1024, dtype=np.float32)):
                raise AssertionError("one-rank all_reduce changed the data")
        finally:
            dist.destroy_process_group()
        return OK, f"one-rank all_reduce on the host backend ({(time.perf_counter() - t0) * 1e3:.0f} ms)"

    def nccl_sanity(self, gpu: dict[str, Any]) -> Outcome:
        if not self.nccl_loaded:
            raise RuntimeError("NCCL library not loaded (see the nccl probe)")
        cmd = [sys.executable, "-m", "nccl_pg.cli.doctor", "--_sanity-device", str(gpu["index"])]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.args.sanity_timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timeout: no result after {self.args.sanity_timeout:g} s (hung NCCL init or "
                               "all_reduce?)") from None
        took = time.monotonic() - t0
        last = (proc.stdout.strip().splitlines() or [""])[-1]
        if proc.returncode == 0 and last.startswith("ok"):
            return OK, f"one-rank all_reduce on GPU {gpu['index']}: {last[2:].strip()} ({took:.1f} s with init)"
        err = [x for x in (proc.stderr.strip().splitlines() + proc.stdout.strip().splitlines()) if x.strip()]
        raise RuntimeError(f"exit code {proc.returncode}: {err[-1] if err else 'no output'}")

    # --- the run -------------------------------------------------------------------

    def run(self) -> int:
        print("nccl-pg doctor", flush=True)
        self.probe("nccl_pg", self.versions)
        self.probe("python", self.python)
        self.probe("array libs", self.array_libs)
        self.probe("cuda driver", self.driver)
        self.probe("gpus", self.find_gpus)
        self.probe("nccl", self.nccl)
        self.probe("cuda runtime", self.runtime)
        self.probe("nvrtc", self.nvrtc)
        self.probe("p2p", self.p2p)
        self.probe("kernels", self.kernels)
        self.probe("host sanity", self.host_sanity)
        if not self.gpus:
            self.probe("nccl sanity", _skipper(f"no GPU ({self.gpu_error or 'none found'})"))
        elif self.args.no_sanity:
            self.probe("nccl sanity", _skipper("--no-sanity"))
        else:
            for gpu in self.gpus:
                self.probe(f"nccl sanity {gpu['index']}", functools.partial(self.nccl_sanity, gpu))
        failed = [r for r in self.results if r.status == FAIL]
        passed = sum(r.status == OK for r in self.results)
        skipped = sum(r.status == SKIP for r in self.results)
        gpu_note = "" if self.gpus else " (no GPU: GPU probes skipped)"
        print(f"doctor: {passed} passed, {skipped} skipped, {len(failed)} failed{gpu_note}"
              + (f"; failed: {', '.join(r.name for r in failed)}" if failed else ""), flush=True)
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump({"results": [vars(r) for r in self.results], "failed": len(failed),
                           "gpus": len(self.gpus)}, f, indent=1)
        return 1 if failed else 0


def _skipper(reason: str) -> Callable[[], Outcome]:
    def fn() -> Outcome:
        raise _Skip(reason)

    return fn


def _print(r: Result) -> None:
    print(f"  [{r.status:^4}] {r.name:<14} {r.detail}", flush=True)


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "?"


def _errname(err: Any) -> str:
    return getattr(err, "name", str(err))


def _check(err: Any, what: str) -> None:
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {_errname(err)}")


def _runtime_version() -> int:
    """cudaRuntimeGetVersion() of the runtime nccl_pg uses (it answers without a driver)."""
    from ..comm.nccl import _lib

    err, ver = _lib.cudart().cudaRuntimeGetVersion()
    _check(err, "cudaRuntimeGetVersion")
    return int(ver)


def _sanity_child(device: int) -> int:
    """One-rank all_reduce through nccl_pg on one GPU; prints 'ok <detail>'."""
    import cupy
    import numpy as np

    import nccl_pg as dist
    from nccl_pg.store import HashStore

    cupy.cuda.Device(device).use()
    t0 = time.perf_counter()
    dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, timeout=60)
    try:
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        dist.all_reduce(x)
        work = dist.all_reduce(x, async_op=True)
        assert work is not None
        work.wait()
        cupy.cuda.runtime.deviceSynchronize()
        if not np.array_equal(x.get(), np.arange(1 << 20, dtype=np.float32)):
            print("wrong result: a one-rank sum must leave the data as it was")
            return 1
    finally:
        dist.destroy_process_group()
    print(f"ok 4 MiB float32 in place, correct ({(time.perf_counter() - t0) * 1e3:.0f} ms)", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "sanity_device", None) is not None:
        return _sanity_child(args.sanity_device)
    return Doctor(args).run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nccl-pg doctor", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

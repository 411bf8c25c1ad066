"""Throughput of the NaN check, against the read bandwidth of the same device
over the same buffer, and its overhead on an all_reduce; one run.

On a GPU (CuPy and the NCCL backend): for each dtype, the check kernel
(nccl_pg's ``find_nan`` on the caller's stream, timed with CUDA events) over
a ``--gib`` GiB buffer, against a CuPy sum over the same bytes (the read
bandwidth reference), a device-to-device copy of them (the device's copy
bandwidth: bytes copied per second, each read once and written once) and
PyTorch's ``torch.isnan(x).any()`` when torch with CUDA is installed; then a
``--mb`` MB float32 all_reduce on a world-size-1 NCCL group with the check
off, raise and async. Each dtype's figures are printed as they are measured
(to stderr), so a run cut short keeps them.

Without a GPU: the host backend's numpy check over the same buffer sizes,
against numpy reading the same bytes (``np.sum`` of a float64 view, the
fastest plain numpy read measured here), and the overhead on a ``--mb`` MB
all_reduce of two thread ranks; it says that the GPU figures need a GPU.

    python3 tools/bench_nan_check.py [--gib 1] [--mb 256] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nccl_pg as dist  # noqa: E402
from nccl_pg.comm import backends  # noqa: E402
from nccl_pg.comm.nan_scan import first_nan_of  # noqa: E402
from nccl_pg.group.options import Options  # noqa: E402

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
          "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
          "complex64": np.dtype(np.complex64)}


def best(fn: Callable[[], Any], reps: int) -> float:
    """Fastest of ``reps`` timed calls, after one warm-up (seconds)."""
    return min(_timed(fn, reps))


# ------------------------------------------------------------------ host -------------

def host_rows(nbytes: int, reps: int) -> list[dict[str, Any]]:
    buf = np.full(nbytes, 1, np.uint8)  # written: untouched np.zeros pages all map one zero page (cached)
    rows = []
    for name, dt in DTYPES.items():
        view = buf.view(dt)
        assert first_nan_of([view]) is None
        # The reference is taken next to each check: on a shared machine bandwidth drifts within a run.
        read = best(lambda: np.sum(buf.view(np.float64)), reps)
        check = best(lambda v=view: first_nan_of([v]), reps)
        rows.append({"dtype": name, "check_GBps": nbytes / check / 1e9, "read_GBps": nbytes / read / 1e9,
                     "ratio": read / check})
    return rows


def _host_allreduce(rank: int, world: int, count: int, reps: int) -> dict[str, float]:
    out = {}
    pg = dist._get_default_group()
    x = np.ones(count, np.float32)
    for mode in ("off", "raise", "async"):
        pg.set_nan_check(mode)
        dist.barrier()
        out[mode] = statistics.median(_timed(lambda: dist.all_reduce(x), reps))
    return out


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def host_allreduce(mb: int, reps: int) -> dict[str, float]:
    from nccl_pg.testing import run_threads

    return run_threads(_host_allreduce, 2, timeout=600, args=(mb * 2**20 // 4, reps))[0]


# ------------------------------------------------------------------ GPU --------------

def gpu_rows(nbytes: int, reps: int) -> list[dict[str, Any]]:
    import cupy as cp

    from nccl_pg.comm.nccl.array import DeviceArray
    from nccl_pg.comm.nccl.backend import NCCL

    raw = cp.zeros(nbytes, cp.uint8)
    dev = raw.device.id
    stream = cp.cuda.get_current_stream()

    def gpu_time(fn: Callable[[], Any]) -> float:
        fn()
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps

    read = gpu_time(lambda: raw.view(cp.float32).sum())
    dst = cp.empty_like(raw)
    copy = gpu_time(lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, raw.data.ptr, nbytes,
                                                        cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr))
    print(f"# reference: read {nbytes / read / 1e9:.1f} GB/s, copy {nbytes / copy / 1e9:.1f} GB/s (bytes copied)",
          file=sys.stderr, flush=True)
    torch = _torch_cuda()
    rows = []
    for name, dt in DTYPES.items():
        arr = DeviceArray(int(raw.data.ptr), nbytes // dt.itemsize, dt, dev, raw)
        scans: list[Any] = []
        check = gpu_time(lambda a=arr, out=scans: out.append(NCCL.find_nan([a], None, None)))
        for s in scans:
            s.wait(60)
            assert s.first() is None
            s.release(True)
        row = {"dtype": name, "check_GBps": nbytes / check / 1e9, "read_GBps": nbytes / read / 1e9,
               "ratio": read / check, "copy_GBps": nbytes / copy / 1e9, "torch_GBps": None}
        print(f"# {name}: check {row['check_GBps']:.1f} GB/s, {100 * row['ratio']:.0f}% of read",
              file=sys.stderr, flush=True)
        if torch is not None and hasattr(torch, name):
            t = torch.zeros(nbytes // dt.itemsize, dtype=getattr(torch, name), device=f"cuda:{dev}")
            try:
                torch.isnan(t).any()
                tstream = torch.cuda.current_stream()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(tstream)
                for _ in range(reps):
                    torch.isnan(t).any()
                e.record(tstream)
                e.synchronize()
                row["torch_GBps"] = nbytes / (s.elapsed_time(e) / 1e3 / reps) / 1e9
            except RuntimeError as exc:  # e.g. isnan not implemented for a float8 type
                row["torch_GBps"] = f"n/a ({str(exc).splitlines()[0][:60]})"
            del t
        rows.append(row)
    return rows


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def gpu_allreduce(mb: int, reps: int) -> dict[str, float]:
    import cupy as cp

    out = {}
    x = cp.ones(mb * 2**20 // 4, cp.float32)
    for mode in ("off", "raise", "async"):
        pg = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, Options(nan_check=mode, timeout=120), device_id=0)

        def op(pg: Any = pg) -> None:
            pg.allreduce(x).wait()
            cp.cuda.get_current_stream().synchronize()

        out[mode] = statistics.median(_timed(op, reps))
        pg.shutdown()
    return out


# ------------------------------------------------------------------ report -----------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="buffer size of the throughput rows (GiB)")
    ap.add_argument("--mb", type=int, default=256, help="all_reduce size for the overhead rows (MB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the results here")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    nbytes = int(args.gib * 2**30) // 16 * 16
    gpu = backends.gpu_count() > 0
    print(f"# NaN check, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}")
    if gpu:
        rows, ar, where = gpu_rows(nbytes, args.reps), gpu_allreduce(args.mb, args.reps), "GPU (NCCL backend)"
    else:
        print("# no GPU here: host backend (numpy) figures; the GPU figures need a GPU (make bench on a GPU machine)")
        rows, ar, where = host_rows(nbytes, args.reps), host_allreduce(args.mb, args.reps), "host backend (numpy)"
    print(f"\n{where}: check of a {nbytes / 2**30:.2f} GiB buffer, best of {args.reps}")
    print("| dtype | check GB/s | read GB/s (same buffer) | check / read |"
          + (" copy GB/s (bytes copied) | torch isnan().any() GB/s |" if gpu else ""))
    print("|---|---|---|---|" + ("---|---|" if gpu else ""))
    for r in rows:
        extra = ""
        if gpu:
            t = r["torch_GBps"]
            extra = f" {r['copy_GBps']:.1f} |" + (f" {t:.0f} |" if isinstance(t, float) else f" {t or 'no torch+CUDA'} |")
        print(f"| {r['dtype']} | {r['check_GBps']:.1f} | {r['read_GBps']:.1f} | {100 * r['ratio']:.0f}% |{extra}")
    world = "world size 1" if gpu else "2 thread ranks"
    print(f"\nall_reduce of {args.mb} MB float32, {world}, median of {args.reps} (s/op):")
    print("| NaN check | s/op | overhead |")
    print("|---|---|---|")
    for mode, t in ar.items():
        print(f"| {mode} | {t:.4f} | {100 * (t / ar['off'] - 1):+.1f}% |")
    if args.json:
        Path(args.json).write_text(json.dumps({"where": where, "bytes": nbytes, "rows": rows, "all_reduce": ar},
                                              indent=1))


if __name__ == "__main__":
    main()

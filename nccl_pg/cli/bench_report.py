"""Rank 0's report of `nccl-pg bench`: nccl-tests' bus bandwidth factors, the
table, the summary, the machine's description, --json and --plot."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np

from .bench_cases import REDUCING, ROOTED, Layout


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor (``src/*.cu`` ``*GetBw``)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


class Report:
    """Rank 0's table: the header now, a row per size, the summary and files at the end; ``device`` names
    rank 0's device."""

    def __init__(self, args: argparse.Namespace, n: int, modes: Sequence[str], device: str) -> None:
        self.args, self.n, self.modes = args, n, modes
        self.rows: list[dict[str, Any]] = []
        self.wrong_total = 0
        self.machine = machine_info(args.backend, device)
        a = args
        print(f"# nccl-pg bench: {a.op}, backend {a.backend}, {n} rank(s), {device}", flush=True)
        print(f"#  minBytes {a.minbytes} maxBytes {a.maxbytes} step: {a.stepfactor}(factor) warmup iters: "
              f"{a.warmup_iters} iters: {a.iters} validation: {int(a.check)} "
              f"{'overhead: 1 ' if a.overhead else ''}{'graph: 1 ' if a.graph else ''}type: {a.dtype} redop: {a.redop} root: {a.root}",
              flush=True)
        print(f"# nccl_pg {self.machine['nccl_pg']}, Python {self.machine['python']}, numpy "
              f"{self.machine['numpy']}, {self.machine['date']}", flush=True)
        print("#", flush=True)
        self.header()

    def header(self) -> None:
        if self.args.overhead:
            group = f"{'issue(us)':>9} {'p50':>7} {'p99':>7} {'time(us)':>9} {'#wrong':>6}"
            units = f"{'mean':>9} {'(us)':>7} {'(us)':>7} {'per op':>9} {'':>6}"
        else:
            group = f"{'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
            units = f"{'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
        width = len(group)
        lead = f"{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>6}"
        print("# " + " " * len(lead) + "".join(f"  {m:^{width}}" for m in self.modes))
        print("# " + lead + "".join(f"  {group}" for _ in self.modes))
        print("# " + f"{'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>6}" + "".join(f"  {units}"
                                                                                      for _ in self.modes),
              flush=True)

    def skipped(self, size: int) -> None:
        print(f"# {size} B: too small to split among {self.n} ranks, skipped", flush=True)

    def row(self, size: int, lay: Layout, dtype: np.dtype, per_rank: list[dict[str, Any]]) -> int:
        a, n = self.args, self.n
        nbytes = lay.nbytes(dtype.itemsize)
        root = a.root if a.op in ROOTED else -1
        line = f"  {nbytes:>12} {lay.count:>12} {a.dtype:>8} {a.redop if a.op in REDUCING else 'none':>6} {root:>6}"
        bad = 0
        for mode in self.modes:
            t = statistics.fmean(r[mode]["time_s"] for r in per_rank)  # nccl-tests' -a 1: mean over ranks
            algbw = nbytes / t / 1e9
            busbw = algbw * busbw_factor(a.op, n)
            wrong = sum(r[mode]["wrong"] for r in per_rank) if a.check else None
            bad += bool(wrong)
            self.wrong_total += wrong or 0
            row: dict[str, Any] = {"op": a.op, "backend": a.backend, "nranks": n, "mode": mode, "bytes": nbytes,
                                   "count": lay.count, "type": a.dtype, "redop": a.redop, "root": root,
                                   "iters": a.iters, "warmup": a.warmup_iters, "time_us": t * 1e6,
                                   "time_us_ranks": [r[mode]["time_s"] * 1e6 for r in per_rank],
                                   "algbw_GBps": algbw, "busbw_GBps": busbw, "wrong": wrong}
            wrong_s = "N/A" if wrong is None else str(wrong)
            if a.overhead:
                issue = {k: statistics.fmean(r[mode]["issue_us"][k] for r in per_rank)
                         for k in ("mean", "min", "p50", "p99")}
                row["issue_us"] = issue
                line += (f"  {issue['mean']:>9.2f} {issue['p50']:>7.2f} {issue['p99']:>7.2f} {t * 1e6:>9.2f} "
                         f"{wrong_s:>6}")
            else:
                line += f"  {t * 1e6:>9.2f} {algbw:>7.3f} {busbw:>7.3f} {wrong_s:>6}"
            self.rows.append(row)
        print(line, flush=True)
        return bad

    def finish(self) -> None:
        a = self.args
        big = [r["busbw_GBps"] for r in self.rows]
        if a.check:
            state = "OK" if self.wrong_total == 0 else "FAILED"
            print(f"# Out of bounds values : {self.wrong_total} {state}")
        else:
            print("# Out of bounds values : N/A (no --check)")
        if big:
            print(f"# Avg bus bandwidth    : {statistics.fmean(big):.4g} GB/s")
        print("#", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"machine": self.machine, "args": {k: v for k, v in vars(a).items() if k != "func"},
                           "results": self.rows}, f, indent=1)
            print(f"# wrote {a.json}", flush=True)
        if a.plot:
            plot(self.rows, a.plot, f"nccl-pg bench {a.op} ({a.backend}, {self.n} ranks, {a.dtype})")
            print(f"# wrote {a.plot}", flush=True)


def machine_info(backend: str, device: str) -> dict[str, Any]:
    from .. import __version__

    info: dict[str, Any] = {"nccl_pg": __version__, "python": platform.python_version(), "numpy": np.__version__,
                            "host": socket.gethostname(), "cpus": os.cpu_count(), "device": device,
                            "platform": platform.platform(),
                            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                            "command": "nccl-pg bench " + " ".join(sys.argv[1:]),  # one rank's settings
                            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "CUDA_VISIBLE"))
                                    and "SECRET" not in k}}
    if backend == "nccl":
        try:
            from nccl.bindings import nccl as nb

            code = nb.get_version()
            info["nccl"] = f"{code // 10000}.{code // 100 % 100}.{code % 100}"
        except Exception as exc:  # report, do not fail the run over it
            info["nccl"] = f"unknown ({exc.__class__.__name__})"
    return info


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in sorted({r["mode"] for r in rows}):
        mine = [r for r in rows if r["mode"] == mode]
        x = [r["bytes"] for r in mine]
        ax_t.plot(x, [r["time_us"] for r in mine], marker="o", label=mode)
        ax_bw.plot(x, [r["busbw_GBps"] for r in mine], marker="o", label=mode)
    for ax, label in ((ax_t, "time per op (µs)"), (ax_bw, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_t.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

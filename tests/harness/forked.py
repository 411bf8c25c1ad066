"""Run a scenario as a world of real processes, one per rank, the way the
seed suites' MultiProcessTestCase does (rendezvous over a FileStore).

Ranks are forked from a multiprocessing forkserver that has imported numpy,
nccl_pg and the scenario's module once, so a world of four costs a few tens
of milliseconds instead of four interpreter start-ups. ``backend="simnccl"``
runs the NCCL backend on the simulated bindings (tests/simnccl): each rank
installs the simulation, drives simulated GPU 1, makes its arrays with
simnccl.xp, and fails if the simulation recorded a violation. Each rank runs
``scenario(rank_ctx, **kwargs)`` and sends back its return value (or its
traceback); the parent then tells every rank to exit, so a rank that finished
early stays alive while its peers still talk to it. Every wait is bounded and
children left over are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

import nccl_pg as dist
from nccl_pg.comm import backends

_preloaded: set[str] = set()
SIM_DEVICE = 1  # the simulated GPU a simnccl rank drives


def nccl_unavailable_reason() -> str | None:
    """Why the NCCL variant of a test cannot run here (None: it can)."""
    if backends.gpu_count() == 0:
        return "needs a GPU"
    try:
        import cupy  # noqa: F401, PLC0415 - the scenarios make CuPy arrays
    except ImportError:
        return "the nccl scenarios need CuPy"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rank:
    """What a scenario gets: its rank, the world size, the backend, and
    helpers to rendezvous and to make arrays for the backend."""

    def __init__(self, rank: int, world_size: int, backend: str, path: str, tmp_dir: str, sim: bool = False) -> None:
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.path, self.tmp_dir, self.sim = path, tmp_dir, sim
        self._store: dist.FileStore | None = None

    @property
    def device(self) -> int:
        """The device this rank drives (ranks share GPU 0 on a GPU machine; simulated ranks drive GPU 1, so that
        a context created on GPU 0 by mistake is seen)."""
        if self.sim:
            return SIM_DEVICE
        return 0 if self.backend == "nccl" else self.rank

    def store(self) -> dist.FileStore:
        """The world's FileStore (one per process, as the seeds' ``FileStore(file_name, world_size)``)."""
        if self._store is None:
            self._store = dist.FileStore(self.path, self.world_size)
        return self._store

    def init(self, backend: Any = "default", **kwargs: Any) -> dist.ProcessGroup:
        """``init_process_group`` on the world's store; returns the default group."""
        dist.init_process_group(self.backend if backend == "default" else backend, store=self.store(),
                                rank=self.rank, world_size=self.world_size, **kwargs)
        return dist._get_default_group()

    def array(self, data: Any, dtype: Any = None) -> Any:
        """``data`` as an array of the backend (numpy on host, CuPy on GPU)."""
        a = np.asarray(data, dtype=dtype)
        if self.sim:
            from simnccl import xp  # noqa: PLC0415 - simulated runs only

            return xp.asarray(a)
        if self.backend == "nccl":
            import cupy  # noqa: PLC0415 - GPU runs only

            return cupy.asarray(a)
        return a

    def full(self, shape: Any, value: Any, dtype: Any = np.float32) -> Any:
        return self.array(np.full(shape, value, dtype=dtype))

    def host(self, a: Any) -> np.ndarray:
        """A backend array as numpy."""
        return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def _child(scenario: Callable[..., Any], rank: int, world_size: int, backend: str, path: str, tmp_dir: str,
           env: Mapping[str, str], kwargs: Mapping[str, Any], conn: mpc.Connection) -> None:
    code = 0
    try:
        # Every rank drives GPU 0: each process must look like its own host, unless NCCL >= 2.30 is told to
        # share the GPU (NCCL_MULTI_RANK_GPU_ENABLE=1, as backends.pick_gpu does).
        if backend == "nccl" and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "0") in ("", "0"):
            for name, value in {"NCCL_HOSTID": f"rank{rank}", **backends.SAME_GPU_ENV}.items():
                os.environ.setdefault(name, value)
        os.environ.update(env)
        sim = backend == "simnccl"
        if sim:
            import simnccl  # noqa: PLC0415

            simnccl.install()
            simnccl.select_device(SIM_DEVICE)  # what torch.cuda.set_device(local_rank) does in a real job
            backend = "nccl"
        try:
            value = scenario(Rank(rank, world_size, backend, path, tmp_dir, sim), **kwargs)
            if sim and simnccl.violations():
                raise AssertionError("the NCCL simulation recorded violations:\n" + "\n".join(simnccl.violations()))
            conn.send(("ok", value))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            code = 1
        conn.poll(None)  # stay alive (peers may still use this rank) until the parent says so, or is gone
    except BaseException:
        code = 2
    finally:
        os._exit(code)  # no atexit, no joining of backend threads


def _context(module: str, extra: str | None = None) -> mp.context.ForkServerContext:
    ctx = mp.get_context("forkserver")
    wanted = {"numpy", "ml_dtypes", "nccl_pg", __name__, module} | ({extra} if extra else set())
    if not wanted <= _preloaded:
        _preloaded.update(wanted)
        ctx.set_forkserver_preload(sorted(_preloaded))  # effective if the server is not started yet
    return ctx


def run_world(scenario: Callable[..., Any], world_size: int, tmp_path: Any, backend: str = "host",
              env: Mapping[str, str] | None = None, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
    """Run ``scenario`` on ``world_size`` processes; returns each rank's
    result, or raises AssertionError with every failing rank's traceback."""
    ctx = _context(scenario.__module__, "simnccl" if backend == "simnccl" else None)
    tmp_dir = str(tmp_path)
    path = os.path.join(tmp_dir, f"store.{time.monotonic_ns()}")
    procs: list[mp.process.BaseProcess] = []
    conns: list[mpc.Connection] = []
    results: dict[int, tuple[str, Any]] = {}
    try:
        for rank in range(world_size):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_child, name=f"rank{rank}", daemon=True,
                            args=(scenario, rank, world_size, backend, path, tmp_dir, dict(env or {}), kwargs,
                                  theirs))
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(mine)
        deadline = time.monotonic() + timeout
        by_conn = {c: r for r, c in enumerate(conns)}
        waiting = list(conns)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for c in mpc.wait(waiting, timeout=left):
                rank = by_conn[c]
                waiting.remove(c)
                try:
                    results[rank] = c.recv()
                except EOFError:
                    results[rank] = ("error", f"rank {rank} died (exit code {procs[rank].exitcode})")
                if results[rank][0] == "error":  # peers of a failed rank may wait for it: give them a moment
                    deadline = min(deadline, time.monotonic() + 3.0)
    finally:
        for rank, (p, c) in enumerate(zip(procs, conns, strict=True)):
            if rank not in results:  # stuck (or we are interrupted): it would not read the message
                p.kill()
                continue
            try:
                c.send("exit")
            except OSError:
                pass
        end = time.monotonic() + 5.0
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in conns:
            c.close()
    failures = [f"--- rank {r} ---\n{v}" for r, (k, v) in sorted(results.items()) if k == "error"]
    missing = [r for r in range(world_size) if r not in results]
    if failures or missing:
        what = "\n".join(failures)
        if missing:
            what += f"\nranks {missing} did not finish (killed; limit {timeout:.0f} s, 3 s after a failure)"
        raise AssertionError(f"{scenario.__name__} failed:\n{what}")
    return [results[r][1] for r in range(world_size)]

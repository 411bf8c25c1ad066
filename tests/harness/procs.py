"""Worlds of fresh interpreters, one per rank, each running one scenario
function, for the tests that need a real process: faults (kill, SIGSTOP,
exit codes, hangs), the exit path (atexit), fork safety, diagnosis.

A rank is started as ``python -c BOOT <module>:<scenario> <port> <rank>
<n>`` around a TCPStore served by the test process. It reads its arguments
(JSON) from the key ``args``, calls ``scenario(Ctx)``, publishes the
returned dict (JSON) under ``result/<rank>`` and then returns: the
interpreter exits the ordinary way, atexit handlers included. A scenario
that raises publishes its traceback and exits with code 1; one that ends
its process otherwise (a signal, SIGABRT, ``sys.exit``) publishes what it
has first, if anything.

The parent synchronises on store keys, never on sleeps, and measures on
CLOCK_MONOTONIC, which every process of the machine shares: children report
``time.monotonic()`` stamps that the parent compares with its own (for
instance the moment it saw a child exit). Every wait is bounded; ranks
still running when the world closes are killed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from nccl_pg.store import TCPStore

HOST = "127.0.0.1"
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOT = (f"import sys; sys.path.insert(0, {TESTS_DIR!r}); from harness.procs import child_main; "
        "child_main(sys.argv[1:])")
# The library's settings, which a child must get from the test only, never from the shell that ran pytest.
_ENV_PREFIXES = ("NCCL_PG_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_FR_")
# multiprocessing's own service processes, which live for the whole session by design
_SERVICES = (b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")


def clean_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the library's settings, then ``env``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(_ENV_PREFIXES)}, **(env or {})}


def live_children(pid: int | None = None) -> list[int]:
    """Processes whose parent is ``pid`` (default: this process) and that are
    not zombies, nor multiprocessing's forkserver or resource tracker."""
    pid = os.getpid() if pid is None else pid
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z" and not any(s in cmdline for s in _SERVICES):
            out.append(int(entry))
    return out


# --- parent side ------------------------------------------------------------------------------

class World:
    """``n`` ranks as processes running ``scenario`` (a module-level function
    of a module importable from tests/). ``args`` reach every rank through
    the store; ``env`` goes to every rank (on top of this process's
    environment, minus any NCCL_PG_*/TORCH_* setting of ours), ``rank_env``
    to single ranks; ``ranks`` starts only those ranks of the ``n``. Logs and
    dumps (``<dir>/trace_<rank>``) go to ``tmp_path``, or to a temporary
    directory removed at close."""

    def __init__(self, n: int, scenario: Callable[[Ctx], dict | None], tmp_path: Any = None,
                 args: dict | None = None, env: Mapping[str, str] | None = None,
                 rank_env: Mapping[int, Mapping[str, str]] | None = None, ranks: Sequence[int] | None = None,
                 store_timeout: float = 30.0) -> None:
        self.n = n
        self._tmp = tempfile.TemporaryDirectory(prefix="harness_") if tmp_path is None else None
        self.dir = self._tmp.name if self._tmp is not None else str(tmp_path)
        self.dump_prefix = os.path.join(self.dir, "trace_")
        self.store = TCPStore(HOST, 0, is_master=True, timeout=store_timeout)
        self.store.set("args", json.dumps(args or {}))  # may be too long for a command line
        base = clean_env({"NCCL_PG_DEBUG_INFO_TEMP_FILE": self.dump_prefix, **(env or {})})
        self.procs: dict[int, subprocess.Popen] = {}
        self.exited_at: dict[int, float] = {}  # rank -> when this process saw it gone (CLOCK_MONOTONIC)
        self._logs: dict[int, Any] = {}
        target = f"{scenario.__module__}:{scenario.__name__}"
        try:
            for r in (range(n) if ranks is None else ranks):
                log = open(os.path.join(self.dir, f"rank{r}.log"), "w+")  # noqa: SIM115 - closed in close()
                self._logs[r] = log
                self.procs[r] = subprocess.Popen(
                    [sys.executable, "-c", BOOT, target, str(self.store.port), str(r), str(n)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env={**base, **(rank_env or {}).get(r, {})})
        except BaseException:
            self.close()
            raise

    # --- observation ---

    def log(self, r: int) -> str:
        f = self._logs[r]
        f.flush()
        f.seek(0)
        return f.read()

    def logs(self) -> str:
        return "\n".join(f"--- rank {r} (exit {p.poll()}) ---\n{self.log(r)[-3000:]}" for r, p in self.procs.items())

    def poll(self) -> None:
        """Note (in ``exited_at``) the ranks seen gone since the last look."""
        now = time.monotonic()
        for r, p in self.procs.items():
            if r not in self.exited_at and p.poll() is not None:
                self.exited_at[r] = now

    def wait_key(self, key: str, timeout: float = 20.0) -> bytes:
        """Wait for a store key; fails early (with the logs) if a rank dies
        without having published a result."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.store.wait([key], timeout=0.02)
                return self.store.get(key)
            except Exception:
                pass
            self.poll()
            for r, p in self.procs.items():
                if p.poll() not in (None, 0) and not self.store.check([f"result/{r}"]):
                    raise AssertionError(f"rank {r} exited with {p.returncode} while the test waited for "
                                         f"{key!r}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timeout waiting for store key {key!r}\n{self.logs()}")

    def set(self, key: str, value: str = "1") -> None:
        self.store.set(key, value)

    def join(self, timeout: float = 20.0, ranks: Sequence[int] | None = None) -> dict[int, int]:
        """Wait for ``ranks`` (default: all) to exit; their exit codes. A rank
        still running at the deadline fails the test (every rank is killed)."""
        ranks = list(self.procs if ranks is None else ranks)
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if all(r in self.exited_at for r in ranks):
                return {r: self.procs[r].returncode for r in ranks}
            if time.monotonic() > deadline:
                stuck = [r for r in ranks if r not in self.exited_at]
                text = self.logs()
                self.kill_all()
                raise AssertionError(f"ranks {stuck} did not exit within {timeout} s\n{text}")
            time.sleep(0.01)

    def result(self, r: int) -> dict | None:
        if not self.store.check([f"result/{r}"]):
            return None
        res = json.loads(self.store.get(f"result/{r}"))
        if "error" in res:
            raise AssertionError(f"rank {r} failed:\n{res['error']}\n{self.logs()}")
        return res

    def results(self, timeout: float = 20.0, expect_rc: dict[int, int] | None = None,
                ranks: Sequence[int] | None = None) -> dict[int, dict]:
        """Join ``ranks`` (default: all), check their exit codes (default 0)
        and return the published results of those that have one."""
        rcs = self.join(timeout, ranks)
        out = {r: self.result(r) for r in rcs}
        want = {r: 0 for r in rcs} | (expect_rc or {})
        assert rcs == want, f"exit codes {rcs}, expected {want}\n{self.logs()}"
        return {r: v for r, v in out.items() if v is not None}

    # --- teardown ---

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process immune to SIGKILL
                pass

    def close(self) -> None:
        self.kill_all()
        for f in self._logs.values():
            f.close()
        self.store.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- child side -------------------------------------------------------------------------------

@dataclasses.dataclass
class Ctx:
    """What a scenario gets: the world's store (a client), its rank, the
    world size and the test's arguments."""

    store: TCPStore
    rank: int
    n: int
    args: dict

    def set(self, key: str, value: str = "1") -> None:
        self.store.set(key, value)

    def wait(self, key: str, timeout: float = 30.0) -> bytes:
        self.store.wait([key], timeout=timeout)
        return self.store.get(key)

    def barrier(self, name: str, timeout: float = 30.0) -> None:
        """All ranks meet, over the store only (the seeds' gloo barrier)."""
        self.store.set(f"{name}/{self.rank}", "1")
        self.store.wait([f"{name}/{r}" for r in range(self.n)], timeout=timeout)

    def die_inside_the_next_collective(self, victim: int, members: int) -> None:
        """Rank ``victim`` SIGKILLs itself once the other ``members - 1`` ranks have counted themselves in on
        their way into the next collective (0.3 s later, so that they are inside it; if they were not yet,
        they would still find it dead there). Every member calls it just before that collective."""
        if self.rank == victim:
            self.store.wait(["survivors_in"], timeout=30)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.store.add("in", 1) == members - 1:
            self.set("survivors_in")

    def publish(self, result: dict) -> None:
        self.store.set(f"result/{self.rank}", json.dumps(result))

    def init(self, timeout: float | None = None) -> Any:
        """``init_process_group`` on the host backend; the default group."""
        import nccl_pg as dist  # noqa: PLC0415 - only the scenarios that use it pay for it

        dist.init_process_group("host", store=self.store, rank=self.rank, world_size=self.n,
                                timeout=timeout or self.args.get("timeout", 30.0))
        return dist._get_default_group()

    def pg(self, timeout: float | None = None) -> Any:
        """A group made directly, as the seeds' ``ProcessGroupNCCL(store, rank, size, timeout=)``."""
        from nccl_pg import Options, PrefixStore, ProcessGroupHost  # noqa: PLC0415

        return ProcessGroupHost(PrefixStore("pg", self.store), self.rank, self.n,
                                Options(timeout=timeout or self.args.get("timeout", 30.0)))

    def comm(self, name: str = "comm", **config: Any) -> Any:
        """A host communicator of every rank (no process group)."""
        from nccl_pg.comm.base import CommConfig  # noqa: PLC0415
        from nccl_pg.comm.host import HostCommunicator  # noqa: PLC0415
        from nccl_pg.store import PrefixStore  # noqa: PLC0415

        cfg = CommConfig(**{"timeout": 30.0, **config})
        return HostCommunicator.create(PrefixStore(name, self.store), self.n, self.rank, cfg)


def child_main(argv: list[str]) -> None:
    target, port, rank, n = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    module, name = target.split(":")
    scenario = getattr(importlib.import_module(module), name)
    store = TCPStore(HOST, port, timeout=30)
    ctx = Ctx(store, rank, n, json.loads(store.get("args")))
    try:
        result = scenario(ctx)
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise  # a scenario's own sys.exit()
        store.set(f"result/{rank}", json.dumps({"error": traceback.format_exc()}))
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    if result is not None:
        ctx.publish(result)
    # return: the interpreter exits normally (atexit handlers run)


# --- helpers for scenarios ---------------------------------------------------------------------

def attempt(fn: Callable[[], Any]) -> dict:
    """Run ``fn``; what happened, with monotonic stamps."""
    from nccl_pg import DistBackendError  # noqa: PLC0415

    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:
        return {"ok": False, "t0": t0, "t1": time.monotonic(), "type": type(e).__name__,
                "backend": isinstance(e, DistBackendError), "msg": str(e)}
    return {"ok": True, "t0": t0, "t1": time.monotonic()}


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict]:
    """Start ``attempt(fn)`` on a daemon thread; the dict fills in when it ends."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(attempt(fn)), daemon=True)
    t.start()
    return t, out


def ones(k: int = 10) -> np.ndarray:
    return np.ones(k, dtype=np.float32)


def run_scripts(script: Any, world: int, env: Mapping[str, str],
                rank_env: Mapping[int, Mapping[str, str]] | None = None,
                timeout: float = 45.0) -> list[tuple[int, str]]:
    """Run ``python script`` as ranks 0..world-1 (``RANK`` and ``WORLD_SIZE``
    set; this process's NCCL_PG_/TORCH_ variables dropped, then ``env`` and
    ``rank_env[rank]`` applied); each rank's (exit code, output). Ranks
    still running at ``timeout`` are killed."""
    base = clean_env({**env, "WORLD_SIZE": str(world)})
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(world):
            e = {**base, "RANK": str(rank), **(rank_env or {}).get(rank, {})}
            procs.append(subprocess.Popen([sys.executable, str(script)], env=e, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, out))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()

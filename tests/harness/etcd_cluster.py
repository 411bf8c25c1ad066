"""A real etcd cluster on loopback for the EtcdStore tests and benchmark:
``n`` members of the installed ``etcd`` binary (Debian's etcd-server), each
on free ports with a data directory of its own (in /dev/shm where there is
one, so that etcd's fsyncs cost little), started within a deadline and
killed (SIGKILL) at the end, or when the process that started them dies.
Members can be killed one at a time, as a machine dies.
"""

from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid

INSTALL_HINT = ("etcd is not installed: `make install-test` installs it where it can (root and apt-get: "
                "apt-get install etcd-server); elsewhere install etcd >= 3.4 and put `etcd` on PATH")
HOST = "127.0.0.1"


def _die_with_parent() -> None:
    """In the member, before exec: SIGKILL when the process that started it dies, however it dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: atexit and stop() still end the members


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def fresh_job() -> str:
    """A job name no other test uses: each test's keys in a namespace of their own."""
    return f"test-{uuid.uuid4().hex[:16]}"


def _free_ports(n: int) -> list[int]:
    """n distinct free ports (held open together so that none is handed out twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdCluster:
    def __init__(self, members: int = 3, start_timeout: float = 60.0) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        shm = "/dev/shm"
        self.root = tempfile.mkdtemp(prefix="nccl_pg_etcd_",
                                     dir=shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None)
        ports = _free_ports(2 * members)
        self.client_ports, peer_ports = ports[:members], ports[members:]
        self.names = [f"m{i}" for i in range(members)]
        initial = ",".join(f"{name}=http://{HOST}:{p}" for name, p in zip(self.names, peer_ports, strict=True))
        token = f"nccl_pg-{uuid.uuid4().hex}"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        atexit.register(self.stop)  # members run in sessions of their own: never leave them behind
        try:
            for name, cport, pport in zip(self.names, self.client_ports, peer_ports, strict=True):
                log = os.path.join(self.root, f"{name}.log")
                self.logs.append(log)
                with open(log, "wb") as out:
                    self.procs.append(subprocess.Popen(
                        [binary, "--name", name, "--data-dir", os.path.join(self.root, name),
                         "--listen-client-urls", f"http://{HOST}:{cport}",
                         "--advertise-client-urls", f"http://{HOST}:{cport}",
                         "--listen-peer-urls", f"http://{HOST}:{pport}",
                         "--initial-advertise-peer-urls", f"http://{HOST}:{pport}",
                         "--initial-cluster", initial, "--initial-cluster-token", token,
                         "--initial-cluster-state", "new", "--logger", "zap", "--log-level", "warn"],
                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                        preexec_fn=_die_with_parent))
            self._wait_healthy(time.monotonic() + start_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [f"{HOST}:{p}" for p in self.client_ports]

    @property
    def url(self) -> str:
        """The endpoints as in an ``etcd://`` init_method."""
        return ",".join(self.endpoints)

    def _healthy(self, port: int) -> bool:
        conn = http.client.HTTPConnection(HOST, port, timeout=2)
        try:
            conn.request("GET", "/health")
            return json.loads(conn.getresponse().read()).get("health") == "true"
        except (OSError, ValueError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def _wait_healthy(self, deadline: float) -> None:
        delay = 0.02
        while True:
            dead = [(n, p.returncode) for n, p in zip(self.names, self.procs, strict=True) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"etcd members exited during start-up: {dead}\n{self.log_tail()}")
            if all(self._healthy(p) for p, proc in zip(self.client_ports, self.procs, strict=True)
                   if proc.poll() is None):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd cluster not healthy within the start-up deadline\n{self.log_tail()}")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def log_tail(self, lines: int = 20) -> str:
        out = []
        for log in self.logs:
            try:
                with open(log, errors="replace") as f:
                    out.append(f"--- {log}\n" + "".join(f.readlines()[-lines:]))
            except OSError:
                pass
        return "\n".join(out)

    def _status(self, port: int) -> dict:
        conn = http.client.HTTPConnection(HOST, port, timeout=5)
        try:
            conn.request("POST", "/v3/maintenance/status", b"{}")
            return json.loads(conn.getresponse().read())
        except (OSError, ValueError, http.client.HTTPException):
            return {}
        finally:
            conn.close()

    def leader(self) -> int:
        """The index of the member that leads the cluster now."""
        status = {i: self._status(self.client_ports[i]) for i in self.alive()}
        ids = {s.get("header", {}).get("member_id"): i for i, s in status.items()}
        for s in status.values():
            if s.get("leader") in ids:
                return ids[s["leader"]]
        raise RuntimeError(f"no live member names a live leader: {status}\n{self.log_tail()}")

    def kill(self, member: int) -> None:
        """SIGKILL one member, as its machine dies."""
        proc = self.procs[member]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def freeze(self, member: int) -> None:
        """SIGSTOP one member: its connections stay open and it answers nothing, as on a hung machine."""
        os.killpg(self.procs[member].pid, signal.SIGSTOP)

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def stop(self) -> None:
        atexit.unregister(self.stop)
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

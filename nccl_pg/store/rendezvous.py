"""Init methods: turn ``tcp://``, ``file://``, ``etcd://`` or ``env://`` into
a store, a rank and a world size.

Under torchrun, whose agent hosts a torch TCPStore for the ranks
(``TORCHELASTIC_USE_AGENT_STORE``), ``env://`` connects to it in torch's wire
protocol (torch_client.py); everywhere else it uses our authenticated one.

``env://`` reads the variables of torchrun / ``nccl-pg run`` (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and falls back to those of
SLURM (srun), Open MPI (mpirun) and MPICH/PMI, so the same script runs under
any of these launchers. Every variable is validated and an error names it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlparse

from .. import env
from ..timeouts import Timeout, to_seconds
from . import FileStore, Store, TCPStore


@dataclass
class Rendezvous:
    store: Store
    rank: int
    world_size: int
    local_rank: int | None
    source: str  # where rank and world size came from, for messages and logs


# Each launcher's variables, in order of precedence.
_LAUNCHERS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("torchrun-style", "RANK", "WORLD_SIZE", ("LOCAL_RANK",)),
    ("SLURM", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",)),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    ("MPICH/PMI", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID",)),
)


def _env_int(environ: Mapping[str, str], name: str, lo: int, hi: int | None = None) -> int:
    raw = environ[name]
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"env:// rendezvous: environment variable {name}={raw!r} is not an integer") from None
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"env:// rendezvous: environment variable {name}={raw!r} is out of range ({bound})")
    return value


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist such as ``gpu[03-05,9],cpu1``."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise ValueError(f"cannot read a host from SLURM node list {nodelist!r}")
    prefix, ranges, suffix = m.groups()
    first = re.split(r"[,-]", ranges)[0] if ranges else ""
    return f"{prefix}{first}{suffix or ''}"


def _master_addr(environ: Mapping[str, str], source: str) -> str:
    addr = environ.get("MASTER_ADDR", "").strip()
    if addr:
        return addr
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if source == "SLURM" and nodelist:
        return first_host(nodelist)
    raise ValueError(
        "env:// rendezvous: environment variable MASTER_ADDR is not set (the host of rank 0's store); "
        "set it, or start the job with `nccl-pg run`"
    )


def _from_env(environ: Mapping[str, str], rank: int, world_size: int) -> tuple[int, int, int | None, str, str, int]:
    launcher = next((la for la in _LAUNCHERS if la[1] in environ or la[2] in environ), None)
    if launcher is not None:
        source, rank_var, size_var, local_vars = launcher
    else:
        if rank < 0 or world_size < 0:
            raise ValueError(
                "env:// rendezvous: no launcher variables found (RANK and WORLD_SIZE, or SLURM_PROCID/SLURM_NTASKS, "
                "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE, PMI_RANK/PMI_SIZE), and rank/world_size were not passed"
            )
        source, rank_var, size_var, local_vars = "arguments", "", "", ("LOCAL_RANK",)
    if world_size < 0:
        if size_var not in environ:
            raise ValueError(f"env:// rendezvous: environment variable {size_var} is not set ({source} launch)")
        world_size = _env_int(environ, size_var, 1)
    if rank < 0:
        if rank_var not in environ:
            raise ValueError(f"env:// rendezvous: environment variable {rank_var} is not set ({source} launch)")
        rank = _env_int(environ, rank_var, 0)
    local_rank = next((_env_int(environ, v, 0) for v in local_vars if v in environ), None)
    addr = _master_addr(environ, source)
    if "MASTER_PORT" not in environ:
        raise ValueError("env:// rendezvous: environment variable MASTER_PORT is not set (the port of rank 0's store)")
    port = _env_int(environ, "MASTER_PORT", 1, 65535)
    return rank, world_size, local_rank, source, addr, port


def rendezvous(
    init_method: str | None = "env://",
    rank: int = -1,
    world_size: int = -1,
    timeout: Timeout | None = None,
    environ: Mapping[str, str] | None = None,
) -> Rendezvous:
    """Connect to (or, as rank 0, start) the store named by ``init_method``.

    ``rank`` and ``world_size`` override what the URL or the environment say;
    -1 means "not given". ``timeout`` bounds connecting and waiting for the
    other ranks (default: NCCL_PG_STORE_TIMEOUT, 300 s).
    """
    environ = os.environ if environ is None else environ
    seconds = env.STORE_TIMEOUT.get(environ) if timeout is None else to_seconds(timeout)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    url = urlparse(init_method or "env://")
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    for name in ("rank", "world_size"):
        if name in query and (rank if name == "rank" else world_size) < 0:
            try:
                parsed = int(query[name])
            except ValueError:
                raise ValueError(f"{init_method}: {name}={query[name]!r} is not an integer") from None
            rank, world_size = (parsed, world_size) if name == "rank" else (rank, parsed)

    local_rank: int | None = None
    if url.scheme == "env":
        rank, world_size, local_rank, source, host, port = _from_env(environ, rank, world_size)
    elif url.scheme == "tcp":
        if not url.hostname or url.port is None:
            raise ValueError(f"init_method {init_method!r}: expected tcp://host:port")
        host, port, source = url.hostname, url.port, f"tcp://{url.hostname}:{url.port}"
    elif url.scheme == "file":
        path = unquote(url.path)
        if not path:
            raise ValueError(f"init_method {init_method!r}: expected file:///absolute/path")
        source = f"file://{path}"
    elif url.scheme == "etcd":
        job = unquote(url.path).removeprefix("/")
        if not url.netloc or not job:
            raise ValueError(f"init_method {init_method!r}: expected etcd://host:port[,host:port...]/job")
        source = f"etcd://{url.netloc}/{job}"
    else:
        raise ValueError(f"init_method {init_method!r}: unsupported scheme; use env://, tcp://host:port, "
                         f"file:///path or etcd://host:port[,host:port...]/job")

    if world_size < 1:
        raise ValueError(f"{source}: world_size must be given and >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{source}: rank {rank} is out of range for world_size {world_size}")

    if url.scheme == "file":
        store: Store = FileStore(path, world_size, timeout=seconds)
    elif url.scheme == "etcd":
        store = etcd_store_of(init_method or "", seconds)
    elif speaks_torch(environ, url.scheme):
        from .torch_client import TorchWireStore  # only jobs on torch's store load it

        store = TorchWireStore(host, port, timeout=seconds)
    else:
        agent_store = url.scheme == "env" and env.USE_AGENT_STORE.get(environ)
        store = TCPStore(host, port, world_size=world_size, is_master=rank == 0 and not agent_store,
                         timeout=seconds, secret=env.STORE_SECRET.get(environ))
    return Rendezvous(store, rank, world_size, local_rank, source)


def etcd_store_of(url: str, timeout: float) -> Store:
    """The EtcdStore that ``etcd://host:port[,host:port...]/job`` names."""
    parts = urlparse(url)
    job = unquote(parts.path).removeprefix("/")
    if parts.scheme != "etcd" or not parts.netloc or not job:
        raise ValueError(f"{url!r}: expected etcd://host:port[,host:port...]/job")
    from .etcd_store import EtcdStore  # noqa: PLC0415 - only jobs on etcd load its client

    return EtcdStore(parts.netloc, job, timeout=timeout)


def speaks_torch(environ: Mapping[str, str], scheme: str = "env") -> bool:
    """Whether the job's store is a torch TCPStore server (NCCL_PG_STORE_PROTOCOL): by default, for env://
    under torchrun, its agent's store (``TORCHELASTIC_USE_AGENT_STORE``; ``nccl-pg run``, whose store is ours,
    sets NCCL_PG_USE_AGENT_STORE as well)."""
    protocol = env.STORE_PROTOCOL.get(environ)
    if protocol != "auto":
        return protocol == "torch"
    return (scheme == "env" and env.USE_AGENT_STORE.get(environ)
            and not environ.get(env.USE_AGENT_STORE.name, "").strip())

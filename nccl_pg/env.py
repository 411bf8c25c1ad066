"""Every environment variable nccl_pg reads is declared and parsed here.

Each variable has an ``NCCL_PG_*`` name; where PyTorch has an equivalent, the
``TORCH_*`` name is accepted as well (ours wins when both are set). A value
that does not parse raises ``ValueError`` naming the variable, so a typo fails
at start-up instead of silently selecting a default.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from .timeouts import parse_seconds

T = TypeVar("T")


@dataclass(frozen=True)
class Var(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    doc: str
    aliases: tuple[str, ...] = ()

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        environ = os.environ if environ is None else environ
        for key in (self.name, *self.aliases):
            raw = environ.get(key)
            if raw is not None and raw.strip() != "":
                try:
                    return self.parse(raw.strip())
                except ValueError as exc:
                    raise ValueError(f"invalid value {raw!r} for environment variable {key}: {exc}") from None
        return self.default


def parse_bool(raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def parse_int(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw, 10)
        except ValueError:
            raise ValueError("expected an integer") from None
        if lo is not None and value < lo:
            raise ValueError(f"must be >= {lo}")
        if hi is not None and value > hi:
            raise ValueError(f"must be <= {hi}")
        return value

    return parse


def parse_seconds_at_least(lo: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = parse_seconds(raw)
        if value < lo:
            raise ValueError(f"must be >= {lo:g} s")
        return value

    return parse


def parse_str(raw: str) -> str:
    return raw


def parse_etcd_url(raw: str) -> str:
    """``etcd://host:port[,host:port...]/job`` (the form of the etcd:// init method)."""
    head, _, job = raw.removeprefix("etcd://").partition("/")
    if not raw.startswith("etcd://") or not head or not job or "/" in job:
        raise ValueError("expected etcd://host:port[,host:port...]/job")
    return raw


def parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.lower() not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return raw.lower()

    return parse


# --- store -----------------------------------------------------------------
STORE_SECRET: Var[str | None] = Var(
    "NCCL_PG_STORE_SECRET", parse_str, None,
    "Shared secret for TCPStore authentication (HMAC challenge-response); unset: no authentication.")
STORE_TIMEOUT: Var[float] = Var(
    "NCCL_PG_STORE_TIMEOUT", parse_seconds, 300.0,
    "Default deadline in seconds of blocking store calls (connect, get, wait).")
STORE_MAX_VALUE_SIZE: Var[int] = Var(
    "NCCL_PG_STORE_MAX_VALUE_SIZE", parse_int(1, 2**31 - 1), 64 * 2**20,
    "Largest value (bytes) a TCPStore server accepts.")
STORE_IDLE_TIMEOUT: Var[float] = Var(
    "NCCL_PG_STORE_IDLE_TIMEOUT", parse_seconds, 600.0,
    "Seconds after which a TCPStore server closes an authenticated connection that has sent nothing and has "
    "no blocked request (clients reconnect by themselves when they need the store again).")
USE_AGENT_STORE: Var[bool] = Var(
    "NCCL_PG_USE_AGENT_STORE", parse_bool, False,
    "Set by `nccl-pg run`: the launcher hosts the TCPStore, so rank 0 connects as a client.",
    aliases=("TORCHELASTIC_USE_AGENT_STORE",))
STORE_PROTOCOL: Var[str] = Var(
    "NCCL_PG_STORE_PROTOCOL", parse_choice("auto", "nccl_pg", "torch"), "auto",
    "Wire protocol of env:// and tcp:// rendezvous: nccl_pg (ours, authenticated), torch (a client of a torch "
    "TCPStore server: every rank connects, none hosts), or auto: torch under torchrun's agent store "
    "(TORCHELASTIC_USE_AGENT_STORE without NCCL_PG_USE_AGENT_STORE), else nccl_pg.")

# --- host backend ----------------------------------------------------------
HOST_ADDR: Var[str | None] = Var(
    "NCCL_PG_HOST_ADDR", parse_str, None,
    "Address the host backend listens on and publishes to peers; default: the local address of the "
    "connection to the TCPStore or EtcdStore, else 127.0.0.1.")

HOST_BROADCAST: Var[str] = Var(
    "NCCL_PG_HOST_BROADCAST", parse_choice("auto", "chain", "tree"), "auto",
    "Large-broadcast algorithm of the host backend: a pipelined chain, a binomial tree, or auto (the tree "
    "when a host runs more ranks of the communicator than it has CPUs).")

# --- NCCL backend ----------------------------------------------------------
RANKS_PER_ROOT: Var[int] = Var(
    "NCCL_PG_RANKS_PER_ROOT", parse_int(1, 2**31 - 1), 128,
    "Ranks per NCCL bootstrap root: a communicator of more ranks is created with ncclCommInitRankScalable "
    "and ceil(ranks / this) unique ids (NCCL >= 2.23), so that no single rank bootstraps them all.",
    aliases=("TORCH_NCCL_RANKS_PER_ROOT",))
NCCL_OPS: Var[str] = Var(
    "NCCL_PG_NCCL_OPS", parse_choice("nonblocking", "blocking"), "nonblocking",
    "Which NCCL communicator operations are issued on (docs/NCCL_BACKEND.md, \"The communicator family\"): "
    "nonblocking (the group's one nonblocking communicator: every call returns at once and is polled against the "
    "group timeout, so an abort never overlaps a call; NCCL starts a thread per operation) or blocking (a blocking "
    "communicator sharing the control one's abort flag: no thread per operation, but a call stuck in NCCL is "
    "stopped only by an abort overlapping it, which NCCL's user guide forbids). The GPU run decides the default.")
POOL_RELEASE_THRESHOLD: Var[int] = Var(
    "NCCL_PG_POOL_RELEASE_THRESHOLD", parse_int(0, 2**63 - 1), 256 * 2**20,
    "Bytes of freed temporaries (list collectives, object collectives) the NCCL backend's private CUDA memory "
    "pool keeps per device across synchronizations instead of returning them to the driver "
    "(cudaMemPoolAttrReleaseThreshold; CUDA's default pool keeps 0).")

# --- process groups --------------------------------------------------------
USE_COMM_NONBLOCKING: Var[bool] = Var(
    "NCCL_PG_USE_COMM_NONBLOCKING", parse_bool, False,
    "Create communicators in nonblocking mode: init and split return at once and operations wait for "
    "them (bounded by the group timeout).",
    aliases=("TORCH_NCCL_USE_COMM_NONBLOCKING",))
ENABLE_TIMING: Var[bool] = Var(
    "NCCL_PG_ENABLE_TIMING", parse_bool, False,
    "Record a start event for every operation so Works report their duration (on by itself once a "
    "completion hook is registered).",
    aliases=("TORCH_NCCL_ENABLE_TIMING",))
LAUNCH_MARKS: Var[bool] = Var(
    "NCCL_PG_LAUNCH_MARKS", parse_bool, True,
    "On NCCL >= 2.32.3, give every collective a launch-completion event (ncclCollConfig_t.launchCompletionEvent) "
    "that NCCL records when its kernel launches: the exact \"started\" mark of the watchdog and the flight "
    "recorder. Set it alike on every rank (NCCL requires the event on every rank or on none).")
# Below this the watchdog's poller busy-loops a core for nothing: no completion needs noticing sooner.
MIN_WATCHDOG_INTERVAL = 0.001
WATCHDOG_INTERVAL: Var[float] = Var(
    "NCCL_PG_WATCHDOG_INTERVAL", parse_seconds_at_least(MIN_WATCHDOG_INTERVAL), 0.1,
    "Seconds between two polls of pending operations by the watchdog thread (at least 0.001).")
DEBUG: Var[str] = Var(
    "NCCL_PG_DEBUG", parse_choice("off", "info", "detail"), "off",
    "Debug level: off, info (log group creation), detail (also log every operation issued, and check before "
    "each collective that every rank issued the same one: kind, dtype, count, reduction op, root).",
    aliases=("TORCH_DISTRIBUTED_DEBUG",))

# --- failure handling --------------------------------------------------------
ASYNC_ERROR_HANDLING: Var[int] = Var(
    "NCCL_PG_ASYNC_ERROR_HANDLING", parse_int(0, 3), 2,
    "What a failed or timed-out operation does besides failing its Work: 0 nothing more, 1 abort the "
    "group's communicator and end the process (SIGABRT), 2 abort the communicator so every waiter is "
    "released and wait() raises, 3 end the process without aborting.",
    aliases=("TORCH_NCCL_ASYNC_ERROR_HANDLING",))
BLOCKING_WAIT: Var[bool] = Var(
    "NCCL_PG_BLOCKING_WAIT", parse_bool, False,
    "Work.wait() blocks the calling thread until the operation completes, polling for errors and the "
    "timeout (the host backend always does).",
    aliases=("TORCH_NCCL_BLOCKING_WAIT",))
HEARTBEAT_TIMEOUT: Var[float] = Var(
    "NCCL_PG_HEARTBEAT_TIMEOUT", parse_seconds, 480.0,
    "Seconds the watchdog thread may go without completing a poll before the monitor writes a dump "
    "and ends the process with SIGABRT (at least twice NCCL_PG_WATCHDOG_INTERVAL).",
    aliases=("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",))
ENABLE_MONITORING: Var[bool] = Var(
    "NCCL_PG_ENABLE_MONITORING", parse_bool, True,
    "Run the heartbeat monitor of the watchdog thread.",
    aliases=("TORCH_NCCL_ENABLE_MONITORING",))
DUMP_ON_TIMEOUT: Var[bool] = Var(
    "NCCL_PG_DUMP_ON_TIMEOUT", parse_bool, True,
    "On a timeout, write a debug dump on this rank and signal every rank (through the store) to write "
    "theirs.",
    aliases=("TORCH_NCCL_DUMP_ON_TIMEOUT",))
DUMP_FILE: Var[str | None] = Var(
    "NCCL_PG_DEBUG_INFO_TEMP_FILE", parse_str, None,
    "Path prefix of debug dumps; the rank number is appended. Default: <tmp>/nccl_pg-<uid>/nccl_pg_trace_rank_ "
    "(a private directory, made 0700 and refused unless it is this user's).",
    aliases=("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",))


def parse_signal(raw: str) -> int:
    """A signal by name ("SIGUSR2", "USR2") or number; 0 or "off": none."""
    if raw.lower() in ("0", "off", "none"):
        return 0
    if raw.isdigit():
        num = int(raw)
    else:
        name = raw.upper() if raw.upper().startswith("SIG") else f"SIG{raw.upper()}"
        try:
            num = int(signal.Signals[name])
        except KeyError:
            raise ValueError("expected a signal name (e.g. SIGUSR2) or number, or 0/off") from None
    if num in (signal.SIGKILL, signal.SIGSTOP) or num not in signal.valid_signals():
        raise ValueError(f"signal {num} cannot be caught")
    return num


STACKS_SIGNAL: Var[int] = Var(
    "NCCL_PG_STACKS_SIGNAL", parse_signal, int(signal.SIGUSR2),
    "Signal whose C-level handler (faulthandler) appends every thread's Python stack to <dump dir>/c_stacks/rank<rank>.<pid>.txt, "
    "even while a thread holds the GIL or is stuck in C; `nccl-pg why` and `nccl-pg run` send it to ranks that do "
    "not answer, and the test harness (nccl_pg.testing) to its ranks still running. 0 or off: none. Only with "
    "NCCL_PG_DUMP_ON_TIMEOUT on (the test harness's ranks: always).")

# --- NaN checks ------------------------------------------------------------------
NAN_CHECK_MODES = ("off", "raise", "async", "trap")


def parse_nan_check(raw: str) -> str:
    """A mode name, or a boolean: true means ``raise`` (torch's ``TORCH_NCCL_NAN_CHECK=1`` traps; ``trap``
    asks for that)."""
    low = raw.lower()
    if low in NAN_CHECK_MODES:
        return low
    try:
        return "raise" if parse_bool(low) else "off"
    except ValueError:
        raise ValueError(f"expected one of {', '.join(NAN_CHECK_MODES)} (or 1/0)") from None


NAN_CHECK: Var[str] = Var(
    "NCCL_PG_NAN_CHECK", parse_nan_check, "off",
    "Check the inputs of collectives and sends for NaN: off; raise (before issuing: NanError naming rank, "
    "group, op, input and element); async (on the stream: the Work fails with NanError); trap (end the "
    "process, as torch). 1 means raise.",
    aliases=("TORCH_NCCL_NAN_CHECK",))
KERNEL_CACHE: Var[str | None] = Var(
    "NCCL_PG_KERNEL_CACHE", parse_str, None,
    "Folder of the compiled CUDA kernels (NVRTC images keyed by source hash, architecture and NVRTC "
    "version); default $XDG_CACHE_HOME/nccl_pg/kernels, else ~/.cache/nccl_pg/kernels.")

TRACE_BUFFER_SIZE: Var[int] = Var(
    "NCCL_PG_TRACE_BUFFER_SIZE", parse_int(0, 10**7), 2000,
    "Entries in the flight recorder's ring buffer (one per operation); 0 turns the recorder off.",
    aliases=("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"))
TRACE_STACKS: Var[bool] = Var(
    "NCCL_PG_TRACE_STACKS", parse_bool, False,
    "Capture the Python stack of every operation into the flight recorder (costs microseconds per op).")

# --- object collectives ------------------------------------------------------------
OBJECT_SERIALIZER: Var[str] = Var(
    "NCCL_PG_OBJECT_SERIALIZER", parse_choice("pickle", "safe"), "pickle",
    "How object collectives (all_gather_object, broadcast_object_list, ...) serialize: pickle (torch's, any "
    "object; loading runs code a peer chooses: trusted ranks only) or safe (pickle read by an unpickler that "
    "builds plain data only: no code runs). A call's serializer= wins.")
OBJECT_MAX_BYTES: Var[int] = Var(
    "NCCL_PG_OBJECT_MAX_BYTES", parse_int(1, 2**62), 2**30,
    "Largest serialized object (bytes) an object collective sends or accepts; a larger size announced by a "
    "peer raises DistBackendError before anything is allocated.")

ALL: tuple[Var, ...] = (STORE_SECRET, STORE_TIMEOUT, STORE_MAX_VALUE_SIZE, STORE_IDLE_TIMEOUT, USE_AGENT_STORE,
                        STORE_PROTOCOL,
                        HOST_ADDR, HOST_BROADCAST, RANKS_PER_ROOT, NCCL_OPS, POOL_RELEASE_THRESHOLD,
                        USE_COMM_NONBLOCKING, ENABLE_TIMING, LAUNCH_MARKS, WATCHDOG_INTERVAL, DEBUG,
                        ASYNC_ERROR_HANDLING, BLOCKING_WAIT, HEARTBEAT_TIMEOUT, ENABLE_MONITORING,
                        DUMP_ON_TIMEOUT, DUMP_FILE, STACKS_SIGNAL, NAN_CHECK, KERNEL_CACHE, TRACE_BUFFER_SIZE, TRACE_STACKS,
                        OBJECT_SERIALIZER, OBJECT_MAX_BYTES)

# --- elastic recovery (set by `nccl-pg run --elastic`; docs/ELASTIC.md) ---------------------------------
ELASTIC_MEMBER: Var[int | None] = Var(
    "NCCL_PG_ELASTIC_MEMBER", parse_int(0), None,
    "Set by `nccl-pg run --elastic`: this process's member number in the launcher's membership records "
    "(the original ranks: their rank; each replacement: the next number).")
ELASTIC_UUID: Var[int | None] = Var(
    "NCCL_PG_ELASTIC_UUID", parse_int(0), None,
    "Set by `nccl-pg run --elastic` for a process that comes in while the job runs (a replacement, a new "
    "node's rank): the configuration (uuid) current when it was started.")
ELASTIC_STORE: Var[str | None] = Var(
    "NCCL_PG_ELASTIC_STORE", lambda raw: parse_etcd_url(raw), None,
    "Set by `nccl-pg run --elastic` on several nodes (--rdzv-endpoint): the job's store, "
    "etcd://host:port[,host:port...]/job, which every rank and launcher meets on.")
ALL = (*ALL, ELASTIC_MEMBER, ELASTIC_UUID, ELASTIC_STORE)


def watchdog_timing(environ: Mapping[str, str] | None = None) -> tuple[float, float]:
    """(poll interval, heartbeat timeout), checked against each other: a
    heartbeat that expires between two healthy polls would SIGABRT a healthy
    process, so it must span at least two of them (when monitoring is on)."""
    interval, heartbeat = WATCHDOG_INTERVAL.get(environ), HEARTBEAT_TIMEOUT.get(environ)
    if ENABLE_MONITORING.get(environ) and heartbeat < 2 * interval:
        raise ValueError(
            f"contradictory settings: {HEARTBEAT_TIMEOUT.name}={heartbeat:g} s is less than twice "
            f"{WATCHDOG_INTERVAL.name}={interval:g} s: the heartbeat monitor would end healthy processes; raise "
            f"{HEARTBEAT_TIMEOUT.name}, lower {WATCHDOG_INTERVAL.name}, or set {ENABLE_MONITORING.name}=0")
    return interval, heartbeat


def validate_all(environ: Mapping[str, str] | None = None) -> None:
    """Parse every declared variable, then the ones that must agree with
    each other; raises on the first invalid value or contradiction."""
    for var in ALL:
        var.get(environ)
    watchdog_timing(environ)

# --- diagnosis of a job (set by `nccl-pg run` and the test harness; docs/DIAGNOSIS.md) ------------------------


def parse_job_id(raw: str) -> str:
    """A job id: letters, digits and ``._-`` (it names a folder), at most 64 characters."""
    if len(raw) > 64 or not all(c.isalnum() or c in "._-" for c in raw) or raw.startswith("."):
        raise ValueError("expected at most 64 letters, digits, '.', '_' or '-', not starting with '.'")
    return raw


JOB_ID: Var[str | None] = Var(
    "NCCL_PG_JOB_ID", parse_job_id, None,
    "The job this process belongs to (set by `nccl-pg run` and the test harness; else torchelastic's run id, or "
    "SLURM's job and step): every dump, report and C-level stacks file carries it, and the default dump folder is "
    "one per job, <tmp>/nccl_pg-<uid>/job-<id>/.")
PROGRESS_FILE: Var[str | None] = Var(
    "NCCL_PG_PROGRESS_FILE", parse_str, None,
    "Set by `nccl-pg run` for each rank: a small file the rank's watchdog keeps its progress in (collectives "
    "completed, in flight and since when, its last poll, its rank in the job), which the launcher reads to say "
    "that a job hangs (and, under --elastic, to label a member's lines with its rank); never store traffic.")
RUNTIME_DIR: Var[str | None] = Var(
    "NCCL_PG_RUNTIME_DIR", parse_str, None,
    "Where `nccl-pg run` keeps its job records and `nccl-pg why` looks for them: default "
    "$XDG_RUNTIME_DIR/nccl_pg when that is a folder of this user's, else /tmp/nccl_pg-<uid>/jobs; whatever "
    "TMPDIR says.")
MAX_TIMEOUT: Var[float | None] = Var(
    "NCCL_PG_MAX_TIMEOUT", parse_seconds_at_least(0.001), None,
    "No group's operations get a longer timeout than this (seconds), whatever the group asked for. The test harness "
    "sets it to the test's operation timeout, so that a group made with a default timeout (torch's 30 minutes for "
    "init_process_group(\"nccl_pg\")) times out, and names its culprit, within the test's deadline.")
ALL = (*ALL, JOB_ID, PROGRESS_FILE, RUNTIME_DIR, MAX_TIMEOUT)

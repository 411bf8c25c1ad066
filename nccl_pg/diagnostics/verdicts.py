"""The verdict catalogue: the failure classes the diagnosis tools can name,
one name each, and the small data model every tool shares.

The timeout message, the test harness (``RanksFailed``), ``nccl-pg why``,
the launcher's autopsy and ``nccl-pg trace`` all say a culprit the same way,
``format_verdict``: ``"<title>: <who> <what>; at <file:line in function>"``,
for example ``stuck in user code: rank 1 (vm, pid 4242) never joined
all_reduce #2 of group 0 (default_pg), which ranks 0, 2, 3 issued; at
train.py:9 in eval_step``. ``CATALOGUE`` holds each class's cause and what
to do next (docs/DIAGNOSIS.md opens with it); ``ANALYZER`` says which of
Meta's NCCL Analyzer verdicts (torchcomms,
``comms/analyzer/if/NCCLAnalyzerVerdict.thrift``) each class answers, and
which do not apply here.

Two rules live here so that other tools (the elastic launcher's hung-rank
replacement, a browser view) decide as the diagnosis does:

- "stuck" only when it persists (``stall``, ``stuck``, ``stuck_after``): an
  operation in flight is stuck once nothing of it has moved between two
  looks and it is older than ``stuck_after`` (many times the group's usual
  step); younger, it is "in progress" or "slow";
- stragglers per group (``StragglerScore``): how late a rank arrives at one
  group's collectives and how often it is last, and a relative score in
  [0, 1] (1: it never keeps its group waiting; the sense of NVRx's relative
  performance score, where the best rank is the reference).

Imports nothing of the package but ``printable``: a view can load it alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .printable import safe


@dataclass(frozen=True)
class VerdictClass:
    """One failure class: its id (``Verdict.kind``), its title (the words
    every tool prints), whether it is a problem (``nccl-pg why`` exits 1),
    its cause, what the user does next, and the tools that can name it."""

    id: str
    title: str
    problem: bool
    cause: str
    next_step: str
    tools: tuple[str, ...]


# The tools, by the names the matrix test and the docs use.
TOOLS = ("timeout", "harness", "why", "autopsy", "trace")
_ALL = TOOLS
_LIVE = ("why", "autopsy")

CATALOGUE: dict[str, VerdictClass] = {c.id: c for c in (
    VerdictClass("stuck_in_user_code", "stuck in user code", True,
                 "the rank runs its own code (a loop, a sleep, a read, a lock, a data loader) instead of issuing the "
                 "collective the rest of its group waits in",
                 "look at the line named: why does this rank not reach the collective (a branch on the rank, I/O "
                 "that does not return, a deadlock in its own threads)?", _ALL),
    VerdictClass("stuck_in_c", "stuck in C with the GIL held", True,
                 "the rank's Python cannot run: a call into C (a regular expression, sum() over an iterator, an "
                 "extension) holds the GIL, so it cannot answer; its C-level stack (faulthandler) says where",
                 "the line named is the call that holds the GIL: bound its input, or run it where it cannot stop "
                 "the rank (a version that releases the GIL, a subprocess)", _ALL),
    VerdictClass("never_joined", "never joined", True,
                 "the rank did not issue the collective its group waits in and is not in its own code: it waits in "
                 "another collective (another group, or an earlier one: the groups' orders differ between ranks), "
                 "or never reached the group's init",
                 "compare the ranks' order of collectives across groups; every rank must issue a group's "
                 "collectives in one order, and must create every group it is in", _ALL),
    VerdictClass("exception", "exception", True,
                 "the rank's own code raised (its traceback says what and where); the others then fail waiting for "
                 "it", "the line named, and the exception", ("harness", "trace")),
    VerdictClass("dead", "dead", True,
                 "the rank's process ended (an exception, an exit code, a signal: a crash, the OOM killer, "
                 "SIGKILL) while the others still needed it; said with the collective it was last in",
                 "its own output and exit status first; for SIGKILL, the kernel log (the OOM killer)",
                 ("harness", "autopsy", "trace")),
    VerdictClass("mismatch", "collective mismatch", True,
                 "the ranks of a group issued different collectives at one sequence number, or the same one with "
                 "different dtypes, counts or roots; the odd rank out of the group is named",
                 "the line that issues the collective on the odd rank: a branch on the rank, a shape that depends "
                 "on the data", ("harness", "autopsy", "trace")),
    VerdictClass("p2p_deadlock", "point-to-point deadlock", True,
                 "a send or recv whose peer posts no matching operation: both sides send first, or both receive, "
                 "or the peer is elsewhere",
                 "order the pair's operations (one side sends first) or post them together (batch_isend_irecv)",
                 _ALL),
    VerdictClass("straggler", "straggler", False,
                 "a rank arrives last at most of a group's collectives, by a clear margin: late, but progressing; "
                 "its group waits for it every step",
                 "that rank's host: CPU or data-loading load, throttling, a noisy neighbour; the score says how "
                 "much of the group's step is spent waiting for it", ("why", "trace")),
    VerdictClass("slow_link", "slow or partitioned link", True,
                 "every rank issued the collective and it does not complete: data does not move between them (a "
                 "partitioned or very slow network, a peer frozen inside the collective)",
                 "the network between those ranks' hosts (nccl-pg doctor, NCCL_DEBUG=INFO), and those hosts' "
                 "health", ("timeout", "harness", "why", "autopsy", "trace")),
    VerdictClass("store_unreachable", "store unreachable", True,
                 "the rendezvous store does not answer (stopped, overloaded, or the network to it is cut): no "
                 "progress can be read, no group can be made",
                 "the store's host and port (the launcher's process, nccl-pg store), a firewall between",
                 ("timeout", "harness", "why")),
    VerdictClass("nan", "NaN found", True,
                 "the NaN check (NCCL_PG_NAN_CHECK) found a NaN in a collective's input; named with the rank, the "
                 "group, the operation and the element",
                 "where that array was computed on that rank", ("harness",)),
    VerdictClass("aborted", "aborted on request", True,
                 "a group was aborted (abort(), a peer's error handling, a shrink or revoke): its operations in "
                 "flight fail saying so",
                 "the first failure before the abort: it is the cause", ("harness",)),
    VerdictClass("init_timeout", "init timeout", True,
                 "a group's init (the rendezvous, or making its communicator) did not complete in time: a rank "
                 "never came (not started, another MASTER_ADDR/MASTER_PORT, a WORLD_SIZE too large) or could not "
                 "connect",
                 "start every rank with the same store and world size; the ranks named never arrived",
                 ("harness",)),
    VerdictClass("no_answer", "no answer", True,
                 "a rank neither answered nor left a C-level stack or a dump: frozen (SIGSTOP, swapped out), dead "
                 "without anyone here knowing, or on another host with its GIL held",
                 "that rank's host: is the process there, and in what state (py-spy dump --pid, /proc/<pid>/status)",
                 _ALL),
    VerdictClass("in_progress", "in progress", False,
                 "an operation was in flight at the first look and had moved at the second (or is younger than the "
                 "group's usual step many times over): a snapshot of a healthy job",
                 "nothing; ask again if the job seems slow", ("why", "autopsy")),
    VerdictClass("slow", "slow", False,
                 "the same operation was still in flight at the second look, but younger than a hang "
                 "(``stuck_after``): the job may be slow, or about to hang",
                 "ask again in a while: a hang is named once it persists", ("why",)),
    VerdictClass("victim", "failed waiting", False,
                 "the rank failed because another did: its operation timed out or was aborted while it waited for "
                 "the culprit named beside it; not a cause",
                 "nothing here: the culprit's verdict says what to look at", _ALL),
    VerdictClass("ok", "no problem", False, "every rank answered and they line up", "nothing", ("why", "trace")),
    VerdictClass("unreadable", "unreadable dump", True,
                 "a file in the dump folder is not a dump that can be read (truncated, too large, another user's, a "
                 "link, not our layout); the others are analyzed",
                 "the reason given; a rank killed while writing leaves a temporary file, never half a dump",
                 ("trace",)),
)}

# Meta's NCCL Analyzer verdicts (NCCLAnalyzerVerdict.thrift, VerdictType) and what answers each here: a class
# id, or "n/a: why".
ANALYZER: dict[str, str] = {
    "ALL_GOOD": "ok",
    "JOB_DEAD_OR_DOES_NOT_EXIST": "n/a: not a verdict here; nccl-pg why exits 2 (no job to ask)",
    "JOB_STARTING_OR_STOPPING": "init_timeout (while starting); in_progress otherwise",
    "TOO_MANY_RANKS_FAILED": "dead",
    "SOME_RANKS_FAILED": "dead",
    "JOB_STUCK_OUTSIDE_NCCL": "stuck_in_user_code, stuck_in_c",
    "JOB_STUCK_IN_NCCL_INITIALIZATION": "init_timeout",
    "JOB_STUCK_IN_NCCL_WITH_ACTIVE_RANKS": "slow_link",
    "JOB_STUCK_IN_NCCL_WITH_INACTIVE_RANKS": "no_answer, dead",
    "JOB_STUCK_IN_NCCL_BASED_ON_MAPPER": "n/a: CTran's mapper state; no such layer here",
    "JOB_STUCK_IN_NCCL_BASED_ON_PT": "never_joined, stuck_in_user_code (from the flight recorders)",
    "PT_NETWORK_ROOT_ANALYSIS_DISAGREEMENT": "n/a: there is one analysis here, not two to disagree",
    "JOB_STUCK_IN_NCCL_BASED_ON_CROSS_COLL": "never_joined (it waits in another group's collective)",
    "JOB_FAILED_AT_INIT": "init_timeout",
    "JOB_COMM_DUMP_MISSING": "no_answer (trace: it left no dump)",
    "JOB_STUCK_IN_NCCL_RANK_NOT_JOIN": "never_joined, stuck_in_user_code",
    "JOB_STUCK_IN_NCCL_BASED_ON_INTERSECT_COLL": "never_joined",
    "SOME_RANKS_FISHY": "straggler",
    "JOB_STUCK_IN_NCCL_UNKNOWN_BAD_RANKS": "slow_link",
    "CHECKSUM_MISMATCH": "n/a: no checksums of the data; the NaN check (nan) is the nearest",
    "RANKS_UNRESPONSIVE_OVER_HTTP_TOO_LONG": "no_answer",
    "NETWORK_PERF_SLOWNESS": "straggler, slow_link",
    "JOB_CONTAINS_COLL_DEADLOCK": "p2p_deadlock, never_joined",
    "JOB_CONTAINS_COLL_METADATA_MISMATCH": "mismatch",
    "IB_COMPLETION_ERROR": "n/a on the host backend; on NCCL it is the communicator's async error (dead, aborted)",
    "CUDA_ERROR": "n/a on the host backend; on NCCL it is the communicator's async error",
    "CUDA_NVLINK_UNCORRECTABLE_ERROR": "n/a: a GPU hardware error, seen here only as a communicator error",
    "JOB_RANK_PROCESS_DEAD": "dead",
    "JOB_PODS_UNREACHABLE": "no_answer",
}


def title(kind: str) -> str:
    """The words of class ``kind`` (its id itself if it is not one)."""
    c = CATALOGUE.get(kind)
    return c.title if c is not None else kind


def is_problem(kind: str) -> bool:
    c = CATALOGUE.get(kind)
    return c.problem if c is not None else True


def format_verdict(kind: str, text: str, where: str = "") -> str:
    """The one line every tool prints for a verdict: ``"<title>: <text>"``
    and ``"; at <where>"`` when known; control characters escaped."""
    return safe(f"{title(kind)}: {text}" + (f"; at {where}" if where else ""), lines=False)


@dataclass(frozen=True)
class Verdict:
    """One problem (or the absence of one): its class, the global ranks it
    blames (none for ``ok``, ``in_progress``, ``slow``), the sentence after
    the title (who, what), and where the culprit is in its code."""

    kind: str
    ranks: tuple[int, ...]
    text: str
    where: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def line(self) -> str:
        return format_verdict(self.kind, self.text, self.where)

    @property
    def problem(self) -> bool:
        return is_problem(self.kind)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "class": title(self.kind), "problem": self.problem, "ranks": list(self.ranks),
                "text": self.line(), "where": self.where, **self.extra}


def who(rank: int, host: str | None = None, pid: int | None = None, device: str = "") -> str:
    """``"rank 1 (vm, pid 42, cuda:1)"``: how every tool names a rank."""
    bits = [b for b in (host or "", f"pid {pid}" if pid else "", device) if b]
    return f"rank {rank}" + (f" ({', '.join(bits)})" if bits else "")


def collective(op: str, seq: int | None, group: str, desc: str = "") -> str:
    """``"all_reduce #2 of group 0 (default_pg)"``: how every tool names a collective."""
    return f"{op_name(op)}" + (f" #{seq}" if seq is not None else "") + f" of group {group}" + (
        f" ({desc})" if desc else "")


def group_desc(desc: str, ranks: Sequence[int] = ()) -> str:
    """A group's description as the tools print it: its own, else (none, or torch's default "undefined") its
    ranks: "ranks 0, 1"."""
    if desc and desc != "undefined":
        return desc
    return f"ranks {', '.join(map(str, ranks))}" if ranks else ""


_OP_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
             "alltoall": "all_to_all", "alltoall_base": "all_to_all_single", "reducescatter": "reduce_scatter",
             "_reduce_scatter_base": "reduce_scatter_tensor", "allreduce_coalesced": "all_reduce_coalesced"}


def op_name(op: str) -> str:
    """One name per operation whatever spelled it (``ALLREDUCE``, ``allreduce``, ``nccl:all_reduce``):
    torch.distributed's function name, ``all_reduce``."""
    bare = op.rpartition(":")[2].strip().lower()
    return _OP_NAMES.get(bare, bare)


# --- "stuck" only when it persists ---------------------------------------------------------------

STUCK_MIN_S = 1.0  # an operation in flight for less than this is never called stuck
STUCK_FACTOR = 10.0  # ... nor for less than this many of its group's usual steps


def stuck_after(typical_s: float | None) -> float:
    """The age (seconds) from which an operation in flight counts as stuck,
    for a group whose usual step (the median time between its consecutive
    collectives) is ``typical_s`` (None: unknown)."""
    return max(STUCK_MIN_S, STUCK_FACTOR * typical_s) if typical_s else STUCK_MIN_S


def typical_step(issue_times_s: Sequence[float]) -> float | None:
    """A group's usual step: the median interval between the issue times of
    its consecutive collectives (one rank's clock); None with fewer than 3."""
    t = sorted(issue_times_s)
    gaps = [b - a for a, b in zip(t, t[1:], strict=False) if b > a]
    return statistics.median(gaps) if len(gaps) >= 2 else None


@dataclass(frozen=True)
class Look:
    """One rank's progress on one group at one look: the last collective it
    issued and the last it completed, and how long the oldest one in flight
    has been (0: none)."""

    issued: int
    completed: int
    age_s: float = 0.0


@dataclass(frozen=True)
class Stall:
    """A group held up at collective ``seq``: ``waiting`` ranks issued it
    and wait, ``holding`` ranks never issued it (the culprits; empty: every
    rank issued it and it does not complete), for ``age_s`` seconds."""

    seq: int
    waiting: tuple[int, ...]
    holding: tuple[int, ...]
    age_s: float


def stall(looks: Mapping[int, Look]) -> Stall | None:
    """What one look at a group shows: the oldest collective some rank waits
    in, who waits and who never issued it; None when nothing is in flight."""
    waiting = {r: lk.completed + 1 for r, lk in looks.items() if lk.issued > lk.completed}
    if not waiting:
        return None
    seq = min(waiting.values())
    in_it = tuple(sorted(r for r, s in waiting.items() if s == seq))
    holding = tuple(sorted(r for r, lk in looks.items() if lk.issued < seq))
    return Stall(seq, in_it, holding, max(looks[r].age_s for r in in_it))


def moved(first: Mapping[int, Look], second: Mapping[int, Look]) -> bool:
    """Whether the group moved between two looks: its stall is gone or is
    another (another collective, other ranks holding it), or a rank that
    waited completed something."""
    a, b = stall(first), stall(second)
    if a is None:
        return False
    if b is None or (b.seq, b.holding) != (a.seq, a.holding):
        return True
    return any(second[r].completed != first[r].completed for r in a.waiting if r in second)


def stuck(first: Mapping[int, Look], second: Mapping[int, Look] | None, typical_s: float | None = None
          ) -> Stall | None:
    """The rule: the group is stuck when the stall of the last look is at
    least ``stuck_after(typical_s)`` old and, with a second look, nothing of
    it moved since the first (the same collective, the same ranks waiting,
    the ranks that never issued it still have not). None otherwise (in
    progress, or slow)."""
    a = stall(first)
    if a is None:
        return None
    if second is None:
        return a if a.age_s >= stuck_after(typical_s) else None
    b = stall(second)
    if b is None or moved(first, second) or not set(a.waiting) <= set(b.waiting):
        return None
    return None if b.age_s < stuck_after(typical_s) else b


# --- stragglers --------------------------------------------------------------------------------

@dataclass(frozen=True)
class StragglerScore:
    """How late one rank arrives at one group's collectives: of the
    ``collectives`` compared, it was ``last`` at that many; its lateness
    behind the first rank (median and max) and, when last, its lead over
    the next-latest (``margin_ms``, median); the group's usual step
    (``step_ms``, between first arrivals); ``score`` = 1 - median lateness
    / step, in [0, 1]: the share of the group's step that does not go to
    waiting for it (1: never late). ``straggler``: the rule named it."""

    rank: int
    group: str
    collectives: int
    last: int
    median_ms: float
    max_ms: float
    margin_ms: float
    step_ms: float | None
    score: float
    straggler: bool = False
    host: str | None = None
    pid: int | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("median_ms", "max_ms", "margin_ms", "score"):
            d[k] = round(d[k], 3)
        d["step_ms"] = None if self.step_ms is None else round(self.step_ms, 3)
        return d

    def text(self) -> str:
        """``"rank 2 (host vm, pid 7) arrived last at 18 of 20 collectives of group '0', ..."``."""
        who_ = ", ".join(p for p in (f"host {self.host}" if self.host else "", f"pid {self.pid}" if self.pid else "")
                         if p)
        step = f" of a {self.step_ms:.1f} ms step" if self.step_ms else ""
        return (f"rank {self.rank}{f' ({who_})' if who_ else ''} arrived last at {self.last} of {self.collectives} "
                f"collectives of group {self.group!r}, {self.median_ms:.1f} ms after the first rank (median; at most "
                f"{self.max_ms:.1f} ms), {self.margin_ms:.1f} ms after the next-latest; score {self.score:.2f} "
                f"(its group waits for it {1 - self.score:.0%}{step})")


def straggler_score(median_ms: float, step_ms: float | None) -> float:
    """1 - lateness / step, clipped to [0, 1] (1 when the step is unknown and the rank is never late)."""
    if not step_ms or step_ms <= 0:
        return 1.0 if median_ms <= 0 else 0.0
    return min(1.0, max(0.0, 1.0 - median_ms / step_ms))


def markdown() -> str:
    """The catalogue as the Markdown tables docs/DIAGNOSIS.md opens with (a test checks that they agree)."""
    out = ["| class (what every tool prints) | a problem? | cause | what to do next | named by |", "|---|---|---|---|---|"]
    for c in CATALOGUE.values():
        out.append(f"| **{c.title}** (`{c.id}`) | {'yes' if c.problem else 'no'} | {c.cause} | {c.next_step} | "
                   f"{', '.join(c.tools)} |")
    out += ["", "| NCCL Analyzer verdict | here |", "|---|---|"]
    out += [f"| `{k}` | {v} |" for k, v in ANALYZER.items()]
    return "\n".join(out) + "\n"

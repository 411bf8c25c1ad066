"""Reading a folder of dumps for ``nccl-pg trace``: which file is which rank,
and each file decoded (``dump.read_decoded``: no code runs from its bytes,
and what decoding may cost is bounded) and checked against the layout the
analysis reads (``layout``), into plain values of known types. A file that
fails is a problem saying why ("not a readable dump"), never the end of the
run. A folder is read within ``Limits``: past them, the remaining files are
reported as not read. A rank's C-level stacks are found where the library
keeps them (``diagnostics.stacks``: ``<dump dir>/c_stacks/``), by rank and
pid."""

from __future__ import annotations

import collections
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import dump as _dump
from .. import stacks, untrusted
from ..frames import Frame, Thread
from ..untrusted import NotADump
from . import layout

_FILE = re.compile(r"^(.*?)(\d+)(\.json)?$")
P2P_TYPES = ("send", "recv")


@dataclass
class Dump:
    rank: int
    path: str
    data: dict[str, Any]
    entries: list[dict[str, Any]] = field(default_factory=list)
    truncated: bool = False  # entries are missing at its start (ring wrap, only_active, or dropped here)
    tracks_states: bool = True  # False for recorders that never move entries past "scheduled" (Gloo's)
    host: str | None = None
    pid: int | None = None
    threads: list[Thread] = field(default_factory=list)  # Python stacks of every thread (our dumps)
    c_threads: list[Thread] = field(default_factory=list)  # faulthandler's stacks (c_stacks_path), if any
    c_stacks_path: str | None = None
    notes: list[str] = field(default_factory=list)
    job: str | None = None  # the job it belongs to (NCCL_PG_JOB_ID; none in torch's dumps)
    raised_at: Frame | None = None  # where it raised the exception it ended on (its ending: newer than its dump)

    @property
    def time(self) -> float | None:
        """When it was written (wall clock), if it says."""
        t = self.data.get("time")
        return float(t) if isinstance(t, (int, float)) else None


@dataclass
class Limits:
    """What reading one folder may cost: bytes read and entries kept, in all."""

    max_bytes: int = 1 << 30
    max_entries: int = 1_000_000  # about 1.8 KiB of memory each once checked: under 2 GiB


def find_dumps(directory: str, prefix: str | None = None) -> tuple[dict[int, str], str, list[str]]:
    """``{rank: path}`` of the dumps in ``directory``, the prefix used, and notes.
    Without ``prefix`` it is inferred: the file-name stem (before the rank
    number) that most files share."""
    notes: list[str] = []
    names = sorted(n for n in os.listdir(directory)
                   if _file_or_link(os.path.join(directory, n)) and not n.endswith((".pipe", ".tmp"))
                   and not n.startswith("."))
    by_stem: dict[str, dict[int, str]] = collections.defaultdict(dict)
    for n in names:
        if prefix is not None:
            if not n.startswith(prefix):
                continue
            m = re.fullmatch(r"(\d+)(\.json)?", n[len(prefix):])
            if m is None:
                continue
            stem, rank = prefix, int(m.group(1))
        else:
            m = _FILE.match(n)
            if m is None:
                continue
            stem, rank = m.group(1), int(m.group(2))
        if rank in by_stem[stem]:
            notes.append(f"rank {rank}: several dumps ({os.path.basename(by_stem[stem][rank])}, {n}); "
                         f"using the first")
            continue
        by_stem[stem][rank] = os.path.join(directory, n)
    if not by_stem:
        return {}, prefix or "", notes
    stem = prefix if prefix is not None else max(by_stem, key=lambda s: (len(by_stem[s]), s))
    if prefix is None and len(by_stem) > 1:
        others = ", ".join(repr(s) for s in sorted(by_stem) if s != stem)
        notes.append(f"several file-name prefixes in {directory}; using {stem!r} (others: {others}; "
                     f"choose with --prefix)")
    return dict(sorted(by_stem[stem].items())), stem, notes


def _file_or_link(path: str) -> bool:
    """A regular file, or a symbolic link (listed so that it is reported as refused, not silently skipped)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISLNK(mode)


def load(paths: Mapping[int, str], limits: Limits | None = None) -> tuple[dict[int, Dump], list[dict[str, Any]]]:
    """Read and check the dumps; a file that is not a readable dump becomes a
    problem saying why, and the rest are read, within ``limits`` in all. A
    dump that names its own rank (ours do) wins over the rank in its file
    name."""
    limits = limits or Limits()
    dumps: dict[int, Dump] = {}
    problems: list[dict[str, Any]] = []
    read_bytes = entries = 0
    c_stacks: dict[str, dict[int, list[str]]] = {}  # per folder
    for rank, path in paths.items():
        try:
            if read_bytes >= limits.max_bytes:
                raise NotADump(f"not read: this folder's limit of {limits.max_bytes} bytes read in all was reached")
            if entries >= limits.max_entries:
                raise NotADump(f"not read: this folder's limit of {limits.max_entries} entries in all was reached")
            decoded = _dump.read_decoded(path)
            read_bytes += decoded.size
            d = check(rank, path, decoded.value, decoded.values)
            folder = os.path.dirname(path)
            if folder not in c_stacks:
                c_stacks[folder] = stacks.find(folder)
            _attach_stacks(d, c_stacks[folder].get(d.rank, []))
            if entries + len(d.entries) > limits.max_entries:
                raise NotADump(f"its {len(d.entries)} entries would pass this folder's limit of "
                               f"{limits.max_entries} entries in all")
            entries += len(d.entries)
        except Exception as exc:  # NotADump, or anything the layout check missed: never the whole run
            why = str(exc) if isinstance(exc, NotADump) else f"{type(exc).__name__}: {exc}"
            problems.append({"kind": "unreadable", "ranks": [rank], "path": path,
                             "message": f"{path}: not a readable dump ({why})"})
            continue
        if d.rank in dumps:
            problems.append({"kind": "unreadable", "ranks": [d.rank], "path": path,
                             "message": f"{path}: not used: it says it is rank {d.rank}, like "
                                      f"{dumps[d.rank].path}"})
            continue
        dumps[d.rank] = d
    return dumps, problems


@dataclass
class Folder:
    """A folder of dumps read: the dumps by rank, the problems of the files
    that are not readable dumps, the ranks known only by their C-level
    stacks, the prefix used and notes."""

    directory: str
    prefix: str
    dumps: dict[int, Dump]
    unreadable: list[dict[str, Any]]
    stacks_only: dict[int, Dump]
    notes: list[str]


def load_dir(directory: str, prefix: str | None = None, limits: Limits | None = None) -> Folder:
    """``find_dumps``, ``load`` and ``load_stacks_only`` on ``directory``."""
    paths, used, notes = find_dumps(directory, prefix)
    dumps, unreadable = load(paths, limits)
    return Folder(directory, used, dumps, unreadable, load_stacks_only(directory, dumps), notes)


def load_bytes(rank: int, data: bytes, source: str) -> Dump:
    """A dump that came as bytes rather than as a file (e.g. a rank's answer
    through the store), decoded and checked as a file's would be; NotADump
    saying why it is not one. ``source`` names it in the report."""
    decoded = untrusted.decode(data)
    return check(rank, source, decoded.value, decoded.values)


def check(rank: int, path: str, data: dict[str, Any], values_built: int) -> Dump:
    """A decoded dump (``values_built``: what decoding built, ``untrusted.Decoded.values``)
    checked into a Dump; NotADump saying why it is not one. ``path`` names
    where it came from."""
    c = layout.Checker(values_built)
    r = data.get("rank", rank)
    r = r if isinstance(r, int) and not isinstance(r, bool) and r >= 0 else rank
    raw = c.list_(data.get("entries"), "entries")
    if len(raw) > layout.MAX_ENTRIES:
        raise NotADump(f"entries: {len(raw)} of them, over the limit of {layout.MAX_ENTRIES} a dump")
    entries = [_normal(c.entry(e, i)) for i, e in enumerate(raw)]
    entries.sort(key=lambda e: e["record_id"])
    for i, e in enumerate(entries):  # the issue-time stacks "where" may show; the others are let go
        keep = i >= len(entries) - layout.FRAMES_KEPT or (e["state"] != "completed" and not e["retired"])
        e["frames"] = c.frames(e["frames"], f"entries[{i}].frames") if keep else []
    plain = {"version": c.str_(data.get("version"), "version", "?"),
             "reason": data.get("reason") if isinstance(data.get("reason"), str) else None,
             "time": c.number(data.get("time"), "time"),
             "pg_config": c.pg_config(data.get("pg_config"))}
    job = data.get("job")
    return Dump(r, path, plain, entries, host=c.opt_str(data.get("host"), "host"),
                pid=c.opt_int(data.get("pid"), "pid"), threads=c.threads(data.get("threads")),
                job=job[:64] if isinstance(job, str) else None)


def _attach_stacks(d: Dump, paths: list[str]) -> None:
    """Rank ``d``'s C-level stacks, of those its folder holds for its rank
    (newest first): the file of its pid where the dump names one, else the
    newest (a note says when there were several)."""
    if d.pid is not None:
        paths = [p for p in paths if os.path.basename(p) == os.path.basename(stacks.path("", d.rank, d.pid))]
    elif len(paths) > 1:
        d.notes.append(f"rank {d.rank}: {len(paths)} C-level stacks files and no pid in its dump to choose by; "
                       f"using the newest, {paths[0]}")
    if paths:
        read_stacks(d, paths[0])


def read_stacks(d: Dump, path: str) -> None:
    """The C-level stacks at ``path`` into ``d`` (host and pid from their
    header where ``d`` lacks them), read as untrusted like a dump; a note
    says why they were not."""
    try:
        written = stacks.read(path)
    except NotADump as exc:
        d.notes.append(f"rank {d.rank}: its C-level stacks {path}: not read ({exc})")
        return
    d.c_threads, d.c_stacks_path = written.threads(), path
    about = written.about
    d.host = d.host if d.host is not None else about.get("host")
    d.pid = d.pid if d.pid is not None else about.get("pid")
    d.job = d.job if d.job is not None else about.get("job")


def load_stacks_only(directory: str, dumps: Mapping[int, Dump]) -> dict[int, Dump]:
    """The ranks of ``directory`` known only by their C-level stacks (they
    wrote no dump: e.g. they held the GIL), as Dumps without entries: each
    from its newest file."""
    out = {}
    for rank, paths in stacks.find(directory).items():
        if rank not in dumps:
            d = Dump(rank, paths[0], {"version": "?", "reason": None, "time": None, "pg_config": {}}, truncated=True)
            _attach_stacks(d, paths)
            if d.c_threads:
                out[rank] = d
    return out


def _normal(e: dict[str, Any]) -> dict[str, Any]:
    """A checked entry plus its parsed name."""
    name = e["profiling_name"]
    lib, _, rest = name.partition(":") if ":" in name else ("", "", name)
    kind, _, meta = rest.partition(" ")
    e["_lib"], e["_kind"], e["_meta"] = lib, kind, meta
    e["_p2p"] = kind in P2P_TYPES
    return e


def outcome(e: dict[str, Any], tracks_states: bool) -> str:
    """completed / failed / started / scheduled: what became of an entry."""
    if e["state"] == "completed" or (e["retired"] and not tracks_states):
        return "completed"
    if e["retired"]:
        return "failed"
    return str(e["state"])

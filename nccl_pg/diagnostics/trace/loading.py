"""Reading a folder of dumps for ``nccl-pg trace``: which file is which rank,
and each file decoded (``dump.read``: no code runs from its bytes) and
checked against the layout the analysis reads, into plain values of known
types. A file that fails is a problem saying why ("not a readable dump"),
never the end of the run."""

from __future__ import annotations

import collections
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import dump as _dump

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


def load(paths: Mapping[int, str]) -> tuple[dict[int, Dump], list[dict[str, Any]]]:
    """Read and check the dumps; a file that is not a readable dump becomes a
    problem saying why, and the rest are read. A dump that names its own
    rank (ours do) wins over the rank in its file name."""
    dumps: dict[int, Dump] = {}
    problems: list[dict[str, Any]] = []
    for rank, path in paths.items():
        try:
            d = _checked(rank, path, _dump.read(path))
        except Exception as exc:  # NotADump, or anything the layout check missed: never the whole run
            why = str(exc) if isinstance(exc, _dump.NotADump) else f"{type(exc).__name__}: {exc}"
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


# Values checked per file at most: a small pickle can share one list many times over (its memo), and
# walking what it expands to must not run away.
_CHECK_BUDGET = 50_000_000


class _Checker:
    """Checks a dump's decoded data against the layout this tool reads, into
    plain values of known types (NotADump naming the first field that is not)."""

    def __init__(self) -> None:
        self.left = _CHECK_BUDGET

    def _spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise _dump.NotADump(f"more than {_CHECK_BUDGET} values to check")

    def int_(self, v: Any, what: str, default: int | None = 0) -> int:
        self._spend()
        if v is None and default is not None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise _dump.NotADump(f"{what} is {_kind(v)}, not an integer")
        return v

    def opt_int(self, v: Any, what: str) -> int | None:
        return None if v is None else self.int_(v, what)

    def number(self, v: Any, what: str) -> float | None:
        self._spend()
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _dump.NotADump(f"{what} is {_kind(v)}, not a number")
        return float(v)

    def str_(self, v: Any, what: str, default: str | None = None) -> str:
        self._spend()
        if v is None and default is not None:
            return default
        if not isinstance(v, str):
            raise _dump.NotADump(f"{what} is {_kind(v)}, not a string")
        return v

    def list_(self, v: Any, what: str) -> list[Any]:
        self._spend()
        if v is None:
            return []
        if not isinstance(v, (list, tuple)):
            raise _dump.NotADump(f"{what} is {_kind(v)}, not a list")
        self._spend(len(v))
        return list(v)

    def sizes(self, v: Any, what: str) -> list[Any]:
        out: list[Any] = []
        for i, s in enumerate(self.list_(v, what)):
            if isinstance(s, (list, tuple)):
                out.append([self.int_(d, f"{what}[{i}]", None) for d in self.list_(s, f"{what}[{i}]")])
            else:
                out.append(self.int_(s, f"{what}[{i}]", None))
        return out

    def entry(self, e: Any, i: int) -> dict[str, Any]:
        what = f"entries[{i}]"
        if not isinstance(e, dict):
            raise _dump.NotADump(f"{what} is {_kind(e)}, not a dict")
        pg = self.list_(e.get("process_group") or ["?", "?"], f"{what}.process_group")
        out: dict[str, Any] = {
            "record_id": self.int_(e.get("record_id"), f"{what}.record_id"),
            "process_group": (self.str_(pg[0] if pg else "?", f"{what}.process_group[0]"),
                              self.str_(pg[1] if len(pg) > 1 else "", f"{what}.process_group[1]")),
            "profiling_name": self.str_(e.get("profiling_name"), f"{what}.profiling_name", "?"),
            "state": self.str_(e.get("state"), f"{what}.state", "scheduled"),
            "retired": bool(e.get("retired")),
            "is_p2p": bool(e.get("is_p2p")),
            "time_created_ns": self.int_(e.get("time_created_ns"), f"{what}.time_created_ns"),
            "time_discovered_completed_ns": self.opt_int(e.get("time_discovered_completed_ns"),
                                                         f"{what}.time_discovered_completed_ns"),
            "duration_ms": self.number(e.get("duration_ms"), f"{what}.duration_ms"),
        }
        for k in ("collective_seq_id", "p2p_seq_id", "op_id"):
            out[k] = self.int_(e.get(k), f"{what}.{k}")
        for k in ("input_sizes", "output_sizes"):
            out[k] = self.sizes(e.get(k), f"{what}.{k}")
        for k in ("input_dtypes", "output_dtypes"):
            out[k] = [self.str_(x, f"{what}.{k}") for x in self.list_(e.get(k), f"{what}.{k}")]
        return out

    def pg_config(self, v: Any) -> dict[str, dict[str, Any]]:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise _dump.NotADump(f"pg_config is {_kind(v)}, not a dict")
        self._spend(len(v))
        out: dict[str, dict[str, Any]] = {}
        for k, cfg in v.items():
            name = cfg.get("name", k) if isinstance(cfg, dict) else k
            if isinstance(name, bool) or not isinstance(name, (str, int)):
                raise _dump.NotADump(f"pg_config has a group named by {_kind(name)}")
            name = str(name)
            if not isinstance(cfg, dict):
                out[name] = {"desc": "", "ranks": None}
                continue
            out[name] = {"desc": self.str_(cfg.get("desc"), f"pg_config[{name!r}].desc", ""),
                         "ranks": self.ranks(cfg.get("ranks"), f"pg_config[{name!r}].ranks")}
        return out

    def ranks(self, v: Any, what: str) -> list[int] | None:
        """Members as torch writes them (a string of a list, e.g. "[0, 1]") or a list; None if neither."""
        if isinstance(v, str):
            self._spend(len(v))
            if not re.fullmatch(r"\s*\[[\d,\s]*\]\s*", v):
                return None
            v = json.loads(v)
        if isinstance(v, (list, tuple)):
            return [self.int_(r, what, None) for r in self.list_(v, what)]
        return None


def _kind(v: Any) -> str:
    return "missing" if v is None else f"a {type(v).__name__}"


def _checked(rank: int, path: str, data: dict[str, Any]) -> Dump:
    c = _Checker()
    r = data.get("rank", rank)
    r = r if isinstance(r, int) and not isinstance(r, bool) and r >= 0 else rank
    raw = c.list_(data.get("entries"), "entries")
    entries = [_normal(c.entry(e, i)) for i, e in enumerate(raw)]
    entries.sort(key=lambda e: e["record_id"])
    plain = {"version": c.str_(data.get("version"), "version", "?"),
             "reason": data.get("reason") if isinstance(data.get("reason"), str) else None,
             "time": c.number(data.get("time"), "time"),
             "pg_config": c.pg_config(data.get("pg_config"))}
    return Dump(r, path, plain, entries)


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

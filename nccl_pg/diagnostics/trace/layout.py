"""A decoded dump checked against the layout ``nccl-pg trace`` reads, into
plain values of known types: NotADump naming the first field that is not,
or the first bound it crosses.

Bounds: strings of at most ``MAX_STRING`` characters, at most
``MAX_ENTRIES`` entries and ``MAX_THREADS`` thread stacks, and at most
``BUDGET_FLOOR`` + ``BUDGET_PER_VALUE`` × (the values the file built)
values walked: a pickle can refer to one value many times over for a few
bytes each, and walking (and copying) what the references expand to is
where a small file would cost a lot (``untrusted``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..frames import Frame, Thread, parse_python
from ..untrusted import NotADump

MAX_STRING = 1 << 16  # characters of any one string read (names, stack lines)
MAX_ENTRIES = 100_000  # entries of one dump (the recorder keeps 2,000 by default)
MAX_THREADS = 4096
BUDGET_FLOOR, BUDGET_PER_VALUE = 10_000, 4
FRAMES_KEPT = 16  # entries (the newest, and those still pending) whose issue-time stack is kept


def _kind(v: Any) -> str:
    return "missing" if v is None else f"a {type(v).__name__}"


class Checker:
    """Walks a decoded dump within a budget of values (see the module's doc)."""

    def __init__(self, values_built: int) -> None:
        self.budget = BUDGET_FLOOR + BUDGET_PER_VALUE * values_built
        self.left = self.budget
        self.values_built = values_built

    def _spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise NotADump(f"it refers to its values over {self.budget} times while it holds {self.values_built} "
                           f"(one value shared many times over: refused)")

    def int_(self, v: Any, what: str, default: int | None = 0) -> int:
        self._spend()
        if v is None and default is not None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise NotADump(f"{what} is {_kind(v)}, not an integer")
        return v

    def opt_int(self, v: Any, what: str) -> int | None:
        return None if v is None else self.int_(v, what)

    def number(self, v: Any, what: str) -> float | None:
        self._spend()
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise NotADump(f"{what} is {_kind(v)}, not a number")
        return float(v)

    def str_(self, v: Any, what: str, default: str | None = None, limit: int = MAX_STRING) -> str:
        self._spend()
        if v is None and default is not None:
            return default
        if not isinstance(v, str):
            raise NotADump(f"{what} is {_kind(v)}, not a string")
        if len(v) > limit:
            raise NotADump(f"{what} is a string of {len(v)} characters, over the limit of {limit}")
        self._spend(len(v) >> 6)  # a long string shared many times is copied when it is taken apart
        return v

    def ident(self, v: Any, what: str) -> int | None:
        """A thread id: an integer (ours) or its decimal string (torch's)."""
        if isinstance(v, str):
            v = int(v) if self.str_(v, what).isdigit() and len(v) < 40 else None
        return self.opt_int(v, what)

    def opt_str(self, v: Any, what: str) -> str | None:
        return None if v is None else self.str_(v, what)

    def list_(self, v: Any, what: str) -> list[Any]:
        self._spend()
        if v is None:
            return []
        if not isinstance(v, (list, tuple)):
            raise NotADump(f"{what} is {_kind(v)}, not a list")
        self._spend(len(v))
        return list(v)

    def dict_(self, v: Any, what: str) -> dict[Any, Any]:
        self._spend()
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise NotADump(f"{what} is {_kind(v)}, not a dict")
        self._spend(len(v))
        return v

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
            raise NotADump(f"{what} is {_kind(e)}, not a dict")
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
            "time_discovered_started_ns": self.opt_int(e.get("time_discovered_started_ns"),
                                                       f"{what}.time_discovered_started_ns"),
            "time_discovered_completed_ns": self.opt_int(e.get("time_discovered_completed_ns"),
                                                         f"{what}.time_discovered_completed_ns"),
            "duration_ms": self.number(e.get("duration_ms"), f"{what}.duration_ms"),
            "thread_id": self.ident(e.get("thread_id"), f"{what}.thread_id"),
            "thread_name": self.opt_str(e.get("thread_name"), f"{what}.thread_name"),
            "frames": e.get("frames"),  # checked only where kept (frames())
        }
        for k in ("collective_seq_id", "p2p_seq_id", "op_id"):
            out[k] = self.int_(e.get(k), f"{what}.{k}")
        for k in ("input_sizes", "output_sizes"):
            out[k] = self.sizes(e.get(k), f"{what}.{k}")
        for k in ("input_dtypes", "output_dtypes"):
            out[k] = [self.str_(x, f"{what}.{k}") for x in self.list_(e.get(k), f"{what}.{k}")]
        return out

    def frames(self, v: Any, what: str) -> list[Frame]:
        """An entry's issue-time stack: [{name, filename, line}], innermost first; outermost first here."""
        out = []
        for j, f in enumerate(self.list_(v, what)):
            f = self.dict_(f, f"{what}[{j}]")
            out.append(Frame(self.str_(f.get("filename"), f"{what}[{j}].filename", "?"),
                             self.int_(f.get("line"), f"{what}[{j}].line"),
                             self.str_(f.get("name"), f"{what}[{j}].name", "?")))
        return out[::-1]

    def pg_config(self, v: Any) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for k, cfg in self.dict_(v, "pg_config").items():
            name = cfg.get("name", k) if isinstance(cfg, dict) else k
            if isinstance(name, bool) or not isinstance(name, (str, int)):
                raise NotADump(f"pg_config has a group named by {_kind(name)}")
            name = self.str_(str(name), "pg_config's group name")
            if not isinstance(cfg, dict):
                out[name] = {"desc": "", "ranks": None}
                continue
            out[name] = {"desc": self.str_(cfg.get("desc"), f"pg_config[{name!r}].desc", ""),
                         "ranks": self.ranks(cfg.get("ranks"), f"pg_config[{name!r}].ranks")}
        return out

    def ranks(self, v: Any, what: str) -> list[int] | None:
        """Members as torch writes them (a string of a list, e.g. "[0, 1]") or a list; None if neither."""
        if isinstance(v, str):
            self.str_(v, what)
            if not re.fullmatch(r"\s*\[[\d,\s]*\]\s*", v):
                return None
            v = json.loads(v)
        if isinstance(v, (list, tuple)):
            return [self.int_(r, what, None) for r in self.list_(v, what)]
        return None

    def threads(self, v: Any) -> list[Thread]:
        """Our dumps' ``threads``: {"<name> (<ident>)": traceback.format_stack lines}."""
        raw = self.dict_(v, "threads")
        if len(raw) > MAX_THREADS:
            raise NotADump(f"threads: {len(raw)} of them, over the limit of {MAX_THREADS}")
        plain = {self.str_(k, "threads' key"): [self.str_(line, f"threads[{k!r}]")
                                                for line in self.list_(lines, f"threads[{k!r}]")]
                 for k, lines in raw.items()}
        return parse_python(plain)

"""Per-call configuration of a collective: ``config=CollConfig(...)`` on
any collective of a process group (NCCL's ``ncclCollConfig_t``, NCCL >=
2.31.2; docs/NCCL_BACKEND.md, "Per-call config").

Every field is checked here, on the caller's rank, before anything is
numbered or enqueued, as NCCL checks it and more: NCCL finds a bad algorithm
selection only inside the enqueue, where it leaves a nonblocking
communicator in error for good (enqueue.cc ncclEnqueueCheck). Every rank must
pass the same config ("NCCL validates it only locally", nccl.h 2.32.3): the
collective fingerprint check (``NCCL_PG_DEBUG=detail``) compares it across
ranks. The host backend validates it the same way and otherwise ignores it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

# NCCL's selectable algorithms and the collectives each serves (src/config/algorithm_registry.cc @ v2.31.2-1;
# AR all_reduce, AG all_gather, RS reduce_scatter, BC broadcast, RD reduce). all_to_all, gather and scatter
# have none: a forced selection on them is refused.
_EVERY = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "TREE_LL": ("all_reduce",), "TREE_LL128": ("all_reduce",), "TREE_SIMPLE": ("all_reduce",),
    "RING_LL": _EVERY, "RING_LL128": _EVERY, "RING_SIMPLE": _EVERY,
    "COLLNET_DIRECT_SIMPLE": ("all_reduce", "all_gather", "reduce_scatter"), "COLLNET_CHAIN_SIMPLE": ("all_reduce",),
    "NVLS_SIMPLE": ("all_reduce", "all_gather", "reduce_scatter"), "NVLSTREE_SIMPLE": ("all_reduce",),
    "PAT_SIMPLE": ("all_gather", "reduce_scatter"),
    "SYMK_AGxLL_R": ("all_reduce",), "SYMK_AGxLLMC_R": ("all_reduce",), "SYMK_RSxTmaLD_AGxTmaST": ("all_reduce",),
    "SYMK_RSxLD_AGxST": ("all_reduce",), "SYMK_RSxLDMC_AGxSTMC": ("all_reduce",),
    "SYMK_LL": ("all_gather", "reduce_scatter"), "SYMK_LLMC": ("all_gather",), "SYMK_TmaST": ("all_gather",),
    "SYMK_ST": ("all_gather",), "SYMK_TmaSTMC": ("all_gather",), "SYMK_STMC": ("all_gather",),
    "SYMK_RailRing_LsaSTMC": ("all_gather",), "SYMK_TmaLD": ("reduce_scatter",), "SYMK_LD": ("reduce_scatter",),
    "SYMK_LDMC": ("reduce_scatter",), "SYMK_RailA2A_LsaLD": ("reduce_scatter",),
    "SYMK_RailA2A_LsaLDMC": ("reduce_scatter",),
}
MAX_CTAS = 64  # MAXCHANNELS (device.h): the most channels (CTAs) a collective can use
_TAG_LIMIT = 1 << 63  # "NCCL reserves profiler-tag values with the most-significant bit set" (nccl.h)


def _matching(tag: str) -> set[str]:
    """The registry names ``tag`` selects: those it is a case-insensitive prefix of (ncclAlgTagMask)."""
    t = tag.lower()
    return {name for name in ALGORITHMS if name.lower().startswith(t)}


def selected(selection: str) -> set[str]:
    """The algorithms ``selection`` names (NCCL's grammar: ``,`` or, ``+``
    and, ``^`` not, each tag a case-insensitive prefix of a name); raises
    ValueError naming what does not parse."""
    text = "".join(ch for ch in selection if not ch.isspace())
    chosen: set[str] = set()
    for term in filter(None, text.split(",")):
        keep = set(ALGORITHMS)
        factors = [f for f in term.split("+") if f]
        if not factors:
            raise ValueError(f"CollConfig.algorithm {selection!r}: empty term {term!r}")
        for factor in factors:
            tag = factor[1:] if factor.startswith("^") else factor
            names = _matching(tag) if tag else set()
            if not names:
                raise ValueError(f"CollConfig.algorithm {selection!r}: {tag!r} names no NCCL algorithm (known: "
                                 f"{', '.join(sorted(ALGORITHMS))}; a prefix selects every name it starts)")
            keep = keep - names if factor.startswith("^") else keep & names
        if not keep:
            raise ValueError(f"CollConfig.algorithm {selection!r}: the term {term!r} selects nothing")
        chosen |= keep
    return chosen


@dataclass(frozen=True)
class CollConfig:
    """How one collective runs (NCCL's per-call ``ncclCollConfig_t``).
    Unset fields (None) leave NCCL's choice.

    - ``min_ctas``, ``max_ctas``: bounds on the CTAs (channels) it uses, 1..64,
      ``max_ctas`` at most the communicator's own ``max_ctas``;
    - ``algorithm``: NCCL's selection string (``"ring"``, ``"tree+^ll"``,
      ``"RING_SIMPLE,NVLS"``: ``,`` or, ``+`` and, ``^`` not, prefixes of
      ``ALGORITHMS``' names); ``force_algorithm``: a selection that fits no
      algorithm of the collective is an error (default) rather than NCCL's
      automatic choice;
    - ``profiler_tag``: an opaque value NCCL hands to profiler plugins with
      this call's events (below 2**63)."""

    min_ctas: int | None = None
    max_ctas: int | None = None
    algorithm: str | None = None
    force_algorithm: bool = True
    profiler_tag: int = 0

    def __post_init__(self) -> None:
        for name in ("min_ctas", "max_ctas"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_CTAS):
                raise ValueError(f"CollConfig.{name} must be an int in 1..{MAX_CTAS}, got {v!r}")
        if self.min_ctas is not None and self.max_ctas is not None and self.min_ctas > self.max_ctas:
            raise ValueError(f"CollConfig.min_ctas ({self.min_ctas}) exceeds max_ctas ({self.max_ctas})")
        if self.algorithm is not None:
            if not isinstance(self.algorithm, str):
                raise TypeError(f"CollConfig.algorithm must be a str, got {type(self.algorithm).__name__}")
            selected(self.algorithm)
        if not isinstance(self.force_algorithm, bool):
            raise TypeError(f"CollConfig.force_algorithm must be a bool, got {self.force_algorithm!r}")
        tag = self.profiler_tag
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < _TAG_LIMIT:
            raise ValueError(f"CollConfig.profiler_tag must be an int in 0..2**63-1 (NCCL reserves the values with "
                             f"the top bit set), got {tag!r}")

    def check_for(self, collective: str, comm_max_ctas: int | None) -> None:
        """Raise ValueError if this config cannot apply to ``collective``
        (an NCCL function name: all_reduce, all_gather, ...) on a
        communicator whose own CTA limit is ``comm_max_ctas``."""
        if comm_max_ctas is not None and self.max_ctas is not None and self.max_ctas > comm_max_ctas:
            raise ValueError(f"CollConfig.max_ctas ({self.max_ctas}) exceeds the communicator's max_ctas "
                             f"({comm_max_ctas}); nccl.h: \"must be <= comm->maxCTAs\"")
        if self.algorithm and self.force_algorithm:
            fits = {n for n in selected(self.algorithm) if collective in ALGORITHMS[n]}
            if not fits:
                raise ValueError(f"{collective}: CollConfig.algorithm {self.algorithm!r} selects no algorithm NCCL has "
                                 f"for {collective} (force_algorithm=False lets NCCL choose instead)")

    def digest(self) -> int:
        """A number equal on every rank that passes the same config (the fingerprint check compares it)."""
        text = f"{self.min_ctas}|{self.max_ctas}|{self.algorithm}|{self.force_algorithm}|{self.profiler_tag}"
        return zlib.crc32(text.encode())

    def describe(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if v is not None and v != CollConfig.__dict__.get(k)}
        return "CollConfig(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"

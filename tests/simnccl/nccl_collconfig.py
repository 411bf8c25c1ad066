"""Per-call configuration of collectives (``ncclCollConfig_t``, the
``nccl*Config`` entry points) in the simulated NCCL. It proves our logic
against NCCL's code as read at the tags named, never GPU behaviour.

- The entry points exist from v2.31.2-1 (``src/collectives.cc``
  ncclAllReduceConfig ... ncclScatterConfig; ``ncclCollConfig_v23100`` in
  that tag's ``src/nccl.h.in``); ``launchCompletionEvent`` was appended in
  v2.32.3-1 (``ncclCollConfig_v23200``, nccl.h of nvidia-nccl 2.32.3; release
  notes 2.32.3: "Adds ncclCollConfig_t::launchCompletionEvent"). A config is
  read as ncclParseCollConfig reads it (``src/config/collconfig.cc`` @
  v2.32.3-1): NULL is no config; otherwise at most the library's own struct
  (so a 2.31 library never sees a 2.32 caller's event), ``magic`` must be
  NCCL_API_MAGIC, ``forceAlgSelection`` 0 or 1, ``CTAPolicy`` unset or in
  [0, DEFAULT|EFFICIENCY|ZERO]; a refusal is ncclInvalidArgument before the
  enqueue (the communicator is untouched: collectives.cc calls
  ncclParseCollConfig before ncclEnqueueCheck).
- ``algSelection`` (``src/config/algorithm_parser.cc`` ncclAlgParse,
  ``algorithm_registry.cc`` @ v2.31.2-1): terms separated by ``,`` (or), factors
  by ``+`` (and), ``^`` negates; a tag selects the registry names it is a
  case-insensitive prefix of; whitespace is dropped. A selection that does not
  parse, or selects no algorithm valid for the function, is ncclInvalidArgument
  when ``forceAlgSelection`` is set (ncclCollConfigGetAlgMask), found inside
  the enqueue (enqueue.cc taskAppend), so a nonblocking communicator is left in
  that error (ncclEnqueueCheck's ``fail:`` path: ncclCommSetAsyncError).
  AlltoAll, Gather and Scatter have no selectable algorithm.
- ``launchCompletionEvent`` (enqueue.cc ncclLaunchKernel, 2.32 sources): NCCL
  records the caller's event when the collective's kernel launch completes
  (CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT; before CUDA 12.3 "recording
  the user event before launch"): here it completes once the work queued on
  the stream before the kernel has run, the moment the kernel starts. "At most
  one non-NULL event per communicator is supported in a group" (nccl.h 2.32.3;
  enqueue.cc counts them per group, ncclRecordCollConfigLaunchCompletionEvent):
  a second is refused with ncclInvalidUsage at the group's end.
- "The same configuration must be set on every rank; NCCL validates it only
  locally" (nccl.h), and "Every rank must provide a non-NULL event or every
  rank must provide NULL": the kernels exchange each configured collective's
  settings and record a violation when ranks differ (undefined on a GPU: a
  hang or wrong results).
"""

from __future__ import annotations

import ctypes
from typing import Any

import nccl.bindings.nccl as real  # type: ignore[import-untyped]

from .nccl_state import API_MAGIC, INVALID_ARGUMENT, UNDEF, NCCLError

LAUNCH_EVENT_VERSION = 23203  # ncclCollConfig_v23200.launchCompletionEvent (v2.32.3-1)
_SIZE_2_31 = 64  # sizeof(ncclCollConfig_v23100): up to userProfilerTag
CTA_POLICY_ALL = 0x00 | 0x01 | 0x02  # NCCL_CTA_POLICY_DEFAULT | EFFICIENCY | ZERO (nccl.h)

# algorithm_registry.cc @ v2.31.2-1: name -> the functions it serves (AR, AG, RS, BC, RD).
_ALL = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"})
_AR, _AG, _RS = frozenset({"all_reduce"}), frozenset({"all_gather"}), frozenset({"reduce_scatter"})
REGISTRY: tuple[tuple[str, frozenset[str]], ...] = (
    ("TREE_LL", _AR), ("TREE_LL128", _AR), ("TREE_SIMPLE", _AR), ("RING_LL", _ALL), ("RING_LL128", _ALL),
    ("RING_SIMPLE", _ALL), ("COLLNET_DIRECT_SIMPLE", _AR | _AG | _RS), ("COLLNET_CHAIN_SIMPLE", _AR),
    ("NVLS_SIMPLE", _AR | _AG | _RS), ("NVLSTREE_SIMPLE", _AR), ("PAT_SIMPLE", _AG | _RS),
    ("SYMK_AGxLL_R", _AR), ("SYMK_AGxLLMC_R", _AR), ("SYMK_RSxTmaLD_AGxTmaST", _AR), ("SYMK_RSxLD_AGxST", _AR),
    ("SYMK_RSxLDMC_AGxSTMC", _AR), ("SYMK_LL", _AG), ("SYMK_LLMC", _AG), ("SYMK_TmaST", _AG), ("SYMK_ST", _AG),
    ("SYMK_TmaSTMC", _AG), ("SYMK_STMC", _AG), ("SYMK_RailRing_LsaSTMC", _AG), ("SYMK_LL", _RS),
    ("SYMK_TmaLD", _RS), ("SYMK_LD", _RS), ("SYMK_LDMC", _RS), ("SYMK_RailA2A_LsaLD", _RS),
    ("SYMK_RailA2A_LsaLDMC", _RS))
_ALL_BITS = (1 << len(REGISTRY)) - 1


class CollConfig:
    """A parsed per-call config: what the simulation keeps of it."""

    __slots__ = ("min_ctas", "max_ctas", "nvls_ctas", "cga", "alg", "force", "cta_policy", "tag", "event")

    def __init__(self, raw: Any, size: int) -> None:
        self.min_ctas, self.max_ctas, self.nvls_ctas = raw.min_ctas, raw.max_ctas, raw.nvls_ctas
        self.cga, self.force, self.cta_policy = raw.cga_cluster_size, raw.force_alg_selection, raw.cta_policy
        self.tag = raw.user_profiler_tag
        self.alg = raw.alg_selection or ""
        self.event = raw.launch_completion_event_handle if size > _SIZE_2_31 else 0

    def signature(self) -> tuple[Any, ...]:
        """What must agree across ranks (the event only by its presence: it is rank-local)."""
        return (self.min_ctas, self.max_ctas, self.nvls_ctas, self.cga, self.alg, self.force, self.cta_policy,
                self.tag, bool(self.event))


def parse(ptr: int, version: int) -> CollConfig | None:
    """ncclParseCollConfig: the config at ``ptr`` (0: none), or NCCLError(ncclInvalidArgument)."""
    if not ptr:
        return None
    own = real.CollConfig()  # NCCL_COLLCONFIG_INITIALIZER of the 2.32.3 header
    limit = own.size_ if version >= LAUNCH_EVENT_VERSION else _SIZE_2_31
    size = min(ctypes.c_size_t.from_address(ptr).value, limit)
    own.magic = 0
    ctypes.memmove(own.ptr, ptr, size)
    if own.magic != API_MAGIC:  # "ncclCollConfig_t magic mismatch"
        raise NCCLError(INVALID_ARGUMENT)
    if own.force_alg_selection not in (0, 1):
        raise NCCLError(INVALID_ARGUMENT)
    if own.cta_policy != UNDEF and not 0 <= own.cta_policy <= CTA_POLICY_ALL:
        raise NCCLError(INVALID_ARGUMENT)
    return CollConfig(own, size)


def _tag_mask(tag: str) -> int:
    """ncclAlgTagMask: the registry names ``tag`` is a case-insensitive prefix of."""
    t = tag.lower()
    return sum(1 << i for i, (name, _) in enumerate(REGISTRY) if name.lower().startswith(t))


def alg_mask(sel: str) -> int | None:
    """ncclAlgParse: the selected algorithms' mask (0: automatic), None when it does not parse."""
    s = "".join(ch for ch in sel if ch not in " \t\n\r")
    if not s:
        return 0
    mask = 0
    for term in filter(None, s.split(",")):  # strtok_r skips empty tokens
        term_mask, factors = _ALL_BITS, 0
        for factor in filter(None, term.split("+")):
            neg = factor.startswith("^")
            tag = factor[1:] if neg else factor
            tm = _tag_mask(tag) if tag else 0
            if tm == 0:  # a bare '^' or an unknown tag
                return None
            term_mask &= (_ALL_BITS & ~tm) if neg else tm
            factors += 1
        if factors == 0 or term_mask == 0:  # "a,+,b" / a contradictory term
            return None
        mask |= term_mask
    return mask


def alg_refused(cfg: CollConfig | None, kind: str) -> bool:
    """ncclCollConfigGetAlgMask: a forced selection that does not parse or selects nothing for ``kind``."""
    if cfg is None or not cfg.alg or not cfg.force:
        return False
    mask = alg_mask(cfg.alg)
    valid = sum(1 << i for i, (_, kinds) in enumerate(REGISTRY) if kind in kinds)
    return mask is None or mask & valid == 0

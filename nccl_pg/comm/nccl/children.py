"""Children of NcclCommunicator (a mixin of communicator.py): split,
shrink and revoke, and the splits it makes of its own communicators. NCCL
writes a child (``*newcomm``) only when its job ends (init.cc
ncclCommInitRankFunc, ``exit:`` label; NULL until then), and nccl4py 0.6
passes the new ``Comm`` object's own storage as ``newcomm``: the object is
kept until then, and the parent polled out of ncclInProgress.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import DistBackendError
from ..base import WAIT_READY_GRACE, CommConfig, CommState, check_exclude
from . import _lib
from ._lib import NOCOLOR, bindings
from .config import nccl_config
from .device import adopt_thread, device_guard, restore_device
from .family import Family
from .operations import Operations


class Children(Operations):
    _mode: str
    _rank_known: bool
    _split_count: int
    _abort_on_destroy: bool
    _keep: list[Any]

    def _sibling(self, nranks: int, rank: int, cfg: CommConfig, name: str, family: Family | None) -> Children:
        """A new NcclCommunicator for a child, in ``family`` (None: its own), of this one's variant."""
        return type(self)(nranks, rank, self.device, cfg, name, family, self._mode)  # type: ignore[call-arg]

    def _ctl_config(self, cfg: CommConfig) -> Any:
        """A control communicator's config: nonblocking; in the blocking variant with ``splitShare=1`` so that
        its operations communicator shares its abort flag (user splits go through the split source)."""
        return nccl_config(cfg, split_share=True if self._mode == "blocking" else None)

    def _start(self, step: Any, arg: Any, kind: str) -> None:
        """Run a new communicator's init-like ``step(arg, deadline, own_thread)``: inline under a blocking config
        (its error raised, the communicator freed), else on a thread of its own that the caller polls."""
        deadline = time.monotonic() + self.config.timeout
        if self.config.blocking:
            step(arg, deadline)
            if self._error is not None:
                self.destroy()
                raise self._error
        else:
            threading.Thread(target=step, args=(arg, deadline, True), daemon=True,
                             name=f"nccl_pg-nccl-{kind}-{self.name}").start()

    def _fail(self, exc: BaseException, what: str) -> None:
        """An init, split or shrink failed: record why, and free what NCCL created."""
        self._set_error(exc if isinstance(exc, DistBackendError) else DistBackendError(
            f"{self.name}: {what} failed on rank {self._rank}: {exc}"))
        self._abort_handles()
        self._ready.set()

    def _open_ops(self, deadline: float) -> None:
        """Blocking variant: split the blocking operations communicator off the control one (its job runs on
        the nonblocking parent, polled: group.cc ncclAsyncLaunch takes the group's kind from the parent). Then
        READY."""
        if self._mode == "blocking":
            self._ops = self._split_sync(self._ctl, nccl_config(self.config, blocking=True), deadline,
                                         "init (split of the operations communicator)")
        else:
            self._ops = self._ctl
        with self._state_lock:
            if self._state is CommState.INITIALIZING and not self._freed:
                self._state = CommState.READY

    def _split_sync(self, parent: Any, cfg: Any, deadline: float, what: str) -> Any:
        """A split of one of this communicator's own nonblocking communicators into another of its own (color
        0, key = rank), waited for."""
        self._keep.append(cfg)
        child = self._start_child("ncclCommSplit", bindings().comm_split, parent, 0, self._rank, cfg)
        self._poll(deadline, what, parent)  # the parent leaves ncclInProgress
        self._acquire(what)
        try:  # NCCL has written the child now (init.cc ncclCommInitRankFunc)
            self._take_child(child)
            if not child.handle:
                raise DistBackendError(f"{self.name}: {what} wrote no communicator on rank {self._rank}")
            return child
        finally:
            self._lock.release()

    def _take_child(self, child: Any) -> None:
        """Hand a written child over to its new owner; raises if an abort already freed it."""
        for i, c in enumerate(self._children):
            if c is child:
                del self._children[i]
                return
        raise self._error or DistBackendError(f"{self.name}: aborted while a split was in progress")

    # --- split ------------------------------------------------------------------------------------------

    @property
    def split_count(self) -> int:
        return self._split_count

    def _split_source(self, deadline: float) -> Any:
        """The communicator user splits are made of: the control one, or in the blocking variant (where the
        control one shares its resources with every child) a nonblocking split of it with the user's
        split_share, made at the first split."""
        if self._mode != "blocking":
            return self._ctl
        if self._src is None:
            self._wait_ctl_idle(deadline, "split")
            self._src = self._split_sync(self._ctl, nccl_config(self.config), deadline, "split")
        return self._src

    def split(self, color: int | None, key: int, config: CommConfig | None = None) -> Children | None:
        """ncclCommSplit (NCCL >= 2.18); ``color=None`` takes part with NCCL_SPLIT_NOCOLOR and gets None."""
        if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"split color must be a non-negative int or None, got {color!r}")
        if self._version < _lib.V_SPLIT:
            raise DistBackendError(f"ncclCommSplit needs NCCL >= 2.18; this is {_lib.version_tuple(self._version)}")
        self._ops_comm()  # READY
        cfg = config or self.config
        deadline = time.monotonic() + cfg.timeout
        try:
            parent = self._split_source(deadline)
        except BaseException as exc:
            self._fail(exc, "split")
            raise
        self._wait_ctl_idle(deadline, "split")
        ncfg = self._ctl_config(cfg)
        self._split_count += 1
        child_obj = self._start_child("ncclCommSplit", bindings().comm_split, parent,
                                      NOCOLOR if color is None else int(color), int(key), ncfg)
        if color is None:  # no child; the parent must still finish its part before anything else uses it
            try:
                self._poll(deadline, "split", parent)
            except BaseException as exc:
                self._fail(exc, "split")
                raise
            self._acquire("split")
            try:
                self._take_child(child_obj)  # NCCL never writes it (init.cc: NCCL_SPLIT_NOCOLOR)
            finally:
                self._lock.release()
            return None
        shares = bool(self.config.split_share)  # the parent's splitShare decides (init.cc ncclCommInitChildComm)
        child = self._sibling(self._nranks, 0, cfg, f"{self.name}.{color}", self._family if shares else None)
        self._finish_child(child, child_obj, ncfg, deadline, "split", cfg.blocking, parent)
        return child

    def _start_child(self, what: str, fn: Any, parent: Any, *args: Any) -> Any:
        """Issue a split or shrink of ``parent``; returns the nccl4py Comm NCCL writes the child into when the
        job ends (it must stay referenced until then: the binding passed its own storage)."""
        return self._start_job(what, fn, parent, *args, keep=True)

    def _start_job(self, what: str, fn: Any, *args: Any, keep: bool = False) -> Any:
        """Issue ``fn(*args)``, a call whose job runs on the control communicator (polled out of ncclInProgress
        by the caller, ``_poll``), under the family lock on this communicator's device; ``keep``: its result is
        a child NCCL writes when the job ends (kept referenced until then)."""
        prev = device_guard(self.device)
        try:
            self._acquire(what)
            try:
                self._check_live(what)
                self._ctl_idle.clear()
                try:
                    result = self._call(what, fn, *args)
                except BaseException:
                    self._ctl_idle.set()
                    raise
                if keep:
                    self._children.append(result)
                return result
            finally:
                self._lock.release()
        finally:
            restore_device(prev)

    def _finish_child(self, child: Children, child_obj: Any, ncfg: Any, deadline: float, what: str,
                      blocking: bool, parent: Any) -> None:
        """Poll the parent until its job ends (NCCL writes the child then), read
        the child, open its operations communicator; a failure frees the child
        and the parent's poll error stays the parent's."""
        child._keep.append(ncfg)
        if what == "split":
            child._rank_known = False  # until NCCL says which rank it is

        def finish() -> None:
            try:
                try:
                    self._poll(deadline, what, parent)
                except BaseException as exc:  # NCCL puts the parent in error too (or it is stuck in progress)
                    self._fail(exc, what)  # its abort frees the child it may have written
                    raise
                self._acquire(what)
                try:  # written by NCCL now, failed or not: from here the child frees it
                    self._take_child(child_obj)
                    child._ctl = child_obj if child_obj.handle else None
                finally:
                    self._lock.release()
                if child._ctl is None:
                    raise DistBackendError(f"{self.name}: {what} wrote no communicator on rank {self._rank}")
                child._learn_rank()
                child._open_ops(deadline)
            except BaseException as exc:
                child._fail(exc, what)
            finally:
                child._ready.set()

        if blocking:
            finish()
            child.wait_ready(0)
        else:
            def run() -> None:
                try:
                    adopt_thread(self.device)
                except BaseException as exc:
                    child._fail(exc, what)
                    return
                finish()

            threading.Thread(target=run, daemon=True, name=f"nccl_pg-nccl-{what}-{child.name}").start()

    def _learn_rank(self) -> None:
        b = bindings()
        self._acquire("split")
        try:
            self._rank = int(self._call("ncclCommUserRank", b.comm_user_rank, self._ctl))
            self._nranks = int(self._call("ncclCommCount", b.comm_count, self._ctl))
        finally:
            self._lock.release()
        self._rank_known = True

    # --- shrink and revoke ------------------------------------------------------------------------------

    @property
    def supports_shrink(self) -> bool:  # type: ignore[override]
        return self._version >= _lib.V_SHRINK

    @property
    def supports_revoke(self) -> bool:  # type: ignore[override]
        return self._version >= _lib.V_REVOKE

    shrink_refuses_errors = True  # ncclCommShrink's ncclCommEnsureReady refuses a parent that reports an error

    def can_shrink(self) -> bool:
        """Whether ncclCommShrink would take this communicator now: NCCL refuses a parent whose
        ncclCommGetAsyncError reports an error (init.cc ncclCommInitChildComm -> ncclCommEnsureReady), a lost
        network peer's included (the proxy's asyncResult, which neither a revoke nor NCCL_SHRINK_ABORT clears)."""
        if not self.supports_shrink or self._freed or self._ctl is None or self._state in (
                CommState.INITIALIZING, CommState.ABORTED, CommState.DESTROYED):
            return False
        try:
            self._acquire("shrink")
        except DistBackendError:
            return False
        try:
            code = int(bindings().comm_get_async_error(self._ctl))
        except Exception:
            return False
        finally:
            self._lock.release()
        return code == _lib.SUCCESS

    def _need(self, version: int, what: str) -> None:
        if self._version < version:
            raise DistBackendError(f"{what} needs NCCL >= {'.'.join(map(str, _lib.version_tuple(version)))}; "
                                   f"this is {'.'.join(map(str, _lib.version_tuple(self._version)))}")

    def shrink(self, exclude: Sequence[int], config: CommConfig | None = None,
               abort_first: bool = False) -> Children:
        """ncclCommShrink of the control communicator (NCCL >= 2.27);
        ``abort_first`` passes NCCL_SHRINK_ABORT (the abort flag of the
        control communicator, the operations' too, stops what is in flight).
        The child shares nothing (shrinkShare unset; never with
        NCCL_SHRINK_ABORT). Allowed in error or revoked, not once aborted or
        destroyed; after an abortive shrink the parent is aborted at destroy,
        never finalized (pytorch#194775: such a finalize hangs with NCCL >=
        2.31)."""
        self._need(_lib.V_SHRINK, "ncclCommShrink")
        excluded = check_exclude(exclude, self._nranks, self._rank)
        if self._state is CommState.INITIALIZING:
            self.wait_ready(self.config.timeout + WAIT_READY_GRACE)
        cfg = config or self.config
        deadline = time.monotonic() + cfg.timeout
        self._wait_ctl_idle(deadline, "shrink")
        ncfg = self._ctl_config(cfg)
        flags = _lib.SHRINK_ABORT if abort_first else _lib.SHRINK_DEFAULT
        child_obj = self._start_child("ncclCommShrink", bindings().comm_shrink, self._ctl, excluded, len(excluded),
                                      ncfg, flags)
        if abort_first:
            self._abort_on_destroy = True
        survivors = [r for r in range(self._nranks) if r not in excluded]
        child = self._sibling(len(survivors), survivors.index(self._rank), cfg, f"{self.name}.shrink", None)
        self._finish_child(child, child_obj, ncfg, deadline, "shrink", cfg.blocking, self._ctl)
        return child

    def revoke(self) -> None:
        """ncclCommRevoke of the control communicator (NCCL >= 2.28.7): its
        abort flag, the operations' too, stops the operations in flight; it may
        answer ncclInProgress, so it is polled (bounded) until NCCL says it is
        quiescent; past the deadline it is aborted. Later operations are
        refused here, and destroy() aborts it (finalize is invalid after a
        revoke). Nothing to do once revoked, aborted or destroyed: NCCL
        refuses a second revoke (init.cc: "Disallow revoke if revoke in
        progress"), and an abort stopped everything already."""
        self._need(_lib.V_REVOKE, "ncclCommRevoke")
        if self._state is CommState.INITIALIZING:
            self.wait_ready(self.config.timeout + WAIT_READY_GRACE)
        if self._freed or self._state in (CommState.REVOKED, CommState.ABORTED, CommState.DESTROYED):
            return
        deadline = time.monotonic() + self.config.timeout
        self._wait_ctl_idle(deadline, "revoke")
        self._set_error(DistBackendError(f"{self.name}: communicator revoked on rank {self._rank}"),
                        CommState.REVOKED)
        self._abort_on_destroy = True
        self._acquire("revoke")
        try:
            self._check_live("revoke")
            self._ctl_idle.clear()
            try:
                bindings().comm_revoke(self._ctl, 0)
            except Exception as exc:
                # A nonblocking revoke ends with ncclCommGetAsyncError (init.cc ncclCommRevoke): an error the
                # communicator reported before (a lost network peer: the proxy's asyncResult) comes back too,
                # and the revoke was made all the same. Only its own refusals are failures.
                if getattr(exc, "status", None) in (None, _lib.INVALID_ARGUMENT, _lib.INVALID_USAGE):
                    self._ctl_idle.set()
                    err = DistBackendError(f"{self.name}: ncclCommRevoke failed on rank {self._rank}: "
                                           f"{type(exc).__name__}: {exc}")
                    self._set_error(err)
                    raise err from exc
        finally:
            self._lock.release()
        try:
            self._settled(deadline, "revoke")  # quiescent; an earlier error it reports stays the communicator's
        except DistBackendError as exc:
            self._set_error(exc)
            self._abort_handles()
        for s in self._streams:
            s.release_kept()

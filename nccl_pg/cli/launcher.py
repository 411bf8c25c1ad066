"""`nccl-pg run`: start N local ranks with the env:// variables set.

The launcher hosts the rendezvous TCPStore itself, so that rank 0 dying does
not take the store down for the others. Each rank runs in its own session, so
that signalling its process group reaches everything it started. One
single-threaded loop multiplexes the ranks' output pipes, signals (through a
wakeup pipe) and deadlines; nothing else signals or reaps the ranks, so there
are no races between threads over who reaps or kills what. It never blocks on
its own output: what it prints goes through output.py's sinks (a bounded
buffer and a writer thread each), so a reader that stops reading cannot stop
the deadlines or the signals.

Before it stops a job (``--max-time``, the first rank to fail, a signal), it
asks the ranks why (autopsy.py, on a thread of its own that only talks to
the store and reads files; bounded by ``--autopsy-time``), and it keeps a
record of the job for `nccl-pg why` (jobs.py), removed when it exits.
Stopping is SIGTERM to each rank's process group, then, after the grace
period, the kill signal to each rank's guard (_rank_guard.py), which kills
the rank and everything below it, its own sessions included; only a guard
that does not do so in time is SIGKILLed.
"""

from __future__ import annotations

import os
import secrets
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO

from .. import env, process_tree
from ..diagnostics import dump, jobs_folder
from ..errors import DistError
from ..store import TCPStoreServer
from . import elastic, jobs, output, ui
from ._rank_guard import CLEANUP_BUDGET, KILL_SIGNAL
from .autopsy import Autopsy
from .elastic_stuck import StuckWatch
from .job_files import JobFiles
from .launch_options import LaunchConfig

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_MAX_TIME = 124  # as timeout(1)
# After the guards are told to kill: their own bound, and a second for them to exit.
GUARD_KILL_WAIT = CLEANUP_BUDGET + 1.0
READ_SIZE = 65536
MAX_LINE = 1 << 20  # a longer line without a newline is written out in pieces


# --- the job -----------------------------------------------------------------

def launch(config: LaunchConfig) -> int:
    """Run the job to the end; returns the launcher's exit status."""
    return _Job(config).run()


def exit_status(returncode: int) -> int:
    """A shell-style status: Popen reports death by signal N as -N."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by signal {_signame(-returncode)} ({-returncode})"
    return f"exited with code {returncode}"


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


_console: output.Console | None = None  # the running job's outputs (the launcher runs one job per process)
OUTPUT_FLUSH = 2.0  # seconds, at the end, for the outputs to write out what they hold


def _log(message: str) -> None:
    line = f"nccl-pg run: {message}"
    if _console is not None:
        _console.log(line)
    else:
        print(line, file=sys.stderr, flush=True)


class _LineWriter:
    """Writes a rank's output line by line with a prefix, so that lines of
    different ranks never interleave mid-line."""

    def __init__(self, prefix: bytes, out: output.Sink) -> None:
        self.prefix = prefix
        self.out = out
        self.partial = b""

    def feed(self, data: bytes) -> None:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        if len(self.partial) >= MAX_LINE:
            lines.append(self.partial)
            self.partial = b""
        self._write(lines)

    def finish(self) -> None:
        if self.partial:
            self._write([self.partial])
            self.partial = b""

    def _write(self, lines: list[bytes]) -> None:
        if lines:
            self.out.write(b"".join(self.prefix + line + b"\n" for line in lines), len(lines))


class _Stream:
    """One output pipe of a rank and where its lines go."""

    def __init__(self, pipe: IO[bytes], writer: _LineWriter) -> None:
        self.pipe = pipe
        self.writer = writer

    def read(self) -> bool:
        """Pass on what is available; False at end of file."""
        data = os.read(self.pipe.fileno(), READ_SIZE)
        self.writer.feed(data)
        return bool(data)

    def close(self) -> None:
        self.writer.finish()
        self.pipe.close()


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    returncode: int | None = None
    own_pid: int | None = None  # the rank's process, below its guard (what the rank and the verdicts call its pid)
    # --elastic: ``rank`` is the member number, and the rank changes with each configuration: the writers, whose
    # prefix says the rank the progress file last gave ("[rank1|member3]: "), and that rank
    labelled: list[_LineWriter] | None = None
    shown_rank: int = -1

    @property
    def pid(self) -> int:
        """The guard's pid (the launcher's child)."""
        return self.proc.pid

    def find_own_pid(self) -> int | None:
        """The rank's own pid: its guard's one child (read once, while both run)."""
        if self.own_pid is None and self.returncode is None:
            self.own_pid = process_tree.only_child(self.pid)
        return self.own_pid

    def name(self) -> str:
        """"rank 1 (pid 4242)", or "member 1 (pid 4242)" under --elastic: by the rank's own pid once known, as
        every verdict names it."""
        kind = "rank" if self.labelled is None else "member"
        return f"{kind} {self.rank} (pid {self.own_pid or self.pid})"

    def signal_group(self, signum: int) -> None:
        """Signal the rank and everything it started (its session's group).
        Only called before the rank is reaped: until then its pid, which is
        also the group id, cannot be reused."""
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Ask the guard to kill the rank and everything below it (a SIGKILL of
        the group would kill the guard too, orphaning what the rank started in
        other sessions)."""
        try:
            os.kill(self.pid, KILL_SIGNAL)
        except ProcessLookupError:
            pass

    def exited(self) -> bool:
        """True once the rank has exited; it is left unreaped (a zombie)."""
        return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def reap(self) -> int:
        self.signal_group(signal.SIGKILL)  # leftovers of the rank, before the group id can be reused
        self.returncode = self.proc.wait()
        return self.returncode


class _Job:
    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.ranks: list[_Rank] = []
        self.selector = selectors.DefaultSelector()
        self.streams: dict[int, _Stream] = {}  # by file descriptor
        self.wake_r, self.wake_w = os.pipe()  # signal wakeup pipe
        self.pending_signals: list[int] = []
        self.exit_code: int | None = None  # set when the job starts stopping
        started = time.monotonic()
        self.started_wall = time.time() - 1.0  # (file times are coarser than the clock)
        self.max_time_at = None if config.max_time is None else started + config.max_time
        self.kill_at: float | None = None  # tell the guards to kill what is still running then
        self.hard_kill_at: float | None = None  # SIGKILL the groups of guards that did not do it by then
        self.drain_until: float | None = None  # bound on output after the last rank exits
        self.server: TCPStoreServer | None = None
        self.store: tuple[str, int, str] | None = None  # the rendezvous store's address, port and secret
        self.autopsy: Autopsy | None = None
        self.stop_after_autopsy: tuple[int, str] | None = None  # the signal and reason of the stop it holds back
        self.membership: elastic.Membership | None = None  # --elastic: the records, the replacements
        self.stuck: StuckWatch | None = None  # --elastic: the hung ranks the others named
        self.stuck_to_stop: list[tuple[int, str]] = []  # (member, why), from the stuck watch's thread
        self.common_env: dict[str, str] = {}  # what every rank's environment holds (a replacement's too)
        self.console = output.Console()  # the launcher's stdout and stderr (output.py)
        self.files: JobFiles | None = None  # the job's id, folder, progress files (job_files.py)
        self.endings: list[jobs_folder.Ending] = []  # how each rank ended, as they are reaped

    def run(self) -> int:
        global _console
        _console = self.console
        try:
            return self._run()
        finally:
            _console = None
            self.console.close(OUTPUT_FLUSH)

    def _run(self) -> int:
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        old_wakeup = signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        old_handlers = {s: signal.signal(s, self._on_signal) for s in FORWARDED_SIGNALS}
        old_handlers[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        server = page = None
        record = None
        try:
            try:
                self.files = JobFiles.start(self.config.stall_warning, os.environ)
            except OSError as exc:
                _log(f"warning: no folder for this job's dumps and progress ({exc}); no stall line")
            secret = env.STORE_SECRET.get() or secrets.token_hex(16)
            server = _start_store(self.config, secret)
            if server is None:
                return 1
            self.server, self.store = server, (self.config.master_addr, server.port, secret)
            if self.config.ui and not (page := ui.launcher_page(self.config.ui, self.store, self.config.nproc,
                                                                self.config.command, self._gone, _log)):
                return 1
            record = _record(self.config, server.port, secret)
            self._spawn_all(server.port, secret)
            self._supervise()
        finally:
            self._kill_remaining()
            if self.files is not None:
                self._finish_files()
            if record is not None:
                jobs.remove(record)
            for stream in self.streams.values():  # left open only when leaving on an exception
                stream.pipe.close()
            if self.stuck is not None:
                self.stuck.close()
            if self.membership is not None:
                self.membership.close()
            if page is not None:
                page.close()
            if server is not None:
                server.stop()
            for signum, handler in old_handlers.items():
                signal.signal(signum, handler)
            signal.set_wakeup_fd(old_wakeup)
            self.selector.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
        return self.exit_code or 0

    def _finish_files(self) -> None:
        assert self.files is not None
        failed = self.exit_code not in (None, 0)
        path = self.files.finish(failed, self.endings, lambda: [r.own_pid or r.pid for r in self.ranks])
        if path is not None:
            _log(f"how each rank ended: {path} (nccl-pg trace {os.path.dirname(path)})")

    def _on_signal(self, signum: int, frame: object) -> None:
        self.pending_signals.append(signum)  # handled by the loop, outside the handler

    # -- starting ---------------------------------------------------------

    def _spawn_all(self, port: int, secret: str) -> None:
        cfg = self.config
        common = {
            **os.environ,
            "WORLD_SIZE": str(cfg.nproc),
            "LOCAL_WORLD_SIZE": str(cfg.nproc),
            "GROUP_RANK": "0",
            "MASTER_ADDR": cfg.master_addr,
            "MASTER_PORT": str(port),
            env.USE_AGENT_STORE.name: "1",
            env.STORE_SECRET.name: secret,
            "PYTHONUNBUFFERED": "1",
        }
        if cfg.torch_clients:  # torch's env:// connects to the launcher's store, as to torchrun's agent's
            common["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        if cfg.elastic:
            self._spawn_elastic(cfg.elastic, common, port, secret)
            return
        for rank in range(cfg.nproc):
            self._spawn(rank, {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)})

    def _spawn_elastic(self, opts: elastic.ElasticOptions, common: dict[str, str], port: int, secret: str) -> None:
        """--elastic: the ranks the records say (cli/elastic.py), and the watch for hung ones."""
        self.membership = elastic.Membership.open(opts, self.config.nproc, self.config.master_addr, port, secret)
        self.common_env = {**common, **self.membership.common_env()}
        for start in self.membership.initial():
            self._spawn(start.member, {**self.common_env, **start.env})
        if opts.replace_stuck:
            self.stuck = StuckWatch(self.membership.store, self._own_ranks, self._stuck_found,
                                    self.config.report_dir or os.path.dirname(dump.prefix()) or ".")

    def _own_ranks(self) -> dict[int, int]:
        """(From the stuck watch's thread) the live ranks: {member: guard pid}."""
        return {r.rank: r.pid for r in list(self.ranks) if r.returncode is None}

    def _stuck_found(self, member: int, why: str) -> None:
        """(From the stuck watch's thread) stop ``member``: the loop does it."""
        self.stuck_to_stop.append((member, why))
        self._wake()

    def _stop_stuck(self) -> None:
        while self.stuck_to_stop and self.exit_code is None:
            member, why = self.stuck_to_stop.pop(0)
            for rank in self._live():
                if rank.rank == member:
                    _log(f"{rank.name()} is stuck: {why}; stopping it, to replace it like a dead one")
                    rank.kill()

    def _job_env(self, index: int) -> dict[str, str]:
        return {} if self.files is None else self.files.rank_env(index)

    def _spawn(self, rank: int, rank_env: dict[str, str]) -> None:
        pipe = subprocess.PIPE if self.config.prefix else None
        command = [sys.executable, "-m", "nccl_pg.cli._rank_guard", str(os.getpid()), *self.config.command]
        rank_env = {**rank_env, **self._job_env(rank)}
        proc = subprocess.Popen(command, env=rank_env, stdin=subprocess.DEVNULL,
                                stdout=pipe, stderr=pipe, start_new_session=True)
        started = _Rank(rank, proc)
        self.ranks.append(started)
        elastic_job = self.config.elastic is not None
        writers: list[_LineWriter] = []
        if self.config.prefix:
            prefix = (f"[member{rank}]: " if elastic_job else f"[rank{rank}]: ").encode()
            writers = [_LineWriter(prefix, self.console.out), _LineWriter(prefix, self.console.err)]
            self._watch(proc.stdout, writers[0])
            self._watch(proc.stderr, writers[1])
        if elastic_job:
            started.labelled = writers  # ([] under --no-prefix: nothing to label, but its words say "member")

    def _watch(self, pipe: IO[bytes] | None, writer: _LineWriter) -> None:
        assert pipe is not None
        self.streams[pipe.fileno()] = _Stream(pipe, writer)
        self.selector.register(pipe.fileno(), selectors.EVENT_READ)

    def _close_stream(self, fd: int) -> None:
        self.selector.unregister(fd)
        self.streams.pop(fd).close()

    # -- supervising ------------------------------------------------------

    def _live(self) -> list[_Rank]:
        return [r for r in self.ranks if r.returncode is None]

    def _supervise(self) -> None:
        while self._live() or self.streams or self.stop_after_autopsy is not None:  # an autopsy outlives the ranks
            for key, _ in self.selector.select(self._timeout()):
                if key.fd == self.wake_r:
                    _drain(self.wake_r)
                elif not self.streams[key.fd].read():
                    self._close_stream(key.fd)
            self._handle_signals()
            self._stop_stuck()
            self._reap()
            self._check_deadlines()
            self._watch_progress()

    def _watch_progress(self) -> None:
        """The ranks' own pids (while their guards run), and the line that says the job hangs (job_files.py)."""
        for r in self._live():
            r.find_own_pid()
            if r.labelled and self.files is not None:
                self._label(r, self.files)
        if self.files is not None and self.exit_code is None:
            line = self.files.check([r.rank for r in self._live()])
            if line is not None:
                _log(line)

    @staticmethod
    def _label(r: _Rank, files: JobFiles) -> None:
        """--elastic: a member's lines say its rank in the job as its progress file last gave it (its watchdog
        writes it at each poll), with the member number that stays: "[rank1|member3]: "."""
        progress = files.read(r.rank)
        if progress is None or progress.rank < 0 or progress.rank == r.shown_rank or not r.labelled:
            return
        r.shown_rank = progress.rank
        for writer in r.labelled:
            writer.prefix = f"[rank{progress.rank}|member{r.rank}]: ".encode()

    def _timeout(self) -> float | None:
        autopsy = self.autopsy.deadline if self.autopsy is not None and self.stop_after_autopsy else None
        tick = None
        if self._live() and (any(r.own_pid is None or r.labelled for r in self._live()) or (
                self.files is not None and self.files.stall_warning and self.exit_code is None)):
            tick = time.monotonic() + (0.05 if any(r.own_pid is None for r in self._live()) else 1.0)
        deadlines = [t for t in (self.max_time_at, self.kill_at, self.hard_kill_at, self.drain_until, autopsy, tick)
                     if t is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _handle_signals(self) -> None:
        while self.pending_signals:
            signum = self.pending_signals.pop(0)
            if self.stop_after_autopsy is not None:  # asked again while the autopsy runs: stop now
                _log(f"received {_signame(signum)} during the autopsy; not waiting for it")
                self._end_autopsy()
            self._stop(signum, 128 + signum, f"received {_signame(signum)}")

    def _reap(self) -> None:
        failed = []
        for rank in self._live():
            if not rank.exited():
                continue
            returncode = rank.reap()
            if self.files is not None:
                self.endings.append(self.files.ending(rank.rank, rank.own_pid, returncode, describe(returncode),
                                                      stopped=self.exit_code is not None))
            if returncode != 0 and self.exit_code is None:
                failed.append(rank)
        if failed and not self._replace(failed):  # (--elastic: all those of one pass together, as a node's)
            first = failed[0]
            assert first.returncode is not None
            self._stop(signal.SIGTERM, exit_status(first.returncode), f"{first.name()} {describe(first.returncode)}")
        if not self._live() and self.streams and self.drain_until is None:
            self.drain_until = time.monotonic() + self.config.grace_period

    def _replace(self, dead: list[_Rank]) -> bool:
        """--elastic: start a replacement for each dead rank; False when there
        are not enough left (the job stops then)."""
        if self.membership is None:
            return False
        how = {r.rank: describe(r.returncode or 0) for r in dead}
        starts = self.membership.died(how)
        said = "; ".join(f"{r.name()} {how[r.rank]}" for r in dead)
        if starts is None:
            _log(f"{said}; no replacement left (--max-replacements {self.membership.opts.max_replacements})")
            return False
        rank_env = {k: v for k, v in self.common_env.items() if k not in ("RANK", "GROUP_RANK")}
        for r, start in zip(sorted(dead, key=lambda r: r.rank), starts, strict=True):
            _log(f"{r.name()} {how[r.rank]}; starting member {start.member} in its place (it comes "
                 f"in after configuration {start.env[env.ELASTIC_UUID.name]}; "
                 f"{self.membership.replacements_left} replacement(s) left)")
            self._spawn(start.member, {**rank_env, **start.env})
        return True

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if self.max_time_at is not None and now >= self.max_time_at:
            self.max_time_at = None
            if self.exit_code is None and self._live():
                self._stop(signal.SIGTERM, EXIT_MAX_TIME, f"--max-time {self.config.max_time:g} s expired")
        if self.stop_after_autopsy is not None and self.autopsy is not None and (
                self.autopsy.done() or now >= self.autopsy.deadline):
            self._end_autopsy()
        if self.kill_at is not None and now >= self.kill_at:
            self.kill_at = None
            for rank in self._live():
                _log(f"{rank.name()} still running after the "
                     f"{self.config.grace_period:g} s grace period; sending SIGKILL to it and everything it started")
                rank.kill()
            self.hard_kill_at = now + GUARD_KILL_WAIT
        if self.hard_kill_at is not None and now >= self.hard_kill_at:
            self.hard_kill_at = None
            for rank in self._live():
                _log(f"rank {rank.rank}'s guard (pid {rank.pid}) did not end it; sending SIGKILL to its group")
                rank.signal_group(signal.SIGKILL)
        if self.drain_until is not None and now >= self.drain_until:
            # Only a process that left its rank's session can still hold a pipe open.
            for fd in list(self.streams):
                self._close_stream(fd)

    def _stop(self, signum: int, exit_code: int, reason: str) -> None:
        """Start stopping the job (or forward a further signal while stopping);
        the first reason decides the exit status. The first stop of a running
        job asks the ranks why before it signals them."""
        first = self.exit_code is None
        if first:
            self.exit_code = exit_code
        if self.stop_after_autopsy is not None:
            _log(f"{reason} (while the autopsy runs)")
            return
        # Someone to ask (a process group's listener parks a wait on the store), or ranks that made a process group
        # and may have left their dumps and stacks (a job without one has nothing to say).
        listening = self.server is not None and self.server.num_waiters > 0
        if first and self.config.autopsy_time > 0 and self.store is not None and (
                listening or (self.files is not None and self.files.uses_groups())):
            addr, port, secret = self.store
            how = "asking the ranks why" if listening else "looking for why (no rank can be asked: their dumps and stacks)"
            _log(f"{reason}; {how} (at most {self.config.autopsy_time:g} s) before stopping them" if self._live()
                 else f"{reason}; {how} (at most {self.config.autopsy_time:g} s)")
            prefix = self.files.dump_prefix if self.files is not None else None
            self.autopsy = Autopsy(addr, port, secret, self.config.nproc, reason, self.config.autopsy_time,
                                   self.config.report_dir, self._wake, self._gone, self.started_wall, prefix,
                                   listening, {r.rank: p for r in self.ranks if (p := r.own_pid or r.find_own_pid())})
            self.stop_after_autopsy = (signum, reason)
            return
        live = self._live()
        if not live:
            _log(reason)
            return
        _log(f"{reason}; sending {_signame(signum)} to {len(live)} running rank(s), "
             f"SIGKILL after {self.config.grace_period:g} s")
        for rank in live:
            rank.signal_group(signum)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.config.grace_period

    def _gone(self) -> dict[int, str]:
        """How the ranks reaped so far ended, and where (read by the autopsy's thread: a snapshot)."""
        where = {e.rank: e.last_op for e in list(self.endings)}
        return {r.rank: describe(r.returncode) + (f" {where[r.rank]}" if where.get(r.rank) else "")
                for r in list(self.ranks) if r.returncode is not None}

    def _wake(self) -> None:
        """From another thread: make the loop look at its deadlines now."""
        try:
            os.write(self.wake_w, b"\0")
        except OSError:  # full (the loop is awake anyway) or closed (it has ended)
            pass

    def _end_autopsy(self) -> None:
        """Print what the autopsy found (or that it ran out of time), then do the stop it held back."""
        assert self.autopsy is not None and self.stop_after_autopsy is not None
        signum, reason = self.stop_after_autopsy
        self.stop_after_autopsy = None
        late = (f"autopsy: no verdict within {self.config.autopsy_time:g} s; stopping the ranks anyway" if self._live()
                else f"autopsy: no verdict within {self.config.autopsy_time:g} s")
        for line in self.autopsy.lines if self.autopsy.done() else [late]:
            _log(line)
        self._stop(signum, self.exit_code or 0, reason)

    def _kill_remaining(self) -> None:
        """Last resort on every path out, an exception included: no rank, nor
        anything a rank started, survives the launcher. The guards kill their
        rank's processes (all sessions); a guard that does not, is killed with
        its group."""
        live = self._live()
        for rank in live:
            rank.kill()
        deadline = time.monotonic() + GUARD_KILL_WAIT
        while any(not r.exited() for r in live) and time.monotonic() < deadline:
            time.sleep(0.01)
        for rank in live:
            rank.reap()


def _record(config: LaunchConfig, port: int, secret: str) -> str | None:
    """The job's record for `nccl-pg why` (None, with a warning, if it cannot be written)."""
    try:
        return jobs.write(config.master_addr, port, secret, config.nproc, config.command)
    except OSError as exc:
        _log(f"warning: no record of this job for `nccl-pg why` ({exc})")
        return None


def _start_store(config: LaunchConfig, secret: str) -> TCPStoreServer | None:
    try:
        server = TCPStoreServer(config.master_addr, config.master_port, secret=secret,
                                torch_clients=config.torch_clients)
        server.start()
    except (OSError, DistError) as exc:
        _log(f"cannot start the rendezvous store: {exc}")  # exc names the address
        return None
    return server


def _drain(fd: int) -> None:
    try:
        while os.read(fd, READ_SIZE):
            pass
    except BlockingIOError:
        pass

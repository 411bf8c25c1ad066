"""``nccl-pg trace``: who is where, and who is missing, from the flight-recorder
dumps of every rank.

It reads a directory of dumps (ours, PyTorch's pickles, or either as JSON),
lines the ranks up per process group (by the group's name and member ranks)
and per sequence number (``collective_seq_id`` for collectives; for
point-to-point operations the k-th send from a to b is paired with the k-th
receive at b from a), and reports:

- ranks missing from a collective, and where each of them is instead (its
  newest operation that did not complete, and its last one on that group);
- operation, size and dtype mismatches between the ranks of a collective, and
  send/recv pairs that disagree or have no partner;
- the first collective that did not complete anywhere (a hang or a failure);
- ranks expected by a group's membership that left no dump;
- who and where each culprit is: host, pid, and where it is in its own
  code (file:line in function) from the stacks its dump holds, or its
  C-level stacks (``whereabouts``, over ``diagnostics.frames`` and
  ``diagnostics.stacks``), every thread's stack on demand;
- ranks consistently last at collectives, and by how much (``stragglers``).

Ring-buffer wrap: entries with a ``record_id`` below the largest first
``record_id`` of any rank are dropped (as PyTorch's analyzer does), and within
a group only the sequence numbers every truncated rank still holds are
compared. Exit status: 0 when everything is consistent, 1 when a problem was
found, 2 when no dump could be read.

Every file is untrusted input (a dump folder may be writable by others):
``dump.read_decoded`` runs no code from its bytes, refuses links and files
of other users and bounds what decoding may cost (``untrusted``), and each
dump is checked against the layout before analysis (``layout``), within
bounds per dump and per folder; a file that fails is reported as not a
readable dump, saying why, and the others are analyzed.

Modules: ``loading`` (finding and reading the dumps), ``layout`` (checking
one), ``whereabouts`` (who and where a rank is), ``rules``
(what the ranks of one collective must agree on), ``analysis`` (the
cross-rank analysis), ``stragglers``, ``report`` (the words), ``timeline``
(the Chrome trace), ``cli``.
"""

from __future__ import annotations

from .analysis import Analysis, analyze, analyze_dir
from .cli import EXIT_NO_DUMPS, EXIT_OK, EXIT_PROBLEMS, EXIT_STATUS_HELP, add_arguments, main, run
from .loading import Dump, Limits, find_dumps, load, load_bytes
from .report import format_text
from .timeline import chrome_trace

__all__ = ["EXIT_NO_DUMPS", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_STATUS_HELP", "Analysis", "Dump", "Limits",
           "add_arguments", "analyze", "analyze_dir", "chrome_trace", "find_dumps", "format_text", "load",
           "load_bytes", "main", "run"]

"""The one timeout type and its normaliser, used by every blocking call.

A timeout is given as a number of seconds or a ``datetime.timedelta`` (as
torch.distributed accepts them) and becomes a float of seconds here, at the
call, so that a bad value is refused with the argument's name before anything
starts. Two rule sets are legitimate, chosen by explicit flags:

- a *deadline* (group, store, rendezvous, init, CLI options): finite and > 0;
  every operation under it must end, so there is no "no limit" value;
- a *wait* (``Work.wait``): 0 polls once, ``inf`` means no limit of its own
  (a deadline above it still ends the operation).

``monitored_barrier`` takes 0 (no waiting) but no ``inf``. Always refused:
bool (an int, but never meant as seconds), nan, negative durations, and
finite values longer than a thread wait can hold (they would overflow at
the first wait instead of at the call).

This module imports nothing from nccl_pg: every layer may use it.
"""

from __future__ import annotations

import argparse
import math
import numbers
import threading
from datetime import timedelta

Timeout = float | int | timedelta

# The longest finite timeout: threading's waits raise OverflowError beyond it (~292 years).
MAX_SECONDS: float = threading.TIMEOUT_MAX


def _rule(zero: bool, forever: bool) -> str:
    bound = ">= 0 s" if zero else "> 0 s"
    if forever:
        return f"a duration {bound} (at most {MAX_SECONDS:.0f} s, or inf for no limit)"
    return f"a finite duration {bound} (at most {MAX_SECONDS:.0f} s)"


def _allowed(value: float, zero: bool, forever: bool) -> bool:
    if value == math.inf:
        return forever
    return (0 <= value if zero else 0 < value) and value <= MAX_SECONDS  # all False for nan


def to_seconds(timeout: object, name: str = "timeout", *, zero: bool = False, forever: bool = False) -> float:
    """Seconds from a number or a timedelta, checked against one rule set.

    ``zero``: 0 is accepted (a poll, or no waiting). ``forever``: ``inf`` is
    accepted (no limit). Neither: a deadline, finite and > 0. ``name`` is the
    argument as the caller knows it; TypeError and ValueError name it and the
    value."""
    if isinstance(timeout, (float, int)) and not isinstance(timeout, bool):  # the common case: no ABC check
        value = float(timeout)
    elif isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):  # NumPy scalars, Fraction
        value = float(timeout)
    else:
        raise TypeError(f"{name} must be a number of seconds or a timedelta, got "
                        f"{type(timeout).__name__}: {timeout!r}")
    if not _allowed(value, zero, forever):
        raise ValueError(f"{name} must be {_rule(zero, forever)}, got {timeout!r}")
    return value


def parse_seconds(raw: str, *, zero: bool = False, forever: bool = False) -> float:
    """``to_seconds`` for text (environment variables, command-line options):
    the ValueError says what is wrong and leaves naming the setting to the
    caller, who knows its name."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {raw!r}") from None
    if not _allowed(value, zero, forever):
        raise ValueError(f"must be {_rule(zero, forever)}, got {raw!r}")
    return value


def option_seconds(raw: str) -> float:
    """argparse ``type=`` for a deadline option (``--timeout S``): argparse
    shows an ArgumentTypeError's message after the option's name."""
    try:
        return parse_seconds(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

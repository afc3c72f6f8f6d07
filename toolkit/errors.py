"""The one exception type for mistakes a user can fix.

Anything raised as `UserError` reaches the user as one line on stderr (no traceback) and a non-zero
exit code; see `toolkit.cli.main`. Raise it before anything is written, so that bad input never
leaves a half-written output behind.
"""

from __future__ import annotations

import difflib
from typing import Iterable


class UserError(Exception):
    """A problem with the user's input, explained in one line that says what to do."""


def closest(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The valid choices nearest to a misspelled `word`, best first."""
    choices = list(choices)
    matches = difflib.get_close_matches(word, choices, n=n, cutoff=0.4)
    if not matches:
        lowered = word.lower()
        matches = [c for c in choices if lowered in c.lower()][:n]
    return matches


def check_choice(what: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise a UserError naming `what`, the valid choices and the closest ones unless `value` is one of them."""
    if value not in choices:
        raise UserError(f"Unknown {what} {value!r}; choose one of {', '.join(choices)}.{did_you_mean(str(value), choices)}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean: a, b?' or '' when nothing is close."""
    matches = closest(word, choices)
    return f" Did you mean: {', '.join(matches)}?" if matches else ""


class PeerFailure(Exception):
    """Another process of a distributed run failed, died or stopped answering.

    Not the user's input, but reported the same way: one line on stderr, naming the process and
    what happened, and a non-zero exit code, instead of a traceback from every rank or a hang.
    See `toolkit.training.failures.run_on_rank_zero` and `explain_peer_failure`.
    """


class Preempted(Exception):
    """The run stopped on a preemption signal (SIGTERM, SIGUSR1), after saving a checkpoint when a
    step was under way (`toolkit.training.preemption`). Reported in one line; the exit code is
    128 + the signal's number, as a shell reports a process that signal ended."""

    def __init__(self, signal_name: str, what: str) -> None:
        super().__init__(f"stopped by {signal_name}: {what}")
        self.signal_name = signal_name
        import signal

        self.exit_code = 128 + int(getattr(signal, signal_name))


def caused_by_interrupt(error: BaseException) -> bool:
    """Whether `error` is Ctrl-C's KeyboardInterrupt that a library caught and raised again as its
    own error: in its chain of causes, or among the per-rank failures of torch's distributed
    checkpoint (a save interrupted on any rank raises one CheckpointException on every rank)."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, KeyboardInterrupt):
            return True
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)  # CheckpointException: {rank: (exception, stack)}
        if isinstance(failures, dict):
            for failure in failures.values():
                failure = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(failure, BaseException):
                    pending.append(failure)
    return False

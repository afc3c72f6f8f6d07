"""Stopping a run cleanly when the cluster asks: SIGTERM (torchrun, Kubernetes, SLURM at the time
limit or on preemption) and SIGUSR1 (SLURM's `--signal=B:USR1@<seconds>` warning).

The handlers are installed when a run's tracker runs start (`Session.start`) and removed when it
ends. While the training loop runs, a signal only raises a flag. Each rank reads its flag as an
optimizer step starts and the flag travels in the step's one all-reduce (`toolkit.training.loop`),
so every rank agrees: the step under way when any rank was signalled (on several processes, at
most the next one) is the last. The session then writes a checkpoint, ends the tracker runs as
killed, and the command exits with 128 + the signal's number (143 for SIGTERM, 138 for SIGUSR1),
as a shell reports a process ended by that signal. `--resume auto` continues exactly.

Outside the loop (data preparation, model set-up, the final export) there is no step to finish: the
signal stops the process at once with `Preempted`, its tracker runs are ended as killed, and the
exit code is the same. A second signal while the first one's checkpoint is written does the same.
"""

from __future__ import annotations

import signal
from typing import Any, Optional

from toolkit.errors import Preempted

PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")


class StopSignals:
    """Installs flag-raising handlers for the preemption signals; `restore` puts back the previous ones."""

    def __init__(self) -> None:
        self.received: Optional[str] = None  # the first signal received by this process
        self.agreed = False  # set by the loop when the ranks stopped because of a signal
        self.deferring = False  # True while the loop runs: a signal only raises the flag
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopSignals":
        for name in PREEMPTION_SIGNALS:
            number = getattr(signal, name, None)
            if number is not None:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number: int, frame: Any) -> None:
        name = signal.Signals(number).name
        if self.deferring and self.received is None:
            self.received = name
            return
        self.received = self.received or name
        raise Preempted(name, "no optimizer step under way to finish; nothing more was saved by this start")

    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

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

Python runs a signal's handler in the main thread between two calls, so a process whose main thread
is inside one call that does not return (a collective whose peers are stuck or gone waits
--distributed.timeout, an hour by default; a device that stopped answering) would never see the
signal. A watch thread learns of each signal through the interpreter's wakeup file descriptor and
asks the main thread to run a tiny function (`_MainThreadProbe`); if the main thread stays inside
one call and does not, the process says where after `STUCK_REPORT_SECONDS`, and stops without a
checkpoint (exit code as above, tracker runs killed, the node's other ranks with it):

- after the first signal, once the call has lasted `stuck_limit()`, but only while optimizer steps
  run (from the second step of this start on, outside checkpoint saves): elsewhere a rank may wait
  in a collective for as long as a peer's legitimate work takes (preparing data, compiling, saving);
- after a second signal (one that comes `SAME_SIGNAL_SECONDS` or more after the first: launchers
  that forward a scheduler's signal deliver it twice at once) or Ctrl-C (SIGINT, exit code 130),
  once the call has lasted `SECOND_SIGNAL_SECONDS`, until that signal has reached Python.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from toolkit.errors import Preempted

PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
# After a preemption signal, the longest the main thread may stay inside one call during the
# training steps before the process stops without a checkpoint: this, or twice the longest
# optimizer step so far (with its validation and save) if that is longer. Schedulers follow SIGTERM
# with SIGKILL after their grace (SLURM's KillWait and Kubernetes' default are 30 s); without one, a
# stuck run would otherwise wait out --distributed.timeout.
STUCK_SECONDS = 60.0
# A process still inside the same call this long after a stop signal says where.
STUCK_REPORT_SECONDS = 10.0
# After a second signal, or Ctrl-C (which saves nothing), a main thread inside one call this long
# is stopped.
SECOND_SIGNAL_SECONDS = 3.0
# Signals closer together than this are one request (torchrun forwards the SIGTERM that srun also
# sends to each worker).
SAME_SIGNAL_SECONDS = 1.0
_SAMPLE_SECONDS = 0.5
_SEEN = {"SIGINT": False}  # set by the watch thread: Ctrl-C reached this process while a run was under way
_PIPE: dict[str, Optional[tuple[int, int]]] = {"fds": None}  # the watch's (read, write) descriptors


def interrupt_received() -> bool:
    """Whether this process received SIGINT (Ctrl-C) while a training run's stop signals were installed."""
    return _SEEN["SIGINT"]


def _forget_in_child() -> None:
    """In a forked child (a data loader's worker): stop writing its signals into the parent's pipe,
    where one Ctrl-C to the process group would read as several."""
    fds, _PIPE["fds"] = _PIPE["fds"], None
    if fds is None:
        return
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from a thread other than the main one
        pass
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


os.register_at_fork(after_in_child=_forget_in_child)


class StopSignals:
    """Installs flag-raising handlers for the preemption signals; `restore` puts back the previous ones."""

    def __init__(self) -> None:
        self.received: Optional[str] = None  # the first signal received by this process
        self.agreed = False  # set by the loop when the ranks stopped because of a signal
        self.deferring = False  # True while the loop runs: a signal only raises the flag
        self._previous: dict[int, Any] = {}
        self._previous_wakeup_fd: Optional[int] = None
        self._wakeup_write_fd: Optional[int] = None
        self._longest_step = 0.0  # seconds between two steps' starts (`step_started`)
        self._last_step_start: Optional[float] = None
        self._patience = 0  # > 0 while a checkpoint is written (`patient`)

    def install(self) -> "StopSignals":
        for name in PREEMPTION_SIGNALS:
            number = getattr(signal, name, None)
            if number is not None:
                self._previous[number] = signal.signal(number, self._handle)
        self._start_watch()
        return self

    def step_started(self) -> None:
        """Called by the training loop as each optimizer step starts: the longest step so far
        (with its validation and save) sets how long a call may take after a signal."""
        now = time.monotonic()
        if self._last_step_start is not None:
            self._longest_step = max(self._longest_step, now - self._last_step_start)
        self._last_step_start = now

    def stuck_limit(self) -> float:
        return max(STUCK_SECONDS, 2 * self._longest_step)

    @contextmanager
    def patient(self) -> Iterator[None]:
        """While a checkpoint is written, the first signal stops no rank inside a call: one may wait
        for a peer that writes or hashes a large shard."""
        self._patience += 1
        try:
            yield
        finally:
            self._patience -= 1

    def _armed(self) -> bool:
        """Whether a first signal may stop a process stuck inside one call now (see the module's docstring)."""
        return self.deferring and self._longest_step > 0 and self._patience == 0

    def _start_watch(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set the wakeup descriptor (and install handlers)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the interpreter's C handler must never wait
        try:
            self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup_write_fd = write_fd
        _PIPE["fds"] = (read_fd, write_fd)
        threading.Thread(target=self._watch_main_thread, args=(read_fd, threading.main_thread().ident),
                         daemon=True, name="toolkit-stop-watch").start()

    def _watch_main_thread(self, read_fd: int, main_ident: int) -> None:
        """The watch thread (see the module's docstring); it ends when `restore` closes the pipe."""
        watched = {int(getattr(signal, name)) for name in (*PREEMPTION_SIGNALS, "SIGINT") if hasattr(signal, name)}
        poller = select.poll()  # (select.select refuses descriptors past 1023)
        poller.register(read_fd, select.POLLIN)
        first: Optional[str] = None  # the first watched signal's name
        first_at = 0.0
        urgent_at: Optional[float] = None  # a second signal or Ctrl-C that has not reached Python yet
        probe, reported = _MainThreadProbe(), False
        try:
            while True:
                if poller.poll(None if first is None else _SAMPLE_SECONDS * 1000):
                    data = os.read(read_fd, 64)
                    if not data:
                        return
                    now = time.monotonic()
                    for name in (signal.Signals(n).name for n in data if n in watched):
                        _SEEN["SIGINT"] = _SEEN["SIGINT"] or name == "SIGINT"
                        if first is None:
                            first, first_at = name, now
                        if name == "SIGINT" or now - first_at >= SAME_SIGNAL_SECONDS:
                            urgent_at = now
                if first is None:
                    continue
                if urgent_at is not None and probe.answered_at >= urgent_at:
                    urgent_at = None  # it reached Python: its handler acts, and clean-up takes its time
                inside = probe.unanswered_for()
                if inside == 0.0:
                    reported = False
                    probe.ask()
                    continue
                limit = SECOND_SIGNAL_SECONDS if urgent_at is not None else self.stuck_limit() if self._armed() else None
                if limit is not None and inside >= limit:
                    self._stop_stuck(first, inside, _describe_position(main_ident))
                    return
                if inside >= STUCK_REPORT_SECONDS and not reported:
                    reported = True
                    then = f"or without a checkpoint in {limit - inside:.0f} s" if limit is not None else "or when it is stopped"
                    _write_line(f"toolkit: {_rank_label()}{first} came, and the main thread has been inside one call for "
                                f"{inside:.0f} s: {_describe_position(main_ident)}. It stops when the call returns, "
                                f"{then} (a second signal stops it now).")
        except Exception as error:  # the watch must never take the process down, nor leave a dead pipe
            _write_line(f"toolkit: the watch of stop signals ended ({type(error).__name__}: {error})")
            if _PIPE["fds"] is not None and _PIPE["fds"][0] == read_fd and threading.main_thread().is_alive():
                self._stop_watching_quietly()
        finally:
            os.close(read_fd)

    def _stop_watching_quietly(self) -> None:
        """The watch failed: keep the interpreter's signals out of a pipe nobody reads. Setting the
        descriptor is for the main thread; from here the pipe's write end is made harmless."""
        write_fd = self._wakeup_write_fd
        if write_fd is not None:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, write_fd)  # the signals' bytes go nowhere
            except OSError:
                pass
            finally:
                os.close(null)

    def _stop_stuck(self, name: str, inside: float, where: str) -> None:
        from toolkit.training.failures import stop_after_signal

        code = 128 + int(getattr(signal, name))
        if name == "SIGINT":
            what = f"interrupted while inside one call for {inside:.0f} s: {where}"
        else:
            what = (f"stopped by {name} after {inside:.0f} s inside one call: {where}; a collective whose peers are "
                    "stuck or gone, or a device that stopped answering. No checkpoint was written by this stop: "
                    "--resume auto continues from the last one")
        stop_after_signal(f"{_rank_label()}{what}.", code)

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
        if self._wakeup_write_fd is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd if self._previous_wakeup_fd is not None else -1)
            os.close(self._wakeup_write_fd)  # the watch thread reads the end of the pipe and returns
            self._wakeup_write_fd = None
            _PIPE["fds"] = None


_PENDING_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class _MainThreadProbe:
    """Tells whether the main thread runs Python: `ask` schedules a function that the interpreter
    runs in the main thread the next time it executes Python code (`Py_AddPendingCall`, part of the
    stable C API). While the main thread is inside one call of native code (a collective waiting for
    a stuck peer) the function does not run; between two calls of a loop that makes progress (a
    checkpoint written file after file) it runs at once, where the innermost frame and instruction
    would look the same at every look."""

    def __init__(self) -> None:
        self._asked_at: Optional[float] = None  # the unanswered request's time
        self.answered_at = 0.0  # when the main thread last ran the function
        self._callback = _PENDING_CALL(self._answer)  # kept alive while a request may run
        self._add = ctypes.pythonapi.Py_AddPendingCall
        self._add.argtypes, self._add.restype = [_PENDING_CALL, ctypes.c_void_p], ctypes.c_int

    def _answer(self, _: Any) -> int:
        self.answered_at = time.monotonic()
        self._asked_at = None
        return 0

    def ask(self) -> None:
        if self._asked_at is None:
            self._asked_at = time.monotonic()  # before the request: the main thread may answer at once
            if self._add(self._callback, None) != 0:  # the interpreter's queue is full: ask again later
                self._asked_at = None

    def unanswered_for(self) -> float:
        """Seconds since the request the main thread has not answered yet; 0 if none is waiting."""
        asked = self._asked_at
        return 0.0 if asked is None else time.monotonic() - asked


def _describe_position(main_ident: int) -> str:
    """`function (file:line)` of the main thread's innermost frame, and the toolkit's call that led there."""
    frame = sys._current_frames().get(main_ident)
    if frame is None:
        return "the main thread has ended"
    package = str(Path(__file__).resolve().parents[1])
    text = _frame_text(frame)
    caller = frame
    while caller is not None and not caller.f_code.co_filename.startswith(package):
        caller = caller.f_back
    if caller is not None and caller is not frame:
        text += f", called from {_frame_text(caller)}"
    return text


def _frame_text(frame: Any) -> str:
    path = frame.f_code.co_filename
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            path = path.split(marker, 1)[1]
    package_parent = str(Path(__file__).resolve().parents[2]) + os.sep
    if path.startswith(package_parent):
        path = path[len(package_parent):]
    return f"{frame.f_code.co_name} ({path}:{frame.f_lineno})"


def _rank_label() -> str:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"rank {dist.get_rank()}: "
    return ""


def _write_line(line: str) -> None:
    """One line to stderr in one system call (ranks share stderr)."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (AttributeError, OSError, ValueError):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

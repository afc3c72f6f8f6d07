"""Failing together: one message from every process, in seconds, instead of a hang.

- `check_launcher`: before any process starts, refuse a multi-node run that nothing launched, and
  a launch (torchrun, SLURM) of another number of processes than --devices x --num_nodes.
- `prepare_failure_handling` (called by `build_fabric`): watch the node's other ranks (in the
  process that starts them) or the launching process (in the ranks it started).
- `run_on_rank_zero`: work only rank 0 does, with every rank learning how it went.
- `check_on_every_rank`: a check each rank makes on its own, refused on every rank if one refuses.
- `explain_peer_failure`: one line for an error a dead peer caused in this process.
- `release_process_group`: tear the process group down after a run that ended normally.

Importing this module is cheap: torch and lightning are imported inside the functions.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from toolkit.errors import PeerFailure, UserError

if TYPE_CHECKING:
    from lightning_fabric import Fabric

    from toolkit.parallel.plan import StrategyPlan

log = logging.getLogger(__name__)


# Environment variables that tell Fabric where a process stands when no launcher (torchrun,
# SLURM, ...) set it up: without them every node of a multi-node run thinks it is node 0.
_MANUAL_LAUNCH_VARIABLES = ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
# Set by a process that will start its node's other ranks itself (Fabric's launcher), so that
# those ranks can tell that their parent is rank 0 of the node, and notice when it is gone.
_LAUNCHER_PID_VARIABLE = "TOOLKIT_LAUNCHER_PID"
# How often the watch threads look at their processes, and how long a process whose peer died
# is given to stop on its own (with its own message) before it is stopped.
_WATCH_SECONDS = 0.5
_GRACE_SECONDS = 10.0


@dataclass
class _FailureContext:
    """What the messages about a failed peer need to know about the run (set by build_fabric)."""

    timeout: int = 0
    num_nodes: int = 1
    devices: int = 1
    peer_failures: list = None  # one line per dead local rank, found by the watch threads
    children: list = None  # the node's other ranks, in the process that started them

    def __post_init__(self) -> None:
        self.peer_failures = []
        self.children = []


_FAILURE_CONTEXT = _FailureContext()


def _launcher_environment() -> Optional[str]:
    """The name of the launcher that set up this process's environment, or None.

    The same tests as Lightning's cluster environments (TorchElasticEnvironment, SLURMEnvironment,
    LSFEnvironment `detect()`), made on the environment variables directly: importing Lightning
    takes seconds, and this check runs before anything else.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # torch.distributed.is_torchelastic_launched()
        return "torchrun"
    if "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "SLURM"  # started by srun (an interactive allocation is not a launcher)
    if all(v in os.environ for v in ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK")):
        return "LSF"
    if all(os.environ.get(v) for v in _MANUAL_LAUNCH_VARIABLES):
        return "NODE_RANK/MASTER_ADDR/MASTER_PORT"
    return None


def check_launcher(num_nodes: int, devices: int) -> None:
    """Refuse to start a multi-node run that nothing launched, before any process starts.

    Without torchrun, SLURM (or LSF) or NODE_RANK, MASTER_ADDR and MASTER_PORT, every
    node would claim ranks 0..devices-1 and wait on its own random port: a silent hang. One node
    needs nothing: Fabric starts the local processes itself.
    """
    launcher = _launcher_environment()
    if launcher in ("torchrun", "SLURM"):
        _check_launched_processes(launcher, num_nodes, devices)
    if num_nodes <= 1 or launcher is not None:
        return
    missing = [v for v in _MANUAL_LAUNCH_VARIABLES if not os.environ.get(v)]
    raise UserError(
        f"--num_nodes {num_nodes} needs a launcher that tells each process where it stands, and none was found "
        f"(no torchrun or SLURM environment; {', '.join(missing)} not set). Start the same command on every node, "
        f"either with torchrun: `torchrun --nnodes {num_nodes} --nproc-per-node {devices} --node-rank <0..{num_nodes - 1}> "
        f"--master-addr <address of node 0> --master-port 29500 -m toolkit <command and options>`, or under SLURM: "
        f"`srun --nodes {num_nodes} --ntasks-per-node {devices} toolkit <command and options>`, or by setting "
        f"NODE_RANK (0..{num_nodes - 1}), MASTER_ADDR (node 0's address) and MASTER_PORT (a free port on node 0) "
        "on every node. See tutorials/distributed.md."
    )


def _check_launched_processes(launcher: str, num_nodes: int, devices: int) -> None:
    """Refuse a launch whose process count differs from --devices x --num_nodes: with fewer asked
    for, each process would train alone into the same --out_dir; with more, the ranks would wait
    for processes that never come."""
    if launcher == "torchrun":
        world, per_node = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
        how = "--nnodes and --nproc-per-node"
    else:
        world, per_node = os.environ.get("SLURM_NTASKS"), os.environ.get("SLURM_NTASKS_PER_NODE")
        how = "--nodes and --ntasks-per-node"
    if not (world or "").isdigit() or int(world) == num_nodes * devices:
        return
    world = int(world)
    # SLURM writes "2(x3)" for uneven layouts: only a plain count suggests --devices
    per_node = int(per_node) if (per_node or "").isdigit() and int(per_node) > 0 else None
    fix = f" (--devices {per_node} --num_nodes {world // per_node})" if per_node and world % per_node == 0 else ""
    raise UserError(
        f"{launcher} started {world} process(es), but this run asks for --devices {devices} x --num_nodes "
        f"{num_nodes} = {devices * num_nodes}: give the command what was launched{fix}, or change {launcher}'s {how}."
    )


def prepare_failure_handling(plan: StrategyPlan, fabric: Fabric) -> None:
    """Make a failed or vanished process stop the others with a message (see `explain_peer_failure`).

    Called by build_fabric, before `fabric.launch()`. In the process that will start the node's
    other ranks (Fabric's launcher), Lightning's child-process observer is replaced by
    `_watch_local_ranks`; in a rank that process started, a thread watches that it is still there.
    """
    _FAILURE_CONTEXT.timeout, _FAILURE_CONTEXT.num_nodes, _FAILURE_CONTEXT.devices = plan.timeout, plan.num_nodes, plan.devices
    _FAILURE_CONTEXT.peer_failures.clear()
    if "nccl" in (plan.process_group_backend or "") and os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "0":
        log.warning(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a collective that times out will not stop this process, so a dead "
            "rank hangs the job; unset it to let --distributed.timeout end the run."
        )
    launched_by = os.environ.get(_LAUNCHER_PID_VARIABLE)
    if not fabric.strategy.cluster_environment.creates_processes_externally:
        # This process will start the node's other ranks (Fabric's _SubprocessScriptLauncher).
        os.environ[_LAUNCHER_PID_VARIABLE] = str(os.getpid())
        import lightning_fabric.strategies.launchers.subprocess_script as subprocess_script

        # Workaround for Lightning 2.6: its `_ChildProcessObserver` SIGKILLs every process of the
        # node within 5 s of a child exiting non-zero, including rank 0 while it prints the same
        # error or removes what it half-wrote, and says why only at INFO level, which is not shown.
        subprocess_script._launch_process_observer = _watch_local_ranks
    elif launched_by is not None and launched_by == str(os.getppid()):
        threading.Thread(target=_watch_launcher, args=(int(launched_by),), daemon=True, name="toolkit-launcher-watch").start()


# Exit codes of a rank that stopped on a preemption signal after the ranks agreed and saved
# (`toolkit.training.preemption.Preempted`: 128 + SIGTERM, 128 + SIGUSR1): not a failure.
_PREEMPTED_CODES = (143, 138)


def _watch_local_ranks(children: list) -> None:
    """Replaces Lightning's observer of the ranks this process started (see `prepare_failure_handling`)."""
    _FAILURE_CONTEXT.children = children
    threading.Thread(target=_watch_children, args=(children,), daemon=True, name="toolkit-rank-watch").start()


def _watch_children(children: list) -> None:
    """Rank 0 of a node: notice a local rank that died, name it, and stop the node if it hangs.

    A dead rank makes the others fail in their next collective (gloo at once; NCCL when the
    collective times out). This process is given `_GRACE_SECONDS` to stop by itself with its own
    message (`explain_peer_failure` names the dead rank); if it is still running then (stuck in a
    collective), the message is printed here and every process of the node is stopped.
    """
    node_rank = int(os.environ.get("NODE_RANK", "0"))
    per_node = len(children) + 1
    while True:
        time.sleep(_WATCH_SECONDS)
        codes = [child.poll() for child in children]
        if all(code == 0 or code in _PREEMPTED_CODES for code in codes):
            return  # every rank finished cleanly, or stopped with the others on a preemption signal
        failed = [(i, child, code) for i, (child, code) in enumerate(zip(children, codes))
                  if code not in (None, 0, *_PREEMPTED_CODES)]
        if failed:
            break
    for i, child, code in failed:
        _FAILURE_CONTEXT.peer_failures.append(_describe_exit(node_rank * per_node + i + 1, child.pid, code))
    time.sleep(min(_GRACE_SECONDS, max(_FAILURE_CONTEXT.timeout, 1)))
    _stop_now(f"{_FAILURE_CONTEXT.peer_failures[0]}; stopping the other processes.", children)


def _watch_launcher(launcher_pid: int) -> None:
    """A rank started by Fabric's launcher: notice that the launching process (local rank 0) is gone.

    Its death closes the connections of the other ranks (gloo) or leaves them waiting in a
    collective (NCCL); if this process has not stopped by itself within the grace period, it stops.
    """
    while os.getppid() == launcher_pid:
        time.sleep(_WATCH_SECONDS)
    _FAILURE_CONTEXT.peer_failures.append(_describe_launcher_gone(launcher_pid))
    time.sleep(min(_GRACE_SECONDS, max(_FAILURE_CONTEXT.timeout, 1)))
    _stop_now(f"{_FAILURE_CONTEXT.peer_failures[0]}; stopping.", [])


def _describe_exit(rank: int, pid: int, code: int) -> str:
    if code < 0:
        import signal

        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        cause = " (the kernel's out-of-memory killer sends SIGKILL; see `dmesg`)" if name == "SIGKILL" else ""
        return f"rank {rank} (process {pid}) was killed by {name}{cause}"
    return f"rank {rank} (process {pid}) exited with code {code} (its own message is above)"


def _describe_launcher_gone(pid: int) -> str:
    node_rank = int(os.environ.get("NODE_RANK", "0"))
    return f"rank {node_rank * _FAILURE_CONTEXT.devices} (process {pid}, which started this node's other ranks) is gone: killed, or out of memory"


_EXIT_ACTIONS: list[Callable[[str], None]] = []


def add_exit_action(action: Callable[[str], None]) -> None:
    """Run `action(status)` (end the tracker runs with status "failed", or "killed" after a stop
    signal) before a watchdog ends this process with os._exit, which skips every `finally` and
    context manager of the main thread."""
    _EXIT_ACTIONS.append(action)


def clear_exit_actions() -> None:
    _EXIT_ACTIONS.clear()


def stop_after_signal(message: str, exit_code: int) -> None:
    """Stop this process, and the node's other ranks if it started them, when a stop signal came
    while its main thread was stuck inside one call (`toolkit.training.preemption`)."""
    _stop_now(message, _FAILURE_CONTEXT.children, exit_code=exit_code, status="killed")


# How long the exit actions (ending tracker runs: a network call) may take when a watchdog stops
# the process: an unreachable tracker server must not keep a stuck run alive.
_EXIT_ACTION_SECONDS = 10.0


def _stop_now(message: str, children: list, exit_code: int = 1, status: str = "failed") -> None:
    """Print `message` as this process's one line, stop `children` and exit at once (from any thread)."""
    import signal

    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)  # SIGTERM does not end a process stuck in a collective
    try:  # one system call, which takes no lock a stuck main thread may hold (sys.stderr's)
        os.write(2, f"toolkit: error: {message}\n".encode())
    except OSError:
        pass

    def run_actions() -> None:
        for action in list(_EXIT_ACTIONS):
            try:
                action(status)
            except Exception as error:  # a tracker that cannot be reached must not keep a stuck process alive
                log.warning("Could not finish before stopping: %s", str(error).splitlines()[0] if str(error) else error)

    actions = threading.Thread(target=run_actions, daemon=True, name="toolkit-exit-actions")
    actions.start()
    actions.join(_EXIT_ACTION_SECONDS)
    os._exit(exit_code)


def release_process_group() -> None:
    """Tear the process group down after a run that ended normally, or with a UserError that every
    rank raised (every rank calls it).

    Left to the interpreter's exit, torch's communication threads (and the TCP store that rank 0
    hosts) can be destroyed while still running: once in a few hundred CPU runs the process then
    ended with SIGABRT ("terminate called without an active exception") after all its work.

    Destroying the group only unregisters it: the sharded model still refers to it (FSDP2 keeps
    its process group), from reference cycles that only the garbage collector frees, so the gloo
    group and its worker threads outlived this call and were destroyed during the interpreter's
    finalization, when a thread that needs the GIL aborts the process. Collecting here frees them
    while the interpreter is whole (`tests/scripts/run_and_count_process_groups.py` checks that
    none is left).
    """
    if "torch.distributed" not in sys.modules:
        return
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # only after a group: a full collection costs 0.3 s or more in a large process


def run_on_rank_zero(fabric: Fabric, work: Callable[[], Any]) -> Any:
    """Run `work()` on global rank 0 while the others wait; every rank learns how it went.

    Use it for work only rank 0 does (preparing data, training a tokenizer, writing the final
    model) instead of `if rank == 0: work()` followed by a barrier, which strands the other ranks
    at the barrier (until the timeout) when rank 0 fails. A UserError on rank 0 is raised on every
    rank with the same message, so all of them exit non-zero with the same one line. Any other
    exception keeps its traceback on rank 0 and is a one-line `PeerFailure` on the others.

    Returns what `work` returned on rank 0, None on the other ranks. A collective call.
    """
    if fabric.world_size == 1:
        return work()
    result, outcome, raised = None, None, None
    if fabric.global_rank == 0:
        try:
            result = work()
        except UserError as error:
            outcome, raised = ("user", str(error)), error
        except Exception as error:
            outcome, raised = ("crash", f"{type(error).__name__}: {error}".splitlines()[0]), error
    outcome = fabric.broadcast(outcome, src=0)  # also the barrier that the others wait at
    if raised is not None:
        raise raised
    if outcome is not None:
        kind, message = outcome
        if kind == "user":
            raise UserError(message)
        raise PeerFailure(f"rank 0 failed ({message}); its traceback is above")
    return result


def check_on_every_rank(fabric: Fabric, check: Callable[[], None]) -> None:
    """Run `check()` on every rank; if it raises a UserError on any, every rank raises the first
    one (by rank), so that all of them stop with the same line. A collective call.

    For what each rank must see for itself (a file on each node's own disk), where one rank's
    refusal alone would leave the others waiting at their next collective.
    """
    message = None
    try:
        check()
    except UserError as error:
        message = str(error)
    if fabric.world_size > 1:
        from toolkit.training.checkpoint_io import gather_objects

        message = next((m for m in gather_objects(fabric, message) if m is not None), None)
    if message is not None:
        raise UserError(message)


def explain_peer_failure(error: BaseException) -> Optional[str]:
    """One line for an error that a failed or vanished process caused in this one, or None.

    Such errors come out of a collective: with gloo at once (the connection closes), with NCCL
    after --distributed.timeout; at start-up, out of the rendezvous. The line names the dead rank
    when this node's watch threads saw it die, and says what to do otherwise. In the process that
    started the node's other ranks, those still running are stopped before it exits.
    """
    if isinstance(error, PeerFailure):
        return str(error)
    import torch.distributed as dist

    text = str(error)
    is_distributed = isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and re.search(r"gloo|NCCL|Connection (closed|reset) by peer|Broken pipe|Timed out", text)
    )
    if not is_distributed:
        return None
    detail = _first_line(text)
    context = _FAILURE_CONTEXT
    if isinstance(error, dist.DistStoreError) or "clients joined" in text or "TCPStore" in text:
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (
            f"the processes did not all meet at {address} (MASTER_ADDR:MASTER_PORT) within --distributed.timeout="
            f"{context.timeout} s ({detail}). Start the same command on all {context.num_nodes} node(s) with the same "
            f"MASTER_ADDR and MASTER_PORT and NODE_RANK 0..{context.num_nodes - 1}, and check that every node can reach "
            "node 0 on that port."
        )
    # Give this node's watch threads time to see which local process died.
    deadline = time.monotonic() + 4 * _WATCH_SECONDS
    while not context.peer_failures and time.monotonic() < deadline:
        time.sleep(_WATCH_SECONDS / 5)
    if context.peer_failures:
        return f"{context.peer_failures[0]}; stopping."
    if re.search(r"timed out|timeout", text, re.IGNORECASE):
        return (
            f"a collective waited longer than --distributed.timeout={context.timeout} s for another process ({detail}); "
            "that process is stuck or gone: look for its message, or raise the timeout if rank 0 was still working alone."
        )
    return (
        f"lost contact with another process in a collective ({detail}): it failed or was killed; "
        "its own message, or its launcher's, says which."
    )


def _first_line(text: str) -> str:
    """The informative part of a torch.distributed error: its first line, without gloo's source location."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    return line[:200]

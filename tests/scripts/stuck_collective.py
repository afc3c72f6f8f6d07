"""Rank 0 installs the stop signals as a training session does, raises the loop's deferring flag,
has two optimizer steps start (the watch stops a stuck process only once a step was measured) and
then, in mode `collective`, waits in an all-reduce that rank 1 (a second gloo process on 127.0.0.1)
never joins; mode `setup` waits the same way before any step, as a rank waits for rank 0 to prepare
data; in mode `busy` (one process) it makes progress for 6 s through native calls made from one
line, as a checkpoint written file after file does. The test signals rank 0.

    python stuck_collective.py MODE RANK PORT STUCK_SECONDS STUCK_REPORT_SECONDS
"""

import signal
import sys
import time
from datetime import timedelta

from toolkit.training import preemption

# Ctrl-C as a terminal's process has it: a test suite started in the background by a shell without
# job control (as CI may be) passes SIGINT on ignored, and Python then leaves it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

mode, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
preemption.STUCK_SECONDS, preemption.STUCK_REPORT_SECONDS = float(sys.argv[4]), float(sys.argv[5])
if mode in ("collective", "setup"):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    if rank == 1:
        time.sleep(300)
        sys.exit(0)
stop = preemption.StopSignals().install()
stop.deferring = True
if mode != "setup":
    stop.step_started()
    stop.step_started()
print("waiting", flush=True)
if mode in ("collective", "setup"):
    dist.all_reduce(torch.ones(4))
else:
    end = time.monotonic() + 6
    while time.monotonic() < end:
        time.sleep(0.3)
print(f"returned, {stop.received} received", flush=True)

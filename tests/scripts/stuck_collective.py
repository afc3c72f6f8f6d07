"""Two gloo processes on 127.0.0.1; rank 0 installs the stop signals as a training session does,
raises the loop's deferring flag and waits in an all-reduce that rank 1 never joins (rank 1
sleeps). The test signals rank 0 and checks how it stops.

    python stuck_collective.py RANK PORT STUCK_SECONDS STUCK_REPORT_SECONDS
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from toolkit.training import preemption

rank, port = int(sys.argv[1]), int(sys.argv[2])
preemption.STUCK_SECONDS, preemption.STUCK_REPORT_SECONDS = float(sys.argv[3]), float(sys.argv[4])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=300))
if rank == 1:
    time.sleep(300)
    sys.exit(0)
stop = preemption.StopSignals().install()
stop.deferring = True
print("waiting", flush=True)
dist.all_reduce(torch.ones(4))
print("returned", flush=True)

"""`toolkit <args>` with the stop-signal watch's patience shortened to $STUCK_SECONDS seconds, so
that a test can see a stuck run stop in seconds. Every rank runs this file: Fabric's launcher starts
the node's other ranks with the same command line and environment."""

import os

from toolkit.training import preemption

preemption.STUCK_SECONDS = preemption.STUCK_REPORT_SECONDS = float(os.environ["STUCK_SECONDS"])

from toolkit.cli import main  # noqa: E402

main()

"""uneven_data.py, then count_syncs.py, in one launch of two processes: torch and Lightning start once.

Used by tests/test_distributed_failures.py: started with `--devices 2` (Fabric's launcher re-runs
this script for rank 1). The second set-up's launch finds the processes and their process group
already made and reuses them; it builds its own model, optimizer and data. Prints what each prints.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder

import count_syncs  # noqa: E402
import uneven_data  # noqa: E402

if __name__ == "__main__":
    uneven_data.main()
    count_syncs.main()

"""`toolkit <args>` as the command line runs it, then one line per rank: how many process groups and
modules are still alive once the command has returned, before the interpreter exits, and which
quantization libraries (bitsandbytes, torchao) the command imported.

Any process group alive at this point is destroyed during the interpreter's finalization, which can
abort the process (see `toolkit.training.failures.release_process_group`). The exit code is the
command's. Usage: python run_and_count_process_groups.py <toolkit command> <args>... (Fabric starts
the other ranks with the same command line).
"""

import gc
import os
import sys

from toolkit.cli import run
from toolkit.process import runs_one_command


def _alive_objects() -> tuple[list, list]:
    """(process groups, nn.Modules) reachable from objects the garbage collector tracks."""
    import torch.distributed as dist
    from torch import nn

    groups, modules = {}, []
    for obj in gc.get_objects():
        if isinstance(obj, nn.Module):
            modules.append(obj)
        for ref in (obj, *gc.get_referents(obj)):  # process groups themselves are not tracked
            if isinstance(ref, dist.ProcessGroup):
                groups[id(ref)] = ref
    return list(groups.values()), modules


def _alive() -> tuple[int, int]:
    """How many of each `_alive_objects` finds."""
    groups, modules = _alive_objects()
    return len(groups), len(modules)


if __name__ == "__main__":
    runs_one_command()  # as the CLI's entry point declares
    code = run(sys.argv[1:])
    groups, modules = _alive()
    imported = " ".join(name for name in ("bitsandbytes", "torchao") if sys.modules.get(name) is not None) or "none"
    # One write of the whole line: the ranks share the pipe, and print's separate write of the
    # newline let two ranks' lines run together ("... aliverank 0: ...").
    sys.stdout.flush()
    sys.stdout.write(f"rank {os.environ.get('LOCAL_RANK', '0')}: {groups} process groups, {modules} modules alive; "
                     f"quantization libraries imported: {imported}\n")
    sys.stdout.flush()
    sys.exit(code)

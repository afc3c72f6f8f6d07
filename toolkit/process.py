"""What a toolkit process imports: the optional libraries a command does not use are kept out.

peft imports bitsandbytes and torchao whenever they are installed (peft 0.21 `peft.helpers`; torchao
through transformers' quantizer), although a LoRA run uses bitsandbytes only with --quantize bnb.*
and torchao only with --quantize nf4. On this project's CPU they cost every rank of every LoRA run
about 1.0 s (bitsandbytes calls torch.compile at import, which loads inductor) and 0.3 s of
start-up, and print their own import-time warnings.

Leaving a library out marks it absent in `sys.modules`: `import` raises ImportError and
`importlib.util.find_spec` answers None, which is how peft and transformers ask whether it is
installed. That is safe only in a process that runs a single command (the CLI's entry point says
so, `runs_one_command`): a later command in the same process could need what an earlier one left
out, and peft remembers what it found. Elsewhere (`run` called in-process, tests) nothing is left out.
"""

from __future__ import annotations

import sys

_ONE_COMMAND = [False]


def runs_one_command() -> None:
    """Declare that this process runs one command and then exits (the CLI's entry point)."""
    _ONE_COMMAND[0] = True


def leave_out(*names: str) -> list[str]:
    """Keep the libraries `names` out of this process if it runs one command and has not imported
    them yet; returns those left out."""
    if not _ONE_COMMAND[0]:
        return []
    left_out = [name for name in names if name not in sys.modules]
    for name in left_out:
        sys.modules[name] = None  # type: ignore[assignment]  # "absent": ImportError, find_spec None
    return left_out

"""A process-wide choice that model code reads when it runs, set for the length of a `with` block.

Model code stays single-device and takes no flags through its calls for how a kernel runs: a
caller (a benchmark, a test, a reference pass) says `with SETTING.use(value): ...` and the layers
read `SETTING.value`. Compiled code guards on the value, so a change recompiles rather than goes
unseen.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


class Switch:
    """`what`: the name errors give; `value`: the current choice (`default` outside any block);
    `allowed`: the values `use` accepts."""

    def __init__(self, what: str, default: Any, allowed: tuple) -> None:
        self.what, self.value, self.allowed = what, default, allowed

    @contextmanager
    def use(self, value: Any) -> Iterator[None]:
        """`value` inside the block, the previous value after it (also when the block raises)."""
        if value not in self.allowed:
            raise ValueError(f"{self.what} {value!r}: one of {', '.join(map(repr, self.allowed))}")
        saved, self.value = self.value, value
        try:
            yield
        finally:
            self.value = saved

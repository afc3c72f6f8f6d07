"""`python -m extensions.lm_eval <checkpoint_dir> --tasks ...`: the same conventions as `toolkit <command>`
(typed options, --config YAML, --help, one-line errors), through `toolkit.cli.run_function`."""

import os
import sys

from toolkit.cli import run_function

from extensions.lm_eval.evaluate import evaluate


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_function("python -m extensions.lm_eval", evaluate, sys.argv[1:]))


if __name__ == "__main__":
    main()

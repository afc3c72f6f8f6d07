"""A DPO fine-tuning run through the real entry points, on synthetic pairs (tests/pair_data.py).

Usage: preference_run.py CHECKPOINT OUT_DIR DEVICES KIND PRECOMPUTE STEPS
    KIND: lora (finetune_lora, the base with adapters switched off as reference) or full
    (finetune_full, a frozen copy or the starting weights); PRECOMPUTE: 1 for
    --objective.precompute_reference true. Runs 32-true on the CPU, FSDP (FULL_SHARD, gloo) when
    DEVICES is 2, the same global batch of 4 pairs per step whatever DEVICES (micro-batches of 1),
    a constant learning rate (a run stopped early and resumed takes the same steps), a checkpoint
    after every step, validation every 2 steps, and resumes from OUT_DIR when it holds one. Fabric re-runs this
    script in each process it launches, as it re-runs the command line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS)]

from pair_data import SyntheticPairs, rule_pairs  # noqa: E402
from toolkit.args import DistributedArgs, EvalArgs, LogArgs, TrainArgs  # noqa: E402
from toolkit.models.adapters import LoRAArgs  # noqa: E402
from toolkit.training.preference_objectives import DPO  # noqa: E402


def run(checkpoint: Path, out_dir: Path, devices: int, kind: str, precompute: bool, steps: int) -> None:
    """The run described above (tests/test_preference_training.py calls it in its own process for one device)."""
    data = SyntheticPairs(rule_pairs(24, seed=1), rule_pairs(4, seed=2))
    common = dict(
        checkpoint_dir=Path(checkpoint), out_dir=Path(out_dir), data=data,
        objective=DPO(beta=0.5, precompute_reference=precompute),
        train=TrainArgs(micro_batch_size=1, global_batch_size=4, max_seq_length=16, max_steps=steps,
                        learning_rate=1e-3 if kind == "lora" else 1e-4, lr_schedule="constant", warmup_steps=0,
                        weight_decay=0.0, save_interval=1, keep_last=None),
        eval=EvalArgs(interval=2, max_iters=4, initial_validation=True),
        log=LogArgs(interval=1, loggers=("csv",)),
        distributed=DistributedArgs(sharding="FULL_SHARD", timeout=120), devices=devices, precision="32-true",
        seed=3, resume="auto",
    )
    if kind == "lora":
        from toolkit.finetune.lora import finetune_lora

        finetune_lora(lora=LoRAArgs(r=4, alpha=8, dropout=0.0, targets=("query", "value", "mlp")), **common)
    else:
        from toolkit.finetune.full import finetune_full

        finetune_full(**common)


def main() -> None:
    checkpoint, out_dir, devices, kind, precompute, steps = sys.argv[1:7]
    run(Path(checkpoint), Path(out_dir), int(devices), kind, precompute == "1", int(steps))


if __name__ == "__main__":
    main()

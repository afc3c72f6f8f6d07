"""Two ranks set up by `Session` (as every entry point): LoRA dropout masks differ, initial weights do not.

Used by tests/test_distributed_setup.py: started with `--devices 2` (Fabric's launcher re-runs this
script for rank 1), DDP so that each rank holds whole weights. Each rank builds the LoRA model as
finetune_lora does (random base, peft, `init_adapters`), runs one training-mode forward pass on the
same input and writes <argv[2]>/rank<R>.json: a digest of its initial weights and the dropout mask it drew.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from toolkit.finetune.lora import init_adapters  # noqa: E402
from toolkit.models.adapters import LoRAArgs  # noqa: E402
from toolkit.models.config import Config  # noqa: E402
from toolkit.models.param_names import unwrapped_name  # noqa: E402
from toolkit.args import DistributedArgs, EvalArgs, LogArgs, TrainArgs  # noqa: E402
from toolkit.parallel.plan import plan_run  # noqa: E402
from toolkit.training.session import Session  # noqa: E402

SEED, SEQ = 7, 8


def main() -> None:
    from peft import get_peft_model

    config = Config.from_name("debug-neox")
    train = TrainArgs(global_batch_size=2, micro_batch_size=1, max_seq_length=SEQ, max_steps=1)
    run_plan = plan_run(2, 1, "32-true", DistributedArgs(strategy="ddp"), train, SEQ)
    session = Session.start("finetune_lora", Path(sys.argv[1]), config, train, EvalArgs(), LogArgs(loggers=()),
                            run_plan, seed=SEED, resume=False)
    lora = LoRAArgs(dropout=0.5)

    def prepare(model):
        model = get_peft_model(model, lora.peft_config())
        init_adapters(model, SEED)
        return model

    model = session.build_model("random", prepare=prepare)
    weights = {unwrapped_name(n): p.detach() for n, p in model.named_parameters()}
    digest = {n: float(w.double().sum()) for n, w in sorted(weights.items())}
    masks = []
    dropouts = [m for n, m in model.named_modules() if n.endswith("lora_dropout.default")]
    hook = dropouts[0].register_forward_hook(lambda m, inp, out: masks.append((out == 0).flatten().tolist()))
    model.train()
    tokens = torch.arange(SEQ).unsqueeze(0) % config.vocab_size  # the same input on every rank
    model(tokens)
    hook.remove()
    rank = session.fabric.global_rank
    report = {"rank": rank, "digest": digest, "mask": masks[0], "lora_params": sum("lora_" in n for n in weights)}
    (Path(sys.argv[2]) / f"rank{rank}.json").write_text(json.dumps(report))
    from toolkit.training.failures import release_process_group

    release_process_group()  # destroys the group and frees what holds its threads


if __name__ == "__main__":
    main()

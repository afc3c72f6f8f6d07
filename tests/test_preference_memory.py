"""The memory estimate and pre-flight of preference objectives, held to the simulated step.

A preference step runs 2 rows per pair, takes per-token log-probabilities from the fused head,
and runs the reference's forward pass first: LoRA's own base with the adapters switched off, or
under full fine-tuning a frozen copy sharded like the model (none when reference-free or precomputed).
The simulation (`toolkit.memory.simulation`) runs exactly that on 8 fake ranks.
"""

from __future__ import annotations

import pytest

from toolkit.errors import UserError
from toolkit.memory import check_fits, simulate
from toolkit.memory.estimator import PREFERENCE_REFERENCE, Options, column_memory, estimate, make_column
from toolkit.models.adapters import LoRAArgs
from toolkit.models.config import Config

SEQ = 512


@pytest.mark.parametrize("finetune, frozen_copy, checkpointing", [
    ("lora", False, False),  # DPO on LoRA: the adapters-off pass through the sharded trained model
    ("full", True, True),  # DPO, full fine-tuning: a frozen sharded copy
    ("full", False, False),  # SimPO / ORPO, or DPO with a precomputed reference: no reference model
])
def test_estimate_of_a_preference_step_matches_the_simulated_step(finetune, frozen_copy, checkpointing):
    """TinyLlama-1.1B's shapes with 4 blocks, 8 ranks FULL_SHARD, bf16-mixed, two micro-batches of
    one pair (two rows) of 512 tokens. Measured: within 0.05%. Before the adapters-off pass freed what
    it left gathered (`release_gathered`), the head stayed gathered through the training forward
    pass; before its adapters were kept trainable inside it (`adapters_switched_off`), FSDP2 reduced
    their gradients in bf16 and the LoRA step failed."""
    config = Config.from_name("tiny-llama-1.1b", n_layer=4)
    lora = LoRAArgs() if finetune == "lora" else None
    sim = simulate(config, 8, 1, 1, SEQ, "bf16-mixed", "FULL_SHARD", finetune, lora, checkpointing, 2,
                   pairs=True, frozen_copy=frozen_copy)

    def options(pairs: bool, copy: bool) -> Options:
        return Options(config, "bf16-mixed", finetune, tuple(lora.module_names()) if lora else (), 8, None, SEQ,
                       device="fake", lora_dropout=lora.dropout if lora else 0.0, pairs=pairs, frozen_copy=copy)

    key = "total_checkpointed" if checkpointing else "total"
    column = make_column("FULL_SHARD", 8, 1)
    figures = column_memory(options(True, frozen_copy), column, 1)
    assert figures[key] == pytest.approx(sim.peak_total, rel=0.01), (figures[key] / 2**20, sim.peak_total / 2**20)
    assert figures["reference_model"] == sim.peak.get("Reference Param", 0)
    assert (figures["reference_model"] > 0) == frozen_copy
    # The pair's two rows and the reference are in the figure: one sequence without a reference is much less.
    assert column_memory(options(False, False), column, 1)[key] < 0.9 * figures[key]
    # The pre-flight (CUDA's rules) takes the pairs and the copy: a device that fits the step of one
    # sequence refuses the step of one pair.
    sequence = column_memory(Options(config, "bf16-mixed", finetune, options(False, False).lora_modules, 8, None, SEQ,
                                     lora_dropout=options(False, False).lora_dropout), column, 1)[key]
    device = int(sequence * 1.01 / 0.95)
    args = (config, 8, 1, 1, SEQ, "bf16-mixed", "FULL_SHARD", checkpointing, finetune, lora)
    assert "fits." in check_fits(device, *args)
    with pytest.raises(UserError, match="does not fit"):
        check_fits(device, *args, pairs=True, frozen_copy=frozen_copy)


def test_objectives_tell_the_memory_code_what_they_add():
    """`Objective.memory_profile` (what the pre-flight is given) and the estimate's table of objectives."""
    from toolkit.training.objectives import SFT
    from toolkit.training.preference_objectives import DPO, IPO, ORPO, SimPO

    assert SFT().memory_profile(frozen_base=False) == {}
    assert DPO().memory_profile(frozen_base=True) == {"pairs": True, "frozen_copy": False}  # LoRA: its own base
    assert DPO().memory_profile(frozen_base=False) == {"pairs": True, "frozen_copy": True}
    assert IPO(precompute_reference=True).memory_profile(frozen_base=False) == {"pairs": True, "frozen_copy": False}
    assert SimPO().memory_profile(frozen_base=False) == {"pairs": True, "frozen_copy": False}
    assert {cls.__name__.lower(): cls.uses_reference for cls in (DPO, IPO, SimPO, ORPO)} == PREFERENCE_REFERENCE


def test_the_estimate_command_counts_pairs_and_the_reference(capsys):
    common = dict(model_name="tiny-llama-1.1b", devices=2, micro_batch_size=1, max_seq_length=256, strategy="fsdp",
                  sharding="FULL_SHARD", model_overrides={"n_layer": 2})
    sft = estimate(finetune="full", **common)["strategies"]["FULL_SHARD"]
    dpo = estimate(finetune="full", objective="dpo", **common)
    table = capsys.readouterr().out
    figures = dpo["strategies"]["FULL_SHARD"]
    assert "reference model (frozen copy)" in table and "DPO on pairs" in table and "1 pair(s) x 2 rows" in table
    assert figures["reference_model"] > 0 and figures["activations"] > sft["activations"]
    precomputed = estimate(finetune="full", objective="dpo", precompute_reference=True, **common)["strategies"]["FULL_SHARD"]
    assert precomputed["reference_model"] == 0 and precomputed["total"] < figures["total"]
    assert estimate(finetune="lora", objective="dpo", **common)["strategies"]["FULL_SHARD"]["reference_model"] == 0
    with pytest.raises(UserError, match="fine-tuning objective"):
        estimate(objective="dpo", **common)
    with pytest.raises(UserError, match="simpo has none"):
        estimate(finetune="lora", objective="simpo", precompute_reference=True, **common)

"""Packing (--data.packing): several samples share one sequence, each attending only to itself.

The loss and the LoRA gradients of packed batches equal those of the same samples unpacked; a
packed sample's logits do not depend on its neighbours; positions restart per sample.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ASSETS, logged_val_losses
from peft import get_peft_model
from peft.tuners.lora import LoraLayer

from toolkit.cli import run
from toolkit.data.chat import Chat
from toolkit.data.instruct import IGNORE_INDEX, Alpaca, PackedSamples, pack_lengths
from toolkit.finetune.lora import init_adapters
from toolkit.models.adapters import LoRAArgs
from toolkit.models.attention import document_segments
from toolkit.models.config import Config
from toolkit.models.gpt import GPT
from toolkit.tokenizer import Tokenizer
from toolkit.training.objectives import CausalLM, tokens_before_padding

LLAMA2 = ASSETS / "tokenizers" / "llama2"
ALPACA = ASSETS / "instruct" / "alpaca_tiny.json"
FASTCHAT = ASSETS / "instruct" / "fastchat_dummy_conversation.json"
MAX_SEQ = 256


@pytest.fixture(scope="module")
def llama2() -> Tokenizer:
    return Tokenizer(LLAMA2)


@pytest.fixture(scope="module")
def alpaca(llama2) -> Alpaca:
    data = Alpaca(json_path=ALPACA, prompt_style="alpaca", val_split_fraction=0, packing=True)
    data.setup(llama2, max_seq_length=MAX_SEQ, model="llama-2-7b")
    return data


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(Config.from_name("debug-llama2")).float()  # vocab 32000: the llama2 tokenizer's


# ---------------------------------------------------------------------------------------------------
# Packs


def test_packs_hold_every_sample_once_whole_and_nearly_fill_their_sequences(alpaca):
    lengths = alpaca._train.lengths.tolist()
    packs = pack_lengths(lengths, MAX_SEQ)
    assert sorted(i for pack in packs for i in pack) == list(range(len(lengths)))
    assert max(sum(lengths[i] for i in pack) for pack in packs) <= MAX_SEQ
    # Best fit decreasing: within 10% of the bound no packing can beat (here 54 packs for 51), and
    # fewer than filling sequences in file order (next fit: 65).
    assert len(packs) <= 1.1 * math.ceil(sum(lengths) / MAX_SEQ)
    next_fit, room = 0, 0
    for n in lengths:
        next_fit, room = (next_fit + 1, MAX_SEQ - n) if n > room else (next_fit, room - n)
    assert len(packs) < next_fit
    with pytest.raises(ValueError, match="sample 1 has 9 tokens, more than a pack holds \\(8\\)"):
        pack_lengths([3, 9], 8)


def test_a_packed_row_is_its_samples_unpacked_rows_one_after_another(alpaca):
    samples = alpaca._train
    packed = PackedSamples(samples, MAX_SEQ)
    loader = alpaca.train_dataloader(micro_batch_size=2, seed=1)
    assert len(loader) == len(packed) // 2 and alpaca.stats["packed_sequences"] == len(packed)
    seen = []
    for indices, batch in zip(loader.batch_indices(0), loader):
        for row, pack in enumerate(indices.tolist()):
            docs = batch["document_ids"][row]
            for doc, sample in enumerate(packed.packs[pack]):
                alone = samples.collate([sample], pad_id=0)
                n = int(samples.lengths[sample])
                where = (docs == doc).nonzero().squeeze(1)
                assert len(where) == n and int(where[-1] - where[0]) == n - 1  # contiguous
                assert torch.equal(batch["input_ids"][row, where], alone["input_ids"][0])
                # Labels as unpacked: a sample's first token is never a label (not predicted from the sample before)
                assert torch.equal(batch["labels"][row, where], alone["labels"][0])
                seen.append(sample)
            padding = docs == -1
            assert (batch["labels"][row, padding] == IGNORE_INDEX).all()
            assert int((~padding).sum()) == int(packed.lengths[pack])
        # The throughput count (real tokens: up to each row's last target) is the samples' length.
        assert int(tokens_before_padding(batch["labels"])) == sum(int(packed.lengths[p]) for p in indices.tolist())
    assert len(seen) == len(set(seen)) > len(packed) // 2 * 2  # each sample once per epoch, several per row
    assert loader.padding_fraction(0) < 0.05


def test_a_packed_loader_resumes_at_the_exact_next_batch(alpaca):
    loader = alpaca.train_dataloader(micro_batch_size=2, seed=5)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    expected = next(batches)
    resumed = alpaca.train_dataloader(micro_batch_size=2, seed=5)
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert all(torch.equal(got[key], expected[key]) for key in ("input_ids", "labels", "document_ids"))
    # Its fingerprint is not the unpacked samples': switching packing on or off is seen on resume.
    assert state["samples_checksum"] != alpaca._train.checksum


def test_positions_restart_at_every_sample():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 1, 1, 1, 1, 1]])
    positions, segments = document_segments(doc)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    assert segments.tolist() == [[3, 2, 1], [1, 5, 0]]  # run lengths, padded with 0
    # The model rotates by those positions. RoPE scores depend on relative positions only, so the
    # logits barely show it (about 1e-6): read what the real rotary table is asked for instead.
    model = _model().eval()
    asked = []
    table = model.rope.at
    model.rope.at = lambda pos, device, *rest: asked.append(pos.tolist()) or table(pos, device, *rest)
    with torch.no_grad():
        model(torch.randint(3, 32000, (2, 6)), document_ids=doc)
    assert asked == [positions.tolist()]


# ---------------------------------------------------------------------------------------------------
# The model on packed rows


def test_a_packed_sample_sees_only_itself():
    model = _model().eval()
    torch.manual_seed(1)
    a, b, c = (torch.randint(3, 32000, (1, n)) for n in (9, 14, 6))
    row = torch.cat([a, b, c], dim=1)
    doc = torch.tensor([[0] * 9 + [1] * 14 + [2] * 6])
    with torch.no_grad():
        packed = model(row, document_ids=doc)
        alone = [model(x) for x in (a, b, c)]
        changed_row = row.clone()
        changed_row[0, 9:23] = torch.randint(3, 32000, (14,))
        changed = model(changed_row, document_ids=doc)
    for got, want in zip(packed.split([9, 14, 6], dim=1), alone):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Changing the middle sample changes its logits only.
    assert torch.equal(changed[:, :9], packed[:, :9]) and torch.equal(changed[:, 23:], packed[:, 23:])
    assert (changed[:, 9:23] - packed[:, 9:23]).abs().max() > 1e-2


def test_packed_lora_first_step_equals_unpacked_loss_and_gradients(alpaca):
    """The same samples, packed (2 sequences) and unpacked (padded rows): loss and every adapter
    gradient agree in float32 within rtol 1e-4 / atol 1e-6 (summation order differs, nothing else)."""
    samples = alpaca._train
    packed = PackedSamples(samples, MAX_SEQ)
    pack_ids = sorted(range(len(packed)), key=lambda p: -len(packed.packs[p]))[:2]  # the fullest of samples
    sample_ids = [i for p in pack_ids for i in packed.packs[p]]
    assert len(sample_ids) >= 4
    batches = {"packed": packed.collate(pack_ids, pad_id=0), "unpacked": samples.collate(sample_ids, pad_id=0)}
    assert batches["packed"]["input_ids"].numel() < batches["unpacked"]["input_ids"].numel()

    results = {}
    for name, batch in batches.items():
        model = get_peft_model(_model(), LoRAArgs(targets=("query", "value", "mlp"), dropout=0.0).peft_config())
        init_adapters(model, seed=3)
        with torch.no_grad():  # B starts at zero (A's gradient would be 0): give it values, as after some steps
            generator = torch.Generator().manual_seed(4)
            for module in model.modules():
                if isinstance(module, LoraLayer):
                    weight = module.lora_B["default"].weight
                    weight.copy_(torch.randn(weight.shape, generator=generator) * 0.02)
        targets = int((batch["labels"] != IGNORE_INDEX).sum())
        loss = CausalLM()(model, batch).loss_sum / targets
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[name] = (loss.detach(), grads, targets)

    (loss_p, grads_p, targets_p), (loss_u, grads_u, targets_u) = results["packed"], results["unpacked"]
    assert targets_p == targets_u
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=0)
    assert grads_p.keys() == grads_u.keys() and len(grads_p) == 2 * 2 * 5  # 2 layers x (A, B) x 5 targets
    for name in grads_p:
        assert grads_u[name].abs().max() > 0, name
        torch.testing.assert_close(grads_p[name], grads_u[name], rtol=1e-4, atol=1e-6, msg=name)


def test_kv_cache_and_misshapen_document_ids_are_refused():
    model = _model().eval()
    ids = torch.randint(3, 32000, (1, 6))
    with pytest.raises(ValueError, match=r"document_ids \(1, 5\) must have the shape of input_ids \(1, 6\)"):
        model(ids, document_ids=torch.zeros(1, 5, dtype=torch.long))
    model.set_kv_cache(1, 16)
    with pytest.raises(ValueError, match="clear the KV cache first"):
        model(ids, document_ids=torch.zeros(1, 6, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------
# Chat data


def test_packed_conversations_keep_their_assistant_only_labels(llama2):
    data = Chat(json_path=FASTCHAT, chat_template="llama-2", val_split_fraction=0.1, packing=True)
    data.setup(llama2, max_seq_length=512, model="llama-2-7b")
    samples = data._train
    loader = data.train_dataloader(micro_batch_size=4, seed=0)
    indices, batch = loader.batch_indices(0)[0], next(iter(loader))
    packs = loader.samples.packs
    n_docs = 0
    for row, pack in enumerate(indices.tolist()):
        for doc, sample in enumerate(packs[pack]):
            where = batch["document_ids"][row] == doc
            assert torch.equal(batch["labels"][row, where], samples.collate([sample], pad_id=0)["labels"][0])
            n_docs += 1
    assert n_docs > len(indices)  # several conversations share a sequence
    # Validation packs too, and counts the same targets as unpacked.
    val = data.val_dataloader(micro_batch_size=2)
    assert sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in val) == data._val.num_targets


# ---------------------------------------------------------------------------------------------------
# Through the command line


def test_a_packed_lora_run_validates_to_the_unpacked_loss(base, tmp_path):
    """finetune_lora with --data.packing true: the same validation conversations, packed by the data
    module and passed through Fabric, peft and the loop, give the unpacked validation loss."""
    losses = {}
    for packing in ("false", "true"):
        out = tmp_path / f"packing-{packing}"
        assert run([
            "finetune_lora", str(base["checkpoint"]), "--out_dir", str(out),
            "--data", "Chat", "--data.json_path", str(FASTCHAT), "--data.val_split_fraction", "0.1",
            "--data.chat_template", "llama-2", "--data.packing", packing,
            "--precision", "32-true", "--train.micro_batch_size", "2", "--train.max_seq_length", "256",
            "--train.max_steps", "1", "--eval.max_iters", "100", "--eval.initial_validation", "true",
            "--eval.final_validation", "false",
            "--log.loggers", "[csv]",
        ]) == 0
        losses[packing] = logged_val_losses(out)
    assert len(losses["true"]) == len(losses["false"]) == 1
    assert losses["true"][0] == pytest.approx(losses["false"][0], rel=1e-5)

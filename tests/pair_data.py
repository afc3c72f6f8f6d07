"""Synthetic preference pairs for the preference-objective tests, in the preference data modules'
batch contract, loaded by the real `InstructLoader` (shuffling, sharding over ranks, resumable).

    input_ids (2B, T), labels (2B, T): chosen rows first, then the rejected ones in the same pair
                                       order; shifted; IGNORE_INDEX on the prompt and the padding
    pair_ids (B,):                     each pair's index in its split

`rule_pairs` makes pairs where the chosen response follows a rule that the rejected one breaks:
it repeats the prompt's last word (one to three times); the rejected response says other words,
none of them the word before it.
"""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import torch

from toolkit.data.instruct import InstructLoader
from toolkit.models import IGNORE_INDEX

BOS, EOS, PAD = 1, 2, 0
WORDS = list(range(100, 132))

Pair = tuple[list[int], list[int], list[int]]  # (prompt, chosen response, rejected response), token ids


def rule_pairs(count: int, seed: int) -> list[Pair]:
    generator = random.Random(seed)
    pairs = []
    for _ in range(count):
        prompt = [BOS] + [generator.choice(WORDS) for _ in range(generator.randint(2, 5))]
        chosen = [prompt[-1]] * generator.randint(1, 3) + [EOS]
        rejected = [prompt[-1]]
        for _ in range(generator.randint(1, 3)):
            rejected.append(generator.choice([w for w in WORDS if w != rejected[-1]]))
        pairs.append((prompt, chosen, rejected[1:] + [EOS]))
    return pairs


def collate_pairs(pairs: list[Pair], pair_ids: list[int], pad_id: int = PAD) -> dict:
    rows = [p + c for p, c, _ in pairs] + [p + r for p, _, r in pairs]
    prompts = [len(p) for p, _, _ in pairs] * 2
    T = max(len(r) for r in rows) - 1
    input_ids = torch.full((len(rows), T), pad_id)
    labels = torch.full((len(rows), T), IGNORE_INDEX)
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        input_ids[i, : len(row) - 1] = torch.tensor(row[:-1])
        labels[i, prompt - 1 : len(row) - 1] = torch.tensor(row[prompt:])
    return {"input_ids": input_ids, "labels": labels, "pair_ids": torch.tensor(pair_ids)}


class PairSamples:
    """A split's pairs as `InstructLoader` cuts them into batches (`lengths`, `collate`, `checksum`)."""

    def __init__(self, pairs: list[Pair]) -> None:
        self.pairs = pairs
        self.lengths = torch.tensor([len(p) + max(len(c), len(r)) - 1 for p, c, r in pairs])

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def checksum(self) -> int:
        return zlib.crc32(repr(self.pairs).encode())

    def collate(self, indices, pad_id: int) -> dict:
        indices = [int(i) for i in indices]
        return collate_pairs([self.pairs[i] for i in indices], indices, pad_id)


class SyntheticPairs:
    """A data module (the protocol `run_finetune` calls) over given training and validation pairs."""

    def __init__(self, train: list[Pair], val: list[Pair]) -> None:
        self.train, self.val = PairSamples(train), PairSamples(val)
        self.stats = {"train_samples": len(train)}

    def setup(self, tokenizer, max_seq_length: int, config=None) -> None:
        longest = int(max(self.train.lengths.max(), self.val.lengths.max()))
        assert longest <= max_seq_length, (longest, max_seq_length)

    def output_tokenizer_dir(self, checkpoint_dir: Path, out_dir: Path) -> Path:
        return Path(checkpoint_dir)

    def train_dataloader(self, micro_batch_size, seed, rank=0, world_size=1, global_batch_size=None) -> InstructLoader:
        return InstructLoader(self.train, micro_batch_size, shuffle=True, seed=seed, rank=rank, world_size=world_size,
                              pad_id=PAD, step_batch_size=global_batch_size)

    def val_dataloader(self, micro_batch_size, rank=0, world_size=1) -> InstructLoader:
        return InstructLoader(self.val, micro_batch_size, shuffle=False, rank=rank, world_size=world_size, pad_id=PAD)

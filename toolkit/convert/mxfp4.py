"""MXFP4 weights (OCP microscaling, 4-bit floats in groups of 32 sharing a power of two), as
gpt-oss's published checkpoints store their experts, dequantized at conversion.

A weight W (..., R, K) is stored as two tensors:

    <name>_blocks  (..., R, K / 32, 16) uint8: each group's 32 FP4 (E2M1) codes, two per byte,
                   the low nibble first (value 2j in bits 0-3, value 2j + 1 in bits 4-7)
    <name>_scales  (..., R, K / 32) uint8: each group's exponent e (E8M0, biased by 127)

and W[..., r, 32 g + j] = FP4[code] * 2^(e - 127). transformers (integrations/mxfp4.py) hands the
dequantized weight to GptOssExperts transposed, (..., K, R): the layout of its `gate_up_proj` and
`down_proj` parameters, and of bf16 gpt-oss checkpoints. `dequantize` returns that tensor.
"""

from __future__ import annotations

import torch

# E2M1 code -> value: sign bit 3, then two exponent bits and one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per shared exponent
EXPONENT_BIAS = 127


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `dequantize` returns for blocks of `blocks_shape` (..., R, G, 16): (..., G * 32, R)."""
    *lead, rows, groups, _ = blocks_shape
    return (*lead, groups * GROUP, rows)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 `blocks` (..., R, G, 16) and `scales` (..., R, G), both uint8 -> the weight transposed,
    (..., G * 32, R) in `dtype`. Computed a leading slice (one expert) at a time in float32, where
    every FP4 value times its power of two is exact, then rounded once to `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}")
    *lead, rows, groups, _ = blocks.shape
    out = torch.empty(dequantized_shape(tuple(blocks.shape)), dtype=dtype)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    flat_blocks = blocks.reshape(-1, rows, groups, GROUP // 2)
    flat_scales = scales.reshape(-1, rows, groups)
    flat_out = out.view(-1, groups * GROUP, rows)
    for i in range(flat_blocks.shape[0]):
        codes = flat_blocks[i].long()  # (R, G, 16)
        values = torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1)  # (R, G, 16, 2): low nibble first
        exponent = flat_scales[i].to(torch.int32) - EXPONENT_BIAS  # (R, G)
        values = torch.ldexp(values.view(rows, groups, GROUP), exponent[..., None].float())
        flat_out[i] = values.view(rows, groups * GROUP).transpose(0, 1)
    return out

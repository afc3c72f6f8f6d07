"""Decoding: sample tokens from a model with its KV cache. Used by `toolkit generate` (plain and chat
mode) and the lm-eval extension; imports nothing of theirs."""

from __future__ import annotations

from typing import Callable, Collection, Optional

import torch


@torch.inference_mode()
def generate_tokens(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: Optional[float] = None,
    eos_id: Optional[int] | Collection[int] = None,
    generator: Optional[torch.Generator] = None,
    stop: Optional[Callable[[torch.Tensor], bool]] = None,
) -> torch.Tensor:
    """Prompt (T,) followed by up to `max_new_tokens` sampled tokens (greedy when temperature is 0).

    Generation stops after `eos_id` (one id, or several: a chat template's end-of-turn token and EOS).

    The prompt is processed in one forward pass that fills the KV cache; each new token then costs
    one forward pass over a single position. `stop`, when given, is called with the new tokens so
    far (N,) after each one; returning True ends generation there (stop strings).
    """
    stop_ids = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    total = min(prompt.numel() + max_new_tokens, model.config.block_size)
    model.set_kv_cache(batch_size=1, max_seq_length=total, device=prompt.device)
    try:
        tokens = [prompt]
        logits = model(prompt[None], input_pos=0, logits_to_keep=1)[0, -1]  # (V,)
        position = prompt.numel()
        while position < total:
            next_token = sample(logits, temperature, top_k, top_p, generator)
            tokens.append(next_token[None])
            if int(next_token) in stop_ids:
                break
            if stop is not None and stop(torch.cat(tokens[1:])):
                break
            if position + 1 >= total:
                break
            if model.rope.same_frequencies(position, position + 1):
                logits = model(next_token.view(1, 1), input_pos=position)[0, -1]
            else:
                # LongRoPE: past its switch every position takes the long frequencies, so the whole
                # sequence is run again (as transformers' Phi-3 generation drops its cache there)
                logits = model(torch.cat(tokens)[None], input_pos=0, logits_to_keep=1)[0, -1]
            position += 1
        return torch.cat(tokens)
    finally:
        model.clear_kv_cache()


def sample(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float], generator=None) -> torch.Tensor:
    """One token id from logits (V,)."""
    if temperature <= 0:
        return logits.argmax()
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[0]

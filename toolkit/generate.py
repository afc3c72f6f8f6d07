"""`toolkit generate`: sample text from a checkpoint, with a KV cache.

Imports go one way: this entry point uses `toolkit.generate_chat` (chat mode) and `toolkit.sampling`
(the decoding loop); neither imports this module.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from toolkit.errors import UserError
from toolkit.sampling import generate_tokens

# Precisions for inference: weights and compute in one dtype (no mixed precision without training).
INFERENCE_DTYPES = {"bf16-true": torch.bfloat16, "32-true": torch.float32, "16-true": torch.float16}


def inference_dtype(precision: Optional[str], device: str) -> torch.dtype:
    """The dtype for `precision`; None: bfloat16 on GPUs that support it, float32 elsewhere."""
    if precision is None:
        # Native bfloat16 only: V100 and T4 emulate it slowly.
        native_bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported(including_emulation=False)
        precision = "bf16-true" if native_bf16 else "32-true"
    if precision not in INFERENCE_DTYPES:
        raise UserError(f"--precision must be one of {', '.join(INFERENCE_DTYPES)} for inference, got {precision!r}.")
    return INFERENCE_DTYPES[precision]


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float], num_samples: int, seed: int) -> None:
    """One line for a sampling setting out of range, instead of a traceback from torch (or a silent misreading)."""
    from toolkit.args import check_seed

    if temperature < 0:
        raise UserError(f"--temperature must be 0 (greedy) or more, got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top_k must be at least 1 (or null for no limit), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1] (or null for no limit), got {top_p}")
    if num_samples < 1:
        raise UserError(f"--num_samples must be at least 1, got {num_samples}")
    check_seed(seed)


def generate(
    checkpoint_dir: Path,
    prompt: str = "",
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: Optional[float] = None,
    num_samples: int = 1,
    seed: int = 1234,
    device: str = "auto",
    precision: Optional[str] = None,
    prompt_style: Optional[str] = None,
    messages: Optional[Path] = None,
    chat: bool = False,
    system: Optional[str] = None,
    chat_template: Optional[str] = None,
    template_variables: Optional[dict] = None,  # plain dict: values stay as written (see Chat)
) -> list[str]:
    """Sample text from a toolkit checkpoint, or chat with it through its chat template.

    Args:
        checkpoint_dir: A toolkit checkpoint, e.g. `out/pretrain/debug/final`.
        prompt: Text to continue.
        max_new_tokens: Tokens to generate per sample (fewer if the model's context ends first).
        temperature: Softmax temperature; 0 means greedy decoding.
        top_k: Sample only among the k most likely tokens.
        top_p: Sample only among the most likely tokens whose probabilities sum to p.
        num_samples: Independent samples to draw.
        seed: Random seed.
        device: "auto", "cpu" or "cuda".
        precision: "bf16-true" or "32-true"; default bf16 on GPUs that support it, float32 on CPU.
        prompt_style: Wrap the prompt as an instruction in this style (alpaca, chatml, llama-3, ...),
            as fine-tuning did; "auto" picks the model's default style. None: the prompt as written.
        messages: A JSON file with a conversation ending in a user message ([{"role", "content"}, ...]):
            print the model's reply, prompted through the chat template as chat fine-tuning trained it.
        chat: An interactive multi-turn chat on stdin (/reset starts over, /exit or Ctrl-D ends).
        system: A system message for --messages or --chat (unless the conversation has one).
        chat_template: For --messages and --chat: a built-in template (chatml, llama-3, llama-2, gemma,
            zephyr) or a .jinja file; default: the checkpoint's own (see `toolkit.data.chat_template`).
        template_variables: For --messages and --chat: extra template variables as JSON values, the
            same as fine-tuning's --data.template_variables, e.g. '{"enable_thinking": false}' (Qwen3)
            or '{"reasoning_effort": "high"}' (gpt-oss).
    """
    from toolkit.model_dir import load_model, require_checkpoint_dir
    from toolkit.models.config import Config
    from toolkit.tokenizer import Tokenizer, check_tokenizer_fits

    checkpoint_dir = require_checkpoint_dir(checkpoint_dir)
    if max_new_tokens < 1:
        raise UserError("--max_new_tokens must be at least 1.")
    check_sampling(temperature, top_k, top_p, num_samples, seed)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = inference_dtype(precision, device)
    if (chat or messages is not None) and (prompt or prompt_style is not None):
        raise UserError("--prompt and --prompt_style are for plain text; --messages and --chat use the chat template.")
    if template_variables is not None or chat_template is not None:
        if not (chat or messages is not None):
            raise UserError("--chat_template and --template_variables apply to --messages and --chat only.")
        from toolkit.data.chat_template import check_template_variables

        template_variables = check_template_variables(template_variables, "--template_variables")
    if messages is not None:
        from toolkit.generate_chat import read_messages

        conversation = read_messages(messages, system)  # a bad file fails before the model loads
    tokenizer = Tokenizer(checkpoint_dir)
    check_tokenizer_fits(tokenizer, Config.from_file(checkpoint_dir).vocab_size, str(checkpoint_dir))
    model = load_model(checkpoint_dir, device=device, dtype=dtype)
    if chat or messages is not None:
        from toolkit.data.chat_template import resolve_chat_template
        from toolkit.generate_chat import ChatSession, answer_messages, interactive

        template = resolve_chat_template(tokenizer, chat_template, model.config, template_variables)
        generator = torch.Generator(device=device).manual_seed(seed)
        session = ChatSession(model, tokenizer, template, device, max_new_tokens, temperature, top_k, top_p, generator)
        if messages is not None:
            return answer_messages(session, conversation, num_samples)
        return interactive(session, system)
    stop_ids = tokenizer.stop_ids
    stop_texts: list[str] = []
    if prompt_style is not None:
        from toolkit.data.prompts import resolve_style

        style = resolve_style(None if prompt_style == "auto" else prompt_style, model.config)
        prompt = style.apply(prompt)
        # The response ends where fine-tuning ended it: at the style's end-of-turn marker (one
        # special token, e.g. <|im_end|>, or text to look for in the decoded reply) as well as EOS.
        for text in style.stop_strings:
            token = tokenizer.token_to_id(text)
            stop_ids.add(token) if token is not None else stop_texts.append(text)
    stop = (lambda new: any(text in tokenizer.decode(new) for text in stop_texts)) if stop_texts else None
    encoded = tokenizer.encode(prompt).to(device)
    if encoded.numel() == 0:
        if tokenizer.bos_id is None:
            raise UserError("Empty prompt and the tokenizer has no BOS token to start from: pass --prompt.")
        encoded = torch.tensor([tokenizer.bos_id], device=device)
    if encoded.numel() >= model.config.block_size:
        raise UserError(f"The prompt has {encoded.numel()} tokens; the model's context is {model.config.block_size}.")
    generator = torch.Generator(device=device).manual_seed(seed)
    samples = []
    for _ in range(num_samples):
        start = time.perf_counter()
        out = generate_tokens(model, encoded, max_new_tokens, temperature, top_k, top_p, stop_ids, generator, stop=stop)
        seconds = time.perf_counter() - start
        reply = tokenizer.decode(out[encoded.numel():])
        for marker in stop_texts:
            reply = reply.split(marker, 1)[0]
        text = tokenizer.decode(encoded) + reply
        samples.append(text)
        print(text, flush=True)
        new = out.numel() - encoded.numel()
        print(f"\n[{new} tokens in {seconds:.2f} s: {new / seconds:.1f} tokens/s]", flush=True)
    return samples

"""Prompt styles: how an instruction (and an optional input) is laid out before the response.

A style is plain data: a template with `{instruction}` (and one with `{input}` too), the text that
closes a response (a chat format's end-of-turn marker, if any) and nothing else. Styles live in a
registry keyed by name; `default_style_for` picks one for a model preset from a small table, so no
model code ever needs to look at a model's name.

    style = get_style("alpaca")
    prompt = style.apply("Name a colour.")             # the text the response follows
    text = style.render("Name a colour.", "", "Red.")  # the whole training text

Importing this module is cheap (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from toolkit.errors import UserError, did_you_mean


@dataclass(frozen=True)
class PromptStyle:
    """One prompt layout.

    Args:
        name: the registry key (`--data.prompt_style NAME`).
        template: the prompt for an instruction alone; holds `{instruction}`.
        template_with_input: the prompt when the record has a non-empty input; holds `{instruction}`
            and `{input}`. None: the instruction and the input, separated by a blank line, fill
            `{instruction}` of `template` (what chat formats do with a single user turn).
        response_prefix: text between the prompt and the response that belongs to the response
            (it is trained, not masked): the space after "[/INST]" or "Output:". Keeping it out of
            the prompt means a prompt at generation time ends on the same token as in training
            (a byte-level BPE merges the space into the response's first word).
        response_end: text that closes the response in this format (an end-of-turn marker such as
            "<|im_end|>"), written after the response and before the tokenizer's EOS. Generation
            should stop at it as well as at EOS.
    """

    name: str
    template: str
    template_with_input: Optional[str] = None
    response_prefix: str = ""
    response_end: str = ""

    def apply(self, instruction: str, input: str = "") -> str:
        """The prompt text; the response follows it directly."""
        if input:
            if self.template_with_input is not None:
                return self.template_with_input.format_map({"instruction": instruction, "input": input})
            instruction = f"{instruction}\n\n{input}"
        # format_map substitutes the values as they are: braces inside them are not parsed again.
        return self.template.format_map({"instruction": instruction})

    def render(self, instruction: str, input: str, response: str) -> str:
        """The whole training text (without BOS/EOS): prompt, response, end-of-turn marker."""
        return self.apply(instruction, input) + self.response_prefix + response + self.response_end

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Text that ends a generated response besides EOS."""
        return (self.response_end,) if self.response_end else ()


_ALPACA_HEAD = "Below is an instruction that describes a task"
_ALPACA_ASK = "Write a response that appropriately completes the request."

_BUILTIN = (
    PromptStyle(
        name="alpaca",
        template=f"{_ALPACA_HEAD}. {_ALPACA_ASK}\n\n### Instruction:\n{{instruction}}\n\n### Response:\n",
        template_with_input=(
            f"{_ALPACA_HEAD}, paired with an input that provides further context. {_ALPACA_ASK}\n\n"
            "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
        ),
    ),
    PromptStyle(
        name="chatml",
        template="<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n",
        response_end="<|im_end|>",
    ),
    PromptStyle(
        name="llama-3",
        template=(
            "<|start_header_id|>user<|end_header_id|>\n\n{instruction}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        ),
        response_end="<|eot_id|>",
    ),
    # "[INST] ... [/INST] response</s>": the tokenizer's EOS closes the response.
    PromptStyle(name="llama-2", template="[INST] {instruction} [/INST]", response_prefix=" "),
    PromptStyle(name="phi", template="Instruct: {instruction}\nOutput:", response_prefix=" "),  # Phi-2
    PromptStyle(name="phi-3", template="<|user|>\n{instruction}<|end|>\n<|assistant|>\n", response_end="<|end|>"),
    PromptStyle(name="phi-4", template="<|im_start|>user<|im_sep|>{instruction}<|im_end|><|im_start|>assistant<|im_sep|>",
                response_end="<|im_end|>"),
    PromptStyle(name="phi-4-mini", template="<|user|>{instruction}<|end|><|assistant|>", response_end="<|end|>"),
    # Tulu's turns (OLMo 2's instruct models): the tokenizer's EOS closes the response.
    PromptStyle(name="tulu", template="<|user|>\n{instruction}\n<|assistant|>\n"),
    PromptStyle(
        name="gemma",
        template="<start_of_turn>user\n{instruction}<end_of_turn>\n<start_of_turn>model\n",
        response_end="<end_of_turn>",
    ),
    # gpt-oss's harmony format as its chat template lays out one user turn and a final answer, less the
    # system message's "Current date" line (a training text should not change with the day it is made).
    PromptStyle(
        name="harmony",
        template=(
            "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. "
            "Channel must be included for every message.\nCalls to these tools must go to the commentary channel: "
            "'functions'.<|end|><|start|>user<|message|>{instruction}<|end|><|start|>assistant<|channel|>final<|message|>"
        ),
        response_end="<|return|>",
    ),
    # No template: the instruction (and input) on their own, a line break, then the response.
    PromptStyle(name="plain", template="{instruction}\n"),
)

STYLES: dict[str, PromptStyle] = {style.name: style for style in _BUILTIN}


def register_style(style: PromptStyle) -> None:
    """Add (or replace) a style, e.g. from a project's own module, before the data is set up."""
    STYLES[style.name] = style


def style_names() -> list[str]:
    return sorted(STYLES)


def get_style(name: str) -> PromptStyle:
    style = STYLES.get(name)
    if style is None:
        style = STYLES.get(name.strip().lower())
    if style is None:
        raise UserError(
            f"Unknown prompt style {name!r}.{did_you_mean(name, style_names())} "
            f"Choose one of: {', '.join(style_names())}."
        )
    return style


# Default style per model: (preset-name prefix, style), longest matching prefix wins. Matched against
# the preset's canonical name, so aliases and Hugging Face repo ids work too.
DEFAULT_STYLES: tuple[tuple[str, str], ...] = (
    ("llama-3", "llama-3"),  # llama-3, llama-3.1, llama-3.2
    ("llama-2", "llama-2"),
    ("mistral", "llama-2"),  # Mistral's instruct format is [INST] ... [/INST]
    ("mixtral", "llama-2"),
    ("qwen", "chatml"),  # qwen2.5, qwen3
    ("smollm3", "chatml"),
    ("gemma", "gemma"),
    ("phi", "phi"),  # phi-2
    ("phi-3", "phi-3"),  # phi-3 and phi-3.5
    ("phi-4", "phi-4"),
    ("phi-4-mini", "phi-4-mini"),
    ("olmo-2", "tulu"),
    ("olmoe", "tulu"),  # OLMoE's instruct model: Tulu's turns, as OLMo 2's
    ("gpt-oss", "harmony"),
    ("pythia", "alpaca"),
    ("tiny-llama", "alpaca"),
    ("debug", "alpaca"),
)
# For a model name the table does not know (a custom config): by architecture family, then this.
DEFAULT_STYLES_BY_FAMILY: dict[str, str] = {"qwen2": "chatml", "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma",
                                             "phi": "phi", "phi3": "phi-3", "olmo2": "tulu", "qwen3": "chatml",
                                             "smollm3": "chatml",
                                             "mixtral": "llama-2", "qwen3_moe": "chatml", "olmoe": "tulu",
                                             "gpt_oss": "harmony"}
FALLBACK_STYLE = "alpaca"


def _preset_name(name: str) -> Optional[str]:
    from toolkit.models.presets import find_preset

    try:
        return find_preset(name)["name"]
    except UserError:
        return None


def _by_prefix(name: str) -> Optional[str]:
    """The style of the longest prefix of `name` in DEFAULT_STYLES, or None."""
    matches = [(prefix, style) for prefix, style in DEFAULT_STYLES if name.lower().startswith(prefix)]
    return max(matches, key=lambda match: len(match[0]))[1] if matches else None


def _family_styles(family: str) -> set[str]:
    """The styles the presets of `family` are laid out in (Phi-3, Phi-4 and Phi-4-mini's for phi3)."""
    from toolkit.models.config import Config
    from toolkit.models.presets import PRESETS

    default = Config.__dataclass_fields__["family"].default
    return {style for p in PRESETS if p.get("family", default) == family and (style := _by_prefix(p["name"]))}


def default_style_for(model: Any) -> str:
    """The default style name for a model: a preset name, alias or HF repo id, or a `Config`.

    A preset's name decides (`DEFAULT_STYLES`). Another name is a custom model: its name's prefix
    decides where it names a style of its family's presets ("phi-4-reasoning" of family phi3: Phi-4's),
    else its family's style (a "phi4-custom" of family phi3 is Phi-3's, not the Phi-2 its prefix
    would say), else the prefix alone, else "alpaca".
    """
    name = model if isinstance(model, str) else getattr(model, "name", "") or ""
    family = None if isinstance(model, str) else getattr(model, "family", None)
    preset = _preset_name(name) if name else None
    if preset is not None and (style := _by_prefix(preset)) is not None:
        return style
    prefixed = _by_prefix(name) if name else None
    if family is not None and prefixed in _family_styles(family):
        return prefixed
    if family in DEFAULT_STYLES_BY_FAMILY:
        return DEFAULT_STYLES_BY_FAMILY[family]
    return prefixed or FALLBACK_STYLE


def resolve_style(prompt_style: Optional[str], model: Any = "") -> PromptStyle:
    """The style named by `prompt_style`, or the model's default when it is None."""
    return get_style(prompt_style if prompt_style is not None else default_style_for(model))


__all__ = [
    "DEFAULT_STYLES",
    "PromptStyle",
    "STYLES",
    "default_style_for",
    "get_style",
    "register_style",
    "resolve_style",
    "style_names",
]

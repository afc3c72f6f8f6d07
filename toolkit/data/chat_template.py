"""Chat templates: the Jinja programs in a model's tokenizer files that lay a conversation out as text.

A template is rendered the way `transformers` `apply_chat_template` renders it, so that the tokens
a model is fine-tuned on are the tokens `transformers`, vLLM or llama.cpp give it afterwards:

- Jinja's immutable sandbox (a template is code from a model repository), with `trim_blocks`,
  `lstrip_blocks` and the loop-control extension (`{% break %}`, `{% continue %}`);
- variables: `messages` (a list of {"role", "content", ...}: also `tool_calls`, `reasoning_content`
  / `thinking` where a message has them), `add_generation_prompt`, `tools` (the conversation's
  function definitions, or None) and `documents` (None), the tokenizer's special tokens as text
  (`bos_token`, `eos_token`, ...), and any extra variables given, typed as JSON values (Qwen3's
  `enable_thinking`: false, gpt-oss's `reasoning_effort`, Llama 3's `date_string`);
- helpers: `raise_exception(message)`, `strftime_now(format)` (read once per template, so every
  conversation of a run sees the same date), a `tojson` filter that keeps non-ASCII text, and the
  `{% generation %}` tag of templates patched for assistant masks (rendered as its body);
- the text is tokenized with no special tokens added: the template writes BOS where the model wants it.

Where a template comes from (`resolve_chat_template`), first match wins:
    1. the name of a built-in template (`CHAT_TEMPLATES`) or a .jinja file, given by the user;
    2. the checkpoint's `chat_template.jinja` (how transformers 5 saves it);
    3. the `chat_template` field of its `tokenizer_config.json`;
    4. the built-in template named like the model's default prompt style (llama-3, chatml, llama-2,
       gemma), else "zephyr", which needs nothing but the tokenizer's EOS token.
A template that did not come from the checkpoint is written into the output's tokenizer_config.json
(`write_tokenizer_files`), so the fine-tuned model carries the format it was trained on.

Importing this module is cheap: jinja2 is imported when a template is compiled.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from toolkit.errors import UserError, did_you_mean

if TYPE_CHECKING:
    from toolkit.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 saves a tokenizer's template here
TOKENIZER_CONFIG = "tokenizer_config.json"

# Built-in templates, for checkpoints that have none. Each is written for this toolkit; the layouts
# are the published ones of the model families they are named after. A system message is folded into
# the first user turn where the format has no system role (llama-2's <<SYS>> block, gemma).
CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
    "llama-3": (
        "{{- bos_token -}}"
        "{%- for message in messages -%}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
        " + '<|eot_id|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
    ),
    "llama-2": (
        "{%- if messages[0]['role'] == 'system' -%}"
        "{%- set system = messages[0]['content'] | trim -%}{%- set turns = messages[1:] -%}"
        "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
        "{%- for message in turns -%}"
        "{%- if message['role'] == 'user' -%}"
        "{%- set text = message['content'] | trim -%}"
        "{%- if loop.first and system -%}{%- set text = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + text -%}{%- endif -%}"
        "{{- bos_token + '[INST] ' + text + ' [/INST]' -}}"
        "{%- elif message['role'] == 'assistant' -%}"
        "{{- ' ' + message['content'] | trim + ' ' + eos_token -}}"
        "{%- else -%}{{- raise_exception('the llama-2 format has no role ' + message['role']) -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
    ),
    "gemma": (
        "{{- bos_token -}}"
        "{%- if messages[0]['role'] == 'system' -%}"
        "{%- set system = messages[0]['content'] | trim + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
        "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
        "{%- for message in turns -%}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
        "{%- set prefix = system if loop.first else '' -%}"
        "{{- '<start_of_turn>' + role + '\\n' + prefix + message['content'] | trim + '<end_of_turn>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
    ),
    # Plain-text role headers; every turn ends with the tokenizer's EOS, so it suits any tokenizer.
    "zephyr": (
        "{%- for message in messages -%}"
        "{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
    ),
}
FALLBACK_TEMPLATE = "zephyr"

# The special tokens transformers hands a template as variables (its `special_tokens_map`).
_SPECIAL_TOKEN_VARIABLES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _compile(source: str, now: datetime):
    """The template compiled in Jinja's immutable sandbox, with the helpers transformers provides."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` (templates patched for assistant masks): the body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = now.strftime
    return env.from_string(source)


@dataclass
class ChatTemplate:
    """A chat template with the variables it renders with.

    Args:
        source: the Jinja text.
        origin: where it came from, for messages ("tokenizer_config.json of <dir>", "built-in 'chatml'").
        variables: special tokens as text (bos_token, eos_token, ...) and extra variables.
        from_checkpoint: whether the checkpoint's tokenizer files already hold it.
    """

    source: str
    origin: str
    variables: dict[str, Any] = field(default_factory=dict)
    from_checkpoint: bool = False

    def __post_init__(self) -> None:
        import jinja2

        try:
            self._compiled = _compile(self.source, datetime.now())
        except jinja2.TemplateSyntaxError as err:
            raise UserError(
                f"the chat template ({self.origin}) is not valid Jinja: {err.message} (line {err.lineno})"
            ) from err

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: Optional[list[dict[str, Any]]] = None) -> str:
        """The conversation as text (`tools`: the function definitions the conversation may call).
        Raises `TemplateRenderError` with the template's own message."""
        import jinja2

        try:
            return self._compiled.render(
                **{"documents": None, **self.variables},
                messages=template_messages(messages), add_generation_prompt=add_generation_prompt, tools=tools,
            )
        except jinja2.TemplateError as err:
            raise TemplateRenderError(str(err) or type(err).__name__) from err
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise TemplateRenderError(f"{type(err).__name__}: {err}") from err


# Names a message's reasoning may come under; transformers passes it to templates under the first
# two (Qwen3 and DeepSeek read reasoning_content, gpt-oss reads thinking).
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers (5.x) hands them to a template: keys whose value is None dropped
    (templates test a key's presence: `"content" in message`), and the reasoning under both names
    templates read."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class TemplateRenderError(Exception):
    """A template refused a conversation (raise_exception) or failed on it; the caller names the record."""


def _read_config(directory: Path) -> dict:
    path = directory / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {path}: {err}; fix or delete that file") from err
    return config if isinstance(config, dict) else {}


def checkpoint_template(directory: Path) -> Optional[tuple[str, str]]:
    """(source, origin) of the template in a tokenizer folder, or None when it has none.

    chat_template.jinja wins over tokenizer_config.json, as in transformers. A config may hold several
    named templates (a list of {"name", "template"}): the one named "default" is used.
    """
    directory = Path(directory)
    jinja_file = directory / TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"cannot read {jinja_file}: {err}; fix or delete that file") from err
    return _configured_template(_read_config(directory).get("chat_template"), f"{directory / TOKENIZER_CONFIG}")


def _configured_template(value: Any, origin: str) -> Optional[tuple[str, str]]:
    """(source, origin) of a "chat_template" value of a JSON file: a template, or a list of named
    ones of which "default" is used; None when there is none."""
    if isinstance(value, str) and value.strip():
        return value, origin
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"], f"{origin} (template 'default')"
        raise UserError(
            f"{origin} holds several chat templates ({', '.join(map(str, named))}) and none named 'default'; "
            "pass one with --data.chat_template FILE.jinja"
        )
    return None


def _template_from_json_file(path: Path) -> tuple[str, str]:
    """The template a JSON file holds under "chat_template" (a tokenizer_config.json, or a file of
    that one key): the file itself is not a template."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read the chat template {path}: {err}") from None
    found = _configured_template(config.get("chat_template"), str(path)) if isinstance(config, dict) else None
    if found is None:
        raise UserError(f"{path} holds no \"chat_template\" (a JSON file must be a tokenizer_config.json or "
                        "{\"chat_template\": ...}); pass it, or a .jinja file")
    return found


def default_template_name(model: Any) -> str:
    """The built-in template for a model without one: its default prompt style's name, if built in."""
    from toolkit.data.prompts import default_style_for

    style = default_style_for(model)
    return style if style in CHAT_TEMPLATES else FALLBACK_TEMPLATE


def special_token_variables(tokenizer: "Tokenizer") -> dict[str, str]:
    """The special tokens as text, as the template sees them (transformers' special_tokens_map).

    BOS/EOS/PAD are the ones the toolkit resolved (the ones `convert_to_hf` writes into the export);
    the others come from tokenizer_config.json when it names them.
    """
    from toolkit.tokenizer import token_text

    config = _read_config(Path(tokenizer.directory))
    found: dict[str, str] = {}
    for name in _SPECIAL_TOKEN_VARIABLES:
        text = token_text(config.get(name))
        resolved = getattr(tokenizer, name.replace("_token", "_id"), None)
        if resolved is not None:
            text = tokenizer.id_to_token(resolved)
        if text is not None:
            found[name] = text
    return found


def resolve_chat_template(
    tokenizer: "Tokenizer", name: Optional[str] = None, model: Any = "", variables: Optional[dict[str, Any]] = None
) -> ChatTemplate:
    """The template to use with `tokenizer` (see the module docstring for the order)."""
    directory = Path(tokenizer.directory)
    source, origin, from_checkpoint = None, "", False
    if name is not None:
        if name in CHAT_TEMPLATES:
            source, origin = CHAT_TEMPLATES[name], f"built-in {name!r}"
        elif name.endswith((".jinja", ".j2", ".txt")) or os.sep in name or Path(name).is_file():
            path = Path(name)
            if not path.is_file():
                raise UserError(
                    f"chat template file {path} does not exist; pass a .jinja file (or a tokenizer_config.json) or one "
                    f"of: {', '.join(CHAT_TEMPLATES)}"
                )
            if path.suffix == ".json":
                source, origin = _template_from_json_file(path)
            else:
                try:
                    source, origin = path.read_text(encoding="utf-8"), str(path)
                except (OSError, UnicodeDecodeError) as err:
                    raise UserError(f"cannot read the chat template {path}: {err}") from err
        else:
            raise UserError(
                f"unknown chat template {name!r}.{did_you_mean(name, CHAT_TEMPLATES)} Pass one of: "
                f"{', '.join(CHAT_TEMPLATES)}, or a .jinja file"
            )
    else:
        found = checkpoint_template(directory)
        if found is not None:
            (source, origin), from_checkpoint = found, True
        else:
            default = default_template_name(model)
            source = CHAT_TEMPLATES[default]
            origin = f"built-in {default!r} (the tokenizer in {directory} has no chat template)"
    all_variables = {**special_token_variables(tokenizer), **check_template_variables(variables)}
    return ChatTemplate(source, origin, all_variables, from_checkpoint)


# Variables a template gets from the conversation itself; passing them as template variables is a mistake.
_RESERVED_VARIABLES = ("messages", "add_generation_prompt", "tools")


def check_template_variables(variables: Optional[dict[str, Any]], option: str = "--data.template_variables") -> dict[str, Any]:
    """The extra template variables, checked: JSON values (strings, numbers, booleans, null, lists,
    mappings) under names that are not the conversation's own. A quoted "true"/"false" is refused: a
    template tests it for truth (`{% if enable_thinking %}`), and any non-empty string is true."""
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise UserError(f"{option} must be a mapping of names to values, e.g. '{{\"enable_thinking\": false}}'")
    for name, value in variables.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise UserError(f"{option}: {name!r} is not a template variable name (letters, digits and _)")
        if name in _RESERVED_VARIABLES:
            raise UserError(f"{option}: {name!r} comes from each conversation; it cannot be set as a template variable")
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            raise UserError(
                f"{option}: {name} is the string {value!r}, which a template reads as true; "
                f"write the boolean without quotes: '{{\"{name}\": {value.strip().lower()}}}'"
            )
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise UserError(f"{option}: {name} is a {type(value).__name__}; give a JSON value "
                            "(string, number, boolean, null, list or mapping)") from None
    return dict(variables)


def write_tokenizer_files(src_dir: Path, dst_dir: Path, template: ChatTemplate) -> Path:
    """Copy the tokenizer files of `src_dir` into `dst_dir`, with `template` as their chat template.

    The template goes into tokenizer_config.json ("chat_template"), which every reader of Hugging
    Face folders understands; a chat_template.jinja from `src_dir` is not copied (it would win).
    Safe to call from several processes at once: each file is written whole and renamed into place.
    """
    from toolkit.tokenizer import TOKENIZER_FILES

    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)

    def put(name: str, write) -> None:
        tmp = dst_dir / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        write(tmp)
        os.replace(tmp, dst_dir / name)

    for name in TOKENIZER_FILES:
        if name in (TOKENIZER_CONFIG, TEMPLATE_FILE) or not (src_dir / name).is_file():
            continue
        put(name, lambda tmp, src=src_dir / name: shutil.copyfile(src, tmp))
    stale = dst_dir / TEMPLATE_FILE
    if stale.exists():
        stale.unlink()
    config = {**_read_config(src_dir), "chat_template": template.source}
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    put(TOKENIZER_CONFIG, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return dst_dir


__all__ = [
    "CHAT_TEMPLATES",
    "ChatTemplate",
    "FALLBACK_TEMPLATE",
    "TemplateRenderError",
    "check_template_variables",
    "checkpoint_template",
    "default_template_name",
    "resolve_chat_template",
    "write_tokenizer_files",
]

"""The toolkit's model inside lm-evaluation-harness, in process: `ToolkitLM`, registered as "toolkit".

It reads a toolkit checkpoint folder, or a LoRA run's adapter with the base model it was trained on
(applied through peft, not merged), and answers the harness's three request types:

    loglikelihood          (context, continuation) -> (log p(continuation | context), is greedy)
    loglikelihood_rolling  document -> log p(document), over windows of `max_length` tokens
    generate_until         (context, generation kwargs) -> text, with the KV cache and stop strings

Tokenization follows lm-evaluation-harness's Hugging Face backend token for token (BOS handling,
left truncation, rolling windows, stop strings), so the same weights give the same numbers in both.

Distributed: with a launched Fabric, every process receives every request (the harness runs as if
alone on each) and cuts the work into units that do not depend on the number of processes.
Replicated (DDP's layout, each process holds the whole model): each process computes its share
(unit i on process i % N) and gathers the rest from the others. Sharded (FSDP2, the trainers'
engine, for a model that does not fit on one device): each process holds 1/N of every weight and
all of them compute every unit together, each block's weights gathered for its forward pass. Every
unit is computed with the same shapes whatever N is, so N processes give exactly the results of one.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from toolkit.errors import UserError

log = logging.getLogger(__name__)


def find_model_dirs(path: Path | str) -> tuple[Path, Optional[Path]]:
    """(the checkpoint with the full weights, the LoRA adapter folder or None); a one-line error otherwise.

    `path` is a toolkit checkpoint (pretrained, fine-tuned, merged, converted), or a LoRA run's folder
    or its `final` folder, whose lora.json names the base checkpoint.
    """
    from toolkit.model_dir import require_checkpoint_dir
    from toolkit.finetune.lora import find_adapter_dir, read_adapter_meta

    adapter_dir = find_adapter_dir(path)
    if adapter_dir is None:
        return require_checkpoint_dir(path), None
    base, _ = read_adapter_meta(adapter_dir)
    if not base.exists():
        raise UserError(f"The adapter in {adapter_dir} was trained on {base}, which does not exist any more.")
    return require_checkpoint_dir(base), adapter_dir


def load_evaluated_model(path: Path | str, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, Path]:
    """(the model in eval mode, the folder that holds its tokenizer) for `find_model_dirs(path)`."""
    from toolkit.model_dir import load_model
    from toolkit.finetune.lora import attach_adapter, read_adapter_meta

    checkpoint, adapter_dir = find_model_dirs(path)
    if adapter_dir is None:
        return load_model(checkpoint, device=str(device), dtype=dtype), checkpoint
    _, lora = read_adapter_meta(adapter_dir)
    model = attach_adapter(load_model(checkpoint, device=str(device)), adapter_dir, lora)
    # The toolkit GPT with peft's LoRA layers in place of the adapted Linears: it keeps the model's
    # own methods (KV cache) and computes base + adapter in every adapted layer.
    return model.get_base_model().to(device=device, dtype=dtype).eval(), adapter_dir


def load_sharded_model(checkpoint: Path, fabric: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint's model sharded by FSDP2 over the processes of `fabric`, as the trainers set it
    up (`setup_model`): built on the meta device, sharded, then each process reads only its own rows
    of every weight from the file. Returns the sharded module itself (FSDP2's hooks are on it)."""
    from toolkit.model_dir import checkpoint_row_reader
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT
    from toolkit.training.model_setup import setup_model

    with torch.device("meta"):
        model = GPT(Config.from_file(checkpoint)).to(dtype)
    model.requires_grad_(False)
    module = setup_model(fabric, model, checkpoint_row_reader(checkpoint))
    return (module.module if hasattr(module, "module") else module).eval()


def check_settings(config, tokenizer, batch_size: int | str, max_length: Optional[int], stride: Optional[int], chat_template: Optional[str]):
    """(batch_size, max_length, stride, ChatTemplate), defaults filled in; a one-line error for a bad one.

    batch_size is a number or "auto" (found by `ToolkitLM.detect_batch_size` once the model is loaded).
    """
    from toolkit.data.chat_template import resolve_chat_template

    if batch_size != "auto":
        try:
            batch_size = int(batch_size)
        except (TypeError, ValueError):
            raise UserError(f"--batch_size must be a number or 'auto', got {batch_size!r}.") from None
        if batch_size < 1:
            raise UserError(f"--batch_size must be at least 1, got {batch_size}.")
    max_length = int(max_length) if max_length is not None else config.block_size
    if not 1 < max_length <= config.block_size:
        raise UserError(f"--max_length must be between 2 and the model's context ({config.block_size}), got {max_length}.")
    stride = int(stride) if stride is not None else max_length
    if not 1 <= stride <= max_length:
        raise UserError(f"--stride must be between 1 and max_length ({max_length}), got {stride}.")
    return batch_size, max_length, stride, resolve_chat_template(tokenizer, chat_template, config)


DEFAULT_MAX_GEN_TOKS = 256  # tokens a generation task may produce when neither it nor --gen_kwargs says


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation failure (CUDA, or the CPU allocator's)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("out of memory" in str(error) or "can't allocate memory" in str(error))
    )


def largest_batch_that_fits(run: Callable[[int], Any], largest: int) -> int:
    """The largest power of two up to `largest` (or `largest` itself) for which `run(batch_size)`
    does not run out of memory, halving from the top; a one-line error when not even 1 fits."""
    size = largest
    while size >= 1:
        try:
            run(size)
            return size
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            size = size // 2 if size & (size - 1) == 0 else 1 << (size.bit_length() - 1)
    raise UserError("--batch_size auto: not even one sequence of max_length tokens fits in memory; lower --max_length.")


@dataclass
class _Row:
    """One distinct model input of `_loglikelihood_tokens`: prefix + suffix, run once for all its members.

    The prefix ends with the token that predicts the continuation's first token; the suffix is the
    continuation without its last token. Requests that differ only in the continuation's last token
    (single-token answer choices, or duplicates) share one row.
    """

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    members: list[tuple[int, list[int]]] = field(default_factory=list)  # (request index, continuation tokens)


# Appended to a message that the model is to continue; the rendered text is cut where it appears.
_OPEN_END = "CONTINUE_FINAL_MESSAGE_TAG "


@register_model("toolkit")
class ToolkitLM(TemplateLM):
    """A toolkit checkpoint (or base + LoRA adapter) as an lm-evaluation-harness model.

    Args:
        checkpoint_dir: A toolkit checkpoint folder, or a LoRA run's folder (adapter not merged).
        device: "cpu", "cuda", "cuda:1", ...; default the Fabric's device, else CUDA when there is one.
        precision: "bf16-true", "32-true" or "16-true"; default bf16 on GPUs that support it, else float32.
        batch_size: Sequences per forward pass for log-likelihoods, and decoded together for
            generation; "auto": the largest that fits (`detect_batch_size`).
        max_batch_size: The largest batch size "auto" tries.
        max_length: Longest input in tokens; default the model's context (block_size).
        stride: loglikelihood_rolling: after the first window, each window holds max_length tokens
            and scores only its last `stride`, so every token keeps at least max_length - stride
            tokens of context. Default max_length: windows that do not overlap, as the harness's
            Hugging Face backend has them.
        max_gen_toks: Tokens to generate when a task does not say.
        chat_template: For prompts given as conversations (the harness's apply_chat_template): a
            built-in template (chatml, llama-3, llama-2, gemma, zephyr) or a .jinja file; default the
            checkpoint's own, as `toolkit generate --chat true` uses it.
        seed: Seed of sampled generations (request i uses seed + i, on whichever process runs it).
        fabric: A launched Fabric: requests are split across its processes and the results gathered;
            under FSDP (`is_fsdp(fabric)`) the model is sharded and every process runs every request.
    """

    def __init__(
        self,
        checkpoint_dir: str | Path,
        device: Optional[str] = None,
        precision: Optional[str] = None,
        batch_size: int | str = 8,
        max_batch_size: int = 64,
        max_length: Optional[int] = None,
        stride: Optional[int] = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        chat_template: Optional[str] = None,
        seed: int = 1234,
        fabric: Any = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        from toolkit.generate import inference_dtype
        from toolkit.tokenizer import Tokenizer

        if unused:
            log.warning("ToolkitLM ignores these arguments: %s", ", ".join(sorted(unused)))
        self.fabric = fabric
        if fabric is not None:
            self._device = torch.device(fabric.device)
        else:
            self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        from toolkit.training.fabric import is_fsdp

        self.sharded = fabric is not None and is_fsdp(fabric)
        dtype = inference_dtype(precision, self._device.type)
        if self.sharded:
            checkpoint, adapter_dir = find_model_dirs(checkpoint_dir)
            if adapter_dir is not None:
                raise UserError("A LoRA adapter cannot be evaluated sharded yet: merge it first (`toolkit merge_lora`).")
            self.model, tokenizer_dir = load_sharded_model(checkpoint, fabric, dtype), checkpoint
            from toolkit.training.checkpoint_io import gather_objects

            # What each process holds: its shard of every weight (the harness asks process 0 only).
            self.parameters_per_process = gather_objects(fabric, sum(p.to_local().numel() for p in self.model.parameters()))
        else:
            self.model, tokenizer_dir = load_evaluated_model(checkpoint_dir, self._device, dtype)
        self.tokenizer = Tokenizer(tokenizer_dir)
        settings = check_settings(self.model.config, self.tokenizer, batch_size, max_length, stride, chat_template)
        self.batch_size, self._max_length, self.stride, self.conversation_template = settings
        if self.batch_size == "auto":
            self.batch_size = self.detect_batch_size(int(max_batch_size))
            self.batch_sizes = {"auto": self.batch_size}  # reported by the harness as config.batch_sizes
        self._max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)
        self._chat_stop_ids: Optional[set[int]] = None  # set once a prompt went through the chat template
        self._bos_text = None if self.tokenizer.bos_id is None else self.tokenizer.decode([self.tokenizer.bos_id], skip_special_tokens=False)

    # ------------------------------------------------------------------ what the harness asks of a model
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token a context-free request is conditioned on: BOS, else EOS (as the HF backend)."""
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.directory).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str:
        return self.conversation_template.source

    def get_model_info(self) -> dict:
        model = self.model
        info = {
            "model_num_parameters": sum(p.numel() for p in model.parameters()),
            "model_dtype": str(next(model.parameters()).dtype),
        }
        if self.sharded:
            info["parameters_per_process"] = self.parameters_per_process
        return info

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, left_truncate_len: Optional[int] = None, **kwargs) -> list[int]:
        """Token ids; BOS as the tokenizer adds it by default, unless asked not to or the text starts with it."""
        bos: Optional[bool] = None if add_special_tokens is None or add_special_tokens else False
        if add_special_tokens is None and self._bos_text and string.startswith(self._bos_text):
            bos = False
        ids = self.tokenizer.encode(string, bos=bos).tolist()
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the chat template, as the harness's Hugging Face backend renders it.

        With add_generation_prompt false the last (assistant) message is left open for the model to
        continue, as transformers' continue_final_message does: the message is rendered with a marker
        after it, and the text is cut at the marker. A template that refuses a system message gets
        the conversation without it.
        """
        from toolkit.generate_chat import end_of_turn_ids

        if self._chat_stop_ids is None:
            self._chat_stop_ids = end_of_turn_ids(self.conversation_template, self.tokenizer)
        if add_generation_prompt:
            return self._render(chat_history, add_generation_prompt=True)
        last = chat_history[-1]
        text = self._render([*chat_history[:-1], {**last, "content": last["content"] + _OPEN_END}], add_generation_prompt=False)
        cut = text.rindex(_OPEN_END.strip())
        return text[:cut] if text[cut : cut + len(_OPEN_END)] == _OPEN_END else text[:cut].rstrip()

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        from toolkit.data.chat_template import TemplateRenderError

        template = self.conversation_template
        try:
            return template.render(messages, add_generation_prompt=add_generation_prompt)
        except TemplateRenderError as err:
            without_system = [m for m in messages if m["role"] != "system"]
            if len(without_system) == len(messages):
                raise UserError(f"The chat template ({template.origin}) cannot render a prompt: {err}") from None
            log.warning("The chat template (%s) failed with a system message (%s); rendering without it.", template.origin, err)
            return self._render(without_system, add_generation_prompt)

    def detect_batch_size(self, largest: int) -> int:
        """The largest batch size up to `largest` (halving from it) whose forward pass over max_length
        tokens fits in memory, with a KV cache as generation holds it: what every batch of the run
        needs at most. With several processes, the smallest of theirs."""

        def run(size: int) -> None:
            tokens = torch.zeros(size, self.max_length, dtype=torch.long, device=self.device)
            self.model.set_kv_cache(batch_size=size, max_seq_length=self.max_length, device=self.device)
            try:
                with torch.no_grad():
                    self.model(tokens, input_pos=0).float().log_softmax(-1)  # (B, T, V), as scoring a row
            finally:
                self.model.clear_kv_cache()

        size = largest_batch_that_fits(run, largest)
        if self.fabric is not None and self.fabric.world_size > 1:
            from toolkit.training.checkpoint_io import gather_objects

            size = min(gather_objects(self.fabric, size))
        if self.fabric is None or self.fabric.global_rank == 0:
            log.warning("--batch_size auto: %d sequences per batch.", size)
        return size

    # ------------------------------------------------------------------ distribution over processes
    def _run_units(self, units: list, work: Callable[[Any], dict[int, Any]], what: str) -> dict[int, Any]:
        """{request index: result} from `work(unit)` over all units, each unit computed on one process."""
        rank, world = (self.fabric.global_rank, self.fabric.world_size) if self.fabric is not None else (0, 1)
        mine: dict[int, Any] = {}
        # Sharded, every process runs every unit (their forward passes gather the weights together).
        # FSDP2 reshards after backward, which inference never runs: torch.no_grad, and an explicit reshard.
        share = units if self.sharded else units[rank::world]
        with torch.no_grad() if self.sharded else torch.inference_mode():
            for unit in tqdm(share, desc=what, disable=rank != 0 or len(units) < 2):
                mine.update(work(unit))
                if self.sharded:
                    self.model.reshard()
        if world == 1 or self.sharded:
            return mine
        import torch.distributed as dist

        gathered: list = [None] * world
        dist.all_gather_object(gathered, (len(units), mine))
        if len({count for count, _ in gathered}) != 1:
            raise UserError(f"The processes built different request lists ({[c for c, _ in gathered]} units); evaluation needs the same seed and tasks on every process.")
        results: dict[int, Any] = {}
        for _, part in gathered:
            results.update(part)
        return results

    # ------------------------------------------------------------------ log-likelihoods
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p of the continuation tokens, whether greedy decoding would produce them) per request.

        Requests are first reduced to distinct inputs (`_Row`). Rows that share a long prefix run it
        once: the prefix fills a KV cache whose rows are then copied to each of its continuations.
        Other rows run in batches of similar length, right-padded (causal attention never looks at
        the padding).
        """
        L = self.max_length
        rows: dict[tuple, _Row] = {}
        cut = []  # tokens cut from each truncated request
        for index, (_, context, continuation) in enumerate(requests):
            if not continuation:
                raise UserError(f"Request {index} has an empty continuation, which has no log-likelihood: check the task's target text.")
            if len(continuation) > L:
                raise UserError(f"A continuation of {len(continuation)} tokens does not fit in --max_length {L}.")
            if len(context) + len(continuation) > L + 1:
                cut.append(len(context) + len(continuation) - L - 1)
            tokens = (context + continuation)[-(L + 1):]  # the input is tokens[:-1], left-truncated to L
            split = len(tokens) - len(continuation)
            key = (tuple(tokens[:split]), tuple(tokens[split:-1]))
            rows.setdefault(key, _Row(*key)).members.append((index, continuation))

        if cut:
            self._warn_truncation(
                f"Left truncation applied to {len(cut)} of {len(requests)} requests: context and continuation "
                f"exceed the model's maximum length ({L}); at most {max(cut)} tokens were cut from the left. "
                "Some content will be lost."
            )
        by_prefix: dict[tuple, list[_Row]] = defaultdict(list)
        for row in rows.values():
            by_prefix[row.prefix].append(row)
        # Sharing a prefix helps when it is at least as long as the suffixes: it then saves at least
        # half the work (answer choices after a long question; not a lone BOS before a whole window).
        shared = [g for g in by_prefix.values() if len(g) > 1 and len(g[0].prefix) >= max(len(r.suffix) for r in g)]
        in_shared = {id(row) for group in shared for row in group}
        alone = sorted((r for r in rows.values() if id(r) not in in_shared), key=lambda r: (-len(r.prefix) - len(r.suffix), r.prefix + r.suffix))
        units: list = [("batch", alone[i:i + self.batch_size]) for i in range(0, len(alone), self.batch_size)]
        units += self._shared_prefix_units(shared)

        def work(unit) -> dict[int, tuple[float, bool]]:
            kind, content = unit
            return self._score_batch(content) if kind == "batch" else self._score_shared_prefixes(content)

        scores = self._run_units(units, work, "loglikelihood")
        answers = [scores[i] for i in range(len(requests))]
        for (request, _, _), answer in zip(requests, answers):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers

    def _shared_prefix_units(self, groups: list[list[_Row]]) -> list:
        """Units of groups whose prefixes have one length, up to batch_size rows each; a group with more
        rows than that is cut into parts, each of which runs the prefix again."""
        units, current, rows = [], [], 0
        for group in sorted(groups, key=lambda g: (-len(g[0].prefix), g[0].prefix)):
            group = sorted(group, key=lambda r: r.suffix)
            for start in range(0, len(group), self.batch_size):
                part = group[start:start + self.batch_size]
                if current and (len(part[0].prefix) != len(current[0][0].prefix) or rows + len(part) > self.batch_size):
                    units.append(("shared", current))
                    current, rows = [], 0
                current.append(part)
                rows += len(part)
        if current:
            units.append(("shared", current))
        return units

    def _score_batch(self, rows: list[_Row]) -> dict[int, tuple[float, bool]]:
        inputs = [row.prefix + row.suffix for row in rows]
        batch = torch.zeros(len(rows), max(map(len, inputs)), dtype=torch.long)
        for b, ids in enumerate(inputs):
            batch[b, : len(ids)] = torch.tensor(ids)
        logits = self.model(batch.to(self.device))  # (B, T, V)
        scores = {}
        for b, row in enumerate(rows):
            start = len(row.prefix) - 1  # the position that predicts the first continuation token
            scores.update(self._score_row(row, logits[b, start : start + len(row.suffix) + 1]))
        return scores

    def _score_shared_prefixes(self, groups: list[list[_Row]]) -> dict[int, tuple[float, bool]]:
        """G prefixes of one length run once (G, P); their cache rows are copied to the R suffixes (R, S)."""
        model = self.model
        rows = [row for group in groups for row in group]
        owner = torch.tensor([g for g, group in enumerate(groups) for _ in group], device=self.device)  # (R,)
        prefixes = torch.tensor([group[0].prefix for group in groups], device=self.device)  # (G, P)
        P, S = prefixes.shape[1], max(len(row.suffix) for row in rows)
        suffixes = torch.zeros(len(rows), S, dtype=torch.long)
        for r, row in enumerate(rows):
            suffixes[r, : len(row.suffix)] = torch.tensor(row.suffix, dtype=torch.long)
        model.set_kv_cache(batch_size=len(rows), max_seq_length=P + S, device=self.device)
        try:
            first = model(prefixes, input_pos=0, logits_to_keep=1)[:, -1]  # (G, V): predicts each continuation's first token
            model.select_kv_cache_rows(owner)
            rest = model(suffixes.to(self.device), input_pos=P)  # (R, S, V)
        finally:
            model.clear_kv_cache()
        scores = {}
        for r, row in enumerate(rows):
            logits = torch.cat([first[owner[r]][None], rest[r, : len(row.suffix)]])  # (len(suffix) + 1, V)
            scores.update(self._score_row(row, logits))
        return scores

    @staticmethod
    def _score_row(row: _Row, logits: torch.Tensor) -> dict[int, tuple[float, bool]]:
        """Score each member's continuation against the logits (n, V) that predict its n tokens."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        greedy = logits.argmax(dim=-1)
        scores = {}
        for index, continuation in row.members:
            target = torch.tensor(continuation, device=logits.device)
            picked = logprobs.gather(1, target[:, None])[:, 0]
            scores[index] = (float(picked.sum()), bool((greedy == target).all()))
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(document) per request, each token predicted once, in windows of max_length tokens.

        The first window conditions on `prefix_token_id`; each later one holds max_length tokens and
        scores its last `stride` (with the default stride, windows do not overlap).
        """
        context_len = self.max_length - self.stride + 1
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            pairs = get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, context_len)
            for context, continuation in map(make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[index] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The continuation of each context, ended by a stop string, EOS or max_gen_toks (text cut before the stop string).

        Greedy unless the request samples (do_sample / temperature > 0); request i samples with
        seed + i wherever it runs. Requests decode together, batch_size at a time, left-padded
        in one KV cache (see `_generate_batch`); each keeps its own stop strings and length.
        """
        eos_text = None if self.eot_token_id is None else self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        jobs = [self.generation_job(index, *request.args, eos_text) for index, request in enumerate(requests)]
        cut = [job for job in jobs if job.truncated]
        if cut:
            worst = max(cut, key=lambda job: job.truncated)
            self._warn_truncation(
                f"Left truncation applied to {len(cut)} of {len(jobs)} generation contexts: each keeps its last "
                f"max_length - max_gen_toks tokens (max_length {self.max_length}); at most {worst.truncated} tokens "
                "were cut. Some content will be lost."
            )
        # Batches of one max_gen_toks (so that prompt + new tokens fit the context) and similar
        # prompt lengths (little padding), longest first: the slowest batches are shared out first.
        jobs.sort(key=lambda job: (-job.max_new, -len(job.prompt), job.index))
        units, current = [], []
        for job in jobs:
            if current and (len(current) == self.batch_size or job.max_new != current[0].max_new):
                units.append(current)
                current = []
            current.append(job)
        if current:
            units.append(current)
        texts = self._run_units(units, self._generate_batch, "generate_until")
        answers = [texts[i] for i in range(len(requests))]
        for request, answer in zip(requests, answers):
            self.cache_hook.add_partial("generate_until", request.args, answer)
        return answers

    def generation_job(self, index: int, context: str, gen_kwargs: dict, eos_text: Optional[str]) -> "_Job":
        """The request's prompt tokens (left-truncated to leave room for max_gen_toks) and settings.

        Every process builds every job before any work is shared out, so that a bad setting is
        the same error on all of them (one line for the run, see evaluate.py), not a hang.
        """
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_new = int(kwargs.pop("max_gen_toks"))
        if not 0 < max_new < self.max_length:
            raise UserError(
                f"max_gen_toks ({max_new}) must be between 1 and max_length - 1 ({self.max_length - 1}); "
                f"give a smaller one with --gen_kwargs max_gen_toks=N."
            )
        prompt = self.tok_encode(context)
        room = self.max_length - max_new
        truncated = max(len(prompt) - room, 0)
        prompt = prompt[-room:]
        temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
        return _Job(index, prompt or [self.prefix_token_id], max_new, until, temperature, kwargs.get("top_k"), kwargs.get("top_p"), truncated)

    def _generate_batch(self, jobs: list["_Job"]) -> dict[int, str]:
        """{request index: answer text, cut before its first stop string} for a batch of jobs."""
        rows = self.decode_batch(jobs)
        return {job.index: postprocess_generated_text(self.tok_decode(row), job.until, None) for job, row in zip(jobs, rows)}

    def decode_batch(self, jobs: list["_Job"]) -> list[list[int]]:
        """The new tokens of each job. Decode B requests together: left-padded prompts (B, P) fill the KV cache in one pass, then
        one pass per new token (B, 1). A row ends at EOS (or the chat template's end of turn), at one
        of its stop strings, or after its max_gen_toks; the batch ends when all rows have."""
        from toolkit.sampling import sample

        model, B = self.model, len(jobs)
        P = max(len(job.prompt) for job in jobs)
        steps = max(job.max_new for job in jobs)
        padding = torch.tensor([P - len(job.prompt) for job in jobs], device=self.device)  # (B,)
        tokens = torch.zeros(B, P, dtype=torch.long)
        for b, job in enumerate(jobs):
            tokens[b, P - len(job.prompt):] = torch.tensor(job.prompt)
        stop_ids = set(self._chat_stop_ids or {self.eot_token_id}) - {None}
        generators = [torch.Generator(device=self.device).manual_seed(self.seed + job.index) for job in jobs]
        new: list[list[int]] = [[] for _ in jobs]
        done = [False] * B
        model.set_kv_cache(batch_size=B, max_seq_length=P + steps, device=self.device, left_padding=padding)
        try:
            logits = model(tokens.to(self.device), input_pos=0, logits_to_keep=1)[:, -1]  # (B, V)
            for step in range(steps):
                greedy = logits.argmax(dim=-1).tolist()  # (B,)
                for b, job in enumerate(jobs):
                    if done[b]:
                        continue
                    token = greedy[b] if job.temperature <= 0 else int(sample(logits[b], job.temperature, job.top_k, job.top_p, generators[b]))
                    new[b].append(token)
                    done[b] = token in stop_ids or len(new[b]) >= job.max_new or self._reached_stop(new[b], job.stops)
                if all(done):
                    break
                last = torch.tensor([row[-1] for row in new], device=self.device)
                logits = model(last[:, None], input_pos=P + step)[:, -1]
        finally:
            model.clear_kv_cache()
        return new

    def _reached_stop(self, new: list[int], stops: list[str]) -> bool:
        """Whether the text of the new tokens contains a stop string; only the last few tokens are
        decoded (a stop string of n characters spans at most n + 2 of them), which is enough to end
        early: the answer is cut at the first stop string anyway."""
        if not stops:
            return False
        tail = max(map(len, stops)) + 2
        text = self.tok_decode(new[-tail:])
        return any(stop in text for stop in stops)

    def _warn_truncation(self, message: str) -> None:
        """The harness's warning when a context loses tokens on the left, from process 0 only."""
        if self.fabric is None or self.fabric.global_rank == 0:
            log.warning(message)


@dataclass
class _Job:
    """One generate_until request, ready to decode."""

    index: int
    prompt: list[int]
    max_new: int
    until: list[str]  # as the harness cuts the answer (with EOS text)
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    truncated: int  # context tokens cut on the left

    @property
    def stops(self) -> list[str]:
        return [s for s in self.until if s]

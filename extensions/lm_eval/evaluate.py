"""`python -m extensions.lm_eval`: score a toolkit checkpoint on lm-evaluation-harness tasks, in process.

    checks (checkpoint, task names, data files, unsafe code, generation lengths)  ->  Fabric launch
      ->  ToolkitLM on every process  ->  lm_eval.simple_evaluate on every process (each computes
          its share of the requests, see model.py)  ->  process 0 writes results_<date>.json (and
          samples_<task>_<date>.jsonl, as the harness names them) and prints the table

Everything a user can get wrong is checked before any process starts or anything is written; what
can only be found once the requests exist is found by every process alike, and reported once.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Literal, Optional, Union

from toolkit.errors import UserError, did_you_mean

TASKS_DIR = Path(__file__).parent / "tasks"
INSTALL_HINT = "pip install -c constraints.txt -r extensions/lm_eval/requirements.txt"


def local_task_names() -> list[str]:
    """The offline tasks shipped in tasks/ (each YAML file is named after its task)."""
    return sorted(path.stem for path in TASKS_DIR.glob("*.yaml"))


def evaluate(
    checkpoint_dir: Path,
    tasks: Optional[str] = None,
    data_files: Optional[dict[str, Path]] = None,
    include_path: Optional[Path] = None,
    num_fewshot: Optional[int] = None,
    limit: Optional[float] = None,
    batch_size: Union[int, str] = 8,
    max_batch_size: int = 64,
    max_length: Optional[int] = None,
    stride: Optional[int] = None,
    apply_chat_template: bool = False,
    chat_template: Optional[str] = None,
    system_instruction: Optional[str] = None,
    gen_kwargs: Optional[str] = None,
    confirm_run_unsafe_code: bool = False,
    log_samples: bool = False,
    bootstrap_iters: int = 1000,
    out_dir: Optional[Path] = None,
    devices: Union[int, str] = 1,
    num_nodes: int = 1,
    sharded: bool = False,
    precision: Optional[Literal["bf16-true", "32-true", "16-true"]] = None,
    seed: int = 1234,
) -> Optional[dict]:
    """Evaluate a toolkit checkpoint, or a LoRA adapter on its base model, with lm-evaluation-harness.

    Args:
        checkpoint_dir: A toolkit checkpoint folder (pretrained, fine-tuned, merged or converted), or
            a LoRA run's folder: its adapter is applied to the base model it was trained on, unmerged.
        tasks: Comma-separated task names: the offline local_lambada and local_perplexity, any task or
            group of lm-evaluation-harness (hellaswag, mmlu, ...; they download their data), or YAML files.
        data_files: The local file each offline task reads, e.g. '{local_lambada: lambada_test.jsonl}'.
        include_path: A folder of your own task YAML files.
        num_fewshot: Examples in each prompt; default each task's own.
        limit: Evaluate only this many documents per task (a fraction when below 1).
        batch_size: Sequences per forward pass (log-likelihoods) or decoded together (generation);
            "auto": the largest power of two up to max_batch_size whose forward pass over
            max_length tokens fits in memory.
        max_batch_size: The largest batch size "auto" tries.
        max_length: Longest input in tokens; default the model's context.
        stride: Perplexity: new tokens scored per window after the first (default max_length: no overlap).
        apply_chat_template: Give the model its prompts as conversations, laid out by its chat template.
        chat_template: A built-in template (chatml, llama-3, llama-2, gemma, zephyr) or a .jinja file;
            default the checkpoint's own (as `toolkit generate --chat`).
        system_instruction: A system message for every prompt.
        gen_kwargs: Generation settings for every generation task, over the task's own, as the
            harness's --gen_kwargs: 'max_gen_toks=32,temperature=0' (keys: max_gen_toks, until,
            do_sample, temperature, top_k, top_p).
        confirm_run_unsafe_code: Run tasks marked unsafe_code (HumanEval, MBPP, ...): their metric
            executes the code the model wrote, on this machine. Use a sandbox.
        log_samples: Also write every document's requests and responses, one samples_<task>_<date>.jsonl per task.
        bootstrap_iters: Resamples for the standard error of metrics that need them (0: skip).
        out_dir: Where results_<date>.json (and the samples files) go; default `<checkpoint_dir>/eval`.
            Every run writes new files, as the harness does.
        devices: Devices (processes) per node; requests are split across all of them, unless --sharded.
        num_nodes: Number of nodes.
        sharded: Shard the model over all devices with FSDP2, as the trainers do, for a model that does
            not fit on one device: each process holds 1/N of every weight, and all of them run every
            request together (no faster than one device; the same numbers).
        precision: bf16-true, 32-true or 16-true; default bf16 on GPUs that support it, float32 elsewhere.
        seed: Seed for few-shot sampling and sampled generation.
    """
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"lm_eval is not installed; install the extension's requirements: {INSTALL_HINT}") from None
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable, make_table

    from extensions.lm_eval.model import ToolkitLM, check_settings, find_model_dirs
    from toolkit.generate import INFERENCE_DTYPES, inference_dtype
    from toolkit.models.config import Config
    from toolkit.models.gpt import Block
    from toolkit.tokenizer import Tokenizer
    from toolkit.args import DistributedArgs
    from toolkit.parallel.plan import plan_strategy, resolve_accelerator, resolve_devices
    from toolkit.training.fabric import build_fabric

    logging.getLogger("lm_eval.api.task").addFilter(_drop_metadata_hint)
    names = [name.strip() for name in (tasks or "").split(",") if name.strip()]
    if not names:
        raise UserError("--tasks is empty: name at least one task, e.g. --tasks local_lambada.")
    checkpoint, adapter_dir = find_model_dirs(checkpoint_dir)
    settings = check_settings(Config.from_file(checkpoint), Tokenizer(adapter_dir or checkpoint), batch_size, max_length, stride, chat_template)
    if max_batch_size < 1:
        raise UserError(f"--max_batch_size must be at least 1, got {max_batch_size}.")
    if limit is not None and not (0 < limit < 1 or (limit >= 1 and float(limit).is_integer())):
        raise UserError(f"--limit must be a number of documents (1, 2, ...) or a fraction between 0 and 1, got {limit}.")
    if chat_template is not None and not apply_chat_template:
        raise UserError("--chat_template lays out prompts only with --apply_chat_template true; add it, or drop --chat_template.")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num_fewshot must be 0 or more, got {num_fewshot}.")
    generation = parse_gen_kwargs(gen_kwargs)
    files = check_data_files(names, data_files or {})
    task_manager = make_task_manager(names, files, include_path)
    task_dict = check_tasks_load(names, task_manager)
    check_data_files_read(files, task_dict, names)
    check_unsafe_code(task_dict, confirm_run_unsafe_code)
    check_generation_lengths(task_dict, generation, max_length=settings[1])
    out_dir = Path(out_dir) if out_dir is not None else (adapter_dir or checkpoint) / "eval"

    accelerator = resolve_accelerator()
    several = resolve_devices(devices, accelerator) * num_nodes > 1
    if sharded and not several:
        raise UserError("--sharded true needs more than one device (--devices, --num_nodes) to shard the model over.")
    if sharded and adapter_dir is not None:
        raise UserError("A LoRA adapter cannot be evaluated sharded yet: merge it first (`toolkit merge_lora`) and evaluate the merged folder.")
    # Replicated: every process holds the whole model (DDP's layout; nothing is trained, so nothing
    # is synchronised). Sharded: the trainers' FSDP2 engine, in the dtype the model computes in.
    dtype = inference_dtype(precision, accelerator)
    strategy = "fsdp" if sharded else ("ddp" if several else "auto")
    flag = next(name for name, value in INFERENCE_DTYPES.items() if value == dtype)  # e.g. "bf16-true"
    fabric = build_fabric(plan_strategy(devices, num_nodes, flag, DistributedArgs(strategy=strategy)), block_cls=Block)
    fabric.launch()
    logging.getLogger("lm_eval").setLevel(logging.WARNING if fabric.global_rank == 0 else logging.ERROR)
    try:
        lm = ToolkitLM(
            checkpoint_dir, precision=precision, batch_size=batch_size, max_batch_size=max_batch_size,
            max_length=max_length, stride=stride, chat_template=chat_template, seed=seed, fabric=fabric,
        )
        results = simple_evaluate(
            model=lm, tasks=names, task_manager=task_manager, num_fewshot=num_fewshot, limit=limit,
            batch_size=batch_size, gen_kwargs=generation or None, confirm_run_unsafe_code=confirm_run_unsafe_code,
            bootstrap_iters=bootstrap_iters if fabric.global_rank == 0 else 0,  # only process 0 reports
            log_samples=log_samples, apply_chat_template=apply_chat_template,
            system_instruction=system_instruction, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed,
        )
    except UserError:
        # Found alike by every process (see model.py): process 0 tells the user, the others leave quietly.
        if fabric.global_rank != 0:
            raise SystemExit(1) from None
        raise
    if fabric.global_rank != 0:
        return None
    results["config"]["model"] = str(checkpoint_dir)
    results["config"]["devices"] = fabric.world_size
    results["config"]["sharded"] = sharded
    files = write_results(out_dir, results, handle_non_serializable)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    for file in files:
        print(f"{'Samples' if file.name.startswith('samples_') else 'Results'}: {file}")
    return results


def _drop_metadata_hint(record: logging.LogRecord) -> bool:
    """The harness suggests its own `--metadata` option for every task that reads a custom dataset:
    here that is --data_files, which the user has already given."""
    return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


def check_data_files(names: list[str], data_files: dict[str, Path]) -> dict[str, str]:
    """{task: absolute path} for the offline tasks among `names`; each file read once to check it.
    Whether a task that runs reads each file is known once groups and tags are opened
    (`check_data_files_read`)."""
    from extensions.lm_eval.tasks.local_files import read_documents

    local = local_task_names()
    for task in data_files:
        if task not in local:
            raise UserError(f"--data_files names {task!r}, which reads no local file; the offline tasks are {', '.join(local)}.")
    for task in names:
        if task in local and task not in data_files:
            raise UserError(f"Task {task} reads a local file: pass --data_files '{{{task}: FILE}}'.")
    for path in data_files.values():
        read_documents(path)
    return {task: str(Path(path).resolve()) for task, path in data_files.items()}


def check_data_files_read(data_files: dict[str, str], task_dict: dict, names: list[str]) -> None:
    """Every --data_files entry is read by a task that runs: one named in --tasks, or in a group or
    tag it names, or a task of the user's that includes an offline task (which reads that task's file)."""
    read = set()
    for name, task in _tasks_in(task_dict).items():
        read.add(name)
        dataset_kwargs = getattr(getattr(task, "config", None), "dataset_kwargs", None) or {}
        if "task_name" in dataset_kwargs:  # local_files.load_documents reads data_files[task_name]
            read.add(dataset_kwargs["task_name"])
    for task in data_files:
        if task not in read:
            raise UserError(f"--data_files names {task!r}, which no task of --tasks {','.join(names)} reads.")


def make_task_manager(names: list[str], data_files: dict[str, str], include_path: Optional[Path]):
    """The harness's task index with the offline tasks (and `include_path`); unknown names are an error.

    The harness's own 10,000-odd task files are indexed (several seconds, in every process) only when
    a task may need them: a name not found among the offline tasks and `include_path`'s, a task
    given as a file, or a group or tag in `include_path` (which may name the harness's tasks).
    """
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)]
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise UserError(f"--include_path {include_path} is not a folder.")
        paths.append(str(include_path))
    metadata = {"data_files": data_files}
    manager = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)  # a fraction of a second
    if not all(name in manager.all_subtasks for name in names) or manager.all_groups or manager.all_tags:
        manager = TaskManager(include_path=paths, include_defaults=True, metadata=metadata)
    for name in names:
        if name not in manager.all_tasks and not (name.endswith((".yaml", ".yml")) and Path(name).is_file()):
            raise UserError(f"Unknown task {name!r}.{did_you_mean(name, manager.all_tasks)} "
                            "`python -m lm_eval ls tasks` lists the harness's tasks.")
    return manager


def check_tasks_load(names: list[str], manager) -> dict:
    """Build the tasks once, before any process starts: a hub dataset is downloaded (and cached for
    the processes), and one that cannot be reached is a one-line error instead of a traceback."""
    try:
        return manager.load(names)["tasks"]
    except OSError as err:  # ConnectionError, DatasetNotFoundError, a missing or unreadable file
        raise UserError(f"Cannot load the data of --tasks {','.join(names)}: {err}. Without a network, use "
                        "local files (--data_files, --include_path).") from None


def parse_gen_kwargs(text: Optional[str]) -> dict:
    """{key: value} from the harness's form 'max_gen_toks=32,until=["\\n"]'; a one-line error for anything else."""
    from lm_eval.utils import simple_parse_args_string

    if text is None or not str(text).strip():
        return {}
    try:
        parsed = simple_parse_args_string(str(text))
    except (ValueError, SyntaxError) as err:
        raise UserError(f"--gen_kwargs {text!r} is not key=value,key=value ({err}).") from None
    unknown = sorted(set(parsed) - set(GEN_KWARGS))
    if unknown:
        raise UserError(f"--gen_kwargs: unknown setting {unknown[0]!r}; the toolkit model reads {', '.join(GEN_KWARGS)}.{did_you_mean(unknown[0], GEN_KWARGS)}")
    max_gen_toks = parsed.get("max_gen_toks")
    if max_gen_toks is not None and (not isinstance(max_gen_toks, int) or isinstance(max_gen_toks, bool) or max_gen_toks < 1):
        raise UserError(f"--gen_kwargs max_gen_toks must be a whole number of at least 1, got {max_gen_toks!r}.")
    return parsed


# What ToolkitLM.generate_until reads of a request's generation settings.
GEN_KWARGS = ("max_gen_toks", "until", "do_sample", "temperature", "top_k", "top_p")


def _tasks_in(task_dict: dict) -> dict:
    """{task name: Task} of a harness task dict, groups opened."""
    found = {}
    for key, value in task_dict.items():
        if isinstance(value, dict):
            found.update(_tasks_in(value))
        elif value is not None:
            found[getattr(key, "group_name", key) if not isinstance(key, str) else key] = value
    return found


def check_unsafe_code(task_dict: dict, confirmed: bool) -> None:
    """A task marked unsafe_code runs the model's code to score it: only with --confirm_run_unsafe_code."""
    unsafe = [name for name, task in _tasks_in(task_dict).items() if getattr(task, "UNSAFE_CODE", False)]
    if unsafe and not confirmed:
        raise UserError(
            f"Task {', '.join(unsafe)} is marked unsafe_code: scoring it executes the code the model writes, on "
            "this machine. Pass --confirm_run_unsafe_code true to run it (preferably in a sandbox or container)."
        )


def check_generation_lengths(task_dict: dict, gen_kwargs: dict, max_length: int) -> None:
    """Each generation task's max_gen_toks (its own, or --gen_kwargs's) leaves room for a prompt."""
    from extensions.lm_eval.model import DEFAULT_MAX_GEN_TOKS

    for name, task in _tasks_in(task_dict).items():
        if task.OUTPUT_TYPE != "generate_until":
            continue
        settings = {**(task.config.generation_kwargs or {}), **gen_kwargs}
        tokens = settings.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)
        if int(tokens) >= max_length:
            given = "--gen_kwargs" if "max_gen_toks" in gen_kwargs else ("its own" if "max_gen_toks" in settings else "by default")
            raise UserError(
                f"Task {name} generates up to {tokens} tokens (max_gen_toks, {given}), which leaves no room for a prompt "
                f"in max_length {max_length}: pass --gen_kwargs max_gen_toks=N with N below {max_length}."
            )


def write_results(out_dir: Path, results: dict, default) -> list[Path]:
    """results_<date>.json and, with samples, samples_<task>_<date>.jsonl in `out_dir`, named as the
    harness names them (the date to the microsecond, ':' as '-'), so that no run overwrites another."""
    date_id = datetime.now().isoformat().replace(":", "-")
    samples = results.pop("samples", None) or {}
    written = []
    for task, task_samples in samples.items():
        path = out_dir / f"samples_{task}_{date_id}.jsonl"
        write_atomically(path, "".join(json.dumps(sample, default=default, ensure_ascii=False) + "\n" for sample in task_samples))
        written.append(path)
    path = out_dir / f"results_{date_id}.json"
    write_atomically(path, json.dumps(results, indent=2, default=default, ensure_ascii=False) + "\n")
    results["samples"] = samples
    return [path, *written]


def write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file renamed into place, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

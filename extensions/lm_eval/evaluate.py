"""`python -m extensions.lm_eval`: score a toolkit checkpoint on lm-evaluation-harness tasks, in process.

    checks (checkpoint, task names, data files)  ->  Fabric launch (one process per device)
      ->  ToolkitLM on every process  ->  lm_eval.simple_evaluate on every process (each computes
          its share of the requests, see model.py)  ->  process 0 writes the JSON and prints the table

Everything a user can get wrong is checked before any process starts or anything is written.
"""

from __future__ import annotations

import json
import logging
import os
import re
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
    batch_size: int = 8,
    max_length: Optional[int] = None,
    stride: Optional[int] = None,
    apply_chat_template: bool = False,
    chat_template: Optional[str] = None,
    system_instruction: Optional[str] = None,
    log_samples: bool = False,
    bootstrap_iters: int = 1000,
    out_dir: Optional[Path] = None,
    devices: Union[int, str] = 1,
    num_nodes: int = 1,
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
        batch_size: Sequences per forward pass.
        max_length: Longest input in tokens; default the model's context.
        stride: Perplexity: new tokens scored per window after the first (default max_length: no overlap).
        apply_chat_template: Give the model its prompts as conversations, laid out by its chat template.
        chat_template: A built-in template (chatml, llama-3, llama-2, gemma, zephyr) or a .jinja file;
            default the checkpoint's own (as `toolkit generate --chat`).
        system_instruction: A system message for every prompt.
        log_samples: Also store every document's requests and responses in the results file.
        bootstrap_iters: Resamples for the standard error of metrics that need them (0: skip).
        out_dir: Where the results JSON goes; default `<checkpoint_dir>/eval`.
        devices: Devices (processes) per node; requests are split across all of them.
        num_nodes: Number of nodes.
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
    from toolkit.models.config import Config
    from toolkit.models.gpt import Block
    from toolkit.tokenizer import Tokenizer
    from toolkit.training.args import DistributedArgs
    from toolkit.training.strategy import build_fabric, plan_strategy, resolve_accelerator, resolve_devices

    logging.getLogger("lm_eval.api.task").addFilter(_drop_metadata_hint)
    names = [name.strip() for name in (tasks or "").split(",") if name.strip()]
    if not names:
        raise UserError("--tasks is empty: name at least one task, e.g. --tasks local_lambada.")
    checkpoint, adapter_dir = find_model_dirs(checkpoint_dir)
    check_settings(Config.from_file(checkpoint), Tokenizer(adapter_dir or checkpoint), batch_size, max_length, stride, chat_template)
    files = check_data_files(names, data_files or {})
    task_manager = make_task_manager(names, files, include_path)
    check_tasks_load(names, task_manager)
    out_file = results_path(Path(out_dir) if out_dir is not None else (adapter_dir or checkpoint) / "eval", names)

    # Every process holds the whole model (DDP's layout; nothing is trained, so nothing is synchronised).
    several = resolve_devices(devices, resolve_accelerator()) * num_nodes > 1
    strategy = plan_strategy(devices, num_nodes, "32-true", DistributedArgs(strategy="ddp" if several else "auto"))
    fabric = build_fabric(strategy, block_cls=Block)
    fabric.launch()
    logging.getLogger("lm_eval").setLevel(logging.WARNING if fabric.global_rank == 0 else logging.ERROR)
    lm = ToolkitLM(
        checkpoint_dir, precision=precision, batch_size=batch_size, max_length=max_length, stride=stride,
        chat_template=chat_template, seed=seed, fabric=fabric,
    )
    results = simple_evaluate(
        model=lm, tasks=names, task_manager=task_manager, num_fewshot=num_fewshot, limit=limit,
        bootstrap_iters=bootstrap_iters if fabric.global_rank == 0 else 0,  # only process 0 reports
        log_samples=log_samples, apply_chat_template=apply_chat_template,
        system_instruction=system_instruction, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed,
    )
    if fabric.global_rank != 0:
        return None
    results["config"]["model"] = str(checkpoint_dir)
    results["config"]["devices"] = fabric.world_size
    write_atomically(out_file, json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    print(f"Results: {out_file}")
    return results


def _drop_metadata_hint(record: logging.LogRecord) -> bool:
    """The harness suggests its own `--metadata` option for every task that reads a custom dataset:
    here that is --data_files, which the user has already given."""
    return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


def check_data_files(names: list[str], data_files: dict[str, Path]) -> dict[str, str]:
    """{task: absolute path} for the offline tasks among `names`; each file read once to check it."""
    from extensions.lm_eval.tasks.local_files import read_documents

    local = local_task_names()
    for task in data_files:
        if task not in local:
            raise UserError(f"--data_files names {task!r}, which reads no local file; the offline tasks are {', '.join(local)}.")
        if task not in names:
            raise UserError(f"--data_files names {task!r}, which is not among --tasks {','.join(names)}.")
    for task in names:
        if task in local and task not in data_files:
            raise UserError(f"Task {task} reads a local file: pass --data_files '{{{task}: FILE}}'.")
    for path in data_files.values():
        read_documents(path)
    return {task: str(Path(path).resolve()) for task, path in data_files.items()}


def make_task_manager(names: list[str], data_files: dict[str, str], include_path: Optional[Path]):
    """The harness's task index with the offline tasks (and `include_path`); unknown names are an error.

    The harness's own 10,000-odd task files are indexed (several seconds) only when a task needs them.
    """
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)]
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise UserError(f"--include_path {include_path} is not a folder.")
        paths.append(str(include_path))
    local = set(local_task_names())
    only_local = include_path is None and all(name in local for name in names)
    manager = TaskManager(include_path=paths, include_defaults=not only_local, metadata={"data_files": data_files})
    for name in names:
        if name not in manager.all_tasks and not (name.endswith((".yaml", ".yml")) and Path(name).is_file()):
            raise UserError(f"Unknown task {name!r}.{did_you_mean(name, manager.all_tasks)} "
                            "`python -m lm_eval ls tasks` lists the harness's tasks.")
    return manager


def check_tasks_load(names: list[str], manager) -> None:
    """Build the tasks once, before any process starts: a hub dataset is downloaded (and cached for
    the processes), and one that cannot be reached is a one-line error instead of a traceback."""
    from lm_eval.tasks import get_task_dict

    try:
        get_task_dict(names, manager)
    except OSError as err:  # ConnectionError, DatasetNotFoundError, a missing or unreadable file
        raise UserError(f"Cannot load the data of --tasks {','.join(names)}: {err}. Without a network, use "
                        "local files (--data_files, --include_path).") from None


def results_path(out_dir: Path, names: list[str]) -> Path:
    """`<out_dir>/<task>+<task>.json`: one file per set of tasks, so other evaluations stay."""
    stem = re.sub(r"[^A-Za-z0-9_.+-]", "_", "+".join(Path(name).stem if name.endswith((".yaml", ".yml")) else name for name in names))
    return out_dir / f"{stem[:150]}.json"


def write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file renamed into place, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

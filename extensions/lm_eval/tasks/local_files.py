"""Documents for the offline tasks in this folder, read from the local files the user names.

`python -m extensions.lm_eval` passes `--data_files` (task name -> file) to the harness as task
metadata; the harness calls `load_documents` (each task's `custom_dataset`) with that metadata and
the task's own `dataset_kwargs` (its name).
"""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.errors import UserError


def read_documents(path: Path | str) -> list[dict]:
    """[{"text": ...}, ...]: one per line of a .jsonl file (each line an object with a "text" string),
    or the whole of any other file as one document."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"Data file {path} does not exist.")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}).") from None
    if path.suffix != ".jsonl":
        if not content.strip():
            raise UserError(f"{path} holds no text.")  # (perplexity per word of nothing: a division by zero)
        return [{"text": content}]
    documents = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}, line {number}: not JSON ({err.msg}: column {err.colno}).") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UserError(f'{path}, line {number}: expected an object with a "text" string.')
        if not record["text"].strip():
            raise UserError(f'{path}, line {number}: the "text" is empty.')
        documents.append({"text": record["text"]})
    if not documents:
        raise UserError(f"{path} holds no documents.")
    return documents


def load_documents(task_name: str, data_files: dict | None = None, **metadata) -> dict:
    """The task's test split, {"test": datasets.Dataset}, from the file `data_files[task_name]`."""
    import datasets

    path = (data_files or {}).get(task_name)
    if path is None:
        raise UserError(f"Task {task_name} reads a local file: pass --data_files '{{{task_name}: FILE}}'.")
    return {"test": datasets.Dataset.from_list(read_documents(path))}

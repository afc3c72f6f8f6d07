"""Download a model from the Hugging Face Hub and convert it into a toolkit checkpoint.

    toolkit download meta-llama/Llama-3.2-1B                 -> checkpoints/meta-llama/Llama-3.2-1B
    HF_HUB_OFFLINE=1 toolkit download EleutherAI/pythia-14m  (from the local Hugging Face cache only)

Only the files that conversion needs are fetched: the safetensors weights (the .bin weights only
when the repository has no safetensors), config.json, generation_config.json and the tokenizer
files. Files go to the Hugging Face cache (shared with transformers) unless `hf_dir` is given.
The access token comes from `access_token` or the HF_TOKEN environment variable and is never
printed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal, Optional

from toolkit.errors import UserError
from toolkit.tokenizer import TOKENIZER_FILES

# transformers' weight files: single or sharded; variants (model.fp16.safetensors...) are not fetched
_SAFETENSORS = re.compile(r"model(-\d+-of-\d+)?\.safetensors")
_BIN = re.compile(r"pytorch_model(-\d+-of-\d+)?\.bin")


def select_files(filenames: list[str]) -> list[str]:
    """The files of a repository listing that conversion needs (top-level only).

    Safetensors weights are preferred; `pytorch_model*.bin` files are chosen only when the
    repository has no `model*.safetensors`. A listing with no weights or no config.json is a
    UserError.
    """
    top = [name for name in filenames if "/" not in name]
    safetensors = [n for n in top if _SAFETENSORS.fullmatch(n) or n == "model.safetensors.index.json"]
    bins = [n for n in top if _BIN.fullmatch(n) or n == "pytorch_model.bin.index.json"]
    weights = safetensors if any(n.endswith(".safetensors") for n in safetensors) else bins
    if not any(n.endswith((".safetensors", ".bin")) for n in weights):
        raise UserError(
            "The repository has no Hugging Face weights (model*.safetensors or pytorch_model*.bin); "
            "the toolkit converts transformers-format repositories only"
        )
    if "config.json" not in top:
        raise UserError("The repository has no config.json; the toolkit converts transformers-format repositories only")
    extras = [n for n in ("config.json", *TOKENIZER_FILES) if n in top]
    return sorted(weights) + extras


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return bool(constants.HF_HUB_OFFLINE) or env in ("1", "ON", "YES", "TRUE")


def _local_snapshot(repo_id: str, cache_dir: Optional[Path], hf_dir: Optional[Path], token, why: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(repo_id, cache_dir=cache_dir, local_dir=hf_dir, token=token, local_files_only=True)
        return Path(path)
    except Exception:  # LocalEntryNotFoundError, IncompleteSnapshotError, HFValidationError...
        where = hf_dir if hf_dir is not None else (cache_dir or "the Hugging Face cache")
        raise UserError(f"{repo_id} is not in {where}, and {why}") from None


def fetch(
    repo_id: str, hf_dir: Optional[Path] = None, access_token: Optional[str] = None, cache_dir: Optional[Path] = None
) -> Path:
    """The local directory holding the repository files that conversion needs (downloading them if needed)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    token = access_token or os.environ.get("HF_TOKEN") or None
    if _offline():
        path = _local_snapshot(
            repo_id, cache_dir, hf_dir, token, "downloads are disabled (HF_HUB_OFFLINE=1): unset it to download"
        )
    else:
        try:
            files = HfApi().list_repo_files(repo_id, token=token)
        except GatedRepoError:
            raise UserError(
                f"{repo_id} is gated: accept its license on https://huggingface.co/{repo_id} and set HF_TOKEN "
                "to an access token of that account"
            ) from None
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise UserError(
                f"No repository {repo_id!r} on the Hugging Face Hub (or it is private: set HF_TOKEN). "
                "Run `toolkit list` for the supported models."
            ) from None
        except HFValidationError:
            raise UserError(f"{repo_id!r} is not a Hugging Face repository id (expected owner/name)") from None
        except Exception as err:  # no connection: use what the cache holds
            why = f"the Hub cannot be reached ({type(err).__name__}); check the connection"
            path = _local_snapshot(repo_id, cache_dir, hf_dir, token, why)
        else:
            patterns = select_files(files)
            path = Path(
                snapshot_download(repo_id, allow_patterns=patterns, cache_dir=cache_dir, local_dir=hf_dir, token=token)
            )
    try:
        select_files([p.name for p in path.iterdir()])  # what is there must be convertible
    except UserError as err:
        raise UserError(f"The local copy of {repo_id} in {path} is incomplete: {err}") from None
    return path


def download(
    repo_id: str,
    out_dir: Optional[Path] = None,
    hf_dir: Optional[Path] = None,
    access_token: Optional[str] = None,
    convert: bool = True,
    dtype: Optional[Literal["float32", "float16", "bfloat16"]] = None,
    overwrite: bool = False,
    cache_dir: Optional[Path] = None,
) -> Path:
    """Download a Hugging Face model and convert it into a toolkit checkpoint.

    Args:
        repo_id: Hugging Face repository, e.g. EleutherAI/pythia-160m.
        out_dir: Toolkit checkpoint directory to create. Default: checkpoints/<repo_id>.
        hf_dir: Put the downloaded Hugging Face files here instead of the Hugging Face cache.
        access_token: Hugging Face token for gated or private models. Default: $HF_TOKEN.
        convert: Convert after downloading; false only downloads.
        dtype: Store weights as float32, float16 or bfloat16. Default: as published.
        overwrite: Replace `out_dir` if it already holds files.
        cache_dir: Hugging Face cache directory. Default: $HF_HUB_CACHE (~/.cache/huggingface/hub).

    Returns:
        The toolkit checkpoint directory, or with convert=false the Hugging Face files' directory.
        With HF_HUB_OFFLINE=1 nothing is downloaded: the files must already be cached.
    """
    if out_dir is None:
        out_dir = Path("checkpoints") / repo_id
    out_dir = Path(out_dir)
    if convert:
        from toolkit.convert.hf_to_toolkit import refuse_existing

        refuse_existing(out_dir, overwrite)
    path = fetch(repo_id, hf_dir=hf_dir, access_token=access_token, cache_dir=cache_dir)
    if not convert:
        return path
    from toolkit.convert.hf_to_toolkit import convert_hf_dir

    return convert_hf_dir(path, out_dir, model_name=None, dtype=dtype, overwrite=overwrite, default_name=repo_id)

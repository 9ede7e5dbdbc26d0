"""Models named by a Hugging Face Hub id (``org/name``): the local Hub cache, else a download.

The cache is huggingface_hub's own (``HF_HUB_CACHE`` / ``HF_HOME``), so a model downloaded
by any Hugging Face tool is found, and one downloaded here serves them too. A download
fetches the configs, the tokenizer files and the safetensors weights (the PyTorch ``.bin``
weights only when a repository has no safetensors), with huggingface_hub's progress bars.
``HF_HUB_OFFLINE=1`` (or ``model.download = false``) forbids downloading: a model missing from
the cache is then an error saying how to get it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from baton.errors import ModelLoadError

log = logging.getLogger(__name__)

#: What a model needs besides its weights: configs, tokenizer files, chat templates.
SUPPORT_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py")
SAFETENSORS = ("*.safetensors",)
PYTORCH_BINS = ("*.bin",)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids the network: set now, or when huggingface_hub was
    imported (it reads the variable once, then refuses downloads whatever it says later)."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return now or bool(constants.HF_HUB_OFFLINE)


def hub_cache() -> str:
    """The Hub cache folder, from the environment as it is now (huggingface_hub's constant is
    read once, at its import)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return str(constants.HF_HUB_CACHE)


def is_repo_id(name: str) -> bool:
    """``org/name`` as the Hub spells repository ids."""
    return bool(_REPO_ID.match(name)) and ".." not in name


def from_hub(
    name: str,
    *,
    revision: str | None = None,
    download: bool = True,
    hint: str = "",
) -> Path:
    """The snapshot folder of Hub model ``name`` at ``revision`` (default: main), downloaded
    when it is not cached and downloading is allowed; ModelLoadError saying what to do else."""
    from huggingface_hub import snapshot_download

    at = f" at revision {revision!r}" if revision else ""
    cache = hub_cache()
    where = {"cache_dir": cache, "endpoint": os.environ.get("HF_ENDPOINT") or None}
    try:
        return Path(snapshot_download(name, revision=revision, local_files_only=True, **where))
    except Exception as e:  # huggingface_hub raises several unrelated types for "not cached"
        cached_error = e
    get_it = f"download it first (`hf download {name}`){', or ' + hint if hint else ''}"
    if hub_offline():
        raise ModelLoadError(
            f"model {name!r}{at} is not in the local Hugging Face cache ({cache}) and "
            f"HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '1 (at import)')} forbids downloading "
            f"it: unset HF_HUB_OFFLINE before starting to let baton download it, or {get_it}"
        ) from cached_error
    if not download:
        raise ModelLoadError(
            f"model {name!r}{at} is not in the local Hugging Face cache ({cache}) and "
            f"model.download = false: set it to true to let baton download it, or {get_it}"
        ) from cached_error
    log.warning("downloading model %r%s from the Hugging Face Hub into %s", name, at, cache)
    try:
        folder = Path(
            snapshot_download(
                name, revision=revision, allow_patterns=[*SUPPORT_FILES, *SAFETENSORS], **where
            )
        )
        if not any(folder.glob("*.safetensors")):
            folder = Path(
                snapshot_download(
                    name, revision=revision, allow_patterns=[*SUPPORT_FILES, *PYTORCH_BINS], **where
                )
            )
    except Exception as e:  # network, authentication, a missing repository or revision
        raise ModelLoadError(
            f"downloading model {name!r}{at} from the Hugging Face Hub failed: "
            f"{type(e).__name__}: {_first_line(e)}; check the id and the revision, the network "
            f"(HF_ENDPOINT), and HF_TOKEN for a gated or private model, or {get_it}"
        ) from e
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"model {name!r}{at} from the Hugging Face Hub has no config.json: not a transformers "
            "model repository (a GGUF-only repository: download its .gguf file and give its path)"
        )
    return folder


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"

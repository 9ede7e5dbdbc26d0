"""What the frontend and the engine both need to know about a model, read from its folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from baton.config import ModelSection
from baton.errors import ConfigError, ModelLoadError
from baton.model.loader import check_causal_architectures, model_folder
from baton.protocol import ModelInfo

__all__ = ["ModelInfo", "model_info", "read_model_info"]


def model_info(model: ModelSection) -> ModelInfo:
    """Resolve the configured model (converting a GGUF once) and read its limits."""
    return read_model_info(model_folder(model), model.max_model_len)


def read_model_info(folder: str | Path, max_model_len: int | None) -> ModelInfo:
    """The model's limits from ``folder/config.json``; ModelLoadError naming the file when it cannot."""
    folder = Path(folder)
    path = folder / "config.json"
    cfg = _read_json(path, required=True)
    text_cfg = cfg.get("text_config", cfg)
    if not isinstance(text_cfg, dict):
        raise ModelLoadError(
            f"{path}: text_config must be an object, got {type(text_cfg).__name__}"
        )
    runner_type = "generate"
    if not cfg.get("auto_map"):  # remote-code models are refused when loaded, with their reason
        runner_type = check_causal_architectures(cfg.get("architectures"), str(path))
    vocab_size = _positive_int(text_cfg, "vocab_size", path)
    if vocab_size is None:
        raise ModelLoadError(
            f"{path} has no vocab_size (the number of token ids the model predicts), so baton "
            "cannot check token ids or size the sampler: add it, or re-download the model"
        )
    model_max = next(
        (
            v
            for k in ("max_position_embeddings", "n_positions", "max_seq_len")
            if (v := _positive_int(text_cfg, k, path)) is not None
        ),
        None,
    )
    if max_model_len is None:
        if model_max is None:
            raise ConfigError(
                f"model.max_model_len: the model in {folder} states no limit; set one"
            )
        max_model_len = model_max
    elif model_max is not None and max_model_len > model_max:
        raise ConfigError(
            f"model.max_model_len = {max_model_len} exceeds the model's limit of {model_max} "
            f"(max_position_embeddings in {path}); lower it or leave it unset"
        )
    archs = cfg.get("architectures")
    return ModelInfo(
        path=str(folder),
        architecture=str(archs[0]) if isinstance(archs, list) and archs else "unknown",
        vocab_size=vocab_size,
        max_model_len=int(max_model_len),
        eos_token_ids=_eos_ids(folder, text_cfg),
        hidden_size=_positive_int(text_cfg, "hidden_size", path) or 0,
        matryoshka_dimensions=_matryoshka(cfg),
        runner_type=runner_type,
        pooling_type=_pooling_type(folder, cfg, runner_type),
    )


#: sentence-transformers' pooling modes -> baton's pooling types
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


def _pooling_type(folder: Path, cfg: dict[str, Any], runner_type: str) -> str:
    """The model's own pooling: its sentence-transformers Pooling module's mode if it has one;
    else the first token's for an encoder (config.json says ``is_decoder: false``, BERT-style)
    and the last token's for the rest."""
    try:  # a list, not an object: read here (a sentence-transformers file, optional)
        modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        modules = None
    for module in modules if isinstance(modules, list) else ():
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
            st = _read_json(folder / str(module.get("path", "")) / "config.json", required=False)
            mode = next((t for k, t in _ST_MODES.items() if st.get(k) is True), None)
            if mode is not None:
                return mode
    if runner_type == "pooling" and cfg.get("is_decoder") is False:
        return "cls"
    return "last"


def _matryoshka(cfg: dict[str, Any]) -> list[int] | None:
    """The embedding sizes a Matryoshka model lists ([]: any), None for other models."""
    dims = cfg.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(type(d) is int and d > 0 for d in dims):
        return sorted(dims)
    return [] if cfg.get("is_matryoshka") is True else None


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    """A JSON object file; ModelLoadError naming the file when missing (if required) or not JSON."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if not required:
            return {}
        raise ModelLoadError(
            f"{path} is missing: a model folder needs the model's config.json"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ModelLoadError(
            f"{path} is not valid JSON ({e}): re-download the model or fix the file"
        ) from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _positive_int(cfg: dict[str, Any], key: str, path: Path) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def _eos_ids(folder: Path, cfg: dict[str, Any]) -> list[int]:
    gen = folder / "generation_config.json"
    value = _read_json(gen, required=False).get("eos_token_id")
    if value is None:
        value = cfg.get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(
            f"eos_token_id in {folder} must be a token id or a list of them, got {value!r}"
        )
    return list(values)

"""What the frontend and the engine both need to know about a model, read from its folder."""

from __future__ import annotations

import json
from pathlib import Path

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.protocol import ModelInfo

__all__ = ["ModelInfo", "model_info", "read_model_info"]


def model_info(config: BatonConfig) -> ModelInfo:
    """Resolve the configured model (converting a GGUF once) and read its limits."""
    from baton.worker.model_loader import resolve_model  # heavy imports stay off the CLI's start-up

    folder = resolve_model(config.model.name, config.model.cache_dir)
    return read_model_info(folder, config.model.max_model_len)


def read_model_info(folder: str | Path, max_model_len: int | None) -> ModelInfo:
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    model_max = next(
        (
            text_cfg[k]
            for k in ("max_position_embeddings", "n_positions", "max_seq_len")
            if text_cfg.get(k)
        ),
        None,
    )
    if max_model_len is None:
        if model_max is None:
            raise ConfigError(
                f"model.max_model_len: the model in {folder} states no limit; set one"
            )
        max_model_len = int(model_max)
    elif model_max is not None and max_model_len > model_max:
        raise ConfigError(
            f"model.max_model_len = {max_model_len} exceeds the model's limit of {model_max} "
            f"(max_position_embeddings in {folder / 'config.json'}); lower it or leave it unset"
        )
    eos = _eos_ids(folder, text_cfg)
    return ModelInfo(
        path=str(folder),
        architecture=(cfg.get("architectures") or ["unknown"])[0],
        vocab_size=int(text_cfg["vocab_size"]),
        max_model_len=int(max_model_len),
        eos_token_ids=eos,
    )


def _eos_ids(folder: Path, cfg: dict) -> list[int]:
    gen = folder / "generation_config.json"
    value = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
    if value is None:
        value = cfg.get("eos_token_id")
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]

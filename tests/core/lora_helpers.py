"""Tiny random PEFT LoRA adapters for the tests (made with peft, a test requirement only)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_cache: dict[str, Path] = {}
_lock = threading.Lock()
_root: Path | None = None


def make_adapter(
    model_dir: str | Path,
    dest: str | Path,
    *,
    seed: int = 0,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    **lora_config: Any,
) -> Path:
    """A random LoRA adapter for the model in ``model_dir``, saved by peft into ``dest``.

    ``init_lora_weights=False``: B is random too (peft's default makes it zero, a no-op)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cfg = LoraConfig(
            r=r,
            lora_alpha=alpha,
            target_modules=list(targets),
            init_lora_weights=False,
            lora_dropout=0.0,
            **lora_config,
        )
        peft_model = get_peft_model(model, cfg)
    dest = Path(dest)
    peft_model.save_pretrained(dest)
    return dest


def adapter(model_dir: str | Path, **kwargs: Any) -> str:
    """``make_adapter`` once per process per (model, arguments), in a folder removed at exit."""
    global _root
    key = json.dumps([str(model_dir), kwargs], sort_keys=True, default=str)
    with _lock:
        if key not in _cache:
            if _root is None:
                import atexit

                _root = Path(tempfile.mkdtemp(prefix="baton-lora-"))
                atexit.register(shutil.rmtree, _root, ignore_errors=True)
            _cache[key] = make_adapter(model_dir, _root / f"a{len(_cache)}", **kwargs)
        return str(_cache[key])


def merged_model(model_dir: str | Path, adapter_dir: str | Path) -> torch.nn.Module:
    """transformers + peft: the base model with the adapter merged into its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()

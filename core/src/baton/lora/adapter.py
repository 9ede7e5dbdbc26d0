"""PEFT-format LoRA adapters, read without peft: ``adapter_config.json`` and
``adapter_model.safetensors`` in one folder.

A PEFT LoRA adds ``scaling * B @ A`` to a linear layer's weight, with ``A`` [r, in] and ``B``
[out, r] stored as ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` and
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern``
and ``alpha_pattern`` change ``r`` and ``lora_alpha`` per module). What baton does not run is
refused by name: DoRA, LoRA biases, ``modules_to_save``, embedding or LM-head adapters, a
``fan_in_fan_out`` layout, other PEFT types, a rank above ``lora.max_lora_rank``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baton.errors import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: The linear layers of a decoder block an adapter may target (by their leaf name).
TARGET_MODULES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "qkv_proj",  # fused (Phi-3)
        "gate_up_proj",
    }
)
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    """What baton reads of ``adapter_config.json``."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])

    def scaling(self, module: str, rank: int) -> float:
        """``lora_alpha / r`` of one module (its pattern's alpha if any; ``rank`` its A's rows)."""
        alpha = _pattern(self.alpha_pattern, module, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: a key matches a module name that ends with it (a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _fail(path: Path | str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter at {str(path)!r}: {message}", param="lora_path")


def read_adapter_config(path: str | Path, max_lora_rank: int | None = None) -> AdapterConfig:
    """The adapter folder's config, checked (InvalidRequestError naming the folder and the key)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise _fail(path, "no such folder (it must hold adapter_config.json and its weights)")
    cfg_file = folder / CONFIG_FILE
    if not cfg_file.is_file():
        raise _fail(path, f"no {CONFIG_FILE}: is it a PEFT adapter folder?")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise _fail(path, f"{CONFIG_FILE} could not be read: {e}") from None
    if not isinstance(raw, dict):
        raise _fail(path, f"{CONFIG_FILE} is not a JSON object")
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _fail(path, f"peft_type {peft_type!r}: only LORA adapters are supported")
    for key, ok, why in (
        ("use_dora", lambda v: not v, "DoRA adapters are not supported"),
        ("bias", lambda v: v in (None, "none"), "adapters with biases are not supported"),
        ("lora_bias", lambda v: not v, "adapters with biases are not supported"),
        (
            "fan_in_fan_out",
            lambda v: not v,
            "the fan_in_fan_out layout (GPT-2's Conv1D) is not supported",
        ),
        (
            "modules_to_save",
            lambda v: not v,
            "fully trained modules (modules_to_save) are not supported",
        ),
    ):
        if key in raw and not ok(raw[key]):
            raise _fail(path, f"{key}={raw[key]!r}: {why}")
    try:
        cfg = AdapterConfig(
            r=int(raw["r"]),
            lora_alpha=float(raw.get("lora_alpha", raw["r"])),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
            alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
        )
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(
            path, f"{CONFIG_FILE} needs an integer r and a number lora_alpha ({e})"
        ) from None
    if cfg.r <= 0 or any(v <= 0 for v in cfg.rank_pattern.values()):
        raise _fail(path, f"rank r={cfg.r} must be > 0")
    if max_lora_rank is not None and cfg.max_rank > max_lora_rank:
        raise _fail(
            path,
            f"rank {cfg.max_rank} > lora.max_lora_rank={max_lora_rank}: raise max_lora_rank "
            "(--max-lora-rank) to at least the adapter's rank",
        )
    if not (folder / WEIGHTS_FILE).is_file():
        other = [n for n in ("adapter_model.bin", "adapter_model.pt") if (folder / n).is_file()]
        hint = f" (found {other[0]}: save it with safe_serialization=True)" if other else ""
        raise _fail(path, f"no {WEIGHTS_FILE}{hint}")
    return cfg


@dataclass
class AdapterWeights:
    """One adapter's low-rank factors per module, on the host: ``A`` [r, in] and ``B`` [out, r]
    with the module's scaling already multiplied in (float32)."""

    config: AdapterConfig
    modules: dict[str, tuple[Any, Any]]

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a, _ in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def load_adapter(path: str | Path, max_lora_rank: int | None = None) -> AdapterWeights:
    """Read an adapter folder: its config and its factors by module name (the name of the module
    in the transformers model, e.g. ``model.layers.0.self_attn.q_proj``)."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = read_adapter_config(path, max_lora_rank)
    file = Path(path).expanduser() / WEIGHTS_FILE
    try:
        tensors = load_file(str(file))
    except (OSError, SafetensorError) as e:
        raise _fail(path, f"{WEIGHTS_FILE} could not be read: {e}") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name = key.removeprefix(_PREFIX)
        m = _KEY.match(name)
        if m is None:
            raise _fail(
                path,
                f"tensor {key!r} is not a LoRA factor (lora_A / lora_B weight): embedding and "
                "LM-head adapters, DoRA magnitudes and saved modules are not supported",
            )
        module = m["module"]
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in TARGET_MODULES:
            raise _fail(
                path,
                f"it adapts {module!r}; baton adapts the linear layers "
                f"{', '.join(sorted(TARGET_MODULES))} only",
            )
        if t.dim() != 2:
            raise _fail(path, f"tensor {key!r} has shape {tuple(t.shape)}, not a matrix")
        halves.setdefault(module, {})[m["which"]] = t.to(torch.float32)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise _fail(path, f"module {module!r} has lora_{''.join(pair)} but not both A and B")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise _fail(
                path, f"module {module!r}: lora_A is {tuple(a.shape)}, lora_B {tuple(b.shape)}"
            )
        if max_lora_rank is not None and rank > max_lora_rank:
            raise _fail(
                path, f"module {module!r} has rank {rank} > lora.max_lora_rank={max_lora_rank}"
            )
        modules[module] = (a.contiguous(), (b * cfg.scaling(module, rank)).contiguous())
    if not modules:
        raise _fail(path, f"{WEIGHTS_FILE} holds no LoRA factors")
    return AdapterWeights(cfg, modules)

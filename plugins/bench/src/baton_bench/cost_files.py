"""A cost model (``baton.sched.cost_model``) from the command line or a JSON file, and back.

``--cost-model FILE`` reads what ``--calibrate --cost-model-out FILE`` wrote;
``--cost-model overhead=0.08,prefill=0.003,decode=0.004`` gives the figures inline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from baton.errors import ConfigError
from baton.sched.cost_model import DEFAULT, CostModel

_SHORT = {
    "overhead": "step_overhead_s",
    "prefill": "prefill_s_per_token",
    "decode": "decode_s_per_token",
    "attention": "attention_s_per_token_pair",
    "num_blocks": "num_blocks",
}


def load_cost_model(spec: str | None) -> CostModel:
    """``spec``: a JSON file, or ``overhead=0.08,prefill=0.003,decode=0.004[,attention=..]``; None: DEFAULT."""
    if spec is None:
        return DEFAULT
    if "=" in spec and not Path(spec).exists():
        values: dict[str, Any] = {}
        for item in spec.split(","):
            key, _, value = item.partition("=")
            field = _SHORT.get(key.strip(), key.strip())
            if field not in CostModel.__struct_fields__:
                raise ConfigError(f"--cost-model: unknown field {key!r} (use {', '.join(_SHORT)})")
            values[field] = int(value) if field == "num_blocks" else float(value)
        values.setdefault("source", "command line")
        try:
            return msgspec.convert(values, CostModel)
        except msgspec.ValidationError as e:
            raise ConfigError(f"--cost-model {spec!r}: {e}") from None
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"--cost-model {spec!r}: no such file (or give overhead=..,prefill=..,decode=..)"
        )
    try:
        return msgspec.json.decode(path.read_bytes(), type=CostModel)
    except msgspec.DecodeError as e:
        raise ConfigError(f"--cost-model {spec!r}: not a cost model JSON: {e}") from None


def save_cost_model(model: CostModel, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(model), indent=2) + b"\n")

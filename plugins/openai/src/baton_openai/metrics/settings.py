"""The ``prometheus`` stat logger's ``[observability.prometheus]`` settings (light: the plugin
module imports it in every process)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class PrometheusSettings(BaseModel):
    """``[observability.prometheus]`` settings."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    metric_names: Literal["baton", "vllm", "both"] = "baton"
    """baton: baton_* names; vllm: vLLM's vllm:* names (same histograms, model_name label);
    both: each figure under both names."""

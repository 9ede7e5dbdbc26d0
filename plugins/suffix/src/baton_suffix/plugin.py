"""Plugin module of baton-plugin-suffix: registers speculator ``suffix``.

Settings come from the ``[speculative.suffix]`` sub-table (or
``BATON_SPECULATIVE__SUFFIX__<FIELD>``), validated by ``SuffixSettings``.
"""

from __future__ import annotations

from typing import Any

from baton import hookimpl
from baton_suffix.settings import SuffixSettings
from baton_suffix.speculator import SuffixSpeculator

BATON_PLUGIN_API = 1


def create_speculator(
    config: Any = None, settings: SuffixSettings | None = None
) -> SuffixSpeculator:
    """The registered factory: ``factory(config, settings)``."""
    s = settings or SuffixSettings()
    return SuffixSpeculator(
        max_depth=s.max_depth,
        max_cached_requests=s.max_cached_requests,
        max_spec_factor=s.max_spec_factor,
        min_token_prob=s.min_token_prob,
    )


@hookimpl
def register_speculators(register: Any) -> None:
    register("suffix", create_speculator, settings_model=SuffixSettings)

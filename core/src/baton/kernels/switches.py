"""Environment switches that force a kernel choice (``BATON_PACKED_EXACT``, ``BATON_PACKED_STREAM``)."""

from __future__ import annotations

import os

from baton.errors import ConfigError


def env_switch(name: str, meanings: dict[str, str]) -> str:
    """The value of variable ``name`` ("" where unset); ConfigError naming the values ``meanings``
    allows (value -> what it does) for any other."""
    value = os.environ.get(name, "")
    if value and value not in meanings:
        allowed = ", ".join(f"{v} ({what})" for v, what in meanings.items())
        raise ConfigError(f"{name}={value!r}: set it to {allowed} or leave it unset (by CPU)")
    return value

"""How a refused configuration is worded: every bad value with its dotted path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic


def describe_error(err: Any, prefix: str = "") -> str:
    """One refused value of a ``ValidationError``: ``section.field: message (got value)``."""
    path = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    return f"{path}: {err['msg']}{shown}" if path else f"{err['msg']}{shown}"


def format_validation_error(
    e: pydantic.ValidationError, source: Path | None = None, prefix: str = ""
) -> str:
    """Every refused value, one a line, under a header naming ``source``."""
    lines = [describe_error(err, prefix) for err in e.errors()]
    where = f" in {source}" if source else ""
    return f"invalid configuration{where}:\n  " + "\n  ".join(lines)

"""``server.chat_template``: the server's chat template, from a file or given inline."""

from __future__ import annotations

from pathlib import Path

from baton.errors import ConfigError

#: A template has at least one of these; a value with none is taken for a file's path.
_TEMPLATE_CHARS = ("{", "}", "\n")


def load_chat_template(value: str | None) -> str | None:
    """The template ``value`` names: a file's text when it is a path to one, else ``value``
    itself when it reads as a template (vLLM's rule); ConfigError for a path with no file."""
    if value is None:
        return None
    path = Path(value).expanduser()
    looks_inline = any(c in value for c in _TEMPLATE_CHARS)
    if not looks_inline:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"server.chat_template = {value!r} reads as a file path, but the file cannot be "
                f"read ({type(e).__name__}: {e}): give the path of a Jinja template file, or "
                "the template itself"
            ) from None
    return value

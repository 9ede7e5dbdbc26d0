"""``server.log_format = "json"``: one JSON object per log line, with the request id.

Each line has ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
``request_id`` (the ``X-Request-Id`` of the request being served, or null) and,
for an exception, ``exc_info`` (the formatted traceback).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from baton_openai.http.request_id import RequestIdFilter


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def use_json_logs(logger: logging.Logger | None = None) -> None:
    """Make every handler of ``logger`` (default: the root logger) write JSON lines."""
    target = logger or logging.getLogger()
    if not target.handlers:
        logging.basicConfig()
    for handler in target.handlers:
        handler.setFormatter(JsonFormatter())
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())

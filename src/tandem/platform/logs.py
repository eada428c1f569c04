"""Structured logs: one line per event, `LEVEL time logger message key=value ...` (logfmt).

Tandem's loggers live under `tandem` (`tandem.api`, `tandem.engine`, ...) and pass their fields
as `extra={...}`; `configure_logging` gives that tree one handler on stderr that writes those
fields after the message, so a line can be searched by request id, tenant or code. Each process
calls it once (the CLI, and every Serve replica in its constructor: Ray forwards replicas' stderr
to the driver's terminal and writes it to the session's log files). Tracebacks (`exc_info`)
follow their line, as usual.
"""

from __future__ import annotations

import logging
import os
import sys
import time

# Attributes every LogRecord has: anything else on a record came from `extra`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
_HANDLER_NAME = "tandem-structured"


class StructuredFormatter(logging.Formatter):
    """`INFO <UTC ISO-8601 time, ms> tandem.api request refused status=400 code=... param=...`"""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        fields = " ".join(
            f"{key}={_value(value)}"
            for key, value in vars(record).items()
            if key not in _STANDARD and value is not None
        )
        line = f"{record.levelname} {stamp} {record.name} {record.getMessage()}"
        if fields:
            line = f"{line} {fields}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


def _value(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' ="\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def configure_logging(level: str | int | None = None) -> None:
    """Send the `tandem` loggers' records at `level` (default: $TANDEM_LOG_LEVEL, else INFO) and
    above to stderr as structured lines (idempotent: a second call only changes the level)."""
    if level is None:
        level = os.environ.get("TANDEM_LOG_LEVEL") or "INFO"
    logger = logging.getLogger("tandem")
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    if not any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(StructuredFormatter())
        logger.addHandler(handler)
    logger.propagate = False

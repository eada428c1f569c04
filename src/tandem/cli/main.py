"""`tandem`: the command line. Each command is a module with `add_parser(sub)` (its flags) and
the `run(args)` its parser sets; a `TandemError` prints as OpenAI's error JSON and exits 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tandem.cli import batch, generate, serve, tenants
from tandem.platform.errors import TandemError
from tandem.platform.logs import configure_logging

COMMANDS = (generate, serve, batch, tenants)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM inference platform")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    configure_logging(args.log_level)  # tandem's own lines: structured (platform/logs.py)
    try:
        return int(args.run(args))
    except TandemError as exc:
        print(
            json.dumps({"error": {"message": exc.message, "type": exc.error_type, "param": exc.param}}),
            file=sys.stderr,
        )
        return 2

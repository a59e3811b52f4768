"""`kiln` command line: a thin dispatcher. Each command family lives in its own module and registers
its subcommands; heavy imports happen inside the command functions so `kiln --help` stays instant."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kiln import __version__
from kiln.errors import KilnError, describe_os_error

# Modules that define `register(subparsers)`; order is the order of `kiln --help`.
COMMAND_MODULES = [
    "kiln.commands.run",
    "kiln.commands.models",
    "kiln.commands.serve",
    "kiln.commands.ps",
    "kiln.bench.cli",
    "kiln.eval.cli",
    "kiln.commands.report",
    "kiln.commands.trace",
    "kiln.commands.validate",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="Run small LLMs locally, fast, and see where the time goes.",
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "forwards_raw_args", False):
        args.args = argv[argv.index(args.command) + 1:]
    elif rest:
        parser.parse_args(argv)  # reports the unrecognized arguments and exits, as argparse does
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    # The scheduler logs each failure it turns into a request's error, for a server's log; a command
    # reports that error in its one line instead (kiln serve configures logging to show them).
    scheduler_log = logging.getLogger("kiln.scheduler")
    if not scheduler_log.handlers:
        scheduler_log.addHandler(logging.NullHandler())
    try:
        return int(args.func(args) or 0)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:  # a full disk, a folder kiln may not write: one line, as for any error
        print(f"kiln: error: {describe_os_error(e, f'kiln {args.command}')}", file=sys.stderr)
        return 1

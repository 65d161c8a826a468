"""The `specvox` command line: up, serve, client, say, demo, captions, keys, health, generate, train-draft, bench.

A table of subcommands: each is a `Command` (its name, help, arguments and run function) in a
module of its family (services/cli/serve.py: up and serve; client.py: client and say; demo.py; captions.py;
admin.py: keys and health; llm.py: generate and train-draft; bench.py: `specvox bench NAME`,
which imports bench/ by name, the one way from services/ to bench/). `main` builds the parser
from the table, makes the settings and the logging, and runs the one asked for.
"""

from __future__ import annotations

import argparse
import os
import sys

from services.cli import admin, bench, captions, client, demo, llm, serve
from services.cli.command import Command, UsageError
from services.stack import StackDidNotStart

COMMANDS: tuple[Command, ...] = (*serve.COMMANDS, *client.COMMANDS, *demo.COMMANDS, *captions.COMMANDS, *admin.COMMANDS,
                                 *llm.COMMANDS, *bench.COMMANDS)


def parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser, and each subcommand's own (for its usage errors)."""
    top = argparse.ArgumentParser(prog="specvox", description=__doc__.split("\n")[0])
    sub = top.add_subparsers(dest="command", required=True)
    parsers = {}
    for command in COMMANDS:
        parsers[command.name] = sub.add_parser(command.name, help=command.help)
        command.add_arguments(parsers[command.name])
    return top, parsers


def main(argv: list[str] | None = None) -> int:
    top, parsers = parser()
    args = top.parse_args(argv)
    command = next(c for c in COMMANDS if c.name == args.command)

    from services.server.logs import configure_logging
    from services.settings import Settings

    settings = Settings()
    if command.prepare is not None:
        command.prepare(settings, args, argv is None)
    configure_logging(os.environ.get("SPECVOX_LOG_LEVEL", command.log_level), settings.log_format,
                      command.process_name(args))
    try:
        return command.run(settings, args)
    except UsageError as e:
        parsers[command.name].error(str(e))
    except StackDidNotStart as e:
        print(f"specvox: {e}", file=sys.stderr)
        return 1

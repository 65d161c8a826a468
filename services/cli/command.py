"""One subcommand of the `specvox` command line, as the table in services/cli/__init__.py lists it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.settings import Settings


class UsageError(Exception):
    """Arguments that argparse alone cannot refuse: said as argparse says its own (usage, exit 2)."""


def _no_process_name(args: argparse.Namespace) -> str:
    return ""


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[Settings, argparse.Namespace], int]
    log_level: str = "INFO"  # unless SPECVOX_LOG_LEVEL says otherwise
    process_name: Callable[[argparse.Namespace], str] = _no_process_name  # in every log line (serve: the service)
    # Before the logging: (settings, args, started as a command rather than by main(argv) in a process)
    prepare: Callable[[Settings, argparse.Namespace, bool], None] | None = None

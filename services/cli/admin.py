"""`specvox keys` (the gateway's API keys) and `specvox health` (a container's health check)."""

from __future__ import annotations

import argparse
import sys

from services.cli.command import Command, UsageError
from services.cli.serve import SERVICES


def keys_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["add", "list", "revoke"])
    parser.add_argument("name", nargs="?", default="", help="add: the tenant; revoke: a tenant or a key's hash prefix")
    parser.add_argument("--file", default="", help="the key file (default: auth.keys_file)")


def run_keys(settings, args: argparse.Namespace) -> int:
    from services.server.auth import AuthConfigError, keys_command

    if args.action != "list" and not args.name:
        raise UsageError(f"keys {args.action} needs a tenant{' or a hash prefix' if args.action == 'revoke' else ''}")
    try:
        return keys_command(args.action, args.file or settings.auth.keys_file, args.name)
    except AuthConfigError as e:
        print(f"specvox keys: {e}", file=sys.stderr)
        return 2


def health_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="host:port, or a service name (asr, llm, tts, gateway) for its address")


def run_health(settings, args: argparse.Namespace) -> int:
    from services.server.supervisor import health_probe

    address = settings.address(args.address) if args.address in SERVICES else args.address
    serving = health_probe(settings)(address)
    print(f"{address}: {'SERVING' if serving else 'not serving'}")
    return 0 if serving else 1


COMMANDS = (
    Command("keys", "the gateway's API keys: add TENANT (prints the key once), list, revoke "
                    "TENANT-or-HASH-PREFIX; only hashes are stored (docs/security.md)", keys_arguments, run_keys),
    Command("health", "exit 0 if the service at ADDRESS says SERVING (grpc.health.v1, over the settings' TLS, "
                      "with the service credential): a container health check", health_arguments, run_health),
)

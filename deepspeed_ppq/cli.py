"""The ``ppq`` command: ``ppq report | simulate | tune | schema ...``.

There is no separate planning command: ``ppq tune`` writes the plan (``plan.json``) and ``ppq simulate``
times a configuration given on its command line.

Each subcommand lives beside the code it drives and registers itself here through
``_SUBCOMMANDS`` (module path, function name that adds its parser); modules are imported only when
their subcommand runs, so ``ppq report`` works even where DeepSpeed or megatron-core are missing.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# name -> (module, "add_parser" function). The function takes the subparsers object, adds its
# parser and sets ``func`` (called with the parsed args, returns an exit code).
_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "report": ("deepspeed_ppq.env_report", "add_parser"),
    "simulate": ("deepspeed_ppq.schedule.cli", "add_parser"),
    "tune": ("deepspeed_ppq.integrations.tune_cli", "add_parser"),
    "schema": ("deepspeed_ppq.config", "add_schema_parser"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="ppq", description="deepspeed_ppq: simulate a pipeline, tune a training script (writes the "
        "plan), report the environment, print the config's JSON schema")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    for name, (module, fn) in _SUBCOMMANDS.items():
        if wanted is not None and name != wanted:
            sub.add_parser(name)  # listed in --help, loaded only when used
            continue
        try:
            getattr(importlib.import_module(module), fn)(sub)
        except ModuleNotFoundError as e:
            if wanted == name:
                raise
            sub.add_parser(name, help=f"(unavailable: {e})")
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

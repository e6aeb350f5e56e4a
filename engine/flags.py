"""Command-line flags declared once, on the dataclass field they set: its name, help and argparse keywords sit in the
field's metadata, its default is the field's. A settings object (LoadOptions, FitConfig) then gives every command
line the same flags with the same defaults, and reads them back into one typed value."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields


def flag(name: str, help: str, **argument) -> dict:
    """A field's command-line flag: `field(default=..., metadata=flag("--name", "help", type=int))`."""
    return {"flag": name, "help": help, "argument": argument}


def add_flags(settings: type, parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """Add the flags of `settings`' fields (those in `only`, if given) to `parser`, each with its field's default
    (or the flag's own: None for a tree's shape, which then stays the tree's)."""
    for f in fields(settings):
        if "flag" not in f.metadata or (only is not None and f.name not in only):
            continue
        argument = dict(f.metadata["argument"])
        if argument.get("action") not in ("store_false", "store_true") and "default" not in argument:
            argument["default"] = f.default if f.default is not MISSING else f.default_factory()
        parser.add_argument(f.metadata["flag"], dest=f.name, help=f.metadata["help"], **argument)


def flag_values(settings: type, args: argparse.Namespace) -> dict:
    """The values a parsed command line gives `settings`' fields (fields it has no flag for are left out)."""
    return {f.name: getattr(args, f.name) for f in fields(settings) if hasattr(args, f.name)}

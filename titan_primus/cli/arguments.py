"""Argument kinds the commands share: counts, switches and device profiles."""

from __future__ import annotations

import argparse

from ..device import known_profiles

__all__ = ["add_count", "add_profile", "add_switch", "positive"]


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_count(parser: argparse.ArgumentParser, flag: str, help: str, default: int | None = None) -> None:
    """A positive integer option, shown as N."""
    parser.add_argument(flag, type=positive, default=default, metavar="N", help=help)


def add_switch(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    parser.add_argument(flag, action="store_true", help=help)


def add_profile(parser: argparse.ArgumentParser, help: str) -> None:
    """``--device PROFILE``, one of the named device profiles."""
    parser.add_argument("--device", choices=known_profiles(), metavar="PROFILE", help=help)

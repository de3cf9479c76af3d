"""Checks for ``compass-fx``'s numeric command-line values, shared by every subcommand.

One place, one style: a bad value reads like argparse's own errors
(``compass-fx plan: error: argument --tokens: must be a positive integer, got -5``) and exits
with status 2, whether argparse's ``type=`` catches it (one value on its own) or a subcommand
does after parsing (values that must agree, raised as ``ValueError`` and reported by ``main``).
"""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts and sizes: catches the sign before any model sees it."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """argparse ``type=`` for a comma-separated list of positive integers (sweep grids)."""
    try:
        values = tuple(positive_int(v) for v in text.split(",") if v.strip())
    except argparse.ArgumentTypeError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}")
    return values


def require_multiple(option: str, value: int, of_option: str, of: int, why: str = "") -> None:
    """Raise the argparse-style ``ValueError`` unless ``value`` divides evenly by ``of``."""
    if value % of:
        raise ValueError(f"argument {option}: must be a multiple of {of_option} ({of}){why}, got {value}")

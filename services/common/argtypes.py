"""argparse types that check a number's range at parse time: a bad value is a usage
error (exit 2) naming the option and the allowed range, never a traceback or a failure
minutes later (``kvmesh up --port 70000``, ``--prefill -1``; issue 34)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_in(lo: int, hi: int, note: str = "") -> Callable[[str], int]:
    """An integer in [lo, hi]; ``note`` (e.g. "-1 = off") is added to the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            more = f" ({note})" if note else ""
            raise argparse.ArgumentTypeError(
                f"{value} is out of range: give an integer from {lo} to {hi}{more}"
            )
        return value

    return parse


def int_at_least(lo: int, note: str = "") -> Callable[[str], int]:
    """An integer >= lo; ``note`` is added to the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            more = f" ({note})" if note else ""
            raise argparse.ArgumentTypeError(
                f"{value} is out of range: give an integer >= {lo}{more}"
            )
        return value

    return parse


def float_at_least(lo: float, above: bool = False, hi: float | None = None):
    """A finite number >= lo (> lo when ``above``), and <= hi when given."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if (
            not math.isfinite(value)
            or value < lo
            or (above and value == lo)
            or (hi is not None and value > hi)
        ):
            upper = f" and <= {hi:g}" if hi is not None else ""
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: give a number {'>' if above else '>='} {lo:g}{upper}"
            )
        return value

    return parse


PORT = int_in(0, 65535, "0 = any free port")

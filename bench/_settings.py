"""``--set KEY=VALUE``: service settings a benchmark passes to the ``streamtrain serve`` it starts."""

from __future__ import annotations

import argparse


def add_set_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a service setting by its name (any case, without the STREAMTRAIN_ prefix), e.g. --set COMPILE=off "
        "(repeatable)",
    )  # fmt: skip


def service_settings(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, str]:
    """The ``--set`` items as {name: value}, names lower-cased (Settings' field names; the
    environment's names are case-insensitive); a malformed one ends the run with a usage error."""
    malformed = [item for item in items if "=" not in item.strip("= ")]
    if malformed:
        parser.error(f"--set takes KEY=VALUE, got {malformed[0]!r}")
    return {name.strip().lower(): value.strip() for name, value in (item.split("=", 1) for item in items)}

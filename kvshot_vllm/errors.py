"""User-facing errors: the CLI prints these as one line, without a traceback."""

from __future__ import annotations

from pydantic import ValidationError


class KVShotError(Exception):
    """A problem with the user's input (a file, a flag, a config) that they can fix."""


def first_validation_error(exc: ValidationError) -> tuple[str, str]:
    """pydantic's first error as (dotted field path, message), for a one-line KVShotError."""
    first = exc.errors()[0]
    return (".".join(str(p) for p in first["loc"]),
            first["msg"].removeprefix("Value error, "))

"""Errors a user causes with the run config or the schedule file (a leaf module: everything may
import it)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A run config a user wrote wrongly: names the file, the key and the fix."""


class ScheduleError(ValueError):
    """A schedule file the method cannot run; the message names the file, the key and the fix."""


def toml_value(value) -> str:
    """``value`` as a TOML file spells it, for messages that quote a key (``false``, not
    Python's ``False``)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)

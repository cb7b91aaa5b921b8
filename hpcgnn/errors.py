"""Errors a user causes with the run config (a leaf module: everything may import it)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A run config a user wrote wrongly: names the file, the key and the fix."""

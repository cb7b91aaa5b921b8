"""The one error preprocessing raises for a request a user can fix."""
from __future__ import annotations


class PreprocessError(ValueError):
    """A bad request (parts, output directory) or a failed write; names the file and the fix."""

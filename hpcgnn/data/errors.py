"""The one error a dataset reader raises for input a user can fix."""
from __future__ import annotations


class DatasetError(ValueError):
    """A dataset that is missing, malformed or out of range; the message names file and fix."""

"""VARCO's channel rule: ``k = floor(F / r)`` channels of ``F`` at ratio ``r``.

The channel stage itself (``truncate``, ``learned``, ``random``) is part of ``WireCodec``
(``hpcgnn.codecs.base``); the learned encoder/decoder pair is in ``hpcgnn.codecs.learned``.
"""
from __future__ import annotations

import math


def channels_for(width: int, ratio: float) -> int:
    """VARCO's ``k = floor(F / r)``, guarded to ``1 <= k <= F`` (the authors' code sends nothing
    when ``F < r``)."""
    return max(1, min(width, math.floor(width / ratio + 1e-9)))

"""The halo plan: who sends which owned rows to whom, read once from a shard's ``halo/*``.

Counts and displacements are fixed for the whole run (the invariant of the shard format: rank
``q``'s send block for ``p`` is, row for row, rank ``p``'s halo block from ``q``), so no
exchange ever needs a size handshake. Byte counts per exchange follow from the counts, the
width and the codec (``WireCodec.byte_counts``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hpcgnn.data.shard import Shard


@dataclass(frozen=True)
class HaloPlan:
    """Send/receive row counts per peer, and which owned rows go out, grouped by peer."""

    send_counts: tuple[int, ...]   # rows sent to each part
    recv_counts: tuple[int, ...]   # halo rows received from each part
    send_index: torch.Tensor       # int64 [sum(send_counts)] owned local rows, grouped by peer
    n_owned: int
    n_halo: int

    @classmethod
    def from_shard(cls, shard: Shard, device: torch.device | str = "cpu") -> "HaloPlan":
        return cls(send_counts=tuple(int(c) for c in shard.send_counts),
                   recv_counts=tuple(int(c) for c in shard.recv_counts),
                   send_index=torch.as_tensor(shard.send_index, dtype=torch.long).to(device),
                   n_owned=shard.n_owned, n_halo=shard.n_halo)

    @classmethod
    def empty(cls, parts: int, n_owned: int, device: torch.device | str = "cpu") -> "HaloPlan":
        """A plan that exchanges nothing (algorithms without a halo exchange)."""
        return cls(send_counts=(0,) * parts, recv_counts=(0,) * parts,
                   send_index=torch.zeros(0, dtype=torch.long, device=device), n_owned=n_owned,
                   n_halo=0)

    @property
    def num_parts(self) -> int:
        return len(self.send_counts)

    @property
    def n_send(self) -> int:
        return int(self.send_index.shape[0])

    @property
    def peers(self) -> list[int]:
        """Parts this rank exchanges any row with (either direction)."""
        return [p for p, (s, r) in enumerate(zip(self.send_counts, self.recv_counts)) if s or r]

    def boundary_rows(self) -> np.ndarray:
        """Owned local rows that some peer needs (sorted, unique)."""
        return np.unique(self.send_index.cpu().numpy())


def displacements(counts: list[int]) -> list[int]:
    """Exclusive prefix sum: where each peer's block starts in a packed buffer."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += int(c)
    return out

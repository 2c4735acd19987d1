"""Which samples go into which ``seq_len`` block: best-fit-decreasing packing, or one per block.

A *plan* lists, per block, its segments ``(sample, start, end)`` (token ranges of tokenized
samples); ``PackedDataset`` turns it into rows. Samples longer than ``seq_len`` are first
``truncate``d (their first ``seq_len`` tokens), ``split`` into ``seq_len`` pieces (each its own
document: positions restart) or ``drop``ped, and counted.

``best-fit``: samples in decreasing length, each into the open block with the *least* room that
still fits it (a new block if none does). For ``n`` pieces and block room ``C`` it runs in
``O(n log C)`` (a segment tree over the room left, ``C + 1`` leaves), so a million samples plan in
seconds; best-fit-decreasing uses at most ``11/9 OPT + 6/9`` blocks. ``none``: one sample per
block, padded (the baseline the efficiency is compared with).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PACKINGS = ("best-fit", "none")
LONG_SAMPLES = ("truncate", "split", "drop")


@dataclass(frozen=True, kw_only=True)
class PackingPlan:
    """Blocks as flat segment arrays: block ``b`` holds segments ``offsets[b]:offsets[b+1]``."""

    offsets: np.ndarray
    """``[num_blocks + 1]`` int64 start of each block's segments."""
    sample: np.ndarray
    """``[num_segments]`` int64 index of the segment's sample."""
    start: np.ndarray
    """``[num_segments]`` int64 first token of the segment in its sample."""
    end: np.ndarray
    """``[num_segments]`` int64 one past its last token."""
    truncated: int = 0
    """Samples longer than ``seq_len`` cut to their first ``seq_len`` tokens."""
    split: int = 0
    """Samples longer than ``seq_len`` cut into several pieces."""
    dropped: int = 0
    """Samples longer than ``seq_len`` left out (and empty samples)."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def real_tokens(self) -> int:
        return int((self.end - self.start).sum())


class _RoomTree:
    """Open blocks by room left: ``take(n)`` finds a block with the least room ``>= n`` in ``O(log C)``."""

    def __init__(self, capacity: int) -> None:
        self.size = 1
        while self.size < capacity + 1:
            self.size *= 2
        self.count = [0] * (2 * self.size)  # open blocks per room value, summed up the tree
        self.blocks: dict[int, list[int]] = {}

    def add(self, room: int, block: int) -> None:
        self.blocks.setdefault(room, []).append(block)
        i = room + self.size
        while i:
            self.count[i] += 1
            i //= 2

    def take(self, need: int) -> tuple[int, int] | None:
        """Remove and return ``(room, block)`` of the smallest room ``>= need``, or ``None``."""
        lo, hi = need + self.size, 2 * self.size - 1
        # walk [need, C] bottom-up, collecting the left-to-right covering nodes
        left, right = [], []
        while lo <= hi:
            if lo & 1:
                left.append(lo)
                lo += 1
            if not hi & 1:
                right.append(hi)
                hi -= 1
            lo, hi = lo // 2, hi // 2
        for node in left + right[::-1]:
            if self.count[node]:
                while node < self.size:  # descend to the leftmost non-empty leaf
                    node = 2 * node if self.count[2 * node] else 2 * node + 1
                room = node - self.size
                block = self.blocks[room].pop()
                i = node
                while i:
                    self.count[i] -= 1
                    i //= 2
                return room, block
        return None


def _pieces(lengths: np.ndarray, seq_len: int, long_samples: str):
    """``(sample, start, end)`` pieces of at most ``seq_len`` tokens, and the counts of cut samples."""
    if long_samples not in LONG_SAMPLES:
        raise ValueError(f"--long-samples must be one of {LONG_SAMPLES}, got {long_samples!r}")
    long = lengths > seq_len
    keep = (lengths > 0) & (~long | (long_samples != "drop"))
    idx = np.nonzero(keep)[0]
    ln = lengths[idx]
    if long_samples == "split":
        counts = -(-ln // seq_len)
        sample = np.repeat(idx, counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        start = (np.arange(len(sample)) - first) * seq_len
        end = np.minimum(start + seq_len, np.repeat(ln, counts))
    else:
        sample, start, end = idx, np.zeros_like(idx), np.minimum(ln, seq_len)
    n_long = int(long.sum())
    return (
        sample,
        start,
        end,
        {
            "truncated": n_long if long_samples == "truncate" else 0,
            "split": n_long if long_samples == "split" else 0,
            "dropped": int((lengths == 0).sum()) + (n_long if long_samples == "drop" else 0),
        },
    )


def plan_blocks(lengths: np.ndarray, seq_len: int, *, packing: str, long_samples: str) -> PackingPlan:
    """Pack samples of token ``lengths`` into blocks of ``seq_len`` (see the module docstring)."""
    if packing not in PACKINGS:
        raise ValueError(f"--packing must be one of {PACKINGS}, got {packing!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    sample, start, end, counts = _pieces(lengths, seq_len, long_samples)
    if packing == "none":
        offsets = np.arange(len(sample) + 1, dtype=np.int64)
        return PackingPlan(offsets=offsets, sample=sample, start=start, end=end, **counts)
    size = end - start
    order = np.argsort(-size, kind="stable")  # decreasing; ties keep the data order
    tree = _RoomTree(seq_len)
    members: list[list[int]] = []
    for piece in order.tolist():
        n = int(size[piece])
        found = tree.take(n)
        if found is None:
            room, block = seq_len, len(members)
            members.append([])
        else:
            room, block = found
        members[block].append(piece)
        if room - n > 0:
            tree.add(room - n, block)
    flat = np.fromiter((p for m in members for p in m), dtype=np.int64, count=len(sample))
    offsets = np.zeros(len(members) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(m) for m in members])
    return PackingPlan(offsets=offsets, sample=sample[flat], start=start[flat], end=end[flat], **counts)

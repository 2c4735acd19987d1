"""The validation vocabulary every component uses: one checker per kind of value, one wording.

Checks run before any collective (DESIGN.md: validate early) and raise ``ValueError`` naming the
value and what was expected, so the same bad input gets the same message from the config, the
mesh, the data adapter, the tiling and the CLI. The base of the import graph: imports nothing of
ours.
"""

from __future__ import annotations

from typing import Any


def positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """Return ``value`` if it is an ``int >= minimum`` (``bool`` is refused: ``True`` as a size is a
    mistake); else raise ``ValueError``: ``"{name} must be a positive int, got 1.5 (float)"`` or
    ``"{name} must be >= 1, got 0"``."""
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def optional_positive_int(name: str, value: Any, *, minimum: int = 1) -> int | None:
    """``positive_int`` that lets ``None`` ("not set" / "auto") through."""
    return None if value is None else positive_int(name, value, minimum=minimum)


def read_text_file(flag: str, path: str) -> str:
    """The UTF-8 contents of the file ``path`` given as ``flag`` (``--data``, ``--chat-template``);
    ``ValueError`` naming both when it cannot be read or holds only whitespace."""
    try:
        with open(path, encoding="utf-8") as f:
            content = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: cannot read {path!r}: {e}") from e
    if not content.strip():
        raise ValueError(f"{flag}: {path!r} is empty")
    return content


def seq_len_multiple(sp_size: int, ring_size: int = 1) -> tuple[int, str]:
    """``(m, why)``: the sequence length of sequence parallelism must be a multiple of ``m``: the SP
    size ``P``, or ``2P`` with a ring (every ring rank holds two zigzag chunks)."""
    if ring_size > 1:
        return 2 * sp_size, f"sp {sp_size} x 2 zigzag chunks per ring rank, ring size {ring_size}"
    return sp_size, f"sp {sp_size}"


def check_seq_len_divisible(
    seq_len: int, sp_size: int, ring_size: int = 1, *, name: str = "sequence length", fix: str = "use"
) -> None:
    """The one wording of the sequence-length divisibility rule (``seq_len_multiple``), for every
    place that enforces it (CLI flags, batch preparation, sharding, ring spans):
    ``"--seq-len 30 is not divisible by 4 (sp 4); use a multiple of 4, e.g. 32"``."""
    multiple, why = seq_len_multiple(sp_size, ring_size)
    if seq_len % multiple:
        up = seq_len + multiple - seq_len % multiple
        raise ValueError(
            f"{name} {seq_len} is not divisible by {multiple} ({why}); {fix} a multiple of {multiple}, e.g. {up}"
        )

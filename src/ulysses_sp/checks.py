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

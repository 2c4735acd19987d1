"""The documentation's pages, for the tests that check what they say: README.md and the site's
pages (docs/**/*.md; the README's template is not a page, the README made from it is)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pages() -> list[pathlib.Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "README.template.md")
    return [ROOT / "README.md", *docs]


def all_text() -> str:
    """Every page's text, one after another (a test looking for a passage wherever it lives)."""
    return "\n".join(p.read_text(encoding="utf-8") for p in pages())


def code_blocks(path: pathlib.Path) -> list[tuple[str, str, str, int]]:
    """``(language, body, the line before the fence, line number)`` of each fenced block of a page."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((m.group(1), m.group(2), before, text.count("\n", 0, m.start()) + 1))
    return out

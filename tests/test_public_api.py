"""The public API is where the docs say it is: every documented import path resolves.

The README and the site's pages (docs/**/*.md) are parsed, not copied: every ``from ulysses_sp... import a, b`` statement, every
``import ulysses_sp...`` and every dotted mention ``ulysses_sp.x.y`` must import (a module) or
resolve (an attribute of one), so moving or renaming a documented name fails here, naming the
page and line. The package's lazy ``__all__`` must resolve as well.
"""

from __future__ import annotations

import importlib
import re

import pytest
from docs_pages import ROOT, pages

import ulysses_sp

_FROM_IMPORT = re.compile(r"^\s*from\s+(ulysses_sp(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)
_IMPORT = re.compile(r"^\s*import\s+(ulysses_sp(?:\.\w+)*)", re.M)
_DOTTED = re.compile(r"(?<![\w./-])ulysses_sp(?:\.[A-Za-z_]\w*)+")


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _documented() -> list[tuple[str, str | None, str]]:
    """``(module, name or None, "page:line")`` for every import and dotted mention in the docs."""
    found: dict[tuple[str, str | None], str] = {}
    for page in pages():
        text = page.read_text(encoding="utf-8")
        where = str(page.relative_to(ROOT)) + ":{}"
        for m in _FROM_IMPORT.finditer(text):
            for name in m.group(2).strip("()").replace("\n", " ").split(","):
                name = name.split(" as ")[0].strip()
                if name:
                    found.setdefault((m.group(1), name), where.format(_line(text, m.start())))
        for m in _IMPORT.finditer(text):
            found.setdefault((m.group(1), None), where.format(_line(text, m.start())))
        for m in _DOTTED.finditer(text):
            found.setdefault((m.group(0), None), where.format(_line(text, m.start())))
    return [(module, name, line) for (module, name), line in found.items()]


def _resolve(dotted: str) -> object:
    """Import the longest importable module prefix of ``dotted``; the rest are attributes."""
    parts = dotted.split(".")
    obj, i = importlib.import_module(parts[0]), 1
    while i < len(parts):
        candidate = ".".join(parts[: i + 1])
        try:
            obj = importlib.import_module(candidate)
        except ModuleNotFoundError as e:
            if e.name != candidate:  # the module exists but one of its own imports failed
                raise
            break
        i += 1
    for attr in parts[i:]:
        obj = getattr(obj, attr)
    return obj


DOCUMENTED = _documented()


def test_the_readme_documents_the_tiling_api():
    # the parser must see the paths this suite exists to protect (a silent parse would test nothing)
    names = {(module, name) for module, name, _ in DOCUMENTED}
    assert {
        ("ulysses_sp.memory.tiling", "apply_tiled_mlp"),
        ("ulysses_sp.memory.tiling", "TiledCausalLMLoss"),
    } <= names
    assert ("ulysses_sp.memory.tiling", "sequence_tiled_compute") in names
    assert ("ulysses_sp", "initialize") in names
    assert len(DOCUMENTED) >= 30, DOCUMENTED


@pytest.mark.parametrize(
    "module, name, line", DOCUMENTED, ids=[f"{m}:{n}" if n else m for m, n, _ in DOCUMENTED]
)
def test_documented_import_path_resolves(module, name, line):
    try:
        obj = _resolve(module)
        if name is not None:
            obj = getattr(obj, name)
    except (ImportError, AttributeError) as e:
        what = f"from {module} import {name}" if name else module
        pytest.fail(f"{line}: {what} does not resolve: {e!r}")
    assert obj is not None


@pytest.mark.parametrize("name", sorted(set(ulysses_sp.__all__) - {"__version__"}))
def test_package_exports_resolve(name):
    obj = getattr(ulysses_sp, name)
    module = importlib.import_module(obj.__module__)
    # callers can import it from where it lives, and that module is public (no ``_private`` home)
    assert getattr(module, name) is obj
    assert not any(part.startswith("_") for part in obj.__module__.split(".")), obj.__module__

"""The site's ``ulysses-sp plan`` commands run as printed: every ``ulysses-sp plan`` line of a
``bash`` block whose marker names this test (``<!-- run by: tests/test_docs_howto.py::... -->``)
runs in this process (``plan`` builds nothing and starts no process) and recommends a ``train``
command, so a renamed flag or a plan that no longer finds a setting breaks the page's test."""

from __future__ import annotations

import shlex

import pytest
from docs_pages import ROOT, code_blocks, pages

from ulysses_sp.cli.main import main

_MARK = "run by: tests/test_docs_howto.py::test_plan_commands_in_the_pages_run"


def _plan_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in pages():
        for lang, body, before, line in code_blocks(page):
            if lang != "bash" or _MARK not in before:
                continue
            for text in body.replace("\\\n", " ").splitlines():
                words = shlex.split(text, comments=True)
                if words[:2] == ["ulysses-sp", "plan"]:
                    found.append((f"{page.relative_to(ROOT)}:{line}", words[1:]))
    return found


COMMANDS = _plan_commands()


def test_the_pages_name_this_test_for_their_plan_commands():
    assert len(COMMANDS) >= 2, COMMANDS


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_plan_commands_in_the_pages_run(where, argv, capsys):
    main(argv)
    out = capsys.readouterr().out
    assert "recommended:" in out and "ulysses-sp train --model" in out, f"{where}: {out[-2000:]}"

"""The docs cannot rot (issue 33): README.md and the site's pages (docs/**/*.md) say only what the
code and the results files say.

- every ``bash`` block is run by a named test or marked not run, with the reason, on the line
  before it (``<!-- run by: tests/FILE.py::TEST ... -->`` / ``<!-- not run: REASON -->``); the named
  test must exist;
- every ``ulysses-sp SUBCOMMAND ...`` command in the pages uses flags that subcommand has, and
  every flag quoted alone (`` `--flag` ``) exists, outside the bench and test pages;
- the README's excerpts (``# excerpt of examples/FILE``) are lines of that file;
- the version and the requirements stated anywhere are pyproject.toml's; the README is at most
  300 lines. (Whole scripts in the pages run in tests/test_examples.py; mkdocs build --strict in
  scripts/test.sh.)
"""

from __future__ import annotations

import argparse
import re

import pytest
from docs_pages import ROOT, all_text, code_blocks, pages

from ulysses_sp.cli.args import build_parser

_MARK = re.compile(r"<!-- (run by: (tests/\S+\.py)::(\w+).*?|not run: \S.*?) -->")
_CMD = re.compile(r"(?:ulysses-sp|-m ulysses_sp\.cli\.main)\s+(train|eval|plan|env)\b([^\n`#]*)")  # on text with continuations joined
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# Pages about the bench and the tests quote their scripts' flags (`--smoke`, `--tech`), not the CLI's.
_OTHER_FLAGS_PAGES = {"performance.md", "testing.md", "bench.md"}


def _rel(path) -> str:
    return str(path.relative_to(ROOT))


def _flags() -> dict[str, set[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}


BASH = [
    (f"{_rel(page)}:{line}", body, before)
    for page in pages()
    for lang, body, before, line in code_blocks(page)
    if lang in ("bash", "sh", "shell", "console")
]


def test_the_pages_have_bash_blocks():
    assert len(BASH) >= 15, [where for where, _, _ in BASH]


@pytest.mark.parametrize("where, body, before", BASH, ids=[w for w, _, _ in BASH])
def test_every_bash_block_is_run_by_a_test_or_marked_not_run(where, body, before):
    m = _MARK.search(before)
    assert m, (
        f"{where}: the line before this ```bash block must say which test runs it "
        "(<!-- run by: tests/test_x.py::test_name -->) or why none does (<!-- not run: reason -->)"
    )
    if m.group(2):
        path = ROOT / m.group(2)
        assert path.is_file(), f"{where}: {m.group(2)} does not exist"
        assert re.search(rf"^\s*def {m.group(3)}\(", path.read_text(), re.M), (
            f"{where}: {m.group(2)} has no test {m.group(3)}"
        )


def test_every_documented_ulysses_sp_flag_exists():
    flags = _flags()
    every = set().union(*flags.values())
    wrong, seen = [], 0
    for page in pages():
        text = page.read_text(encoding="utf-8").replace("\\\n", " ")  # join `\` continuation lines
        for m in _CMD.finditer(text):
            for flag in _FLAG.findall(m.group(2)):
                seen += 1
                if flag not in flags[m.group(1)]:
                    wrong.append(f"{_rel(page)}: ulysses-sp {m.group(1)} has no {flag}")
        if page.name not in _OTHER_FLAGS_PAGES:
            for flag in re.findall(r"`(--[a-z][a-z0-9-]*)", text):
                seen += 1
                if flag not in every:
                    wrong.append(f"{_rel(page)}: `{flag}` is no flag of ulysses-sp")
    assert seen > 200 and not wrong, "\n".join(wrong)


def test_the_flag_check_sees_a_wrong_flag():
    text = "```bash\nulysses-sp train --model x \\\n    --tiled-mlpp --sp 2   # a comment --not-a-flag\n```"
    (m,) = _CMD.finditer(text.replace("\\\n", " "))
    assert m.group(1) == "train" and _FLAG.findall(m.group(2)) == ["--model", "--tiled-mlpp", "--sp"]
    assert "--tiled-mlpp" not in _flags()["train"]


def test_readme_excerpts_are_lines_of_their_files():
    readme = ROOT / "README.md"
    excerpts = [b for lang, b, _, _ in code_blocks(readme) if b.startswith("# excerpt of ")]
    assert excerpts, "the README shows the library path as an excerpt of examples/train_sp.py"
    for body in excerpts:
        first, *lines = body.splitlines()
        source = ROOT / first.removeprefix("# excerpt of ").strip()
        have = {line.strip() for line in source.read_text().splitlines()}
        missing = [line for line in lines if line.strip() and line.strip() not in have]
        assert not missing, f"README excerpt of {source.name}: not in the file: {missing}"


def _pyproject():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_facts
    finally:
        sys.path.pop(0)
    return docs_facts


def test_versions_and_requirements_have_one_source():
    import ulysses_sp

    facts = _pyproject()
    assert ulysses_sp.__version__ == facts.pyproject()["version"]
    reqs = {"torch": facts.requirement("torch"), "transformers": facts.requirement("transformers")}
    for name, req in reqs.items():
        stated = set(re.findall(rf"`?({name}\s*>=\s*[\d.]+)", all_text()))
        assert {s.replace(" ", "") for s in stated} <= {req}, (name, stated, req)
    assert f"v{facts.pyproject()['version']}" in (ROOT / "README.md").read_text()


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: keep it a front door, move the rest to a page"


def test_every_page_is_in_the_site_nav():
    """A page not in mkdocs.yml's nav is built but unreachable: each docs/**/*.md is listed."""
    nav = (ROOT / "mkdocs.yml").read_text()
    docs = ROOT / "docs"
    missing = [
        str(p.relative_to(docs))
        for p in docs.rglob("*.md")
        if p.name != "README.template.md" and f": {p.relative_to(docs).as_posix()}" not in nav
    ]
    assert not missing, f"add to mkdocs.yml's nav: {missing}"


def test_the_trainer_diff_is_the_same_on_every_page():
    """The one-line `prepare` diff on an SFTTrainer is shown on the README, Get started and the
    Trainer guide: one text."""
    diffs = {
        body: _rel(page)
        for page in pages()
        for lang, body, _, _ in code_blocks(page)
        if lang == "diff" and "prepare(trainer" in body and "SFTTrainer(" in body
    }
    assert len(diffs) == 1, f"the prepare() diffs differ: {sorted(diffs.values())}"

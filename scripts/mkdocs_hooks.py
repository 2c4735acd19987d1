"""mkdocs hooks (mkdocs.yml `hooks:`): what the site generates at build time, so it cannot go stale.

- `index.md` is README.md; `results/NAME.md` is bench/results/NAME.md (one source each).
- `reference/cli.md`: every subcommand's `--help`, from `ulysses_sp.cli.args.build_parser`.
- `reference/api.md`: a mkdocstrings block per public name of `ulysses_sp` (its `_EXPORTS`).
- `reference/config.md`, `reference/plan-json.md`: the config keys and the plan JSON schema
  (scripts/docs_reference.py); a page's `<!-- bench-scripts -->` line becomes the table of bench/*.py
  with each script's docstring summary.
- `contributing/architecture.md`: the layers of `tests/test_architecture.py`, each package's
  docstring beside them.
- The pages are written with repository-relative links (they read on GitHub as well):
  `docs/readme/hf.md` from the README, `../../bench/results/x.md` from a page. Each such link is
  mapped to the site's page; a link to anything the site does not hold is left for
  `mkdocs build --strict` to report. The pages under `readme/` start at `##` (they were README
  sections); their headings move up one level.
"""

from __future__ import annotations

import ast
import os
import pathlib
import posixpath
import re
import sys

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent
_LINK = re.compile(r"(\]\()([^)\s]+)(\))")
_FENCE = re.compile(r"^\s*(```|~~~)")
sys.path.insert(0, str(ROOT / "scripts"))
import docs_reference  # noqa: E402  (beside this file)


def _generated(config, files, src_uri: str, content: str) -> None:
    old = files.get_file_from_path(src_uri)
    if old is not None:
        files.remove(old)
    files.append(File.generated(config, src_uri, content=content))


def on_files(files, config):
    _generated(config, files, "index.md", (ROOT / "README.md").read_text())
    for path in sorted((ROOT / "bench" / "results").glob("*.md")):
        _generated(config, files, f"results/{path.name}", path.read_text())
    _generated(config, files, "reference/cli.md", cli_reference())
    _generated(config, files, "reference/api.md", api_reference())
    _generated(config, files, "reference/config.md", docs_reference.config_reference())
    _generated(config, files, "reference/plan-json.md", docs_reference.plan_json_reference())
    _generated(config, files, "contributing/architecture.md", architecture())
    return files


def _repo_path(src_uri: str) -> str:
    """Where a site page lives in the repository."""
    if src_uri == "index.md":
        return "README.md"
    if src_uri.startswith("results/"):
        return "bench/" + src_uri
    return "docs/" + src_uri


def _site_path(repo_path: str) -> str | None:
    if repo_path == "README.md":
        return "index.md"
    if repo_path.startswith("bench/results/") and repo_path.endswith(".md"):
        return repo_path[len("bench/") :]
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    return None


def _map_link(target: str, src_uri: str) -> str:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return target
    path, _, anchor = target.partition("#")
    repo = posixpath.normpath(posixpath.join(posixpath.dirname(_repo_path(src_uri)), path))
    if not (ROOT / repo).exists() and (ROOT / path).exists():
        repo = posixpath.normpath(path)  # written relative to the repository root (a former README section)
    site = _site_path(repo)
    if site is None:
        return target
    rel = posixpath.relpath(site, posixpath.dirname(src_uri) or ".")
    return rel + ("#" + anchor if anchor else "")


def on_page_markdown(markdown, page, config, files):
    src_uri = page.file.src_uri
    if "<!-- bench-scripts -->" in markdown:
        markdown = markdown.replace("<!-- bench-scripts -->", docs_reference.bench_scripts())
    shift = src_uri.startswith("readme/") and markdown.lstrip().startswith("## ")
    out, fenced = [], False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            if shift and line.startswith("##"):
                line = line[1:]
            line = _LINK.sub(lambda m: m.group(1) + _map_link(m.group(2), src_uri) + m.group(3), line)
        out.append(line)
    return "\n".join(out) + "\n"


def cli_reference() -> str:
    import argparse

    from ulysses_sp.cli.args import build_parser

    prev = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # the help's width, whatever the terminal
    try:
        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parts = [
            "# CLI reference",
            "",
            "Generated when the site is built, from the parser `ulysses-sp` itself runs "
            "(`ulysses_sp.cli.args.build_parser`): each subcommand's `--help`.",
        ]
        for name, subparser in sub.choices.items():
            parts += ["", f"## `ulysses-sp {name}`", "", "```text", subparser.format_help().rstrip(), "```"]
    finally:
        if prev is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = prev
    return "\n".join(parts) + "\n"


# Public entry points that live outside `ulysses_sp.__all__` but are documented as the way in.
EXTRA_API = {
    "Trainer / TRL": ["ulysses_sp.integrations.transformers.prepare"],
    "Vision-language models": ["ulysses_sp.vlm.shard_vlm", "ulysses_sp.vlm.prepare_vlm_batch"],
}


def api_reference() -> str:
    import ulysses_sp

    parts = [
        "# Python API",
        "",
        "Generated when the site is built: every name `ulysses_sp` exports (`ulysses_sp.__all__`), "
        "from its docstring, grouped by the module that defines it; then the entry points of the "
        "Trainer and VLM paths.",
    ]
    by_module: dict[str, list[str]] = {}
    for name, module in ulysses_sp._EXPORTS.items():
        by_module.setdefault(module, []).append(name)
    for module, names in by_module.items():
        parts += ["", f"## `ulysses_sp.{module}`"]
        for name in names:
            parts += ["", f"::: ulysses_sp.{module}.{name}", "    options:", "      heading_level: 3"]
    for title, paths in EXTRA_API.items():
        parts += ["", f"## {title}"]
        for path in paths:
            parts += ["", f"::: {path}", "    options:", "      heading_level: 3"]
    return "\n".join(parts) + "\n"


def _package_summary(name: str) -> str:
    src = ROOT / "src" / "ulysses_sp"
    path = src / name / "__init__.py" if (src / name).is_dir() else src / f"{name}.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def architecture() -> str:
    """The layer table of tests/test_architecture.py (its LAYERS literal, comments included)."""
    text = (ROOT / "tests" / "test_architecture.py").read_text()
    block = re.search(r"^LAYERS = \[\n(.*?)^\]", text, re.S | re.M).group(1)
    rows = ["| layer | packages | what the layer holds (the test's comment) |", "|---|---|---|"]
    packages: list[str] = []
    for i, line in enumerate(block.strip().splitlines()):
        names, _, comment = line.partition("#")
        found = re.findall(r'"(\w+)"', names)
        packages += found
        rows.append(f"| {i} | {', '.join(f'`{n}`' for n in found)} | {comment.strip()} |")
    pkgs = ["| package | its docstring's first paragraph |", "|---|---|"]
    pkgs += [f"| `{name}` | {_package_summary(name)} |" for name in packages]
    return "\n".join(
        [
            "# Architecture",
            "",
            "Generated when the site is built, from `tests/test_architecture.py`, which enforces it: "
            "packages import one way, bottom to top (a package may import its own layer and the ones "
            "below), with no cycle; every collective lives in `parallel/comm.py`; no module uses a bare "
            "`WORLD` group; no module passes the test's line limit. The folder list is the architecture.",
            "",
            *rows,
            "",
            "## The packages",
            "",
            *pkgs,
            "",
        ]
    )

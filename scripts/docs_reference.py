"""What the site generates from the code (scripts/mkdocs_hooks.py adds it at build time): the config
keys from the config dataclasses, the plan JSON schema from ``cli/plan_schema.py``, the bench's scripts.
tests/test_docs_reference.py checks that each page covers every key and that the schema matches a
real ``ulysses-sp plan --json``.

- ``config_reference()``: ``RunConfig`` (``ulysses-sp train --config FILE`` and the flags of the same
  names) and ``TrainingConfig`` (``ulysses_sp.initialize(config=...)``, DeepSpeed-style), each key's
  type, default and docstring; for ``TrainingConfig`` which ``train`` flag sets each key, found by
  changing that flag's ``RunConfig`` field and seeing which key of ``training_config()`` moves.
- ``plan_json_reference()``: the tables of ``ulysses_sp.cli.plan_schema``.
- ``bench_scripts()``: the table of bench/*.py that replaces ``<!-- bench-scripts -->`` in
  docs/contributing/bench.md.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import pathlib
import textwrap
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent

WORLD_SIZE = 4
"""The world size the probes derive ``TrainingConfig`` at (sp 2, so dp 2)."""

PROBES: list[tuple[str, Any, dict[str, Any]]] = [
    ("micro_batch_size", 2, {}),
    ("grad_accum", 2, {}),
    ("grad_clip", 0.5, {}),
    ("zero_stage", 2, {}),
    ("zero_partition", "all", {"zero_stage": 1}),
    ("cpu_offload", True, {"zero_stage": 3}),
    ("dtype", "bf16", {}),
    ("dtype", "fp16", {}),
    ("lr", 1e-3, {}),
    ("betas", (0.8, 0.9), {}),
    ("weight_decay", 0.1, {}),
    ("steps", 1000, {}),
    ("warmup_steps", 7, {}),
    ("warmup_ratio", 0.5, {}),
    ("warmup_min_ratio", 0.2, {}),
    ("cos_min_ratio", 0.3, {}),
    ("warmup_type", "log", {}),
    ("max_nonfinite_steps", 5, {}),
]
"""``(RunConfig field, another value, other fields it needs)``: the ``train`` settings that feed
``RunConfig.training_config()``. The test changes every other field and checks it changes nothing."""

FLAG_ALIASES = {"tiled_mlp_shards": "--tiled-mlp N", "tiled_loss_shards": "--tiled-loss N"}
"""``RunConfig`` fields set by a flag of another name."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (its bases' included), whitespace joined."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                out[node.target.id] = " ".join(after.value.value.split())
    return out


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return f"`{t.replace(' | ', ' or ')}`"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "`{}`" if value == {} else "a section (the keys below)"
    return "required"


def train_flags() -> dict[str, str]:
    """``train``'s flags by destination: ``{"seq_len": "--seq-len", ...}``."""
    from ulysses_sp.cli.args import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a.option_strings[0] for a in sub.choices["train"]._actions if a.option_strings}


def flag_of(name: str, flags: dict[str, str]) -> str:
    """How ``train`` sets the ``RunConfig`` field ``name``: its flag, else its ``--config`` key."""
    if name in flags:
        return flags[name]
    return FLAG_ALIASES.get(name, f"--config {{\"{name}\": ...}}")


def run_config_rows() -> list[tuple[str, str, str, str, str]]:
    """``(key, type, default, flag, doc)`` of every ``RunConfig`` field."""
    from ulysses_sp.run.config import RunConfig

    docs, flags = field_docs(RunConfig), train_flags()
    rows = []
    for f in dataclasses.fields(RunConfig):
        flag = f"`{flags[f.name]}`" if f.name in flags else FLAG_ALIASES.get(f.name, "none: `--config` only")
        flag = f"`{flag}`" if f.name in FLAG_ALIASES else flag
        rows.append((f"`{f.name}`", _type(f), _default(f), flag, docs.get(f.name, "")))
    return rows


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def derived_keys(**changes: Any) -> dict[str, Any]:
    """``RunConfig(**changes).training_config(WORLD_SIZE)`` as flat keys (``optimizer.params.lr``)."""
    from ulysses_sp.run.config import RunConfig

    return _flatten(RunConfig(**changes).training_config(WORLD_SIZE).to_dict())


def flags_setting_keys() -> dict[str, list[str]]:
    """Which ``train`` flags move each ``TrainingConfig`` key (by ``PROBES``)."""
    flags = train_flags()
    out: dict[str, list[str]] = {}
    for name, value, needs in PROBES:
        before, after = derived_keys(**needs), derived_keys(**needs, **{name: value})
        for key in sorted(set(before) | set(after)):
            if before.get(key) != after.get(key) and flag_of(name, flags) not in out.setdefault(key, []):
                out[key].append(flag_of(name, flags))
    return out


def _setters():
    """``setters(key)``: the ``train`` flags that change ``key`` (or a key under it), or the constant
    ``train`` always writes there, or ``none``."""
    set_by, base = flags_setting_keys(), derived_keys()

    def setters(key: str) -> str:
        hits = sorted({flag for k, fl in set_by.items() if k == key or k.startswith(key + ".") for flag in fl})
        if hits:
            return ", ".join(f"`{h}`" for h in hits)
        return f"always `{base[key]!r}`" if key in base else "none"

    return setters


def training_config_rows() -> list[tuple[str, str, str, str, str]]:
    """``(key, type, default, set by, doc)`` of every ``TrainingConfig`` key, sections flattened."""
    from ulysses_sp.config import TrainingConfig
    from ulysses_sp.config.sections import OffloadConfig

    setters = _setters()

    rows = []

    def walk(cls: type, prefix: str) -> None:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            rows.append((f"`{key}`", _type(f), _default(f), setters(key), docs.get(f.name, "")))
            section = {"zero_optimization", "bf16", "fp16", "optimizer", "scheduler"}
            if prefix == "" and f.name in section:
                walk(_section_class(f.name), key + ".")
            elif f.name.startswith("offload_"):
                walk(OffloadConfig, key + ".")

    walk(TrainingConfig, "")
    return rows


def _section_class(name: str) -> type:
    from ulysses_sp.config import sections

    return {
        "zero_optimization": sections.ZeroConfig,
        "bf16": sections.BF16Config,
        "fp16": sections.FP16Config,
        "optimizer": sections.OptimizerConfig,
        "scheduler": sections.SchedulerConfig,
    }[name]


def scheduler_rows() -> list[tuple[str, str, str, str]]:
    """``(scheduler, parameter, default, set by)`` from ``config.sections.SCHEDULERS``; ``train``
    uses ``WarmupCosineLR`` alone."""
    from ulysses_sp.config.sections import SCHEDULERS

    setters = _setters()
    return [
        (
            f"`{name}`",
            f"`{p}`",
            "required" if d is None and p == "total_num_steps" else f"`{d!r}`",
            setters(f"scheduler.params.{p}") if name == "WarmupCosineLR" else "",
        )
        for name, params in SCHEDULERS.items()
        for p, d in params.items()
    ]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def config_reference() -> str:
    from ulysses_sp.cli.flags import LAUNCH_KEYS
    from ulysses_sp.config.sections import OPTIMIZERS

    flags = train_flags()
    launch = ", ".join(f"`{k}` (`{flags[k]}`)" for k in LAUNCH_KEYS)
    return "\n".join([
        "# Config keys",
        "",
        "Generated when the site is built, from the config dataclasses' fields and their docstrings "
        "(`tests/test_docs_reference.py` checks that every key is here).",
        "",
        "## `ulysses-sp train --config FILE`",
        "",
        "A JSON object whose keys are `RunConfig`'s fields (`ulysses_sp.run.config`), one per `train` "
        "flag of the same name (`seq_len` is `--seq-len`). Precedence: the defaults, then the file, then "
        f"the flags given on the command line. The launch options {launch} are accepted too; an unknown "
        "key is an error that lists the known ones. `\"auto\"` is accepted for `ring_size` and `attn_chunk`.",
        "",
        *_table(("key", "type", "default", "flag", "meaning"), run_config_rows()),
        "",
        "## `ulysses_sp.initialize(model, config=...)`",
        "",
        "The engine's `TrainingConfig` (`ulysses_sp.config`): a dict, a JSON file path or a "
        "`TrainingConfig`, with DeepSpeed's key names. Unknown keys are refused with a did-you-mean; "
        "DeepSpeed keys ulysses-sp does not implement are named as such. Of `train_batch_size`, "
        "`train_micro_batch_size_per_gpu` and `gradient_accumulation_steps` any two determine the third "
        "(`train_batch_size = micro * accumulation * dp`). `ulysses-sp train` builds this config from its "
        "flags (`RunConfig.training_config()`, AdamW and `WarmupCosineLR`); *set by* names the `train` "
        "flags that change each key (found by changing each flag and comparing the configs).",
        "",
        *_table(("key", "type", "default", "set by (train)", "meaning"), training_config_rows()),
        "",
        "`optimizer.type` is one of " + ", ".join(f"`{k}`" for k in OPTIMIZERS) + " (case-insensitive); "
        "`optimizer.params` are the torch optimizer's keyword arguments (`lr`, `betas`, `weight_decay`, "
        "...), checked against its signature. `scheduler.params` by `scheduler.type` "
        "(`config.sections.SCHEDULERS`; `warmup_max_lr` `None`: the optimizer's lr):",
        "",
        *_table(("scheduler.type", "parameter", "default", "set by (train)"), scheduler_rows()),
        "",
    ])


def plan_json_reference() -> str:
    from ulysses_sp.cli.plan_schema import SECTIONS

    parts = [
        "# `ulysses-sp plan --json`",
        "",
        "`ulysses-sp plan ... --json` prints one JSON document. Generated when the site is built, from "
        "`ulysses_sp.cli.plan_schema`; `tests/test_docs_reference.py` runs `plan --json` (and "
        "`--rehearse`) and checks every key and type of the output against these tables, both ways.",
    ]
    for title, intro, schema in SECTIONS:
        rows = [(f"`{key}`", kind, meaning) for key, (kind, meaning) in schema.items()]
        parts += ["", f"## {title}", "", intro, "", *_table(("key", "type", "meaning"), rows)]
    return "\n".join(parts) + "\n"


def _first_sentence(doc: str) -> str:
    para = " ".join(doc.split("\n\n")[0].split())
    return para.split(": ``python")[0].split(" (``python")[0]


def bench_scripts() -> str:
    """A table of bench/*.py: what each is (its docstring's first paragraph), how it runs (the first
    ``python -m bench...`` line of its docstring) and the results pages its source names."""
    import re

    rows = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        run = re.search(r"(?:PYTHONPATH=src )?python -m (?:torch\.distributed\.run [^`\n]*?)?bench[\w.]*[^`\n]*", doc)
        results = sorted(set(re.findall(r"results/(\w+)\.md", path.read_text())) | {path.stem})
        results = [r for r in results if (ROOT / "bench" / "results" / f"{r}.md").is_file()]
        rows.append((
            f"`{path.name}`",
            _first_sentence(doc),
            f"`{run.group(0).split('  #')[0].strip()}`" if run else "(imported by the others)",
            ", ".join(f"[{r}](../results/{r}.md)" for r in results),
        ))  # fmt: skip
    return "\n".join(_table(("script", "what it is", "run", "results"), rows))

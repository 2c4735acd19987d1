"""The generated reference pages say what the code does (issue 33, "Reference" and "Contributing").

- Config keys (scripts/docs_reference.py): every ``RunConfig`` field and every ``TrainingConfig``
  key, sections and scheduler parameters included, has its row; every ``train`` setting that shapes
  the engine's config is probed for the *set by* column, and no other setting changes it.
- ``plan --json`` (``cli/plan_schema.py``): real output of several runs (a dense preset, eight
  GPUs with host states, a hybrid, ``--rehearse``) has exactly the documented keys, with the
  documented types, and every documented key is printed by one of them.
- Errors (docs/reference/errors.md): every quoted message is a literal part of a string in src/.
- Contributing pages: every repository path and ``tests/FILE.py::test`` they name exists.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import sys

import pytest
from docs_pages import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import docs_reference  # noqa: E402

from ulysses_sp.cli import plan_schema  # noqa: E402
from ulysses_sp.cli.main import main  # noqa: E402


# ---------------------------------------------------------------- config keys
def _training_config_keys(cls: type, prefix: str = "") -> list[str]:
    from ulysses_sp.config.sections import OffloadConfig

    keys = []
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        if prefix == "" and f.name in ("zero_optimization", "bf16", "fp16", "optimizer", "scheduler"):
            keys += _training_config_keys(docs_reference._section_class(f.name), f"{f.name}.")
        elif f.name.startswith("offload_"):
            keys += _training_config_keys(OffloadConfig, f"{prefix}{f.name}.")
    return keys


def test_the_config_page_has_a_row_per_key():
    from ulysses_sp.config import TrainingConfig
    from ulysses_sp.config.sections import SCHEDULERS
    from ulysses_sp.run.config import RunConfig

    page = docs_reference.config_reference()
    rows = set(re.findall(r"^\| `([^`]+)` \|", page, re.M))
    run_keys = {f.name for f in dataclasses.fields(RunConfig)}
    engine_keys = set(_training_config_keys(TrainingConfig))
    assert len(run_keys) > 50 and {"zero_optimization.offload_param.device", "fp16.hysteresis"} <= engine_keys
    assert run_keys | engine_keys <= rows, sorted((run_keys | engine_keys) - rows)
    for name, params in SCHEDULERS.items():
        for p in params:
            assert f"| `{name}` | `{p}` |" in page
    docs = docs_reference.field_docs(RunConfig)
    assert set(docs) == run_keys, sorted(run_keys - set(docs))  # every field has its docstring
    assert "| `zero_optimization.stage` | `int` | `0` | `--zero-stage` |" in page
    assert "| `seq_len` | `int` | `256` | `--seq-len` |" in page


def test_the_set_by_column_probes_every_setting_that_shapes_the_engine_config():
    """Each probe moves some key; every other ``train`` setting (bools and numbers) moves none, so a
    new setting feeding ``training_config()`` cannot be missing from the page's *set by*."""
    from ulysses_sp.run.config import RunConfig

    base = docs_reference.derived_keys()
    for name, value, needs in docs_reference.PROBES:
        assert docs_reference.derived_keys(**needs, **{name: value}) != docs_reference.derived_keys(**needs), name
    probed = {name for name, _, _ in docs_reference.PROBES}
    checked = []
    for f in dataclasses.fields(RunConfig):
        if f.name in probed or f.default is dataclasses.MISSING:
            continue
        if isinstance(f.default, bool):
            value = not f.default
        elif isinstance(f.default, (int, float)):
            value = f.default + 1
        elif f.default is None and "int" in str(f.type):
            value = 3
        else:
            continue
        checked.append(f.name)
        assert docs_reference.derived_keys(**{f.name: value}) == base, f"{f.name} shapes TrainingConfig: add a probe"
    assert {"seq_len", "sp", "tiled_mlp", "head_chunks", "ring_size"} <= set(checked)


# ---------------------------------------------------------------- plan --json
_TYPES = {"int": int, "float": (float, int), "bool": bool, "str": str, "list": list, "dict": dict, "null": type(None)}


def _check(obj: dict, schema: dict, where: str, seen: set[str]) -> None:
    extra = set(obj) - set(schema)
    assert not extra, f"{where}: keys not in cli/plan_schema.py: {sorted(extra)}"
    for key, value in obj.items():
        kinds = tuple(_TYPES[t] for t in schema[key][0].split(" or "))
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        assert ok, f"{where}.{key}: {value!r} is not {schema[key][0]}"
        seen.add(key)


@pytest.fixture(scope="module")
def plan_docs(tmp_path_factory):
    from transformers import Qwen3_5TextConfig

    sys.path.insert(0, str(ROOT))
    from bench.plan_check import _COMMON, HYBRIDS

    tmp = tmp_path_factory.mktemp("plan")
    Qwen3_5TextConfig(**_COMMON, **HYBRIDS["tiny-qwen3.5"][1]).save_pretrained(tmp)
    cpu = ["--device", "cpu", "--memory", "2GB"]
    runs = [
        ["--model", "tiny-llama", *cpu, "--gpus", "2", "--max"],  # --max: head_chunks rows
        ["--model", "tiny-llama", "--gpus", "8", "--dtype", "bf16", "--offload-states", "--gpu-memory", "1GB"],
        ["--model", str(tmp / "config.json"), *cpu, "--gpus", "4", "--seq-len", "4096"],
        ["--model", "tiny-llama", *cpu, "--gpus", "2", "--seq-len", "2048", "--rehearse"],
    ]
    out = []
    for args in runs:
        capture = tmp / "out.json"
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main(["plan", *args, "--json"])
        capture.write_text(buf.getvalue())
        out.append(json.loads(buf.getvalue()))
    return out


def test_plan_json_has_exactly_the_documented_keys_and_types(plan_docs):
    seen: dict[str, set[str]] = {name: set() for name in ("doc", "cand", "set", "break", "layer", "reh", "rehd")}
    for doc in plan_docs:
        _check(doc, plan_schema.DOCUMENT, "document", seen["doc"])
        for i, c in enumerate(doc["candidates"] + ([doc["recommended"]] if doc["recommended"] else [])):
            _check(c, plan_schema.CANDIDATE, f"candidates[{i}]", seen["cand"])
            _check(c["settings"], plan_schema.SETTINGS, f"candidates[{i}].settings", seen["set"])
            _check(c["breakdown"], plan_schema.BREAKDOWN, f"candidates[{i}].breakdown", seen["break"])
            assert sum(c["breakdown"].values()) == c["peak_bytes_per_rank"]
        for layer in doc["layers"]:
            _check(layer, plan_schema.LAYER, "layers[]", seen["layer"])
        if "rehearsal" in doc:
            _check(doc["rehearsal"], plan_schema.REHEARSAL, "rehearsal", seen["reh"])
            _check(doc["rehearsal"]["rehearsal"], plan_schema.REHEARSED, "rehearsal.rehearsal", seen["rehd"])
    # every documented key printed by one of the runs; `attn` needs a model sdpa cannot build (gpt-oss)
    for name, schema in [("doc", plan_schema.DOCUMENT), ("cand", plan_schema.CANDIDATE),
                         ("set", plan_schema.SETTINGS), ("break", plan_schema.BREAKDOWN),
                         ("layer", plan_schema.LAYER), ("reh", plan_schema.REHEARSAL),
                         ("rehd", plan_schema.REHEARSED)]:  # fmt: skip
        missing = set(schema) - seen[name] - {"attn"}
        assert not missing, f"documented but never printed ({name}): {sorted(missing)}"


def test_plan_rehearse_json_gives_the_recommended_commands_verdict(plan_docs):
    """``plan --seq-len 2048 --rehearse --json`` (the last plan run): the rehearsal of its recommended command
    fits, and its first probe is the asked length."""
    rehearsal = plan_docs[-1]["rehearsal"]
    assert rehearsal["rehearsal"]["fits"] and rehearsal["probes"][0][:2] == [2048, True]


def test_the_plan_page_shows_every_section():
    page = docs_reference.plan_json_reference()
    for _, _, schema in plan_schema.SECTIONS:
        for key in schema:
            assert f"| `{key}` |" in page


# ---------------------------------------------------------------- errors
def _literal(node: ast.AST) -> str | None:
    """A string expression's text, ``…`` for each value filled in (f-strings, ``+`` chains)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left), _literal(node.right)
        if left is not None or right is not None:
            return (left or "…") + (right or "…")
    return None


def _source_strings() -> list[str]:
    out = []
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            text = _literal(node)
            if text and len(text) > 20:
                out.append(text)
    return out


def _quoted_messages() -> list[str]:
    text = (ROOT / "docs" / "reference" / "errors.md").read_text(encoding="utf-8")
    return re.findall(r"^\| `([^`]+)` \|", text, re.M)


def _raised(message: str, strings: list[str]) -> bool:
    pieces = [p for p in message.split("…") if p]
    for s in strings:
        at = 0
        for piece in pieces:
            at = s.find(piece, at)
            if at < 0:
                break
            at += len(piece)
        else:
            return True
    return False


def test_every_message_on_the_errors_page_is_in_the_code():
    messages, strings = _quoted_messages(), _source_strings()
    assert len(messages) >= 40
    missing = [m for m in messages if not _raised(m, strings)]
    assert not missing, "errors.md quotes messages src/ no longer has:\n" + "\n".join(missing)


def test_the_errors_check_sees_a_reworded_message():
    strings = _source_strings()
    assert _raised("--cpu-offload needs --zero-stage 3 (got …)", strings)
    assert not _raised("--cpu-offload requires --zero-stage 3 (got …)", strings)
    assert not _raised("got …)--cpu-offload needs --zero-stage 3 (", strings)  # pieces in order


# ---------------------------------------------------------------- contributing pages
@pytest.mark.parametrize("page", ["testing.md", "bench.md"])
def test_the_contributing_pages_name_what_exists(page):
    text = (ROOT / "docs" / "contributing" / page).read_text(encoding="utf-8")
    paths = set(re.findall(r"\b((?:tests|bench|scripts|src/ulysses_sp)/[\w/.-]+\.(?:py|sh|md))\b", text))
    assert len(paths) >= 5, paths
    assert not [p for p in paths if not (ROOT / p).is_file()], sorted(p for p in paths if not (ROOT / p).is_file())
    for path, test in re.findall(r"\b(tests/\w+\.py)::(\w+)", text):
        assert re.search(rf"^\s*def {test}\(", (ROOT / path).read_text(), re.M), f"{path} has no {test}"


# ---------------------------------------------------------------- the planner's fit script
def _short_conv_fit() -> dict:
    import fit_mixer_terms

    rows = [fit_mixer_terms.measure("short_conv", cls, kw) for cls, kw in fit_mixer_terms.GRIDS["short_conv"][::2]]
    return fit_mixer_terms.fit("short_conv", rows)  # 3 of its 5 sizes: one monomial


def test_the_mixer_fit_script_reproduces_the_planners_coefficients(pool):
    """scripts/fit_mixer_terms.py (the contributing page "The bench" names it): its short-convolution
    fit, measured now, gives the coefficients ``plan.mixers`` holds."""
    from ulysses_sp.plan.inputs import MixerShape
    from ulysses_sp.plan.mixers import FP32, memory_per_token

    saved, workspace = (b / FP32 for b in memory_per_token(MixerShape(kind="short_conv", channels=1), 1))
    got = pool.run(_short_conv_fit, 1)[0]
    assert got["saved"]["coefficients"]["C"] == pytest.approx(saved, rel=0.03), got
    assert got["workspace"]["coefficients"]["C"] == pytest.approx(workspace, rel=0.10), got
    assert got["saved"]["fit_error"] < 0.01 and got["saved"]["code_error"] < 0.03, got

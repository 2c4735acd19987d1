"""The facts the README and the site state, read from their one source each.

Nothing here is typed by hand twice: the model verdicts come from the sweep's results page
(`bench/results/model_sweep.md`, written by `python -m bench.model_sweep`), the VLM list from
`ulysses_sp.vlm.SUPPORTED_VLMS`, the headline numbers from the results page of the run that
measured them, the version and requirements from `pyproject.toml`. A results page whose table no
longer has the expected rows or columns makes the build fail here (KeyError / ValueError), so a
number cannot silently go stale. Used by `scripts/build_readme.py` and the site's hooks.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def pyproject() -> dict:
    """``version`` and ``dependencies`` of pyproject.toml's [project] table (read without tomllib,
    which Python 3.10, the oldest supported, lacks)."""
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    deps = re.search(r"^dependencies = \[(.*?)^\]", project, re.S | re.M).group(1)
    return {
        "version": re.search(r'^version = "([^"]+)"', project, re.M).group(1),
        "dependencies": re.findall(r'^\s*"([^"]+)"', deps, re.M),
    }


def requirement(name: str) -> str:
    """``torch>=2.13`` as pyproject.toml's dependencies state it."""
    for dep in pyproject()["dependencies"]:
        if re.match(rf"{re.escape(name)}\b", dep):
            return dep.split(";")[0].strip()
    raise KeyError(f"{name} is not a dependency in pyproject.toml")


def read_table(path: pathlib.Path, index: int = 0) -> list[dict[str, str]]:
    """The ``index``-th markdown table of ``path`` as rows keyed by header (``\\|`` kept in cells)."""
    tables, current = [], []
    for line in path.read_text().splitlines() + [""]:
        if line.lstrip().startswith("|"):
            current.append(line.strip())
        elif current:
            tables.append(current)
            current = []
    lines = tables[index]
    cells = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    header, seen = [], {}
    for name in cells[0]:  # a repeated header ("vs real" after each estimate) gets " 2", " 3"
        seen[name] = seen.get(name, 0) + 1
        header.append(name if seen[name] == 1 else f"{name} {seen[name]}")
    return [dict(zip(header, row)) for row in cells[2:]]


def provenance(path: pathlib.Path) -> str:
    """The run id a results page names in its header (``2026-11-27T09:46Z@bb26175``)."""
    m = re.search(r"Produced by run `([^`]+)`", path.read_text())
    if not m:
        raise ValueError(f"{path}: no 'Produced by run' header")
    return m.group(1)


def sweep() -> dict[str, dict[str, str]]:
    """``model_type`` -> its sweep row."""
    return {row["family"]: row for row in read_table(RESULTS / "model_sweep.md")}


def sweep_versions() -> dict[str, str]:
    """The torch and transformers versions the sweep ran with (its provenance header)."""
    text = (RESULTS / "model_sweep.md").read_text()
    torch_v = re.search(r"torch ([\w.+]+)", text).group(1)
    tf_v = re.search(r"transformers (\d[\w.]*\d)", text).group(1)
    return {"torch": torch_v, "transformers": tf_v}


def _skipped(n: int) -> str:
    """The sweep's skipped families, as a clause: none, or how many and why (a tiny config that does not run)."""
    return f", {n} skipped (untested: no tiny config of theirs runs here)" if n else ", none skipped"


def sweep_counts() -> dict[str, int]:
    counts = {"families": 0}
    for row in sweep().values():
        verdict = row["verdict"].split()[0]
        counts[verdict] = counts.get(verdict, 0) + 1
        counts["families"] += 1
    for key in ("exact", "refused", "skipped", "crash", "wrong"):
        counts.setdefault(key, 0)
    return counts


# The sp limit of each kind of token mixer (docs/readme/attention.md, hybrid.md): what the SP size
# must divide, and whether the hybrid Ulysses x Ring layout applies.
_ATTN = "heads % sp = 0, or a ring"
LIMITS = {
    "attention": _ATTN,
    "moe": _ATTN + "; no MoE aux loss",
    "mamba2": "Mamba heads % sp = 0; no ring",
    "mamba1": "`intermediate_size` % sp = 0; no ring",
    "mamba1_heads": "channels per Mamba head % sp = 0; no ring",
    "conv": "conv channels % sp = 0; no ring",
    "gdn": "value heads % sp = 0; no ring",
    "vlm": _ATTN + "; images encoded whole",
    "vlm_scatter": "heads % sp = 0 (a ring: untested); images encoded whole",
    "vlm_spans": "heads % sp = 0; no ring; no flash (image blocks bidirectional); images encoded whole",
    "dsa": "heads % sp = 0; cores sdpa/eager; no ring",
    "own": "heads % sp = 0; no ring; O(S²/sp) scores (its own eager attention)",
    "vlm_prefix": "heads % sp = 0; no ring; O(S²/sp) scores (its own eager attention); image encoded whole",
    "pair": "heads % sp = 0; no ring; O(L²/sp) bias and scores per document (its own)",
    "rnn": "channels % sp = 0; no ring",
    "lightning": "lightning and attention heads % sp = 0; no ring",
    "mlstm": "heads % sp = 0; no ring",
    "pooled": "heads % sp = 0; no ring; no packed rows",
}

# (family as users name it, the sweep's model_type(s), mixer kind). The verdicts are the sweep's.
FAMILIES = [
    ("Llama 3.x", ["llama"], "attention"),
    ("Llama 4 (text)", ["llama4_text"], "moe"),
    ("Qwen2 / Qwen2.5", ["qwen2"], "attention"),
    ("Qwen3", ["qwen3"], "attention"),
    ("Qwen3-MoE", ["qwen3_moe"], "moe"),
    ("Qwen3-Next", ["qwen3_next"], "gdn"),
    ("Qwen3.5 (text, dense and MoE)", ["qwen3_5_text", "qwen3_5_moe_text"], "gdn"),
    ("Ling 3 (Bailing hybrid, KDA)", ["bailing_hybrid"], "gdn"),
    ("Mistral", ["mistral"], "attention"),
    ("Mixtral", ["mixtral"], "moe"),
    ("Gemma 2", ["gemma2"], "attention"),
    ("Gemma 3 (text)", ["gemma3_text"], "attention"),
    ("Gemma 4 (text)", ["gemma4_text"], "attention"),
    ("gpt-oss", ["gpt_oss"], "moe"),
    ("DeepSeek-V2", ["deepseek_v2"], "moe"),
    ("DeepSeek-V3", ["deepseek_v3"], "moe"),
    ("Phi-3", ["phi3"], "attention"),
    ("OLMo 2", ["olmo2"], "attention"),
    ("Granite-4 hybrid", ["granitemoehybrid"], "mamba2"),
    ("Nemotron-H", ["nemotron_h"], "mamba2"),
    ("Falcon-H1", ["falcon_h1"], "mamba2"),
    ("LFM2", ["lfm2"], "conv"),
    ("Jamba", ["jamba"], "mamba1"),
    ("Mamba / Falcon-Mamba", ["mamba", "falcon_mamba"], "mamba1"),
    ("Zamba", ["zamba"], "mamba1_heads"),
    ("OPT / BioGPT", ["opt", "biogpt"], "attention"),
    ("DeepSeek-V3.2 / GLM-5 (sparse attention)", ["deepseek_v32", "glm_moe_dsa"], "dsa"),
    ("Qwen4-Exp (block-sparse attention)", ["qwen4_exp_text"], "dsa"),
    ("DeepSeek-V4 (pooled K/V)", ["deepseek_v4"], "pooled"),
    ("BLOOM / Falcon / MPT / GPT-Neo", ["bloom", "falcon", "mpt", "gpt_neo"], "own"),
    ("Doge", ["doge"], "own"),
    ("Inkling / Inkling-2 / Inkling-2 Loop (text)", ["inkling_text", "inkling2_text", "inkling2_loop_text"], "pair"),
    ("RecurrentGemma / RWKV", ["recurrent_gemma", "rwkv"], "rnn"),
    ("MiniMax (lightning attention)", ["minimax"], "lightning"),
    ("xLSTM", ["xlstm"], "mlstm"),
    ("Phi-MoE", ["phimoe"], "moe"),
]
VLM_NAMES = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL"}
VLM_LIMITS = {"gemma3": "vlm_spans", "shieldgemma2": "vlm_spans", "git": "vlm_prefix"}
"""VLM families whose sp limit is not ``LIMITS["vlm"]`` (Gemma 3: its image blocks, ``attention/span_mask.py``)."""


def _verdict(rows: list[dict[str, str]], column: str) -> str:
    values = {row[column] for row in rows}
    return values.pop() if len(values) == 1 else " / ".join(row[column] for row in rows)


def models_table() -> str:
    """The README's supported-models table: ~20 popular families, verdicts from the sweep."""
    from ulysses_sp.vlm import SUPPORTED_VLMS
    from ulysses_sp.vlm.families import QWEN_VLMS

    rows = sweep()
    out = [
        "| family | `model_type` | at sp 2 vs no SP | packed documents | sp limits | paths |",
        "|---|---|---|---|---|---|",
    ]
    for name, types, kind in FAMILIES:
        found = [rows[t] for t in types]  # KeyError: the sweep no longer lists it
        verdict = _verdict(found, "verdict")
        packed = _verdict(found, "packed sp 2")
        paths = "CLI · Trainer · library" if verdict == "exact" else "—"
        code = ", ".join(f"`{t}`" for t in types)
        out.append(f"| {name} | {code} | **{verdict}** | {packed} | {LIMITS[kind]} | {paths} |")
    for model_type in SUPPORTED_VLMS:
        name = VLM_NAMES.get(model_type, model_type)
        out.append(
            f"| {name} | `{model_type}` | **exact** (VLM tests) | — | {LIMITS[VLM_LIMITS.get(model_type, 'vlm' if model_type in QWEN_VLMS else 'vlm_scatter')]} | "
            + ("CLI · Trainer · library |" if model_type in QWEN_VLMS else "library (the CLI reads Qwen's images only) |")
        )
    return "\n".join(out)


def _number(text: str) -> float:
    return float(re.sub(r"[^\d.]", "", text))


def headline() -> list[tuple[str, str]]:
    """Four numbers, each with the results page that holds its run: ``(sentence, page name)``."""
    c = sweep_counts()
    items = [
        (
            f"**{c['exact']} of {c['families']}** decoder-only model families of transformers "
            f"{sweep_versions()['transformers']} exact at sp 2 (per-position logits and every gradient "
            f"against the same model without SP, fp32), **{c['wrong']} wrong**, {c['refused']} refused "
            f"by name before the first step{_skipped(c['skipped'])} (CPU, 2 gloo ranks)",
            "model_sweep.md",
        )
    ]
    gpu = [r for r in read_table(RESULTS / "gpu_rehearsal.md") if "H200" not in r["tokens"]]
    ratios = [_number(r["vs real"]) for r in gpu]
    tokens = [int(_number(r["tokens"])) for r in gpu]
    items.append(
        (
            f"**{min(ratios):.3f}–{max(ratios):.3f}** of a real H100 step's peak memory: what "
            f"`train --rehearse` (fake tensors) predicts for a 1.2B Llama at {min(tokens) // 1024}K–"
            f"{max(tokens) // 1024}K tokens, bf16, ZeRO 3, one GPU",
            "gpu_rehearsal.md",
        )
    )
    fit = {(r["data"], r["system"]): r for r in read_table(RESULTS / "longest_fit.md")}
    causal = fit["causal", "ulysses-sp, all techniques"]["vs DeepSpeed"]
    packed = fit["packed", "ulysses-sp, all techniques"]["vs DeepSpeed"]
    items.append(
        (
            f"**{causal.replace('x', '×')} causal, {packed.replace('x', '×')} packed documents**: the "
            "longest sequence in one memory budget against DeepSpeed Ulysses/ALST, all techniques on "
            "(CPU, a tiny Llama, sp 2, the same meter on both sides; DeepSpeed's own causal fit varies by one "
            "512-token step between runs, see Performance)",
            "longest_fit.md",
        )
    )
    one = next(r for r in read_table(RESULTS / "scale_table.md") if r["GPUs"] == "1")
    eight = [r for r in _scale_rows() if r["GPUs"] == "8" and "disk_layers" in r.get("settings changed", "")
             and next(v for k, v in r.items() if k.startswith("verdict")) == "fits"]  # fmt: skip
    on_eight = (f"; **{eight[0]['tokens']} on eight** in a 2 TB node, the first "
                f"{eight[0]['settings changed'].split('disk_layers ')[1].split(',')[0]} layers' inputs on its NVMe" if eight else "")  # fmt: skip
    items.append(
        (
            f"**{one['tokens']} tokens** of {one['model']} rehearsed to fit one 80 GB GPU "
            f"({one['rehearsed peak GiB']} GiB peak, {one.get('verdict (80 GB, 6 GB reserve, 2 TB host)') or one['verdict (80 GB, 6 GB reserve, 2 TiB host)']}): "
            "every ALST technique, model states on the host"
            + (f", the attention block in {one['head groups']} head groups" if one.get("head groups", "1") != "1" else "")
            + on_eight + " — rehearsals on fake tensors, not yet runs",
            "scale_table.md",
        )
    )
    return items


def _scale_rows() -> list[dict[str, str]]:
    """Every row of every table on the scale table's page."""
    text = (RESULTS / "scale_table.md").read_text()
    count = sum(1 for block in re.split(r"\n\s*\n", text) if block.lstrip().startswith("|"))
    return [r for i in range(count) for r in read_table(RESULTS / "scale_table.md", i)]

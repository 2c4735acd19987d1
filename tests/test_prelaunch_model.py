"""Every model-dependent refusal of ``train`` comes from the launching process (``run.model_checks``):
before any worker starts, once, on one line, exit 2 — not once per rank after the launch (issue 32).

The model is built on the meta device in the launcher and asked what the ranks would ask it: the
attention implementation it builds with, the techniques' targets (tiled MLP, norm recompute), the SP
attention (head groups, sinks, sparse attention kinds), the closed-world guard and the mixers' heads.
In-process (``main`` with the launcher replaced by a failure): no worker, no training.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a top-level folder of the repository, not an installed package
    sys.path.insert(0, str(ROOT))

from family_models import COMMON, FAMILIES  # noqa: E402
from hybrid_models import hybrid_config  # noqa: E402

from bench.model_sweep import tiny_config  # noqa: E402
from ulysses_sp.cli import main as cli  # noqa: E402
from ulysses_sp.run.model_checks import one_line  # noqa: E402

VOCAB = 264  # room for the byte tokenizer saved beside each model (259 tokens)


def save_model_dir(path: Path, config, *, weights: bool = True) -> str:
    """``config``'s model (random weights) and the byte tokenizer saved at ``path``."""
    from transformers import AutoModelForCausalLM

    from ulysses_sp.tasks import byte_tokenizer

    config.vocab_size = VOCAB
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= VOCAB:
            setattr(config, key, 0)
    if weights:
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def _configs():
    from transformers import AutoConfig

    qwen35 = tiny_config("qwen3_5_text")
    qwen35.linear_num_key_heads, qwen35.linear_num_value_heads = 3, 6  # key heads: neither divide 2 nor a multiple
    return {
        "gpt_oss": AutoConfig.for_model("gpt_oss", **{**COMMON, **FAMILIES["gpt_oss"], "num_key_value_heads": 2}),
        "nemotron_h": hybrid_config("nemotron_h", mamba_heads=3, groups=1),  # 3 Mamba heads
        "qwen3_5": qwen35,
        "gpt_neox": tiny_config("gpt_neox"),
        "deepseek_v32": tiny_config("deepseek_v32"),
        "minimax": tiny_config("minimax"),
        "doge": _doge_moe(),
        "llama": AutoConfig.for_model("llama", **COMMON),
    }


def _doge_moe():
    """Doge with its MoE MLP (``is_moe``): the router pairs each token with others of the row (refused)."""
    config = tiny_config("doge")
    config.is_moe, config.num_experts = True, 16
    return config


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    dirs = {name: save_model_dir(root / name, config) for name, config in _configs().items()}
    dirs["no_weights"] = save_model_dir(root / "no_weights", _configs()["llama"], weights=False)
    return dirs


CASES = [  # (model, extra flags, what the one line says)
    ("gpt_oss", [], r"--attn sdpa: transformers cannot build .*GptOssForCausalLM does not support .*--attn eager"),
    ("llama", ["--head-chunks", "4"], r"--head-chunks 4: head_chunks 4: each rank's 2 query heads .* valid head_chunks"),
    ("nemotron_h", [], r"--sp 2: sequence parallelism cannot shard these mixers: .*NemotronHMamba2Mixer \(3 heads"),
    ("qwen3_5", [], r"--sp 2: sequence parallelism cannot shard these mixers: .*Qwen3_5GatedDeltaNet .*3 key heads"),
    ("gpt_neox", ["--recompute-norms"], r"--recompute-norms: GPTNeoXForCausalLM has no RMSNorm-like module"),
    ("deepseek_v32", ["--ring-size", "2"], r"'indexed_attention' layers attend to each query's top .* ring_size 2"),
    ("doge", [], r"sequence parallelism \(sp_size 2\) cannot train DogeForCausalLM exactly: .* layer 0: mlp \(DogeCDMoE\)"),
    ("no_weights", [], r"has a config.json but no weight file"),
    ("gpt_oss", ["--attn", "eager", "--tiled-mlp"], r"--tiled-mlp: cannot tile .*GptOssTopKRouter"),
]  # fmt: skip


@pytest.mark.parametrize("model, extra, expected", CASES, ids=[f"{m}{''.join(e)}" for m, e, _ in CASES])
def test_a_model_dependent_refusal_comes_from_the_launcher_once_on_one_line(
    models, model, extra, expected, tmp_path, capsys, monkeypatch
):
    def launched(*args, **kwargs):
        raise AssertionError("the workers were started")

    monkeypatch.setattr(cli, "_launch", launched)
    monkeypatch.setattr(cli, "_run_rank", launched)
    argv = ["train", "--model", models[model], "--seq-len", "32", "--steps", "1", "--sp", "2", "--no-progress",
            "--output-dir", str(tmp_path / "out"), *extra]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ulysses-sp")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("ulysses-sp train: error: ")
    assert "Traceback" not in lines[0]
    import re

    assert re.search(expected, lines[0]), lines[0]


def test_the_same_models_pass_with_the_settings_the_messages_name(models, tmp_path, monkeypatch):
    """The fix each message names is accepted before launch (the launcher is reached)."""
    reached = []
    monkeypatch.setattr(cli, "_launch", lambda *a, **k: reached.append(a[2]))
    # gpt-oss's sinks under head groups: the whole attention block per group cuts them (once refused); MiniMax at
    # sp 2: its lightning attention sharded by head (once refused)
    for model, extra in [("gpt_oss", ["--attn", "eager", "--head-chunks", "2"]), ("llama", ["--head-chunks", "2"]),
                         ("nemotron_h", ["--sp", "1"]), ("gpt_neox", []), ("doge", ["--sp", "1"]),
                         ("minimax", [])]:  # fmt: skip
        cli.main(["train", "--model", models[model], "--seq-len", "32", "--steps", "1", "--sp", "2", "--nproc", "2",
                  "--no-progress", "--output-dir", str(tmp_path / model), *extra])  # fmt: skip
    assert reached == [2] * 6


def test_one_line_joins_a_guard_list():
    assert one_line("cannot train X exactly:\n  layer 0: a\n  layer 1: b\nTrain it with sp 1") == (
        "cannot train X exactly: layer 0: a; layer 1: b; Train it with sp 1"
    )


def test_packed_documents_at_sp_1_are_refused_where_a_module_mixes_the_whole_row(models, tmp_path, capsys, monkeypatch):
    """Doge's MoE router pairs each token with others of the row (transformers' own reshape of the logits):
    at sp 1 packed documents would leak into each other (the guard refuses it at sp > 1). Refused before launch
    naming the module; --packing none passes."""
    import json

    reached = []
    monkeypatch.setattr(cli, "_launch", lambda *a, **k: reached.append(a[2]))
    monkeypatch.setattr(cli, "_run_rank", lambda *a, **k: reached.append(1))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc {i} " * (1 + i % 3)}) + "\n" for i in range(40)))
    argv = ["train", "--model", models["doge"], "--data", str(data), "--seq-len", "64", "--steps", "1", "--sp", "1",
            "--nproc", "1", "--no-progress"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--packing", "best-fit", "--output-dir", str(tmp_path / "packed")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert ("--packing best-fit: packed documents cannot be kept apart in DogeForCausalLM: these modules mix tokens "
            "across the whole row") in err and "mlp (DogeCDMoE)" in err and "--packing none" in err
    cli.main([*argv, "--packing", "none", "--output-dir", str(tmp_path / "one")])
    assert reached == [1]

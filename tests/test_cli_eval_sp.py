"""``ulysses-sp eval`` is ``train``'s forward: ``eval --sp 2`` equals ``eval --sp 1`` at every position,
over the same sequences, on packed documents — for hybrids (Mamba-2 mixers: Bamba, Nemotron-H,
Falcon-H1; short convolutions: LFM2; gated delta-net: Qwen3-Next; sharded by the mixer handlers
``train`` applies) and a plain model (Llama) — and a family the closed-world guard refuses (Jamba) is
refused with ``train``'s message.

One launch per layout for every model (``--model`` takes several): sp 1 in this process, sp 2 in two
processes with another micro-batch (each sample is still scored once: the held-out set is smaller than
one sp-2 round and is not refused).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hybrid_models import hybrid_config
from test_cli import cli

from ulysses_sp.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a top-level folder of the repository, not an installed package
    sys.path.insert(0, str(ROOT))

MODELS = ("bamba", "nemotron_h", "falcon_h1", "lfm2", "qwen3_next", "tiny-llama")


def _config(family: str):
    """A tiny config of ``family`` with the byte tokenizer's 259 ids."""
    if family == "qwen3_next":
        from bench.model_sweep import tiny_config

        config = tiny_config(family)
        config.vocab_size = 259
        return config
    return hybrid_config(family, vocab=259)


def _docs(path, n: int = 24) -> str:
    g = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(n):
        length = int(torch.randint(10, 40, (1,), generator=g))
        text = "".join("abcdefgh "[i] for i in torch.randint(0, 9, (length,), generator=g))
        lines.append(json.dumps({"text": text}) + "\n")
    path.write_text("".join(lines))
    return str(path)


def _save(config, path) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # large enough that a position run on the wrong tokens shows
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def evals(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-sp")
    models = [_save(_config(f), root / f) for f in MODELS[:-1]] + [MODELS[-1]]  # the last: a preset
    common = ["--data", _docs(root / "docs.jsonl"), "--packing", "best-fit", "--eval-split", "0.5",
              "--seq-len", "64", "--plot", "none", "--data-cache", str(root / "cache"), "--tokenizer", "byte"]  # fmt: skip
    main(["eval", "--model", *models, "--sp", "1", "--nproc", "1", "--micro-batch-size", "1",
          "--output-json", str(root / "sp1.json"), *common])  # fmt: skip
    cli("eval", "--model", *models, "--sp", "2", "--nproc", "2", "--micro-batch-size", "3", "--timeout", "120",
        "--output-json", str(root / "sp2.json"), *common)  # fmt: skip
    one, two = (json.loads((root / f"sp{sp}.json").read_text())["results"] for sp in (1, 2))
    return root, common, one, two


@pytest.mark.parametrize("index", range(len(MODELS)), ids=MODELS)
def test_eval_at_sp2_equals_sp1_per_position_on_packed_documents(evals, index):
    _, _, one, two = evals
    a, b = one[index], two[index]
    assert (a["sp"], b["sp"]) == (1, 2)
    # the same sequences: every held-out block scored once (4 blocks of 64 tokens, fewer than one
    # sp-2 round of 3 per rank), whatever the layout and the micro-batch
    assert a["tokens"] == b["tokens"] > 3 * 64
    assert [x["tokens"] for x in a["per_position"]] == [x["tokens"] for x in b["per_position"]]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    for x, y in zip(a["per_position"], b["per_position"]):
        assert (x["loss"] is None) == (y["loss"] is None)
        if x["loss"] is not None:
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x["start"], x["loss"], y["loss"])


def test_eval_at_sp2_refuses_a_family_the_guard_refuses_with_trains_message(evals, capsys):
    import transformers as tf

    from bench.model_sweep import tiny_config
    from ulysses_sp.mixers.guard import check_sequence_mixing

    root, common, _, _ = evals
    config = tiny_config("doge")  # its MoE router pairs each token with others of the row: refused at sp > 1
    config.is_moe, config.num_experts = True, 16
    config.vocab_size = 259
    doge = _save(config, root / "doge")
    with pytest.raises(ValueError) as refused:  # what train's initialize() raises on its ranks
        check_sequence_mixing(tf.AutoModelForCausalLM.from_config(config), sp_size=2)
    message = str(refused.value)
    assert "layer 0: mlp (DogeCDMoE) mixes tokens along the sequence" in message
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_code:  # refused in the launching process: no worker starts
        main(["eval", "--model", doge, "--sp", "2", "--output-json", str(root / "doge.json"), *common])
    assert exit_code.value.code == 2
    assert capsys.readouterr().err.count(message) == 1
    assert not (root / "doge.json").exists()

"""A local model directory is checked before any worker starts, each error naming its file.

In-process (no group): ``state.model_dir.check_model_dir`` through the run-level check
(``run.checks.model_config``) on a tiny sharded Llama, broken one way per test; and the meta-device
construction of ``state.loading.init_empty_model`` (buffers equal ``from_pretrained``'s, also when a
model's ``_init_weights`` does not compute them, through the fallback).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from ulysses_sp.run.checks import model_config
from ulysses_sp.state.loading import init_empty_model
from ulysses_sp.state.model_dir import check_model_dir


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A tiny Llama saved as 3+ shards with an index (fp32)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    path = str(tmp_path_factory.mktemp("model"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, max_shard_size="20KB")
    return path


def _copy(saved: str, tmp_path) -> str:
    import shutil

    return shutil.copytree(saved, str(tmp_path / "m"))


def _edit_json(file: str, **changes) -> None:
    with open(file) as f:
        data = json.load(f)
    data.update(changes)
    with open(file, "w") as f:
        json.dump(data, f)


def _shards(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def test_a_good_directory_passes_and_returns_its_config(saved):
    assert len(_shards(saved)) >= 3
    assert model_config(saved, 64).num_hidden_layers == 2


def test_broken_config_json_is_named(saved, tmp_path):
    d = _copy(saved, tmp_path)
    with open(os.path.join(d, "config.json"), "a") as f:
        f.write("}")
    with pytest.raises(ValueError, match=r"m/config.json: the model config is not valid JSON"):
        model_config(d, 64)


def test_zero_heads_is_named(saved, tmp_path):
    d = _copy(saved, tmp_path)
    _edit_json(os.path.join(d, "config.json"), num_attention_heads=0)
    with pytest.raises(ValueError, match=r"config.json: num_attention_heads = 0: must be positive integers"):
        model_config(d, 64)


def test_bad_and_truncated_index_are_named(saved, tmp_path):
    d = _copy(saved, tmp_path)
    index = os.path.join(d, "model.safetensors.index.json")
    text = open(index).read()
    for broken in (text.replace('",', '"', 1), text[: len(text) // 2]):  # a lost comma; a cut file
        with open(index, "w") as f:
            f.write(broken)
        with pytest.raises(
            ValueError, match=r"model.safetensors.index.json: the safetensors index is not valid JSON"
        ):
            model_config(d, 64)


def test_missing_shard_is_named(saved, tmp_path):
    d = _copy(saved, tmp_path)
    gone = _shards(d)[1]
    os.remove(os.path.join(d, gone))
    with pytest.raises(
        ValueError, match=rf"index.json names {gone}, which is not in .*fetch the missing shard"
    ):
        model_config(d, 64)


def test_truncated_shard_is_named(saved, tmp_path):
    d = _copy(saved, tmp_path)
    cut = os.path.join(d, _shards(d)[-1])
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) - 100)
    with pytest.raises(
        ValueError, match=rf"{_shards(d)[-1]}: not a readable safetensors file .*truncated or corrupt"
    ):
        model_config(d, 64)


def test_shape_mismatch_and_missing_weights_are_named(saved, tmp_path):
    d = _copy(saved, tmp_path)
    _edit_json(os.path.join(d, "config.json"), intermediate_size=72)
    with pytest.raises(
        ValueError,
        match=r"mlp.\w+_proj.weight has shape \(64, 32\) in the files but \(72, 32\) in the model built",
    ):
        model_config(d, 64)
    _edit_json(os.path.join(d, "config.json"), intermediate_size=64, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"lacks weights for 9 parameter\(s\): \['model.layers.2"):
        model_config(d, 64)


def test_config_only_directory_passes_unless_weights_are_required(saved, tmp_path):
    d = tmp_path / "config-only"
    d.mkdir()
    (d / "config.json").write_text(open(os.path.join(saved, "config.json")).read())
    assert check_model_dir(str(d)).hidden_size == 32
    with pytest.raises(ValueError, match="has neither model.safetensors nor model.safetensors.index.json"):
        check_model_dir(str(d), require_weights=True)


def test_meta_construction_buffers_equal_from_pretrained_with_and_without_init_weights(saved, monkeypatch):
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    want = dict(AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).named_buffers())
    model = init_empty_model(saved)
    assert all(p.is_meta for p in model.parameters()) and want.keys() == dict(model.named_buffers()).keys()
    assert all(torch.equal(b, want[n]) for n, b in model.named_buffers())
    # a model whose _init_weights leaves its rotary buffers alone (transformers 4.x): the fallback builds them
    original = LlamaPreTrainedModel._init_weights
    skip_rotary = lambda self, m: None if "Rotary" in type(m).__name__ else original(self, m)  # noqa: E731
    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", skip_rotary)
    model = init_empty_model(saved)
    assert all(p.is_meta for p in model.parameters())
    assert all(torch.equal(b, want[n]) for n, b in model.named_buffers())


def _save_tiny(model_type: str, path: str, **sizes) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes)).save_pretrained(path)
    return path


TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64)  # fmt: skip


def test_directories_transformers_converts_while_loading_pass_as_from_pretrained_reads_them(tmp_path):
    """Nemotron-H stores ``backbone.*`` for the model's ``model.*`` (a rename), Qwen3-MoE and Mixtral
    store one tensor per expert for the model's fused ``experts.gate_up_proj`` (a merge), and Mixtral's
    config.json says ``head_dim: null``: each passes (it was "lacks weights" / "must be positive"), at
    ZeRO 0/1; the merged ones are refused by name for the sharded load of ZeRO 2/3."""
    nemotron = _save_tiny("nemotron_h", str(tmp_path / "nemotron_h"), **{**TINY, "num_hidden_layers": 4},
                          head_dim=8, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
                          hybrid_override_pattern="M*M-")  # fmt: skip
    moe = _save_tiny("qwen3_moe", str(tmp_path / "qwen3_moe"), **TINY, head_dim=8, moe_intermediate_size=16,
                     num_experts=4, num_experts_per_tok=2)  # fmt: skip
    mixtral = _save_tiny("mixtral", str(tmp_path / "mixtral"), **TINY, num_local_experts=4)
    assert json.load(open(os.path.join(mixtral, "config.json")))["head_dim"] is None
    for d in (nemotron, moe, mixtral):
        assert model_config(d, 64).hidden_size == 32
    assert check_model_dir(nemotron, sharded_load=True).model_type == "nemotron_h"  # a rename: readable
    for d in (moe, mixtral):
        with pytest.raises(ValueError, match=r"by combining stored tensors while loading \(e.g. model.layers.0."
                           r"mlp.experts.\w+ from 4 tensors such as model.layers.0.[\w.]*experts.0.*"
                           r"use --zero-stage 0 or 1"):  # fmt: skip
            model_config(d, 64, sharded_load=True)
    _edit_json(os.path.join(nemotron, "config.json"), mamba_num_heads=8)  # a renamed tensor is still checked
    with pytest.raises(ValueError, match=r"backbone.layers.0.mixer.\w+ has shape \(4,\) in the files but \(8,\)"):
        model_config(nemotron, 64)

"""The coverage sweep's CI subset: one model per mechanism at sp=2 against the same model without SP.

``bench.model_sweep.compare`` on a 2-rank gloo group (per-position logits and every gradient, fp32,
rtol 1e-4): dense (Llama), MoE (Qwen2-MoE), MLA (DeepSeek-V3), sliding window (Mistral, window 8 of
32 tokens) and a short-convolution hybrid (LFM2, its mixer sharded) are exact; MiniMax's lightning
attention is refused naming it; a Llama hiding a running sum in its MLP is refused — and LFM2 and
the hidden sum are shown to be really wrong without the guard (and the mixer handlers), so what the
guard refuses is a real error. A custom position-wise module declared with
``declare_position_wise`` passes and is exact. The full sweep is ``python -m bench.model_sweep``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a top-level folder of the repository, not an installed package
    sys.path.insert(0, str(ROOT))

from bench import model_sweep  # noqa: E402


def _family(name: str, guard: bool = True) -> dict:
    return model_sweep.compare(model_sweep.build(name), guard=guard)


def _packed(name: str, route: bool = True) -> dict:
    import copy

    model = model_sweep.build(name)
    plain = copy.deepcopy(model)
    try:
        model_sweep.check_sequence_mixing(model, sp_size=2)
        verdict = "exact"
    except ValueError:
        verdict = "refused"
    return model_sweep.compare_packed(model, plain, verdict, route)


def test_packed_documents_stay_apart_at_sp_1_and_2_or_are_refused(pool):
    """Every family ``train`` packs for: the packed row equals each document run alone, at sp 1 (the
    SP attention registered there, the mixer handlers applied) and sp 2; Doge (its attention's dynamic
    mask reads every kv head: no head-parallel split) is refused at both; gpt-oss's own forward (sinks) leaks,
    which is why sp 1 is routed."""
    for family in ("llama", "gpt_oss", "lfm2", "bamba", "deepseek_v32"):  # DSA: its picks per document
        assert pool.run(_packed, 2, family) == [{"sp1": "exact", "sp2": "exact"}] * 2, family
    assert pool.run(_packed, 2, "doge") == [{"sp1": "refused", "sp2": "refused"}] * 2
    own = pool.run(_packed, 2, "gpt_oss", False)
    assert [r["sp1"].startswith("leaks (logits differ by") for r in own] == [True, True], own
    assert [r["sp2"] for r in own] == ["exact", "exact"]


def test_packed_rows_are_refused_at_sp_1_where_a_module_mixes_the_whole_row():
    from ulysses_sp.mixers.guard import check_document_mixing
    from ulysses_sp.run.config import config_from_dict
    from ulysses_sp.run.model_checks import sp_attention_wanted

    for family in ("llama", "lfm2", "qwen3_next", "deepseek_v32"):
        check_document_mixing(model_sweep.build(family))  # documents kept apart: no error
    dsa = model_sweep.build("deepseek_v32").config  # at sp 1 through the SP attention where its picks run
    assert sp_attention_wanted(config_from_dict({"model": "tiny-llama", "sp": 1}), dsa)
    assert not sp_attention_wanted(config_from_dict({"model": "tiny-llama", "sp": 1, "attn": "flash"}), dsa)
    with pytest.raises(ValueError, match=r"(?s)packed documents cannot be kept apart in DogeForCausalLM.*"
                       r"self_attn \(DogeAttention\).*--packing none"):  # fmt: skip
        check_document_mixing(model_sweep.build("doge"))
    check_document_mixing(model_sweep.build("bloom"))  # its own attention runs per document (mixers/own_scores.py)
    with pytest.raises(ValueError, match="layer 0: 'heavily_compressed_attention' attention pools K/V in windows of 5 "
                       "tokens from the row's first token"):  # at every sp size: train and prepare check it at sp > 1 too
        check_document_mixing(model_sweep.build("deepseek_v4"))


def _hidden(kind: str, guard: bool = True, declare: bool = False) -> dict:
    from hidden_mixer import TokenScale, hidden_mixer_llama

    from ulysses_sp import declare_position_wise

    model = hidden_mixer_llama(kind)
    if not declare:
        return model_sweep.compare(model, guard=guard)
    with declare_position_wise(TokenScale):
        return model_sweep.compare(model, guard=guard)


@pytest.mark.parametrize("family", ["llama", "qwen2_moe", "deepseek_v3", "mistral"])
def test_dense_moe_mla_and_sliding_window_are_exact(pool, family):
    results = pool.run(_family, 2, family)
    assert results == [{"verdict": "exact", "detail": ""}] * 2


def test_lfm2_is_exact_with_its_short_convolution_sharded_and_silently_wrong_without(pool):
    assert pool.run(_family, 2, "lfm2") == [{"verdict": "exact", "detail": ""}] * 2
    unguarded = pool.run(_family, 2, "lfm2", False)  # no guard, no mixer handler: what SP did before
    assert [r["verdict"] for r in unguarded] == ["wrong", "wrong"], unguarded


def test_mamba1_is_exact_with_its_scan_sharded_and_silently_wrong_without(pool):
    """Mamba-1 alone (no attention layers: the mesh without a registration) and beside attention
    (Jamba): exact with the channel-sharded selective scan, packed documents too; wrong without it."""
    for family in ("mamba", "jamba"):
        assert pool.run(_family, 2, family) == [{"verdict": "exact", "detail": ""}] * 2, family
    assert pool.run(_packed, 2, "mamba") == [{"sp1": "exact", "sp2": "exact"}] * 2
    unguarded = pool.run(_family, 2, "mamba", False)  # no guard, no mixer handler: each rank scans its shard
    assert [r["verdict"] for r in unguarded] == ["wrong", "wrong"], unguarded


def test_minimax_lightning_attention_is_refused_naming_it(pool):
    for r in pool.run(_family, 2, "minimax"):
        assert r["verdict"] == "refused"
        assert "layer 1: MiniMaxDecoderLayer is a 'linear_attention' layer" in r["detail"]
        assert "self_attn (MiniMaxLightningAttention)" in r["detail"]


def test_a_hidden_running_sum_is_refused_and_would_be_silently_wrong(pool):
    refused = pool.run(_hidden, 2, "cumsum")
    assert [r["verdict"] for r in refused] == ["refused"] * 2
    assert (
        "layer 0: mlp (CumsumMLP) mixes tokens along the sequence (its code calls cumsum)"
        in refused[0]["detail"]
    )
    assert [r["verdict"] for r in pool.run(_hidden, 2, "cumsum", False)] == ["wrong", "wrong"]


def test_a_declared_position_wise_module_is_admitted_and_exact(pool):
    assert [r["verdict"] for r in pool.run(_hidden, 2, "scale")] == ["refused"] * 2
    assert pool.run(_hidden, 2, "scale", True, True) == [{"verdict": "exact", "detail": ""}] * 2

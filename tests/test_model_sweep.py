"""The coverage sweep's CI subset: one model per mechanism at sp=2 against the same model without SP.

``bench.model_sweep.compare`` on a 2-rank gloo group (per-position logits and every gradient, fp32,
rtol 1e-4): dense (Llama), MoE (Qwen2-MoE), MLA (DeepSeek-V3), looped stacks (HRM), sliding window
(Mistral, window 8 of 32 tokens), a short-convolution hybrid (LFM2, its mixer sharded) and MiniMax (its
lightning attention sharded by head) are exact; a Gemma 4 assistant (a draft model attending to another
model's cache) is refused naming why; a Llama hiding a running sum in its MLP is refused — and LFM2, MiniMax and the hidden
sum are shown to be really wrong without the guard (and the mixer handlers), so what the guard refuses
is a real error. The handlers of issue 36 (own-score attention, causal and mask windows, self-numbered
positions, RG-LRU, RWKV, DSA and QSA indexers, CPM-Ant's prompt-prefixed row) are exact with their handler and wrong without it. A
custom position-wise module declared with ``declare_position_wise`` passes and is exact. The full sweep
is ``python -m bench.model_sweep``.
"""

from __future__ import annotations

import contextlib
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
    SP attention registered there, the mixer handlers applied) and sp 2 — Doge's dynamic mask too (its
    attention run head-parallel over a per-document mask, ``mixers/key_gates.py``); XLNet (bidirectional
    relative attention over the whole row, run head-parallel unpacked by ``mixers/xlnet.py``) is refused
    packed at both; gpt-oss's own forward (sinks) leaks, which is
    why sp 1 is routed."""
    for family in ("llama", "gpt_oss", "lfm2", "bamba", "deepseek_v32", "doge"):  # DSA: its picks per document
        assert pool.run(_packed, 2, family) == [{"sp1": "exact", "sp2": "exact"}] * 2, family
    assert pool.run(_packed, 2, "xlnet") == [{"sp1": "refused", "sp2": "refused"}] * 2
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
    with pytest.raises(ValueError, match=r"(?s)packed documents cannot be kept apart in XLNetLMHeadModel.*"
                       r"rel_attn \(XLNetRelativeAttention\).*--packing none"):  # fmt: skip
        check_document_mixing(model_sweep.build("xlnet"))
    for family in ("bloom", "doge"):  # their own attention runs per document (mixers/own_scores.py)
        check_document_mixing(model_sweep.build(family))
    check_document_mixing(model_sweep.build("deepseek_v4"))  # its pooled K/V per document (attention/pooled_docs.py)


def _hidden(kind: str, guard: bool = True, declare: bool = False) -> dict:
    from hidden_mixer import TokenScale, hidden_mixer_llama

    from ulysses_sp import declare_position_wise

    model = hidden_mixer_llama(kind)
    if not declare:
        return model_sweep.compare(model, guard=guard)
    with declare_position_wise(TokenScale):
        return model_sweep.compare(model, guard=guard)


@pytest.mark.parametrize("family", ["llama", "qwen2_moe", "deepseek_v3", "mistral", "hrm_text"])  # HRM: looped stacks
def test_dense_moe_mla_and_sliding_window_are_exact(pool, family):
    results = pool.run(_family, 2, family)
    assert results == [{"verdict": "exact", "detail": ""}] * 2


def _prefix_lm_refused() -> str:
    import torch

    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF

    model = model_sweep.build("hrm_text")  # prefix_lm defaults to True
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "eager", 1, 1)
    ids = torch.zeros(1, 8, dtype=torch.long)
    try:
        model(input_ids=ids, position_ids=torch.arange(8)[None], token_type_ids=torch.ones_like(ids))
    except ValueError as err:
        return str(err)
    finally:
        reg.remove()
    return "not refused"


def test_a_prefix_lm_block_is_refused_under_the_sp_attention(pool):
    """HRM's token_type_ids make its prefix one bidirectional block in its own mask, which the SP attention
    (causal, from positions) does not build: refused at the call, not silently causal."""
    assert pool.run(_prefix_lm_refused, 1)[0].startswith(
        "HrmTextForCausalLM was given token_type_ids with config.prefix_lm = True")


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


def test_minimax_lightning_attention_is_exact_with_its_heads_sharded_and_silently_wrong_without(pool):
    assert pool.run(_family, 2, "minimax") == [{"verdict": "exact", "detail": ""}] * 2
    unguarded = pool.run(_family, 2, "minimax", False)  # no guard, no handler: each rank's recurrence starts at 0
    assert [r["verdict"] for r in unguarded] == ["wrong", "wrong"], unguarded


def test_a_model_whose_sequence_cannot_be_split_is_refused_naming_why(pool):
    for r in pool.run(_family, 2, "gemma4_assistant"):
        assert r["verdict"] == "refused"
        assert "decoder stack: Gemma4AssistantForCausalLM is a draft model for assisted decoding" in r["detail"]
        assert "attends to the key/value states of another model" in r["detail"]


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


HANDLED = {  # family -> its handler (mixers/*.py, attention/indexer.py, block_indexer.py)
    "bloom": "own_scores", "zaya": "causal_window", "phimoe": "mask_window", "musicgen": "counted_positions",
    "recurrent_gemma": "rg_lru", "rwkv": "rwkv", "deepseek_v32": "indexer", "qwen4_exp_text": "block_indexer",
    "cpmant": "segment_bias",
}  # fmt: skip


def _with_and_without(name: str) -> list[str]:
    """The verdict with the family's handler, then without it: a mixer handler off with the guard (the
    family holds no other mixer); DSA's indexer left unwrapped (it picks among its shard's keys), QSA's picks
    dropped (the SP attention attends densely; its gated delta-net layers stay sharded), their stand-in masks
    kept; the registration's after-step check off (it stops a step whose own-score layers skipped SP)."""
    from unittest import mock

    from ulysses_sp.attention import block_indexer, indexer, registration

    verdicts = [model_sweep.compare(model_sweep.build(name))["verdict"]]
    with mock.patch.object(indexer, "sp_indexer_forward", lambda forward, *a: forward), \
         mock.patch.object(block_indexer, "qsa_picks", lambda *a: None), \
         mock.patch.object(registration.SPRegistration, "check_ran", lambda *a: None):  # fmt: skip
        guard = HANDLED[name].endswith("indexer")
        verdicts.append(model_sweep.compare(model_sweep.build(name), guard=guard)["verdict"])
    return verdicts


def test_issue_36_handlers_are_exact_and_their_families_wrong_without_them(pool):
    """One family per handler at sp 2 on the sweep's tiny configs (richer cases: ``test_mixers``,
    ``test_attention_families``): exact, and wrong without the handler, so each one is needed."""
    for family in HANDLED:
        assert pool.run(_with_and_without, 2, family) == [["exact", "wrong"]] * 2, family


def _vlm(name: str, positions: bool = True) -> dict:
    """``bench.vlm_sweep``'s verdict for one family (its rank worker's steps); ``positions=False``: each rank's
    3-D rotary positions replaced by plain text positions (a bug the comparison must catch)."""
    from unittest import mock

    from bench import vlm_sweep
    from ulysses_sp.vlm import batch

    why = vlm_sweep.refusal(vlm_sweep.build(name, meta=True))
    if why is not None:
        return {"verdict": "refused", "detail": why}
    flat = lambda model, ids, **kw: kw["position_ids"].expand(4, *ids.shape)  # noqa: E731 - text row for every axis
    with mock.patch.object(batch, "vlm_position_ids", flat) if not positions else contextlib.nullcontext():
        return vlm_sweep.compare(vlm_sweep.build(name))


def test_vlm_sweep_judges_qwen2_5_vl_exact_a_position_bug_wrong_and_emu3_refused(pool):
    """The VLM sweep's CI subset (``python -m bench.vlm_sweep``): Qwen2.5-VL at sp 2 through ``ulysses_sp.vlm``
    equals the model without SP (logits and every gradient, its vision tower's included) and a position bug in
    the same run is judged wrong; Emu3 (a VQ image tokenizer scattered into the sequence) is refused with
    ulysses-sp's reason, on the meta device."""
    assert pool.run(_vlm, 2, "qwen2_5_vl") == [{"verdict": "exact", "detail": ""}] * 2
    assert [r["verdict"] for r in pool.run(_vlm, 2, "qwen2_5_vl", False)] == ["wrong"] * 2
    (emu3,) = pool.run(_vlm, 1, "emu3")
    assert emu3["verdict"] == "refused", emu3
    assert "Emu3ForConditionalGeneration is a multimodal model (emu3: vq_config)" in emu3["detail"]
    assert "its VQ-VAE (vqmodel) turns each image into discrete codes" in emu3["detail"]

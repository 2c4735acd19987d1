"""The ALST techniques in the HF Trainer path (``prepare(..., tiled_loss=, tiled_mlp=,
offload_activations=, offload_attention=, recompute_norms=)``, the Trainer's ``gradient_checkpointing`` and ``bf16``):
with ``sp=2`` on 2 gloo processes every step's logged loss and grad norm and the eval loss equal the
same Trainer without SP (fp32: tight; bf16: ``test_precision``'s tolerance), and each technique
took effect (no full logits through ``lm_head``, bytes offloaded, MLPs tiled). All runs share one
worker group (one ``pool.run``); what cannot run is refused with the fix in the message."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

pytest.importorskip("accelerate", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")

from hf_runs import VOCAB, accelerate_env, right_pad_collator, text_rows, token_rows  # noqa: E402
from models import tiny_model  # noqa: E402
from test_hf_trainer import make_trainer  # noqa: E402, F401  (the fixture)
from test_precision import BF16_RTOL  # noqa: E402

from ulysses_sp.integrations.transformers import prepare  # noqa: E402

ALL = {"tiled_loss": 3, "tiled_mlp": 3, "offload_activations": True, "offload_attention": True, "recompute_norms": True}
RUNS = {  # name: (sp, prepare options, TrainingArguments fields); "sft_"/"lora_": packed SFT / LoRA runs
    "ref": (0, {}, {}),
    "tiled_loss": (2, {"tiled_loss": 3}, {}),
    "tiled_mlp": (2, {"tiled_mlp": 3}, {}),
    "checkpoint_offload": (2, {"offload_activations": True}, {"gradient_checkpointing": True}),
    "offload_attention": (2, {"offload_attention": True}, {}),
    "ref_bf16": (0, {}, {"bf16": True}),
    "bf16_all": (2, {"tiled_loss": 3, "tiled_mlp": 3}, {"bf16": True}),
    "sft_ref": (0, {}, {}),
    "sft_all": (2, ALL, {"gradient_checkpointing": True}),
    "lora_ref": (0, {}, {}),
    "lora_tiled": (2, {"tiled_loss": 3, "tiled_mlp": 3}, {}),
}


def _train(name: str) -> dict:
    """One Trainer run, 3 steps and an eval: logs, eval loss, effects. Plain ``Trainer`` on right-padded
    variable lengths; ``sft_``: TRL's ``SFTTrainer`` with BFD packing; ``lora_``: a LoRA model."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    sp, options, fields = RUNS[name]
    model = tiny_model("llama", seed=0, vocab=VOCAB, kv_heads=2)
    head_seq: list[int] = []  # sequence lengths lm_head's own call saw (its hooks)
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: head_seq.append(out.shape[1]))
    if name.startswith("lora_"):  # lm_head frozen: the tiled loss back-propagates into the hidden states only
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
        )
        torch.manual_seed(1)
        with torch.no_grad():  # non-zero B: every adapter weight has a gradient at step 1
            for n, p in model.named_parameters():
                p.normal_(0, 0.1) if "lora_B" in n else None
    common = dict(
        output_dir="", use_cpu=True, report_to=[], save_strategy="no", max_steps=3, seed=0,
        per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=max(sp, 1),
        learning_rate=1e-2, logging_steps=1, disable_tqdm=True, **fields,
    )  # fmt: skip
    with accelerate_env(), tempfile.TemporaryDirectory() as out:
        common["output_dir"] = out
        if name.startswith("sft_"):
            from trl import SFTConfig, SFTTrainer

            from ulysses_sp.tasks.tokenizer import byte_tokenizer

            args = SFTConfig(packing=True, max_length=40, bf16=False, dataset_num_proc=None, **common)
            trainer = SFTTrainer(
                model=model, args=args, processing_class=byte_tokenizer(),
                train_dataset=Dataset.from_list(text_rows(32, 1, completion=False)),
                eval_dataset=Dataset.from_list(text_rows(8, 2, completion=False)),
            )  # fmt: skip
        else:
            trainer = Trainer(
                model=model, args=TrainingArguments(remove_unused_columns=False, **common),
                data_collator=right_pad_collator,
                train_dataset=Dataset.from_list(token_rows(24, (13, 20, 7, 16), seed=1)),
                eval_dataset=Dataset.from_list(token_rows(8, (11, 18), seed=2)),
            )  # fmt: skip
        handle = prepare(trainer, sp_size=sp, **options) if sp else None
        trainer.train()
        logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
        result = {
            "logs": logs,
            "eval_loss": trainer.evaluate()["eval_loss"],
            "head_seq": max(head_seq, default=-1),
        }
        if handle is not None:
            alst, attention = handle.alst, handle.registration.attention
            result["tiled_mlps"] = len(alst.mlp.module_names) if alst and alst.mlp else 0
            result["offloaded"] = alst.offload.stats.offloaded_bytes if alst and alst.offload else 0
            result["norms"] = len(alst.norms.module_names) if alst and alst.norms else 0
            kv = attention.kv_offload
            result["kv_offloaded"] = kv.stats.offloaded_bytes if kv is not None else 0
            handle.remove()
            result["restored"] = not any(
                getattr(m.forward, "_ulysses_sp_tiled", False) for m in model.modules()
            )
    return result


def _all_runs() -> dict[str, dict]:
    return {name: _train(name) for name in RUNS}


@pytest.fixture(scope="module")
def runs(pool):
    by_rank = pool.run(_all_runs, 2)
    for name in RUNS:  # both ranks of the SP group log the same numbers
        assert by_rank[0][name]["logs"] == by_rank[1][name]["logs"], name
    return by_rank[0]


def _assert_same(got: dict, want: dict, rtol_loss: float, rtol_norm: float) -> None:
    assert len(got["logs"]) == len(want["logs"]) == 3, (got["logs"], want["logs"])
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got["logs"], want["logs"])):
        assert math.isclose(loss, ref_loss, rel_tol=rtol_loss), (step, got["logs"], want["logs"])
        assert math.isclose(norm, ref_norm, rel_tol=rtol_norm), (step, got["logs"], want["logs"])
    assert math.isclose(got["eval_loss"], want["eval_loss"], rel_tol=rtol_loss), (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiled_loss", "tiled_mlp", "checkpoint_offload", "offload_attention"])
def test_alst_technique_in_trainer_equals_trainer_without_sp(runs, name):
    _assert_same(runs[name], runs["ref"], 1e-5, 1e-4)
    assert runs[name]["restored"]  # handle.remove() undid the tiled MLP


@pytest.mark.slow
def test_all_techniques_with_packed_sft_and_with_lora_equal_runs_without_sp(runs):
    """TRL's SFTTrainer with BFD packing (documents restart position_ids: the blockwise, offloaded
    attention keeps them apart), every technique at once; and LoRA (frozen lm_head) with the tilings."""
    _assert_same(runs["sft_all"], runs["sft_ref"], 1e-5, 1e-4)
    _assert_same(runs["lora_tiled"], runs["lora_ref"], 1e-5, 1e-4)
    assert (
        runs["sft_all"]["head_seq"] == 0
        and runs["sft_all"]["offloaded"] > 0
        and runs["sft_all"]["kv_offloaded"] > 0
        and runs["sft_all"]["norms"] == 5  # 2 layers x (input, post-attention), the final norm
    )


@pytest.mark.slow
def test_each_technique_took_effect(runs):
    assert runs["ref"]["head_seq"] > 1 and runs["tiled_loss"]["head_seq"] == 0  # no [B, S_l, V] logits
    assert runs["bf16_all"]["head_seq"] == 0
    assert runs["tiled_mlp"]["tiled_mlps"] == 2 and runs["tiled_loss"]["tiled_mlps"] == 0
    assert runs["checkpoint_offload"]["offloaded"] > 0 and runs["tiled_mlp"]["offloaded"] == 0
    assert runs["offload_attention"]["kv_offloaded"] > 0 and runs["tiled_loss"]["kv_offloaded"] == 0


@pytest.mark.slow
def test_bf16_with_tiling_equals_bf16_trainer_without_sp(runs):
    """bf16 autocast through the Trainer: SP (with tiled loss and MLP) equals the bf16 run without SP
    within ``test_precision``'s tolerance; bf16 rounding shows against fp32 (the policy took effect)."""
    _assert_same(runs["bf16_all"], runs["ref_bf16"], BF16_RTOL, BF16_RTOL)
    assert runs["ref_bf16"]["logs"][0][0] != runs["ref"]["logs"][0][0]


# --------------------------------------------------------------------------- refusals (no process group)
def test_offload_activations_needs_gradient_checkpointing(make_trainer):  # noqa: F811
    with pytest.raises(ValueError, match=r"offload_activations=True .* set gradient_checkpointing=True"):
        prepare(make_trainer(), sp_size=2, offload_activations=True)


def test_offload_attention_needs_sdpa_and_tile_counts_are_checked(make_trainer):  # noqa: F811
    with pytest.raises(ValueError, match=r"offload_attention \(True\) configure the blockwise core.*'sdpa'"):
        prepare(make_trainer(attn="eager"), sp_size=2, offload_attention=True)
    with pytest.raises(ValueError, match=r"prepare\(tiled_mlp=...\) must be >= 1, got 0"):
        prepare(make_trainer(), sp_size=2, tiled_mlp=0)


def test_tiled_loss_refuses_a_model_that_transforms_its_logits(make_trainer):  # noqa: F811
    trainer = make_trainer()
    trainer.model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30.0: pass tiled_loss=False"):
        prepare(trainer, sp_size=2, tiled_loss=True)


def test_tiled_loss_parts_equal_the_untiled_parts_and_gradients():
    """In-process: the intercepted, tiled lm_head + loss gives the untiled sum, count and gradients."""
    from ulysses_sp.integrations.alst import loss_parts

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[0, :5] = -100  # a tile without tokens is skipped
    grads, parts = [], []
    for shards in (False, 4):
        model = tiny_model("llama", seed=0, vocab=VOCAB)
        out, total, count = loss_parts(model, {"input_ids": ids, "use_cache": False}, labels, shards)
        total.backward()
        parts.append((total.detach(), count, out.logits.shape[1]))
        grads.append([p.grad for p in model.parameters()])
    (ref_total, ref_count, ref_seq), (total, count, seq) = parts
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-5)
    assert count == ref_count == 12 * 2 - 2 - 5 and (ref_seq, seq) == (12, 0)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

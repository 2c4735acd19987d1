"""TRL's ``DPOTrainer`` through ``prepare(trainer, sp_size=...)`` (issue 34 item 2): a real trainer on a
tiny llama, fp32, against the same trainer without SP. Every logged value of every step (loss,
grad_norm, rewards/chosen, rejected, margins, accuracies, logps/chosen, rejected, logits/chosen,
rejected, entropy, mean_token_accuracy, num_tokens, ...) and of ``evaluate()`` agrees to float
rounding (measured: loss and grad_norm within 5.2e-7 relative, log-probs within 6e-6 absolute = 1e-7
relative, rewards within 1e-6 absolute) at dp 1 x sp 2 against one process, for the sigmoid loss with a separate reference model, IPO with
precomputed reference log-probs, and the sum of every loss type TRL offers with LoRA (the reference is the adapter
disabled).

At dp 2 x sp 2 against dp 4 under FSDP2 (gradient accumulation doubled, as for the SFT path) the loss,
the gradient norm and every per-sequence metric agree; TRL's token-weighted metrics (entropy, logits/*,
mean_token_accuracy) are token means *per micro-step* across the ranks, and the SP round puts other
batches side by side in a micro-step than dp 4 does, so they are not compared there."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("accelerate", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")
pytest.importorskip("trl", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")
pytest.importorskip("peft", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")

from hf_dpo_runs import dpo_train  # noqa: E402

REL, ABS = 2e-6, 3e-6
"""fp32 rounding; rewards are beta * (a difference of two log-probs near -60), hence the absolute part."""
BF16_REL, BF16_ABS = 5e-3, 1e-3
"""bf16 rounding (8 bits of mantissa: 4e-3 per operation); measured: loss within 1.9e-4 relative, grad_norm
3.9e-4, logps/chosen 6.1e-6, rewards/margins 2.6e-4 absolute (second step)."""
TIMING = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "eval_runtime",
          "eval_samples_per_second", "eval_steps_per_second")  # fmt: skip
ALL_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
              "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")  # fmt: skip
"""Every ``loss_type`` TRL 1.16's DPOTrainer offers, summed (``loss_weights``: 1 each; exo_pair needs label_smoothing > 0)."""
TOKEN_WEIGHTED = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")


def _assert_same(got: dict, want: dict, where: str, skip: tuple[str, ...] = ()) -> None:
    keys = set(want) - set(TIMING) - set(skip)
    assert keys <= set(got), (where, sorted(keys - set(got)))
    for key in sorted(keys):
        assert math.isclose(got[key], want[key], rel_tol=REL, abs_tol=ABS), (where, key, got[key], want[key])


def _assert_exact(pool, dp: int, accum: int, *, skip: tuple[str, ...] = (), **kw) -> dict:
    """dp x sp 2 (accumulation ``2 * accum`` for ``dp > 1``, as for the SFT path; ``accum`` at dp 1, where
    one process of the oracle sees the group's batches in the same order) against 1 or 4
    processes without SP (dp 1: 1, dp 2: 4): every logged value of every step and of evaluate()."""
    want = pool.run(dpo_train, 1 if dp == 1 else 2 * dp, 0, accum=accum, **kw)[0]
    sp = pool.run(dpo_train, 2 * dp, 2, accum=accum if dp == 1 else 2 * accum, **kw)
    assert all(r["logs"] == sp[0]["logs"] for r in sp), "the SP ranks logged different values"
    got = sp[0]
    assert got["name"] == "SequenceParallelDPOTrainer" and got["restored"] == "DPOTrainer"
    assert len(got["logs"]) == len(want["logs"]) == kw.get("steps", 2)
    for step, (g, w) in enumerate(zip(got["logs"], want["logs"])):
        assert set(w) >= {"loss", "grad_norm", "rewards/margins", "rewards/accuracies", "logps/chosen"}, sorted(w)
        _assert_same(g, w, f"step {step + 1}", skip)
    _assert_same(got["eval"], want["eval"], "evaluate()", tuple(f"eval_{k}" for k in skip))
    return got


@pytest.mark.slow
def test_dpo_sigmoid_with_a_reference_model_sp2_equals_one_process(pool):
    """The default DPO: sigmoid loss, a separate reference model, accumulation 2, eval at the end."""
    _assert_exact(pool, 1, 2, evaluate=True)


@pytest.mark.slow
def test_dpo_ipo_precomputed_and_lora_reference_sp2_equal_one_process(pool):
    """IPO (normalised by completion lengths) with reference log-probs precomputed when the trainer is
    built (before prepare: no SP there); the sum of every loss type TRL offers (sigmoid, hinge, IPO, EXO, NCA,
    robust, BCO, SPPO, AOT paired and unpaired, APO zero and down, DiscoPOP, SFT, normalised sigmoid) with a LoRA
    adapter whose disabled form is the reference (the same wrapped head, called under the adapter's context)."""
    _assert_exact(pool, 1, 1, loss_type=("ipo",), reference="precompute", evaluate=True)
    got = _assert_exact(pool, 1, 1, loss_type=ALL_LOSSES, label_smoothing=1e-3, reference="peft")
    assert got["logs"][0]["rewards/chosen"] != 0  # the LoRA weights start non-zero: policy != reference


@pytest.mark.slow
def test_dpo_fsdp2_dp2_sp2_equals_fsdp2_dp4(pool):
    """4 processes under accelerate's FSDP2 (``hf_runs.fsdp2_on_cpu``: the policy and the reference
    model sharded, TRL's fused head gathering the DTensor lm_head): dp 2 x sp 2 (accumulation 2)
    against dp 4 (accumulation 1)."""
    got = _assert_exact(pool, 2, 1, skip=TOKEN_WEIGHTED, evaluate=True, fsdp2=True)
    assert got["fsdp2"]


@pytest.mark.slow
def test_dpo_bf16_sp2_matches_one_process(pool):
    """bf16 autocast (TRL's default precision) at dp 1 x sp 2 against one process: bf16 rounds differently where
    the SP run's shapes differ (the attention over the exchanged heads, the fused head's tiles of ``S/P`` tokens),
    so the tolerance is bf16's (measured: see BF16_REL); a wrong normaliser or a lost gradient share (a factor of 2)
    is far outside it."""
    want = pool.run(dpo_train, 1, 0, bf16=True)[0]
    got = pool.run(dpo_train, 2, 2, bf16=True)[0]
    assert got["name"] == "SequenceParallelDPOTrainer" and len(got["logs"]) == len(want["logs"]) == 2
    for step, (g, w) in enumerate(zip(got["logs"], want["logs"])):
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins"):
            assert math.isclose(g[key], w[key], rel_tol=BF16_REL, abs_tol=BF16_ABS), (step, key, g[key], w[key])

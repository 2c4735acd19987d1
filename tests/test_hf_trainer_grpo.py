"""TRL's ``GRPOTrainer`` and ``RLOOTrainer`` through ``prepare(trainer, sp_size=...)`` (issue 34 item 2): a real
trainer on a tiny llama, fp32, sampled completions of varied lengths (left-padded prompts, right-padded
completions), against the same trainer on the same processes without SP. Every logged value of every step on
every rank — loss, grad_norm, reward, reward_std, kl, entropy, clip ratios, completion lengths, policy_loss,
num_tokens — and of ``evaluate()`` agrees to float rounding (measured: loss within 2.3e-8 absolute, grad_norm
within 1e-7 relative, entropy within 4.8e-7 of 5.5, kl within 9e-8 of 0.023). Also dp 2 x sp 2 against dp 4 under FSDP2, and
bf16 autocast at bf16's tolerance (``BF16_REL``).

Why the oracle has as many processes as the SP run: TRL seeds sampling per process and hands each process its
slice of the generation batch, so every rank generates (without SP) exactly what it generates in the run without
SP; a single process would sample other completions. The SP group then computes its ranks' per-token
log-probs together (``integrations._rl``)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("accelerate", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")
pytest.importorskip("trl", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")
pytest.importorskip("peft", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")

from hf_grpo_runs import refusals, rl_train  # noqa: E402

REL, ABS = 2e-6, 1e-6
"""fp32 rounding; losses near 0 (RLOO's leave-one-out advantages sum to 0 per prompt), hence the absolute part."""
BF16_REL, BF16_ABS = 5e-3, 2e-5
"""bf16 rounding (8 bits of mantissa: 4e-3 per operation); measured: grad_norm within 7.7e-4 relative, kl 8.1e-4
relative (4.3e-6 absolute of 0.0053), entropy 2.8e-6, loss 1.3e-6 (1.8e-7 absolute); the absolute part is for
step 1's kl of 0 and stays far below a kl off by a factor of 2."""
TIMING = ("runtime", "per_second", "step_time")


def _assert_exact(pool, world: int, **kw) -> list[dict]:
    """dp ``world/2`` x sp 2 against ``world`` processes without SP: every rank's logged values, every step."""
    want = pool.run(rl_train, world, 0, **kw)
    got = pool.run(rl_train, world, 2, **kw)
    assert got[0]["name"].startswith("SequenceParallel") and got[0]["restored"] == want[0]["name"]
    for rank, (g_run, w_run) in enumerate(zip(got, want)):
        assert len(g_run["logs"]) == len(w_run["logs"]) == kw.get("steps", 2)
        for step, (g, w) in enumerate([*zip(g_run["logs"], w_run["logs"]), (g_run["eval"], w_run["eval"])]):
            keys = {k for k in w if not any(t in k for t in TIMING)}
            assert keys <= set(g), (rank, step, sorted(keys - set(g)))
            for key in sorted(keys):
                assert math.isclose(g[key], w[key], rel_tol=REL, abs_tol=ABS), (rank, step, key, g[key], w[key])
    assert {"loss", "grad_norm", "reward", "entropy", "completions/mean_length"} <= set(want[0]["logs"][0])
    return want


@pytest.mark.slow
def test_grpo_dapo_with_a_reference_model_sp2_equals_two_processes(pool):
    """TRL's default loss (dapo, normalised by the generation batch's tokens), beta > 0 with the reference model
    TRL builds from the policy's directory (its log-probs computed by the SP group too), eval at the end."""
    want = _assert_exact(pool, 2, beta=0.04, evaluate=True)
    assert want[0]["logs"][1]["kl"] > 0 and want[0]["logs"][0]["grad_norm"] > 0


@pytest.mark.slow
def test_grpo_loss_types_and_old_logps_sp2_equal_two_processes(pool):
    """grpo (per-sequence mean) with num_iterations=2 (old log-probs and importance ratios, clipping); bnpo
    (batch token mean) with steps_per_generation=2 over 2 accumulation steps, masked truncated completions, the
    top-entropy token mask (quantile gathered over the processes) and an entropy bonus; dr_grpo with a LoRA
    adapter whose disabled form is the reference and sequence-level importance sampling."""
    want = _assert_exact(pool, 2, loss_type="grpo", num_iterations=2, steps=3)
    assert want[0]["logs"][1]["clip_ratio/region_mean"] > 0  # the second pass on a generation clips
    _assert_exact(pool, 2, loss_type="bnpo", gradient_accumulation_steps=2, steps_per_generation=2,
                  mask_truncated_completions=True, top_entropy_quantile=0.5, entropy_coef=0.01)  # fmt: skip
    _assert_exact(pool, 2, loss_type="dr_grpo", lora=True, beta=0.04, importance_sampling_level="sequence",
                  num_iterations=2)  # fmt: skip


@pytest.mark.slow
def test_rloo_sp2_equals_two_processes(pool):
    """RLOOTrainer (the same per-token machinery, per-sequence summed log-probs) with a reference model, over 2
    accumulation steps (its loss is unscaled: the Trainer divides it, and the SP backward by the same)."""
    want = _assert_exact(pool, 2, trainer="rloo", beta=0.04, gradient_accumulation_steps=2, evaluate=True)
    assert want[0]["logs"][1]["kl"] > 0


@pytest.mark.slow
def test_grpo_fsdp2_dp2_sp2_equals_fsdp2_dp4(pool):
    """4 processes under accelerate's FSDP2 (``hf_runs.fsdp2_on_cpu``: the policy and the reference model sharded
    over the 4 ranks): dp 2 x sp 2 against dp 4, bnpo with a reference model."""
    want = _assert_exact(pool, 4, loss_type="bnpo", beta=0.04, fsdp2=True)
    assert want[0]["fsdp2"]


@pytest.mark.slow
def test_grpo_bf16_sp2_matches_two_processes(pool):
    """bf16 autocast (TRL's default precision), the default dapo loss with a reference model, dp 1 x sp 2 against
    the same 2 processes without SP. Generation runs without SP, so completions, rewards and lengths are equal;
    the log-probs round differently where the SP run's shapes differ (the attention over exchanged heads, the
    fused head's tiles of ``S/P`` tokens), so loss, grad_norm, kl and entropy get bf16's tolerance (measured: see
    BF16_REL); a wrong normaliser or a lost gradient share (a factor of 2) is far outside it."""
    want = pool.run(rl_train, 2, 0, bf16=True, beta=0.04)
    got = pool.run(rl_train, 2, 2, bf16=True, beta=0.04)
    for rank, (g_run, w_run) in enumerate(zip(got, want)):
        assert len(g_run["logs"]) == len(w_run["logs"]) == 2
        for step, (g, w) in enumerate(zip(g_run["logs"], w_run["logs"])):
            for key in ("reward", "reward_std", "completions/mean_length", "num_tokens"):
                assert g[key] == w[key], (rank, step, key, g[key], w[key])
            for key in ("loss", "grad_norm", "kl", "entropy"):
                assert math.isclose(g[key], w[key], rel_tol=BF16_REL, abs_tol=BF16_ABS), (rank, step, key, g[key], w[key])
    assert want[0]["logs"][1]["kl"] > 0


def test_grpo_refusals_name_the_option(pool):
    """What the RL SP path cannot reproduce is refused before any collective, naming it."""
    messages = pool.run(refusals, 1)[0]
    assert len(messages) == 3, messages
    assert "use_transformers_continuous_batching=True" in messages[0]
    assert "tiled_loss does not apply to GRPOTrainer" in messages[1]
    assert "overrides ['_get_per_token_logps_and_entropies']" in messages[2]

"""TRL's ``KTOTrainer`` and ``RewardTrainer`` through ``prepare(trainer, sp_size=...)`` (issue 34 item 2): a real
trainer on a tiny llama, fp32, against the same trainer without SP. Every logged value of every step — loss,
grad_norm, KTO's kl, rewards/chosen, rejected, margins, logps, logits, entropy, num_tokens; the reward model's
accuracy, margin, mean reward — and of ``evaluate()`` agrees to float rounding (see the assertions' tolerances):
KTO at dp 1 x sp 2 against one process, with a LoRA adapter whose disabled form is the reference and with
precomputed reference log-probs; the reward model at dp 2 x sp 2 against dp 4, both under FSDP2. KTO with its KL
term at dp > 1 is refused (the term averages the micro-step's batches over the processes). The reward rows have
varied lengths, so each row's last token (the score TRL reads) lies on either shard: its gradient is routed back
through the gather. A lost gradient share (the SP loss scaling removed) fails every exact test here (checked:
grad_norm off by a factor of 2)."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")
pytest.importorskip("trl", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")

from hf_kto_reward_runs import kto_train, reward_train  # noqa: E402
from test_hf_trainer_dpo import TIMING, _assert_same  # noqa: E402


def _assert_exact(pool, run, name: str, dp: int = 1, *, skip: tuple[str, ...] = (), **kw) -> list[dict]:
    """dp x sp 2 against dp x 2 processes without SP (one at dp 1; at dp > 1 the SP run accumulates twice as many
    micro-steps, as for the SFT and DPO paths): every logged value of every step and of evaluate() but ``skip``."""
    accum = kw.pop("accum", 1)
    want = pool.run(run, 1 if dp == 1 else 2 * dp, 0, accum=accum, **kw)[0]
    sp = pool.run(run, 2 * dp, 2, accum=accum if dp == 1 else 2 * accum, **kw)
    assert all(r["logs"] == sp[0]["logs"] for r in sp), "the SP ranks logged different values"
    got = sp[0]
    assert got["name"] == f"SequenceParallel{name}" and got["restored"] == name
    assert len(got["logs"]) == len(want["logs"]) == kw.get("steps", 2)
    for step, (g, w) in enumerate(zip(got["logs"], want["logs"])):
        _assert_same(g, w, f"step {step + 1}", skip)
    _assert_same(got["eval"], want["eval"], "evaluate()", tuple(f"eval_{k}" for k in skip))
    assert set(want["eval"]) - set(TIMING) or not kw.get("evaluate"), want["eval"]
    assert got["fsdp2"] == want["fsdp2"] == kw.get("fsdp2", False)
    return want["logs"]


@pytest.mark.slow
def test_kto_with_kl_term_and_lora_sp2_equals_one_process(pool):
    """KTO's default loss: the KL term from mismatched completions, with a LoRA adapter whose disabled form is the
    reference (the policy's, the reference's and both KL passes under SP), accumulation 2, eval at the end. Here the
    policy's KL log-probs stay below the reference's, so TRL's kl (clamped at 0) logs 0: the precomputed run below
    checks a positive kl."""
    logs = _assert_exact(pool, kto_train, "KTOTrainer", accum=2, evaluate=True, reference="peft")
    assert {"loss", "grad_norm", "kl", "rewards/chosen", "logps/rejected", "entropy"} <= set(logs[0])
    assert logs[0]["grad_norm"] > 0 and logs[0]["rewards/chosen"] != 0  # LoRA starts non-zero: policy != reference


@pytest.mark.slow
def test_kto_precomputed_reference_sp2_equals_one_process(pool):
    """The reference's log-probs and KL log-probs precomputed by a separate model when the trainer is built (the
    dataset's ref_logps / ref_KL_logps columns ride with their rows through the SP group's exchange; the policy's KL
    pass under SP), accumulation 2, eval at the end (the eval set precomputed too)."""
    logs = _assert_exact(pool, kto_train, "KTOTrainer", accum=2, reference="precompute", evaluate=True)
    assert logs[1]["kl"] > 0 and logs[0]["rewards/chosen"] != 0


@pytest.mark.slow
def test_reward_model_fsdp2_dp2_sp2_equals_fsdp2_dp4(pool):
    """RewardTrainer with the reward-centring term, 4 processes under accelerate's FSDP2 (``hf_runs.fsdp2_on_cpu``):
    dp 2 x sp 2 (accumulation 2) against dp 4 (accumulation 1), eval at the end. TRL's min/max_reward are a mean
    over micro-steps (eval steps) of each one's extreme over the processes: a dp 2 x sp 2 micro-step holds 2 batches
    where dp 4's holds 4, so those two are not compared (mean_reward, accuracy and margin are)."""
    logs = _assert_exact(pool, reward_train, "RewardTrainer", 2, skip=("min_reward", "max_reward"), evaluate=True,
                         fsdp2=True, center_rewards_coefficient=0.01)  # fmt: skip
    assert {"loss", "grad_norm", "accuracy", "margin", "mean_reward", "min_reward"} <= set(logs[0])
    assert logs[0]["grad_norm"] > 0


def test_kto_kl_at_dp2_and_orpo_cpo_are_refused_by_name():
    """KTO's KL term at dp > 1 (its estimate would average other batches than any run without SP), and
    trl.experimental's ORPO / CPO (their losses slice the full [B, S, V] logits), name the reason and the fix."""
    import types

    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    from ulysses_sp.integrations._preference import check_preference
    from ulysses_sp.integrations._support import check_trainer_loss

    kto = types.SimpleNamespace(calculate_KL=True, loss_type="kto")
    with pytest.raises(ValueError, match=r"loss_type='kto' at dp_size=2: .* holds 2 distinct batches.*apo_zero_unpaired"):
        check_preference(kto, ring_size=1, tiled_loss=False, dp_size=2)
    for cls in (ORPOTrainer, CPOTrainer):
        with pytest.raises(ValueError, match=rf"{cls.__name__} .*full \[B, S, V\] logits"):
            check_trainer_loss(object.__new__(cls))

"""TRL's ``KTOTrainer`` and ``RewardTrainer`` through ``prepare(trainer, sp_size=...)`` (issue 34 item 2): a real
trainer on a tiny llama, fp32, against the same trainer in one process without SP. Every logged value of every
step — loss, grad_norm, KTO's kl, rewards/chosen, rejected, margins, logps, logits, entropy, num_tokens; the
reward model's accuracy, margin, min/mean/max reward — and of ``evaluate()`` agrees to float rounding at
dp 1 x sp 2 (measured: see the assertions' tolerances). KTO at dp > 1 is refused (its KL term averages the
micro-step's batches over the processes). The reward rows have varied lengths, so each row's last token (the
score TRL reads) lies on either shard: its gradient is routed back through the gather."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")
pytest.importorskip("trl", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")

from hf_kto_reward_runs import kto_train, reward_train  # noqa: E402
from test_hf_trainer_dpo import TIMING, _assert_same  # noqa: E402


def _assert_exact(pool, run, name: str, **kw) -> list[dict]:
    """dp 1 x sp 2 against one process: every logged value of every step and of evaluate()."""
    want = pool.run(run, 1, 0, **kw)[0]
    sp = pool.run(run, 2, 2, **kw)
    assert all(r["logs"] == sp[0]["logs"] for r in sp), "the SP ranks logged different values"
    got = sp[0]
    assert got["name"] == f"SequenceParallel{name}" and got["restored"] == name
    assert len(got["logs"]) == len(want["logs"]) == kw.get("steps", 2)
    for step, (g, w) in enumerate(zip(got["logs"], want["logs"])):
        _assert_same(g, w, f"step {step + 1}")
    _assert_same(got["eval"], want["eval"], "evaluate()")
    assert set(want["eval"]) - set(TIMING), want["eval"]
    return want["logs"]


@pytest.mark.slow
def test_kto_with_kl_term_sp2_equals_one_process(pool):
    """KTO's default loss: the KL term from mismatched completions (the policy's and the reference's KL passes
    both under SP), a separate reference model, accumulation 2, eval at the end."""
    logs = _assert_exact(pool, kto_train, "KTOTrainer", accum=2, evaluate=True)
    assert {"loss", "grad_norm", "kl", "rewards/chosen", "logps/rejected", "entropy"} <= set(logs[0])
    assert logs[1]["kl"] > 0 and logs[0]["grad_norm"] > 0


@pytest.mark.slow
def test_reward_model_sp2_equals_one_process(pool):
    """RewardTrainer with the reward-centring term, accumulation 2, eval at the end."""
    logs = _assert_exact(pool, reward_train, "RewardTrainer", accum=2, evaluate=True, center_rewards_coefficient=0.01)
    assert {"loss", "grad_norm", "accuracy", "margin", "min_reward", "max_reward"} <= set(logs[0])
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

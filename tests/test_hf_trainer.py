"""Sequence parallelism inside the real ``transformers.Trainer`` and TRL's ``SFTTrainer`` (README,
"From the HF Trainer / TRL"): with ``sp=2`` on 2 gloo processes, every step's logged loss and grad
norm and the eval loss equal the same trainer without SP (gradient accumulation doubled: one SP
group works through both ranks' batches), for plain, packed and completion-only data, and LoRA;
and what cannot run with SP is refused with the fix in the message."""

from __future__ import annotations

import math
import types

import pytest
import torch

pytest.importorskip("accelerate", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")
pytest.importorskip("trl", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")
pytest.importorskip("peft", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")

from hf_runs import VOCAB, right_pad_collator, token_rows, train_and_eval  # noqa: E402
from models import tiny_model  # noqa: E402

from ulysses_sp.data import prepare_batch  # noqa: E402
from ulysses_sp.integrations.transformers import prepare  # noqa: E402


def _assert_same_run(sp: list[dict], ref: list[dict]) -> None:
    # both ranks form one SP group: the same logged numbers
    assert (sp[0]["logs"], sp[0]["eval_loss"]) == (sp[1]["logs"], sp[1]["eval_loss"])
    got, want = sp[0], ref[0]
    assert got["name"].startswith("SequenceParallel") and not want["name"].startswith("SequenceParallel")
    assert len(got["logs"]) == len(want["logs"]) == 3, (got["logs"], want["logs"])
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got["logs"], want["logs"])):
        assert math.isclose(loss, ref_loss, rel_tol=2e-6), (step, got["logs"], want["logs"])
        assert math.isclose(norm, ref_norm, rel_tol=2e-6), (step, got["logs"], want["logs"])
    assert math.isclose(got["eval_loss"], want["eval_loss"], rel_tol=2e-6), (
        got["eval_loss"],
        want["eval_loss"],
    )


@pytest.mark.slow
def test_trainer_sp2_steps_and_eval_equal_trainer_without_sp(pool):
    """Right-padded variable lengths (odd ones padded for SP), token-weighted loss over the step."""
    ref = pool.run(train_and_eval, 2, 0, kind="plain", accum=1)
    sp = pool.run(train_and_eval, 2, 2, kind="plain", accum=2)
    _assert_same_run(sp, ref)
    # prepare() is undone by its handle: the trainer's class and the model's attention come back
    assert sp[0]["restored"] == ("Trainer", "sdpa")


@pytest.mark.slow
def test_trainer_sp2_per_batch_mean_loss_equals_trainer_without_sp(pool):
    """Models without loss kwargs: the Trainer averages per-batch means; SP's gradient rule (P x the
    local share under the Trainer's average over all ranks) gives the same steps."""
    ref = pool.run(train_and_eval, 2, 0, kind="plain", accum=1, token_weighted=False)
    sp = pool.run(train_and_eval, 2, 2, kind="plain", accum=2, token_weighted=False)
    _assert_same_run(sp, ref)


@pytest.fixture(scope="module")
def packed_ref(pool):
    """SFTTrainer without SP on packed batches: the oracle of both packed layouts (Ulysses, ring)."""
    return pool.run(train_and_eval, 2, 0, kind="packed", accum=1)


@pytest.mark.slow
def test_sft_trainer_sp2_packed_batches_equal_sft_without_sp(pool, packed_ref):
    """TRL BFD packing = padding-free batches (documents restart position_ids): document-causal under
    SP; the eval's last, evened-out batch is counted like the run without SP counts it."""
    sp = pool.run(train_and_eval, 2, 2, kind="packed", accum=2)
    _assert_same_run(sp, packed_ref)
    assert sp[0]["name"] == "SequenceParallelSFTTrainer"


@pytest.mark.slow
def test_sft_trainer_ring2_packed_batches_equal_sft_without_sp(pool, packed_ref):
    """The hybrid layout from the Trainer: sp 2 as a ring of 2 (zigzag shards, K/V around the ring)."""
    sp = pool.run(train_and_eval, 2, 2, kind="packed", accum=2, ring_size=2)
    _assert_same_run(sp, packed_ref)


@pytest.mark.slow
def test_sft_trainer_sp2_completion_only_loss_equals_sft_without_sp(pool):
    """Prompt/completion data: TRL masks the prompt tokens; the mask survives the sharding."""
    ref = pool.run(train_and_eval, 2, 0, kind="completion", accum=1)
    sp = pool.run(train_and_eval, 2, 2, kind="completion", accum=2)
    _assert_same_run(sp, ref)


@pytest.mark.slow
def test_lora_sp2_equals_lora_without_sp_and_saves_adapter_files(pool):
    ref = pool.run(train_and_eval, 2, 0, kind="plain", accum=1, lora=True, kv_heads=2)
    sp = pool.run(train_and_eval, 2, 2, kind="plain", accum=2, lora=True, kv_heads=2)
    _assert_same_run(sp, ref)
    assert sp[0]["trained"] == ref[0]["trained"] and all("lora_" in n for n in sp[0]["trained"])
    assert "adapter_model.safetensors" in sp[0]["saved"] and "adapter_config.json" in sp[0]["saved"]


# --------------------------------------------------------------------------- refusals (no process group)
@pytest.fixture
def make_trainer(tmp_path):
    """A real single-process ``Trainer`` on a tiny model, built under accelerate's multi-CPU-free state."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    def build(**kw):
        model = tiny_model("llama", vocab=VOCAB, attn=kw.pop("attn", "sdpa"))
        args = TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", **kw.pop("args", {})
        )
        data = Dataset.from_list(token_rows(4, (8,), seed=0))
        return Trainer(model=model, args=args, train_dataset=data, data_collator=right_pad_collator, **kw)

    with _single_process_accelerate():
        yield build


class _single_process_accelerate:
    """accelerate's singletons reset around an in-process (non-distributed) Trainer."""

    def __enter__(self):
        from accelerate.state import AcceleratorState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()

    def __exit__(self, *exc):
        self.__enter__()


def test_prepare_refuses_deepspeed(make_trainer):
    trainer = make_trainer()
    trainer.args.deepspeed = "ds_config.json"
    with pytest.raises(ValueError, match=r"configured with DeepSpeed.*remove `deepspeed=`"):
        prepare(trainer, sp_size=2)


def test_prepare_refuses_accelerate_parallelism_config(make_trainer):
    trainer = make_trainer()
    trainer.args.parallelism_config = types.SimpleNamespace(sp_size=2, cp_size=1, tp_size=1)
    with pytest.raises(ValueError, match=r"parallelism_config uses \{'sp': 2\}.*remove parallelism_config"):
        prepare(trainer, sp_size=2)


def test_prepare_refuses_an_attention_it_cannot_wrap(make_trainer):
    trainer = make_trainer()
    trainer.model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(
        ValueError, match=r"attn_implementation='paged\|sdpa' cannot run.*attn_implementation='sdpa'"
    ):
        prepare(trainer, sp_size=2)


def test_prepare_refuses_label_smoothing_and_compute_metrics(make_trainer):
    with pytest.raises(
        ValueError, match=r"label_smoothing_factor=0.1 is not supported.*set label_smoothing_factor=0"
    ):
        prepare(make_trainer(args={"label_smoothing_factor": 0.1}), sp_size=2)
    with pytest.raises(
        ValueError, match=r"compute_metrics needs full-sequence logits.*remove compute_metrics"
    ):
        prepare(make_trainer(compute_metrics=lambda p: {}), sp_size=2)


def test_prepare_refuses_a_loss_it_does_not_reproduce(make_trainer):
    trainer = make_trainer()
    trainer.args.loss_type = "dft"  # TRL's SFTConfig field
    with pytest.raises(ValueError, match=r"loss_type='dft' is not reproduced.*set loss_type='nll'"):
        prepare(trainer, sp_size=2)


def test_prepare_refuses_a_prompt_learning_adapter(make_trainer):
    """Prompt tuning's virtual tokens would go before each rank's shard, not before the sequence."""
    from peft import PromptTuningConfig, get_peft_model

    trainer = make_trainer()
    trainer.model = get_peft_model(trainer.model, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match=r"Trainer with a prompt-learning PEFT adapter .*use LoRA"):
        prepare(trainer, sp_size=2)


def test_prepare_refuses_a_model_hiding_a_sequence_mixer(make_trainer):
    """The closed-world guard runs in prepare(), before any process group is needed."""
    from hidden_mixer import ConvMLP

    trainer = make_trainer()
    trainer.model.model.layers[0].mlp = ConvMLP(trainer.model.config)
    with pytest.raises(
        ValueError, match=r"layer 0: mlp.conv \(Conv1d\) mixes tokens along the sequence \(Conv1d, kernel 3\)"
    ):
        prepare(trainer, sp_size=2)


def test_readme_trainer_script_is_the_example_file():
    """The Trainer guide's script (docs/readme/hf.md) is examples/hf_trainer_sp.py verbatim (the
    docs' script test runs it as documented)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    example = (root / "examples" / "hf_trainer_sp.py").read_text()
    assert f"```python\n{example}```" in (root / "docs" / "readme" / "hf.md").read_text()


def test_prepare_without_a_process_group_says_how_to_launch(make_trainer):
    with pytest.raises(ValueError, match=r"needs an initialized torch.distributed process group.*torchrun"):
        prepare(make_trainer(), sp_size=2)


def test_left_padded_batch_is_refused_naming_the_fix():
    """The SP path drops attention_mask: exact for right padding, wrong for left padding."""
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(
        ValueError, match=r"attention_mask rows \[0\] have padding before real tokens.*padding_side"
    ):
        prepare_batch({"input_ids": ids, "attention_mask": mask}, 2)
    prepare_batch({"input_ids": ids, "attention_mask": mask.flip(1)}, 2)  # right padding is fine

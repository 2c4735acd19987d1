"""Trainers and kernels the SP Trainer path does not reproduce are refused by ``prepare()`` with the
reason (issue 25 item 5): the ``DPOTrainer`` options its SP path does not cover (a real trainer, built
on a tiny model), any subclass with its own ``compute_loss``, Liger kernels on the CPU. No process
group is needed: the checks run before any collective."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")
pytest.importorskip("trl", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")

from hf_runs import VOCAB, right_pad_collator, token_rows  # noqa: E402
from models import tiny_model  # noqa: E402
from test_hf_trainer import _single_process_accelerate  # noqa: E402

from ulysses_sp.integrations.transformers import prepare  # noqa: E402


@pytest.fixture
def single_process():
    with _single_process_accelerate():
        yield


def test_prepare_refuses_dpo_options_it_does_not_reproduce_naming_them(single_process, tmp_path):
    """DPOTrainer itself runs with SP (``test_hf_trainer_dpo``); what its SP path does not cover is
    refused by name before any collective: tiled_loss (TRL's fused head is tiled already), a ring
    layout (zigzag shards), a subclass with its own loss."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from ulysses_sp.tasks.tokenizer import byte_tokenizer

    class MyDPOTrainer(DPOTrainer):
        def _compute_loss(self, model, inputs, return_outputs):
            return super()._compute_loss(model, inputs, return_outputs)

    rows = [
        {"prompt": "say a", "chosen": " a", "rejected": " b"},
        {"prompt": "say c", "chosen": " c", "rejected": " d"},
    ]
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], save_strategy="no")
    trainers = [
        cls(
            model=tiny_model("llama", vocab=VOCAB),
            ref_model=tiny_model("llama", vocab=VOCAB),  # given: nothing is loaded from a hub
            args=args,
            processing_class=byte_tokenizer(),
            train_dataset=Dataset.from_list(rows),
        )
        for cls in (DPOTrainer, MyDPOTrainer)
    ]
    with pytest.raises(ValueError, match=r"tiled_loss does not apply to DPOTrainer: TRL's fused LM head"):
        prepare(trainers[0], sp_size=2, tiled_loss=True)
    with pytest.raises(ValueError, match=r"DPOTrainer under a ring \(ring_size=2\) is not supported"):
        prepare(trainers[0], sp_size=2, ring_size=2)
    with pytest.raises(ValueError, match=r"MyDPOTrainer \(through .*MyDPOTrainer\) overrides \['_compute_loss'\]"):
        prepare(trainers[1], sp_size=2)
    assert type(trainers[0]) is DPOTrainer  # untouched
    with pytest.raises(ValueError, match=r"needs an initialized torch.distributed process group"):
        prepare(trainers[0], sp_size=2)  # the rest passes the checks


def test_prepare_refuses_a_subclass_with_its_own_loss(single_process, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    class WeightedTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 2 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class LoggingTrainer(Trainer):  # overrides something else: accepted
        def log(self, logs, start_time=None):
            super().log(logs, start_time)

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no")
    data = Dataset.from_list(token_rows(4, (8,), seed=0))
    model = tiny_model("llama", vocab=VOCAB)
    weighted = WeightedTrainer(model=model, args=args, train_dataset=data, data_collator=right_pad_collator)
    with pytest.raises(
        ValueError, match=r"WeightedTrainer.*defines its own compute_loss, which prepare\(\) would replace"
    ):
        prepare(weighted, sp_size=2)
    logging_trainer = LoggingTrainer(
        model=model, args=args, train_dataset=data, data_collator=right_pad_collator
    )
    # passes the loss check; stops only at the missing process group
    with pytest.raises(ValueError, match=r"needs an initialized torch.distributed process group"):
        prepare(logging_trainer, sp_size=2)


def test_prepare_refuses_liger_kernels_on_cpu(single_process, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no")
    trainer = Trainer(
        model=tiny_model("llama", vocab=VOCAB),
        args=args,
        train_dataset=Dataset.from_list(token_rows(4, (8,), seed=0)),
        data_collator=right_pad_collator,
    )
    # set after construction: the Trainer itself refuses use_liger_kernel when liger_kernel is missing
    trainer.args.use_liger_kernel = True
    with pytest.raises(
        ValueError,
        match=r"use_liger_kernel=True: Liger's kernels are Triton, GPU only.*use_liger_kernel=False",
    ):
        prepare(trainer, sp_size=2)


def test_prepare_at_sp_1_refuses_packed_sequences_a_module_would_mix_across_documents(single_process, tmp_path):
    """TRL's padding-free packing at sp 1: documents stay apart only through the SP attention and the
    mixer handlers; Doge's MoE router pairs each token with others of the row (its logits reshaped to
    ``(2, B*S, K)``), so it is refused."""
    import sys
    from pathlib import Path

    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.model_sweep import tiny_config
    from ulysses_sp.tasks.tokenizer import byte_tokenizer

    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                     packing=True, padding_free=True, max_length=16, router_aux_loss_coef=0.0)  # fmt: skip
    data = Dataset.from_list([{"input_ids": r["input_ids"]} for r in token_rows(4, (8,), seed=0)])
    config = tiny_config("doge")
    config.is_moe, config.num_experts = True, 16
    model = AutoModelForCausalLM.from_config(config).train()
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=byte_tokenizer())
    with pytest.raises(ValueError, match=r"(?s)packed sequences \(SFTConfig packing / padding_free\) cannot be "
                       r"kept apart in DogeForCausalLM.*mlp \(DogeCDMoE\)"):  # fmt: skip
        prepare(trainer, sp_size=1)


def test_the_moe_aux_loss_refusal_names_the_fix_that_works(single_process, tmp_path):
    import sys
    from pathlib import Path

    """TRL 1.16 sets output_router_logits from router_aux_loss_coef (Mixtral's config: 0.001), so the
    fix is the SFTConfig's coefficient; applied, prepare() goes on to its next step (the process group)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from ulysses_sp.tasks.tokenizer import byte_tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.model_sweep import build

    data = Dataset.from_list([{"input_ids": r["input_ids"]} for r in token_rows(4, (8,), seed=0)])

    def trainer(**kw):
        args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], save_strategy="no", **kw)
        model = build("mixtral")
        return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=byte_tokenizer())

    with pytest.raises(ValueError, match=r"MoE auxiliary \(load-balancing\) loss .*set router_aux_loss_coef=0.0"):
        prepare(trainer(), sp_size=2)
    with pytest.raises(ValueError, match=r"needs an initialized torch.distributed process group"):
        prepare(trainer(router_aux_loss_coef=0.0), sp_size=2)  # the loss check passes


def test_readme_shows_the_fsdp2_config_file():
    """The Trainer guide's (docs/readme/hf.md) accelerate + FSDP2 config is examples/accelerate_fsdp2.yaml (the file the launch test
    runs), less its comment header."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    lines = (root / "examples" / "accelerate_fsdp2.yaml").read_text().splitlines(keepends=True)
    body = "".join(line for line in lines if not line.startswith("#"))
    assert f"```yaml\n{body}```" in (root / "docs" / "readme" / "hf.md").read_text()


def test_the_dpo_and_grpo_guides_show_the_example_files():
    """The DPO and GRPO sections of the Trainer guide (docs/readme/hf.md) show examples/dpo_sp.py and
    examples/grpo_sp.py verbatim; the examples test runs the shown scripts with torchrun at sp 2."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    for name in ("dpo_sp.py", "grpo_sp.py"):
        example = (root / "examples" / name).read_text()
        assert f"```python\n{example}```" in (root / "docs" / "readme" / "hf.md").read_text(), name

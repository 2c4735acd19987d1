"""The typed config: batch arithmetic, parsing, and every error message (pure, no process group)."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from ulysses_sp.config import TrainingConfig, load_config
from ulysses_sp.config.batch import BatchSizes, resolve_batch_sizes
from ulysses_sp.config.sections import SCHEDULERS, OptimizerConfig, SchedulerConfig, ZeroConfig

# ---- batch arithmetic: train_batch_size = micro * grad_accum * dp_world_size ----


@pytest.mark.parametrize(
    "given, want",
    [
        (
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
            (16, 2, 4),
        ),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, (16, 2, 4)),
        ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, (16, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, (30, 3, 5)),
        ({"train_batch_size": 8}, (8, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 3}, (6, 3, 1)),
    ],
)
def test_any_two_batch_sizes_determine_the_third(given, want):
    got = resolve_batch_sizes(2, **given)
    assert got == BatchSizes(
        train_batch_size=want[0],
        train_micro_batch_size_per_gpu=want[1],
        gradient_accumulation_steps=want[2],
        dp_world_size=2,
    )
    assert got.train_batch_size == got.train_micro_batch_size_per_gpu * got.gradient_accumulation_steps * 2


@pytest.mark.parametrize(
    "dp, given, match",
    [
        (
            2,
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
            r"train_batch_size \(16\) != train_micro_batch_size_per_gpu \(2\) \* gradient_accumulation_steps \(2\) "
            r"\* dp_world_size \(2\) = 8",
        ),
        (
            4,
            {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2},
            r"train_batch_size \(10\) is not divisible by train_micro_batch_size_per_gpu \(2\) \* dp_world_size "
            r"\(4\) = 8",
        ),
        (
            2,
            {"train_batch_size": 10, "gradient_accumulation_steps": 3},
            r"train_batch_size \(10\) is not divisible by gradient_accumulation_steps \(3\) \* dp_world_size \(2\) = 6",
        ),
        (
            3,
            {"train_batch_size": 4},
            r"train_batch_size \(4\) is not divisible by .* dp_world_size \(3\) = 3",
        ),
        (2, {"gradient_accumulation_steps": 2}, r"give train_batch_size or train_micro_batch_size_per_gpu"),
        (2, {}, r"give train_batch_size or train_micro_batch_size_per_gpu"),
        (2, {"train_batch_size": 0}, r"train_batch_size must be >= 1, got 0"),
        (
            2,
            {"train_micro_batch_size_per_gpu": 1.5},
            r"train_micro_batch_size_per_gpu must be a positive int, got 1.5",
        ),
        (0, {"train_batch_size": 4}, r"dp_world_size must be >= 1, got 0"),
    ],
)
def test_bad_batch_sizes_name_every_number(dp, given, match):
    with pytest.raises(ValueError, match=match):
        resolve_batch_sizes(dp, **given)


def test_config_batch_sizes_uses_its_keys():
    cfg = load_config({"train_batch_size": 32, "gradient_accumulation_steps": 4})
    assert cfg.batch_sizes(4).train_micro_batch_size_per_gpu == 2
    with pytest.raises(ValueError, match=r"train_batch_size \(32\) is not divisible"):
        cfg.batch_sizes(3)


# ---- parsing ----

FULL = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "sequence_parallel_size": 4,
    "data_parallel_size": 2,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "partition": "all"},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
}


def test_full_config_parses_into_typed_sections():
    cfg = load_config(FULL)
    assert cfg.zero_optimization == ZeroConfig(stage=3, partition="all")
    assert cfg.optimizer.optimizer_class.__name__ == "AdamW"
    assert cfg.optimizer.params["betas"] == (0.9, 0.95)  # JSON list -> the tuple torch expects
    assert cfg.scheduler.kwargs == {
        **SCHEDULERS["WarmupCosineLR"],
        "warmup_num_steps": 10,
        "total_num_steps": 100,
    }
    assert (cfg.sequence_parallel_size, cfg.data_parallel_size, cfg.gradient_clipping) == (4, 2, 1.0)
    assert load_config(cfg) is cfg
    assert load_config(cfg.to_dict()) == cfg


def test_defaults_and_case_insensitive_names():
    cfg = load_config(
        {"train_batch_size": 1, "optimizer": {"type": "sgd"}, "scheduler": {"type": "warmuplr", "params": {}}}
    )
    assert cfg.zero_optimization == ZeroConfig(stage=0, partition="data_parallel")
    assert cfg.gradient_clipping == 0.0
    assert cfg.optimizer.optimizer_class.__name__ == "SGD"
    assert cfg.scheduler.type == "WarmupLR"
    assert load_config({"train_batch_size": 1, "optimizer": None, "scheduler": None}).optimizer is None


def test_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(FULL))
    assert load_config(str(path)) == load_config(FULL) == load_config(path)


def test_json_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_config(bad)


def test_configs_are_frozen_and_keyword_only():
    cfg = load_config(FULL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gradient_clipping = 2.0
    with pytest.raises(TypeError):
        ZeroConfig(3)
    for cls in (TrainingConfig, ZeroConfig, OptimizerConfig, SchedulerConfig, BatchSizes):
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls


@pytest.mark.parametrize(
    "config, match",
    [
        ({"train_batch_sise": 8}, r"unknown config key 'train_batch_sise'; did you mean 'train_batch_size'\?"),
        ({"zero_optimization": {"stgae": 2}}, r"unknown config key 'zero_optimization.stgae'; did you mean 'stage'"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1, "weight_decy": 0}}}, r"'optimizer.params.weight_decy'; did you mean 'weight_decay'"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}}, r"'scheduler.params.warmup_steps'; did you mean 'warmup_num_steps'"),
        ({"zzz": 1}, r"unknown config key 'zzz'; known keys: "),
        ({"amp": {"enabled": True}}, r"'amp' is a DeepSpeed option that ulysses-sp does not implement"),
        ({"zero_optimization": {"stage": 2, "overlap_comm": True}}, r"'zero_optimization.overlap_comm' is a DeepSpeed option"),
        ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage must be one of \(0, 1, 2, 3\), got 4"),
        ({"zero_optimization": {"stage": -1}}, r"zero_optimization.stage must be one of .*got -1"),
        ({"zero_optimization": {"stage": "3"}}, r"zero_optimization.stage must be one of .*got '3'"),
        ({"zero_optimization": {"stage": True}}, r"zero_optimization.stage must be one of .*got True"),
        ({"zero_optimization": {"partition": "sequence_parallel"}}, r"partition must be one of \('data_parallel', 'all'\)"),
        ({"zero_optimization": 3}, r"zero_optimization must be a dict, got 3"),
        ({"optimizer": {"type": "Lion"}}, r"optimizer.type must be one of Adam, AdamW, SGD, got 'Lion'"),
        ({"optimizer": {"params": {"lr": 1}}}, r"optimizer needs a 'type'"),
        ({"optimizer": {"type": "SGD", "params": 0.1}}, r"optimizer.params must be a dict, got 0.1"),
        ({"scheduler": {"type": "OneCycle"}}, r"scheduler.type must be one of WarmupLR, WarmupDecayLR, WarmupCosineLR"),
        ({"scheduler": {"type": "WarmupDecayLR"}}, r"scheduler.params.total_num_steps must be a positive int, got None"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}}, r"warmup_type must be 'log' or 'linear'"),
        ({"gradient_clipping": -1}, r"gradient_clipping must be a finite number >= 0 \(0 = off\), got -1"),
        ({"gradient_clipping": float("nan")}, r"gradient_clipping must be a finite number"),
        ({"gradient_clipping": "1.0"}, r"gradient_clipping must be a finite number .*got '1.0'"),
        ({"sequence_parallel_size": 0}, r"sequence_parallel_size must be >= 1, got 0"),
        ({"data_parallel_size": 2.0}, r"data_parallel_size must be a positive int, got 2.0"),
        ({"train_batch_size": "auto"}, r"train_batch_size must be a positive int, got 'auto'"),
        ([("train_batch_size", 1)], r"config must be a dict, a JSON file path or a TrainingConfig, got list"),
    ],
)  # fmt: skip
def test_bad_config_raises_value_error_naming_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        load_config(config)


def test_scheduler_table_matches_the_scheduler_classes():
    from ulysses_sp.engine.schedulers import SCHEDULER_CLASSES

    assert set(SCHEDULER_CLASSES) == set(SCHEDULERS)
    for name, defaults in SCHEDULERS.items():
        params = inspect.signature(SCHEDULER_CLASSES[name]).parameters
        assert set(params) - {"optimizer", "last_epoch"} == set(defaults), name
        for key, value in defaults.items():
            if value is not None:
                assert params[key].default == value, (name, key)

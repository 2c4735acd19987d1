"""The train command's settings: the optimizer recipe, the engine config it builds, the checks shared
with ``eval``, the validation vocabulary and the one DataLoader path (pure, no process group)."""

from __future__ import annotations

import json

import pytest

from ulysses_sp.checks import optional_positive_int, positive_int
from ulysses_sp.cli.args import build_parser, train_options
from ulysses_sp.cli.evaluate import EvalConfig, validate_eval
from ulysses_sp.cli.main import main
from ulysses_sp.config import TrainingConfig
from ulysses_sp.data import sp_data_sampler, sp_dataloader
from ulysses_sp.run.checks import check_recipe
from ulysses_sp.run.config import RunConfig, config_from_dict
from ulysses_sp.run.resolve import validate


def _previous_recipe(steps: int, lr: float = 1e-2, warmup: int | None = None) -> dict:
    """The engine config ``train.py`` hard-coded before the recipe became ``RunConfig`` fields."""
    warmup = warmup if warmup is not None else max(1, min(20, steps // 10))
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": max(steps, warmup),
                "warmup_num_steps": warmup,
                "warmup_min_ratio": 0.05,
                "cos_min_ratio": 0.1,
                "warmup_type": "linear",
            },
        },
    }


@pytest.mark.parametrize("steps, warmup", [(300, None), (8, None), (50, 7), (3, 5)])
def test_default_recipe_is_the_previous_hard_coded_one(steps, warmup):
    cfg = RunConfig(steps=steps, warmup_steps=warmup)
    assert cfg.training_config() == TrainingConfig.from_dict(_previous_recipe(steps, warmup=warmup))


def test_recipe_fields_reach_the_engine_config():
    cfg = RunConfig(steps=100, lr=3e-4, betas=(0.8, 0.99), weight_decay=0.1, warmup_ratio=0.05,
                      warmup_min_ratio=0.0, cos_min_ratio=0.2, warmup_type="log", zero_stage=3, grad_accum=2)  # fmt: skip
    tc = cfg.training_config(4)
    assert tc.optimizer.params == {"lr": 3e-4, "betas": (0.8, 0.99), "weight_decay": 0.1}
    assert tc.scheduler.kwargs == {"total_num_steps": 100, "warmup_num_steps": 5, "warmup_min_ratio": 0.0,
                                   "cos_min_ratio": 0.2, "warmup_type": "log"}  # fmt: skip
    assert (tc.zero_optimization.stage, tc.gradient_accumulation_steps) == (3, 2)


def test_safe_defaults_partition_over_every_rank_at_dp1_and_a_fine_tuning_recipe_for_a_model_dir():
    """At ZeRO >= 1 with dp 1 the default partition (auto) is every rank, not a DP axis of one rank that
    shards nothing (said loudly when asked for); a model directory defaults to lr 1e-5 and micro-batch 1
    (fine-tuning on long sequences), a preset keeps the recall task's 1e-2 and 8."""
    from ulysses_sp.run.config import unpartitioned_warning, zero_note

    cfg = RunConfig(sp=4, zero_stage=3)
    assert cfg.zero_partition == "auto" and cfg.partition_for(4) == "all" and cfg.partition_for(8) == "data_parallel"
    assert cfg.training_config(4).zero_optimization.partition == "all"
    assert cfg.training_config(8).zero_optimization.partition == "data_parallel"
    with pytest.raises(ValueError, match="depends on the world size: training_config"):
        cfg.training_config()
    assert zero_note(cfg, 4) == "ZeRO stage 3, partitioned over 4 rank(s) (all dp x sp ranks, --zero-partition all)"
    assert unpartitioned_warning(cfg, 4) is None
    asked = RunConfig(sp=4, zero_stage=1, zero_partition="data_parallel")
    assert asked.partition_for(4) == "data_parallel" and "NOTHING IS PARTITIONED" in zero_note(asked, 4)
    assert "each of the 4 ranks holds the whole model's" in unpartitioned_warning(asked, 4)
    assert unpartitioned_warning(asked, 8) is None and RunConfig(sp=4).partition_for(4) == "data_parallel"
    assert (RunConfig().lr, RunConfig().micro_batch_size) == (1e-2, 8)
    own = RunConfig(model="/models/my-llama")
    assert (own.lr, own.micro_batch_size) == (1e-5, 1)
    assert (RunConfig(model="/m", lr=3e-4, micro_batch_size=2).lr, config_from_dict({"model": "/m"}).lr) == (3e-4, 1e-5)


@pytest.mark.parametrize(
    "steps, ratio, want",
    [
        (100, 0.05, 5),
        (10, 0.15, 2),
        (10, 0.0, 1),
        (7, 1.0, 7),
        (1000, 0.1, 100),
        (30, 0.1, 3),
        (100, 0.07, 7),
    ],
)
def test_warmup_ratio_is_ceil_of_a_fraction_of_steps_at_least_one(steps, ratio, want):
    assert RunConfig(steps=steps, warmup_ratio=ratio).warmup_num_steps == want


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"betas": (1.0, 0.9)}, r"--betas must be a number in \[0, 1\), got 1.0"),
        ({"betas": (0.9, -0.1)}, r"--betas must be a number in \[0, 1\), got -0.1"),
        ({"betas": (0.9,)}, r"--betas must be two numbers B1,B2, got \(0.9,\)"),
        ({"betas": (0.9, "0.95")}, r"--betas must be a number in \[0, 1\), got '0.95'"),
        ({"weight_decay": -0.1}, r"--weight-decay must be a finite number >= 0, got -0.1"),
        ({"weight_decay": float("nan")}, r"--weight-decay must be a finite number >= 0, got nan"),
        ({"warmup_ratio": 1.5}, r"--warmup-ratio must be a number in \[0, 1\], got 1.5"),
        ({"warmup_steps": 0}, r"--warmup-steps must be >= 1, got 0"),
        ({"warmup_steps": 2.5}, r"--warmup-steps must be a positive int, got 2.5 \(float\)"),
        (
            {"warmup_steps": 10, "warmup_ratio": 0.1},
            r"--warmup-steps \(10\) and --warmup-ratio \(0.1\) both set the warmup; pass one of them",
        ),
        ({"warmup_min_ratio": 2}, r"--warmup-min-ratio must be a number in \[0, 1\], got 2"),
        ({"cos_min_ratio": -1}, r"--cos-min-ratio must be a number in \[0, 1\], got -1"),
        ({"warmup_type": "cosine"}, r"--warmup-type must be 'linear' or 'log', got 'cosine'"),
        ({"lr": 0.0}, r"--lr must be > 0, got 0.0"),
    ],
)
def test_bad_recipe_raises_naming_the_flag(fields, match):
    with pytest.raises(ValueError, match=match):
        check_recipe(RunConfig(**fields))
    with pytest.raises(ValueError, match=match):  # validate checks it before model, data, output dir
        validate(RunConfig(**fields), 2)


def test_recipe_flags_and_json_config(tmp_path):
    ns = build_parser().parse_args(
        ["train", "--betas", "0.8,0.99", "--weight-decay", "0.1", "--warmup-ratio", "0.2"]
    )
    cfg, _ = train_options(ns)
    assert (cfg.betas, cfg.weight_decay, cfg.warmup_ratio, cfg.warmup_steps) == ((0.8, 0.99), 0.1, 0.2, None)
    assert cfg.training_config().optimizer.params["betas"] == (0.8, 0.99)
    (tmp_path / "c.json").write_text(json.dumps({"betas": [0.5, 0.6], "warmup-min-ratio": 0.0}))
    cfg, _ = train_options(build_parser().parse_args(["train", "--config", str(tmp_path / "c.json")]))
    assert (cfg.betas, cfg.warmup_min_ratio) == ((0.5, 0.6), 0.0)
    assert config_from_dict({"betas": [0.9, 0.95]}) == RunConfig()


def test_bad_recipe_flags_exit_2_before_launch(capsys, tmp_path):
    out = ["--output-dir", str(tmp_path / "run")]
    for argv, message in [
        (["--warmup-steps", "5", "--warmup-ratio", "0.1"], "both set the warmup; pass one of them"),
        (["--betas", "0.9,1"], "--betas must be a number in [0, 1), got 1.0"),
        (["--betas", "0.9"], "expected two numbers B1,B2 (e.g. 0.9,0.95), got '0.9'"),
        (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0, got -1.0"),
        (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["train", *argv, *out])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_train_and_eval_share_their_checks():
    with pytest.raises(ValueError, match=r"--nproc / world size \(3\) is not divisible by --sp \(2\)"):
        validate_eval(EvalConfig(models=("tiny-llama",), sp=2), 3)
    with pytest.raises(ValueError, match=r"--attn must be one of \('sdpa', 'eager'"):
        validate_eval(EvalConfig(models=("tiny-llama",), attn="flash"), 1)
    with pytest.raises(ValueError, match=r"--bins must be >= 1, got 0"):
        validate_eval(EvalConfig(models=("tiny-llama",), bins=0), 1)
    with pytest.raises(
        ValueError, match=r"^--seq-len 30 is not divisible by 4 \(sp 4\); use a multiple of 4, e.g. 32$"
    ):
        validate_eval(EvalConfig(models=("tiny-llama",), seq_len=30, sp=4), 4)
    with pytest.raises(ValueError, match=r"--seq-len must be a positive int, got 1.5 \(float\)"):
        validate(RunConfig(seq_len=1.5), 2)
    with pytest.raises(ValueError, match=r"--save-every must be >= 0, got -1"):
        validate(RunConfig(save_every=-1), 2)
    with pytest.raises(ValueError, match=r"--memory-every must be >= 1, got 0"):
        validate(RunConfig(memory_every=0), 2)


def test_positive_int_vocabulary():
    assert positive_int("n", 3) == 3 and positive_int("n", 0, minimum=0) == 0
    assert optional_positive_int("n", None) is None
    for value, match in [(0, r"n must be >= 1, got 0"), (1.5, r"n must be a positive int, got 1.5 \(float\)"),
                         (True, r"n must be a positive int, got True \(bool\)")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            positive_int("n", value)
    with pytest.raises(ValueError, match=r"n must be an int >= 0, got '1' \(str\)"):
        positive_int("n", "1", minimum=0)


@pytest.mark.parametrize("dp_rank, sp_rank", [(0, 0), (1, 1)])
def test_sp_dataloader_resumes_where_the_sampler_left_off(dp_rank, sp_rank):
    data = [{"input_ids": [i]} for i in range(48)]
    place = {"dp_size": 2, "sp_size": 2, "dp_rank": dp_rank, "sp_rank": sp_rank}
    full = list(sp_dataloader(data, batch_size=3, seed=5, epoch=1, **place))
    sampler = sp_data_sampler(data, batch_size=3, seed=5, **place)
    sampler.set_epoch(1)
    assert [b["input_ids"][0].tolist() for b in full] == [
        [data[i]["input_ids"][0] for i in list(sampler)[j : j + 3]] for j in range(0, 12, 3)
    ]
    rest = list(sp_dataloader(data, batch_size=3, seed=5, epoch=1, start_batch=2, **place))
    assert [b["input_ids"][0].tolist() for b in rest] == [b["input_ids"][0].tolist() for b in full[2:]]
    with pytest.raises(ValueError, match=r"start_batch must be >= 0, got -1"):
        sp_dataloader(data, batch_size=3, start_batch=-1, **place)
    with pytest.raises(ValueError, match=r"batch_size must be >= 1, got 0"):
        sp_dataloader(data, batch_size=0, **place)

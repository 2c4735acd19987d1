"""``plan`` and ``train``, one judge (``cli.plan_judge``, issue 32): every setting ``plan`` offers
passes ``train``'s own pre-launch resolution, and no technique train refuses is offered or credited.

The fuzz: tiny model directories of the families whose settings ``plan`` got wrong (hybrids with
Mamba-2, linear attention and convolutions, MoE with fused expert tensors, sinks, no RMSNorm, pure
Mamba-2, a VLM) and budgets (devices, memory, a fixed length or ``--max``); each recommendation's
command line is parsed by ``train``'s parser and checked by what the launcher runs before it
starts workers (``cli.main._check_before_launch``: ``run.resolve.resolve_run`` with the model on the
meta device). In-process, no worker, no training.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from family_models import COMMON, FAMILIES  # noqa: E402
from hybrid_models import hybrid_config  # noqa: E402
from test_prelaunch_model import save_model_dir  # noqa: E402

from bench.model_sweep import tiny_config  # noqa: E402
from ulysses_sp.cli import main as cli  # noqa: E402
from ulysses_sp.cli.args import build_parser, train_options  # noqa: E402

BUDGETS = [  # (devices, memory per rank, --seq-len or None for --max)
    (1, "2GB", None), (2, "2GB", 64), (4, "2GB", 128), (4, "60MB", None), (8, "1GB", 256),
]  # fmt: skip


def _text_configs() -> dict:
    from transformers import AutoConfig

    return {
        "llama": AutoConfig.for_model("llama", **{**COMMON, "num_key_value_heads": 2}),
        "gpt_oss": AutoConfig.for_model("gpt_oss", **{**COMMON, **FAMILIES["gpt_oss"], "num_key_value_heads": 2}),
        "nemotron_h": hybrid_config("nemotron_h"),
        "granite_hybrid": hybrid_config("granitemoehybrid"),
        "lfm2": hybrid_config("lfm2"),
        "mamba2": hybrid_config("mamba2"),
        "gpt_neox": tiny_config("gpt_neox"),
        "jamba": tiny_config("jamba"),
        "doge": _doge_moe(),
        "qwen3_next": tiny_config("qwen3_next"),
        "kimi_linear": tiny_config("kimi_linear"),
    }


def _doge_moe():
    """Doge with its MoE MLP (``is_moe``): the router pairs each token with others of the row (refused at sp > 1)."""
    config = tiny_config("doge")
    config.is_moe, config.num_experts = True, 16
    return config


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from vlm_models import save_vlm_dir

    root = tmp_path_factory.mktemp("plan-judge")
    dirs = {name: save_model_dir(root / name, config) for name, config in _text_configs().items()}
    save_vlm_dir(str(root / "qwen2_5_vl"))
    dirs["qwen2_5_vl"] = str(root / "qwen2_5_vl")
    return dirs


def _plan(model: str, gpus: int, memory: str, seq_len: int | None) -> dict:
    from ulysses_sp.cli.plan import run_plan

    argv = ["plan", "--model", model, "--gpus", str(gpus), "--device", "cpu", "--memory", memory, "--json"]
    argv += ["--seq-len", str(seq_len)] if seq_len else []
    return json.loads(run_plan(build_parser().parse_args(argv)))


def _train_refusal(args: list[str], out: Path) -> str | None:
    """What ``train``'s launcher says of ``args`` before it would start workers (``None``: it would)."""
    from ulysses_sp.run.checks import check_model, check_train_options
    from ulysses_sp.run.model_checks import check_model_run
    from ulysses_sp.run.vlm import check_vlm_options, is_vlm_config
    from ulysses_sp.tasks import load_tokenizer

    vlm = ["--data", "chat.jsonl"] if "qwen2_5_vl" in args[3] else []  # plan's notes: a VLM run adds its data
    ns = build_parser().parse_args([*args[1:], "--output-dir", str(out), "--steps", "1", *vlm])
    try:
        cfg, launch = train_options(ns)
        nproc = launch.get("nproc", cfg.sp)
        tokenizer = load_tokenizer(None, cfg.model)
        mcfg, ring = check_model(cfg.model, tokenizer, sp=cfg.sp, seq_len=cfg.seq_len, ring_size=cfg.ring_size,
                                 sharded_load=cfg.zero_stage >= 2, require_weights=True)  # fmt: skip
        if is_vlm_config(mcfg):  # a VLM's data is chat JSONL with images: its options and model, not its data
            check_train_options(cfg)
            check_vlm_options(cfg)
            check_model_run(cfg, mcfg, ring_size=ring)
        else:  # the launcher's own pre-launch path, whole
            cli._check_before_launch("train", cfg, nproc)
    except ValueError as e:
        return str(e)
    return None


def test_every_plan_recommendation_is_accepted_by_train(model_dirs, tmp_path):
    checked, refused, withheld = 0, [], 0
    for name, path in model_dirs.items():
        for i, (gpus, memory, seq_len) in enumerate(BUDGETS):
            doc = _plan(path, gpus, memory, seq_len)
            withheld += sum("not offered" in n for n in doc["notes"])
            best = doc["recommended"]
            if best is None:
                continue
            checked += 1
            why = _train_refusal(best["train_args"], tmp_path / f"{name}-{i}")
            if why is not None:
                refused.append(f"{name} {gpus}x{memory} S={seq_len}: {' '.join(best['train_args'])}: {why}")
    assert not refused, "\n".join(refused)
    assert checked >= 40 and withheld > 0, (checked, withheld)


def test_techniques_train_refuses_are_neither_offered_nor_credited(model_dirs):
    cases = {"gpt_neox": "recompute_norms", "granite_hybrid": "tiled_mlp",  # Nemotron-H's MLP blocks are tiled now
             "gpt_oss": "tiled_mlp", "qwen2_5_vl": "tiled_mlp"}  # fmt: skip
    for name, technique in cases.items():
        doc = _plan(model_dirs[name], 2, "2GB", 64)
        assert doc["candidates"], name
        assert not any(c["settings"].get(technique) for c in doc["candidates"]), name
        assert any(f"--{technique.replace('_', '-')} not offered" in n for n in doc["notes"]), doc["notes"]


def test_sp_and_zero_stages_train_refuses_are_not_offered(model_dirs):
    doc = _plan(model_dirs["doge"], 4, "2GB", 64)  # the guard refuses sp > 1 (its MoE router mixes tokens)
    assert {c["settings"]["sp"] for c in doc["candidates"]} == {1}
    doc = _plan(model_dirs["jamba"], 4, "2GB", 64)  # its Mamba-1 mixers shard by channel (mixers.mamba1)
    assert {c["settings"]["sp"] for c in doc["candidates"]} > {1}
    for name in ("qwen3_next", "kimi_linear"):  # fused tensors: ZeRO 2/3's sharded load refuses the directory
        doc = _plan(model_dirs[name], 4, "2GB", 64)
        assert doc["candidates"] and {c["settings"]["zero_stage"] for c in doc["candidates"]} <= {0, 1}, name
    doc = _plan(model_dirs["gpt_oss"], 2, "2GB", 64)  # sdpa: transformers has none for gpt-oss
    assert doc["recommended"]["settings"]["attn"] == "eager"


def test_plan_refuses_non_finite_hardware_numbers(capsys):
    for flag in ("--tflops", "--link-gbps", "--mfu"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["plan", flag, "inf", "--json"])
        assert exit_.value.code == 2
        assert f"{flag} must be a finite number > 0, got inf" in capsys.readouterr().err

"""Resume on another layout: (dp 2, sp 1, ZeRO 3) -> (dp 1, sp 2, ZeRO 1) -> (dp 1, sp 1, ZeRO 0).

The global batch is the same 4 samples per step in every layout, so the resumed losses equal an
uninterrupted single-process run's within fp32 rounding (AdamW + a warmup/cosine schedule: the
optimizer state and the schedule carry over, or the losses would drift from step 2 on). The first
checkpoint's HF export is sharded (a tiny ``max_shard_bytes``) and saved in bf16: plain
transformers loads it, and it equals the fp32 master weights rounded to bf16.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from models import global_batch, shift, tiny_model
from torch.distributed.tensor import DTensor

from ulysses_sp import tasks
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.engine import initialize
from ulysses_sp.parallel.mesh import init_mesh
from ulysses_sp.state import checkpoint as ckpt

G, S = 4, 16  # global batch, sequence length
MANIFEST = {"world": {}, "run": {}, "model_config": {}}


def _engine(dp: int, sp: int, stage: int):
    mesh = init_mesh((dp, sp))
    model = tiny_model("llama", seed=3)  # the resumed layouts overwrite these weights from the checkpoint
    reg = (
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, G // dp, mesh=mesh)
        if sp > 1
        else None
    )
    config = {
        "train_micro_batch_size_per_gpu": G // dp,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2}},
    }
    engine, *_ = initialize(model, config, mpu=reg or mesh.mpu)
    return engine


def _steps(engine, steps) -> list[float]:
    m = engine.mesh
    rows = slice(m.dp_rank * G // m.dp_size, (m.dp_rank + 1) * G // m.dp_size)
    cols = slice(m.sp_rank * S // m.sp_size, (m.sp_rank + 1) * S // m.sp_size)
    losses = []
    for step in steps:
        ids = global_batch(100 + step, G, S)
        pos = torch.arange(S)[cols].expand(ids[rows].shape[0], -1)
        out = engine(input_ids=ids[rows, cols], position_ids=pos, shift_labels=shift(ids)[rows, cols])
        engine.backward(out.loss)
        losses.append(engine.step())
    return losses


def _full_params(engine) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in engine.module.named_parameters()
    }


def _phase(
    dp: int, sp: int, stage: int, resume: str | None, steps: list[int], out_dir: str | None, **save
) -> dict:
    engine = _engine(dp, sp, stage)
    extra = ckpt.load_training_state(engine, resume) if resume else None
    losses = _steps(engine, steps)
    path = None
    if out_dir:
        path = ckpt.save_checkpoint(engine, out_dir, steps[-1] + 1, tokenizer=tasks.byte_tokenizer(), manifest=MANIFEST,
                                    train_state={"step": steps[-1] + 1}, core_attn="sdpa", **save)  # fmt: skip
    return {
        "losses": losses,
        "extra": extra,
        "path": path,
        "params": _full_params(engine),
        "world": dist.get_world_size(),
    }


def test_resume_reshards_across_layouts_and_matches_uninterrupted_run(pool, tmp_path):
    (ref,) = pool.run(_phase, 1, 1, 1, 0, None, list(range(6)), None)
    a = pool.run(_phase, 2, 2, 1, 3, None, [0, 1], str(tmp_path / "a"), save_dtype=torch.bfloat16, max_shard_bytes=20_000)[0]  # fmt: skip
    b = pool.run(_phase, 2, 1, 2, 1, a["path"], [2, 3], str(tmp_path / "b"))[0]
    c = pool.run(_phase, 1, 1, 1, 0, b["path"], [4, 5], None)[0]
    assert b["extra"] == {"step": 2} and c["extra"] == {"step": 4}
    torch.testing.assert_close(a["losses"] + b["losses"] + c["losses"], ref["losses"], rtol=1e-4, atol=0)
    for name, p in ref["params"].items():
        torch.testing.assert_close(c["params"][name], p, rtol=1e-4, atol=1e-5)

    # the bf16, sharded HF export of (dp 2, ZeRO 3): loads in plain transformers, = master weights in bf16
    from transformers import AutoModelForCausalLM

    files = sorted(f for f in os.listdir(a["path"]) if f.endswith(".safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    with open(os.path.join(a["path"], "model.safetensors.index.json"), encoding="utf-8") as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(a["params"]) and set(index["weight_map"].values()) == set(files)
    model = AutoModelForCausalLM.from_pretrained(a["path"], local_files_only=True)
    assert model.dtype == torch.bfloat16
    for name, p in model.named_parameters():
        assert torch.equal(p, a["params"][name].to(torch.bfloat16)), name


def test_old_format_checkpoint_is_refused_with_a_message(tmp_path):
    with pytest.raises(
        ValueError, match=r"has format 1; this ulysses-sp resumes format 2 .*start a new run with --model"
    ):
        ckpt.check_format({"format": 1, "step": 3}, str(tmp_path))


def _export_tied(directory: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ulysses_sp.state.hf_export import export_hf

    cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    export_hf(model, directory, is_writer=True, config=model.config, max_shard_bytes=10_000)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_hf_export_of_a_tied_model_writes_the_weight_once_and_loads(pool, tmp_path):
    from transformers import AutoModelForCausalLM

    (want,) = pool.run(_export_tied, 1, str(tmp_path))
    with open(tmp_path / "model.safetensors.index.json", encoding="utf-8") as f:
        names = set(json.load(f)["weight_map"])
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.state_dict().keys() == want.keys()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())

"""Checkpoints: HF format from every ZeRO stage, plain-transformers logits, exact resume, atomicity."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from harness import WorkerError
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ulysses_sp import tasks
from ulysses_sp.state import checkpoint as ckpt

SEQ = 32


def _engine(stage: int, weights: dict | None = None):
    from ulysses_sp.engine import initialize

    model = tasks.build_model("tiny-qwen2", vocab_size=259, seed=0)  # GQA: 4 q heads, 2 kv heads
    if weights is not None:
        model.load_state_dict(weights)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 3}},
    }
    engine, *_ = initialize(model, config, mesh_param=(dist.get_world_size(), 1))
    return engine


def _batch(step: int) -> dict[str, torch.Tensor]:
    # each rank trains on its own samples (dp): ids depend on the rank and the step
    ids = torch.stack([tasks.recall_sample(step, 2 * dist.get_rank() + i, SEQ)[0] for i in range(2)])
    return {"input_ids": ids, "labels": ids.clone()}


def _train_step(engine, step: int) -> float:
    out = engine(**_batch(step))
    engine.backward(out.loss)
    return engine.step()


def _full_params(engine) -> dict[str, torch.Tensor]:
    return get_model_state_dict(
        engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _save_load_resume(directory: str, stage: int):
    engine = _engine(stage)
    for s in range(2):
        _train_step(engine, s)
    probe = torch.stack([tasks.recall_sample(99, i, SEQ)[0] for i in range(2)])
    with torch.no_grad():
        logits = engine(input_ids=probe).logits.detach().cpu()
    manifest = {"world": {"world_size": dist.get_world_size()}, "run": {}, "model_config": {}}
    path = ckpt.save_checkpoint(engine, directory, 2, tokenizer=tasks.byte_tokenizer(), manifest=manifest,
                                train_state={"step": 2, "data": {"epoch": 0, "offset": 2}}, core_attn="sdpa")  # fmt: skip
    after_save_rand = torch.rand(3)
    # the uninterrupted run goes on ...
    losses = [_train_step(engine, s) for s in (2, 3)]
    final = _full_params(engine)
    # ... and a resumed one from the checkpoint must do exactly the same
    resumed = _engine(stage, weights=ckpt.load_model_state(path))
    extra = ckpt.load_training_state(resumed, path)
    resumed_rand = torch.rand(3)
    resumed_losses = [_train_step(resumed, s) for s in (2, 3)]
    return {
        "path": path, "logits": logits, "probe": probe, "extra": extra, "losses": losses,
        "resumed_losses": resumed_losses, "final": final, "resumed_final": _full_params(resumed),
        "rng": (after_save_rand, resumed_rand),
    }  # fmt: skip


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpoint_loads_in_plain_transformers_and_resumes_exactly(pool, tmp_path, stage):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r0, r1 = pool.run(_save_load_resume, 2, str(tmp_path), stage)
    assert r0["path"] == os.path.join(str(tmp_path), "checkpoint-2")
    assert sorted(os.listdir(os.path.join(r0["path"], ckpt.STATE_DIR))) == ["dcp", "rank0.pt", "rank1.pt"]
    # without ulysses-sp, without SP: plain transformers gives the training model's logits
    model = AutoModelForCausalLM.from_pretrained(r0["path"], local_files_only=True)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        plain = model(input_ids=r0["probe"]).logits
    torch.testing.assert_close(plain, r0["logits"], rtol=1e-5, atol=1e-6)
    tok = AutoTokenizer.from_pretrained(r0["path"], local_files_only=True)
    text = "any text, ünïcode too"
    assert (
        tok.encode(text, add_special_tokens=False) == list(text.encode())
        and len(tok) <= model.config.vocab_size
    )
    # exact resume: the same losses and parameters as the uninterrupted run, and the RNG restored
    for r in (r0, r1):
        assert r["extra"] == {"step": 2, "data": {"epoch": 0, "offset": 2}}
        assert r["resumed_losses"] == r["losses"]
        for k, v in r["final"].items():
            assert torch.equal(r["resumed_final"][k], v), k
        assert torch.equal(*r["rng"])


class _BrokenTokenizer:
    def save_pretrained(self, path):
        raise OSError("disk full (simulated)")


def _save_twice_second_fails(directory: str):
    engine = _engine(0)
    manifest = {"world": {}, "run": {}, "model_config": {}}
    ckpt.save_checkpoint(engine, directory, 1, tokenizer=tasks.byte_tokenizer(), manifest=manifest,
                         train_state={}, core_attn="sdpa")  # fmt: skip
    _train_step(engine, 0)
    ckpt.save_checkpoint(engine, directory, 2, tokenizer=_BrokenTokenizer(), manifest=manifest,
                         train_state={}, core_attn="sdpa")  # fmt: skip


def test_failed_save_leaves_previous_checkpoint_intact(pool, tmp_path):
    with pytest.raises(WorkerError, match="disk full"):
        pool.run(_save_twice_second_fails, 1, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [".tmp-checkpoint-2", "checkpoint-1"]
    assert ckpt.list_checkpoints(str(tmp_path)) == [(1, os.path.join(str(tmp_path), "checkpoint-1"))]
    assert ckpt.resolve_resume("latest", str(tmp_path)).endswith("checkpoint-1")
    assert ckpt.load_model_state(os.path.join(str(tmp_path), "checkpoint-1"))  # still readable


def test_resolve_resume_and_manifest_differences(tmp_path):
    with pytest.raises(ValueError, match="--resume: no checkpoint in"):
        ckpt.resolve_resume("latest", str(tmp_path))
    with pytest.raises(ValueError, match="no checkpoint in"):
        ckpt.resolve_resume(str(tmp_path / "missing"), str(tmp_path))
    saved = {"world": {"sp": 2, "dp": 1}, "run": {"seq_len": 64}, "model_config": {"hidden_size": 64}}
    now = {"world": {"sp": 1, "dp": 2}, "run": {"seq_len": 64}, "model_config": {"hidden_size": 32}}
    assert ckpt.compare_manifests(saved, saved) == []
    assert ckpt.compare_manifests(saved, now) == [
        "world.dp: checkpoint has 1, this run has 2",
        "world.sp: checkpoint has 2, this run has 1",
        "model_config.hidden_size: checkpoint has 64, this run has 32",
    ]


def test_rng_state_on_cpu_restores_python_and_torch_streams():
    import random

    cpu = torch.device("cpu")
    state = ckpt.rng_state(cpu)
    assert set(state) == {"python", "torch"}  # no accelerator state on a CPU run
    expected = (random.random(), torch.rand(3))
    ckpt.set_rng_state(state, cpu)
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(3), expected[1])


class _FakeDeviceModule:
    """Stands in for ``torch.<device>``: records which device's generator was read or written."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.device]] = []

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        self.calls.append(("get", device))
        return torch.tensor([device.index], dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        self.calls.append(("set", device))
        assert state.tolist() == [device.index]


def test_rng_state_uses_the_engines_device_not_cuda(monkeypatch):
    fake = _FakeDeviceModule()
    asked: list[str] = []

    def get_device_module(device_type: str) -> _FakeDeviceModule:
        asked.append(device_type)
        return fake

    monkeypatch.setattr(torch, "get_device_module", get_device_module)
    xpu = torch.device("xpu", 1)  # any accelerator type: the device decides, not torch.cuda
    state = ckpt.rng_state(xpu)
    assert state["device"][0] == "xpu" and fake.calls == [("get", xpu)]
    ckpt.set_rng_state(state, xpu)
    assert asked == ["xpu", "xpu"] and fake.calls == [("get", xpu), ("set", xpu)]
    ckpt.set_rng_state(state, torch.device("cpu"))  # resumed on another device type: CPU streams only
    assert len(fake.calls) == 2

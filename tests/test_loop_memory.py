"""The training loop frees the model output before backward: no untiled ``[B, S_l, V]`` logits
alive while the backward runs (the HF Trainer path never held them; ``bench/hf_trainer.py``)."""

from __future__ import annotations

import pytest


def _logits_alive_at_backward(out_dir: str, zero_stage: int) -> list[bool]:
    """Run ``ulysses-sp train``'s loop (sp 2, accumulation 2, 2 steps, no tiled loss); at the entry of
    every ``engine.backward``, whether any ``lm_head`` output made so far is still alive."""
    import weakref

    import torch

    from ulysses_sp.engine.engine import Engine
    from ulysses_sp.run.config import RunConfig
    from ulysses_sp.run.loop import run

    outputs: list[tuple[torch.nn.Module, weakref.ref]] = []  # (module, its forward output)
    alive: list[bool] = []

    def record(module, args, output):
        if isinstance(output, torch.Tensor):
            outputs.append((module, weakref.ref(output)))

    original = Engine.backward

    def backward(self, loss):
        head = self.module.get_output_embeddings()
        logits = [ref for m, ref in outputs if m is head]
        assert logits, "no lm_head output was recorded"
        alive.append(any(ref() is not None for ref in logits))
        outputs.clear()
        return original(self, loss)

    cfg = RunConfig(output_dir=out_dir, seq_len=64, sp=2, micro_batch_size=1, grad_accum=2, steps=2,
                      zero_stage=zero_stage, progress=False)  # fmt: skip
    hook = torch.nn.modules.module.register_module_forward_hook(record)
    Engine.backward = backward
    try:
        run(cfg)
    finally:
        Engine.backward = original
        hook.remove()
    return alive


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_the_loop_frees_the_logits_before_backward(pool, tmp_path, zero_stage):
    """DDP (stage 0) and FSDP2 (stage 3): at every micro-step's backward the logits are gone."""
    for alive in pool.run(_logits_alive_at_backward, 2, str(tmp_path / "run"), zero_stage):
        assert alive == [False] * 4  # 2 steps x 2 micro-steps, every rank

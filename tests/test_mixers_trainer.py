"""A hybrid model (LFM2: short convolutions beside attention) in the real ``transformers.Trainer``:
``prepare(trainer, sp_size=2)`` shards its mixers too, and every step's logged loss and grad norm
and the eval loss equal the same trainer without SP (right-padded variable lengths). Pure Mamba-2
(no attention layers: nothing to register, its mixers alone sharded) the same."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")

import hf_runs  # noqa: E402
from hybrid_models import hybrid_model  # noqa: E402


def _lfm2(arch: str, seed: int = 0, vocab: int = 64, kv_heads: int | None = None):
    return hybrid_model("lfm2", seed, vocab=vocab)


def _mamba2(arch: str, seed: int = 0, vocab: int = 64, kv_heads: int | None = None):
    return hybrid_model("mamba2", seed, vocab=vocab)


def _run(sp_size: int, arch: str = "lfm2", **kw) -> dict:
    hf_runs.tiny_model = {"lfm2": _lfm2, "mamba2": _mamba2}[arch]  # the harness's model (this worker only)
    out = hf_runs.train_and_eval(sp_size, **kw)
    return {k: out[k] for k in ("logs", "eval_loss", "name", "restored")}


def test_trainer_sp2_trains_lfm2_as_without_sp(pool):
    ref = pool.run(_run, 2, 0, kind="plain", accum=1)
    sp = pool.run(_run, 2, 2, kind="plain", accum=2)
    assert sp[0]["logs"] == sp[1]["logs"] and sp[0]["name"].startswith("SequenceParallel")
    assert len(sp[0]["logs"]) == len(ref[0]["logs"]) == 3
    for (loss, norm), (ref_loss, ref_norm) in zip(sp[0]["logs"], ref[0]["logs"]):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)
    assert sp[0]["eval_loss"] == pytest.approx(ref[0]["eval_loss"], rel=1e-5)
    assert sp[0]["restored"] == ("Trainer", "sdpa")


def test_trainer_sp2_trains_pure_mamba2_as_without_sp(pool):
    ref = pool.run(_run, 2, 0, arch="mamba2", kind="plain", accum=1)
    sp = pool.run(_run, 2, 2, arch="mamba2", kind="plain", accum=2)
    assert sp[0]["logs"] == sp[1]["logs"] and sp[0]["name"].startswith("SequenceParallel")
    assert len(sp[0]["logs"]) == len(ref[0]["logs"]) == 3
    for (loss, norm), (ref_loss, ref_norm) in zip(sp[0]["logs"], ref[0]["logs"]):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)
    assert sp[0]["eval_loss"] == pytest.approx(ref[0]["eval_loss"], rel=1e-5)
    assert sp[0]["restored"] == ("Trainer", "eager")

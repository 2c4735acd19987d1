"""Sharded loading of pretrained weights equals ``from_pretrained`` bit for bit.

Every parameter and buffer (rotary ``inv_freq`` included) after ``init_empty_model`` -> engine ->
``load_pretrained_weights`` equals ``AutoModelForCausalLM.from_pretrained``'s, at ZeRO 2/3 (meta
model, FSDP2 shards filled row-wise) and ZeRO 0/1 (a whole model filled in place), on layouts with
dp 1 and 2 (and the "all ranks" partition), tied and untied embeddings, single-file and sharded
checkpoints (one of them saved in bf16: the cast to the fp32 master weights is the same).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import WorkerError
from torch.distributed.tensor import DTensor

from ulysses_sp.engine import initialize
from ulysses_sp.parallel.mesh import init_mesh
from ulysses_sp.state.loading import init_empty_model, load_pretrained_weights, weight_files

LAYOUTS = [(2, 1, "data_parallel"), (1, 2, "data_parallel"), (1, 2, "all")]


def _save(directory: str, *, tied: bool, shard: bool, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                      rope_theta=500.0)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.to(dtype).save_pretrained(directory, max_shard_size="8KB" if shard else "1GB")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _load_everywhere(directories: list[str]) -> list[tuple]:
    from transformers import AutoModelForCausalLM

    compared = []
    for dp, sp, partition in LAYOUTS:
        mesh = init_mesh((dp, sp))
        for directory in directories:
            ref = AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.float32, attn_implementation="sdpa"
            )
            want = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
            # a whole replica (ZeRO 0/1) is filled the same on any layout: check it on the first only
            for stage in (0, 1, 2, 3) if (dp, sp, partition) == LAYOUTS[0] else (2, 3):
                if stage >= 2:
                    model = init_empty_model(directory)
                    assert all(p.is_meta for p in model.parameters())
                else:  # a whole (randomly initialised) replica, filled in place
                    model = AutoModelForCausalLM.from_config(ref.config, attn_implementation="sdpa")
                config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                          "zero_optimization": {"stage": stage, "partition": partition}}  # fmt: skip
                engine, *_ = initialize(model, config, mpu=mesh.mpu)
                load_pretrained_weights(engine.module, directory)
                got = {**dict(engine.module.named_parameters()), **dict(engine.module.named_buffers())}
                assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
                for name, value in got.items():
                    assert torch.equal(_full(value.detach()), want[name].detach()), (directory, stage, name)
                if ref.config.tie_word_embeddings:
                    assert engine.module.lm_head.weight is engine.module.model.embed_tokens.weight
                compared.append((dp, sp, partition, stage, directory))
        dist.barrier()
    return compared


def test_sharded_loading_equals_from_pretrained_bit_for_bit(pool, tmp_path):
    dirs = []
    for tied in (False, True):
        for shard, dtype in ((False, torch.float32), (True, torch.bfloat16)):
            d = tmp_path / f"tied{int(tied)}-shard{int(shard)}"
            _save(str(d), tied=tied, shard=shard, dtype=dtype)
            dirs.append(str(d))
    assert len(set(weight_files(dirs[1]).values())) > 1  # really sharded, with an index
    compared = pool.run(_load_everywhere, 2, dirs)[0]
    assert len(compared) == len(dirs) * (4 + 2 * (len(LAYOUTS) - 1))


def test_loading_refuses_missing_weights_and_meta_models_at_stage_0(pool, tmp_path):
    with pytest.raises(ValueError, match="has neither model.safetensors nor model.safetensors.index.json"):
        weight_files(str(tmp_path))
    d = str(tmp_path / "m")
    _save(d, tied=False, shard=False, dtype=torch.float32)
    model = init_empty_model(d)
    with pytest.raises(WorkerError, match="meta device, which needs ZeRO stage 2 or 3 .got stage 1") as e:
        pool.run(_init_meta, 1, d, 1)
    assert e.value.types() == {"ValueError"}
    model.to_empty(device="cpu")
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(ValueError, match=r"lacks weights for 1 parameter\(s\): \['extra'\]"):
        load_pretrained_weights(model, d)


def _init_meta(directory: str, stage: int) -> None:
    initialize(init_empty_model(directory), {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}},
               mesh_param=(1, 1))  # fmt: skip


def _load_in_blocks(directory: str, block_bytes: int) -> int:
    from transformers import AutoModelForCausalLM

    want = dict(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).named_parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = initialize(init_empty_model(directory), config, mpu=init_mesh((2, 1)).mpu)
    load_pretrained_weights(engine.module, directory, block_bytes=block_bytes)
    for name, p in engine.module.named_parameters():
        assert torch.equal(_full(p.detach()), want[name].detach()), name
    return len(want)


@pytest.mark.parametrize("block_bytes", [1, 100])
def test_reading_in_blocks_smaller_than_a_row_or_a_shard_equals_from_pretrained(pool, tmp_path, block_bytes):
    d = str(tmp_path / "m")
    _save(d, tied=True, shard=True, dtype=torch.bfloat16)  # rows of 64 bytes: 1 row per block, or 1 of several
    assert pool.run(_load_in_blocks, 2, d, block_bytes)[0] > 0


def _load_renamed(directory: str) -> int:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    mesh = init_mesh((2, 1))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3}}  # fmt: skip
    engine, *_ = initialize(init_empty_model(directory), config, mpu=mesh.mpu)
    load_pretrained_weights(engine.module, directory)
    want = dict(ref.named_parameters())
    got = dict(engine.module.named_parameters())
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert torch.equal(_full(value.detach()), want[name].detach()), name
    return len(got)


def test_a_checkpoint_stored_under_other_names_loads_sharded_as_from_pretrained(pool, tmp_path):
    """Nemotron-H's files say ``backbone.*`` where the model says ``model.*``: the ZeRO 3 load reads
    them through transformers' own renaming (it was "lacks weights for 28 parameter(s)")."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(2)
    cfg = AutoConfig.for_model("nemotron_h", vocab_size=64, hidden_size=32, num_hidden_layers=4, intermediate_size=64,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=8, n_groups=2, hybrid_override_pattern="M*M-")  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    d = str(tmp_path / "nemotron_h")
    model.save_pretrained(d)
    with safe_open(f"{d}/model.safetensors", framework="pt") as f:
        assert any(k.startswith("backbone.") for k in f.keys())
    assert pool.run(_load_renamed, 2, d) == [len(dict(model.named_parameters()))] * 2

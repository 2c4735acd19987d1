"""`shutdown()` ends a run with no backend worker thread left, so nothing can abort at exit.

A gloo group's worker threads live as long as the group object does; meshes (torch >= 2.13) and
the engine hold groups, and a worker that frees a finished collective's tensors during interpreter
shutdown aborts the process (SIGABRT) after a successful run. ``shutdown()`` must leave no gloo
thread behind: that is checked here by thread name in fresh torchrun processes, after a real
training run on stages 0 and 3 and with a module-level mesh still referenced.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, initialize, init_mesh, shutdown
from ulysses_sp.parallel.mesh import default_backend


def gloo_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except FileNotFoundError:  # the thread ended while we listed
            continue
        if name.startswith(("pt_gloo", "gloo")):
            names.append(name)
    return sorted(names)


def train(stage):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, seq_length=16)
    data = [{"input_ids": torch.arange(16) % 64} for _ in range(4)]
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, loader, _ = initialize(model=model, config=config, mpu=mpu, training_data=data)
    for step, batch in enumerate(UlyssesSPDataLoaderAdapter(loader, engine.sp_rank, engine.sp_group,
                                                            engine.sp_size, engine.device)):
        engine.backward(engine(**batch).loss)
        engine.step()
        if step == 1:
            break
    mpu.remove()


dist.init_process_group(default_backend())
mesh = init_mesh((1, 2))  # module-level: keeps its groups alive until shutdown() releases them
dist.all_reduce(torch.ones(4), group=mesh.sp_group)
for stage in (0, 3):
    train(stage)
during = gloo_threads()
shutdown()
left = gloo_threads()
with open(f"rank{os.environ['RANK']}.txt", "w") as f:  # one file per rank: their stdout lines can interleave
    f.write(f"gloo threads: during {len(during)}, after shutdown {left}")
assert during and not left, (during, left)
shutdown()  # a second call is harmless
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from Linux /proc")
def test_shutdown_leaves_no_gloo_worker_thread_after_training(tmp_path):
    (tmp_path / "run.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "run.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    reports = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert all(report.endswith("after shutdown []") for report in reports), reports


def test_shutdown_without_process_group_is_a_no_op():
    from ulysses_sp import shutdown

    shutdown()
    shutdown()

"""``train --rehearse``: the run's real step on fake tensors at the mission's shapes (issue 31).

One subprocess per module (the rehearsal starts PyTorch's fake process group, which must not meet
another process group of the test session) runs every rehearsal below and prints them as JSON:

* Llama-3-8B's shapes (h 4096, GQA 32/8, vocab 128,256; 8 of its 32 layers: every layer has the same
  shapes, and the depth only multiplies the run time here, ~44 s for 32 layers against ~13 s) at
  1,048,576 tokens on 8 ranks (sp 8, ZeRO 3 over all ranks, bf16, tiled MLP and loss, checkpointing):
  the step runs through the real engine; its parameter and optimizer-state bytes equal the model's
  count over 8 shards; no tensor of ``S^2/P`` elements or more exists anywhere in the step. The full
  32-layer model at 1M-8M tokens is rehearsed by ``bench/scale_table.py`` and ``bench/rehearse_check.py``.
* Bamba-9B's shapes (a Mamba-2 hybrid; 8 layers, attention in one) at 262,144 tokens on 8 ranks: near
  the planner, no ``S^2/P`` tensor.
* a tiny Qwen2.5-VL with an image at sp 2: train's per-shard merge, the image's rank named, near the planner.
* a tiny preset at sp 2 with packed documents through the CLI: exit 0 and the report; ``plan --rehearse``.
* Qwen3-Next-80B-A3B's layer shapes (3 attention layers, 512 experts, top-10) at 262,144 tokens on 8 ranks: the
  experts' copies of each token at the peak, near the planner; Mixtral-8x7B's (3 layers) with the states on the
  devices, near the planner.
* the HF Trainer path: the whole script of docs/readme/hf.md (``hf_trainer_rehearse.py``: a ``Trainer`` after
  ``prepare()``'s ALST options, ``rehearse_trainer``), run in the same subprocess: near the planner, the
  user's trainer untouched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys, tempfile
from transformers import LlamaConfig
from ulysses_sp.run.config import config_from_dict
from ulysses_sp.rehearse.run import rehearse_run

d = tempfile.mkdtemp()
LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=1 << 21, rope_theta=500000.0,
            tie_word_embeddings=False).save_pretrained(d)
cfg = config_from_dict(dict(model=d, sp=8, seq_len=1 << 20, micro_batch_size=1, zero_stage=3, zero_partition="all",
                            dtype="bf16", tiled_mlp=True, tiled_loss=True, activation_checkpointing=True))
r = rehearse_run(cfg, gpus=8, device="cuda", ranks=(0,))
print("JSON" + json.dumps(r.as_dict(), default=str))

from transformers import BambaConfig
d = tempfile.mkdtemp()
BambaConfig(num_hidden_layers=8, attn_layer_indices=[3], max_position_embeddings=1 << 22, tie_word_embeddings=False).save_pretrained(d)
cfg = config_from_dict(dict(model=d, sp=8, seq_len=1 << 18, micro_batch_size=1, zero_stage=3, zero_partition="all",
                            dtype="bf16", tiled_mlp=True, tiled_loss=True, activation_checkpointing=True))
r = rehearse_run(cfg, gpus=8, device="cuda", ranks=(0,))
print("HYBRID" + json.dumps(r.as_dict(), default=str))

from transformers import AutoConfig
d = tempfile.mkdtemp()
AutoConfig.for_model("qwen3_next", num_hidden_layers=3, layer_types=["full_attention"] * 3, max_position_embeddings=1 << 22,
                     tie_word_embeddings=False).save_pretrained(d)
cfg = config_from_dict(dict(model=d, sp=8, seq_len=1 << 18, micro_batch_size=1, zero_stage=3, zero_partition="all",
                            dtype="bf16", tiled_loss=True, activation_checkpointing=True, offload_activations=True,
                            recompute_norms=True, cpu_offload=True))
r = rehearse_run(cfg, gpus=8, device="cuda", ranks=(0,))
import torch
from transformers import AutoModelForCausalLM
with torch.device("meta"):
    n = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d)).parameters())
print("MOE" + json.dumps({**r.as_dict(), "params": n}, default=str))
d = tempfile.mkdtemp()  # Mixtral-8x7B's layers (8 experts of 14,336, top-2), the states on the devices
AutoConfig.for_model("mixtral", num_hidden_layers=3, max_position_embeddings=1 << 22,
                     tie_word_embeddings=False).save_pretrained(d)
cfg = config_from_dict(dict(model=d, sp=8, seq_len=1 << 18, micro_batch_size=1, zero_stage=3, zero_partition="all",
                            dtype="bf16", tiled_loss=True, activation_checkpointing=True, offload_activations=True,
                            recompute_norms=True))
print("MIXTRAL" + json.dumps(rehearse_run(cfg, gpus=8, device="cuda", ranks=(0,)).as_dict(), default=str))

ns = {"__name__": "hf_trainer_rehearse"}
exec(sys.argv[1], ns)  # docs/readme/hf.md's hf_trainer_rehearse.py
untouched = type(ns["trainer"]).__name__ == "Trainer" and ns["trainer"].model is ns["model"]
from types import SimpleNamespace
from ulysses_sp.rehearse.trainer import rehearse_trainer, trainer_run_config
stub, refusals = SimpleNamespace(args=SimpleNamespace(fsdp=[]), model=None), []
for call in (lambda: rehearse_trainer(stub, sp_size=2, seq_len=64, tiled_mpl=True),  # not a prepare() option
             lambda: trainer_run_config(stub, sp_size=2, seq_len=64, fsdp="no_shard")):  # DDP-like: not FSDP2
    try:
        call()
    except ValueError as e:
        refusals.append(str(e))
print("TRAINER" + json.dumps({**ns["rehearsal"].as_dict(), "untouched": untouched, "refusals": refusals}, default=str))
from transformers import Qwen2_5_VLConfig
d = tempfile.mkdtemp()
Qwen2_5_VLConfig(text_config=dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]}),
                 vision_config=dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=14,
                 spatial_merge_size=2, window_size=112, out_hidden_size=128, fullatt_block_indexes=[3]),
                 image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003).save_pretrained(d)
cfg = config_from_dict(dict(model=d, sp=2, seq_len=2048, micro_batch_size=1, zero_stage=3, split_images="off"))
r = rehearse_run(cfg, gpus=2, device="cpu", images=1, image_size=(448, 448))
print("VLM" + json.dumps(r.as_dict(), default=str))
"""


def trainer_script() -> str:
    """The whole script ``hf_trainer_rehearse.py`` of docs/readme/hf.md."""
    sys.path.insert(0, os.path.dirname(__file__))
    from docs_pages import ROOT, code_blocks

    page = ROOT / "docs" / "readme" / "hf.md"
    return next(b for lang, b, _, _ in code_blocks(page) if b.startswith("# hf_trainer_rehearse.py"))


@pytest.fixture(scope="module")
def rehearsals() -> dict[str, dict]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, trainer_script()], capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    found = {}
    for tag in ("JSON", "HYBRID", "MOE", "MIXTRAL", "TRAINER", "VLM"):
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith(tag))
        found[tag] = json.loads(line[len(tag) :])
    return found


@pytest.fixture(scope="module")
def llama8b(rehearsals) -> dict:
    return rehearsals["JSON"]


def test_a_hybrid_at_its_real_size_rehearses_near_the_planner(rehearsals):
    """Bamba-9B's shapes (Mamba-2 mixers; 8 layers, one of them attention) at 262,144 tokens on 8 ranks (sp 8): the
    mixers' SP handlers run on fake tensors (their PyTorch path: the CUDA kernels need real memory),
    the planner's peak is within 10 % of the rehearsal's, and no tensor has S^2/P elements."""
    r = rehearsals["HYBRID"]
    rank = r["ranks"][0]
    assert rank["collectives"]["alltoall_base"]["count"] > 0 and rank["flops"] > 1e14
    planned = r["predicted"]["peak_bytes"] - r["reserve"]
    assert planned == pytest.approx(rank["device_peak"], rel=0.10), (planned, rank["device_peak"])
    assert rank["largest"]["numel"] < r["seq_len"] ** 2 // 8, rank["largest"]


def test_routed_experts_are_planned_at_their_backward(rehearsals):
    """Qwen3-Next-80B-A3B's layer shapes (512 experts, top-10, a shared expert, gated attention; 3 attention layers)
    at 262,144 tokens on 8 ranks with the scale table's settings (the states on the host): the peak is the experts'
    backward, where transformers' grouped experts hold each token's 10 copies ``[T k, h]`` (5 of them); the
    planner, which counts them (``ModelShape.routed``) with one layer gathered there, is within 5 % of the
    rehearsal (12 % under without the term on a 4-layer period at 851,968 tokens); the projected host optimizer
    step counts every expert."""
    r = rehearsals["MOE"]
    rank = r["ranks"][0]
    copies = [t for t in rank["top"] if t["shape"] in ([32768 * 10, 2048], [32768, 10, 2048])]
    assert len(copies) == 5 and rank["peak_phase"] == "backward", rank["top"]
    planned = r["predicted"]["peak_bytes"] - r["reserve"]
    assert planned == pytest.approx(rank["device_peak"], rel=0.05), (planned, rank["device_peak"])
    # the projected host optimizer step moves 16 bytes of each of the rank's parameters twice (rehearse.timing),
    # experts included (the Llama formula counted 0.5B parameters for this model: one MLP a layer, not 512 experts)
    assert r["params"] > 4e9 and r["time"]["host_optimizer_s"] == pytest.approx(2 * 16 * r["params"] / 8 / 100e9, rel=1e-6)


def test_wide_experts_with_the_states_on_the_devices_are_planned_within_5_percent(rehearsals):
    """Mixtral-8x7B's layers (8 experts of 14,336, top-2; 3 layers) at 262,144 tokens on 8 ranks, ZeRO 3 with the
    states on the devices: the peak is mid-way through the experts' backward (the gate/up copies ``[T k, 2 I]``
    and their gradients, wide experts), with the layer above's gradient reduction still in flight; the planner is
    within 5 % (0.866 before these two were counted)."""
    r = rehearsals["MIXTRAL"]
    rank = r["ranks"][0]
    assert any(t["shape"] == [32768 * 2, 2 * 14336] for t in rank["top"]), rank["top"]
    planned = r["predicted"]["peak_bytes"] - r["reserve"]
    assert planned == pytest.approx(rank["device_peak"], rel=0.05), (planned, rank["device_peak"])


def test_the_hf_trainer_path_rehearses_near_the_planner(rehearsals):
    """docs/readme/hf.md's script: a ``Trainer`` (bf16, gradient checkpointing) after ``prepare()``'s ALST options
    (tiled MLP and loss, offloaded checkpoints, norm recompute) rehearsed through ``Trainer.training_step`` under
    FSDP2: the planner's peak for the equivalent ``train`` settings within 5 % of the rehearsal's, the layer
    inputs on the host, and the user's trainer left as it was (class, model)."""
    r = rehearsals["TRAINER"]
    rank = r["ranks"][0]
    assert r["untouched"] and {"forward", "backward", "optimizer"} <= set(rank["phase_peaks"])
    assert rank["collectives"]["alltoall_base"]["count"] > 0 and rank["host_peak"] > 0
    planned = r["predicted"]["peak_bytes"] - r["reserve"]
    assert planned == pytest.approx(rank["device_peak"], rel=0.05), (planned, rank["device_peak"])


def test_the_trainer_rehearsal_refuses_what_it_cannot_rehearse(rehearsals):
    """An option prepare() does not take, and DDP / an FSDP mode other than FSDP2's sharding: ValueErrors naming
    the fix, before any process group or model exists (run in the module's subprocess)."""
    unknown, ddp = rehearsals["TRAINER"]["refusals"]
    assert "['tiled_mpl']: not prepare() options" in unknown
    assert "fsdp='no_shard'" in ddp and "DDP cannot be rehearsed" in ddp
def test_a_qwen_vl_step_with_images_rehearses_through_the_per_shard_merge(rehearsals):
    """A tiny Qwen2.5-VL at sp 2 with one 448x448 image (1,024 patches, 256 tokens) at the start of its 2,048 tokens,
    --split-images off: train's per-shard forward runs on fake tensors with every layout value from the adapter
    (no host read of a device value: the frame plan, the tower's cu_seqlens and window order are host values), the
    rank whose shard holds the image is rehearsed and named, and the planner (its vision term for the 1,024
    patches a rank encodes) is within 5 % of the rehearsal (0.997 when written)."""
    r = rehearsals["VLM"]
    ranks = {x["rank"]: x for x in r["ranks"]}
    assert set(ranks) == {0, 1} and "the busiest tower is rank 0's, 1,024 patches" in r["notes"][-1], r["notes"]
    assert all(x["flops"] > 0 and x["device_peak"] > 0 for x in ranks.values())
    planned = r["predicted"]["peak_bytes"] - r["reserve"]
    assert planned == pytest.approx(r["device_peak"], rel=0.05), (planned, r["device_peak"])


def test_llama_8b_at_1m_tokens_on_8_ranks_rehearses_one_real_step(llama8b):
    rank = llama8b["ranks"][0]
    assert {"forward", "backward", "optimizer"} <= set(rank["phase_peaks"])
    assert rank["flops"] > 1e16  # 6 N T over 131,072 local tokens and 2.8B parameters is ~2e15, attention ~3e16
    assert rank["collectives"]["alltoall_base"]["count"] > 0  # the attention exchange ran
    assert rank["device_peak"] > 0 and llama8b["fits"] in (True, False)
    planned = llama8b["predicted"]["peak_bytes"] - llama8b["reserve"]
    assert planned == pytest.approx(rank["device_peak"], rel=0.05)  # the planner held to the rehearsal (0.99)
    t = llama8b["time"]  # projected from the rehearsal's counts: compute dominates, the exchange is exposed
    assert t["step_s"] >= t["compute_s"] + t["all_to_all_s"] > 0 and t["tokens_per_s_per_gpu"] > 0


def test_model_states_are_counted_as_the_shards_of_8_ranks(llama8b):
    params = 8 * 218_112_000 + 2 * 128_256 * 4_096 + 4_096  # 8 of Llama-3-8B's layers, untied embeddings, final norm
    at_peak = llama8b["ranks"][0]["breakdown"]
    # fp32 master weights and two AdamW moments, each 1/8 of the model on this rank (FSDP2 pads the
    # shards to a multiple of 8 rows: within 0.1 %)
    assert at_peak["parameters"] == pytest.approx(4 * params / 8, rel=1e-3)
    assert at_peak["optimizer state"] == pytest.approx(8 * params / 8, rel=1e-3)


def test_no_tensor_of_s_squared_over_p_elements_in_the_step(llama8b):
    s, p = llama8b["seq_len"], 8
    largest = llama8b["ranks"][0]["largest"]
    assert largest["numel"] < s * s // p, largest


def test_cli_rehearses_a_packed_sp2_run_and_reports_the_verdict(tmp_path):
    cmd = [sys.executable, "-m", "ulysses_sp.cli.main", "train", "--rehearse", "--model", "tiny-llama", "--sp", "2",
           "--seq-len", "512", "--zero-stage", "3", "--micro-batch-size", "1", "--packing", "best-fit"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "verdict: fits" in out.stdout and "largest tensors alive at the peak" in out.stdout
    assert "rank 1: forward and backward" in out.stderr  # a progress line per phase
    small = subprocess.run([*cmd, "--gpu-memory", "1MB", "--exchange", "headwise"], capture_output=True, text=True,
                           check=False, cwd=tmp_path)  # fmt: skip
    assert small.returncode == 1 and "DOES NOT FIT" in small.stdout
    # the run's --exchange is rehearsed: head by head, more all-to-alls than the packed default at 512 tokens
    count = lambda text: int(re.search(r"alltoall_base x(\d+)", text).group(1))  # noqa: E731
    assert count(small.stdout) > count(out.stdout) > 0, (small.stdout[-2000:], out.stdout[-2000:])
    ddp_cmd = [*cmd]
    ddp_cmd[ddp_cmd.index("--zero-stage") + 1] = "0"
    ddp = subprocess.run(ddp_cmd, capture_output=True, text=True, check=False, cwd=tmp_path)
    assert ddp.returncode == 2 and "--rehearse needs --zero-stage 2 or 3" in ddp.stderr


def test_plan_rehearses_its_recommended_command(tmp_path):
    """``plan --seq-len N --rehearse``: the planner's table, then its recommended command rehearsed (the same
    with ``--json``: ``tests/test_docs_reference.py``, whose plan runs include one, checks its verdict and probes)."""
    cmd = [sys.executable, "-m", "ulysses_sp.cli.main", "plan", "--model", "tiny-llama", "--device", "cpu",
           "--memory", "64MB", "--gpus", "2", "--seq-len", "1024", "--rehearse"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "recommended:" in out.stdout and "rehearsal of the recommended command" in out.stdout
    assert "1,024 tokens: fits" in out.stdout and "verdict: fits" in out.stdout


@pytest.mark.parametrize("limit, planned, top", [(1_000_000, 858_504, None), (1_000_000, 1_300_000, None),
                                                 (10**9, 100_000, 131_072), (1_000, 50_000, None)])  # fmt: skip
def test_plan_max_search_finds_the_longest_length_the_rehearsal_accepts(limit, planned, top):
    """``plan --max --rehearse`` walks from the planner's length and bisects to 2 %: the answer fits,
    is within 2 % (or one granularity step) of the true limit or the positions cap, and takes few probes."""
    from ulysses_sp.cli.plan_rehearse import search_longest

    asked: list[int] = []

    def fits(n: int) -> bool:
        asked.append(n)
        return n <= limit

    got = search_longest(fits, planned, 2048, top)
    best = min(limit, top or limit) // 2048 * 2048
    if best < 2048:
        assert got is None
        return
    assert got is not None and got <= best and got % 2048 == 0
    assert best - got <= max(2048, 0.02 * got), (got, best)
    assert len(asked) <= 12, asked


@pytest.mark.parametrize("kernels, kv_heads", [("cuda", 2), ("cuda", 8), ("cpu", 2)])
def test_the_flash_backward_workspace_is_counted_for_cuda_kernels(kernels, kv_heads):
    """FlashAttention-2's backward allocates, inside the kernel, an fp32 dq accumulator (head dim rounded
    to 32, + softmax_d) and, with fewer kv heads than query heads, dk/dv expanded to the query heads;
    no fake kernel makes them. A rehearsal standing for CUDA adds them to the peak for the kernel's
    duration (named in the peak's tensors); one standing for the CPU kernel does not."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ulysses_sp.rehearse.tracker import StepTracker

    b, h, s, d = 1, 8, 4096, 64
    with FakeTensorMode():
        q = torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, kv_heads, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        tracker = StepTracker("cpu", kernels=kernels)
        with tracker:
            tracker.start_step()
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        tracker.finish()
    made = [a for a in tracker.places["device"].peak_at if a.op == "kernel workspace (modelled)"]
    expanded = 2 * b * s * h * d * 2 if kv_heads < h else 0
    assert [a.nbytes for a in made] == ([4 * b * s * h * (d + 1) + expanded] if kernels == "cuda" else [])


def test_a_chunk_loop_mixer_warns_how_long_its_rehearsal_takes():
    """Gated delta-net's torch fallback scans S / 64 chunks in a Python loop, which fake tensors run op
    by op (Qwen3-Next at 720,896 tokens: 11,264 chunks x 36 layers, hours): the rehearsal says so before
    it starts. Mamba-2's vectorized scan and plain attention get no note."""
    from transformers import AutoConfig

    from ulysses_sp.rehearse.run import chunk_loop_note

    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64)
    qwen3_next = AutoConfig.for_model("qwen3_next", num_hidden_layers=8, num_experts=4, moe_intermediate_size=32,
                                      linear_num_key_heads=2, linear_num_value_heads=4, **tiny)  # fmt: skip
    note = chunk_loop_note(qwen3_next, 65536, ranks=2)
    assert note is not None and "6 gated_delta_net layers scan 1,024 chunks each" in note, note
    assert f"about {0.05 * 1024 * 6 * 2 / 60:,.0f} CPU minutes" in note, note
    assert chunk_loop_note(AutoConfig.for_model("llama", num_hidden_layers=2, **tiny), 65536) is None

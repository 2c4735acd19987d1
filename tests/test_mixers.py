"""Short-convolution, Mamba-2 and Mamba-1 mixers (and learned positions) under Ulysses SP equal the same model without SP.

LFM2 (short conv), Nemotron-H, Falcon-H1 (Mamba-2 beside attention in every layer), Granite-4
hybrid, Bamba, Mamba-2 alone and ZAYA (convolutions inside its q/k projection: a halo) at sp 2 and 4:
every position's logits and every parameter's gradient (of a random projection of the logits, so
each position weighs in) against the plain model, fp32.
Packed documents: against the plain model run on each document alone (the mixers must not leak
across a boundary, wherever it falls relative to the shards). Also: B/C groups fewer than sp
(replicated), attention kv heads < sp, the undo, and refusals when heads do not divide. Inkling's
short convolutions alone at sp 2 and 4; Inkling, Inkling-2 and Inkling-2 Loop whole (their attention's pair
bias head-parallel per document) at sp 1, 2 and 4. Phi-MoE,
whose sliding window lives only in its mask (the SP attention is told it), at sp 2. MiniMax's lightning
attention (heads sharded) at sp 1, 2 and 4. xLSTM (its mLSTM sharded by head) at sp 2 and 4. CPM-Ant (its
model's mask and bias built for the whole prompt-prefixed row, its attention head-parallel) at sp 2 and 4. XLNet
(its relative attention head-parallel, ``mixers/xlnet.py``) at sp 2 and 4, unpacked, and its refusals by name.
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hybrid_models import PURE, V, hybrid_model
from models import global_batch, tiny_model
from oracle import assert_grads_close

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.mixers._kernels import refuse_local_boundaries
from ulysses_sp.mixers.apply import (
    HANDLERS,
    apply_mixers,
    has_unsharded_mixers,
    is_sharded,
    needs_plain_layout,
)
from ulysses_sp.mixers.base import claimed_by, shard_mixers
from ulysses_sp.parallel.mesh import init_mesh

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a top-level folder of the repository, not an installed package
    sys.path.insert(0, str(ROOT))

B, S = 2, 32
DOCS = (5, 12, 9, 6)  # boundaries at 5, 17, 26: inside shards and across them at sp 2 and 4


def _positions(packed: bool, docs: tuple[int, ...] = DOCS) -> torch.Tensor:
    if not packed:
        return torch.arange(S).expand(B, -1)
    return torch.cat([torch.arange(n) for n in docs]).expand(B, -1)


def _reference(ref, ids: torch.Tensor, packed: bool, docs: tuple[int, ...] = DOCS) -> torch.Tensor:
    """Plain model logits ``[B, S, V]``: each document alone when packed."""
    if not packed:
        return ref(input_ids=ids, use_cache=False).logits
    starts = torch.tensor((0,) + docs).cumsum(0).tolist()
    return torch.cat(
        [ref(input_ids=ids[:, s:e], use_cache=False).logits for s, e in zip(starts, starts[1:])], dim=1
    )


def _exact(sp: int, cases: list[tuple[str, bool, dict]]) -> list[str]:
    mesh = init_mesh((1, sp))
    s_l = S // sp
    cols = slice(mesh.sp_rank * s_l, (mesh.sp_rank + 1) * s_l)
    done = []
    for arch, packed, kw in cases:
        kw = dict(kw)
        checkpointing = kw.pop("checkpointing", False)  # the mixers re-run in backward: same exchanges
        pad = kw.pop("right_pad", 0)  # row 1's last tokens padding: only the last rank's mask is not all ones
        docs = kw.pop("docs", DOCS)
        dtype = kw.pop("dtype", torch.float32)  # float64: a model whose fp32 gradients round above the tolerance
        ref = hybrid_model(arch, **kw).to(dtype)
        if checkpointing:
            ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            ref.train()
        model = copy.deepcopy(ref)
        ids = global_batch(3, B, S, vocab=V)
        proj = torch.randn(B, S, V, generator=torch.Generator().manual_seed(4)).to(dtype)
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, S - pad :] = 0
        proj = proj * mask[..., None]  # the padded positions' logits carry no loss
        if pad:
            ref_logits = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
        else:
            ref_logits = _reference(ref, ids, packed, docs)
        (ref_logits * proj).sum().backward()
        reg = (
            None
            if arch in PURE
            else UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, B, mesh=mesh)
        )
        handle = apply_mixers(model, mesh)
        assert handle.wrapped and all(is_sharded(model.get_submodule(n)) for n, _ in handle.wrapped), arch
        wrapped = [model.get_submodule(n) for n, _ in handle.wrapped]
        pos = _positions(packed, docs)[:, cols]  # alive until backward, as a batch is: checkpoint recomputes read it
        if arch == "granitemoehybrid":  # position ids passed by position: the tracker finds them there too
            logits = model(ids[:, cols], None, pos, use_cache=False).logits
        else:
            extra = {"attention_mask": mask[:, cols]} if pad else {}
            logits = model(input_ids=ids[:, cols], position_ids=pos, use_cache=False, **extra).logits
        real = mask[:, cols].bool()  # [B, S_l]: compared at the real tokens
        torch.testing.assert_close(logits[real], ref_logits[:, cols][real].detach(), rtol=1e-4, atol=1e-5)
        (logits * proj[:, cols]).sum().backward()
        grads = {}
        for n, p in model.named_parameters():
            if p.grad is not None:  # Musicgen's cross-attention: unused without encoder states, on both sides
                dist.all_reduce(p.grad, group=mesh.sp_group)  # each rank holds its tokens' share
                grads[n] = p.grad
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert grads.keys() == ref_grads.keys(), arch
        # a key bias adds one constant to every score of a query's row, which the softmax removes: its
        # gradient is zero in exact arithmetic (OPT, BioGPT), rounding noise on both sides; held to that
        top = max(r.abs().max().item() for r in ref_grads.values())
        for n in [n for n in grads if n.endswith("k_proj.bias")]:
            assert max(grads.pop(n).abs().max(), ref_grads.pop(n).abs().max()) < 1e-6 * top, n
        # a one-element parameter (Inkling's MoE gate scale) sums signed terms over every token: fp32 rounding
        # in another summation order is relative to those terms, not to their (cancelling) sum: held to 1e-5 of
        # the model's largest gradient, as every other gradient's elements are to their tensor's largest
        for n in [n for n, g in grads.items() if g.numel() == 1]:
            torch.testing.assert_close(grads.pop(n), ref_grads.pop(n), rtol=1e-4, atol=1e-5 * top, msg=n)
        # atol 1e-5 x the largest reference gradient (the loss is a sum over B*S*V projected logits)
        assert_grads_close(grads, ref_grads, atol_cap=math.inf)
        handle.remove()
        if reg is not None:
            reg.remove()
        assert not any("forward" in vars(m) for m in model.modules()) and not model._forward_pre_hooks
        assert not any(is_sharded(m) for m in wrapped)
        done.append(f"{arch}{' packed' if packed else ''}")
    return done


FALCON_MUP = {"mamba_rms_norm": True, "ssm_in_multiplier": 0.7, "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.3]}
CASES_SP2 = [(a, p, {}) for a in ("lfm2", "nemotron_h", "falcon_h1") for p in (False, True)] + [
    ("falcon_h1", True, FALCON_MUP),  # its gated norm and muP multipliers (the defaults are off / 1)
    ("nemotron_h", False, {"right_pad": 5}),  # a padding mask on one rank only
    ("granitemoehybrid", True, {}),
    ("bamba", True, {}),
    ("mamba2", True, {}),  # Mamba-2 alone
    ("opt", True, {}),  # learned positions: the reference numbers each document by its mask's cumsum
    ("biogpt", False, {}),
    ("zaya", True, {}),  # causal window: convolutions inside the q/k projection, a delayed value half (halo 2)
    ("phimoe", True, {}),  # a sliding window (8) only in the model's mask: the SP attention is told it
    ("musicgen", True, {}),  # a table numbering its own input: the reference numbers each document from 0
    ("musicgen_melody", False, {}),  # its table numbers inputs_embeds [B, S_l, D], not ids
    ("recurrent_gemma", True, {}),  # conv halo + channel-sharded RG-LRU; a document starts 1 past the shard edge
    ("rwkv", True, {}),  # token shift (halo 1) + channel-sharded WKV
    ("xlstm", True, {}),  # head-sharded mLSTM; mode "inference": whole chunks of 4 chunkwise, the rest stepwise
]
CASES_SP4 = [
    ("lfm2", True, {}),
    ("nemotron_h", True, {"mamba_heads": 8, "groups": 2}),  # groups < sp: B/C replicated
    ("falcon_h1", False, {"mamba_heads": 8, "groups": 4, "checkpointing": True}),
    ("nemotron_h", False, {"mamba_heads": 4, "groups": 1, "kv_heads": 1}),  # attention kv heads < sp
    ("biogpt", True, {"checkpointing": True}),
    ("zaya", True, {"docs": (8, 7, 9, 8), "checkpointing": True}),  # starts at a shard edge and inside a halo
    ("musicgen", False, {}),  # table of 16 rows: every rank grows it to S, as the model does without SP
    ("recurrent_gemma", True, {"checkpointing": True}),  # attention kv heads (2) < sp: replicated
    ("rwkv", False, {}),
    ("xlstm", False, {"mode": "train"}),  # one head per rank, the chunkwise kernel alone over the whole sequence
]


@pytest.mark.parametrize("sp, cases", [(2, CASES_SP2), (4, CASES_SP4)], ids=["sp2", "sp4"])
def test_mixers_equal_no_sp(pool, sp, cases):
    assert pool.run(_exact, sp, sp, cases)[0] == [f"{a}{' packed' if p else ''}" for a, p, _ in cases]


EDGES = (8, 7, 9, 8)  # starts at 8, 15, 24: at a shard boundary (sp 4: 8, 24), inside the next rank's halo (15)
CASES_MAMBA1 = {
    2: [
        ("mamba", True, {"docs": EDGES}),  # Mamba-1 alone; doc [15, 24) spans the sp-2 boundary at 16
        ("falcon_mamba", True, {}),  # its B, C, dt norms; DOCS: starts inside shards, documents across them
        ("jamba", True, {}),  # Mamba-1 beside attention and experts
        # Zamba: per-head x_proj/dt_proj, one scan call per head; in float64 (its fp32 gradients round at 4e-5 of their
        # scale with or without SP; the model casts A, D and dt's bias to fp32 itself, so float64 is exact to ~3e-7)
        ("zamba", True, {"dtype": torch.float64}),
        ("mamba", False, {"right_pad": 5}),
    ],
    4: [
        ("mamba", True, {"docs": EDGES, "checkpointing": True}),
        ("jamba", False, {"kv_heads": 4}),
        ("zamba", False, {"dtype": torch.float64, "checkpointing": True}),
    ],
}


def _mamba1(sp: int) -> list[str]:
    return _exact(sp, CASES_MAMBA1[sp])


def test_mamba1_mixers_equal_no_sp(pool):
    """Mamba-1 (channel-sharded selective scan, halo conv) at sp 2 and 4, both in one test: logits and
    every gradient against the plain model, packed documents against each document alone."""
    for sp, cases in CASES_MAMBA1.items():
        assert pool.run(_mamba1, sp, sp)[0] == [f"{a}{' packed' if p else ''}" for a, p, _ in cases]


CASES_LIGHTNING = {
    1: [("minimax", True, {})],  # sp 1: packed documents kept apart (the model's own recurrence runs across them)
    2: [("minimax", True, {}), ("minimax", False, {"right_pad": 5})],  # a padding mask on one rank only
    4: [("minimax", True, {"docs": EDGES, "checkpointing": True})],  # a document starts at a shard edge
}


def _lightning(sp: int) -> list[str]:
    return _exact(sp, CASES_LIGHTNING[sp])


def test_minimax_lightning_attention_equals_no_sp(pool):
    """MiniMax's lightning attention (heads sharded, the model's own block recurrence over the full sequence,
    blocks of 8 tokens) at sp 1, 2 and 4: per-position logits and every gradient against the plain model,
    packed documents against each one alone (the recurrence restarts at every document start)."""
    for sp, cases in CASES_LIGHTNING.items():
        assert pool.run(_lightning, sp, sp)[0] == [f"{a}{' packed' if p else ''}" for a, p, _ in cases]


F64 = {"dtype": torch.float64}
FALCON_GQA = {"new_decoder_architecture": True, "num_kv_heads": 2, "dtype": torch.float64}  # fused [Hkv, H/Hkv+2, D]
CASES_OWN_SCORES = {
    # sp 1: packed documents kept apart (their own masks leak; Doge's own registry lacks the SP attention)
    1: [("bloom", True, F64), ("mpt", True, F64), ("doge", True, F64)],
    2: [
        ("bloom", True, F64),  # ALiBi for the rank's heads, fused [H, 3, D] query_key_value, residual inside
        ("falcon", True, F64),  # rotary gathered, multi-query [H + 2, D]: the shared k/v rows on both ranks
        ("gpt_neo", True, F64),  # a local layer (window 8) from its own buffer, documents from the mask
        ("mpt", False, F64),  # ALiBi position bias cut by head, fused [3, H, D] Wqkv, a boolean mask
        ("doge", True, F64),  # its key gate gathered, A cut by kv head, each query's top 8 keys by the gate
        ("doge", False, {**F64, "sliding_window": 8}),  # the model's window (8) in the full-sequence mask
        ("trocr", True, F64),  # its width read from its input, told H_l * D; its learned table numbered per document
        ("trocr", False, F64),  # one document: its learned table reads each shard's global positions
        ("xlnet", False, F64),  # relative encodings of the model for S, residual + LayerNorm after the reduction
    ],
    4: [
        ("falcon", True, FALCON_GQA),
        ("bloom", False, {**F64, "checkpointing": True}),  # 2 kv heads < sp 4
        ("doge", True, F64),  # 2 kv heads < sp 4: each kv head's gate and A on two ranks
        ("trocr", True, {**F64, "docs": EDGES, "checkpointing": True}),  # one head per rank; starts at shard edges
        ("xlnet", False, {**F64, "attn_type": "uni", "clamp_len": 20}),  # the model's causal mask for S; clamped r
    ],
}


def _own_scores(sp: int) -> list[str]:
    return _exact(sp, CASES_OWN_SCORES[sp])


def test_attention_computing_its_own_scores_equals_no_sp(pool):
    """The head-parallel fallback (BLOOM, Falcon, GPT-Neo, MPT, Doge, TrOCR's decoder;
    XLNet's relative attention, ``mixers/xlnet.py``, unpacked) at sp 1, 2 and 4 in one test: per-position
    logits and every gradient against the plain model (float64), packed documents against each one alone."""
    for sp, cases in CASES_OWN_SCORES.items():
        assert pool.run(_own_scores, sp, sp)[0] == [f"{a}{' packed' if p else ''}" for a, p, _ in cases]


LOOP = {"num_hidden_layers": 3, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"], "loop_layer_index_start": 1,
        "loop_layer_index_end": 3}  # two looped layers: its message attention has more than one block to weigh
CASES_PAIR_BIAS = {  # fp32: Inkling-2's router casts to fp32, Inkling's experts run grouped_mm (no float64)
    # sp 1: packed rows run per document (the model's own positions, convolutions and bias span the row)
    1: [("inkling2", True, {})],
    2: [
        ("inkling", True, {}),  # relative logits over 6 distances, log scaling, k/v convolutions cut by channel
        ("inkling2", True, {}),  # sinks, gated output, dynamic convolutions in its full layer, depth attention
        ("inkling2_loop", True, LOOP),  # its looped layers run twice (message gates into keys and values)
        ("inkling", False, {}),
    ],
    4: [("inkling2", True, {}), ("inkling", False, {})],  # 2 kv heads < sp 4: each kv head on two ranks
}


def _pair_bias(sp: int) -> list[str]:
    return _exact(sp, CASES_PAIR_BIAS[sp])


def test_attention_with_its_own_pair_bias_equals_no_sp(pool):
    """Inkling, Inkling-2 and Inkling-2 Loop (``mixers/pair_bias.py``: head-parallel, per document) at sp 1, 2
    and 4: per-position logits and every gradient against the plain model (fp32), packed documents (starts
    inside shards and at an sp 4 edge) against each one alone: the log scaling, relative bias and
    convolutions restart per document."""
    for sp, cases in CASES_PAIR_BIAS.items():
        assert pool.run(_pair_bias, sp, sp)[0] == [f"{a}{' packed' if p else ''}" for a, p, _ in cases]


CASES_SEGMENT_BIAS = {  # float64; each row holds a zero id (the model's left padding: the row's count decides)
    2: [("cpmant", False, F64)],
    4: [("cpmant", False, F64)],  # (the model supports no activation checkpointing)
}


def _segment_bias(sp: int) -> list[str]:
    done = _exact(sp, CASES_SEGMENT_BIAS[sp])
    if sp > 2:
        return done
    from ulysses_sp.mixers.guard import check_document_mixing

    model = hybrid_model("cpmant")
    with pytest.raises(ValueError, match=r"(?s)cannot be kept apart in CpmAntForCausalLM.*gives the row one prompt"):
        check_document_mixing(model)
    mesh = init_mesh((1, sp))
    handle = apply_mixers(model, mesh)
    s_l = S // sp
    pos = _positions(True)[:, mesh.sp_rank * s_l : (mesh.sp_rank + 1) * s_l]
    with pytest.raises(ValueError, match="CpmAntAttention: packed documents cannot be kept apart: its model reads no"):
        model(input_ids=global_batch(3, B, S, vocab=V)[:, : pos.shape[1]], position_ids=pos, use_cache=False)
    handle.remove()
    return done + ["packed refused"]


def test_cpmant_attention_over_its_prompt_prefixed_row_equals_no_sp(pool):
    """CPM-Ant (``mixers/segment_bias.py``) at sp 2 and 4: its model's mask and segment/position bias built for
    the whole prompt-prefixed row, its attention head-parallel over it, the prompt rows summed on every rank:
    per-position logits and every gradient against the plain model (float64), a zero id in each row (its
    left padding, counted over the row). Packed rows are refused (one prompt per row, attention both ways): by
    ``check_document_mixing`` before a step, and by the handler at sp 2."""
    for sp, cases in CASES_SEGMENT_BIAS.items():
        assert pool.run(_segment_bias, sp, sp)[0] == [a for a, _, _ in cases] + ["packed refused"] * (sp == 2)


def test_attention_computing_its_own_scores_refuses_heads_that_do_not_divide():
    model = hybrid_model("bloom")
    mesh = SimpleNamespace(sp_size=3, sp_rank=0, ring_size=1)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.self_attention: BloomAttention runs head-parallel under "
                       r"sequence parallelism, but its 4 attention heads do not divide by sp_size 3; use an sp_size "
                       r"that divides its heads \(2, 4\)"):  # fmt: skip
        shard_mixers(model, mesh, HANDLERS)
    assert not any("forward" in vars(m) for m in model.modules())


def test_doges_per_kv_head_vector_is_cut_by_kv_head_unless_its_size_is_ambiguous():
    """Doge's ``A`` ``[Hkv]`` is cut with the kv heads and its ``dt_proj`` (all kv heads' values -> one gate per
    kv head) is its key gate; with as many kv heads as head features the vector's meaning is not readable
    from its shape: refused, naming it."""
    from ulysses_sp.mixers.guard import refusals
    from ulysses_sp.mixers.head_cuts import head_cut, local_params

    attn = hybrid_model("doge").model.layers[0].self_attn
    cut = head_cut(attn)
    assert (cut.kv_params, cut.kv_gate, cut.kv_heads) == (("A",), "dt_proj", 2)
    assert torch.equal(local_params(attn, cut, 4, 3)["A"], attn.A[1:])  # rank 3's query head 3 uses kv head 1
    ambiguous = hybrid_model("doge", num_attention_heads=16, num_key_value_heads=2, head_dim=2)
    assert any("parameter A (2,) has one entry per kv head or per head feature (kv heads = head dim = 2)" in m
               for m in refusals(ambiguous))  # fmt: skip


def _inkling_convolutions() -> list[torch.nn.Module]:
    """Inkling's and Inkling-2's short convolutions (kernel 4: a halo of 3) and Inkling-2's dynamic one."""
    from transformers.models.inkling.modeling_inkling import InklingShortConvolution
    from transformers.models.inkling2.modeling_inkling2 import (
        Inkling2DynamicShortConvolution,
        Inkling2ShortConvolution,
    )

    torch.manual_seed(0)
    mods = [InklingShortConvolution(16, 4, 0, 0), Inkling2ShortConvolution(16, 4, 0, 1),
            Inkling2DynamicShortConvolution(16, 24, 2, 4, 0, 2)]  # fmt: skip
    with torch.no_grad():
        for p in (p for m in mods for p in m.parameters()):
            p.normal_(0, 0.5)
    return mods


class _Root(torch.nn.Module):
    """A model root for one convolution: ``position_ids`` enter here (the tracker's hook), as in a decoder."""

    def __init__(self, conv: torch.nn.Module) -> None:
        super().__init__()
        self.conv = conv
        self.two_inputs = "dynamic_input" in inspect.signature(conv.forward).parameters  # Inkling-2's

    def forward(self, x, dynamic, position_ids=None):
        return self.conv(x, dynamic, cache=None) if self.two_inputs else self.conv(x, cache=None)


def _windows(sp: int, docs: tuple[int, ...]) -> list[str]:
    """Each Inkling convolution alone at ``sp``: outputs at every position, the input and dynamic-input
    gradients and the weights' against each packed document run alone without SP."""
    mesh = init_mesh((1, sp))
    cols = slice(mesh.sp_rank * (S // sp), (mesh.sp_rank + 1) * (S // sp))
    g = torch.Generator().manual_seed(1)
    x, dyn, proj = (torch.randn(B, S, n, generator=g) for n in (16, 24, 16))
    starts = torch.tensor((0,) + docs).cumsum(0).tolist()
    done = []
    for conv in _inkling_convolutions():
        ref, sharded = _Root(conv), _Root(copy.deepcopy(conv))
        xr, dr = x.clone().requires_grad_(), dyn.clone().requires_grad_()
        want = torch.cat([ref(xr[:, s:e], dr[:, s:e]) for s, e in zip(starts, starts[1:])], dim=1)
        (want * proj).sum().backward()
        handle = apply_mixers(sharded, mesh)
        assert handle.wrapped == [("conv", "causal_window")]
        xl, dl = x[:, cols].clone().requires_grad_(), dyn[:, cols].clone().requires_grad_()
        got = sharded(xl, dl, position_ids=_positions(True, docs)[:, cols])
        torch.testing.assert_close(got, want[:, cols].detach(), rtol=1e-5, atol=1e-5)
        (got * proj[:, cols]).sum().backward()
        torch.testing.assert_close(xl.grad, xr.grad[:, cols], rtol=1e-5, atol=1e-5)  # the halo's gradient came back
        if "Dynamic" in type(conv).__name__:
            torch.testing.assert_close(dl.grad, dr.grad[:, cols], rtol=1e-5, atol=1e-5)
        grads = {n: p.grad for n, p in sharded.named_parameters()}
        for t in grads.values():
            dist.all_reduce(t, group=mesh.sp_group)
        assert_grads_close(grads, {n: p.grad for n, p in ref.named_parameters()}, atol_cap=math.inf)
        handle.remove()
        done.append(type(conv).__name__)
    return done


def test_inkling_convolutions_equal_no_sp(pool):
    """Inkling's short convolutions alone (the layers' own; those inside attention run with it: ``pair_bias``)
    at sp 2 and 4, packed: a document start inside a halo, at a shard edge, inside a shard."""
    names = ["InklingShortConvolution", "Inkling2ShortConvolution", "Inkling2DynamicShortConvolution"]
    assert pool.run(_windows, 2, 2, (8, 7, 9, 8))[0] == names
    assert pool.run(_windows, 4, 4, (5, 12, 9, 6))[0] == names


def test_every_mixer_is_claimed_and_nothing_else():
    claimed = {}
    for arch in ("lfm2", "nemotron_h", "falcon_h1", "granitemoehybrid", "bamba", "mamba2", "mamba", "falcon_mamba",
                 "jamba", "zamba", "opt", "biogpt", "bloom", "gpt_neo", "zaya", "phimoe", "musicgen",
                 "musicgen_melody", "recurrent_gemma", "rwkv", "minimax", "xlstm", "doge", "inkling2", "cpmant",
                 "trocr"):  # fmt: skip
        model = hybrid_model(arch)
        claimed[arch] = sorted(
            {(type(m).__name__, h.name) for m in model.modules() if (h := claimed_by(m, HANDLERS))}
        )
        assert has_unsharded_mixers(model)
    assert claimed == {
        "lfm2": [("Lfm2ShortConv", "short_conv")],
        "nemotron_h": [("NemotronHMamba2Mixer", "mamba2")],
        "falcon_h1": [("FalconH1Mixer", "mamba2")],
        "granitemoehybrid": [("GraniteMoeHybridMambaLayer", "mamba2")],
        "bamba": [("BambaMixer", "mamba2")],
        "mamba2": [("Mamba2Mixer", "mamba2")],
        "mamba": [("MambaMixer", "mamba1")],
        "falcon_mamba": [("FalconMambaMixer", "mamba1")],
        "jamba": [("JambaMambaMixer", "mamba1")],
        "zamba": [("ZambaMambaMixer", "mamba1_heads")],
        "opt": [("OPTLearnedPositionalEmbedding", "learned_positions")],
        "biogpt": [("BioGptLearnedPositionalEmbedding", "learned_positions")],
        "bloom": [("BloomAttention", "own_scores")],
        "gpt_neo": [("GPTNeoSelfAttention", "own_scores")],
        "zaya": [("ZayaCCAProjection", "causal_window")],
        "phimoe": [("PhimoeAttention", "mask_window")],
        "musicgen": [("MusicgenSinusoidalPositionalEmbedding", "counted_positions")],
        "musicgen_melody": [("MusicgenMelodySinusoidalPositionalEmbedding", "counted_positions")],
        "recurrent_gemma": [("RecurrentGemmaRecurrentBlock", "rg_lru")],
        "rwkv": [("RwkvFeedForward", "rwkv"), ("RwkvSelfAttention", "rwkv")],
        "minimax": [("MiniMaxLightningAttention", "lightning_attention")],
        "xlstm": [("xLSTMLayer", "mlstm")],
        "doge": [("DogeAttention", "own_scores")],
        "inkling2": [("Inkling2BlockAttentionResidual", "depth_attention"), ("Inkling2DynamicShortConvolution", "causal_window"),
                     ("Inkling2FullAttention", "pair_bias"), ("Inkling2ShortConvolution", "causal_window"),
                     ("Inkling2SlidingAttention", "pair_bias")],  # the convolutions inside attention: run with it
        "cpmant": [("CpmAntAttention", "segment_bias"), ("CpmAntModel", "segment_bias")],  # the model builds the row's bias
        "trocr": [("TrOCRAttention", "own_scores"), ("TrOCRLearnedPositionalEmbedding", "counted_lookup")],
    }
    assert not needs_plain_layout(hybrid_model("opt")) and needs_plain_layout(hybrid_model("jamba"))
    assert not needs_plain_layout(hybrid_model("phimoe")) and needs_plain_layout(hybrid_model("zaya"))
    assert not has_unsharded_mixers(tiny_model("llama"))


@pytest.mark.parametrize(
    "arch, kw, sp, message",
    [
        (
            "nemotron_h",
            {"mamba_heads": 4, "groups": 2},
            8,
            r"NemotronHMamba2Mixer \(4 heads, 2 B/C groups\): the heads are not divisible by sp_size 8",
        ),
        (
            "falcon_h1",
            {"mamba_heads": 6, "groups": 2},
            3,
            r"FalconH1Mixer \(6 heads, 2 B/C groups\): sp_size 3 neither divides the groups",
        ),
        ("lfm2", {}, 3, r"Lfm2ShortConv: 32 convolution channels are not divisible by sp_size 3"),
        ("zamba", {}, 3, r"ZambaMambaMixer \(Mamba-1, 2 heads of 32 channels\): a head's channels are not divisible by "
         r"sp_size 3 \(each head's scan is sharded by channel\); sp sizes that divide them: 2, 4, 8, 16, 32"),
        ("jamba", {}, 5, r"JambaMambaMixer \(Mamba-1, 64 channels\): the channels are not divisible by sp_size 5 "
         r"\(its selective scan is sharded by channel\); sp sizes that divide them: 2, 4, 8, 16, 32, 64"),
    ],
)
def test_refuses_when_heads_do_not_divide(arch, kw, sp, message):
    model = hybrid_model(arch, **kw)
    mesh = SimpleNamespace(sp_size=sp, sp_rank=0, ring_size=1)  # the check runs before any collective
    with pytest.raises(
        ValueError,
        match=r"sequence parallelism cannot shard these mixers:\nmodel\.layers\.0\.\w+: " + message,
    ):
        shard_mixers(model, mesh, HANDLERS)
    assert not any("forward" in vars(m) for m in model.modules())  # nothing wrapped


def test_a_ring_layout_is_refused_naming_sp_sizes_that_work_and_the_named_size_does():
    """LFM2 with 6 attention heads at sp 4 gets ring_size 2 (Ulysses 2 splits the heads): its short
    convolution needs ring_size 1, which sp 4 cannot give. The message names the sp sizes that split the
    6 heads and the 48 channels (2, 3 or 6), not 'ring_size=1' (impossible there); each of them passes."""
    from ulysses_sp.mixers.apply import usable_sp_sizes

    model = hybrid_model("lfm2", hidden_size=48, num_attention_heads=6, kv_heads=6)
    with pytest.raises(ValueError, match=r"ring_size 2; use an sp size whose ranks split its attention heads and "
                       r"its mixers' heads: 2, 3 or 6$"):  # fmt: skip
        apply_mixers(model, SimpleNamespace(sp_size=4, sp_rank=0, ring_size=2))
    for sp in (2, 3, 6):  # the fix: plain Ulysses at each named size shards the mixers
        apply_mixers(model, SimpleNamespace(sp_size=sp, sp_rank=0, ring_size=1, sp_group=None)).remove()
    assert usable_sp_sizes(hybrid_model("lfm2")) == "2 or 4"  # 4 heads, 32 channels


def test_refuses_local_document_boundaries_and_unbound_handlers():
    with pytest.raises(ValueError, match="seq_idx describe the local shard's documents"):
        refuse_local_boundaries({"seq_idx": torch.zeros(1)}, "Lfm2ShortConv")
    model = hybrid_model("lfm2")
    with pytest.raises(ValueError, match="needs a PositionTracker: use mixers.apply.apply_mixers"):
        shard_mixers(model, SimpleNamespace(sp_size=2, sp_rank=0, ring_size=1), HANDLERS)


def _opt_without_positions(sp: int) -> str:
    mesh = init_mesh((1, sp))
    model = hybrid_model("opt")
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh)
    handle = apply_mixers(model, mesh)
    try:
        model(input_ids=torch.randint(0, V, (1, S // sp)), use_cache=False)
    except ValueError as e:
        return str(e)
    finally:
        handle.remove(), reg.remove()
    return "no error"


def test_learned_positions_without_position_ids_are_refused_under_sp_and_any_layout_is_accepted(pool):
    """OPT numbers tokens by its mask's cumsum when no position_ids come: on a shard that restarts at 0
    (silently wrong). A model call without them is refused on every rank (the SP attention's check); the
    embedding itself refuses a call without them at sp > 1; a lookup needs no neighbour, so the ring's
    zigzag layout is accepted (a convolution's handler refuses it)."""
    assert all("called without position_ids" in m for m in pool.run(_opt_without_positions, 2, 2))
    model = hybrid_model("opt")
    handle = apply_mixers(model, SimpleNamespace(sp_size=2, sp_rank=0, ring_size=2, sp_group=None))
    table = model.model.decoder.embed_positions
    with pytest.raises(ValueError, match=r"OPTLearnedPositionalEmbedding: without position_ids .* every one of the "
                       r"2 shards would start at position 0; pass position_ids"):  # fmt: skip
        table(torch.ones(1, 8), 0)
    positions = torch.arange(8, 16)[None]  # rank 1's global positions: the table's rows 8..15 (+ OPT's offset 2)
    torch.testing.assert_close(table(torch.ones(1, 8), 0, position_ids=positions), table.weight[10:18][None])
    handle.remove()
    assert "forward" not in vars(table)


def _bytes(sp: int) -> list[dict]:
    from bench.mixer_bench import mixer_bytes

    return mixer_bytes(init_mesh((1, sp)), 64)


def test_mixer_exchanges_are_the_analytic_minimum(pool):
    """Two all-to-alls forward, two backward, per mixer layer (Mamba-1: and its conv halo, one each way);
    bytes = the head-sharded minimum."""
    rows = pool.run(_bytes, 2, 2)[0]
    assert [r["mixer"] for r in rows] == ["short_conv", "mamba2 G=2", "mamba2 G=8", "mamba1"]
    for r in rows:
        assert r["a2a_calls"] == (6 if r["mixer"] == "mamba1" else 4) and r["bytes"] == r["analytic"] > 0, r


def test_a_wrap_failing_part_way_restores_the_modules_already_wrapped():
    """LFM2 has two short convolutions: the second wrap fails, the first is undone before the error."""
    from ulysses_sp.mixers.documents import PositionTracker
    from ulysses_sp.mixers.short_conv import ShortConvHandler

    model = hybrid_model("lfm2")
    mesh = SimpleNamespace(sp_size=2, sp_rank=0, ring_size=1, sp_group=None)
    calls = []

    class FailsOnSecond(ShortConvHandler):
        def wrap(self, module, mesh):
            calls.append(module)
            if len(calls) == 2:
                raise RuntimeError("wrap failed on the second mixer")
            return super().wrap(module, mesh)

    with pytest.raises(RuntimeError, match="wrap failed on the second mixer"):
        shard_mixers(model, mesh, [FailsOnSecond(PositionTracker(mesh))])
    assert len(calls) == 2 and is_sharded(calls[0]) is False
    assert not any("forward" in vars(m) for m in model.modules())


def _linear_hybrid(kind: str):
    import transformers as T

    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False, intermediate_size=48,
                  layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4)  # fmt: skip
    if kind == "gated_delta_net":
        cfg = T.Qwen3_5TextConfig(**common, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                                  linear_key_head_dim=8, linear_value_head_dim=8)  # fmt: skip
        return T.Qwen3_5ForCausalLM(cfg)
    common["num_key_value_heads"] = 4
    cfg = T.KimiLinearConfig(**common, moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                             mlp_layer_types=["dense", "dense"], kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
                             qk_nope_head_dim=8, v_head_dim=8, linear_num_heads=4, linear_head_dim=8,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return T.KimiLinearForCausalLM(cfg)


@pytest.mark.parametrize("kind", ["short_conv", "mamba2", "mamba1", "gated_delta_net", "kimi_delta_attention",
                                  "causal_window"])
def test_every_mixer_refuses_a_cache_under_sp(kind):
    """One cache rule for all: at sp > 1 a cache is refused before any exchange (the mixer
    could neither read it nor fill it), naming the module and the fix."""
    if kind in ("short_conv", "mamba2", "mamba1", "causal_window"):
        model = hybrid_model({"short_conv": "lfm2", "mamba2": "bamba", "mamba1": "jamba", "causal_window": "zaya"}[kind])
    else:
        model = _linear_hybrid(kind)
    mesh = SimpleNamespace(sp_size=2, sp_rank=0, ring_size=1, sp_group=None)
    handle = apply_mixers(model, mesh)
    (name, handler), *_ = handle.wrapped
    assert handler == kind
    with pytest.raises(ValueError, match=r"a cache \(use_cache=True: generation\) is not supported under sequence "
                       r"parallelism; pass use_cache=False"):  # fmt: skip
        model.get_submodule(name)(torch.zeros(1, 4, 32), cache=object())
    handle.remove()
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_self_numbering_position_table_reads_the_shards_positions_and_refuses_without_them():
    """Musicgen's sinusoidal table numbers its input 0..S_l-1 itself: under the handler it returns the rows of
    the model's position ids (captured at the root), refuses a direct call without them and a cache at sp > 1."""
    model = hybrid_model("musicgen")
    handle = apply_mixers(model, SimpleNamespace(sp_size=2, sp_rank=1, ring_size=2, sp_group=None))
    table = model.model.decoder.embed_positions
    with pytest.raises(ValueError, match=r"MusicgenSinusoidalPositionalEmbedding: it numbers the tokens it is given "
                       r"0..S_l-1 itself, so every one of the 2 shards would start at position 0; pass position_ids"):  # fmt: skip
        table(torch.zeros(1, 1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"a cache \(use_cache=True: generation\) is not supported"):
        table(torch.zeros(1, 1, 8, dtype=torch.long), 3)
    handle.remove()
    assert "forward" not in vars(table) and not model._forward_pre_hooks


def test_trocr_is_claimed_and_refuses_by_name_what_it_cannot_run():
    """TrOCR's decoder: its attention (the width read from its input's size) and its learned table are claimed;
    the table refuses a call without position ids and a cache at sp > 1, the cross-attention encoder states;
    its sinusoidal table (a cumsum of the non-padding tokens) stays refused, and so does a width read otherwise."""
    from torch import nn

    from ulysses_sp.mixers.guard import refusals
    from ulysses_sp.mixers.input_width import input_width, width_refusal

    model = hybrid_model("trocr")
    assert refusals(model) == [] and input_width(type(model.model.decoder.layers[0].self_attn))
    handle = apply_mixers(model, SimpleNamespace(sp_size=2, sp_rank=0, ring_size=1, sp_group=None))
    table, ids = model.model.decoder.embed_positions, torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"TrOCRLearnedPositionalEmbedding: given no position ids it numbers the tokens "
                       r"it is given 0..S_l-1 itself, so every one of the 2 shards would start at position 0"):  # fmt: skip
        table(ids)
    with pytest.raises(ValueError, match=r"a cache \(use_cache=True: generation\) is not supported"):
        table(ids, cache_length=3)
    assert torch.equal(table(ids, position_ids=torch.arange(8)), table.weight[None, 2:10])  # given ids: its own lookup
    with pytest.raises(ValueError, match=r"TrOCRAttention: cross-attention to encoder states \(key_value_states\) is "
                       r"not run under sequence parallelism"):  # fmt: skip
        model.model.decoder.layers[0].encoder_attn(torch.zeros(1, 8, 32), key_value_states=torch.zeros(1, 5, 32))
    handle.remove()
    assert refusals(hybrid_model("trocr", use_learned_position_embeddings=False)) == [
        "decoder stack: embed_positions (TrOCRSinusoidalPositionalEmbedding) mixes tokens along the sequence (its code "
        "calls cumsum), which sequence parallelism does not shard"]  # fmt: skip

    class Stored(nn.Module):  # a width from an attribute: what it holds is not known
        def forward(self, hidden_states, attention_mask=None):
            embed_dim = self.width
            return hidden_states.reshape(-1, embed_dim)

    assert width_refusal(Stored()) == ("its forward reads the heads' output width into embed_dim other than from its "
                                       "input's size, so it cannot run on a share of its heads")  # fmt: skip


def test_recurrent_gemma_block_refuses_a_cache_and_channels_that_do_not_divide():
    """Griffin's recurrent block keeps conv and recurrent states for generation (use_cache=True): refused at
    sp > 1 before any exchange; its RG-LRU is sharded by channel, so the channels must divide by sp."""
    model = hybrid_model("recurrent_gemma")
    with pytest.raises(ValueError, match=r"RecurrentGemmaRecurrentBlock \(RG-LRU, 32 channels\): the channels are not "
                       r"divisible by sp_size 3 .* use an sp_size that divides 32"):  # fmt: skip
        shard_mixers(model, SimpleNamespace(sp_size=3, sp_rank=0, ring_size=1, sp_group=None), HANDLERS)
    handle = apply_mixers(model, SimpleNamespace(sp_size=2, sp_rank=0, ring_size=1, sp_group=None))
    block = model.model.layers[0].temporal_block
    with pytest.raises(ValueError, match=r"RecurrentGemmaRecurrentBlock: a cache \(use_cache=True: generation\) is "
                       r"not supported under sequence parallelism"):  # fmt: skip
        block(torch.zeros(1, 4, 32), torch.arange(4)[None], None, use_cache=True)
    handle.remove()
    assert not any("forward" in vars(m) or "_rnn_scan" in vars(m) for m in model.modules())


def test_rwkv_refuses_a_state_and_channels_that_do_not_divide():
    """RWKV's time mixing keeps a per-layer state for generation: refused at sp > 1 before any exchange; its WKV
    recurrence is sharded by channel, so the channels must divide by sp (the channel mixing only shifts)."""
    model = hybrid_model("rwkv")
    with pytest.raises(ValueError, match=r"RwkvSelfAttention \(RWKV, 32 channels\): the channels are not divisible by "
                       r"sp_size 3 .* use an sp_size that divides 32"):  # fmt: skip
        shard_mixers(model, SimpleNamespace(sp_size=3, sp_rank=0, ring_size=1, sp_group=None), HANDLERS)
    handle = apply_mixers(model, SimpleNamespace(sp_size=2, sp_rank=0, ring_size=1, sp_group=None))
    for module in (model.rwkv.blocks[0].attention, model.rwkv.blocks[0].feed_forward):
        with pytest.raises(ValueError, match=r"\(layer 0\): a cache \(use_cache=True: generation\) is not supported"):
            module(torch.zeros(1, 4, 32), state=[torch.zeros(1, 32, 2)] * 5)
    handle.remove()
    assert not any("forward" in vars(m) for m in model.modules())


def test_minimax_lightning_attention_refuses_a_cache_and_heads_that_do_not_divide():
    """Lightning attention keeps ``K^T V`` per layer for generation: the model's own cached path at sp 1 (logits
    equal to the unwrapped model's, as the sharded path's are without a cache), refused at sp > 1 before any
    exchange; its recurrence is sharded by head, so the heads must divide by sp."""
    model = hybrid_model("minimax")
    ref = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"MiniMaxLightningAttention \(lightning attention, 4 heads\): the heads are "
                       r"not divisible by sp_size 3 .* use an sp_size that divides 4"):  # fmt: skip
        shard_mixers(model, SimpleNamespace(sp_size=3, sp_rank=0, ring_size=1, sp_group=None), HANDLERS)
    ids = global_batch(3, 1, 20, vocab=V)
    handle = apply_mixers(model, SimpleNamespace(sp_size=1, sp_rank=0, ring_size=1, sp_group=None))
    for cache in (True, False):
        want = ref(input_ids=ids, use_cache=cache).logits
        torch.testing.assert_close(model(input_ids=ids, use_cache=cache).logits, want, rtol=1e-5, atol=1e-5)
    handle.remove()
    handle = apply_mixers(model, SimpleNamespace(sp_size=2, sp_rank=0, ring_size=1, sp_group=None))
    with pytest.raises(ValueError, match=r"MiniMaxLightningAttention: a cache \(use_cache=True: generation\) is not "
                       r"supported under sequence parallelism"):  # fmt: skip
        model(input_ids=ids[:, :10], use_cache=True)
    handle.remove()
    assert not any("forward" in vars(m) for m in model.modules())
def test_xlstm_keeps_packed_documents_apart_at_sp1_and_refuses_a_state_heads_and_partial_chunks():
    """xLSTM's mLSTM layer, in one process: at sp 1 a packed row equals each document alone (the backend runs
    once per document; without the handler the row's recurrence crosses every boundary); a recurrent state
    (a cache) is refused for packed rows at sp 1 and at any sp > 1; heads must divide by sp; mode 'train'
    (the chunkwise kernel alone) refuses a document that is not a whole number of chunks, by name."""
    sp1 = SimpleNamespace(sp_size=1, sp_rank=0, ring_size=1, sp_group=None)
    model = hybrid_model("xlstm")
    ref = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"xLSTMLayer \(mLSTM, 4 heads\): the heads are not divisible by sp_size 3 "
                       r"\(its recurrence is sharded by head\); use an sp_size that divides 4"):  # fmt: skip
        shard_mixers(model, SimpleNamespace(sp_size=3, sp_rank=0, ring_size=1, sp_group=None), HANDLERS)
    ids, pos = global_batch(3, B, S, vocab=V), _positions(True)
    handle = apply_mixers(model, sp1)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(got, _reference(ref, ids, True), rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError, match=r"xLSTMLayer: a cache \(use_cache=True: generation\) is not supported "
                           r"with packed documents .* config.max_inference_chunksize = 16384 tokens"):  # fmt: skip
            model(input_ids=ids, position_ids=pos, use_cache=True)
    handle.remove()
    handle = apply_mixers(model, SimpleNamespace(sp_size=2, sp_rank=0, ring_size=1, sp_group=None))
    state = (torch.zeros(1, 4, 4, 8), torch.zeros(1, 4, 4), torch.zeros(1, 4, 1))
    with pytest.raises(ValueError, match=r"xLSTMLayer: a cache \(use_cache=True: generation\) is not supported under "
                       r"sequence parallelism; pass use_cache=False"):  # fmt: skip
        model.backbone.blocks[0].mlstm_layer(torch.zeros(1, 4, 32), state)
    handle.remove()
    model = hybrid_model("xlstm", mode="train")
    handle = apply_mixers(model, sp1)
    with pytest.raises(ValueError, match=r"config.mode 'train' runs the chunkwise kernel, which needs every sequence "
                       r"\(each packed document\) to be a multiple of chunk_size 4; got one of 5 tokens"):  # fmt: skip
        model(input_ids=ids, position_ids=pos, use_cache=False)
    handle.remove()
    assert not any("forward" in vars(m) for m in model.modules()) and not model._forward_pre_hooks


def _xlnet_refusals(sp: int) -> list[str]:
    from hybrid_models import hybrid_model

    mesh = init_mesh((1, sp))
    model = hybrid_model("xlnet").eval()
    apply_mixers(model, mesh)
    s_l = S // sp
    ids = global_batch(3, B, S, vocab=V)[:, :s_l]
    pos = torch.arange(mesh.sp_rank * s_l, (mesh.sp_rank + 1) * s_l).expand(B, -1)
    out = []
    for extra in ({"token_type_ids": torch.zeros_like(ids)}, {"perm_mask": torch.zeros(B, s_l, s_l)},
                  {"attention_mask": torch.ones_like(ids)}, {"output_attentions": True}):  # fmt: skip
        try:
            model(input_ids=ids, position_ids=pos, **extra)
            out.append("ran")
        except ValueError as e:
            out.append(str(e).split(" is not supported")[0])
    return out


def test_xlnet_refuses_by_name_what_its_model_builds_per_shard(pool):
    """Under SP, XLNet's segment matrix, permutation and padding masks and attention maps are refused by name."""
    assert pool.run(_xlnet_refusals, 2, 2)[0] == [
        "XLNetRelativeAttention: token_type_ids (a segment matrix over the shard's token pairs)",
        "XLNetRelativeAttention: a padding or permutation mask (attention_mask / input_mask / perm_mask)",
        "XLNetRelativeAttention: a padding or permutation mask (attention_mask / input_mask / perm_mask)",
        "XLNetRelativeAttention: output_attentions",
    ]

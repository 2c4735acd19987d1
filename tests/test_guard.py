"""The closed-world guard (``mixers.guard``): every module of every decoder layer is the SP attention,
position-wise, or a mixer SP shards — anything else is refused before the first step, by layer,
module and reason, whatever the model is called.

Pure logic on real transformers models (tiny configs from ``bench.model_sweep``) and on Llamas that
hide a sequence mixer (``hidden_mixer``); that the refused models really are wrong under SP, and the
passing ones exact, is ``test_model_sweep``'s part. ``initialize`` and ``prepare`` run the guard
(``test_initialize_refuses_a_hidden_mixer_on_every_rank`` here, ``test_hf_trainer`` for ``prepare``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a top-level folder of the repository, not an installed package
    sys.path.insert(0, str(ROOT))

from hidden_mixer import TokenScale, TokenShift, hidden_mixer_llama  # noqa: E402

from bench.model_sweep import build, tiny_config  # noqa: E402
from ulysses_sp import declare_position_wise  # noqa: E402
from ulysses_sp.attention.registration import num_attention_layers  # noqa: E402
from ulysses_sp.mixers.base import check_mixers  # noqa: E402
from ulysses_sp.mixers.classify import MIXER, POSITION_WISE, UNKNOWN, verdict  # noqa: E402
from ulysses_sp.mixers.guard import SUPPORTED_MIXERS, check_sequence_mixing, classify_model, refusals  # noqa: E402

CLASSIC = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "phi3", "mixtral", "qwen2_moe",
           "deepseek_v3", "olmo", "olmo2", "granite", "starcoder2"]  # fmt: skip


@pytest.mark.parametrize("family", CLASSIC)
def test_classic_families_pass_with_one_sp_attention_per_layer(family):
    model = build(family)
    findings = classify_model(model)
    assert refusals(model) == []
    layers = model.config.num_hidden_layers
    assert [f.layer for f in findings if f.kind == "attention"] == list(range(layers))
    check_sequence_mixing(model, sp_size=2)  # no error


@pytest.mark.parametrize(
    "family, expected",
    [
        ("lfm2", r"layer 0: conv \(Lfm2ShortConv\) mixes tokens along the sequence \(Conv1d, kernel 3"),
        ("falcon_h1", r"layer 0: mamba \(FalconH1Mixer\) mixes tokens along the sequence \(Conv1d, kernel 4"),
        ("qwen3_next", r"layer 0: linear_attn \(Qwen3NextGatedDeltaNet\) mixes tokens along the sequence"),
        ("nemotron_h", r"layer 0: mixer \(NemotronHMamba2Mixer\) mixes tokens along the sequence"),
        ("minimax", r"layer 1: MiniMaxDecoderLayer is a 'linear_attention' layer.*MiniMaxLightningAttention"),
        ("doge", r"layer 0: self_attn \(DogeAttention\) .*dispatches through a registry of its own"),
        ("bloom", r"layer 0: self_attention \(BloomAttention\) .*computes token-to-token scores itself"),
        ("xlnet", r"layer 0: rel_attn \(XLNetRelativeAttention\) computes its own attention scores .*its heads cannot "
         r"run apart: it is two-stream attention over relative position encodings"),  # no head-parallel fallback
        ("musicgen", r"decoder stack: embed_positions \(MusicgenSinusoidalPositionalEmbedding\) .*numbers the tokens "
         r"it is given 0..S-1 itself"),  # a sinusoidal table of arange(S_l): every shard would start at 0
        (
            "phimoe",
            r"layer 0: self_attn \(PhimoeAttention\) applies its sliding window \(config.sliding_window = 8\) "
            r"only through the model's attention mask",
        ),  # fmt: skip
    ],
)
def test_families_sp_would_get_wrong_are_refused_naming_the_cause(family, expected):
    """Without handlers (``handlers=()``); with them, XLNet is handled (``test_xlnet_is_handled``)."""
    model = build(family)
    with pytest.raises(ValueError, match=expected) as err:
        check_sequence_mixing(model, sp_size=2, handlers=())  # no mixer handler registered
    assert "attn_implementation" not in str(err.value)  # not the old, misleading reason
    check_sequence_mixing(model, sp_size=1)  # no SP: nothing to refuse


@pytest.mark.parametrize(
    "family, expected",
    [
        ("gemma4_assistant", r"decoder stack: Gemma4AssistantForCausalLM is a draft model for assisted decoding: "
         r"every one of its layers attends to the key/value states of another model \(shared_kv_states"),
        ("gemma4_unified_assistant", r"Gemma4UnifiedAssistantForCausalLM is a draft model"),
        ("blt", r"decoder stack: BltForCausalLM is a byte-latent transformer: .*patches whose boundaries its patcher "
         r"picks from each byte's entropy"),
    ],
)
def test_families_without_one_sequence_to_shard_are_refused_by_name(family, expected):
    """Refused whole (``mixers/stack.py``, ``vlm/families.py``) before their layers are looked for."""
    with pytest.raises(ValueError, match=expected):
        check_sequence_mixing(build(family), sp_size=2)


def test_gemma3n_is_admitted_and_checked_through_its_language_model():
    """Gemma 3n's merge is ``vlm.gemma3n``'s (``tests/test_vlm_llava.py``): the guard checks its decoder stack
    only (its towers encode whole images and clips on a rank), and finds every layer's attention there."""
    model = build("gemma3n")
    check_sequence_mixing(model, sp_size=2)
    assert [f.layer for f in classify_model(model) if f.kind == "attention"] == [0, 1, 2, 3]


def test_phi4_multimodal_s_towers_inside_its_decoder_are_left_alone_and_its_layers_checked():
    """Phi-4-multimodal's decoder holds its towers (``embed_tokens_extend``: a Conv2d patch embedding, a
    MultiheadAttention pooling head, a conformer); admitted as a VLM (``vlm/phi4mm.py`` encodes whole images and
    clips on a rank), only the decoder's own modules are read."""
    model = build("phi4_multimodal")
    findings = classify_model(model)
    assert refusals(model) == []
    assert [f.layer for f in findings if f.kind == "attention"] == [0, 1]
    assert not [f for f in findings if "embed_tokens_extend" in f.path]


def test_a_looped_model_s_layers_are_found_in_its_stacks():
    """HRM runs its H and L stacks (2 layers each) in cycles: num_hidden_layers (16) counts the runs; every
    layer module of both stacks is checked, each once, and the stacks' own final norms around them."""
    from ulysses_sp.mixers.stack import around_layers, decoder_layers

    model = build("hrm_text")
    stack, layers = decoder_layers(model)
    assert stack is model.model and list(layers) == [*model.model.L_module.layers, *model.model.H_module.layers]
    assert [n for n, _ in around_layers(stack, layers)] == [
        "embed_tokens", "rotary_emb", "L_module.final_norm", "H_module.final_norm"]  # fmt: skip
    assert [f.layer for f in classify_model(model) if f.kind == "attention"] == [0, 1, 2, 3]
    assert refusals(model) == []


def test_cross_attention_layers_are_not_counted_as_layers_the_sp_attention_runs_in():
    """Mllama's text model skips its cross-attention layers on text-only input; with images the SP
    attention refuses them (keys of another length than the rank's queries: ``test_attention``)."""
    from transformers import MllamaTextConfig

    assert num_attention_layers(MllamaTextConfig(num_hidden_layers=5, cross_attention_layers=[1, 3])) == 3


def test_falcon_h1_is_refused_in_every_layer_although_each_has_an_sp_attention():
    model = build("falcon_h1")
    found = classify_model(model, handlers=())
    assert {f.layer for f in found if f.kind == "attention"} == {0, 1}
    assert [(f.layer, f.cls) for f in found if f.kind == "refused"] == [
        (0, "FalconH1Mixer"),
        (1, "FalconH1Mixer"),
    ]


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("cumsum", r"layer 0: mlp \(CumsumMLP\) mixes tokens along the sequence \(its code calls cumsum\)"),
        ("conv", r"layer 0: mlp.conv \(Conv1d\) mixes tokens along the sequence \(Conv1d, kernel 3\)"),
        (
            "shift",
            r"layer 0: mlp.after \(TokenShift\) is a custom module the guard cannot place.*"
            r"declare_position_wise\(TokenShift\)",
        ),  # fmt: skip
    ],
)
def test_a_mixer_hidden_in_a_llama_mlp_is_refused(kind, expected):
    model = hidden_mixer_llama(kind)
    with pytest.raises(ValueError, match=expected):
        check_sequence_mixing(model, sp_size=2)
    assert [f.layer for f in classify_model(model) if f.kind == "refused"] == [0]  # layer 1 is plain


def test_declare_position_wise_admits_exactly_the_declared_class_and_undoes():
    model = hidden_mixer_llama("scale")
    assert len(refusals(model)) == 1 and "TokenScale" in refusals(model)[0]
    with declare_position_wise(TokenScale):
        assert refusals(model) == []
        assert verdict(model.model.layers[0].mlp.after).kind == POSITION_WISE

        class Sub(TokenScale):  # a subclass may override forward: not covered
            pass

        assert verdict(Sub(4)).kind == UNKNOWN
    assert len(refusals(model)) == 1  # taken back
    handle = declare_position_wise(TokenShift)
    assert refusals(hidden_mixer_llama("shift")) == []
    handle.remove()
    handle.remove()  # idempotent
    assert len(refusals(hidden_mixer_llama("shift"))) == 1
    with pytest.raises(TypeError, match="torch.nn.Module subclasses"):
        declare_position_wise(len)


def test_a_lora_model_passes():
    """PEFT's LoRA layers wrap each linear layer (the prepare() path trains such models)."""
    from models import tiny_model
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=targets, lora_dropout=0.1))
    assert refusals(model) == []
    assert sum(f.kind == "attention" for f in classify_model(model)) == 2


def test_torch_modules_by_type():
    assert verdict(nn.Conv1d(4, 4, 1)).kind == POSITION_WISE  # a pointwise convolution
    assert verdict(nn.Conv1d(4, 4, 4, groups=4)).why == "Conv1d, kernel 4"
    assert verdict(nn.GRU(4, 4)).kind == MIXER
    # recurrences written as a Python time loop are mixers by name, alone (without their conv or shift)
    from transformers import RecurrentGemmaConfig, RwkvConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru
    from transformers.models.rwkv.modeling_rwkv import RwkvSelfAttention

    assert verdict(RecurrentGemmaRglru(RecurrentGemmaConfig(hidden_size=32, lru_width=32, num_attention_heads=4))).kind == MIXER
    assert verdict(RwkvSelfAttention(RwkvConfig(hidden_size=32, attention_hidden_size=32))).kind == MIXER
    assert verdict(nn.MultiheadAttention(4, 2)).kind == MIXER
    assert verdict(nn.ZeroPad2d((0, 0, 1, -1))).kind == UNKNOWN  # RWKV's time shift is a padding
    for module in (
        nn.Linear(2, 2),
        nn.LayerNorm(2),
        nn.RMSNorm(2),
        nn.Dropout(),
        nn.GELU(),
        nn.Embedding(3, 2),
    ):
        assert verdict(module).kind == POSITION_WISE, module


def test_a_module_declared_position_wise_vouches_for_its_subtree():
    model = hidden_mixer_llama("conv")
    with declare_position_wise(type(model.model.layers[0].mlp)):
        assert refusals(model) == []  # the user's word for the whole MLP, conv included


class _ShortConvHandler:
    """A stand-in mixer handler (the real ones live in ``mixers``): claims modules with a depthwise
    Conv1d child, as a short-convolution handler would."""

    name = "short_conv"

    def matches(self, module: nn.Module) -> bool:
        return any(isinstance(c, nn.Conv1d) and c.kernel_size[0] > 1 for c in module.children())

    def check(self, module: nn.Module, sp_size: int) -> None:
        pass

    def wrap(self, module: nn.Module, mesh: object):
        return lambda: None


def test_a_module_a_mixer_handler_claims_is_a_supported_mixer():
    model = build("lfm2")
    assert len(refusals(model, handlers=())) == 1
    found = classify_model(model, handlers=(_ShortConvHandler(),))
    assert [(f.layer, f.path, f.kind) for f in found if f.kind != "attention"] == [(0, "conv", "mixer")]
    check_sequence_mixing(model, sp_size=2, handlers=(_ShortConvHandler(),))  # no error


def test_linear_attention_layers_do_not_count_as_sp_attention_layers():
    config = build("qwen3_next").config
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert num_attention_layers(config) == 1


def _initialize_hidden_mixer() -> str:
    from ulysses_sp import initialize

    model = hidden_mixer_llama("cumsum")
    try:
        initialize(model, {"train_micro_batch_size_per_gpu": 1}, mesh_param=(1, 2))
    except ValueError as err:
        return str(err)
    return "no error"


def test_initialize_refuses_a_hidden_mixer_on_every_rank(pool):
    messages = pool.run(_initialize_hidden_mixer, 2)
    for msg in messages:
        assert "sequence parallelism (sp_size 2) cannot train LlamaForCausalLM exactly" in msg
        assert "layer 0: mlp (CumsumMLP) mixes tokens along the sequence" in msg


def test_the_cli_refuses_a_local_model_whose_router_mixes_tokens(tmp_path):
    """``ulysses-sp train --model DIR --sp 2`` runs the guard in the launching process, on the model
    built on the meta device (``run.model_checks``): one line, exit 2, before any worker starts. Doge's
    MoE (``is_moe``): its router reshapes all tokens' logits to ``(2, B*S, K)``, pairing each token with
    others of the row (transformers notes it is not causal)."""
    import subprocess

    from transformers import AutoModelForCausalLM

    config = build("doge").config
    config.is_moe, config.num_experts = True, 16
    config.vocab_size = 512  # room for the CLI's byte-level tokenizer
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "doge")
    args = ["--model", str(tmp_path / "doge"), "--tokenizer", "byte", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "1",
            "--sp", "2", "--nproc", "2", "--no-progress", "--timeout", "60", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "ulysses_sp.cli.main", "train", *args],
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "[rank" not in proc.stderr, proc.stderr
    assert lines[0].startswith("ulysses-sp train: error: sequence parallelism (sp_size 2) cannot train DogeForCausalLM")
    assert "layer 0: mlp (DogeCDMoE)" in lines[0]


def test_doges_moe_router_is_refused_and_really_mixes_tokens():
    """Doge's attention runs head-parallel (``mixers/key_gates.py``), its MoE MLP (``is_moe``) is refused:
    the router reshapes all tokens' logits ``[B, S, 2K]`` to ``(2, B*S, K)``, so token 1's experts are
    scored from token 0's logits — on a shard, from other tokens than without SP."""
    config = tiny_config("doge")
    config.is_moe, config.num_experts = True, 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"layer 0: mlp \(DogeCDMoE\) mixes tokens along the sequence \(its own code "
                       r"multiplies and takes a softmax \(matmul, softmax\) outside any attention heads"):  # fmt: skip
        check_sequence_mixing(model, sp_size=2)
    assert not [m for m in refusals(model) if "DogeAttention" in m]
    moe = model.model.layers[0].mlp
    x = torch.randn(1, 8, config.hidden_size)
    moved = x.clone()
    moved[0, 0] += 1.0
    with torch.no_grad():
        change = (moe(moved)[0] - moe(x)[0]).abs().amax(-1)[0]  # [S]
    assert change[1] > 1e-4 * change[0], change  # token 1's output follows token 0's input


class _Affine(nn.Module):
    """Per-feature scale and shift of two inputs (ZAYA's residual scaling has this shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.bias = nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4))

    def forward(self, x, residual):
        return (x + self.bias) * self.scale - residual / 2


class _AffineShift(_Affine):
    def forward(self, x, residual):  # the same arithmetic on the previous token: not position-wise
        return x[:, :-1] * self.scale + residual


def test_causal_windows_are_claimed_and_pair_biases_run_whole():
    """ZAYA: its CCA projection (convolutions inside q/k, a delayed value half) is the causal-window
    handler's, its residual scaling per-feature arithmetic, nothing refused. Inkling: its attention (a
    relative-position bias over pairs) is the pair_bias handler's, with the convolutions inside it (not
    claimed apart); its layer's own convolutions are causal windows. An extra parameter that is neither cut
    by head nor shared leaves it refused, with both reasons."""
    zaya = build("zaya")
    assert refusals(zaya) == []
    assert {(f.path, f.why) for f in classify_model(zaya) if f.kind == "mixer"} == {
        ("self_attn.qkv_proj", "is sharded by the causal_window handler")}  # fmt: skip
    assert verdict(_Affine()).kind == POSITION_WISE and verdict(_AffineShift()).kind == UNKNOWN
    with torch.device("meta"):
        inkling = AutoModelForCausalLM.from_config(tiny_config("inkling_text"))
    assert refusals(inkling) == []
    assert {(f.path, f.why) for f in classify_model(inkling) if f.kind == "mixer"} == {
        ("self_attn", "is sharded by the pair_bias handler"), ("attn_sconv", "is sharded by the causal_window handler"),
        ("mlp_sconv", "is sharded by the causal_window handler")}  # fmt: skip
    claimed = {(n.split(".", 3)[-1], h.name) for n, _, h in check_mixers(inkling, 2, SUPPORTED_MIXERS)}
    assert claimed == {("self_attn", "pair_bias"), ("attn_sconv", "causal_window"), ("mlp_sconv", "causal_window")}
    inkling.model.layers[0].self_attn.extra = torch.nn.Parameter(torch.zeros(3, device="meta"))
    (found,) = refusals(inkling)
    assert found.startswith("layer 0: self_attn (InklingAttention) passes its attention a relative-position bias over "
                            "token pairs (position_bias") and found.endswith(
        "its heads cannot run apart either: InklingAttention's parameter extra (3,) is neither cut by head nor "
        "shared by all heads")  # fmt: skip


def test_a_window_kept_only_in_the_mask_is_passed_to_the_sp_attention():
    """Phi-MoE applies config.sliding_window to every layer through its mask alone: refused without the
    mask_window handler (test above), admitted with it as SP attention whose window the handler sets."""
    model = build("phimoe")
    assert refusals(model) == []
    found = [(f.layer, f.kind, f.why) for f in classify_model(model) if f.path == "self_attn"]
    assert found == [(i, "attention", "its window is set by the mask_window handler") for i in range(2)]


def test_xlnet_is_handled_and_refuses_packed_rows_naming_why():
    from ulysses_sp.mixers.guard import check_document_mixing

    model = build("xlnet")
    check_sequence_mixing(model, sp_size=2)  # its relative attention runs head-parallel (mixers/xlnet.py)
    with pytest.raises(ValueError, match=r"rel_attn \(XLNetRelativeAttention\): its relative attention takes no "
                       r"per-document positions"):  # fmt: skip
        check_document_mixing(model)

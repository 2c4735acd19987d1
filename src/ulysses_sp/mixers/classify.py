"""What one module does to the sequence dimension, judged from its type, its parameters and its code.

The closed-world guard (``mixers.guard``) asks ``verdict(module)`` for every module of every
decoder layer and gets one of:

- ``ATTENTION``: its code reads transformers' ``ALL_ATTENTION_FUNCTIONS`` registry, so with
  ``attn_implementation="ulysses_sp"`` its core attention is the SP attention (its children are
  still judged one by one);
- ``POSITION_WISE``: it acts on every token alone (linear layers, norms, activations, dropout,
  embeddings, rotary tables, MoE routers and experts; or a class the user declared with
  ``declare_position_wise``) — sequence shards need nothing from each other;
- ``COMPOSITE``: a container whose own code uses no sequence operation; its children decide;
- ``MIXER``: it mixes tokens along the sequence by other means (a convolution with kernel > 1, a
  recurrence, a scan, a shift, its own attention): refused unless a mixer handler claims it;
- ``UNKNOWN``: a leaf the guard cannot place: refused unless declared position-wise.

Nothing here depends on the model's name: a custom class is judged by what its code calls (the
names its methods and the module-level functions they call reference, followed two calls deep) and
by the shapes of its parameters. The rules are conservative: where a class matches no known
position-wise shape the answer is ``UNKNOWN``, never ``POSITION_WISE``.
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

ATTENTION, POSITION_WISE, COMPOSITE, MIXER, UNKNOWN = (
    "attention",
    "position-wise",
    "composite",
    "mixer",
    "unknown",
)

DECLARED = "__ulysses_sp_position_wise__"
"""Class attribute set by ``declare_position_wise`` (on the class itself, not inherited)."""

SEQUENCE_OPS = (
    "cumsum", "cumprod", "logcumsumexp", "cummax", "roll", "flip", "conv1d", "causal_conv1d_fn", "tril", "triu",
    "scaled_dot_product_attention",
    # transformers' recurrences whose time loop is plain Python (no sequence op to see): RecurrentGemma's
    # RG-LRU and RWKV's WKV, caught by name even in a module without a convolution or shift beside them
    "_rnn_scan", "rwkv_linear_attention", "rwkv_linear_attention_cpu",
)  # fmt: skip
"""Names whose use in a module's code means it combines positions along the sequence (scans, shifts,
convolutions, causal masks of its own, attention of its own)."""

SCORE_OPS = {"matmul", "bmm", "einsum", "baddbmm"}
NORM_OPS = {"rsqrt", "mean", "var", "std", "norm", "layer_norm", "rms_norm", "group_norm"}
ELEMENTWISE_OPS = {
    "relu", "gelu", "silu", "sigmoid", "tanh", "softplus", "erf", "exp", "pow", "clamp", "mish",
    "square", "sqrt", "elu", "leaky_relu", "hardtanh", "hardswish", "sin", "abs",
}  # fmt: skip
RESHAPE_OPS = {
    "cat",
    "pad",
    "zeros",
    "zeros_like",
    "new_zeros",
    "narrow",
    "split",
    "chunk",
    "stack",
    "unfold",
}

_POSITION_WISE_TORCH = (
    nn.Linear, nn.Bilinear, nn.Identity, nn.Embedding, nn.LayerNorm, nn.RMSNorm,
    nn.modules.dropout._DropoutNd, nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Mish,
    nn.Softplus, nn.ELU, nn.SELU, nn.CELU, nn.LeakyReLU, nn.PReLU, nn.GLU, nn.Hardswish, nn.Hardtanh,
    nn.Hardsigmoid, nn.LogSigmoid, nn.Softsign, nn.Tanhshrink,
)  # fmt: skip
_CONTAINERS_TORCH = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)
_POSITION_WISE_LIBRARY = ("transformers.activations",)
"""Modules whose every class is an elementwise activation."""


@dataclass(frozen=True)
class Verdict:
    """What ``verdict`` found for one module: the kind and, for ``MIXER``/``UNKNOWN``, why."""

    kind: str
    why: str = ""


def declared(cls: type) -> bool:
    """Whether ``cls`` itself (not a base class) was declared position-wise."""
    return bool(vars(cls).get(DECLARED, False))


def code_names(cls: type, depth: int = 2) -> set[str]:
    """Every global and attribute name the code of ``cls`` references: its methods (up to, not
    including, ``torch.nn.Module``), their nested functions, and the module-level Python functions
    they call, followed ``depth`` calls deep (library code of torch itself is not followed). Read once
    per class (the guard and the handlers ask for every module of every layer: ``plan`` evaluates
    hundreds of candidates)."""
    return set(_code_names(cls, depth))


@functools.lru_cache(maxsize=4096)
def _code_names(cls: type, depth: int) -> frozenset[str]:
    names: set[str] = set()
    seen: set[int] = set()
    todo = [(f, 0) for f in _methods(cls)]
    while todo:
        fn, level = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for code in _code_objects(fn.__code__):
            names.update(code.co_names)
            if level >= depth:
                continue
            for name in code.co_names:
                target = getattr(fn, "__globals__", {}).get(name)
                if isinstance(target, types.FunctionType) and not _is_torch(target.__module__):
                    todo.append((inspect.unwrap(target), level + 1))
                elif _is_function_class(target):  # a custom autograd op (BLOOM's GeLU): its forward and backward
                    todo += [(target.forward, level + 1), (target.backward, level + 1)]
    return frozenset(names)


def code_constants(cls: type) -> set[str]:
    """The string constants of the methods of ``cls`` (keyword-argument names of its calls, literal
    attribute names): ``f(sliding_window=...)`` names ``sliding_window`` only here."""
    found: set[str] = set()
    for fn in _methods(cls):
        for code in _code_objects(fn.__code__):
            for const in code.co_consts:
                items = const if isinstance(const, tuple) else (const,)
                found.update(c for c in items if isinstance(c, str))
    return found


def verdict(module: nn.Module) -> Verdict:
    """Classify ``module`` alone (its children are judged separately; see the module docstring)."""
    cls = type(module)
    if declared(cls):
        return Verdict(POSITION_WISE)
    if _is_torch(cls.__module__):
        return _torch_verdict(module)
    if cls.__module__ in _POSITION_WISE_LIBRARY or _is_linear_like_library(cls):
        return Verdict(POSITION_WISE)
    names = code_names(cls)
    if "ALL_ATTENTION_FUNCTIONS" in names:
        if _own_registry(cls):
            return Verdict(MIXER, "its attention dispatches through a registry of its own, not transformers' "
                           "AttentionInterface where the SP attention is registered")  # fmt: skip
        return Verdict(ATTENTION)
    ops = [op for op in SEQUENCE_OPS if op in names]
    if ops:
        return Verdict(MIXER, f"its code calls {', '.join(ops)}")
    own = code_names(cls, depth=0)
    if own & SCORE_OPS and "softmax" in own and next(module.children(), None) is not None:
        if not has_heads(module):  # products and a softmax, but no attention heads (Doge's MoE router)
            return Verdict(MIXER, "its own code multiplies and takes a softmax (matmul, softmax) outside any "
                           "attention heads, which the guard cannot show to act on each token alone")  # fmt: skip
        return Verdict(MIXER, "it computes token-to-token scores itself (matmul, softmax) instead of calling "
                       "the registered SP attention")  # fmt: skip
    if next(module.children(), None) is not None:
        return Verdict(COMPOSITE)
    return _leaf_verdict(module, names)


def _leaf_verdict(module: nn.Module, names: set[str]) -> Verdict:
    """A custom leaf: position-wise only when it has the shape of a known position-wise module."""
    if isinstance(module, nn.Embedding) and "arange" in code_names(type(module), depth=0):  # TrOCR's learned table
        return Verdict(MIXER, "it numbers the tokens it is given 0..S-1 itself when its caller passes no position ids "
                       "(arange in its forward): on a shard every rank would start at position 0")  # fmt: skip
    dims = [p.dim() for p in module.parameters(recurse=False)]
    if dims and max(dims) >= 3:
        return Verdict(POSITION_WISE)  # MoE experts: stacked per-expert weights [E, ...]
    if dims and max(dims) == 2:
        return Verdict(POSITION_WISE)  # a linear map / MoE router: each token times a matrix
    if dims and names & NORM_OPS or not dims and names & {"layer_norm", "rms_norm", "rsqrt"}:
        return Verdict(POSITION_WISE)  # a norm over each token's features (with or without weights)
    if not dims and not any(True for _ in module.buffers(recurse=False)) and names & ELEMENTWISE_OPS:
        if not names & RESHAPE_OPS:
            return Verdict(POSITION_WISE)  # an elementwise activation
    if dims and max(dims) == 1 and _per_feature_arithmetic(module):
        return Verdict(POSITION_WISE)  # scales and shifts by per-feature vectors (ZAYA's residual scaling)
    if not dims and ("inv_freq" in names or "polar" in names or names >= {"cos", "sin"}):
        if _numbers_tokens_itself(type(module)):  # Musicgen's sinusoidal table: arange(S) of its own input
            return Verdict(MIXER, "it numbers the tokens it is given 0..S-1 itself (arange in its forward, no "
                           "position ids taken): on a shard every rank would start at position 0")  # fmt: skip
        return Verdict(POSITION_WISE)  # rotary table: cos/sin of each token's own position id
    return Verdict(
        UNKNOWN,
        "a custom module the guard cannot place (not a known linear, norm, activation, rotary, router "
        "or expert shape); if it acts on every token alone, declare it with "
        f"ulysses_sp.declare_position_wise({type(module).__name__})",
    )


ARITHMETIC = {0, 5, 10, 11, 13, 18, 23, 24}
"""``BINARY_OP`` arguments of ``+ * - /`` and their in-place forms."""
PLAIN_OPS = {"RESUME", "NOP", "CACHE", "LOAD_FAST", "STORE_FAST", "RETURN_VALUE", "UNARY_NEGATIVE"}


HEAD_COUNTS = ("num_heads", "n_heads", "n_head", "num_attention_heads")


def has_heads(module: nn.Module) -> bool:
    """Whether ``module`` has an attention head count (its own attribute or its config's)."""
    config = getattr(module, "config", None)
    return any(isinstance(getattr(module, a, None), int) for a in HEAD_COUNTS) or isinstance(
        getattr(config, "num_attention_heads", None), int)  # fmt: skip


def _per_feature_arithmetic(module: nn.Module) -> bool:
    """Whether ``forward`` is nothing but ``+ * - /`` of its inputs, numbers and the module's own 1-D
    parameters or buffers (read by name): no call, no index, no other attribute. A 1-D vector broadcasts
    over the last (feature) dimension, so every token's output is made from that token's inputs alone."""
    own = {n for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
           if t.dim() <= 1}  # fmt: skip
    for ins in dis.get_instructions(inspect.unwrap(type(module).forward)):
        if ins.opname in PLAIN_OPS:
            continue
        if ins.opname == "BINARY_OP" and ins.arg in ARITHMETIC or ins.opname == "LOAD_ATTR" and ins.argval in own:
            continue
        if ins.opname == "LOAD_CONST" and (ins.argval is None or isinstance(ins.argval, (int, float))):
            continue
        return False
    return True


def _numbers_tokens_itself(cls: type) -> bool:
    """Whether ``cls.forward`` builds positions with ``arange`` and takes none (no parameter naming positions)."""
    forward = inspect.unwrap(cls.forward)
    names = {n for code in _code_objects(forward.__code__) for n in code.co_names}
    return "arange" in names and not any("position" in p for p in inspect.signature(forward).parameters)


def _torch_verdict(module: nn.Module) -> Verdict:
    if isinstance(module, nn.modules.conv._ConvNd):
        kernel = list(module.kernel_size)
        if all(k == 1 for k in kernel):
            return Verdict(POSITION_WISE)
        size = kernel[0] if len(kernel) == 1 else "x".join(map(str, kernel))
        return Verdict(MIXER, f"{type(module).__name__}, kernel {size}")
    if isinstance(module, nn.RNNBase):
        return Verdict(MIXER, f"{type(module).__name__}, a recurrence over the sequence")
    if isinstance(
        module,
        (nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer),
    ):
        return Verdict(MIXER, f"{type(module).__name__}: attention that does not go through transformers' "
                       "AttentionInterface")  # fmt: skip
    if isinstance(module, _POSITION_WISE_TORCH):
        return Verdict(POSITION_WISE)
    if isinstance(module, _CONTAINERS_TORCH):
        return Verdict(COMPOSITE)
    return Verdict(UNKNOWN, f"torch.nn.{type(module).__name__} is not a module the guard knows to act on every "
                   "token alone")  # fmt: skip


def _own_registry(cls: type) -> bool:
    """Whether the code of ``cls`` reads an ``ALL_ATTENTION_FUNCTIONS`` that is not transformers' own
    (a model file may keep a separate ``AttentionInterface`` instance, which never sees ours)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for fn in _methods(cls):
        registry = fn.__globals__.get("ALL_ATTENTION_FUNCTIONS")
        if registry is not None and registry is not ALL_ATTENTION_FUNCTIONS:
            return True
    return False


def _is_linear_like_library(cls: type) -> bool:
    """transformers' ``pytorch_utils.Conv1D`` is a linear layer (GPT-2's naming), not a convolution."""
    return cls.__module__ == "transformers.pytorch_utils" and cls.__name__ == "Conv1D"


def _is_function_class(target: Any) -> bool:
    import torch

    return isinstance(target, type) and issubclass(target, torch.autograd.Function) and not _is_torch(target.__module__)


def _is_torch(module_name: str) -> bool:
    return module_name == "torch" or module_name.startswith("torch.")


def _methods(cls: type) -> Iterator[Any]:
    for klass in cls.__mro__:
        if klass is nn.Module or _is_torch(klass.__module__) or klass is object:
            continue
        for value in vars(klass).values():
            fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if isinstance(fn, property):
                fn = fn.fget
            if isinstance(fn, types.FunctionType):
                yield inspect.unwrap(fn)


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)

"""Check a local HF model directory before any worker starts, naming the file that is wrong.

``check_model_dir(path)`` runs in the launching process (the run-level check calls it) and reads
only headers: ``config.json`` (parses; head, layer and size counts positive), the safetensors index
``model.safetensors.index.json`` (parses; every shard it names exists), each weight file's
safetensors header (a truncated or corrupt file is caught here, not as a traceback per rank), and
every parameter's shape in the files against the model the config builds (on the meta device: no
memory). Each failure is one ``ValueError`` naming the file and saying what to do; the shape
wording is the one the loader uses at ZeRO 2/3 (``loading.load_pretrained_weights``).

``weight_files(path)`` is the ``tensor name -> file`` map the loader reads through; ``file_keys(model,
names)`` maps the model's parameter names to the files' tensor names through transformers' own
conversion mapping (renamed prefixes such as Nemotron-H's ``backbone.``; per-expert MoE tensors that
transformers merges into one fused parameter at load).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim")  # fmt: skip
"""Config fields that must be positive integers where present (a 0 divides by zero in the model)."""


def _read_json(file: str, what: str) -> Any:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: the {what} is not valid JSON ({e}); fix or re-download the file") from None


def load_config(path: str) -> Any:
    """The transformers config of the directory ``path``; ``ValueError`` naming ``config.json`` when it
    does not parse, misses ``model_type``, or has a non-positive count (``num_attention_heads: 0``)."""
    from transformers import AutoConfig

    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        raise ValueError(f"{path!r}: directory has no {CONFIG} (not a HF model directory)")
    raw = _read_json(file, "model config")
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: the model config must be a JSON object, got {type(raw).__name__}")
    bad = {k: raw[k] for k in _POSITIVE if raw.get(k) is not None and not (isinstance(raw[k], int) and raw[k] > 0)}
    if bad:
        raise ValueError(
            f"{file}: {', '.join(f'{k} = {v!r}' for k, v in bad.items())}: must be positive integers"
        )
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file}: transformers cannot read this model config: {e}") from None


def weight_files(path: str) -> dict[str, str]:
    """``tensor name -> safetensors file`` of an HF directory: the index's ``weight_map``, or the
    single ``model.safetensors``. ``ValueError`` naming the file: neither exists, the index does not
    parse or lacks ``weight_map``, or a file it names is missing."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        raw = _read_json(index, "safetensors index")
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no 'weight_map' (tensor name -> file) in the safetensors index")
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise ValueError(
                    f"{index} names {os.path.basename(file)}, which is not in {path!r}: the download is "
                    "incomplete; fetch the missing shard"
                )
        return files
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return dict.fromkeys(read_header(single), single)
    raise ValueError(f"{path!r} has neither {SINGLE} nor {INDEX}: not a safetensors HF model directory")


def read_header(file: str) -> dict[str, tuple[int, ...]]:
    """``tensor name -> shape`` from a safetensors file's header; ``ValueError`` naming the file when
    the header does not parse or the data is shorter than the header says (a truncated file)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); the file is truncated or corrupt, "
                         "re-download it") from None  # fmt: skip


def shape_mismatch(path: str, name: str, in_files: tuple[int, ...], in_model: tuple[int, ...]) -> str:
    """The one wording of a tensor whose shape in the files differs from the model's."""
    return (f"{path!r}: {name} has shape {in_files} in the files but {in_model} in the model built from "
            f"its {CONFIG}; the weights belong to another config")  # fmt: skip


def file_keys(model: Any, names: Any) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Where each of ``model``'s tensors is in files whose tensor names are ``names``.

    Returns ``(direct, merged)``: ``direct`` maps a model name to the one file tensor holding it
    (the same name, or renamed by transformers' conversion mapping); ``merged`` maps a model name to
    the file tensors transformers combines into it while loading (e.g. per-expert MoE weights into
    one fused ``experts.gate_up_proj``). transformers' own ``rename_source_key`` decides both, so the
    mapping is the one ``from_pretrained`` applies; transformers without it (4.x): names as stored.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # transformers 4.x: no conversion at load
        return {n: n for n in names}, {}
    with _own_classes(model):  # transformers finds a model's mapping by its class
        transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    meta = model.state_dict()
    direct: dict[str, str] = {}
    merged: dict[str, list[str]] = {}
    for name in names:
        target, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, meta)
        if pattern is None:
            direct[target] = name
        else:
            merged.setdefault(target, []).append(name)
    return direct, merged


@contextlib.contextmanager
def _own_classes(model: Any) -> Iterator[None]:
    """Modules FSDP2's ``fully_shard`` gave a generated class (``FSDPQwen2_5_VL...``, defined outside
    transformers, so transformers skips it as custom code) carry their own class meanwhile."""
    from torch.distributed.fsdp import FSDPModule

    swapped = []
    for module in model.modules():
        cls = type(module)
        if len(cls.__bases__) == 2 and cls.__bases__[0] is FSDPModule:  # FSDP<X>(FSDPModule, X)
            swapped.append((module, cls))
            module.__class__ = cls.__bases__[1]
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def merged_message(path: str, merged: dict[str, list[str]]) -> str:
    """Why ZeRO 2/3's sharded load refuses a checkpoint that transformers converts while loading."""
    name, sources = next(iter(sorted(merged.items())))
    return (f"{path!r}: transformers builds {len(merged)} parameter(s) of this model by combining stored tensors "
            f"while loading (e.g. {name} from {len(sources)} tensors such as {sources[0]}); the sharded load "
            "of --zero-stage 2/3 reads each stored tensor into its shard as it is: use --zero-stage 0 or 1, "
            "where from_pretrained converts them")  # fmt: skip


def auto_model_class(config: Any) -> Any:
    """The transformers auto class that builds ``config``: ``AutoModelForImageTextToText`` for a
    vision-language model (a ``vision_config``), else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def check_model_dir(path: str, *, require_weights: bool = False, sharded_load: bool = False) -> Any:
    """Check the local HF model directory ``path`` (module docstring) and return its config.

    A directory with a config and no weight files passes unless ``require_weights`` (the planner
    needs only the config; loading then says the weights are missing). ``sharded_load``: the run
    loads at ZeRO 2/3 (``loading.load_pretrained_weights``), which refuses tensors that
    transformers must combine while loading (``merged_message``).

    Raises:
        ValueError: naming the file: config, index, a missing or truncated shard, a parameter the
            files lack, or a shape that differs from the config's model.
    """
    import torch

    if not os.path.isdir(path):
        raise ValueError(f"{path!r}: no such model directory")
    config = load_config(path)
    if not require_weights and not any(os.path.isfile(os.path.join(path, f)) for f in (INDEX, SINGLE)):
        return config
    files = weight_files(path)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        shapes.update(read_header(file))
    try:
        with torch.device("meta"):  # shapes only: no memory
            model = auto_model_class(config).from_config(config)
    except (ValueError, ZeroDivisionError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{os.path.join(path, CONFIG)}: transformers cannot build this model: {e}") from None
    direct, merged = file_keys(model, shapes)
    names: dict[int, list[str]] = {}  # a tied parameter under each of its names: the files keep one
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    missing = []
    for p in model.parameters():
        name = next((n for n in names[id(p)] if n in direct or n in merged), None)
        if name is None:
            missing.append(names[id(p)][0])
        elif name in direct and shapes[direct[name]] != tuple(p.shape):
            raise ValueError(shape_mismatch(path, direct[name], shapes[direct[name]], tuple(p.shape)))
    if missing:
        raise ValueError(f"{path!r} lacks weights for {len(missing)} parameter(s): {sorted(missing)[:8]}")
    if sharded_load and merged:
        raise ValueError(merged_message(path, merged))
    return config

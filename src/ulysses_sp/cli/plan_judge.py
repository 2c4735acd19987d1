"""``plan`` and ``train``, one judge: a setting ``ulysses-sp plan`` offers is one ``train`` accepts.

``PlanJudge(model)`` reads the model's config once (a preset, a model directory, a ``config.json``;
a named shape such as ``llama-8b`` has none, and nothing to judge) and builds the model on the meta
device once. ``refusal(flags)`` runs a candidate's ``train`` flags (``cli.plan.train_args``) through
the checks ``train`` runs before launch — ``run.checks`` (options, the model's heads over sp and
ring, positions, what a ZeRO 2/3 load of the directory's weights can read), ``run.vlm`` (options a
VLM run refuses) and ``run.model_checks`` (the guard, the mixers, the techniques' targets, the SP
attention) — and returns train's message, or ``None``. ``admitted(techniques, base)`` keeps the
memory techniques train accepts for this model, so the planner neither offers nor credits the
others. Verdicts are cached by the fields the checks read: a plan asks each question once.

The model builds with train's default ``--attn sdpa``, or else with ``eager`` (``attn``), which the
planner then writes into the command it recommends (gpt-oss: transformers has no sdpa path for it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ulysses_sp.run.config import RunConfig
from ulysses_sp.run.model_checks import JUDGED, build_meta_model, check_model_run, one_line
from ulysses_sp.vlm import SUPPORTED_VLMS


def read_config(model: str) -> Any:
    """The transformers config of a preset, model directory or ``config.json`` file (``ValueError``);
    ``None`` for a named shape (``plan.inputs.SHAPES``)."""
    from ulysses_sp.plan.inputs import SHAPES

    if model in SHAPES:
        return None
    if model.endswith(".json") and os.path.isfile(model):
        from transformers import AutoConfig

        try:
            with open(model, encoding="utf-8") as f:
                values = json.load(f)
            return AutoConfig.for_model(values.pop("model_type"), **values)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"--model {model!r}: not a transformers config.json ({e})") from e
    from ulysses_sp.run.checks import model_config
    from ulysses_sp.tasks import load_tokenizer

    return model_config(model, len(load_tokenizer(None, model)))


class PlanJudge:
    """``train``'s pre-launch verdict on the settings ``plan`` considers (module docstring)."""

    def __init__(self, model: str, config: Any = None) -> None:
        self.model = model
        self.config = read_config(model) if config is None else config
        """The model's config; ``None``: a named shape, whose settings are not judged."""
        self.attn = "sdpa"
        """The ``--attn`` the recommended command carries (train's default unless the model lacks it)."""
        self.notes: list[str] = []
        """What the judge changed or withheld, for the plan's notes (each once)."""
        self._tokenizer: Any = ()  # a config.json: no tokenizer to check against the vocabulary
        self._configs: dict[bool, Any] = {}
        self._verdicts: dict[tuple[Any, ...], str | None] = {}
        self._withheld: dict[str, list[str]] = {}
        self._meta = None
        if self.config is None:
            return
        from ulysses_sp import tasks

        # a directory without tokenizer files: train needs --tokenizer, whose vocabulary the plan cannot know
        if not model.endswith(".json") and (tasks.is_preset(model) or tasks.has_tokenizer(model)):
            self._tokenizer = tasks.load_tokenizer(None, model)
        try:
            self._meta = build_meta_model(self.config, "sdpa", name=repr(model))
        except ValueError as sdpa:
            self._meta = build_meta_model(self.config, "eager", name=repr(model))
            self.attn = "eager"
            self.note(f"--attn eager: train's default sdpa is refused for this model ({sdpa})")

    def note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)

    def withhold(self, label: str, why: str) -> None:
        """Record a candidate (``label``) left out because train refuses it (``why``)."""
        self._withheld.setdefault(why, []).append(label)

    def summary(self) -> list[str]:
        """The notes: what the judge changed, the techniques withheld, the settings left out by reason."""
        return self.notes + [
            f"{len(labels)} setting(s) not offered (e.g. {labels[0]}): train refuses them before launch: {why}"
            for why, labels in self._withheld.items()
        ]

    def run_config(self, flags: dict[str, Any]) -> RunConfig:
        """The ``RunConfig`` ``train`` would run with these flags (the others at train's defaults)."""
        fields = {f.name for f in dataclasses.fields(RunConfig)}
        values = {k: v for k, v in flags.items() if k in fields}
        if self.attn != "sdpa":
            values.setdefault("attn", self.attn)
        if "data" not in values and getattr(self.config, "model_type", None) in SUPPORTED_VLMS:
            values["data"] = "chat.jsonl"  # the data is the user's, not the plan's: not read
            self.note("a vision-language model trains on chat JSONL with images: add --data to the command")
        return RunConfig(**values)

    def refusal(self, flags: dict[str, Any]) -> str | None:
        """``train``'s message refusing these flags before launch (one line), or ``None``."""
        if self.config is None:
            return None
        from ulysses_sp.run.checks import check_model_fits, check_train_options
        from ulysses_sp.run.vlm import check_vlm_options, is_vlm_config

        cfg = self.run_config(flags)
        try:
            check_train_options(cfg)
            mcfg = self._model_config(sharded_load=cfg.zero_stage >= 2)
            ring = check_model_fits(mcfg, cfg.model, self._tokenizer, sp=cfg.sp, seq_len=cfg.seq_len,
                                    ring_size=cfg.ring_size)  # fmt: skip
            if is_vlm_config(mcfg):
                check_vlm_options(cfg)
            key = (*(getattr(cfg, f) for f in JUDGED), ring)
            if key not in self._verdicts:
                try:
                    check_model_run(cfg, mcfg, ring_size=ring, model=self._meta)
                    self._verdicts[key] = None
                except ValueError as e:
                    self._verdicts[key] = str(e)
            if self._verdicts[key] is not None:
                raise ValueError(self._verdicts[key])
        except ValueError as e:
            return one_line(str(e))
        return None

    def admitted(self, techniques: list[str], base: dict[str, Any]) -> list[str]:
        """The techniques of ``techniques`` (``RunConfig`` flag names) train accepts for this model:
        each added alone to ``base`` (offload with the checkpointing it needs) is refused for no
        other reason than ``base`` itself is; a note names each one withheld and why."""
        plain = self.refusal(base)
        out = []
        for name in techniques:
            extra = {name: True, **({"activation_checkpointing": True} if name == "offload_activations" else {})}
            why = self.refusal({**base, **extra})
            if why is None or why == plain:
                out.append(name)
            else:
                self.note(f"--{name.replace('_', '-')} not offered: train refuses it for this model ({why})")
        return out

    def _model_config(self, *, sharded_load: bool) -> Any:
        """The config as ``train`` reads it: a directory's weights checked for a ZeRO 2/3 load."""
        from ulysses_sp.run.checks import model_config

        if self.model.endswith(".json") or not sharded_load:
            return self.config
        if sharded_load not in self._configs:
            try:
                self._configs[sharded_load] = model_config(self.model, len(self._tokenizer), sharded_load=True)
            except ValueError as e:
                self._configs[sharded_load] = e
        found = self._configs[sharded_load]
        if isinstance(found, ValueError):
            raise found
        return found

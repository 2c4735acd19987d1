"""Chat fixtures for the fine-tuning data tests: the byte tokenizer with two different chat
templates (a ChatML-like one and a Llama-2-like one), and conversations to render."""

from __future__ import annotations

import json
import random

from ulysses_sp.tasks import byte_tokenizer

CHATML = (
    "{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)
"""ChatML-like: every turn ``<bos>role\\ncontent<eos>\\n``; the generation prompt opens an assistant turn."""

INST = (
    "<bos>{% if messages[0]['role'] == 'system' %}<<SYS>>{{ messages[0]['content'] }}<</SYS>>"
    "{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}<eos>{% endif %}{% endfor %}"
)
"""Llama-2-like: a system block, ``[INST] user [/INST]`` then `` answer<eos>``; no generation prompt."""


def chat_tokenizer(template: str | None = CHATML):
    tok = byte_tokenizer()
    tok.chat_template = template
    return tok


def conversation(rng: random.Random, turns: int = 2, system: bool = True) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "be brief"}] if system else []
    for _ in range(turns):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 6)))
        msgs += [{"role": "user", "content": word}, {"role": "assistant", "content": word.upper()}]
    return msgs


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)

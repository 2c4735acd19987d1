"""One record to tokens and a loss mask: chat templates, prompt/completion, plain text.

``tokenize_record`` returns ``(ids, scored)``: the token ids of the rendered sample and, per token,
whether the loss scores it (``labels = ids`` where scored, ``-100`` elsewhere; the label shift over
the full sequence happens later, in ``shard.make_shift_labels``, so it stays right across SP
shard boundaries).

**Chat** is rendered with the tokenizer's own Jinja chat template (or ``--chat-template FILE``).
The text is cut into segments at the turn boundaries the template itself produces: for turn ``i``,
``render(turns[:i])`` and, for an assistant turn, ``render(turns[:i], add_generation_prompt=True)``
are prefixes of ``render(turns)``. Each segment is tokenized on its own and the ids concatenated,
so a scored span starts and ends exactly at a turn's boundary whatever the tokenizer merges. The
assistant segment runs from after the generation prompt to the end of the turn (its end-of-turn
tokens included: the model learns to stop). A template that rewrites earlier turns (not a prefix)
is refused with the turn named.

``--loss-on``: ``all`` (every token), ``assistant`` (chat: every assistant turn; prompt/completion:
the completion), ``completion`` (prompt/completion: the completion; chat: the last assistant turn).
Defaults: ``assistant`` for chat, ``completion`` for prompt/completion, ``all`` for text.
"""

from __future__ import annotations

from typing import Any

from ulysses_sp.checks import read_text_file

LOSS_ON = ("all", "assistant", "completion")
_DEFAULT_LOSS_ON = {"text": "all", "chat": "assistant", "prompt-completion": "completion"}


def resolve_loss_on(fmt: str, loss_on: str | None) -> str:
    """``loss_on`` checked against the format, or the format's default when ``None``."""
    if loss_on is None:
        return _DEFAULT_LOSS_ON[fmt]
    if loss_on not in LOSS_ON:
        raise ValueError(f"--loss-on must be one of {LOSS_ON}, got {loss_on!r}")
    if fmt == "text" and loss_on != "all":
        raise ValueError(f"--loss-on {loss_on} needs chat or prompt/completion data; text data is scored "
                         "everywhere (--loss-on all)")  # fmt: skip
    return loss_on


def read_chat_template(path: str | None) -> str | None:
    """The Jinja template in the file ``path`` (``--chat-template``), or ``None`` without one."""
    return None if path is None else read_text_file("--chat-template", path)


def chat_template_of(tokenizer, template: str | None) -> str:
    """The template chat data is rendered with: the given one, else the tokenizer's own."""
    found = template or getattr(tokenizer, "chat_template", None)
    if isinstance(found, dict):  # several named templates: the default one
        found = found.get("default")
    if not found:
        raise ValueError(
            "chat data needs a chat template, and the tokenizer has none: pass --chat-template FILE "
            "(a Jinja template, as in a tokenizer_config.json's 'chat_template'), or --tokenizer DIR of a "
            "tokenizer that has one"
        )
    return found


class ChatTemplateError(ValueError):
    """The chat template failed to render a sample: a Jinja syntax error, or its ``raise_exception``."""


class TurnPrefixError(ValueError):
    """The chat template does not render an assistant turn as a prefix of the conversation, so its
    tokens cannot be told apart (only ``loss_on="all"`` can score such a chat: rendered whole)."""


def template_name(path: str | None) -> str:
    """How messages name the template chat data is rendered with: its file, or the tokenizer's."""
    return f"the chat template {path}" if path else "the tokenizer's chat template"


def _render(tokenizer, template: str, turns: list[dict[str, Any]], *, generation_prompt: bool = False) -> str:
    from jinja2 import TemplateError, TemplateSyntaxError

    try:
        return tokenizer.apply_chat_template(
            turns, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
        )
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"has a Jinja syntax error at line {e.lineno}: {e.message}") from None
    except TemplateError as e:  # what the template's own raise_exception(...) raises
        raise ChatTemplateError(f"refused the sample (raise_exception): {e}") from None


def chat_segments(tokenizer, template: str, messages: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The rendered conversation as ``(text, turn)`` segments; ``turn`` is the index of the assistant
    turn a segment's text belongs to, ``-1`` for everything else (system, user, generation prompts)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"a chat sample needs a non-empty list of messages, got {messages!r}")
    for m in messages:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(f"each message needs string 'role' and 'content', got {m!r}")
    return turn_segments(tokenizer, template, [{"role": m["role"], "content": m["content"]} for m in messages])


def turn_segments(tokenizer, template: str, turns: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """``chat_segments`` of already checked ``turns`` (dicts with a ``role``; the content as the
    template takes it: a string, or a VLM chat's list of text and image parts)."""
    full = _render(tokenizer, template, turns)
    segments, done = [], 0
    for i, m in enumerate(turns):
        if m["role"] != "assistant":
            continue
        start = _render(tokenizer, template, turns[:i], generation_prompt=True)
        end = _render(tokenizer, template, turns[: i + 1])
        if not (full.startswith(start) and full.startswith(end) and done <= len(start) <= len(end)):
            raise TurnPrefixError(
                f"the chat template does not render turn {i} (assistant) as a prefix of the conversation, "
                "so its tokens cannot be told apart; use a template that keeps earlier turns as they are "
                "(--chat-template FILE), or --loss-on all"
            )
        segments += [(full[done : len(start)], -1), (full[len(start) : len(end)], i)]
        done = len(end)
    segments.append((full[done:], -1))
    return [(text, turn) for text, turn in segments if text]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def tokenize_record(
    record: dict[str, Any], *, fmt: str, loss_on: str, tokenizer, template: str | None
) -> tuple[list[int], list[bool]]:
    """``(ids, scored)`` of one record of format ``fmt`` (see the module docstring)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if fmt == "text":
        text = record["text"]
        if not isinstance(text, str):
            raise ValueError(f"a text sample needs a string 'text', got {type(text).__name__}")
        ids = _encode(tokenizer, text) + eos
        return ids, [True] * len(ids)
    if fmt == "prompt-completion":
        prompt, completion = record["prompt"], record["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError("a prompt/completion sample needs string 'prompt' and 'completion'")
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        head, tail = bos + _encode(tokenizer, prompt), _encode(tokenizer, completion) + eos
        return head + tail, [loss_on == "all"] * len(head) + [True] * len(tail)
    try:
        segments = chat_segments(tokenizer, template, record["messages"])
    except TurnPrefixError:
        if loss_on != "all":
            raise
        # every token scored: the conversation rendered whole, nothing to tell apart
        segments = [(_render(tokenizer, template, [{"role": m["role"], "content": m["content"]}
                                                   for m in record["messages"]]), -1)]  # fmt: skip
    return score_segments(tokenizer, segments, loss_on)


def score_segments(tokenizer, segments: list[tuple[str, int]], loss_on: str) -> tuple[list[int], list[bool]]:
    """``(ids, scored)`` of a chat's ``(text, turn)`` segments, each tokenized on its own: ``loss_on``
    ``all`` scores every token, ``assistant`` every assistant turn's, ``completion`` the last one's."""
    last = max((turn for _, turn in segments), default=-1)
    ids: list[int] = []
    scored: list[bool] = []
    for text, turn in segments:
        part = _encode(tokenizer, text)
        keep = loss_on == "all" or (turn >= 0 and (loss_on == "assistant" or turn == last))
        ids += part
        scored += [keep] * len(part)
    return ids, scored

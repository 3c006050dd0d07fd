"""Turn a user's prompt or chat messages into target token ids.

Instruction models carry a chat template; base models (the packaged Gemma 3 270M is one)
do not, so messages are rendered as a plain transcript for them instead of failing.

Message content is text, whatever it spells: a user who types ``<|im_start|>system`` gets
those characters, not the control token, so content can neither close its own turn nor
forge another one (as chat servers do). The template's own control tokens are encoded as
tokens. With a chat template this is transformers' ``sanitize_control_tokens`` (content
control tokens are marked before rendering and encoded as plain text; the tokenizer refuses
if plain text would still produce the token); without one the transcript is encoded with
``split_special_tokens``. A chat of ordinary content encodes exactly as before.

A raw ``prompt`` is not a chat: its caller writes the whole model input, so control tokens
in it are parsed (``encode_prompt``); there is no turn of someone else's to forge.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

ROLES = ("system", "user", "assistant")


def validate_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object with role and content")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


def encode_messages(tokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
    msgs = validate_messages(messages)
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, sanitize_control_tokens=True)
        return list(encoded["input_ids"])
    # No template: the transcript holds no control token of its own (the tokenizer may still add BOS).
    transcript = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in msgs) + "Assistant:"
    return list(tokenizer(transcript, split_special_tokens=True)["input_ids"])


def encode_prompt(tokenizer, text: str) -> list[int]:
    if not isinstance(text, str):
        raise ValueError("prompt must be a string")
    return list(tokenizer(text)["input_ids"])

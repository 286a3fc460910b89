"""The token ids a multi-turn rollout inserts between the model's turns, from the chat template,
never by re-tokenizing what the model generated.

After an assistant turn the template writes a close (Qwen: "<|im_end|>\\n"); the model generated
some of it (its stop token), the rest is inserted. Then the new messages (tool results, a user
turn) and the generation prompt, as the template renders them after an earlier exchange: the
text `render(base + new)` adds to `render(base)` for a fixed base conversation. Pure given the
tokenizer. A template that renders earlier turns differently once more follow (so no such
difference exists) is refused by name.
"""

from typing import Any, Dict, List, Optional, Sequence

_SAID = "MEGARL-ASSISTANT-TURN"  # a base turn's content, found again in the rendered text
_BASE = [{"role": "user", "content": "MEGARL-USER-TURN"}, {"role": "assistant", "content": _SAID}]


def _render(tokenizer, messages, tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _close(base_text: str) -> str:
    return base_text[base_text.rindex(_SAID) + len(_SAID):]


def assistant_close(tokenizer, tools: Optional[Sequence[Dict[str, Any]]] = None) -> str:
    """What the template writes after an assistant turn's content."""
    return _close(_render(tokenizer, _BASE, tools, False))


def inserted_text(tokenizer, generated_ids: List[int], new_messages: Sequence[Dict[str, Any]],
                  tools: Optional[Sequence[Dict[str, Any]]] = None) -> str:
    """The text that follows a turn of `generated_ids` when `new_messages` come next: the rest of
    the assistant turn's close, the new messages, the generation prompt."""
    before = _render(tokenizer, _BASE, tools, False)
    after = _render(tokenizer, [*_BASE, *new_messages], tools, True)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier turns differently once more messages "
                         f"follow ({before[-80:]!r} vs {after[:len(before)][-80:]!r}), so the tokens "
                         "between turns cannot be inserted exactly; use a template that appends turns")
    close = _close(before)
    ended = tokenizer.decode(generated_ids[-1:], skip_special_tokens=False) if generated_ids else ""
    rest = close[len(ended):] if ended and close.startswith(ended) else close
    return rest + after[len(before):]


def inserted_ids(tokenizer, generated_ids: List[int], new_messages: Sequence[Dict[str, Any]],
                 tools: Optional[Sequence[Dict[str, Any]]] = None) -> List[int]:
    return tokenizer.encode(inserted_text(tokenizer, generated_ids, new_messages, tools),
                            add_special_tokens=False)


def first_prompt_ids(tokenizer, messages: Sequence[Dict[str, Any]],
                     tools: Optional[Sequence[Dict[str, Any]]] = None) -> List[int]:
    """The conversation's opening: its messages with the tools' schemas, and the generation prompt."""
    return tokenizer.encode(_render(tokenizer, messages, tools, True), add_special_tokens=False)

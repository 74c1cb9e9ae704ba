"""
Prompts: what a caller may send as a prompt, and its token ids.

Read allocator/prefix_caching.py first: a prompt's token ids are what it hashes into blocks. Pure Python,
like the allocator: no torch, so the workload analyzer (analyzer/) tokenizes a log without
loading a model's framework.

    check_prompt        a prompt refused (ValueError) or its kind: a text, chat messages or
                        token ids
    tokenize_prompts    the token ids of many prompts, every one checked first, in one batch
                        call each for texts and for chats
    tokenize_chats      the token ids of chats already checked (the analyzer's rewritten
                        ones), one batch call for each set of tools they send
    refused_by_template why the model's chat template refused a batch of chats

The Engine (engine/llm_engine.py) tokenizes every request here, at its front; the analyzer tokenizes a
whole log here, so both count the same tokens.
"""

from __future__ import annotations

import json
from typing import Sequence

from jinja2 import TemplateError

from allocator import check_text

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's chat API's roles


def check_prompt(prompt, vocab_size: int | None = None) -> str:
    """Refuse a prompt no tokenizer should see (ValueError); its kind: "text", "messages" or "ids".

    >>> check_prompt("Hi"), check_prompt([{"role": "user", "content": "Hi"}]), check_prompt([1, 2])
    ('text', 'messages', 'ids')
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty: give some text, messages or token ids")
        check_text(prompt, "the prompt")
        return "text"
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(f"prompt must be a non-empty str, list of messages or list of token ids, got {prompt!r:.80}")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            bound = "be >= 0" if vocab_size is None else f"be in [0, {vocab_size}) for this model"
            raise ValueError(f"token ids must {bound}; got {bad[:5]}")
        return "ids"
    for message in prompt:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f'each chat message must be a dict {{"role": str, "content": str}}, got {message!r:.80}')
        if message["role"] not in CHAT_ROLES:
            raise ValueError(f"unknown chat role {message['role']!r:.40}; "
                             f"a message's role is one of {', '.join(CHAT_ROLES)}")
        check_text(message["content"], "a message's content")
    return "messages"


def tokenize_prompts(tokenizer, prompts: Sequence, vocab_size: int | None = None,
                     tools: Sequence[list | None] | None = None) -> list[list[int]]:
    """Token ids of each prompt (see check_prompt for the kinds), every one checked first.

    Texts are encoded as they are; messages go through the chat template with the
    assistant's turn opened, and with their request's `tools` (one list or None a prompt)
    where given, as vLLM's server passes them (apply_chat_template(..., tools=...)). One
    batch call for the texts and one for each set of tools the chats send: the tokenizer's
    Rust code then works through thousands of prompts at a time (a workload log) instead of
    one by one.
    """
    kinds = [check_prompt(prompt, vocab_size) for prompt in prompts]
    if "messages" in kinds and not tokenizer.chat_template:
        raise ValueError("this tokenizer has no chat template: pass the prompt as a str instead of messages")
    ids: list[list[int] | None] = [list(p) if kind == "ids" else None for p, kind in zip(prompts, kinds)]
    texts = [i for i, kind in enumerate(kinds) if kind == "text"]
    if texts:
        for i, encoded in zip(texts, tokenizer([prompts[i] for i in texts])["input_ids"]):
            ids[i] = encoded
    chats = [i for i, kind in enumerate(kinds) if kind == "messages"]
    for i, encoded in zip(chats, tokenize_chats(tokenizer, prompts, tools, chats)):
        ids[i] = encoded
    return ids


def tokenize_chats(tokenizer, prompts: Sequence, tools: Sequence[list | None] | None = None,
                   chats: Sequence[int] | None = None) -> list[list[int]]:
    """Token ids of the chats among `prompts` (those at `chats`, all by default), already
    checked, each with its tools (one list or None a prompt): the chat template with the
    assistant's turn opened, one batch call for each set of tools the chats send."""
    chats = range(len(prompts)) if chats is None else chats
    by_tools: dict[str, list[int]] = {}  # the chats that send the same tools (most send none) share a call
    for i in chats:
        by_tools.setdefault(json.dumps(tools[i] if tools else None, sort_keys=True), []).append(i)
    ids: dict[int, list[int]] = {}
    for group in by_tools.values():
        these_tools = tools[group[0]] if tools else None
        try:
            rendered = tokenizer.apply_chat_template([list(prompts[i]) for i in group], tools=these_tools,
                                                     add_generation_prompt=True, return_dict=False)
        except TemplateError:
            raise ValueError(refused_by_template(tokenizer, prompts, group, these_tools)) from None
        for i, encoded in zip(group, rendered):
            ids[i] = list(encoded)
    return [ids[i] for i in chats]


def refused_by_template(tokenizer, prompts: Sequence, chats: list[int], tools: list | None = None) -> str:
    """Why the model's chat template refused a batch: the first prompt it refuses alone, and
    the template's own words (a template may demand alternating roles, or no system turn)."""
    for i in chats:
        try:
            tokenizer.apply_chat_template(list(prompts[i]), tools=tools, add_generation_prompt=True)
        except TemplateError as err:
            where = f"prompt {i}" if len(prompts) > 1 else "the messages"
            return f"the model's chat template refused {where}: {err}; change the roles or their order"
    return "the model's chat template refused the messages"

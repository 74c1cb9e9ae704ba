"""
vLLM's rewrites of a chat request: what its OpenAI server changes in the messages and tools
before the chat template renders them, so that `--like vllm` counts the tokens vLLM computes.

Read request_logs.py first (how a log's chat bodies are read and checked) and log_replay.py
(where they are tokenized). The reading there renders every server's chats alike; these
rewrites are vLLM's own (release 0.33.0, checked against its code), and only `--like vllm`
applies them. vLLM's files are named as on its main branch (0.33.0 held the message parsing of
both parse_chat_message files in one, vllm/renderers/chat_utils/chat_message.py). In this file:

    1. the template    what vLLM reads from the chat template: does it loop over a message's
                       content parts ("openai" content format) or print it whole ("string"),
                       does it name the developer role
    2. the messages    each rewrite, beside the vLLM function that makes it
    3. the tools       each tool as vLLM's request model dumps it
    4. tokenizing      a batch of logged requests, the chats rewritten

    >>> chats = VllmChats.of("{% for m in messages %}{{ m.content }}{% endfor %}")
    >>> chats.content_format, chats.developer_role
    ('string', False)
    >>> chats.messages([{"role": "system", "content": "x-anthropic-billing-header: cch=1\\nBe brief."},
    ...                 {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": ""},
    ...                                              {"type": "text", "text": "there"}]}])
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi\\nthere'}]
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import jinja2
import jinja2.nodes
from transformers.utils.chat_template_utils import _compile_jinja_template

from analyzer.caching_models import VLLM
from analyzer.request_logs import LoggedRequest
from engine.prompts import tokenize_chats, tokenize_prompts

# -----------------------------------------------------------------------------
# 1. The template
#
# vLLM hands a template one of two shapes of content. "string": each message's text parts
# joined into one string. "openai": the parts as a list of dicts, for a template that loops
# over them. It tells which from the template's syntax tree: "openai" when a for-loop walks a
# message's content (`_detect_content_format` and `_iter_nodes_assign_content_item` in
# vllm/renderers/hf.py). A template that names the role "developer" (quoted, anywhere in its
# text) is handed developer messages as they are; any other gets them as system messages
# (`_detect_developer_role_support`, same file).


def loops_over_content(chat_template: str) -> bool:
    """Does a for-loop of the template walk a message's content? As vLLM looks: a loop over
    `m.content` or `m['content']` where `m` walks the messages (or a name set from them), over
    a macro's parameter that is handed a message's content, or over a name `content` outside
    a macro; names set from the message list count as it, `namespace(rest=messages)` too.

    >>> loops_over_content("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}")
    True
    >>> loops_over_content("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    False
    """
    try:  # parsed as transformers compiles templates (its {% generation %} tag among them), as vLLM does
        tree = _compile_jinja_template(chat_template).environment.parse(chat_template)
    except jinja2.TemplateError:
        return False  # vLLM reads a template it cannot parse as "string"
    lists, todo = {"messages"}, ["messages"]  # the message list and the names set from it ("ns.rest" too)
    while todo:
        name = todo.pop()
        for node in tree.find_all(jinja2.nodes.Assign):
            target, value = dotted(node.target), node.node
            aliases = [target] if target and reads(value, name) else []
            if isinstance(value, jinja2.nodes.Call) and dotted(value.node) == "namespace":
                aliases += [f"{target}.{k.key}" for k in value.kwargs if reads(k.value, name)]
            for alias in aliases:
                if alias not in lists:
                    lists.add(alias)
                    todo.append(alias)
    loops = list(tree.find_all(jinja2.nodes.For))
    messages = {loop.target.name for loop in loops if isinstance(loop.target, jinja2.nodes.Name)
                and any(reads(loop.iter, name) for name in lists)}
    in_macros, content_params = set(), set()
    for macro in tree.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        for call in tree.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                given = list(zip(params, call.args)) + [(k.key, k.value) for k in call.kwargs if k.key in params]
                for param, value in given:
                    if any(reads(value, m, "content") for m in messages):
                        content_params.update((id(loop), param) for loop in macro.find_all(jinja2.nodes.For))
        in_macros.update(id(loop) for loop in macro.find_all(jinja2.nodes.For))
    for loop in loops:
        if any(reads(loop.iter, m, "content") for m in messages):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name) and ((id(loop), loop.iter.name) in content_params or (
                id(loop) not in in_macros and loop.iter.name == "content")):
            return True
    return False


def reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """Is the node the variable `name`, or with `key` its item (m.content, m['content']),
    through filters, tests and slices?"""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
        node = node.node
    if key is not None:
        item = (isinstance(node, jinja2.nodes.Getattr) and node.attr == key
                or isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == key)
        return item and dotted(node.node) == name
    return dotted(node) == name


def dotted(node: jinja2.nodes.Node) -> str | None:
    """A name or an attribute of one as vLLM spells it ("ns.rest"); None for anything else."""
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    if isinstance(node, jinja2.nodes.Getattr):
        base = dotted(node.node)
        return base and f"{base}.{node.attr}"
    return node.name if isinstance(node, jinja2.nodes.Name) else None


# -----------------------------------------------------------------------------
# 2. The messages
#
# Each rewrite below changes the tokens of some requests. They follow the order vLLM runs
# them in: each message's content parsed (_parse_chat_message_content in
# vllm/renderers/chat_utils/parse_chat_message_content.py), then every assistant's tool calls
# (_postprocess_messages in vllm/renderers/chat_utils/parse_chat_message.py), then the
# developer role (safe_apply_chat_template in
# vllm/renderers/hf.py).

BILLING_HEADER = "x-anthropic-billing-header"  # the first line of Claude Code's system prompt; it changes every request
TEXT_KEYS = {"text": "text", "refusal": "refusal", "thinking": "thinking"}  # content part type -> the key of its text
MEDIA = {"image_url": "image", "input_image": "image", "image_embeds": "image", "image_pil": "image",
         "audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio",
         "video_url": "video", "video_embeds": "video"}  # content part type -> what an "openai" template is handed
# The keys of OpenAI's and vLLM's content part types: an "openai" template is handed any other
# key of a text or media part as it was sent (a gateway's "cache_control", say).
PART_KEYS = {"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
             "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
             "video_embeds", "video_url"}


def without_billing_header(parts: list) -> list:
    """A system message's parts with Claude Code's billing header line dropped from each text
    part that starts with it, and a part that held nothing else dropped whole
    (_strip_claude_code_billing_header in
    vllm/renderers/chat_utils/parse_chat_message_content.py).

    >>> without_billing_header([{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=9f1\\nYou are Claude."}])
    [{'type': 'text', 'text': 'You are Claude.'}]
    >>> without_billing_header([{"type": "text", "text": "x-anthropic-billing-header: cch=9f1"}])
    []
    """
    kept = []
    for part in parts:
        text = part.get("text") if part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            kept.append(part)
        elif rest := text.partition("\n")[2]:
            kept.append({**part, "text": rest})
    return kept


@dataclass(frozen=True)
class VllmChats:
    """How vLLM renders chats with one chat template: its content format and whether it names
    the developer role. `messages` rewrites a chat's messages (vllm_tools, below, its tools)."""

    content_format: str  # "string" or "openai"
    developer_role: bool

    @classmethod
    def of(cls, chat_template: str) -> VllmChats:
        return cls("openai" if loops_over_content(chat_template) else "string",
                   '"developer"' in chat_template or "'developer'" in chat_template)

    def messages(self, sent: list[dict]) -> list[dict]:
        """The messages as vLLM hands them to the template, from the messages as sent."""
        conversation = [self.message(message) for message in sent]
        for message in conversation:
            if message["role"] == "assistant" and isinstance(message.get("tool_calls"), list):
                if message["tool_calls"]:
                    message["tool_calls"] = [parsed_arguments(call) for call in message["tool_calls"]]
                else:  # an empty list would take the template down its tool-call path
                    del message["tool_calls"]
        if not self.developer_role and any(m["role"] == "developer" for m in conversation):
            conversation = one_system_message([{k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
                                               if m["role"] == "developer" else m for m in conversation])
        return conversation

    def message(self, sent: dict) -> dict:
        """One message: its content parts joined or listed, and the keys vLLM keeps
        (_parse_chat_message_content in
        vllm/renderers/chat_utils/parse_chat_message_content.py)."""
        role, content = sent["role"], sent.get("content")
        parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
        if role == "system":
            parts = without_billing_header(parts)
        message = {"role": role, "content": self.content(parts)}
        if role == "assistant":
            if sent.get("tool_calls") is not None:
                message["tool_calls"] = list(sent["tool_calls"])
            if sent.get("reasoning") is not None:  # for templates that show earlier turns' thinking
                message["reasoning"] = message["reasoning_content"] = sent["reasoning"]
        if role == "tool":
            if "tool_call_id" in sent:
                message["tool_call_id"] = sent["tool_call_id"]
            if isinstance(message["content"], list) and all(p.get("type") == "text" for p in message["content"]):
                message["content"] = "\n".join(p.get("text", "") for p in message["content"])
        for key in ("name", "task"):
            if isinstance(sent.get(key), str):
                message[key] = sent[key]
        if role == "developer":
            message["tools"] = sent.get("tools")
        return message

    def content(self, parts: list[dict]) -> str | list[dict]:
        """Content parts as the template takes them: "string", the texts joined by a newline
        (an empty text left out, and a media part: vLLM puts the model's own placeholder
        there, which a log cannot tell, and a text-only model refuses it); "openai", a dict a
        part (_parse_chat_message_content_parts, same file).

        >>> parts = [{"type": "text", "text": "Look"}, {"type": "image_url", "image_url": {"url": "a.png"}}]
        >>> VllmChats("string", False).content(parts), VllmChats("openai", False).content(parts)
        ('Look', [{'type': 'text', 'text': 'Look'}, {'type': 'image'}])
        """
        listed = self.content_format == "openai"
        kept: list = []
        for part in parts:
            kind, extra = part.get("type"), {k: v for k, v in part.items() if k not in PART_KEYS}
            if kind in TEXT_KEYS:
                text = part.get(TEXT_KEYS[kind])
                if text is None and kind in ("text", "refusal"):
                    continue
                kept.append({"type": "text", "text": text, **extra} if listed else text)
            elif kind == "tool_reference":  # a deferred tool, named for the template to expand
                kept.append({"type": "tool_reference", "name": part.get("name")} if listed else part.get("name"))
            elif listed and kind in MEDIA:
                kept.append({"type": MEDIA[kind], **extra})
        return kept if listed else "\n".join(text for text in kept if text)


def parsed_arguments(call: dict) -> dict:
    """A tool call with its arguments as an object: a JSON string parsed, and anything that is
    not an object once parsed (text that is not JSON, "[]", "42", null, "") as {}
    (_postprocess_messages in vllm/renderers/chat_utils/parse_chat_message.py).

    >>> [parsed_arguments({"function": {"name": "f", "arguments": a}})["function"]["arguments"]
    ...  for a in ['{"city": "Oslo"}', "city=Oslo", "[1]", "", {"city": "Oslo"}]]
    [{'city': 'Oslo'}, {}, {}, {}, {'city': 'Oslo'}]
    """
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    return {**call, "function": {**call["function"], "arguments": arguments if isinstance(arguments, dict) else {}}}


def one_system_message(conversation: list[dict]) -> list[dict]:
    """The system messages merged into one at the front, their texts apart by a blank line,
    when there is more than one or one is not first (_consolidate_system_messages in
    vllm/renderers/hf.py, which runs after developer messages became system ones).

    >>> one_system_message([{"role": "system", "content": "A"}, {"role": "user", "content": "Hi"},
    ...                     {"role": "system", "content": "B"}])
    [{'role': 'system', 'content': 'A\\n\\nB'}, {'role': 'user', 'content': 'Hi'}]
    """
    texts, others, merge = [], [], False
    for i, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or i > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or isinstance(p, dict) and "text" in p)
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *others] if merge else conversation


# -----------------------------------------------------------------------------
# 3. The tools
#
# vLLM reads each tool into its request model and hands the template `model_dump()` of it
# (render_chat in vllm/renderers/online_renderer.py): a function's name, description and
# parameters always, `strict` and `defer_loading` only when the request set them, other keys
# dropped (FunctionDefinition in vllm/entrypoints/generate/base/protocol.py,
# ChatCompletionToolsParam in vllm/entrypoints/openai/chat_completion/protocol.py).


def vllm_tools(tools: list[dict] | None) -> list[dict] | None:
    """A request's tools as vLLM's server hands them to the template.

    >>> vllm_tools([{"type": "function", "function": {"name": "now", "strict": True, "x": 1}}])
    [{'type': 'function', 'function': {'name': 'now', 'description': None, 'parameters': None, 'strict': True}}]
    """
    if not tools:  # vLLM refuses an empty list (a 400); the replay renders the request without tools
        return None
    dumped = []
    for tool in tools:
        sent = tool["function"]
        function = {"name": sent["name"], "description": sent.get("description"), "parameters": sent.get("parameters")}
        deferred = sent.get("defer_loading")
        deferred = tool.get("defer_loading") if deferred is None else deferred  # the tool's own goes down to it
        for key, value in (("strict", sent.get("strict")), ("defer_loading", deferred)):
            if value is not None:
                function[key] = value
        one = {"type": tool.get("type", "function"), "function": function}
        if tool.get("defer_loading") is not None:
            one["defer_loading"] = tool["defer_loading"]
        dumped.append(one)
    return dumped


# -----------------------------------------------------------------------------
# 4. Tokenizing


def token_ids(tokenizer, batch: list[LoggedRequest], chats: VllmChats | None = None) -> list[list[int]]:
    """The token ids of a batch of logged requests, in order: chats rewritten as vLLM does
    when `chats` is given, every prompt as the log reader rendered it otherwise."""
    if chats is None:
        return tokenize_prompts(tokenizer, [r.prompt for r in batch], tools=[r.tools for r in batch])
    ids: list[list[int] | None] = [None] * len(batch)
    sent = [i for i, r in enumerate(batch) if r.body is not None]
    if sent:
        rendered = tokenize_chats(tokenizer, [chats.messages(batch[i].body["messages"]) for i in sent],
                                  [vllm_tools(batch[i].body.get("tools")) for i in sent])
        for i, encoded in zip(sent, rendered):
            ids[i] = encoded
    rest = [i for i, r in enumerate(batch) if r.body is None]
    if rest:
        for i, encoded in zip(rest, tokenize_prompts(tokenizer, [batch[i].prompt for i in rest],
                                                     tools=[batch[i].tools for i in rest])):
            ids[i] = encoded
    return ids


def server_chats(model, tokenizer) -> VllmChats | None:
    """The rewrites of the server `model` stands for, with the tokenizer's chat template: vLLM's
    for `--like vllm`; None for the others (this course's Engine makes none; what SGLang's and
    llama.cpp's servers change is not modelled)."""
    if isinstance(model, VLLM) and model.vllm_server and tokenizer.chat_template:
        return VllmChats.of(tokenizer.chat_template)
    return None

"""vLLM's rewrites of a chat request (analyzer/vllm_requests.py): the analyzer's token ids equal
those vLLM 0.33.0's own renderer made of the same bodies, body by body, with each template
(data/vllm_chat_ids.json, written by `python prefix_caching.py --bench caching_models
--vllm-wheel DIR --write-chat-ids`); each rewrite on its own; and the command as typed, on
Claude Code's requests, caching what vLLM caches."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analyzer.log_replay import LIKE, TokenizedLog, replay, tokenize_log
from analyzer.request_logs import Writer, read_log, requests_from_record, template_tools, write_log
from analyzer.vllm_requests import (VllmChats, loops_over_content, one_system_message, parsed_arguments, server_chats,
                                    token_ids, vllm_tools, without_billing_header)

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
SAVED = json.loads((DATA / "vllm_chat_ids.json").read_text())
HEADER = "x-anthropic-billing-header: cc_version=2.1.37.0d4; cc_entrypoint=cli; cch={};"


@pytest.fixture(scope="module")
def templated(tokenizer):
    """A copy of SmolLM2's tokenizer whose chat template a test may change."""
    return copy.deepcopy(tokenizer)


def analyzer_ids(tokenizer, body: dict, template: str, rewrite: bool = True) -> list[int]:
    tokenizer.chat_template = template
    [request] = requests_from_record(body, "body")
    return token_ids(tokenizer, [request], VllmChats.of(template) if rewrite else None)[0]


# --- Against vLLM's own rendering


@pytest.mark.parametrize("name", list(SAVED["ids"]))
def test_the_analyzer_makes_the_token_ids_vllm_made_of_every_body(templated, name):
    template = (DATA / SAVED["templates"][name]).read_text()
    compared = 0
    for i, (body, ids) in enumerate(zip(SAVED["bodies"], SAVED["ids"][name])):
        if ids is None:  # vLLM refused it (a 400): an empty list of tools, arguments that are not a string, ...
            continue
        assert analyzer_ids(templated, body, template) == ids, f"body {i} with {name}: {body}"
        compared += 1
    assert compared >= len(SAVED["bodies"]) - 4


def test_the_saved_ids_are_those_of_the_bench_bodies_and_templates():
    from benchmarks.caching_models import CHAT_BODIES, CHAT_TEMPLATES

    assert SAVED["vllm"] == "0.33.0"
    assert SAVED["bodies"] == json.loads(json.dumps(CHAT_BODIES)) and SAVED["templates"] == CHAT_TEMPLATES


def test_without_the_rewrites_many_bodies_differ_from_vllms(templated):
    """The comparison can fail: the reading every server shares differs on most shapes."""
    template = (DATA / SAVED["templates"]["llama3.1_json"]).read_text()
    differ = [i for i, (body, ids) in enumerate(zip(SAVED["bodies"], SAVED["ids"]["llama3.1_json"]))
              if ids is not None and analyzer_ids(templated, body, template, rewrite=False) != ids]
    assert len(differ) >= 8


# --- Each rewrite


def test_the_billing_header_line_is_dropped_so_claude_code_prompts_share_their_system_prompt(templated):
    system = "You are Claude Code.\nUse the tools."
    bodies = [{"messages": [{"role": "system", "content": HEADER.format(cch) + "\n" + system},
                            {"role": "user", "content": "Fix the test."}]} for cch in ("8d1f3", "a07c2")]
    first, second = (analyzer_ids(templated, body, templated.chat_template) for body in bodies)
    assert first == second
    assert first == analyzer_ids(templated, {"messages": [{"role": "system", "content": system},
                                                          {"role": "user", "content": "Fix the test."}]},
                                 templated.chat_template)
    plain = [analyzer_ids(templated, body, templated.chat_template, rewrite=False) for body in bodies]
    assert plain[0] != plain[1]
    assert without_billing_header([{"type": "text", "text": HEADER.format(1)}, {"type": "text", "text": "Hi"}]) == [
        {"type": "text", "text": "Hi"}]
    assert VllmChats("string", False).messages([{"role": "user", "content": HEADER.format(1) + "\nHi"}])[0][
        "content"].startswith("x-anthropic")  # a system message's only


def test_a_developer_turn_becomes_a_system_turn_where_the_template_has_no_developer_role():
    sent = [{"role": "system", "content": "You are helpful."}, {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": "Hi"}]
    assert VllmChats("string", False).messages(sent) == [{"role": "system", "content": "You are helpful.\n\nBe terse."},
                                                         {"role": "user", "content": "Hi"}]
    assert VllmChats("string", True).messages(sent)[1] == {"role": "developer", "content": "Be terse.", "tools": None}
    assert VllmChats.of((DATA / "chatml_developer.jinja").read_text()).developer_role
    assert not VllmChats.of((DATA / "tool_chat_template_hermes.jinja").read_text()).developer_role
    alone = [{"role": "system", "content": "A"}, {"role": "user", "content": "Hi"}]
    assert one_system_message(alone) is alone  # one system message, first: left as it is


def test_a_tools_strict_reaches_the_template():
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    for strict in (True, False):
        sent = [{**tool, "function": {**tool["function"], "strict": strict}}]
        assert vllm_tools(sent)[0]["function"] == {"name": "now", "description": None,
                                                   "parameters": {"type": "object"}, "strict": strict}
        assert "strict" not in template_tools(sent, "line 1")[0]["function"]  # what the other servers get
    assert "strict" not in vllm_tools([tool])[0]["function"]
    deferred = vllm_tools([{**tool, "defer_loading": True}])[0]
    assert deferred["defer_loading"] and deferred["function"]["defer_loading"]


@pytest.mark.parametrize("arguments, parsed", [
    ('{"city": "Oslo"}', {"city": "Oslo"}), ("city=Oslo", {}), ("[1, 2]", {}), ("42", {}), ("null", {}), ("", {}),
    (None, {}), ({"city": "Oslo"}, {"city": "Oslo"}),
])
def test_tool_call_arguments_reach_the_template_as_an_object(arguments, parsed):
    call = {"id": "1", "type": "function", "function": {"name": "weather", "arguments": arguments}}
    assert parsed_arguments(call)["function"]["arguments"] == parsed
    assert call["function"]["arguments"] == arguments  # the logged request is left as it was


def test_content_parts_are_joined_or_listed_as_the_template_takes_them():
    parts = [{"type": "text", "text": "One."}, {"type": "text", "text": ""},
             {"type": "image_url", "image_url": {"url": "cat.png"}, "detail": "low"},
             {"type": "text", "text": "Two.", "cache_control": {"type": "ephemeral"}},
             {"type": "thinking", "thinking": "Three."}]
    assert VllmChats("string", False).content(parts) == "One.\nTwo.\nThree."
    assert VllmChats("openai", False).content(parts) == [
        {"type": "text", "text": "One."}, {"type": "text", "text": ""}, {"type": "image", "detail": "low"},
        {"type": "text", "text": "Two.", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "Three."}]
    listed = VllmChats("openai", False)
    tool = listed.message({"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]})
    assert tool == {"role": "tool", "content": "a\nb", "tool_call_id": "1"}
    assistant = listed.messages([{"role": "assistant", "content": None, "tool_calls": [], "reasoning": "hmm"}])[0]
    assert assistant == {"role": "assistant", "content": [], "reasoning": "hmm", "reasoning_content": "hmm"}


# What vLLM 0.33.0's _detect_content_format answered for each template ("openai": it loops over content).
CONTENT_FORMATS = {
    "{% for m in messages %}{{ m['content'] }}{% endfor %}": "string",
    "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}": "openai",
    "{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m['content'] | list %}{{ p }}{% endfor %}"
    "{% endfor %}": "openai",
    "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p }}{% endfor %}{% endfor %}":
        "openai",
    "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}{% for m in messages %}"
    "{{ show(m.content) }}{% endfor %}": "openai",
    "{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{% for m in messages %}{{ m.content }}"
    "{% endfor %}{{ show([]) }}": "string",
    "{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}{% for p in m.content %}{{ p }}{% endfor %}"
    "{% endfor %}": "openai",
    "{% for m in messages %}{% generation %}{% for p in m.content %}{{ p }}{% endfor %}{% endgeneration %}"
    "{% endfor %}": "openai",
    "{% for m in messages %}{% for c in m.tool_calls %}{{ c }}{% endfor %}{% endfor %}": "string",
    "{% for m in messages %}{{ m.content }": "string",  # a template that does not parse
}


@pytest.mark.parametrize("template, content_format", list(CONTENT_FORMATS.items()))
def test_the_content_format_is_read_from_the_template_as_vllm_reads_it(template, content_format):
    assert ("openai" if loops_over_content(template) else "string") == content_format


def test_the_saved_templates_have_the_content_formats_vllm_read(tokenizer):
    assert VllmChats.of((DATA / "tool_chat_template_hermes.jinja").read_text()).content_format == "string"
    assert VllmChats.of((DATA / "tool_chat_template_llama3.1_json.jinja").read_text()).content_format == "openai"
    assert VllmChats.of(tokenizer.chat_template).content_format == "string"


def test_only_vllms_model_rewrites(tokenizer):
    assert server_chats(LIKE["vllm"], tokenizer) == VllmChats.of(tokenizer.chat_template)
    assert server_chats(LIKE["engine"], tokenizer) is None and server_chats(LIKE["sglang"], tokenizer) is None


# --- The command as typed


def claude_code_log(path: Path, n: int = 8) -> None:
    """Claude Code's requests through a gateway: a billing header whose cch changes every request,
    then the same long system prompt, then a question of each request's own."""
    w = Writer(1)
    system = "You are Claude Code, a coding agent. " + w.words(240)
    write_log(path, [{"messages": [{"role": "system", "content": HEADER.format(f"{w.rng.getrandbits(20):05x}") + "\n"
                                    + system}, {"role": "user", "content": w.sentence(6, 12)}]} for _ in range(n)])


def analyzed(log: Path, like: str) -> str:
    """What `python prefix_caching.py --analyze LOG --like LIKE --num-blocks 256` prints, on one line."""
    command = [sys.executable, "prefix_caching.py", "--analyze", str(log), "--like", like, "--num-blocks", "256"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "250"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return " ".join(done.stdout.split())


@pytest.mark.subprocess
def test_the_command_caches_claude_codes_system_prompt_as_vllm_does(tmp_path, tokenizer):
    log = tmp_path / "claude_code.jsonl"
    claude_code_log(log)
    requests = read_log(log)
    cached = {}
    for like, chats in (("vllm", VllmChats.of(tokenizer.chat_template)), ("engine", None)):
        with TokenizedLog() as streamed:
            for prompt, request in zip(tokenize_log(requests, tokenizer, chats), requests):
                streamed.append(prompt, request.cache_salt)
            counted = replay(streamed, streamed.salts, 256, 16, model=LIKE[like])
        said = f"{counted.cached_tokens:,} of {counted.prompt_tokens:,} prompt tokens not computed again"
        assert said in analyzed(log, like)
        cached[like] = counted.cached_tokens
    # vLLM drops the header: every request after the first finds the system prompt's full blocks
    # cached (16 of its about 290 tokens' blocks); this course's Engine renders the header, so
    # its prompts part at the cch, two blocks in.
    assert cached["vllm"] == 7 * 256 and cached["engine"] == 7 * 32

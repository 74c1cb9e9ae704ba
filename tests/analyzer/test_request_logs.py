"""The log reader takes every request body OpenAI's chat and completions APIs take, renders
chat messages as vLLM's server hands them to the chat template, reads a log as it
decompresses (never more than --max-log-bytes of it), and names every bad record by its line,
or with --skip-bad leaves it out and counts it."""

import bz2
import copy
import gzip
import itertools
import json
import lzma
from array import array
from pathlib import Path

import pytest
from rich.console import Console

from analyzer.log_replay import tokenize_log
from analyzer.request_logs import MAX_TOKEN_ID, JSONArray, Log, LogError, lines, read_log, requests_from_record
from engine.prompts import CHAT_ROLES, check_prompt, tokenize_prompts

TOOL_CHAT = [  # a developer message, content parts, a tool call with null content, the tool's answer
    {"role": "developer", "content": "Answer in one line."},
    {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                 {"type": "text", "text": "And how warm is it there?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot tell who is in it."}]},
    {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                 {"type": "file", "file": {"file_id": "file-1"}}]},
]


# A chat template with a tool block, written here in the shape of Qwen2.5-Instruct's (the chat_template of
# Qwen/Qwen2.5-7B-Instruct's tokenizer_config.json): the tools as JSON lines between <tools> tags in the system
# turn, each call as JSON between <tool_call> tags, a tool's answer in a user turn between <tool_response> tags.
TOOL_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools>' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for m in rest %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for call in m.tool_calls %}{{- '\\n<tool_call>\\n' + ({'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson) + '\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Today's weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
AGENT_RECORD = {"model": "m", "tools": [WEATHER, {"type": "function", "function": {"name": "now"}}], "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Warm in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}]}


def with_template(tokenizer, template: str):
    tool_aware = copy.deepcopy(tokenizer)
    tool_aware.chat_template = template
    return tool_aware


def write(path: Path, records: list, opener=open, prefix: str = "") -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(prefix + "".join(json.dumps(r) + "\n" for r in records))
    return path


# -----------------------------------------------------------------------------
# Every shape the APIs take


def test_chat_messages_are_rendered_as_vllm_hands_them_to_the_chat_template(tmp_path, tokenizer):
    log = Log.read(write(tmp_path / "chat.jsonl", [{"model": "m", "messages": TOOL_CHAT}]))
    (request,) = log.requests
    assert request.prompt == [
        {"role": "developer", "content": "Answer in one line."},
        {"role": "user", "content": "What is in this picture?\nAnd how warm is it there?"},  # text parts, "\n"
        {"role": "assistant", "content": "", "tool_calls": [  # null content is "", arguments an object
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "4 C", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "I cannot tell who is in it."},
        {"role": "user", "content": ""},
    ]
    assert log.skipped_parts == {"image_url": 1, "input_audio": 1, "file": 1}
    # One path to token ids, the engine's: SmolLM2's template over those messages.
    (ids,) = tokenize_prompts(tokenizer, [request.prompt])
    text = tokenizer.decode(ids)
    assert "<|im_start|>developer\nAnswer in one line.<|im_end|>" in text
    assert "<|im_start|>tool\n4 C<|im_end|>\n<|im_start|>assistant\nI cannot tell" in text


def test_a_requests_tools_reach_the_chat_template_as_vllm_hands_them(tmp_path, tokenizer):
    """vLLM's server hands the template each tool's model_dump() (a description and parameters
    left out are None) and the assistant's calls with their arguments parsed; a template with a
    tool block renders both, and the ids are those of the text this test writes by hand."""
    (request,) = read_log(write(tmp_path / "agent.jsonl", [AGENT_RECORD]))
    assert request.tools == [WEATHER, {"type": "function", "function": {"name": "now", "description": None,
                                                                         "parameters": None}}]
    tool_aware = with_template(tokenizer, TOOL_TEMPLATE)
    (ids,) = tokenize_prompts(tool_aware, [request.prompt], tools=[request.tools])
    by_hand = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n"
        '{"type": "function", "function": {"name": "weather", "description": "Today\'s weather.", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}}}}\n'
        '{"type": "function", "function": {"name": "now", "description": null, "parameters": null}}\n'
        "</tools><|im_end|>\n"
        "<|im_start|>user\nWarm in Oslo?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n4 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert ids == tool_aware.encode(by_hand, add_special_tokens=False)
    # SmolLM2's own template has no tool block: the same request renders without them, the call as an empty turn.
    (plain,) = tokenize_prompts(tokenizer, [request.prompt], tools=[request.tools])
    assert "<|im_start|>assistant\n<|im_end|>" in tokenizer.decode(plain) and "weather" not in tokenizer.decode(plain)


def test_chats_with_different_tools_in_one_batch_each_get_their_own(tmp_path, tokenizer):
    """The batch call is made once per list of tools; each chat still gets its own."""
    records = [AGENT_RECORD, {**AGENT_RECORD, "tools": [WEATHER]}, {"messages": AGENT_RECORD["messages"]}]
    requests = read_log(write(tmp_path / "mixed.jsonl", records))
    tool_aware = with_template(tokenizer, TOOL_TEMPLATE)
    one_by_one = [tool_aware.apply_chat_template(r.prompt, tools=r.tools, add_generation_prompt=True, return_dict=False)
                  for r in requests]
    assert tokenize_log(requests, tool_aware) == [array("I", ids) for ids in one_by_one]
    assert len({len(ids) for ids in one_by_one}) == 3


def test_a_template_without_a_tool_block_is_reported_with_what_it_leaves_out(tmp_path, tokenizer):
    from analyzer.workload_analyzer import main, template_renders_tools

    assert template_renders_tools(tokenizer) == (False, False)  # SmolLM2's template: no tool block
    assert template_renders_tools(with_template(tokenizer, TOOL_TEMPLATE)) == (True, True)
    path = write(tmp_path / "agent.jsonl", [AGENT_RECORD] * 3 + [{"prompt": "no tools here " * 4}])
    console = Console(record=True, width=400)
    main([str(path), "--block-size", "4"], console=console)
    text = console.export_text()
    # The rules by hand: a request's tools as one JSON list, each turn's calls as a JSON list of name and arguments.
    definitions = len(tokenizer.encode(json.dumps(read_log(path)[0].tools), add_special_tokens=False))
    calls = len(tokenizer.encode('[{"name": "weather", "arguments": {"city": "Oslo"}}]', add_special_tokens=False))
    assert (f"3 of 4 requests send tools (1 distinct lists), and the model's chat template has no tool block: "
            f"{3 * definitions:,} tokens of tool definitions (as JSON, {definitions:,} a request)") in text
    assert (f"3 requests send back assistant turns that call tools, and the model's chat template renders no "
            f"tool_calls: {3 * calls:,} tokens of calls (as JSON) are not in the replay, and 3 turns that only call "
            f"tools render as empty messages") in text
    assert f"the chat template leaves out {3 * (definitions + calls):,} tokens of tools" in text
    # The served template, given: the tools are counted, nothing is said to be left out.
    template = tmp_path / "tool_template.jinja"
    template.write_text(TOOL_TEMPLATE)
    console = Console(record=True, width=400)
    summary = main([str(path), "--block-size", "4", "--chat-template", str(template)], console=console)
    tool_aware = with_template(tokenizer, TOOL_TEMPLATE)
    assert summary.prompt_tokens == sum(map(len, tokenize_log(read_log(path), tool_aware)))
    assert "no tool block" not in console.export_text() and "leaves out" not in console.export_text()


def test_the_agent_log_counts_its_tools_with_a_template_that_renders_them(tokenizer):
    from analyzer.request_logs import TOOL_NAMES

    requests = read_log("lessons/data/agent_with_tools.jsonl.xz")
    assert len(requests) == 252 and all([t["function"]["name"] for t in r.tools] == list(TOOL_NAMES) for r in requests)
    tool_aware = with_template(tokenizer, TOOL_TEMPLATE)
    with_tools = sum(map(len, tokenize_log(requests, tool_aware)))
    assert with_tools == sum(len(tool_aware.apply_chat_template(r.prompt, tools=r.tools, add_generation_prompt=True,
                                                                return_dict=False))
                             for r in requests)  # the server's call, request by request
    assert with_tools > 3 * sum(map(len, tokenize_log(requests, tokenizer)))  # the tools are most of each prompt


def test_every_role_the_reader_takes_the_engine_takes_and_the_same_check_refuses_the_rest(tmp_path):
    for role in CHAT_ROLES:
        (request,) = read_log(write(tmp_path / f"{role}.jsonl", [{"messages": [{"role": role, "content": "x"}]}]))
        assert check_prompt(request.prompt) == "messages"
    bad = [{"role": "robot", "content": "beep"}]
    with pytest.raises(ValueError) as engine_says:
        check_prompt(bad)
    with pytest.raises(LogError) as reader_says:
        read_log(write(tmp_path / "robot.jsonl", [{"messages": bad}]))
    assert str(reader_says.value) == f"robot.jsonl, line 1: {engine_says.value}"


@pytest.mark.parametrize("prompt, prompts", [
    ("Hi", ["Hi"]),
    (["Hi", "Hello"], ["Hi", "Hello"]),  # a request each
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [MAX_TOKEN_ID]], [[1, 2], [MAX_TOKEN_ID]]),  # a request each
])
def test_a_completion_prompt_is_a_text_token_ids_or_a_list_of_either(prompt, prompts):
    assert [r.prompt for r in requests_from_record({"prompt": prompt}, "line 1")] == prompts


def test_an_openai_batch_files_lines_hold_their_request_in_body(tmp_path):
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}}
    (request,) = read_log(write(tmp_path / "batch.jsonl", [line]))
    assert request.prompt == [{"role": "user", "content": "Hi"}]


# -----------------------------------------------------------------------------
# The file: a BOM, compression, streaming, the size bound


@pytest.mark.parametrize("opener, name", [(open, "log.jsonl"), (gzip.open, "log.jsonl.gz"),
                                          (lzma.open, "log.jsonl.xz"), (bz2.open, "log.jsonl.bz2"),
                                          (gzip.open, "misnamed.jsonl")])  # known by its first bytes
def test_a_log_plain_or_compressed_with_a_bom_reads_the_same(tmp_path, opener, name):
    records = [{"prompt": "Hi"}, {"messages": [{"role": "user", "content": "Hello"}]}]
    path = write(tmp_path / name, records, opener, prefix="\ufeff")
    assert [r.prompt for r in read_log(path)] == ["Hi", [{"role": "user", "content": "Hello"}]]


def test_a_json_array_with_a_bom_reads_its_elements_as_records(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text("\ufeff[\n" + ",\n".join(json.dumps({"prompt": p}) for p in ("a", "b", "c")) + "\n]\n")
    assert [(r.prompt, r.where) for r in read_log(path)] == [
        ("a", "chats.json, record 1"), ("b", "chats.json, record 2"), ("c", "chats.json, record 3")]


@pytest.mark.slow
def test_the_reader_streams_a_line_or_an_array_element_at_a_time():
    """Endless input: each reader gives its first records without reading to an end."""
    endless = itertools.chain([b'{"pro'], itertools.repeat(b'mpt": "x"}\n{"pro'))  # lines across chunks
    assert list(itertools.islice(lines(endless), 3)) == [
        (1, b'{"prompt": "x"}'), (2, b'{"prompt": "x"}'), (3, b'{"prompt": "x"}')]
    endless = itertools.chain([b"["], itertools.repeat(b'{"prompt": "x"}, '))
    assert list(itertools.islice(JSONArray(endless, "log.json"), 3)) == [{"prompt": "x"}] * 3


def test_a_log_past_the_size_bound_is_refused_naming_the_limit(tmp_path):
    path = tmp_path / "big.jsonl.xz"
    with lzma.open(path, "wt") as f:  # 4 MiB of text in a file of a few KB
        f.writelines(json.dumps({"prompt": "x" * 1000}) + "\n" for _ in range(4096))
    with pytest.raises(LogError, match=r"more than 1,048,576 bytes decompressed, the limit of --max-log-bytes"):
        Log.read(path, max_bytes=2**20)
    assert len(Log.read(path, max_bytes=2**23).requests) == 4096


# -----------------------------------------------------------------------------
# Bad records: named by line, or skipped and counted


@pytest.mark.parametrize("line, message", [
    ('{"prompt": [1, 4294967296]}', "line 2: token ids are integers from 0 to 4,294,967,295 (2^32 - 1), got [4294"),
    ('{"prompt": [-1]}', "line 2: token ids are integers from 0 to 4,294,967,295"),
    ('{"prompt": [[1], [2.5]]}', "line 2: token ids are integers"),
    ('{"prompt": [1, "a"]}', 'line 2: "prompt" is a text, token ids, or a list of texts or of token id lists'),
    ('{"prompt": []}', 'line 2: "prompt" is a text, token ids'),
    ('{"messages": []}', 'line 2: "messages" is a non-empty list'),
    ('{"messages": [{"content": "x"}]}', 'line 2: messages[0] is an object with a "role"'),
    ('{"messages": [{"role": "user", "content": 3}]}', "line 2, messages[0]: content is a string, a list of"),
    ('{"messages": [{"role": "user", "content": [{"text": "x"}]}]}', 'a content part is an object with a "type"'),
    ('{"messages": [{"role": "user", "content": [{"type": "text"}]}]}', 'a "text" part holds its text in "text"'),
    ('{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]}]}', "tool_calls is a list of"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', '"tools" is a list of'),
    ('{"conversations": [{"from": ["gpt"], "value": "Hi"}]}', "line 2, turn 1: a turn is"),
    ("[" * 100_000 + "]" * 100_000, "line 2: JSON nested too deep"),
])
def test_a_bad_record_is_refused_with_its_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(LogError) as refused:
        read_log(path)
    assert message in str(refused.value)


def test_bytes_that_are_not_utf8_are_refused_with_their_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(LogError, match=r"latin1.jsonl, line 2: not UTF-8 at byte 16 of the line"):
        read_log(path)
    array = tmp_path / "latin1.json"
    array.write_bytes(b'[{"prompt": "fine"},\n\n{"prompt": "caf\xe9"}]')
    with pytest.raises(LogError, match=r"latin1.json, line 3: not UTF-8"):
        read_log(array)


@pytest.mark.parametrize("text, message", [
    ('[{"prompt": "a"},\n{"prompt": "b"}\n{"prompt": "c"}]', "line 3: the elements of an array are separated by ','"),
    ('[{"prompt": "a"},\n{"prompt": "b",}]', "line 2: not valid JSON"),
    ('[{"prompt": "a"}] {"prompt": "b"}', "line 1: text after the array's closing ']'"),
])
def test_a_bad_json_array_is_refused_with_its_line(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(LogError, match=message):
        read_log(path)


def test_a_damaged_or_unknown_archive_is_refused_without_a_traceback(tmp_path):
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"prompt": "Hi"}\n' * 1000)[:-30])
    with pytest.raises(LogError, match="cannot decompress it"):
        read_log(cut)
    zstd = tmp_path / "log.jsonl.zst"
    zstd.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(20))
    with pytest.raises(LogError, match="zstd is not read here"):
        read_log(zstd)


def test_skip_bad_leaves_bad_records_out_and_counts_them(tmp_path):
    path = tmp_path / "mixed.jsonl"
    bad_chat = {"messages": [{"role": "robot", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    path.write_bytes(b'{"prompt": "a"}\n{not json\n{"prompt": [-1]}\n{"prompt": "caf\xe9"}\n{"prompt": "b"}\n'
                     + json.dumps(bad_chat).encode() + b"\n")
    log = Log.read(path, skip_bad=True)
    assert [r.prompt for r in log.requests] == ["a", "b"]
    assert log.bad_records == 4 and log.skipped_parts == {} and [e.split(":")[0] for e in log.bad_examples] == [
        f"mixed.jsonl, line {n}" for n in (2, 3, 4)]
    (note,) = log.notes()
    assert note.startswith("4 bad records skipped (--skip-bad), not replayed: mixed.jsonl, line 2: not valid JSON")
    assert note.endswith(" …")  # three quoted, the rest counted
    with pytest.raises(LogError, match=r"the log holds no request \(1 bad records skipped\)"):
        Log.read(write(tmp_path / "none.jsonl", [{"prompt": ""}]), skip_bad=True)


def test_the_analyzer_says_what_it_skipped(tmp_path):
    from analyzer.workload_analyzer import main

    records = [{"messages": TOOL_CHAT}, {"prompt": "a short prompt " * 8}] * 3
    path = write(tmp_path / "log.jsonl", records + ["not a record"])
    console = Console(record=True, width=300)
    main([str(path), "--skip-bad", "--block-size", "4"], console=console)
    text = console.export_text()
    assert "1 bad records skipped (--skip-bad), not replayed: log.jsonl, line 7: a record is a JSON object" in text
    assert "9 content parts that are not text skipped (3 image_url, 3 input_audio, 3 file)" in text


def test_the_analyzer_refuses_a_log_past_max_log_bytes_without_a_traceback(tmp_path, capsys):
    from analyzer.workload_analyzer import main

    path = write(tmp_path / "log.jsonl", [{"prompt": "Hi"}] * 100)
    with pytest.raises(SystemExit) as exit_:
        main([str(path), "--max-log-bytes", "1KiB"])
    assert exit_.value.code == 2 and "more than 1,024 bytes decompressed" in capsys.readouterr().err


def test_a_record_the_chat_template_refuses_is_named_by_its_line(tmp_path, tokenizer):
    """A model's template may refuse a role or an order of roles: the analyzer names the record."""
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'developer' %}"
                            "{{ raise_exception('no developer turns here') }}{% endif %}{{ m['content'] }}{% endfor %}")
    records = [{"messages": [{"role": "user", "content": "Hi"}]},
               {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    with pytest.raises(LogError, match="line 2: the model's chat template refused the messages: no developer turns"):
        tokenize_log(read_log(path), strict)
    assert len(tokenize_log(read_log(path)[:1], strict)) == 1

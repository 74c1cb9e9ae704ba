"""How serving/requests.py reads what a client sends, without HTTP: plain values in, a
GenerationRequest or an APIError out. The status and the words of each error are the spec:
a client that reads the message knows what to send instead.
"""

import hashlib
import io
import json

import pytest

from serving.requests import (
    CHAT, COMPLETIONS, GENERATE, MAX_STOP_CHARS, NO_OP_VALUES, APIError, PromptBounds, Settings, check_admin,
    check_content_type, check_host, parse_generation_request, parse_json_object, read_body, tenant_of,
)

SETTINGS = Settings("tiny-llama", max_tokens_limit=300)
KEYED = Settings("tiny-llama", salt_by_api_key=True)
HI = {"prompt": "Hi"}
CHAT_HI = {"messages": [{"role": "user", "content": "Hi"}]}


def parse(body: dict, route=GENERATE, settings=SETTINGS, headers=None):
    return parse_generation_request(body, route, settings, headers or {})


def refused(call, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        call(*args, **kwargs)
    return info.value


# --- the fields of a generation request ------------------------------------------------------------


def test_defaults_differ_by_route():
    assert parse(HI).temperature == 0.0  # /generate is greedy unless told
    assert parse(HI, COMPLETIONS).temperature == 1.0  # OpenAI's default
    assert parse(HI).max_tokens == 64 and parse(HI).stop is None and parse(HI).cache_salt is None
    assert parse(HI, settings=Settings("m", max_tokens_limit=10)).max_tokens == 10


def test_max_completion_tokens_null_does_not_hide_max_tokens():
    assert parse(CHAT_HI | {"max_completion_tokens": None, "max_tokens": 5}, CHAT).max_tokens == 5
    assert parse(CHAT_HI | {"max_completion_tokens": 7, "max_tokens": None}, CHAT).max_tokens == 7
    assert parse(CHAT_HI | {"max_completion_tokens": 7, "max_tokens": 7}, CHAT).max_tokens == 7
    err = refused(parse, CHAT_HI | {"max_completion_tokens": 5, "max_tokens": 600}, CHAT)
    assert err.status == 400 and "disagree; send one of them" in err.message
    err = refused(parse, CHAT_HI | {"max_completion_tokens": None, "max_tokens": 600}, CHAT)
    assert "max_tokens=600 is over this server's limit of 300" in err.message


@pytest.mark.parametrize("stop", ["\n", ["."], ["a", "b", "c", "d"]])
def test_stop_takes_a_string_or_up_to_four(stop):
    assert parse(HI | {"stop": stop}).stop == stop
    assert parse(CHAT_HI | {"stop": stop}, CHAT).stop == stop


@pytest.mark.parametrize("stop", [123, "", [], ["a", ""], ["a", 1], ["a", "b", "c", "d", "e"], {"s": 1}])
def test_a_bad_stop_is_a_400(stop):
    err = refused(parse, HI | {"stop": stop})
    assert err.status == 400 and err.message.startswith("stop must be a non-empty string or a list of 1 to 4")


@pytest.mark.parametrize("salt, expected", [("team-blue", "team-blue"), ("", None), (None, None)])
def test_cache_salt_follows_vllm(salt, expected):
    assert parse(HI | {"cache_salt": salt}).cache_salt == expected  # "" is no salt, as in vLLM


@pytest.mark.parametrize("salt, words", [
    ("x" * 129, "at most 128"), ("a@b", "'@'"), ("a/b", "'/'"), ("a\\b", "'\\\\'"), ("a\0b", "'\\x00'"),
    (7, "cache_salt must be a str"),
])
def test_a_bad_cache_salt_is_a_400(salt, words):
    err = refused(parse, HI | {"cache_salt": salt})
    assert err.status == 400 and words in err.message


def test_under_keys_the_salt_comes_from_the_key():
    key_salt = hashlib.sha256(b"alice-key").hexdigest()
    assert parse(HI, settings=KEYED, headers={"Authorization": "Bearer alice-key"}).cache_salt == key_salt
    assert refused(parse, HI, settings=KEYED).status == 401
    err = refused(parse, HI | {"cache_salt": "bob"}, settings=KEYED, headers={"Authorization": "Bearer alice-key"})
    assert err.status == 400 and "derives cache_salt from your API key" in err.message


# --- nothing ignored in silence ---------------------------------------------------------------------


def test_an_unknown_field_is_refused_by_name_with_the_accepted_ones():
    err = refused(parse, HI | {"max_token": 5})
    assert err.status == 400
    assert err.message == ("/generate does not take the field 'max_token'; it takes prompt, messages, max_tokens, "
                           "temperature, top_p, seed, stop, cache_salt, stream")
    assert "does not take the field 'max_completion_tokens'" in refused(parse, HI | {"max_completion_tokens": 5}).message
    assert "does not take the field 'n'" in refused(parse, HI | {"n": 1}).message  # /generate is not OpenAI's
    assert parse(HI | {"user": "student-7"}, COMPLETIONS).prompt == "Hi"  # OpenAI's user changes no output
    assert "user must be a string" in refused(parse, HI | {"user": 7}, COMPLETIONS).message


NOT_IMPLEMENTED = [
    ("n", 2), ("n", True), ("best_of", 3), ("logprobs", True), ("logprobs", 5), ("top_logprobs", 2), ("echo", True),
    ("suffix", "end"), ("tools", [{"type": "function"}]), ("functions", [{"name": "f"}]), ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}), ("presence_penalty", 0.5), ("frequency_penalty", -1),
    ("repetition_penalty", 1.2), ("logit_bias", {"50256": -100}),
]


@pytest.mark.parametrize("key, value", NOT_IMPLEMENTED, ids=[f"{k}={v}" for k, v in NOT_IMPLEMENTED])
def test_an_unimplemented_openai_field_is_refused_unless_it_changes_nothing(key, value):
    err = refused(parse, CHAT_HI | {key: value}, CHAT)
    assert err.status == 400 and f"this server does not implement {key!r}" in err.message
    for no_op in (None, *NO_OP_VALUES[key]):
        assert parse(CHAT_HI | {key: no_op}, CHAT).prompt == CHAT_HI["messages"]


def test_stream_options_need_a_stream():
    assert parse(HI | {"stream": True, "stream_options": {"include_usage": True}}, COMPLETIONS).include_usage
    assert "stream_options is for streams" in refused(parse, HI | {"stream_options": {"include_usage": True}},
                                                       COMPLETIONS).message
    assert "stream_options must be an object" in refused(parse, HI | {"stream": True, "stream_options": {"x": 1}},
                                                          COMPLETIONS).message


# --- the body ---------------------------------------------------------------------------------------


def test_the_body_must_say_it_is_json():
    check_content_type("application/json")
    for mimetype in ("application/x-www-form-urlencoded", "text/plain", ""):
        err = refused(check_content_type, mimetype)
        assert err.status == 415 and "-H 'Content-Type: application/json'" in err.message and "--json" in err.message


def test_a_body_over_the_limit_is_413_whether_or_not_it_says_its_length():
    assert read_body(io.BytesIO(b"x" * 10), None, limit=10) == b"x" * 10  # a chunked body exactly at the limit
    assert refused(read_body, io.BytesIO(b"x" * 11), None, limit=10).status == 413  # one byte over: not cut
    err = refused(read_body, io.BytesIO(b""), 11, limit=10)  # refused on its Content-Length, unread
    assert err.status == 413 and "the body is 11 bytes, over this server's limit of 10" in err.message


@pytest.mark.parametrize("raw, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nests arrays or objects too deeply"),
    (b'{"prompt": "\\ud800"}', "prompt holds '\\ud800', a lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages[0].content holds"),
    (b'{"prompt": "Hi", "stop": ["ok", "\\ud800"]}', "stop[1] holds"),
    (b'{"\\ud800": 1}', "a key of the body holds"),
    (b'{"prompt": "Hi", "temperature": Infinity}', "Infinity is not a JSON number"),
])
def test_a_body_json_cannot_carry_is_a_400(raw, words):
    err = refused(parse_json_object, raw)
    assert err.status == 400 and words in err.message


# --- who is asking ----------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1:5000", "localhost:5000", "LOCALHOST", "[::1]:5000", "10.1.2.3:80",
                                  "[fe80::1]", "class-server.local:5000"])
def test_hosts_this_server_answers_to(host):
    check_host(host, {"localhost", "127.0.0.1", "::1", "class-server.local"})


@pytest.mark.parametrize("host", ["evil.example", "evil.example:5000", "127.0.0.1.evil.example", "localhost.evil", ""])
def test_any_other_host_is_a_400_naming_the_option(host):
    err = refused(check_host, host, {"localhost", "127.0.0.1", "::1"})
    assert err.status == 400 and "DNS rebinding" in err.message and "--allowed-host" in err.message


def test_the_tenant_is_public_without_keys_and_a_hash_of_the_key_with_them():
    assert tenant_of({"Authorization": "Bearer k"}, salt_by_api_key=False) is None
    assert tenant_of({"Authorization": "Bearer k"}, salt_by_api_key=True) == hashlib.sha256(b"k").hexdigest()
    for headers in ({}, {"Authorization": "Basic k"}, {"Authorization": "Bearer "}):
        assert refused(tenant_of, headers, salt_by_api_key=True).status == 401


def test_the_reset_is_open_without_keys_and_needs_the_admin_key_with_them():
    check_admin({}, admin_key=None, salt_by_api_key=False)  # a development server on your own machine
    check_admin({"Authorization": "Bearer s3cret"}, admin_key="s3cret", salt_by_api_key=True)
    assert refused(check_admin, {}, admin_key="s3cret", salt_by_api_key=False).status == 401
    assert refused(check_admin, {"Authorization": "Bearer guess"}, admin_key="s3cret", salt_by_api_key=False).status == 403
    err = refused(check_admin, {"Authorization": "Bearer any"}, admin_key=None, salt_by_api_key=True)
    assert err.status == 403 and "start it with --admin-key" in err.message


def test_errors_are_json_objects_an_openai_client_reads():
    from serving.requests import error_json

    assert json.loads(json.dumps(error_json(415, "m"))) == {"error": {"message": "m", "type": "invalid_request_error"}}
    assert error_json(403, "m")["error"]["type"] == "permission_error"


# --- what a request may cost before any work ---------------------------------------------------------


def test_a_stop_string_over_the_limit_is_a_400_before_any_work():
    assert parse(HI | {"stop": ["x" * MAX_STOP_CHARS, "."]}).stop == ["x" * MAX_STOP_CHARS, "."]  # at the limit
    for stop in ("x" * (MAX_STOP_CHARS + 1), [".", "x" * 1_000_000]):
        err = refused(parse, HI | {"stop": stop})
        assert err.status == 400 and f"over this server's limit of {MAX_STOP_CHARS:,}" in err.message


@pytest.mark.parametrize("trims, refused_early", [(False, True), (True, False)])
def test_whitespace_is_counted_as_the_chat_template_counts_it(trims, refused_early):
    bounds = PromptBounds.of(max_prompt_tokens=16, max_token_bytes=81, trims_content=trims)  # 1,296 bytes of text
    chat = {"messages": [{"role": "user", "content": " " * 2000 + "Hi"}]}
    settings = Settings("tiny-llama", bounds=bounds, max_prompt_tokens=16)
    if refused_early:  # kept by the template: 2,002 bytes, more than 16 tokens can hold
        err = refused(parse, chat, settings=settings)
        assert err.status == 400 and "the prompt's text is 2,002 bytes" in err.message
    else:  # trimmed by the template: "Hi", for the engine to count
        assert parse(chat, settings=settings).prompt == chat["messages"]

"""ReplyBuilder decodes a few tokens at a time, and its text is still the whole reply decoded
at once: split characters, special tokens, stop strings and all (hypothesis), while the work
per token stays the same however long the reply. SmolLM2's tokenizer, no model."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.outputs import Generation, ReplyBuilder, held_back

# Texts whose tokens cut characters in pieces: emoji, CJK, accents, a family emoji joined by ZWJ.
TEXTS = ["naïve café 🙂🎉 ok", "你好，世界！日本語のテキスト", "a family 👩‍👩‍👧 and ½ ✓ 𝔘𝔫𝔦", " Yes. No.! Q: A:"]


def decoded_reply(tokenizer, token_ids: list[int], stop: tuple[str, ...]) -> str:
    """The oracle: the reply's tokens decoded at once, cut before the first stop string in
    it, or else without half a character at the end."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text.rstrip("\ufffd")


def stream(builder: ReplyBuilder, token_ids: list[int]) -> str:
    """Feed token_ids until the reply ends, aborting it if they run out first; every piece of
    text it let out, joined."""
    streamed = ""
    for token in token_ids:
        text, finish_reason = builder.add(token)
        streamed += text
        if finish_reason is not None:
            return streamed
    return streamed + builder.abort()


# --- the streamed text is the reply decoded at once -----------------------------------------------


def token_ids(tokenizer):
    """Token sequences a model could sample, and worse: slices of TEXTS' tokens (characters
    cut between tokens), random vocabulary ids, special tokens."""
    encoded = [tokenizer.encode(text) for text in TEXTS]
    sliced = st.builds(lambda ids, start, n: ids[start : start + n],
                       st.sampled_from(encoded), st.integers(0, 20), st.integers(1, 8))
    vocab = st.integers(0, len(tokenizer) - 1) | st.sampled_from(tokenizer.all_special_ids)
    parts = st.lists(sliced | st.lists(vocab, min_size=1, max_size=3), min_size=1, max_size=8)
    return parts.map(lambda parts: [t for part in parts for t in part]).filter(bool)


def stop_strings(text: str):
    """Stop strings that occur in `text`, or start to: its pieces (U+FFFD taken out), or a
    character of it and one it never has."""
    chars = text.replace("\ufffd", "") or "."
    piece = st.builds(lambda start, n: chars[start : start + n], st.integers(0, len(chars) - 1), st.integers(1, 4))
    almost = st.sampled_from(chars).map(lambda c: c + "\u2603")
    return st.lists(piece | almost, min_size=1, max_size=2).map(tuple)


@pytest.mark.parametrize("with_stop", [False, True])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_streamed_text_is_the_reply_decoded_at_once(tokenizer, with_stop, data):
    ids = data.draw(token_ids(tokenizer), label="token ids")
    stop = data.draw(stop_strings(tokenizer.decode(ids, skip_special_tokens=True)), label="stop") if with_stop else ()
    ending = data.draw(st.sampled_from(["max_tokens", "eos", "abort"]), label="ending")
    stop_token_ids = {ids[-1]} if ending == "eos" else set()  # the reply ends at its first one
    max_tokens = len(ids) if ending == "max_tokens" else len(ids) + 1
    builder = ReplyBuilder(Generation("r", 3), tokenizer, stop_token_ids, stop, max_tokens)

    streamed = stream(builder, ids)

    reply = builder.reply
    assert streamed == reply.text == decoded_reply(tokenizer, reply.token_ids, stop)
    earlier = tokenizer.decode(reply.token_ids[:-1], skip_special_tokens=True)
    assert not any(s in earlier for s in stop)  # it ends on the first token that completes a stop string
    if reply.finish_reason == "stop" and not (stop_token_ids & set(reply.token_ids)):
        assert any(s in tokenizer.decode(reply.token_ids, skip_special_tokens=True) for s in stop)


# --- characters and stop strings cut between tokens -------------------------------------------------


def test_a_character_cut_between_tokens_comes_out_with_its_last_byte(tokenizer):
    """The worked example of ReplyBuilder._decode_next, offsets and all."""
    ok, fine, smile = tokenizer.encode(" ok")[0], tokenizer.encode(" fine")[0], tokenizer.encode("🙂")
    assert len(smile) == 2  # bytes F0 9F, then 99 82
    builder = ReplyBuilder(Generation("r", 3), tokenizer, set(), max_tokens=10)
    steps = []
    for token in (ok, *smile, fine):
        steps.append((builder.add(token)[0], builder.prefix_offset, builder.read_offset))
    assert steps == [(" ok", 0, 1), ("", 0, 1), ("🙂", 1, 3), (" fine", 3, 4)]


def test_a_stop_string_cut_between_tokens_ends_the_reply_and_nothing_after_it_comes_out(tokenizer):
    ids = tokenizer.encode("Hello world. The end")
    assert [tokenizer.decode([t]) for t in ids] == ["Hello", " world", ".", " The", " end"]
    builder = ReplyBuilder(Generation("r", 3), tokenizer, set(), stop=("d. Th",), max_tokens=10)

    events = [builder.add(t) for t in ids[:4]]

    # "d" and "d." wait: they may start "d. Th". " The" completes it, and its "e" stays out.
    assert events == [("Hello", None), (" worl", None), ("", None), ("", "stop")]
    assert builder.reply.text == "Hello worl" and builder.reply.token_ids == ids[:4]


# --- the work per token ---------------------------------------------------------------------------


class CountingTokenizer:
    """A tokenizer that counts the tokens it is asked to decode (decode is all ReplyBuilder
    may call: anything else fails here)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, token_ids, **kwargs):
        self.decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, **kwargs)


def test_decoding_a_token_costs_the_same_at_the_end_of_a_long_reply(tokenizer):
    text = " ".join(f"Step {i}: block {i % 7} is cached 🙂; 缓存命中 {i}." for i in range(300))
    ids = tokenizer.encode(text)[:2000]
    assert len(ids) == 2000
    counter = CountingTokenizer(tokenizer)
    builder = ReplyBuilder(Generation("r", 3), counter, set(), stop=("🙂!",), max_tokens=len(ids))

    per_token, streamed = [], ""
    for token in ids:
        before = counter.decoded
        streamed += builder.add(token)[0]
        per_token.append(counter.decoded - before)

    # Decoding the whole reply at every token would be 2,000 tokens for the last one alone.
    assert max(per_token) <= 10
    assert streamed == decoded_reply(tokenizer, ids, ("🙂!",)) and builder.reply.finish_reason == "length"


# --- the text held back for a stop string -----------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab", max_size=12), stop=st.lists(st.text("ab", min_size=1, max_size=8), min_size=1, max_size=3))
def test_held_back_is_the_longest_end_of_the_text_that_a_stop_string_starts_with(text, stop):
    """The oracle: every length tried (two letters make many near-misses)."""
    longest = max((n for s in stop for n in range(min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])), default=0)
    assert held_back(text, tuple(stop)) == longest


class CountingStop(str):
    """A stop string that counts the characters read out of it."""

    read = 0

    def __getitem__(self, key):
        part = str.__getitem__(self, key)
        CountingStop.read += len(part)
        return part


def test_holding_back_reads_a_stop_string_a_few_times_not_once_per_length():
    stop = CountingStop("ab" * 1000)  # ends only with a near-miss: the text ends with "a", nothing longer
    CountingStop.read = 0
    assert held_back("x" * 5000 + "a", (stop,)) == 1
    # Trying each length in turn reads 1 + 2 + ... + 1,999 characters: two million.
    assert CountingStop.read <= 10 * len(stop)

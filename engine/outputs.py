"""
What a request gives back, and the one place its text is made.

    Generation     one reply: its tokens and text, why it finished, and what caching did for it
    StreamEvent    one generated token, as a stream yields it: a value, the reply in the last
    ReplyBuilder   sampled token in, new text and finish reason out: detokenizing (a few
                   tokens at a time), stop strings, EOS, max_tokens, and the text held back

Both engines (engine/one_request.py, engine/batch_engine.py) feed every sampled token through a
ReplyBuilder and nothing else, so a reply's text cannot depend on which engine ran it. In
vLLM the same job is the output processor's (vllm/v1/engine/output_processor.py, with
detokenizer.py and its stop-string check), run outside the engine core.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

# -----------------------------------------------------------------------------
# 1. Replies


@dataclass
class PrefillTiming:
    """Where the time to first token went, in milliseconds (one request at a time only)."""
    lookup_ms: float = 0.0  # hash the prompt's blocks, find the cached prefix, allocate the rest
    gather_ms: float = 0.0  # copy the hit blocks' K/V out of the pool
    forward_ms: float = 0.0  # run the model on the uncached suffix
    write_ms: float = 0.0  # copy the suffix's new K/V into the request's blocks
    sample_ms: float = 0.0  # pick the first token
    # On a GPU, each phase's time on the GPU's own clock (engine/cpu_threads.GpuClock: CUDA
    # events at its start and end), by name ("gather", "forward", ...); None on a CPU
    gpu_ms: dict[str, float] | None = None


@dataclass
class Generation:
    """One reply, and what prefix caching did for it."""
    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from the pool instead of the model
    token_ids: list[int] = field(default_factory=list)  # generated only; ends with EOS if it stopped there
    text: str = ""  # the generated tokens decoded, special tokens left out
    finish_reason: str | None = None  # "stop" (EOS, stop string), "length" (max_tokens), "abort" (cut short)
    ttft_ms: float = 0.0  # request in -> first token sampled
    total_ms: float = 0.0
    prefill: PrefillTiming = field(default_factory=PrefillTiming)  # one request at a time only
    wait_ms: float = 0.0  # request in -> admitted by the scheduler (batched only)
    num_preemptions: int = 0  # times the scheduler took its blocks back to make room

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens the model had to run: the uncached suffix."""
        return self.prompt_tokens - self.cached_tokens

    def event(self, token_id: int, text: str) -> StreamEvent:
        """The StreamEvent of its newest token: a value of its own, with this reply in it
        only once the reply has finished (nothing writes a finished reply again)."""
        finished = self.finish_reason is not None
        return StreamEvent(token_id, text, self.finish_reason, self if finished else None,
                           len(self.token_ids), self.cached_tokens)


@dataclass(frozen=True)
class StreamEvent:
    """One generated token, as Engine.stream yields it (Generation.event makes it)."""
    token_id: int  # -1 on an "abort" that came before the first token
    text: str  # the text this token adds ("" while it is held back)
    finish_reason: str | None  # None until the last event: then "stop", "length" or "abort"
    generation: Generation | None  # the finished reply, on the last event only
    num_tokens: int = 0  # tokens generated so far, this one included
    cached_tokens: int = 0  # prompt tokens whose K/V came from the pool


# -----------------------------------------------------------------------------
# 2. Stop strings


def check_stop(stop) -> tuple[str, ...]:
    """stop as a tuple of non-empty strings: None -> (), "x" -> ("x",); ValueError otherwise."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r:.60}")
    return tuple(stops)


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a stop string.

    >>> held_back("The answer is 4", ("4.", "Q:"))   # "4" may become "4."
    1

    Knuth-Morris-Pratt's automaton reads the text's last len(s) - 1 characters once: at the
    end it stands at the longest of them that s starts with. Linear in the stop string's
    length; trying each length in turn copied up to len(s) characters len(s) times, every
    token.
    """
    held = 0
    for s in stop:
        borders, matched = _borders(s), 0  # matched: how many of s's first characters the text ends with
        for char in text[max(0, len(text) - len(s) + 1) :]:  # fewer than len(s): never all of s
            while matched and char != s[matched]:
                matched = borders[matched - 1]
            if char == s[matched]:
                matched += 1
        held = max(held, matched)
    return held


@functools.lru_cache(maxsize=32)
def _borders(s: str) -> tuple[int, ...]:
    """KMP's failure function, computed once per stop string (a reply checks it every token):
    borders[i] is the length of the longest proper prefix of s[: i + 1] that ends it too.

    >>> _borders("abab"), _borders("aab")
    ((0, 0, 1, 2), (0, 1, 0))
    """
    borders, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = borders[k - 1]
        if s[i] == s[k]:
            k += 1
        borders[i] = k
    return tuple(borders)


# -----------------------------------------------------------------------------
# 3. The finisher


class ReplyBuilder:
    """Builds one reply from its sampled tokens: the only code that decides a reply's text
    and when it ends.

    add(token) appends the token and returns (new text, finish reason):
      - a stop string in the text ends the reply with "stop"; the text is cut before it;
      - a stop token (EOS) ends it with "stop"; max_tokens with "length";
      - until then, text that could be the start of a stop string is held back, and so is
        half a multi-byte character (decoded as U+FFFD until its other bytes come);
      - a reply that ends any way but a stop string lets out what was held back, except half
        a character: a reply cut by max_tokens in the middle of an emoji drops its first
        bytes instead of ending in U+FFFD.

    With stop=(".!",) and a reply " Yes." then EOS: " Yes" comes out, "." waits (it may be
    the start of ".!"), and at EOS the "." comes out with the last event.

    The text is decoded a few tokens at a time (_decode_next), never the whole reply again,
    so a token costs the same at the end of a long reply as at its start.
    """

    def __init__(self, reply: Generation, tokenizer, stop_token_ids: frozenset[int] | set[int],
                 stop: tuple[str, ...] = (), max_tokens: int = 64) -> None:
        self.reply, self.tokenizer = reply, tokenizer
        self.stop_token_ids, self.stop, self.max_tokens = stop_token_ids, stop, max_tokens
        # vLLM's names: reply.token_ids[:read_offset] are decoded into self.text; each new token is
        # decoded together with those from prefix_offset on, the ones before read_offset as context.
        self.prefix_offset = self.read_offset = 0
        self.text = ""  # complete characters decoded so far, some perhaps held back from reply.text
        self.tail = ""  # the tokens from read_offset on, decoded: "" or ending in half a character

    def add(self, token: int) -> tuple[str, str | None]:
        reply = self.reply
        reply.token_ids.append(token)
        self._decode_next()
        new, hit_stop = self._new_text(final=False)
        if hit_stop or token in self.stop_token_ids:
            reply.finish_reason = "stop"
        elif len(reply.token_ids) >= self.max_tokens:
            reply.finish_reason = "length"
        if reply.finish_reason is not None and not hit_stop:
            new += self._new_text(final=True)[0]  # what was held back
        return new, reply.finish_reason

    def abort(self) -> str:
        """End the reply now, before its own end (a server shutting down): finish reason
        "abort", as vLLM's; returns what was held back, as any other ending lets it out."""
        self.reply.finish_reason = "abort"
        return self._new_text(final=True)[0]

    def _decode_next(self) -> None:
        """Decode the newest token: only the tokens from prefix_offset on, and those before
        read_offset only to see where the new text starts. vLLM's detokenize_incrementally
        (vllm/transformers_utils/detokenizer_utils.py), which the SlowIncrementalDetokenizer of
        vllm/v1/engine/detokenizer.py runs; its FastIncrementalDetokenizer does the same inside
        the tokenizers library (DecodeStream).

        " ok", then 🙂 in two tokens (bytes F0 9F, then 99 82), then " fine" (� is U+FFFD):

            token     window decodes to   prefix_text   new text   offsets after
            " ok"     " ok"               ""            " ok"      0, 1
            F0 9F     " ok�"              " ok"         "�"        0, 1   half a character: wait
            99 82     " ok🙂"             " ok"         "🙂"       1, 3
            " fine"   "🙂 fine"           "🙂"          " fine"    3, 4

        The window moves on only after a complete character, so it always starts on a
        character boundary and self.text + self.tail is tokenizer.decode(reply.token_ids),
        without decoding the reply again. (Tokens that never complete a character widen the
        window until one does, as in vLLM.) The context is for tokenizers that decode a token
        differently at the start of a text (SentencePiece drops its leading space); a
        byte-level tokenizer such as SmolLM2's needs none.
        """
        ids = self.reply.token_ids
        prefix_text = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        window = self.tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        self.tail = window[len(prefix_text) :]
        if self.tail and not self.tail.endswith("\ufffd"):  # "": a skipped special token; keep the context
            self.text, self.tail = self.text + self.tail, ""
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)

    def _new_text(self, final: bool) -> tuple[str, bool]:
        """What the text decoded so far adds to reply.text, and whether it reached a stop
        string (reply.text is then cut just before it)."""
        reply, stop = self.reply, self.stop
        text = self.text + self.tail
        found = [i for i in (text.find(s, max(0, len(reply.text) - len(s))) for s in stop) if i >= 0]
        if found:
            end = min(found)
        elif final:
            end = len(text.rstrip("\ufffd"))  # half a character at the very end: never finished
        elif text.endswith("\ufffd"):
            return "", False  # a multi-byte character split across tokens: wait for its other bytes
        else:
            end = len(text) - held_back(text, stop)
        end = max(end, len(reply.text))
        new, reply.text = text[len(reply.text) : end], text[:end]
        return new, bool(found)

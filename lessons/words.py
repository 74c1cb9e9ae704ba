"""
A toy tokenizer for the allocator lessons: one word = one token id.

Real tokenizers cut text into sub-words, but the allocator only ever sees token ids, and
words are easier to read in a block table than numbers. Like a real tokenizer, it gives a
word the same id in every lesson and every run: the id is made from the word itself (the
first 4 bytes of its SHA256), not from the order words were first seen. So a block of the
same words gets the same hash in every stage, and different words get different hashes:
blocks are named by their content.

    >>> vocab = Words()
    >>> vocab.encode("the cat saw the dog")
    [3111611773, 2007988107, 3754008968, 3111611773, 3445839855]
    >>> vocab.decode(vocab.encode("the cat"))
    'the cat'
"""

import hashlib


def token_id(word: str) -> int:
    """The id of `word`: the same in every lesson, every process and every run.

    >>> token_id("the")
    3111611773
    """
    return int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big")


class Words:
    def __init__(self) -> None:
        self.words: dict[int, str] = {}  # the words encoded so far, by id: for decoding

    def encode(self, text: str) -> list[int]:
        """Token ids of the words of `text`."""
        ids = []
        for word in text.split():
            known = self.words.setdefault(token_id(word), word)
            if known != word:  # 2 of 4 billion ids: it does not happen to the course's words
                raise ValueError(f"{word!r} and {known!r} got the same token id {token_id(word)}: use another word")
            ids.append(token_id(word))
        return ids

    def word(self, token_id: int) -> str:
        """Pass as `token_repr` to the rich views to see words in the blocks."""
        return self.words[token_id]

    def decode(self, token_ids) -> str:
        return " ".join(self.word(t) for t in token_ids)

"""
A toy tokenizer for the allocator lessons: one word = one token id.

Real tokenizers cut text into sub-words, but the allocator only ever sees token ids, and
words are easier to read in a block table than numbers.

    >>> vocab = Words()
    >>> vocab.encode("the cat saw the dog")
    [0, 1, 2, 0, 3]
    >>> vocab.word(3)
    'dog'
"""


class Words:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        """Token ids of the words of `text`; a word never seen before gets the next id."""
        for word in text.split():
            if word not in self.ids:
                self.ids[word] = len(self.words)
                self.words.append(word)
        return [self.ids[word] for word in text.split()]

    def word(self, token_id: int) -> str:
        """Pass as `token_repr` to the rich views to see words in the blocks."""
        return self.words[token_id]

    def decode(self, token_ids) -> str:
        return " ".join(self.word(t) for t in token_ids)

"""Real tokenizers made here, for the prompt-cap tests and benchmark: nothing is downloaded.

`train_bpe` trains a byte-level BPE with the `tokenizers` library on text it generates (a Hugging Face
`tokenizer.json`, as a model directory holds); `as_tiktoken` turns the same merges into a tiktoken
encoding, and `registered_tiktoken` registers it with tiktoken under a name and a model name, as a
tiktoken plugin would, since OpenAI's own encodings need a download this machine cannot make.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# GPT-2's split into words, numbers, punctuation and spaces (tiktoken's r50k_base pattern).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "the",
    "model",
    "streams",
    "tokens",
    "to",
    "the",
    "client",
    "and",
    "the",
    "server",
    "keeps",
    "its",
    "queue",
    "short",
    "retrieval",
    "finds",
    "documents",
    "prompts",
    "grow",
    "long",
    "caches",
    "answer",
    "again",
]


def sample_text(characters: int, seed: int = 7) -> str:
    """English-like text of exactly `characters` characters, words from `WORDS`."""
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < characters:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:characters]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as byte-level BPE vocabularies spell tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes, strict=True)}


def train_bpe(vocab_size: int = 2000, seed: int = 7) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on generated text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(3000)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def save_bpe(directory: Path, tokenizer: Any) -> Path:
    """The tokenizer as a model directory holds it: `directory/tokenizer.json`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def tiktoken_constructor(tokenizer: Any, name: str) -> Callable[[], dict[str, Any]]:
    """What a tiktoken plugin registers: the trained merges as tiktoken ranks (a token's id is its rank)."""
    decode = {char: byte for byte, char in _bytes_to_unicode().items()}
    ranks = {bytes(decode[char] for char in token): rank for token, rank in tokenizer.get_vocab().items()}

    def construct() -> dict[str, Any]:
        return {"name": name, "pat_str": GPT2_PATTERN, "mergeable_ranks": ranks, "special_tokens": {}}

    return construct


def as_tiktoken(tokenizer: Any, name: str = "llmspans_test_bpe") -> Any:
    import tiktoken

    return tiktoken.Encoding(**tiktoken_constructor(tokenizer, name)())


@contextlib.contextmanager
def registered_tiktoken(
    constructor: Callable[[], dict[str, Any]], encoding: str, model: str
) -> Iterator[None]:
    """tiktoken knows `encoding` (built by `constructor`) and maps `model` to it, inside the block."""
    from tiktoken import model as models
    from tiktoken import registry

    registry.list_encoding_names()  # its plugins found, so ours is not overwritten by the search
    assert registry.ENCODING_CONSTRUCTORS is not None
    registry.ENCODING_CONSTRUCTORS[encoding] = constructor
    models.MODEL_TO_ENCODING[model] = encoding
    try:
        yield
    finally:
        registry.ENCODING_CONSTRUCTORS.pop(encoding, None)
        registry.ENCODINGS.pop(encoding, None)
        models.MODEL_TO_ENCODING.pop(model, None)

"""Build a tiny, randomly initialised Llama chat model for tests that need a real inference server.

Usage: python make_tiny_model.py [--hidden-size N] OUTPUT_DIR   (run it with the `tserve` venv's python)

Nothing is downloaded: the BPE tokenizer is trained on text this script generates, the weights are random.
The result (about 0.5 MB) is meant for `transformers serve OUTPUT_DIR`; with `--hidden-size 256` (about
6 MB) for vLLM, whose CPU attention rejects a head size of 16 on the first request (it takes 64):

* Llama, 2 layers, hidden size 64 (or N; the MLP twice as wide), 4 attention heads (2 for keys and values),
  so a head size of hidden/4; a vocabulary of exactly 512 tokens, `lm_head` not tied to the embeddings;
* the `lm_head` rows of all special tokens are zero, so their logit is always 0 while the other ~500
  random logits almost surely have a positive maximum: greedy decoding never ends on its own and
  `max_tokens` decides the length of every completion;
* a ChatML chat template (`<|im_start|>role\\ncontent<|im_end|>\\n`);
* deterministic: the same script gives byte-identical files (seeded corpus, seeded weights).
"""

from __future__ import annotations

import json
import os
import random
import string
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

VOCAB_SIZE = 512
HIDDEN_SIZE = 64
NUM_LAYERS = 2
SEED = 1234

SPECIAL_TOKENS = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Printable ASCII: letters, digits, punctuation, newline and tab (Metaspace turns spaces into "▁").
ALPHABET = sorted(set(string.printable) - {" ", "\r", "\x0b", "\x0c"})

_WORDS_TEXT = (
    "the quick brown fox jumps over lazy dog hello world open telemetry trace span token stream model "
    "chat completion assistant user system python test server client request response latency "
    "what is say tell me about a an of to and in for with on time first chunk usage prompt answer"
)
_WORDS = _WORDS_TEXT.split()


def _corpus(rng: random.Random) -> list[str]:
    """Sentences of common words plus made-up words, digits and punctuation: enough for 500+ BPE tokens."""
    consonants = "bcdfghjklmnprstvwxz"
    vowels = "aeiouy"

    def made_up_word() -> str:
        return "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4)))

    lines = []
    for _ in range(4000):
        words = []
        for _ in range(rng.randint(4, 24)):
            roll = rng.random()
            if roll < 0.6:
                words.append(rng.choice(_WORDS))
            elif roll < 0.9:
                words.append(made_up_word())
            else:
                words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice(".?!:;,"))
    # Multi-line paragraphs (chat templates put newlines around every message).
    paragraphs = ["\n".join(rng.sample(lines, rng.randint(2, 5))) for _ in range(500)]
    # Every printable ASCII character at least once, so no ASCII prompt hits <unk>.
    return lines + paragraphs + [" ".join(ALPHABET)]


def build(out: Path, hidden_size: int = HIDDEN_SIZE) -> dict[str, object]:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(SEED)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=ALPHABET,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(rng), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        model_max_length=2048,
    )
    hf_tokenizer.chat_template = CHATML_TEMPLATE
    special_ids = sorted(
        {tokenizer.token_to_id(t) for t in SPECIAL_TOKENS} | set(hf_tokenizer.all_special_ids)
    )

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=hf_tokenizer.bos_token_id,
        eos_token_id=hf_tokenizer.eos_token_id,
        pad_token_id=hf_tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for token_id in special_ids:
            model.lm_head.weight[token_id].zero_()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    )

    out.mkdir(parents=True, exist_ok=True)
    hf_tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return {
        "out": str(out),
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": len(hf_tokenizer),
        "special_ids": special_ids,
    }


def main(argv: list[str]) -> int:
    hidden_size = HIDDEN_SIZE
    args = argv[1:]
    if len(args) == 3 and args[0] == "--hidden-size" and args[1].isdigit() and int(args[1]) % 4 == 0:
        hidden_size = int(args[1])
        args = args[2:]
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: make_tiny_model.py [--hidden-size N (a multiple of 4)] OUTPUT_DIR", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    info = build(Path(args[0]), hidden_size)
    info["secs"] = round(time.monotonic() - t0, 2)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

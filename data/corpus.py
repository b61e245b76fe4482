"""A self-generated demo corpus and a SentencePiece tokenizer trained on it.

The corpus comes from a tiny template grammar, so it is regular enough that a toy LLaMA visibly learns it within a
few hundred steps, and it needs no download. The tokenizer is a SentencePiece BPE model (byte fallback, LLaMA's
special-token layout: unk=0, bos=1, eos=2) saved as a Hugging Face `LlamaTokenizer` directory.
"""

import os
import random
from pathlib import Path

import sentencepiece as spm
from transformers import LlamaTokenizer

_ANIMALS = ["cat", "dog", "bird", "fox", "horse", "rabbit", "mouse", "goat", "duck", "bear"]
_PEOPLE = ["farmer", "teacher", "child", "baker", "doctor", "sailor", "painter", "miller", "guard", "singer"]
_THINGS = ["apple", "ball", "book", "stone", "cup", "hat", "box", "key", "coin", "shoe"]
_PLACES = ["park", "river", "market", "garden", "forest", "school", "harbor", "village", "kitchen", "hill"]
_ADJECTIVES = ["small", "big", "red", "green", "old", "young", "happy", "quiet", "brown", "bright"]
_VERBS = [("sees", "see"), ("finds", "find"), ("likes", "like"), ("carries", "carry"), ("drops", "drop")]
_TIMES = ["in the morning", "at noon", "in the evening", "at night", "on monday", "on friday"]
_NUMBER_WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _noun_phrase(rng: random.Random, nouns: list[str]) -> str:
    if rng.random() < 0.5:
        return f"the {rng.choice(_ADJECTIVES)} {rng.choice(nouns)}"
    return f"the {rng.choice(nouns)}"


def _subject(rng: random.Random) -> str:
    return _noun_phrase(rng, rng.choice([_ANIMALS, _PEOPLE]))


def _action_sentence(rng: random.Random) -> str:
    verb, _ = rng.choice(_VERBS)
    return f"{_subject(rng)} {verb} {_noun_phrase(rng, _THINGS)} near the {rng.choice(_PLACES)}."


def _travel_sentence(rng: random.Random) -> str:
    return f"{rng.choice(_TIMES)}, {_subject(rng)} walks to the {rng.choice(_PLACES)}."


def _counting_sentence(rng: random.Random) -> str:
    count = rng.randrange(len(_NUMBER_WORDS))
    noun = rng.choice(_THINGS)
    plural = noun if count == 0 else noun + ("es" if noun.endswith(("x", "s")) else "s")
    return f"{_subject(rng)} has {_NUMBER_WORDS[count]} {plural}, which is {count + 1}."


def _arithmetic_sentence(rng: random.Random) -> str:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a} plus {b} is {a + b}."


def _sequence_sentence(rng: random.Random) -> str:
    start = rng.randrange(20)
    return "count: " + " ".join(str(start + i) for i in range(rng.randrange(4, 9))) + "."


def _question_sentence(rng: random.Random) -> str:
    _, verb = rng.choice(_VERBS)
    return f"does {_subject(rng)} {verb} {_noun_phrase(rng, _THINGS)}? yes, it does."


_SENTENCE_MAKERS = [
    _action_sentence, _travel_sentence, _counting_sentence, _arithmetic_sentence, _sequence_sentence,
    _question_sentence,
]


def demo_line(rng: random.Random) -> str:
    """One document: 1-4 sentences drawn from the grammar, first letter capitalised."""
    sentences = [rng.choice(_SENTENCE_MAKERS)(rng) for _ in range(rng.randint(1, 4))]
    return " ".join(s[0].upper() + s[1:] for s in sentences)


def write_demo_corpus(path: str | os.PathLike, num_lines: int, seed: int) -> Path:
    """Write `num_lines` generated documents, one per line, to `path`; the same seed gives the same file."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(num_lines):
            f.write(demo_line(rng) + "\n")
    return path


def train_demo_tokenizer(corpus_path: str | os.PathLike, out_dir: str | os.PathLike, vocab_size: int) -> LlamaTokenizer:
    """Train a SentencePiece BPE model on `corpus_path` and save it as a Hugging Face tokenizer in `out_dir`.

    `AutoTokenizer.from_pretrained(out_dir)` loads the result. bos/eos/unk follow LLaMA (ids 1/2/0); the pad token is
    the unk token, so padding never collides with a real end of sequence. Single-threaded training with a fixed
    random-generator seed makes the model a pure function of the corpus and `vocab_size`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_prefix = out_dir / "tokenizer"  # → tokenizer.model, the file name LlamaTokenizer looks for
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(
        input=str(corpus_path),
        model_prefix=str(model_prefix),
        model_type="bpe",  # LlamaTokenizer is a BPE tokenizer; a unigram model would not convert to it
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    # The trainer also writes a .vocab listing that the Hugging Face directory does not need.
    model_prefix.with_suffix(".vocab").unlink()
    # Loading from the directory converts tokenizer.model to a fast tokenizer; the constructor alone would not.
    tokenizer = LlamaTokenizer.from_pretrained(out_dir, pad_token="<unk>", add_bos_token=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer

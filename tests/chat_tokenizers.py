"""Small byte-level BPE tokenizers with the chat templates that instruct checkpoints ship (Jinja text as published
in the checkpoints' tokenizer_config.json), built locally with the `tokenizers` library: nothing is downloaded."""
import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Qwen2-7B-Instruct (ChatML, with a default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Meta-Llama-3-8B-Instruct (header tokens; bos from the template, content trimmed).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# Mistral-7B-Instruct-v0.1: refuses roles other than alternating user/assistant.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

STYLES = {  # name: (special tokens, bos, eos, pad, template)
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>",
               CHATML_TEMPLATE),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", LLAMA3_TEMPLATE),
}

CORPUS = [
    "You are a helpful assistant.", "What is the capital of France?", "The capital of France is Paris.",
    "Count to five, please.", "One, two, three, four, five.", "system user assistant tool", "Thanks! Anything else?",
    "Tell me a short story about a cat and a dog who live near the river.",
    "Once upon a time the small cat found a red ball in the garden, and the dog carried it home.",
] * 4


def write_chat_files(directory, count, seed=1):
    """`count` random conversations of one or two exchanges as chat jsonl, and the ChatML template beside them:
    (data path, template path)."""
    rng = random.Random(seed)
    words = "the cat dog sees a red ball near park".split()
    say = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))  # noqa: E731
    conversations = [[message for _ in range(rng.randint(1, 2)) for message in
                      ({"role": "user", "content": say()}, {"role": "assistant", "content": say()})]
                     for _ in range(count)]
    data, template = directory / "chat.jsonl", directory / "chatml.jinja"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    template.write_text(CHATML_TEMPLATE)
    return data, template


def make_chat_tokenizer(style, vocab_size=400):
    """A PreTrainedTokenizerFast of the given style (see STYLES) with its chat template set."""
    special, bos, eos, pad, template = STYLES[style]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad)
    tokenizer.chat_template = template
    return tokenizer

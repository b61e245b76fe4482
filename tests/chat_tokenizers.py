"""Small byte-level BPE tokenizers with the chat templates that instruct checkpoints ship (Jinja text as published
in the checkpoints' tokenizer_config.json, or as TRL 1.16 ships the originals in trl/chat_templates), built locally
with the `tokenizers` library: nothing is downloaded."""
import importlib.util
import json
import random
from pathlib import Path

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

# OLMo-2-1124-7B-Instruct (Tulu's: no end-of-turn token but eos; bos = eos = <|endoftext|>).
OLMO2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\\n' + "
    "message['content'] + '\\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>\\n'  + message['content'] + "
    "eos_token + '\\n' }}{% else %}{{ '<|assistant|>\\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}")

# granite-3.0-8b-instruct (role tokens; every turn ends <|end_of_text|>, its eos).
GRANITE_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|start_of_role|>available_tools<|end_of_role|>\n' }}\n    {%- for tool in tools %}\n"
    "    {{- tool | tojson(indent=4) }}\n    {%- if not loop.last %}\n        {{- '\n\n' }}\n    {%- endif %}\n"
    "    {%- endfor %}\n    {{- '<|end_of_text|>\n' }}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if message['role'] == 'system' %}\n"
    "    {{- '<|start_of_role|>system<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}\n"
    "    {%- elif message['role'] == 'user' %}\n"
    "    {{- '<|start_of_role|>user<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "    {{- '<|start_of_role|>assistant<|end_of_role|>'  + message['content'] + '<|end_of_text|>\n' }}\n"
    "    {%- elif message['role'] == 'assistant_tool_call' %}\n"
    "    {{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message['content'] + '<|end_of_text|>\n' }}\n"
    "    {%- elif message['role'] == 'tool_response' %}\n"
    "    {{- '<|start_of_role|>tool_response<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}\n"
    "    {%- endif %}\n    {%- if loop.last and add_generation_prompt %}\n"
    "    {{- '<|start_of_role|>assistant<|end_of_role|>' }}\n    {%- endif %}\n{%- endfor %}")

# microsoft/phi-4 (ChatML with <|im_sep|>, no newline between turns).
PHI4_TEMPLATE = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}{{'<|im_start|>system<|im_sep|>' + "
    "message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + "
    "message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'assistant') %}{{'<|im_start|>assistant<|im_sep|>'"
    " + message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}")

# SmolLM3-3B's shape (its tool branches left out): a metadata system block with today's date and the reasoning mode
# (/think unless the system message says /no_think), never learned; in /no_think mode every assistant turn and the
# generation prompt carry an empty think block.
SMOLLM3_TEMPLATE = (
    "{%- if enable_thinking is not defined -%}{%- set enable_thinking = true -%}{%- endif -%}"
    "{%- set reasoning_mode = '/think' if enable_thinking else '/no_think' -%}"
    "{%- set custom_instructions = '' -%}"
    "{%- if messages[0].role == 'system' -%}{%- set system_message = messages[0].content -%}"
    "{%- if '/no_think' in system_message -%}{%- set reasoning_mode = '/no_think' -%}"
    "{%- elif '/think' in system_message -%}{%- set reasoning_mode = '/think' -%}{%- endif -%}"
    "{%- set custom_instructions = system_message.replace('/no_think', '').replace('/think', '').rstrip() -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n## Metadata\\n\\nKnowledge Cutoff Date: June 2025\\n' -}}"
    "{{- 'Today Date: ' + strftime_now('%d %B %Y') + '\\nReasoning Mode: ' + reasoning_mode + '\\n\\n' -}}"
    "{{- '## Custom Instructions\\n\\n' -}}"
    "{%- if custom_instructions -%}{{- custom_instructions + '\\n\\n' -}}"
    "{%- else -%}{{- 'You are a helpful AI assistant named SmolLM, trained by Hugging Face.\\n\\n' -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in messages -%}{%- set content = message.content if message.content is string else '' -%}"
    "{%- if message.role == 'user' -%}{{ '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' -%}{%- if reasoning_mode == '/think' -%}"
    "{{ '<|im_start|>assistant\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}{%- else -%}"
    "{{ '<|im_start|>assistant\\n' + '<think>\\n\\n</think>\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- endif -%}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{%- if reasoning_mode == '/think' -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- else -%}{{ '<|im_start|>assistant\\n' + '<think>\\n\\n</think>\\n' }}{%- endif -%}{%- endif -%}")


def trl_template(name):
    """A chat template as TRL ships it (trl/chat_templates/NAME.jinja; TRL pinned in requirements-dev.txt), read
    without importing TRL: the originals of Qwen3 and Phi-3, and TRL's training variants with {% generation %}."""
    return (Path(importlib.util.find_spec("trl").submodule_search_locations[0]) / "chat_templates"
            / f"{name}.jinja").read_text()


# Gemma's turns (Gemma 3 and 4 instruction-tuned): the assistant's role is 'model'.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


STYLES = {  # name: (special tokens, bos, eos, pad, template)
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>",
               CHATML_TEMPLATE),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", LLAMA3_TEMPLATE),
    # Qwen3: its template renders a think block into the last assistant turn only (earlier turns lose it)
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>",
              "<|endoftext|>", lambda: trl_template("qwen3")),
    # Phi-3: eos ends the whole conversation, after its last turn
    "phi3": (["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], None, "<|endoftext|>",
             "<|endoftext|>", lambda: trl_template("phi3")),
    "phi4": (["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>",
             PHI4_TEMPLATE),
    # OLMo 2: its role markers are plain text, not special tokens
    "olmo2": (["<|endoftext|>", "<|pad|>"], "<|endoftext|>", "<|endoftext|>", "<|pad|>", OLMO2_TEMPLATE),
    "granite": (["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"], "<|end_of_text|>",
                "<|end_of_text|>", "<|end_of_text|>", GRANITE_TEMPLATE),
    "smollm3": (["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None,
                "<|im_end|>", "<|im_end|>", SMOLLM3_TEMPLATE),
    "gemma": (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<pad>",
              GEMMA_TEMPLATE),
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
    tokenizer.chat_template = template() if callable(template) else template
    return tokenizer

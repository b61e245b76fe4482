"""Chat data (data.format=chat) rendered with real chat templates, packing, text document isolation and the
format hints: in-process tests of data/ and the collator."""
import json
import logging
import re

import pytest

from data import IGNORE_INDEX, build_dataset, collate_causal_lm
from models.attention import document_causal_mask
from tests.chat_tokenizers import MISTRAL_TEMPLATE, make_chat_tokenizer
from tests.helpers import write_jsonl

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Count to five, please."},
    {"role": "assistant", "content": "One, two, three, four, five."},
    {"role": "user", "content": "Thanks!"},
]
# What each template appends to an assistant turn's content (its end-of-turn marker).
END_OF_TURN = {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>", "phi4": "<|im_end|>", "olmo2": "<|endoftext|>",
               "granite": "<|end_of_text|>\n", "smollm3": "<|im_end|>\n"}


@pytest.fixture(scope="module", params=list(END_OF_TURN))
def chat_tokenizer(request):
    return request.param, make_chat_tokenizer(request.param)


def build(path, tokenizer, seq_length, tmp_path, **cfg):
    return build_dataset(path, tokenizer, {"format": "chat", **cfg}, seq_length, cache_dir=tmp_path / "cache")


def expected_labels(tokenizer, style, messages):
    """Labels from the rendered string: the tokens lying inside an assistant content + end-of-turn marker."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for message in messages:
        if message["role"] == "assistant":
            addition = message["content"] + END_OF_TURN[style]
            start = text.index(addition, cursor)
            spans.append((start, start + len(addition)))
            cursor = start + len(addition)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoded["input_ids"], [
        token if any(lo <= a and b <= hi for lo, hi in spans) else IGNORE_INDEX
        for token, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"])]


def test_labels_are_exactly_what_each_assistant_turn_adds(chat_tokenizer, tmp_path):
    style, tokenizer = chat_tokenizer
    no_system = CONVERSATION[1:5]  # ChatML inserts its default system prompt
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}, {"messages": no_system}])
    dataset, stats = build(path, tokenizer, 256, tmp_path)
    assert stats.records == stats.examples == 2
    for row, messages in zip(dataset, [CONVERSATION, no_system]):
        ids, labels = expected_labels(tokenizer, style, messages)
        assert row["input_ids"] == ids and row["labels"] == labels
        learned = tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])
        assert learned == "".join(m["content"] + END_OF_TURN[style] for m in messages if m["role"] == "assistant")
    if style == "llama3":  # the template's bos comes once, from the template; the header is never learned
        assert dataset[0]["input_ids"].count(tokenizer.bos_token_id) == 1
        assert tokenizer.convert_tokens_to_ids("<|start_header_id|>") not in dataset[0]["labels"]


# The real templates that do not keep earlier turns as a later render shows them: Qwen3 drops the think block of
# assistant turns before the last user turn, Phi-3 ends the whole conversation with eos. {style: (TRL's training
# variant, what an assistant turn learns, what a conversation that ends with one learns after it)}.
NOT_PREFIX_PRESERVING = {"qwen3": ("qwen3_training", "<think>\n\n</think>\n\n{}<|im_end|>\n", ""),
                         "phi3": ("phi3_training", "{}<|end|>\n", "<|endoftext|>")}


@pytest.mark.parametrize("style", NOT_PREFIX_PRESERVING)
def test_qwen3_and_phi3_templates_train_one_exchange_refuse_more_and_train_trls_training_template(style, tmp_path):
    """Qwen3's and Phi-3's own templates: a single exchange learns what the template adds after the generation
    prompt (Qwen3's empty think block, Phi-3's closing eos); a longer conversation is refused in one line that names
    the fix; with TRL's training variant of the template (data.chat_template) the labels are TRL SFTTrainer's with
    assistant_only_loss (which swaps that variant in itself), every assistant turn learned whole."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    from trl.chat_template_utils import get_training_chat_template

    from tests.chat_tokenizers import trl_template
    training, turn, conversation_end = NOT_PREFIX_PRESERVING[style]
    tokenizer = make_chat_tokenizer(style)
    exchange = CONVERSATION[1:3]
    (row,), _ = build(write_jsonl(tmp_path / "one.jsonl", [{"messages": exchange}]), tokenizer, 256, tmp_path)
    learned = tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])
    assert learned == turn.format(exchange[1]["content"]) + conversation_end

    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:5]}])
    with pytest.raises(ValueError, match=rf"{path}: example 0: .* up to message 2 is not a token prefix .*"
                                         r"\{% generation %\} \(TRL's trl/chat_templates/\*_training.jinja\)"):
        build(path, tokenizer, 256, tmp_path)

    template = tmp_path / f"{training}.jinja"
    template.write_text(trl_template(training))
    assert get_training_chat_template(tokenizer) == template.read_text()  # the variant TRL swaps in
    dataset, _ = build(path, tokenizer, 256, tmp_path, chat_template=str(template))
    trainer = SFTTrainer.__new__(SFTTrainer)
    trainer._tokenizer, trainer.completion_only_loss = tokenizer, False
    trainer.chat_template = get_training_chat_template(tokenizer)
    prepared = trainer._prepare_dataset(
        Dataset.from_list([{"messages": CONVERSATION}, {"messages": CONVERSATION[1:5]}]), tokenizer,
        SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, report_to=[], use_cpu=True),
        packing=False, formatting_func=None, dataset_name="train")
    for row, trl, messages in zip(dataset, prepared, [CONVERSATION, CONVERSATION[1:5]]):
        assert row["input_ids"] == trl["input_ids"] and row["labels"] == trl["labels"]
        learned = tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])
        assert learned == "".join(turn.format(m["content"]) for m in messages if m["role"] == "assistant") + (
            conversation_end if messages[-1]["role"] == "assistant" else "")


def test_overlong_chat_splits_at_turn_ends_or_truncates_and_counts(tmp_path):
    tokenizer = make_chat_tokenizer("chatml")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    (whole,), _ = build(path, tokenizer, 256, tmp_path)
    turn_ends = [i + 1 for i, (a, b) in enumerate(zip(whole["labels"], whole["labels"][1:] + [IGNORE_INDEX]))
                 if a != IGNORE_INDEX and b == IGNORE_INDEX]
    seq_length = turn_ends[1] - turn_ends[0] + 4  # the second exchange fits alone, the first with the system does not
    assert turn_ends[0] > seq_length
    split, stats = build(path, tokenizer, seq_length, tmp_path, overlong="split")
    assert (stats.split, stats.truncated) == (1, 1)  # the first piece is cut inside its turn
    assert split[0]["input_ids"] == whole["input_ids"][:seq_length]
    assert split[1]["input_ids"] == whole["input_ids"][turn_ends[0]:turn_ends[1]]
    assert split[1]["labels"] == whole["labels"][turn_ends[0]:turn_ends[1]]
    truncated, stats = build(path, tokenizer, seq_length, tmp_path, overlong="truncate")
    assert (stats.truncated, stats.split, len(truncated)) == (1, 0, 1)


BAD_EXAMPLES = {
    "empty": ([], "empty 'messages' list"),
    "no_assistant": ([{"role": "user", "content": "Hi"}], "no assistant turn"),
    "rejected_role": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                       {"role": "tool", "content": "42"}],
                      "the chat template rejects it: Conversation roles must alternate"),
}


@pytest.mark.parametrize("name", BAD_EXAMPLES)
def test_bad_chat_example_names_file_and_line_or_is_skipped_and_counted(tmp_path, caplog, name):
    tokenizer = make_chat_tokenizer("llama3")
    tokenizer.chat_template = MISTRAL_TEMPLATE
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    messages, why = BAD_EXAMPLES[name]
    path = write_jsonl(tmp_path / "chat.jsonl", [good, good, {"messages": messages}, good])
    with pytest.raises(ValueError, match=rf"{path}: line 3: bad chat example \({re.escape(why)}"):
        build(path, tokenizer, 64, tmp_path)
    with caplog.at_level(logging.WARNING, logger="data.datasets"):
        dataset, stats = build(path, tokenizer, 64, tmp_path, bad_lines="skip")
    assert (stats.bad_lines_skipped, stats.records, len(dataset)) == (1, 3, 3)
    assert "(first: [3])" in caplog.text


def test_bad_chat_example_in_a_json_array_names_the_example(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}]))
    with pytest.raises(ValueError, match=rf"{path}: example 1: bad chat example \(no assistant turn"):
        build(path, make_chat_tokenizer("chatml"), 256, tmp_path)


def test_missing_template_names_the_key_and_a_template_file_supplies_it(tmp_path):
    tokenizer = make_chat_tokenizer("llama3")
    tokenizer.chat_template = None
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(ValueError, match="has no chat template .* data.chat_template=PATH"):
        build(path, tokenizer, 256, tmp_path)
    template = tmp_path / "llama3.jinja"
    with pytest.raises(ValueError, match=f"data.chat_template '{template}' does not exist"):
        build(path, tokenizer, 256, tmp_path, chat_template=str(template))
    template.write_text(make_chat_tokenizer("llama3").chat_template)
    dataset, _ = build(path, tokenizer, 256, tmp_path, chat_template=str(template))
    assert dataset[0]["labels"] == expected_labels(make_chat_tokenizer("llama3"), "llama3", CONVERSATION)[1]
    assert tokenizer.chat_template is None  # the caller's tokenizer is left as it was


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    tokenizer = make_chat_tokenizer("chatml")
    # Like reasoning templates that drop past assistant turns' thinking: earlier turns render differently.
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "message['content'] + '<|im_end|>'",
        "(message['content'] if loop.last or message['role'] != 'assistant' else '...') + '<|im_end|>'")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(ValueError, match=rf"{path}: example 0: .* up to message 2 is not a token prefix"):
        build(path, tokenizer, 256, tmp_path)


@pytest.mark.parametrize("record, data_format, hint", [
    ({"input_ids": [5, 6, 7]}, "text", "'input_ids': set data.format=pretokenized"),
    ({"prompt": "Hi", "response": "Hello"}, "text", "'prompt', 'response': set data.format=instruction"),
    ({"messages": CONVERSATION}, "instruction", "'messages': set data.format=chat"),
    ({"text": "Hello"}, "chat", None),
])
def test_records_of_another_format_say_which_format_reads_them(tmp_path, record, data_format, hint):
    path = write_jsonl(tmp_path / "data.jsonl", [record] * 3)
    with pytest.raises(ValueError) as error:
        build_dataset(path, make_chat_tokenizer("chatml"), {"format": data_format, "bad_lines": "skip"}, 64,
                      cache_dir=tmp_path / "cache")
    if hint:
        assert str(error.value) == (f"{path}: line 1 lacks {'text' if data_format == 'text' else 'prompt'!r}, the "
                                    f"field data.format={data_format} reads; they hold {hint} to read them")
    else:  # nothing recognisable: the plain message
        assert "no well-formed records" in str(error.value)


# --- packing ---------------------------------------------------------------------------------------------------------

def test_packing_keeps_every_example_whole_and_the_collator_isolates_them(tmp_path):
    lengths = [30, 3, 12, 5, 17, 2, 9, 31, 4, 8, 6, 1]
    records = [{"input_ids": list(range(10, 10 + n))} for n in lengths]
    path = write_jsonl(tmp_path / "ids.jsonl", records)
    cfg = {"format": "pretokenized", "packing": True}
    packed, stats = build_dataset(path, make_chat_tokenizer("chatml"), cfg, 32, cache_dir=tmp_path / "cache")
    rows = packed[:]
    # 11 examples (the 1-token one predicts nothing) of 127 tokens in 4 rows of 32; each is whole in one row.
    assert (stats.packed_from, stats.examples, stats.real_tokens) == (11, 4, 127)
    assert all(sum(ls) == len(ids) <= 32 for ls, ids in zip(rows["lengths"], rows["input_ids"]))
    pieces = []
    for ids, ls in zip(rows["input_ids"], rows["lengths"]):
        starts = [sum(ls[:k]) for k in range(len(ls))]
        pieces += [ids[s:s + n] for s, n in zip(starts, ls)]
    assert sorted(pieces) == sorted(r["input_ids"] for r in records if len(r["input_ids"]) > 1)

    (input_ids, document_ids, position_ids), labels = collate_causal_lm(
        [{"input_ids": [5, 6, 7, 8, 9, 10], "labels": [-100, 6, 7, 8, 9, 10], "lengths": [2, 3, 1]}], 8, 0)
    assert document_ids.tolist() == [[1, 1, 2, 2, 2, 3, 0, 0]]
    assert position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]
    assert labels.tolist() == [[-100, 6, -100, 8, 9, -100, -100, -100]]
    mask = document_causal_mask(document_ids)[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0],
                    [0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0, 0],
                    [0, 0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0, 1]]


def test_text_document_isolation_lists_each_blocks_document_pieces(tmp_path):
    tokenizer = make_chat_tokenizer("llama3")
    documents = ["The capital of France is Paris.", "One, two, three.", "Tell me a short story about a cat."] * 4
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(documents) + "\n")
    plain, _ = build_dataset(path, tokenizer, {"format": "text"}, 16, cache_dir=tmp_path / "cache")
    isolated, _ = build_dataset(path, tokenizer, {"format": "text", "document_isolation": True}, 16,
                                cache_dir=tmp_path / "cache")
    assert isolated[:]["input_ids"] == plain[:]["input_ids"]  # the same stream, cut the same way
    ends, total = [], 0
    for document in documents:  # bos + tokens + eos per document
        total += len(tokenizer(document, add_special_tokens=False).input_ids) + 1 + (tokenizer.bos_token_id is not None)
        ends.append(total)
    for index, lengths in enumerate(isolated[:]["lengths"]):
        start = index * 16
        inside = [e - start for e in ends if start < e < start + 16]
        assert lengths == [b - a for a, b in zip([0, *inside], [*inside, 16])]


def test_a_parquet_file_of_another_format_says_which_format_reads_it(tmp_path):
    import datasets
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 3}).to_parquet(tmp_path / "ids.parquet")
    with pytest.raises(ValueError) as error:
        build_dataset(tmp_path / "ids.parquet", make_chat_tokenizer("chatml"), {"format": "text"}, 16,
                      cache_dir=tmp_path / "cache")
    assert str(error.value) == (f"{tmp_path / 'ids.parquet'}: records lack field(s) ['text'] of data.format=text; "
                                "they hold 'input_ids': set data.format=pretokenized to read them")

"""The five data formats and how a record becomes tokens: `pretokenized` (input_ids), `text` (documents: bos +
tokens + eos), `instruction` (prompt and response, the loss on the response), `chat` (a conversation rendered
with the tokenizer's chat template, the loss on what each assistant turn adds) and `preference` (TRL's prompt /
chosen / rejected records, tokenized as TRL's DPOTrainer does). Each format's settings and fields, and the per-batch
functions that data/datasets.py runs in its cached passes."""
import copy
import dataclasses
import re
from functools import partial
from pathlib import Path
from typing import Any

import datasets

from errors import ConfigError
from models import IGNORE_INDEX
FORMATS = ("pretokenized", "text", "instruction", "chat", "preference", "indexed")  # indexed: data/indexed.py
FORMAT_FIELDS = {"pretokenized": ("input_ids",), "instruction": ("prompt", "response"), "chat": ("messages",),
                 "preference": ("chosen", "rejected")}
PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")  # TRL's names
# A preference record's tokens: the shared prompt, then each response (TRL's prompt_ids / chosen_ids / rejected_ids).
PAIR_FEATURES = datasets.Features({f"{part}_ids": datasets.List(datasets.Value("int32")) for part in PREFERENCE_FIELDS})
TOKEN_FEATURE = datasets.List(datasets.Value("int32"))


@dataclasses.dataclass(frozen=True)
class DataSettings:
    format: str
    text_field: str
    prompt_field: str
    response_field: str
    messages_field: str
    chat_template: str | None
    overlong: str
    bad_lines: str
    packing: bool
    document_isolation: bool
    num_proc: int

    @classmethod
    def from_cfg(cls, data_cfg: Any) -> "DataSettings":
        get = data_cfg.get  # dict and OmegaConf DictConfig alike
        settings = cls(
            format=get("format", "text"),
            text_field=get("text_field", "text"),
            prompt_field=get("prompt_field", "prompt"),
            response_field=get("response_field", "response"),
            messages_field=get("messages_field", "messages"),
            chat_template=get("chat_template", None),
            overlong=get("overlong", "truncate"),
            bad_lines=get("bad_lines", "error"),
            packing=bool(get("packing", False)),
            document_isolation=bool(get("document_isolation", False)),
            num_proc=int(get("num_proc", 1) or 1),
        )
        choices = {"format": FORMATS, "overlong": ("truncate", "split"), "bad_lines": ("error", "skip")}
        for name, allowed in choices.items():
            if getattr(settings, name) not in allowed:
                raise ConfigError(f"data.{name}={getattr(settings, name)!r}: expected one of {', '.join(allowed)}")
        if settings.format == "preference" and (settings.packing or settings.overlong == "split"):
            refused = "data.packing=true" if settings.packing else "data.overlong=split"
            raise ConfigError(f"data.format=preference with {refused}: "
                              "a pair's two sequences travel whole, one per row (overlong pairs are truncated as TRL "
                              "does); set data.packing=false and data.overlong=truncate")
        return settings

    def required_fields(self) -> dict[str, type]:
        """Field → JSON type each record must hold for this format."""
        if self.format == "pretokenized":
            return {"input_ids": list}
        if self.format == "instruction":
            return {self.prompt_field: str, self.response_field: str}
        if self.format == "chat":
            return {self.messages_field: list}
        if self.format == "preference":  # strings, or conversations (lists of messages); the prompt may be implicit
            return dict.fromkeys(PREFERENCE_FIELDS[1:], (str, list))
        return {self.text_field: str}

    def format_hint(self, fields) -> str:
        """For records lacking this format's fields: the format whose fields they hold, as advice (or "")."""
        for name, wanted in FORMAT_FIELDS.items():
            if name != self.format and all(field in fields for field in wanted):
                return f"; they hold {', '.join(repr(f) for f in wanted)}: set data.format={name} to read them"
        return ""


def record_tokenizer(settings: DataSettings, tokenizer, columns: list[str], path: Path):
    """(batch function, its output features, a description, whether it takes row indices) that turns a batch of
    records of this format into full token sequences; None for pretokenized records, which already are."""
    if settings.format == "pretokenized":
        return None
    if settings.format == "chat":
        function = partial(_tokenize_chats, tokenizer=tokenizer, field=settings.messages_field, path=path)
        features = datasets.Features({"input_ids": TOKEN_FEATURE, "labels": TOKEN_FEATURE,
                                      "turn_ends": TOKEN_FEATURE})
        return function, features, "rendering chats", True
    if settings.format == "preference":
        return partial(_tokenize_pairs, tokenizer=tokenizer, path=path), PAIR_FEATURES, "tokenizing pairs", True
    if settings.format == "text":
        text_field = settings.text_field if settings.text_field in columns else "text"
        function = partial(_tokenize_documents, tokenizer=tokenizer, text_field=text_field)
        features = datasets.Features({"input_ids": TOKEN_FEATURE})
    else:
        function = partial(_tokenize_instructions, tokenizer=tokenizer,
                           prompt_field=settings.prompt_field, response_field=settings.response_field)
        features = datasets.Features({"input_ids": TOKEN_FEATURE, "labels": TOKEN_FEATURE})
    return function, features, "tokenizing", False


def _special_ids(tokenizer) -> tuple[list[int], list[int]]:
    as_list = lambda token_id: [] if token_id is None else [token_id]  # noqa: E731
    return as_list(tokenizer.bos_token_id), as_list(tokenizer.eos_token_id)


def _tokenize_documents(batch, *, tokenizer, text_field: str) -> dict:
    """Each document → bos + tokens + eos; empty documents (blank lines) → no tokens."""
    bos, eos = _special_ids(tokenizer)
    documents = tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]
    return {"input_ids": [bos + ids + eos if ids else [] for ids in documents]}


def _tokenize_instructions(batch, *, tokenizer, prompt_field: str, response_field: str) -> dict:
    """bos + prompt (labels -100) followed by response + eos (labels = ids): the loss covers the response only."""
    bos, eos = _special_ids(tokenizer)
    prompts = tokenizer(batch[prompt_field], add_special_tokens=False)["input_ids"]
    responses = tokenizer(batch[response_field], add_special_tokens=False)["input_ids"]
    input_ids, labels = [], []
    for prompt, response in zip(prompts, responses):
        prompt, response = bos + prompt, response + eos
        input_ids.append(prompt + response)
        labels.append([IGNORE_INDEX] * len(prompt) + response)
    return {"input_ids": input_ids, "labels": labels}


def with_chat_template(tokenizer, template_file: str | None):
    """The tokenizer with `template_file`'s Jinja template (a copy: the caller's is left alone), or the tokenizer
    itself when it ships a template; an error naming data.chat_template when neither has one."""
    if template_file:
        if not Path(template_file).is_file():
            raise ConfigError(f"data.chat_template '{template_file}' does not exist; give the path of a Jinja file")
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = Path(template_file).read_text()
    elif not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.format=chat (or preference with conversations): the tokenizer "
                          f"({getattr(tokenizer, 'name_or_path', '') or 'given'}) has "
                          "no chat template (an instruct checkpoint ships one in tokenizer_config.json or "
                          "chat_template.jinja, which convert2ckpt.py copies); supply one from a Jinja file with "
                          "data.chat_template=PATH")
    return tokenizer


def chat_problem(record: dict, *, tokenizer, field: str) -> str | None:
    """Why a chat record cannot train (or None): no messages, a malformed message, no assistant turn to learn,
    an assistant turn first (nothing to condition it on), or a template that refuses the conversation."""
    messages = record[field]
    if not messages:
        return f"bad chat example (empty {field!r} list)"
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return f"bad chat example (message {index} is not a {{'role': str, 'content': str}} object)"
    roles = [message["role"] for message in messages]
    if "assistant" not in roles:
        return "bad chat example (no assistant turn: nothing to train on)"
    if roles[0] == "assistant":
        return "bad chat example (it starts with an assistant turn: no prompt before it)"
    try:
        tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as error:  # jinja2's TemplateError from the template's raise_exception, or a broken template
        return f"bad chat example (the chat template rejects it: {error})"
    return None


def _tokenize_chats(batch, indices, *, tokenizer, field: str, path: Path) -> dict:
    """Each conversation rendered with the tokenizer's chat template; labels only on what assistant turns add.

    Assistant turn i adds the tokens of render(messages[:i+1]) beyond render(messages[:i], add_generation_prompt):
    its content and the template's end-of-turn marker, not its header. Both renders must be token prefixes of the
    whole conversation's tokens (checked: a template that rewrites earlier turns cannot be trained this way). A
    template that marks what the assistant generates with {% generation %} (TRL's training templates) is read by its
    marks instead, as TRL's assistant_only_loss reads them.
    `turn_ends`: the token offset where each assistant turn ends, where overlong=split may cut.
    """
    input_ids, labels, turn_ends = [], [], []
    template = tokenizer.chat_template  # named variants: apply_chat_template renders 'default' here
    marked = GENERATION_MARK.search(template["default"] if isinstance(template, dict) else template) is not None
    for index, messages in zip(indices, batch[field]):
        problem = chat_problem({field: messages}, tokenizer=tokenizer, field=field)
        if problem:
            raise ConfigError(f"{path}: example {index}: {problem}; fix it (a JSON-lines file can also skip it with "
                              "data.bad_lines=skip)")
        full, targets, ends = (_marked_turns(tokenizer, messages) if marked
                               else _prefix_turns(tokenizer, messages, where=f"{path}: example {index}"))
        input_ids.append(full)
        labels.append(targets)
        turn_ends.append(ends)
    return {"input_ids": input_ids, "labels": labels, "turn_ends": turn_ends}


def _prefix_turns(tokenizer, messages, where: str) -> tuple[list, list, list]:
    """(input_ids, labels, turn_ends) of a conversation, each assistant turn located by prefix renders."""
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    texts = [tokenizer.apply_chat_template(messages, tokenize=False)]
    for i in turns:
        texts += [tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True),
                  tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)]
    full, *prefixes = tokenizer(texts, add_special_tokens=False)["input_ids"]
    targets, ends = [IGNORE_INDEX] * len(full), []
    for i, prompt, upto in zip(turns, prefixes[0::2], prefixes[1::2]):
        if full[:len(upto)] != upto or upto[:len(prompt)] != prompt:
            raise ConfigError(
                f"{where}: the chat template's render of the conversation up to message {i} is not a token prefix "
                "of the whole conversation's, so the assistant's tokens cannot be located (templates that rewrite "
                "earlier turns, e.g. drop past reasoning, or end the conversation with a token, do this); supply "
                "one without it, or one that marks the assistant's tokens with {% generation %} (TRL's "
                "trl/chat_templates/*_training.jinja), with data.chat_template=PATH")
        targets[len(prompt):len(upto)] = full[len(prompt):len(upto)]
        ends.append(len(upto))
    return full, targets, ends


GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")  # as TRL's has_generation_markers finds them


def _marked_turns(tokenizer, messages) -> tuple[list, list, list]:
    """(input_ids, labels, turn_ends) of a conversation whose template marks the assistant's tokens with
    {% generation %}: transformers' assistant mask, each marked run a turn."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    ids, mask = rendered["input_ids"], rendered["assistant_masks"]
    labels = [token if learned else IGNORE_INDEX for token, learned in zip(ids, mask)]
    ends = [i + 1 for i, learned in enumerate(mask) if learned and (i + 1 == len(mask) or not mask[i + 1])]
    return ids, labels, ends


def split_implicit_prompt(chosen: list, rejected: list) -> tuple[list, list, list] | None:
    """(prompt, chosen, rejected) of two whole conversations that share every turn but their last assistant one
    (TRL's extract_prompt: the longest common prefix of turns is the prompt), or None when they do not."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    responses = (chosen[shared:], rejected[shared:])
    if shared == 0 or any(len(r) != 1 or not isinstance(r[0], dict) or r[0].get("role") != "assistant"
                          for r in responses):
        return None
    return chosen[:shared], *responses


def preference_problem(record: dict) -> str | None:
    """Why a preference record cannot train (or None): prompt, chosen and rejected must be three strings or three
    conversations (lists of {'role', 'content'} messages), the responses not empty and not the same. Without a
    prompt, chosen and rejected must be conversations that share every turn but their last, an assistant turn."""
    if record.get("prompt") is None:
        if not (isinstance(record["chosen"], list) and isinstance(record["rejected"], list)):
            return ("bad preference example (no 'prompt': only conversations can carry it inside 'chosen' and "
                    "'rejected')")
        split = split_implicit_prompt(record["chosen"], record["rejected"])
        if split is None:
            return ("bad preference example (no 'prompt', and 'chosen' and 'rejected' do not share the prompt: they "
                    "must hold the same turns but their last, one assistant turn each)")
        record = dict(zip(PREFERENCE_FIELDS, split))
    values = [record[field] for field in PREFERENCE_FIELDS]
    if all(isinstance(value, str) for value in values):
        conversational = False
    elif all(isinstance(value, list) for value in values):
        conversational = True
        for field, messages in zip(PREFERENCE_FIELDS, values):
            for index, message in enumerate(messages):
                if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                        and isinstance(message.get("content"), str)):
                    return (f"bad preference example ({field!r} message {index} is not a {{'role': str, 'content': "
                            f"str}} object)")
    else:
        return ("bad preference example ('prompt', 'chosen' and 'rejected' must be all strings or all conversations "
                f"(lists of messages), got {', '.join(type(value).__name__ for value in values)})")
    prompt, chosen, rejected = values
    if not chosen or not rejected:
        return f"bad preference example (empty {'chosen' if not chosen else 'rejected'} response)"
    if chosen == rejected:
        return "bad preference example ('chosen' and 'rejected' are the same: nothing to prefer)"
    if conversational and not prompt:
        return "bad preference example (empty 'prompt' conversation)"
    return None


def _tokenize_pairs(batch, indices, *, tokenizer, path: Path) -> dict:
    """Each record as TRL's DPOTrainer tokenizes it: strings as tokenizer(prompt) and tokenizer(prompt + response
    + eos) (eos appended to a response that lacks it); conversations with the chat template (the prompt with the
    generation prompt). The response starts where the prompt's tokens and prompt + response's first differ, for
    both responses (TRL's common_prefix_length)."""
    output = {f"{part}_ids": [] for part in PREFERENCE_FIELDS}
    prompts = batch["prompt"] if "prompt" in batch else [None] * len(indices)
    for index, prompt, chosen, rejected in zip(indices, prompts, batch["chosen"], batch["rejected"]):
        problem = preference_problem(dict(zip(PREFERENCE_FIELDS, (prompt, chosen, rejected))))
        if problem:
            raise ConfigError(f"{path}: example {index}: {problem}; fix it (a JSON-lines file can also skip it with "
                              "data.bad_lines=skip)")
        if prompt is None:
            prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
        if isinstance(prompt, str):
            eos = tokenizer.eos_token or ""
            prompt_ids = tokenizer(prompt)["input_ids"]
            with_response = [tokenizer(prompt + (r if r.endswith(eos) else r + eos))["input_ids"]
                             for r in (chosen, rejected)]
        else:
            if not getattr(tokenizer, "chat_template", None):
                with_chat_template(tokenizer, None)  # the error naming data.chat_template
            render = partial(tokenizer.apply_chat_template, tokenize=True, return_dict=True)
            prompt_ids = render(prompt, add_generation_prompt=True)["input_ids"]
            with_response = [render(prompt + r)["input_ids"] for r in (chosen, rejected)]
        shared = min(_common_prefix(prompt_ids, ids) for ids in with_response)
        output["prompt_ids"].append(prompt_ids[:shared])
        output["chosen_ids"].append(with_response[0][shared:])
        output["rejected_ids"].append(with_response[1][shared:])
    return output


def _common_prefix(a, b) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length

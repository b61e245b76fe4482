"""The training loss is the global batch's token mean: on instruction data whose labelled tokens per sequence range
from 2 to about 60, the trainer's logged losses and gradient norms equal one transformers model trained on each
step's whole global batch at once (torch AdamW, clipping active), for 1 process x 4 micro-batches and 2 stages x 2
data-parallel x 2 micro-batches. A per-micro-batch mean would weigh a token of a short response many times one of a
long response, and change with the micro-batch size and rank count."""
import json
import random

import pytest
import torch

from tests.launch import check_ok, demo_overrides, launch_trainer, read_metrics

STEPS, SEQ, MICRO_BATCH, LEARNING_RATE, MAX_GRAD_NORM, SEED = 3, 64, 2, 1e-3, 0.5, 42
LAYOUTS = {"1_process": (1, dict(num_stages=1, gradient_accumulation_steps=4, zero_stage=0)),
           "2stages_x_2dp": (4, dict(num_stages=2, gradient_accumulation_steps=2, zero_stage=1))}


@pytest.fixture(scope="module")
def skewed_instructions(demo_model, tmp_path_factory):
    return write_skewed_instructions(demo_model, tmp_path_factory.mktemp("token_mean") / "train.jsonl")


def write_skewed_instructions(demo_model, path):
    """Prompts and responses cut from the demo corpus: responses of 1 to 60 words, so that labelled tokens per
    sequence range from a few to most of the row."""
    words = open(demo_model["train"]).read().split()
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(64):
            start = rng.randrange(len(words) - 100)
            prompt_words, response_words = rng.randint(1, 6), rng.choice([1, 2, 3, 5, 20, 40, 60])
            f.write(json.dumps({"prompt": " ".join(words[start:start + prompt_words]),
                                "response": " ".join(words[start + 10:start + 10 + response_words])}) + "\n")
    return path


def global_batches(demo_model, train_file, data_parallel, micro_batches, cache_dir, steps=STEPS):
    """Each step's global batch as the trainer reads it: every data-parallel rank's micro-batches (its own loader,
    the run's seed), joined into one batch."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoTokenizer

    from data.datasets import build_dataset
    from data.loader import build_stage_loader, infinite_micro_batches
    from training.run_data import pad_token_id
    from training.config_checks import BASE_CONFIG

    tokenizer = AutoTokenizer.from_pretrained(demo_model["ds"])
    data_cfg = OmegaConf.merge(OmegaConf.load(BASE_CONFIG).data, {"format": "instruction"})
    dataset, _ = build_dataset(str(train_file), tokenizer, data_cfg, SEQ, cache_dir=cache_dir)
    pad_id = pad_token_id(tokenizer, AutoConfig.from_pretrained(demo_model["hf"]))
    streams = [infinite_micro_batches(build_stage_loader(dataset, reads_data=True, dp_rank=rank, dp_size=data_parallel,
                                                         micro_batch_size=MICRO_BATCH, seq_length=SEQ, pad_id=pad_id,
                                                         seed=SEED)) for rank in range(data_parallel)]
    for _ in range(steps):
        parts = [next(stream) for stream in streams for _ in range(micro_batches)]
        yield tuple(torch.cat([p[0][i] for p in parts]) for i in range(3)), torch.cat([p[1] for p in parts])


def transformers_on_whole_batches(demo_model, batches):
    """(losses, gradient norms before clipping) of transformers' model, one forward and backward per global batch:
    its loss is the mean over every labelled token of the batch."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(demo_model["hf"], attn_implementation="eager", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.0)
    losses, norms, labelled = [], [], []
    for (input_ids, document_ids, position_ids), labels in batches:
        loss = model(input_ids=input_ids, attention_mask=(document_ids != 0).long(), position_ids=position_ids,
                     labels=labels).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        labelled += (labels[:, 1:] != -100).sum(dim=1).tolist()
    return losses, norms, labelled


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_and_gradient_norms_equal_transformers_on_the_whole_global_batch(demo_model, skewed_instructions,
                                                                               tmp_path, layout):
    procs, settings = LAYOUTS[layout]
    out = tmp_path / "run"
    check_ok(launch_trainer(procs, demo_overrides(demo_model, out, **{
        **settings, "train_file": str(skewed_instructions), "eval_file": "null", "data.format": "instruction",
        "data.cache_dir": str(tmp_path / "cache"), "seq_length": SEQ, "micro_batch_size": MICRO_BATCH,
        "max_steps": STEPS, "logging_steps": 1, "learning_rate": LEARNING_RATE, "lr_scheduler": "constant",
        "warmup_steps": 0,
        "max_grad_norm": MAX_GRAD_NORM, "seed": SEED, "save_steps": 0})))
    records = [r for r in read_metrics(out) if "loss" in r]
    data_parallel = procs // settings["num_stages"]
    losses, norms, labelled = transformers_on_whole_batches(demo_model, global_batches(
        demo_model, skewed_instructions, data_parallel, settings["gradient_accumulation_steps"], tmp_path / "ref"))
    assert min(labelled) <= 4 and max(labelled) >= 40, labelled  # the skew the token mean is about
    assert min(norms) > MAX_GRAD_NORM  # clipping acts on every step
    assert [r["loss"] for r in records] == pytest.approx(losses, abs=1e-5, rel=0)
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-4, abs=0)


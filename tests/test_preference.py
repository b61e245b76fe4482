"""Preference tuning against TRL 1.16: the trainer (training/loop.py run, in spawned gloo processes) on preference
pairs equals TRL's DPOTrainer (precomputed reference log-probabilities, AdamW, clipping) and CPOTrainer (SimPO) on
the same weights, data and hyperparameters: the first step's loss, rewards and every gradient within 1e-5, four
steps' losses and TRL's metrics within 1e-4, on 1 stage, 2 stages x 2 data-parallel (resumed), 2 stages x context
parallel 2 (1F1B and ZB-V), 1 stage x tensor parallel 2 x 2 data-parallel and LoRA; the exported adapter's eval
metrics in TRL. Two process starts serve every run (one_process_runs, two_stage_runs). TRL is imported inside the
tests only (it is slow to import)."""
import contextlib
import json
import random

import numpy as np
import pytest
import torch

from models.preference import PreferenceSettings
from tests.distributed import spawn
from tests.launch import logged_steps, read_metrics

SEQ, MICRO_BATCH, GAS, STEPS, SEED, BETA = 48, 2, 2, 4, 42, 0.1
LORA_RANK, SIMPO_BETA, SIMPO_GAMMA, EVAL_PAIRS = 4, 2.0, 0.5, 10
LEARNING_RATE, BETAS, MAX_GRAD_NORM = 2e-3, (0.9, 0.999), 0.5
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
WORDS = "the cat dog sees a red ball near park and river tree runs jumps over under big small".split()


@pytest.fixture(scope="module")
def preference_model(tmp_path_factory):
    """A tiny LLaMA with a byte-level BPE tokenizer (tests/chat_tokenizers.py), converted; string pairs in jsonl. Its
    pad token is eos, as in many Llama-3 fine-tunes: a real token, ending a turn inside every prompt, whose embedding
    row takes no gradient (transformers' padding_idx)."""
    from transformers import LlamaConfig

    from tests.chat_tokenizers import make_chat_tokenizer
    from tests.tiny_models import COMMON
    tokenizer = make_chat_tokenizer("llama3")
    tokenizer.pad_token = tokenizer.eos_token
    config = LlamaConfig(**dict(COMMON, vocab_size=len(tokenizer), max_position_embeddings=SEQ),
                         num_key_value_heads=2, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return preference_checkpoint(tmp_path_factory.mktemp("preference"), config, tokenizer, 48)


# The other families, each with its own chat tokenizer's special tokens (tests/chat_tokenizers.py); Gemma 3 (sliding
# and full layers, the scaled embedding, (1 + w) norms) and Gemma 4 E2B-like (tests/tiny_models.py
# LAYER_TYPE_CONFIGS: per-layer embeddings, shared keys/values), both with the final soft cap, which the
# log-probabilities take inside the chunked loss, with Gemma's.
FAMILIES = ("qwen3", "phi3", "olmo2", "granite", "smollm3", "gemma3_text", "gemma4_e2b")
FAMILY_TOKENIZERS = {"gemma3_text": "gemma", "gemma4_e2b": "gemma"}
# Gemma 4's first-step gradients are compared within 1e-4 (as tests/test_gemma_pipeline.py's): TRL's own eager and
# SDPA runs are 2.2e-5 apart on them (the first layer's MLP and per-layer projection), the pipeline (SDPA) 3.9e-5
# from the eager run; the loss and rewards within 1e-5 (seen 1.4e-8).
FAMILY_GRAD_TOLERANCES = {"gemma4_e2b": 1e-4}


@pytest.fixture(scope="module")
def family_preference_models(tmp_path_factory):
    """{family: a tiny model of it (tests/tiny_models.py, Granite's multipliers, Phi's fused weights, tied Qwen3 and
    SmolLM3) over its chat tokenizer's vocabulary and ids, converted, with string pairs}: for the first step (and
    Granite's six steps)."""
    from tests.tiny_models import LAYER_TYPE_CONFIGS, TINY_CONFIGS
    configs = {**TINY_CONFIGS, **LAYER_TYPE_CONFIGS}
    return {family: chat_preference_checkpoint(tmp_path_factory.mktemp(family), configs[family](),
                                               FAMILY_TOKENIZERS.get(family, family), STEPS * MICRO_BATCH * GAS)
            for family in FAMILIES}


@pytest.fixture(scope="module")
def moe_preference_model(tmp_path_factory):
    """A tiny Qwen3-MoE (a dense layer among sparse ones, router_aux_loss_coef 0.1) over Qwen's chat tokenizer,
    converted, with string pairs; its config's output_router_logits false, as the published checkpoints say: TRL's
    DPOTrainer adds the load-balancing loss all the same."""
    from tests.tiny_models import MOE_CONFIGS
    config = MOE_CONFIGS["qwen3_moe"]()
    config.output_router_logits = False
    return chat_preference_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), config, "qwen3", STEPS * MICRO_BATCH * GAS)


@pytest.fixture(scope="module")
def hybrid_preference_model(tmp_path_factory):
    """A tiny Qwen3.5 (Gated DeltaNet layers and a gated full-attention one, tests/tiny_models.py) over Qwen's chat
    tokenizer, converted, with string pairs: for two_stage_runs' first step and DPO run on 2 stages x 2
    data-parallel (its first step on 1 process, and SimPO's: tests/test_qwen3_5.py)."""
    from tests.tiny_models import HYBRID_CONFIGS
    return chat_preference_checkpoint(tmp_path_factory.mktemp("qwen3_5"), HYBRID_CONFIGS["qwen3_5"](), "qwen3",
                                      2 * STEPS * MICRO_BATCH * GAS)


def chat_preference_checkpoint(root, config, style, num_records):
    """preference_checkpoint of `config` over the chat tokenizer of `style` (tests/chat_tokenizers.py): its
    vocabulary, special tokens' ids and SEQ positions set in the config."""
    from tests.chat_tokenizers import make_chat_tokenizer
    tokenizer = make_chat_tokenizer(style)
    config.vocab_size, config.max_position_embeddings = len(tokenizer), SEQ
    if getattr(config, "hidden_size_per_layer_input", 0):  # Gemma 4's per-layer table: a row for every token
        config.vocab_size_per_layer_input = len(tokenizer)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return preference_checkpoint(root, config, tokenizer, num_records)


def preference_checkpoint(root, config, tokenizer, num_records):
    """A model of `config` with `tokenizer` saved and converted under root, and num_records string pairs to train
    on (and EVAL_PAIRS to evaluate): {hf, ds, train, records, eval, eval_records, root, first_pairs: the first
    step's pairs tokenized as the trainer reads them, once for every pipeline_first_step}."""
    from transformers import AutoTokenizer

    from checkpoints.hf_to_ds import convert_hf_to_ds
    from data import build_dataset
    from tests.tiny_models import make_model
    make_model(config, root / "hf", seed=3)
    tokenizer.save_pretrained(root / "hf")
    convert_hf_to_ds(str(root / "hf"), str(root / "ds"))
    rng = random.Random(0)
    say = lambda low, high: " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))  # noqa: E731
    # prompts start with bos (as TRL's CPOTrainer makes them; DPO's tokenizes it as it is) and hold an earlier turn's
    # end, eos: a real token whose embedding the response's log-probability depends on
    records = [{"prompt": (tokenizer.bos_token or "") + say(1, 4) + tokenizer.eos_token + say(1, 5) + ":",
                "chosen": " " + say(1, 10),
                "rejected": " " + say(1, 10)}
               for _ in range(num_records + EVAL_PAIRS)]
    train, evaluation = records[:-EVAL_PAIRS], records[-EVAL_PAIRS:]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evaluation))
    rows, _ = build_dataset(str(root / "train.jsonl"), AutoTokenizer.from_pretrained(root / "ds"),
                            {"format": "preference"}, SEQ, cache_dir=root / "first_step_cache")
    return {"hf": str(root / "hf"), "ds": str(root / "ds"), "train": str(root / "train.jsonl"),
            "records": train, "eval": str(root / "eval.jsonl"), "eval_records": evaluation,
            "root": root, "first_pairs": [rows[i] for i in range(len(FIRST_STEP_REFERENCE))]}


def trainer_overrides(model, output_dir, **extra):
    values = dict(model_name_or_path=model["ds"], train_file=model["train"], eval_file="null",
                  output_dir=str(output_dir),
                  seq_length=SEQ, micro_batch_size=MICRO_BATCH, gradient_accumulation_steps=GAS, max_steps=STEPS,
                  learning_rate=LEARNING_RATE, lr_scheduler="constant", warmup_steps=0, adam_beta1=BETAS[0],
                  adam_beta2=BETAS[1], max_grad_norm=MAX_GRAD_NORM, precision="fp32", zero_stage=0, num_stages=1,
                  logging_steps=1, eval_steps=0, save_steps=0, export_hf=False, seed=SEED, objective="dpo",
                  loss_chunk_tokens=7, **{"data.format": "preference", "dpo.beta": BETA,
                                          "deepspeed.tensorboard.enabled": False})
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def composed(*runs):
    """Each list of overrides composed as trainer_pipe.py composes it (Hydra, conf/tiny.yaml), here once for all the
    ranks that run it (~0.1 CPU s a run and rank)."""
    from tests.helpers import compose_configs
    return compose_configs(runs)


def run_trainer(rank, *configs):
    """One rank of the trainer on each composed config in turn (one process start for several runs)."""
    from training.loop import run
    for cfg in configs:
        run(cfg)  # the process group stays up for the next run (gloo cannot start a second one on the same port)
    torch.distributed.destroy_process_group()


def trainer_order(num_records, data_parallel):
    """The pairs of each step as the trainer reads them: every data-parallel rank's share (its DistributedSampler,
    data/loader.py), step after step, one list."""
    from torch.utils.data import DistributedSampler
    shards = [list(DistributedSampler(range(num_records), num_replicas=data_parallel, rank=rank, shuffle=True,
                                      seed=SEED, drop_last=True)) for rank in range(data_parallel)]
    per_step = MICRO_BATCH * GAS
    return [index for step in range(STEPS) for shard in shards
            for index in shard[step * per_step:(step + 1) * per_step]]


def trl_dpo_run(model, order, global_pairs, output_dir, lora=None, micro_batch=None):
    """TRL's DPOTrainer on the pairs in `order`, global_pairs per step (one micro-batch: its loss is the mean over
    the step's pairs, as the trainer's; micro_batch: that many pairs a forward, accumulated, as a mixture of
    experts' load-balancing loss is per forward), precomputed reference log-probabilities; its log history. lora
    (LoraSettings): peft adapters starting from the trainer's initial values, the reference the base."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from tests.lora_reference import adapter_values, peft_model

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    if lora is None:
        policy = AutoModelForCausalLM.from_pretrained(model["hf"], dtype=torch.float32, attn_implementation="eager")
    else:
        policy = peft_model(model["hf"], lora, adapter_values(AutoConfig.from_pretrained(model["hf"]), lora, SEED))
    per_device = micro_batch or global_pairs
    args = DPOConfig(output_dir=str(output_dir), per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=global_pairs // per_device, max_steps=STEPS, learning_rate=LEARNING_RATE,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=BETAS[0],
                     adam_beta2=BETAS[1], adam_epsilon=1e-8, max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch",
                     logging_steps=1, beta=BETA, loss_type=["sigmoid"], precompute_ref_log_probs=True,
                     max_length=SEQ, use_cpu=True, bf16=False, report_to=[], save_strategy="no", seed=SEED,
                     dataloader_drop_last=True, disable_tqdm=True)
    trainer = InOrder(model=policy, args=args, processing_class=AutoTokenizer.from_pretrained(model["hf"]),
                      train_dataset=Dataset.from_list([model["records"][i] for i in order]))
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]


def assert_matches_trl(ours, theirs):
    """The trainer's logged steps against TRL's: the first step's loss and rewards within 1e-5 and its gradient
    norm within 1e-5 relative, every step's loss, gradient norm and metrics within 1e-4."""
    assert len(ours) == len(theirs) == STEPS
    first, trl_first = ours[0], theirs[0]
    assert first["loss"] == pytest.approx(trl_first["loss"], abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert first[name] == pytest.approx(trl_first[name], abs=1e-5), name
    assert first["grad_norm"] == pytest.approx(trl_first["grad_norm"], rel=1e-5)
    for step, (mine, trl) in enumerate(zip(ours, theirs), start=1):
        assert mine["loss"] == pytest.approx(trl["loss"], abs=1e-4), step
        assert mine["grad_norm"] == pytest.approx(trl["grad_norm"], rel=1e-4), step
        for name in METRICS:
            assert mine[name] == pytest.approx(trl[name], abs=1e-4, rel=1e-5), (step, name)


@pytest.fixture(scope="module")
def one_process_runs(preference_model, family_preference_models, moe_preference_model, tmp_path_factory):
    """One process for the first-step gradients (pipeline_first_step: full weights, LoRA; LLaMA's and each other
    family's) and the trainer on 1 stage (LLaMA, Granite; Qwen3-MoE under DPO, and one step under SimPO with the
    load-balancing loss switched on); {"root": where the gradients are, "one_stage": the run's output_dir}."""
    root = tmp_path_factory.mktemp("one_process")
    runs = composed(trainer_overrides(preference_model, root / "one_stage", eval_file=preference_model["eval"]),
                    trainer_overrides(family_preference_models["granite"], root / "granite-one_stage"),
                    trainer_overrides(moe_preference_model, root / "moe-one_stage"),
                    trainer_overrides(moe_preference_model, root / "moe-simpo", objective="simpo", max_steps=1,
                                      output_router_logits=True, **{"simpo.beta": SIMPO_BETA,
                                                                    "simpo.gamma": SIMPO_GAMMA}))
    spawn(one_process_worker, 1, preference_model, family_preference_models, moe_preference_model, root, runs)
    return {"root": root, "one_stage": root / "one_stage"}


def one_process_worker(rank, model, families, moe, root, runs):
    from cluster.distributed import init_distributed
    init_distributed(timeout_minutes=2)
    for name, checkpoint in {"": model, **{f"{family}-": families[family] for family in families}}.items():
        pipeline_first_step(rank, checkpoint, root, f"{name}full")
        pipeline_first_step(rank, checkpoint, root, f"{name}lora", lora_rank=LORA_RANK)
    pipeline_first_step(rank, moe, root, "moe-lora", lora_rank=LORA_RANK)
    run_trainer(rank, *runs)


def four_process_worker(rank, model, hybrid, root, runs):
    from cluster.distributed import init_distributed
    init_distributed(timeout_minutes=2)
    pipeline_first_step(rank, model, root, "2stages_2dp", num_stages=2)
    pipeline_first_step(rank, hybrid, root, "qwen3_5-2stages_2dp", num_stages=2)
    pipeline_first_step(rank, model, root, "tp2_2dp", tensor_parallel=2)
    host_tensor_units(rank, root)
    with host_copies_at_saves(rank, root):
        run_trainer(rank, *runs)


@contextlib.contextmanager
def host_copies_at_saves(rank, root):
    """Record, per save of the optimizer state (checkpoints/optimizer_state.py), the bytes this rank copies to host
    memory (Tensor.cpu), in root/host_copies-rank{rank}.jsonl: {"tag_dir": ..., "bytes": ...} per save."""
    import checkpoints.saving

    save, cpu = checkpoints.saving.save_training_state, torch.Tensor.cpu

    def counted_save(engine, tag_dir):
        copied = []

        def counted_cpu(tensor, *args, **kwargs):
            copied.append(tensor.numel() * tensor.element_size())
            return cpu(tensor, *args, **kwargs)
        torch.Tensor.cpu = counted_cpu
        try:
            return save(engine, tag_dir)
        finally:
            torch.Tensor.cpu = cpu
            with open(root / f"host_copies-rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"tag_dir": str(tag_dir), "bytes": sum(copied)}) + "\n")
    checkpoints.saving.save_training_state = counted_save
    try:
        yield
    finally:
        checkpoints.saving.save_training_state = save


def host_tensor_units(rank, root):
    """The step's scored pairs under context parallel 2 (two groups of two ranks), counted as the training loop
    counts them (training/token_mean.py), from micro-batches whose tensors are host memory as the loader gives
    them (tests/test_collectives.py's HostTensor); and counted straight from those, which the collectives refuse, as
    NCCL would. {"error": the refusal, "units": the loop's count} in root/host_units-rank{rank}.json."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from data.collator import collate_preference
    from models.context_parallel import ContextParallel
    from models.loss import split_micro_batch
    from models.preference import PreferenceLoss, PreferenceSettings
    from tests.test_collectives import on_host
    from training.token_mean import global_loss_units, step_micro_batches

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    context = ContextParallel(2, rank % 2, groups[rank // 2])
    loss_fn = PreferenceLoss(PreferenceSettings("dpo", beta=BETA), context=context)
    engine = SimpleNamespace(is_first_stage=lambda: True, is_last_stage=lambda: True, module=SimpleNamespace(
        loss_fn=loss_fn), grid=SimpleNamespace(get_slice_parallel_rank=lambda: 0))
    micro_batches = [split_micro_batch(context, on_host(collate_preference(pairs, SEQ, pad_id=0)))
                     for pairs in HOST_UNIT_PAIRS]
    try:
        global_loss_units(engine, micro_batches)
        error = None
    except RuntimeError as refused:
        error = str(refused)
    units = global_loss_units(engine, step_micro_batches(engine, iter(micro_batches), len(micro_batches)))
    (root / f"host_units-rank{rank}.json").write_text(json.dumps({"error": error, "units": units}))


def pair(prompt, chosen, rejected):
    """A pair of token rows: the prompt's labels -100, the response's its tokens."""
    return {f"{side}_{key}": prompt + response if key == "input_ids" else [-100] * len(prompt) + response
            for side, response in (("chosen", chosen), ("rejected", rejected)) for key in ("input_ids", "labels")}


def test_evaluation_metrics_are_kept_apart_from_the_training_window():
    """A forward without gradient (evaluation's) adds its pairs' metrics to the evaluation's window, not to the
    training window the next log record takes: each window's metrics are those of its forwards alone."""
    from data.collator import collate_preference
    from models.preference import PreferenceLoss, PreferenceSettings
    _, labels = collate_preference([pair([1, 2, 3], [4, 5], [6]), pair([1, 7], [8, 9, 10], [11])], 8, pad_id=0)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 8, generator=generator)
    trained, evaluated = (scale * torch.randn(4, 8, 8, generator=generator) for scale in (1.0, 3.0))

    def metrics_alone(hidden, grad):
        alone = PreferenceLoss(PreferenceSettings("simpo"), chunk_tokens=4)
        with torch.set_grad_enabled(grad):
            alone((hidden.clone().requires_grad_(grad), weight), labels)
        return alone.take_metrics(evaluation=not grad)
    loss_fn = PreferenceLoss(PreferenceSettings("simpo"), chunk_tokens=4)
    loss_fn((trained.clone().requires_grad_(), weight), labels).backward()
    with torch.no_grad():
        loss_fn((evaluated, weight), labels)
    evaluation, training = loss_fn.take_metrics(evaluation=True), loss_fn.take_metrics()
    assert evaluation == metrics_alone(evaluated, grad=False) and training == metrics_alone(trained, grad=True)
    assert evaluation != training
    assert loss_fn.take_metrics() == {} and loss_fn.take_metrics(evaluation=True) == {}


# two micro-batches of two pairs; the second micro-batch's first pair has no chosen response (not scored)
HOST_UNIT_PAIRS = [[pair([1, 2, 3], [4, 5], [6]), pair([1, 7], list(range(8, 40)), [9, 10, 11])],
                   [pair([1, 2], [], [3, 4]), pair([5] * 20, [6] * 20, [7] * 8)]]


@pytest.fixture(scope="module")
def trl_one_replica(preference_model, tmp_path_factory):
    """TRL's DPOTrainer on the steps one data-parallel replica reads."""
    order = trainer_order(len(preference_model["records"]), 1)
    return trl_dpo_run(preference_model, order, MICRO_BATCH * GAS, tmp_path_factory.mktemp("trl_one_replica"))


@pytest.mark.slow
def test_dpo_one_stage_matches_trl(one_process_runs, trl_one_replica):
    assert_matches_trl(logged_steps(one_process_runs["one_stage"]), trl_one_replica)


@pytest.mark.slow
def test_dpo_one_stage_matches_trl_on_granite(family_preference_models, one_process_runs, tmp_path):
    """Six steps on Granite 3 (its multipliers; the logits divided by logits_scaling in the reference pass and the
    policy's, both through the chunked head), its pad token eos: TRL's DPOTrainer."""
    model = family_preference_models["granite"]
    order = trainer_order(len(model["records"]), 1)
    assert_matches_trl(logged_steps(one_process_runs["root"] / "granite-one_stage"),
                       trl_dpo_run(model, order, MICRO_BATCH * GAS, tmp_path / "trl"))


@pytest.mark.slow
def test_dpo_on_a_mixture_of_experts_adds_the_load_balancing_loss_as_trl(moe_preference_model, one_process_runs,
                                                                        tmp_path):
    """Qwen3-MoE whose config says output_router_logits false: TRL's DPOTrainer adds router_aux_loss_coef times each
    forward's load-balancing loss (over its chosen and rejected rows) all the same, and so does the trainer; TRL with
    the trainer's micro-batches, accumulated: four steps' losses, gradient norms, metrics and aux_loss."""
    order = trainer_order(len(moe_preference_model["records"]), 1)
    theirs = trl_dpo_run(moe_preference_model, order, MICRO_BATCH * GAS, tmp_path / "trl", micro_batch=MICRO_BATCH)
    ours = logged_steps(one_process_runs["root"] / "moe-one_stage")
    assert_matches_trl(ours, theirs)
    assert all(trl["aux_loss"] > 1.0 for trl in theirs)
    assert [mine["aux_loss"] for mine in ours] == pytest.approx([trl["aux_loss"] for trl in theirs], abs=1e-5)


@pytest.mark.slow
def test_dpo_with_lora_on_a_mixture_of_experts_first_step_equals_trl(moe_preference_model, one_process_runs):
    """LoRA on Qwen3-MoE by the default names (attention, and its experts as peft reads gate/up/down there: gate_up_proj
    at twice the rank), B nonzero, DPO with the load-balancing loss TRL adds: the first step's loss, rewards and every
    adapter's gradient (the experts' included) within 1e-5 of DPOTrainer's on peft."""
    assert_first_step_matches_trl(moe_preference_model, one_process_runs["root"], "moe-lora", 1, 1,
                                  lora_rank=LORA_RANK)


@pytest.mark.slow
def test_simpo_on_a_mixture_of_experts_adds_the_load_balancing_loss_as_trl_cpo(moe_preference_model, one_process_runs,
                                                                              tmp_path):
    """SimPO with output_router_logits=true (TRL's CPOTrainer adds the loss when the config sets it): the first
    step's loss, rewards and gradient norm equal CPOTrainer's on the same micro-batches, accumulated."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    class InOrder(CPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    model = moe_preference_model
    order = trainer_order(len(model["records"]), 1)[:MICRO_BATCH * GAS]
    policy = AutoModelForCausalLM.from_pretrained(model["hf"], dtype=torch.float32, attn_implementation="eager")
    policy.config.output_router_logits = True  # the run's output_router_logits=true
    args = CPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=MICRO_BATCH,
                     gradient_accumulation_steps=GAS, max_steps=1, learning_rate=LEARNING_RATE,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=BETAS[0],
                     adam_beta2=BETAS[1], adam_epsilon=1e-8, max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch",
                     logging_steps=1, loss_type="simpo", cpo_alpha=0.0, beta=SIMPO_BETA, simpo_gamma=SIMPO_GAMMA,
                     max_length=SEQ, use_cpu=True, bf16=False, report_to=[], save_strategy="no", seed=SEED,
                     dataloader_drop_last=True, disable_tqdm=True)
    trainer = InOrder(model=policy, args=args, processing_class=AutoTokenizer.from_pretrained(model["hf"]),
                      train_dataset=Dataset.from_list([model["records"][i] for i in order]))
    trainer.train()
    (theirs,) = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    (ours,) = logged_steps(one_process_runs["root"] / "moe-simpo")
    assert ours["aux_loss"] > 1.0
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert ours[name] == pytest.approx(theirs[name], abs=1e-5), name


@pytest.fixture(scope="module")
def two_stage_runs(preference_model, hybrid_preference_model, tmp_path_factory):
    """One start of 4 processes for the first-step gradients on 2 stages x 2 data-parallel (LLaMA's and Qwen3.5's)
    and 1 stage x tensor parallel 2 x 2 data-parallel (pipeline_first_step), then the runs, in turn: on 2 stages
    under ZeRO-1, DPO stopped after 2 steps, the same resumed to 4, DPO with LoRA (evaluated, exported, evaluated
    again from its checkpoint with the reference computed again), DPO under zero-bubble with activation
    checkpointing, SimPO, and DPO on Qwen3.5; DPO on 2 stages x context parallel 2 (under 1F1B and under ZB-V), and
    on 1 stage x tensor parallel 2 x 2 data-parallel;
    {name: output_dir}."""
    root = tmp_path_factory.mktemp("two_stages")
    layout = dict(num_stages=2, zero_stage=1)
    runs = {"dpo": trainer_overrides(preference_model, root / "dpo", **layout, max_steps=STEPS // 2),
            "tp2": trainer_overrides(preference_model, root / "tp2", num_stages=1, tensor_parallel_size=2,
                                     zero_stage=1),
            "cp2": trainer_overrides(preference_model, root / "cp2", num_stages=2, context_parallel_size=2,
                                     eval_file=preference_model["eval"]),
            "zbv_cp2": trainer_overrides(preference_model, root / "zbv_cp2", num_stages=2, context_parallel_size=2,
                                         eval_file=preference_model["eval"], pipeline_schedule="zbv"),
            "zero_bubble": trainer_overrides(preference_model, root / "zero_bubble", **layout,
                                             pipeline_schedule="zero_bubble", activation_checkpoint_interval=1),
            "resumed": trainer_overrides(preference_model, root / "dpo", **layout, resume="auto"),
            "lora": trainer_overrides(preference_model, root / "lora", **layout, eval_file=preference_model["eval"],
                                      export_hf=True, **{"lora.rank": LORA_RANK}),
            # the trained adapters evaluated again, the reference computed anew: the base with its adapters off
            "lora_eval": trainer_overrides(preference_model, root / "lora", **layout, eval_only=True, resume="auto",
                                           eval_file=preference_model["eval"], **{"lora.rank": LORA_RANK,
                                           "data.cache_dir": root / "lora_eval_cache"}),
            "simpo": trainer_overrides(preference_model, root / "simpo", **layout, objective="simpo",
                                       **{"simpo.beta": SIMPO_BETA, "simpo.gamma": SIMPO_GAMMA}),
            "qwen3_5": trainer_overrides(hybrid_preference_model, root / "qwen3_5", **layout)}
    spawn(four_process_worker, 4, preference_model, hybrid_preference_model, root, composed(*runs.values()))
    names = ("dpo", "tp2", "cp2", "zbv_cp2", "zero_bubble", "lora", "simpo", "qwen3_5", "lora_eval_cache")
    return {"root": root, **{name: root / name for name in names}}


@pytest.fixture(scope="module")
def trl_two_replicas(preference_model, tmp_path_factory):
    """TRL's DPOTrainer on the steps two data-parallel replicas read."""
    order = trainer_order(len(preference_model["records"]), 2)
    return trl_dpo_run(preference_model, order, 2 * MICRO_BATCH * GAS, tmp_path_factory.mktemp("trl_two_replicas"))


@pytest.mark.slow
def test_dpo_context_parallel_counts_its_pairs_on_the_device(two_stage_runs):
    """The training loop's count of a step's pairs under context parallelism (an all-reduce over the context group)
    runs on the device, never on the loader's host tensors, which NCCL would refuse and gloo would take."""
    for rank in range(4):
        result = json.loads((two_stage_runs["root"] / f"host_units-rank{rank}.json").read_text())
        assert "a collective was handed a tensor on meta, not on the accelerator's cpu" in result["error"]
        assert result["units"] == 4 * 3  # each rank counts its group's 3 scored pairs: 4 ranks


@pytest.mark.slow
def test_only_the_writing_rank_copies_optimizer_state_to_the_host(two_stage_runs):
    """2 stages x 2 data-parallel ranks, ZeRO-1: at a save the ranks together copy the optimizer state they write to
    host memory once (each layer's on the rank that writes it), not once per data-parallel rank."""
    tag_dir = two_stage_runs["dpo"] / f"global_step{STEPS // 2}"
    copies = [json.loads(line) for rank in range(4)
              for line in (two_stage_runs["root"] / f"host_copies-rank{rank}.jsonl").read_text().splitlines()]
    copied = sum(c["bytes"] for c in copies if c["tag_dir"] == str(tag_dir))
    files = [torch.load(path, weights_only=True) for path in tag_dir.glob("*optim_states.pt")]
    written = sum(t.numel() * t.element_size() for state in files for tensors in state.values()
                  for t in tensors.values())
    assert len(files) == 7 and copied == written  # embedding, 4 decoder layers, final norm, head


@pytest.mark.slow
def test_dpo_tensor_parallel_matches_trl(two_stage_runs, trl_two_replicas):
    """1 stage x tensor parallel 2 (vocabulary-parallel head, sequence parallelism) x 2 data-parallel."""
    assert_matches_trl(logged_steps(two_stage_runs["tp2"]), trl_two_replicas)


@pytest.mark.slow
def test_dpo_zero_bubble_with_activation_checkpointing_matches_trl(two_stage_runs, trl_two_replicas):
    """2 stages x 2 data-parallel under the zero-bubble schedule, every decoder layer checkpointed."""
    assert_matches_trl(logged_steps(two_stage_runs["zero_bubble"]), trl_two_replicas)


@pytest.mark.parametrize("run", ["cp2", "zbv_cp2"])
@pytest.mark.slow
def test_dpo_context_parallel_matches_trl(one_process_runs, two_stage_runs, trl_one_replica, run):
    """2 stages x context parallel 2 (each sequence's tokens split zig-zag, its log-probabilities summed over the
    group; the reference pass too), one replica, under 1F1B and under ZB-V (rank 0 holds the embedding and the head,
    the reference pass and the loss on it): TRL's steps on the pairs one replica reads, and the 1-stage run's eval
    metrics."""
    assert_matches_trl(logged_steps(two_stage_runs[run]), trl_one_replica)
    (split,) = [r for r in read_metrics(two_stage_runs[run]) if "eval_loss" in r]
    (whole,) = [r for r in read_metrics(one_process_runs["one_stage"]) if "eval_loss" in r]
    for name in ("eval_loss", *(f"eval_{name}" for name in METRICS)):
        assert split[name] == pytest.approx(whole[name], abs=1e-4), name


@pytest.mark.slow
def test_dpo_two_stages_two_data_parallel_resumed_matches_trl(two_stage_runs, trl_two_replicas):
    """Stopped after 2 steps and resumed: the resumed run reads the stored reference log-probabilities (the file
    is not written again) and the four steps equal TRL's."""
    out = two_stage_runs["dpo"]
    (reference,) = (out / "data_cache").glob("*-reference-*.pt")
    # written before the first run's checkpoint, never again: the resumed run read it
    assert reference.stat().st_mtime_ns < (out / f"global_step{STEPS // 2}").stat().st_mtime_ns
    assert_matches_trl(logged_steps(out), trl_two_replicas)


@pytest.mark.slow
def test_dpo_lora_matches_trl(preference_model, two_stage_runs, tmp_path):
    """LoRA: the reference is the base with the adapters off (TRL: peft's disabled adapter)."""
    from models.lora import LoraSettings
    order = trainer_order(len(preference_model["records"]), 2)
    assert_matches_trl(logged_steps(two_stage_runs["lora"]),
                       trl_dpo_run(preference_model, order, 2 * MICRO_BATCH * GAS, tmp_path / "trl",
                                   lora=LoraSettings(rank=LORA_RANK)))


@pytest.mark.slow
def test_dpo_on_a_hybrid_over_two_stages_matches_trl(hybrid_preference_model, two_stage_runs, tmp_path):
    """Qwen3.5 (Gated DeltaNet layers and gated full attention, the pattern split across the stages) on 2 stages x
    2 data-parallel under ZeRO-1: the first step's loss, rewards and every gradient within 1e-5 of TRL's
    DPOTrainer with FIRST_STEP_REFERENCE; four steps of the trainer, its own reference pass through the hybrid
    included, TRL's."""
    model = hybrid_preference_model
    assert_first_step_matches_trl(model, two_stage_runs["root"], "qwen3_5-2stages_2dp", 4, 2)
    order = trainer_order(len(model["records"]), 2)
    assert_matches_trl(logged_steps(two_stage_runs["qwen3_5"]),
                       trl_dpo_run(model, order, 2 * MICRO_BATCH * GAS, tmp_path / "trl"))


@pytest.mark.slow
def test_exported_lora_adapter_gives_the_eval_metrics_in_trl(preference_model, two_stage_runs, tmp_path):
    """The exported peft adapter on the base, evaluated by TRL's DPOTrainer (reference: the adapter disabled) on
    the eval pairs, gives the eval_loss and eval metrics the trainer logged (its eval shards padded with empty
    pairs that count nowhere); so does the trained checkpoint evaluated again with the reference computed after
    loading its adapters (switched off for it)."""
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    out = two_stage_runs["lora"]
    logged, again = [r for r in read_metrics(out) if "eval_loss" in r]
    assert list((two_stage_runs["lora_eval_cache"]).glob("*-reference-*.pt"))
    for name in ("eval_loss", *(f"eval_{name}" for name in METRICS)):
        assert again[name] == pytest.approx(logged[name], abs=1e-6), name
    base = AutoModelForCausalLM.from_pretrained(preference_model["hf"], dtype=torch.float32,
                                                attn_implementation="eager")
    trainer = DPOTrainer(model=PeftModel.from_pretrained(base, str(out / "hf")),
                         processing_class=AutoTokenizer.from_pretrained(preference_model["hf"]),
                         train_dataset=Dataset.from_list(preference_model["records"][:1]),
                         args=DPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, max_length=SEQ, use_cpu=True,
                                        bf16=False, report_to=[], precompute_ref_log_probs=True, disable_tqdm=True,
                                        per_device_eval_batch_size=EVAL_PAIRS))
    # TRL takes a peft model passed in as an adapter to train further, its copy "ref" the reference; the trainer's
    # reference is the base, TRL's for a new adapter
    trainer.model.delete_adapter("ref")
    theirs = trainer.evaluate(Dataset.from_list(preference_model["eval_records"]))
    assert logged["eval_loss"] == pytest.approx(theirs["eval_loss"], abs=1e-5)
    for name in METRICS:
        assert logged[f"eval_{name}"] == pytest.approx(theirs[f"eval_{name}"], abs=1e-5, rel=1e-6), name


@pytest.mark.slow
def test_simpo_matches_trl_cpo(preference_model, two_stage_runs, tmp_path):
    """objective=simpo equals TRL's CPOTrainer with loss_type="simpo", cpo_alpha=0 (no reference pass: no file)."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    class InOrder(CPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    out = two_stage_runs["simpo"]
    assert not list((out / "data_cache").glob("*-reference-*.pt"))
    order = trainer_order(len(preference_model["records"]), 2)
    args = CPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2 * MICRO_BATCH * GAS,
                     gradient_accumulation_steps=1, max_steps=STEPS, learning_rate=LEARNING_RATE,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=BETAS[0],
                     adam_beta2=BETAS[1], adam_epsilon=1e-8, max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch",
                     logging_steps=1, loss_type="simpo", cpo_alpha=0.0, beta=SIMPO_BETA, simpo_gamma=SIMPO_GAMMA,
                     max_length=SEQ, use_cpu=True, bf16=False, report_to=[], save_strategy="no", seed=SEED,
                     dataloader_drop_last=True, disable_tqdm=True)
    trainer = InOrder(model=AutoModelForCausalLM.from_pretrained(preference_model["hf"], dtype=torch.float32,
                                                                 attn_implementation="eager"),
                      args=args, processing_class=AutoTokenizer.from_pretrained(preference_model["hf"]),
                      train_dataset=Dataset.from_list([preference_model["records"][i] for i in order]))
    trainer.train()
    theirs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    assert_matches_trl(logged_steps(out), theirs)


FIRST_STEP_REFERENCE = [(-60.0 - 7 * i, -55.0 - 11 * i) for i in range(4 * MICRO_BATCH * GAS)]  # margins differ
OBJECTIVES = {"dpo": PreferenceSettings("dpo", beta=BETA),  # pipeline_first_step's and trl_first_step's
              "simpo": PreferenceSettings("simpo", beta=SIMPO_BETA, gamma=SIMPO_GAMMA)}


def pipeline_first_step(rank, model, root, case, lora_rank=0, num_stages=1, tensor_parallel=1, objective="dpo"):
    """One training step of the pipeline on this rank's share of the first pairs (data-parallel rank r takes the
    r-th block of MICRO_BATCH x GAS), with FIRST_STEP_REFERENCE as their reference log-probabilities (which SimPO
    does not read); under LoRA adapters with random B; objective "dpo" or "simpo" (OBJECTIVES' settings). Saves
    this rank's gradients by Hugging Face name (with its tensor-parallel split), the step's loss and metrics to
    root/<case>-rank<r>.pt."""
    import deepspeed
    from transformers import AutoConfig, AutoTokenizer

    from checkpoints.layer_files import load_layer_slice
    from data.collator import collate_preference
    from models.lora import NO_LORA, LoraSettings
    from models.pipeline import build_pipeline_module
    from tests.lora_reference import adapter_values
    from tests.parity_worker import GradientRecorder, hf_name_of_pipeline_param, set_adapters
    from cluster.distributed import parallel_topology
    from training.token_mean import global_loss_units, token_mean_micro_batches

    config = AutoConfig.from_pretrained(model["hf"])
    if getattr(config, "router_aux_loss_coef", 0.0):  # as the trainer sets it under DPO (moe_model_config)
        config.output_router_logits = True
    lora = LoraSettings(rank=lora_rank) if lora_rank else NO_LORA
    module = build_pipeline_module(config, parallel_topology(num_stages, tensor_parallel),
                                   layer_loader=load_layer_slice, loss_chunk_tokens=7, lora=lora,
                                   objective=OBJECTIVES[objective])
    recorder = GradientRecorder([p for p in module.parameters() if p.requires_grad])
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=recorder, config={
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GAS,
        "steps_per_print": 10**9, "gradient_clipping": 0.0,
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}})
    engine.load_checkpoint(model["ds"], load_module_only=True)
    if lora.enabled:
        set_adapters(module, adapter_values(config, lora, seed=7, nonzero_b=True), module.parallel)
    tokenizer = AutoTokenizer.from_pretrained(model["ds"])
    first = engine.grid.data_parallel_id * MICRO_BATCH * GAS
    pairs = [{**model["first_pairs"][i], "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}
             for i, (chosen, rejected) in enumerate(FIRST_STEP_REFERENCE) if first <= i < first + MICRO_BATCH * GAS]
    micro_batches = [collate_preference(pairs[k:k + MICRO_BATCH], SEQ, tokenizer.pad_token_id)
                     for k in range(0, len(pairs), MICRO_BATCH)]
    micro_batches = token_mean_micro_batches(engine, micro_batches, global_loss_units(engine, micro_batches))
    loss = float(engine.train_batch(iter(micro_batches)))
    grads = {hf_name_of_pipeline_param(name, config.num_hidden_layers):
             (recorder.recorded[param], getattr(param, "tensor_parallel_dim", None))
             for name, param in module.named_parameters() if param.requires_grad}
    torch.save({"loss": loss, "metrics": module.loss_fn.take_metrics(), "grads": grads,
                "tensor_parallel": (module.parallel.rank, module.parallel.size)}, root / f"{case}-rank{rank}.pt")


def trl_first_step(model, lora_rank, pairs, output_dir, objective="dpo"):
    """TRL's DPOTrainer loss on the first `pairs` pairs with FIRST_STEP_REFERENCE (objective "simpo": CPOTrainer's
    with loss_type="simpo", cpo_alpha=0, which takes no reference), in the pipeline's micro-batches of MICRO_BATCH
    pairs accumulated (a mixture of experts' load-balancing loss is per forward; a dense model's loss the same as in
    one batch), and its backward: (loss, metrics, {Hugging Face name: gradient})."""
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    from models.layout import split_fused
    from models.lora import LoraSettings
    from tests.lora_reference import adapter_values, hf_name_of_peft, peft_model, pipeline_layout
    from tests.parity_worker import per_layer_grads

    if lora_rank:
        lora = LoraSettings(rank=lora_rank)
        policy = peft_model(model["hf"], lora, adapter_values(AutoConfig.from_pretrained(model["hf"]), lora, seed=7,
                                                              nonzero_b=True))
    else:
        policy = AutoModelForCausalLM.from_pretrained(model["hf"], dtype=torch.float32, attn_implementation="eager")
    common = dict(model=policy, processing_class=AutoTokenizer.from_pretrained(model["hf"]),
                  train_dataset=Dataset.from_list(model["records"][:pairs]))
    settings = dict(output_dir=str(output_dir), max_length=SEQ, use_cpu=True, bf16=False, report_to=[],
                    disable_tqdm=True)
    if objective == "simpo":
        trainer = CPOTrainer(**common, args=CPOConfig(**settings, loss_type="simpo", cpo_alpha=0.0, beta=SIMPO_BETA,
                                                      simpo_gamma=SIMPO_GAMMA))
        examples, compute_loss = list(trainer.train_dataset), trainer.compute_loss
        logged = trainer._stored_metrics["train"]
    else:
        trainer = DPOTrainer(**common, args=DPOConfig(**settings, beta=BETA, precompute_ref_log_probs=True))
        examples = [{**trainer.train_dataset[i], "ref_chosen_logps": c, "ref_rejected_logps": r}
                    for i, (c, r) in enumerate(FIRST_STEP_REFERENCE[:pairs])]
        compute_loss, logged = trainer._compute_loss, trainer._metrics["train"]
    trainer.model.train()
    count, loss = pairs // MICRO_BATCH, 0.0
    for start in range(0, pairs, MICRO_BATCH):
        batch = trainer.data_collator(examples[start:start + MICRO_BATCH])
        micro_batch_loss = compute_loss(trainer.model, batch, return_outputs=False) / count
        micro_batch_loss.backward()
        loss += micro_batch_loss.item()
    metrics = {name: sum(values[-count:]) / count for name, values in logged.items()}
    grads = split_fused({hf_name_of_peft(n): p.grad for n, p in trainer.model.named_parameters() if p.requires_grad},
                        trainer.model.config)  # Phi-3's fused weights (and adapters) as the pipeline's parts
    if lora_rank:  # a mixture of experts' adapters on its experts as the pipeline holds them
        grads = pipeline_layout(grads, trainer.model.config, lora)
    if trainer.model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return loss, metrics, per_layer_grads(grads, trainer.model.config)  # Gemma 4's PLE as each layer's share


def assert_first_step_matches_trl(model, root, case, world_size, data_parallel, lora_rank=0, objective="dpo",
                                  grad_tolerance=1e-5):
    """Every rank's first-step gradients within grad_tolerance of TRL's (relative to the largest element; under
    tensor parallelism against the rank's slice), every gradient compared somewhere; the loss and metrics within
    1e-5."""
    from tests.parity_worker import per_layer_norm_copies
    loss, metrics, grads = trl_first_step(model, lora_rank, data_parallel * MICRO_BATCH * GAS, root / f"{case}-trl",
                                          objective)
    compared, bad = set(), {}
    for rank in range(world_size):
        result = torch.load(root / f"{case}-rank{rank}.pt", weights_only=False)
        assert result["loss"] == pytest.approx(loss, abs=1e-5), (case, rank)
        for name in METRICS:
            assert result["metrics"][name] == pytest.approx(metrics[name], abs=1e-5, rel=1e-6), (case, name)
        tp_rank, tp_size = result["tensor_parallel"]
        for name, (grad, dim) in result["grads"].items():
            ref = grads[name] if dim is None else grads[name].chunk(tp_size, dim)[tp_rank]
            error = ((grad - ref).abs().max() / ref.abs().max()).item()
            if not error < grad_tolerance:
                bad[(rank, name)] = error
            compared.add(name)
    assert not bad, (case, bad)
    copies = per_layer_norm_copies(grads)  # compared on one layer of the stage
    assert compared | copies == set(grads) and bool(copies) == bool(compared & copies), (case, set(grads) - compared)


def launch_two_nodes(settings, timeout=600):
    """tests/two_node_worker.py as a job of 2 nodes x 2 ranks on this machine: each node a PID namespace (the node's
    process pid 1, its ranks 2 and 3, the same on both nodes, as containers on two hosts give them) on the host's
    network, so that gloo's rendezvous on 127.0.0.1 connects; the nodes forked from the rank zygote."""
    import sys

    from tests.distributed import free_port
    from tests.launch import process_environment, run_processes
    env = process_environment("cpu", dict(WORLD_SIZE="4", LOCAL_SIZE="2", CROSS_SIZE="2", MASTER_ADDR="127.0.0.1",
                                          MASTER_PORT=str(free_port())))
    run_processes([sys.executable, "-m", "tests.two_node_worker", "node", json.dumps(settings)],
                  [dict(env, CROSS_RANK=str(node)) for node in range(2)], timeout, kill_peers=False)


def disk_paths(root):
    return {str(path.relative_to(root)): path for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.mark.slow
def test_two_nodes_whose_ranks_share_pids_write_each_shared_file_once_and_whole(preference_model, two_stage_runs,
                                                                                tmp_path):
    """2 nodes x 2 ranks (two PID namespaces: rank 0 and rank 2 have one pid, as do ranks 1 and 3) on one shared
    directory: the tokenized cache, the DPO reference log-probabilities and a token-shard index come out whole, with
    no temporary file left, byte for byte those of a one-node run (two_stage_runs' DPO run: the same layout, 2
    stages x 2 data-parallel; the index built in this process)."""
    import subprocess

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from transformers import AutoTokenizer

    from data.indexed import prepare_indices
    from data.shard_files import check_sources, parse_sources
    from tests.test_checkpointing import disk_state
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("PID namespaces need unshare as root")
    shared, logs = tmp_path / "shared", tmp_path / "logs"
    logs.mkdir()
    builder = IndexedDatasetBuilder(str(tmp_path / "shards.bin"), dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(60):  # Megatron's shards: no PREFIX.json, so rank 0 also scans the token range
        document = rng.integers(0, 100, rng.integers(5, 40)).astype(np.int32)
        builder.add_document(document, [len(document)])
    builder.finalize(str(tmp_path / "shards.idx"))
    vocab_size = len(AutoTokenizer.from_pretrained(preference_model["hf"]))
    settings = {"out": str(logs), "shards": str(tmp_path / "shards"), "index_dir": str(shared / "index"),
                "vocab_size": vocab_size, "overrides": trainer_overrides(preference_model, shared / "run", num_stages=2,
                                                                        zero_stage=1, max_steps=1)}
    launch_two_nodes(settings)
    ranks = [json.loads((logs / f"rank{r}.json").read_text()) if (logs / f"rank{r}.json").exists() else
             pytest.fail((logs / f"rank{r}.log").read_text()[-3000:]) for r in range(4)]
    assert ranks[0]["pid"] == ranks[2]["pid"] and ranks[1]["pid"] == ranks[3]["pid"]
    assert all(rank["samples"] == ranks[0]["samples"] for rank in ranks)
    assert not [path for path in shared.rglob("*") if path.name.endswith(".tmp")]
    # the tokenized cache and the reference: the one-node run's files, names (the cache key) and bytes
    one_node, two_nodes = ({name: path for name, path in disk_paths(out / "data_cache").items()
                            if not name.startswith("raw/")} for out in (two_stage_runs["dpo"], shared / "run"))
    assert sorted(one_node) == sorted(two_nodes)
    assert any(name.endswith(".arrow") for name in one_node) and any("-reference" in name for name in one_node)
    for name, path in one_node.items():
        if name.endswith((".arrow", ".pt")):
            assert two_nodes[name].read_bytes() == path.read_bytes(), name
    assert torch.load(next(p for n, p in two_nodes.items() if "-reference" in n))["chosen"].shape
    # the shard index: as one process builds it
    sources = parse_sources(str(tmp_path / "shards"), "train_file")
    prepare_indices(sources, check_sources(sources, "train_file", vocab_size, None, 16), seed=0, seq_length=16,
                    total_samples=200, blend_dir=tmp_path / "one_node", vocab_size=vocab_size,
                    index_dir=tmp_path / "one_node")
    assert disk_state(shared / "index") == disk_state(tmp_path / "one_node")


@pytest.mark.slow
def test_first_step_gradients_equal_trl(preference_model, one_process_runs, two_stage_runs):
    """Every gradient of the first step within 1e-5 of TRL's, with reference log-probabilities that weigh each
    pair differently; the loss and rewards within 1e-5: 1 stage with full weights and LoRA, 2 stages x 2
    data-parallel, 1 stage x tensor parallel 2 x 2 data-parallel."""
    root = one_process_runs["root"]
    assert_first_step_matches_trl(preference_model, root, "full", 1, 1)
    assert_first_step_matches_trl(preference_model, root, "lora", 1, 1, lora_rank=LORA_RANK)
    root = two_stage_runs["root"]
    assert_first_step_matches_trl(preference_model, root, "2stages_2dp", 4, 2)
    assert_first_step_matches_trl(preference_model, root, "tp2_2dp", 4, 2)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_gradients_equal_trl_for_each_family(family, family_preference_models, one_process_runs):
    """Each other family (Qwen3, Phi-3, OLMo 2, Granite 3, SmolLM3, Gemma 3, Gemma 4): DPO's first-step loss,
    rewards and every gradient within 1e-5 of TRL's (Gemma 4's within 1e-4: FAMILY_GRAD_TOLERANCES) on 1 stage with
    full weights and with LoRA (Phi's on its fused projections, as peft; Gemma's log-probabilities of their soft-capped
    logits). DPO under tensor parallelism: LLaMA's (test_first_step_gradients_equal_trl); each family's layers
    under it (Granite's logit scaling in the vocabulary-parallel head, OLMo 2's projection norms across the group):
    tests/test_tensor_parallel.py."""
    model, tolerance = family_preference_models[family], FAMILY_GRAD_TOLERANCES.get(family, 1e-5)
    assert_first_step_matches_trl(model, one_process_runs["root"], f"{family}-full", 1, 1, grad_tolerance=tolerance)
    assert_first_step_matches_trl(model, one_process_runs["root"], f"{family}-lora", 1, 1, lora_rank=LORA_RANK,
                                  grad_tolerance=tolerance)


# --- data and config checks (in process, no training) ---------------------------------------------------------------

CONVERSATION_PAIRS = [
    {"prompt": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Capital of France?"}],
     "chosen": [{"role": "assistant", "content": "Paris."}],
     "rejected": [{"role": "assistant", "content": "The capital of France is Paris. " * 6}]},
    {"prompt": [{"role": "user", "content": "Count to five, please."}],
     "chosen": [{"role": "assistant", "content": "One, two, three, four, five."}],
     "rejected": [{"role": "assistant", "content": "No."}]},
]
IMPLICIT_PAIRS = [{"chosen": pair["prompt"] + pair["chosen"], "rejected": pair["prompt"] + pair["rejected"]}
                  for pair in CONVERSATION_PAIRS]  # the prompt inside both conversations (TRL's implicit prompt)
STRING_PAIRS = [{"prompt": "What is the capital of France?", "chosen": " Paris.", "rejected": " Rome."},
                {"prompt": "Tell me a short story", "chosen": " about a cat.",
                 "rejected": " Once upon a time the small cat found a red ball in the garden." * 3}]


def write_pairs(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build_pairs(path, tokenizer, tmp_path, seq_length=64, **data):
    from data import build_dataset
    return build_dataset(path, tokenizer, {"format": "preference", **data}, seq_length, cache_dir=tmp_path / "cache")


FAMILY_STYLES = ("qwen3", "phi3", "phi4", "olmo2", "granite", "smollm3")  # tests/chat_tokenizers.py


@pytest.mark.parametrize("style,records", [("llama3", CONVERSATION_PAIRS), ("chatml", CONVERSATION_PAIRS),
                                           ("llama3", IMPLICIT_PAIRS), ("llama3", STRING_PAIRS),
                                           *((style, CONVERSATION_PAIRS) for style in FAMILY_STYLES)],
                         ids=["llama3_chat", "chatml_chat", "implicit_prompt", "strings",
                              *(f"{style}_chat" for style in FAMILY_STYLES)])
def test_pairs_are_tokenized_as_trl_prepares_them(style, records, tmp_path):
    """Each pair's two sequences and labels are TRL's DPOTrainer's (its own dataset preparation: prompt_ids,
    chosen_ids, rejected_ids, truncated to max_length), for conversations with the chat templates of LLaMA-3, Qwen2,
    Qwen3 (a think block in the response), Phi-3 (eos closing it), Phi-4, OLMo 2, Granite 3 and SmolLM3,
    conversations holding their prompt (TRL's extract_prompt) and strings."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from tests.chat_tokenizers import make_chat_tokenizer
    tokenizer = make_chat_tokenizer(style)
    seq_length = 184 if style == "smollm3" else 48  # cuts the longer responses (SmolLM3: a prompt of 176)
    dataset, stats = build_pairs(write_pairs(tmp_path / "pairs.jsonl", records), tokenizer, tmp_path, seq_length)
    trainer = DPOTrainer.__new__(DPOTrainer)
    trainer._tokenizer = tokenizer
    prepared = trainer._prepare_dataset(Dataset.from_list(records), tokenizer,
                                        DPOConfig(output_dir=str(tmp_path / "trl"), max_length=seq_length,
                                                  report_to=[], use_cpu=True), "train")
    assert len(dataset) == len(prepared) == len(records)
    assert stats.truncated >= 1
    for row, trl in zip(dataset, prepared):
        for side in ("chosen", "rejected"):
            sequence = (trl["prompt_ids"] + trl[f"{side}_ids"])[:seq_length]
            assert row[f"{side}_input_ids"] == sequence
            assert row[f"{side}_labels"] == [-100] * len(trl["prompt_ids"]) + sequence[len(trl["prompt_ids"]):]


def test_bad_pairs_are_named_or_skipped(tmp_path):
    from tests.chat_tokenizers import make_chat_tokenizer
    tokenizer = make_chat_tokenizer("llama3")
    good = STRING_PAIRS[0]
    cases = {  # record: what the error says
        "missing": ({"prompt": "Hi", "chosen": " Yes."}, "line 2: malformed JSON line \\(field 'rejected' missing"),
        "same": ({"prompt": "Hi", "chosen": " Yes.", "rejected": " Yes."},
                 "line 2: bad preference example \\('chosen' and 'rejected' are the same"),
        "mixed": ({"prompt": "Hi", "chosen": [{"role": "assistant", "content": "Yes."}], "rejected": " No."},
                  "line 2: bad preference example \\('prompt', 'chosen' and 'rejected' must be all strings or all"),
        "empty": ({"prompt": "Hi", "chosen": "", "rejected": " No."}, "line 2: bad preference example \\(empty chosen"),
        "prompt_not_shared": ({"chosen": [{"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": "Yes."}],
                               "rejected": [{"role": "user", "content": "Ho"},
                                            {"role": "assistant", "content": "No."}]},
                              "line 2: bad preference example \\(no 'prompt', and 'chosen' and 'rejected' do not"),
    }
    for name, (record, message) in cases.items():
        path = write_pairs(tmp_path / f"{name}.jsonl", [good, record, good])
        with pytest.raises(ValueError, match=message):
            build_pairs(path, tokenizer, tmp_path)
        dataset, stats = build_pairs(path, tokenizer, tmp_path, bad_lines="skip")
        assert (len(dataset), stats.bad_lines_skipped) == (2, 1), name
    # after truncation: a prompt that fills seq_length, responses the same within it
    long_prompt = {"prompt": " ".join(["the cat"] * 20), "chosen": " Yes.", "rejected": " No."}
    shared_start = {"prompt": "Hi", "chosen": " the cat the cat the cat the cat the cat the cat the cat. Yes.",
                    "rejected": " the cat the cat the cat the cat the cat the cat the cat. No."}
    for record, message in ((long_prompt, "example 1: its prompt of \\d+ tokens leaves no response token within "
                                          "seq_length=12"),
                            (shared_start, "example 1: its chosen and rejected responses are the same within "
                                           "seq_length=12")):
        path = write_pairs(tmp_path / "cut.jsonl", [good, record])
        with pytest.raises(ValueError, match=message):
            build_pairs(path, tokenizer, tmp_path, seq_length=12)
        dataset, stats = build_pairs(path, tokenizer, tmp_path, seq_length=12, bad_lines="skip")
        assert (len(dataset), stats.dropped_pairs) == (1, 1)


def test_conversations_without_a_chat_template_name_the_key(tmp_path):
    from tests.chat_tokenizers import make_chat_tokenizer
    tokenizer = make_chat_tokenizer("llama3")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template .* data.chat_template=PATH"):
        build_pairs(write_pairs(tmp_path / "pairs.jsonl", CONVERSATION_PAIRS), tokenizer, tmp_path)


@pytest.mark.parametrize("overrides,message", [
    (["objective=dpo"], "objective=dpo trains on preference pairs: set data.format=preference"),
    (["data.format=preference"], "data.format=preference holds pairs: set objective=dpo"),
    (["objective=dpo", "data.format=preference", "data.packing=true"], "data.format=preference with data.packing=true"),
    (["objective=dpo", "data.format=preference", "loss_impl=logits"], "preference losses run on the chunked head"),
    (["objective=dpo", "data.format=preference", "dpo.beta=0"], "dpo.beta=0 must be a positive number"),
    (["objective=dpo", "data.format=preference", "dpo.loss_type=ipo"], "dpo.loss_type='ipo' is not one of sigmoid"),
    (["objective=kto"], "objective='kto' is not one of sft, dpo, simpo"),
], ids=["dpo_on_text", "pairs_without_objective", "packing", "logits_head", "beta", "loss_type",
        "objective"])
def test_preference_config_errors_name_the_key(overrides, message):
    from errors import ConfigError
    from tests.helpers import compose_config
    from training.config_checks import checked_config
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match=message):
        checked_config(cfg)

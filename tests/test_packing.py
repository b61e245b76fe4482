"""Packed rows with per-document isolation against transformers on each example alone (real processes, gloo):
the token-weighted eval loss (evaluation/eval_set.py) and the training gradients, for 1 stage x 2 data-parallel,
2 stages, and 1 stage x tensor parallel 2 with sequence parallelism, in one launch of 2 processes; every other
family on the last (its norms split by tokens, Phi's fused weights split by heads), Gemma 3 and 4 (the MoE block
included) on 2 stages or the last. Mixtures of experts in the same
launch against transformers on each micro-batch's documents flattened into one row (DataCollatorWithFlattening),
whose load-balancing loss counts every token of the micro-batch."""
import json
import math
import random
from types import SimpleNamespace

import pytest

from data import build_dataset
from tests.distributed import ProcessGroupPool, spawn
from tests.parity_worker import CHUNK_TOKENS

SEQ, MICRO_BATCH, GAS = 32, 2, 2
TOPOLOGIES = {"1stage_x_2dp": (1, 1), "2stages": (2, 1), "1stage_x_tp2": (1, 2)}  # name: (stages, tensor parallel)
# {model: its topologies}. Mistral: a sliding window (8) inside the longer packed documents; Qwen2 one on its last
# layers; SmolLM3: layers without rotary embedding, for which positions restarting per document change nothing.
PACKED_MODELS = {"llama3": tuple(TOPOLOGIES), "mistral": tuple(TOPOLOGIES),
                 **dict.fromkeys(("qwen2", "qwen3", "olmo2", "granite", "smollm3", "phi3"), ("1stage_x_tp2",))}
# Gemma's own layers (tests/tiny_models.py LAYER_TYPE_CONFIGS: sliding windows of 4 inside the packed documents, the
# soft cap): Gemma 4 E2B-like on 2 stages (its per-layer embeddings, its reusing layers on the stage after their
# sources'), Gemma 3 and the 26B-A4B-like MoE (no load-balancing loss: each document alone routes as in the row)
# under tensor parallelism.
PACKED_LAYER_TYPES = {"gemma4_e2b": ("2stages",), "gemma3_text": ("1stage_x_tp2",), "gemma4_26b_a4b": ("1stage_x_tp2",)}
# The packed rows the parity checks take (training on their first): those of several documents, then single documents
# of 29 tokens, one beside a short one. Eleven leave every layout's last eval micro-batch a padding row and, on 2
# replicas, its last accumulation window short (the rest, more documents of the same kinds, cost 2 more eval_batch calls
# a case and changed no check).
EVAL_ROWS = 11
# Mixtures of experts, on 2 stages (one replica: every eval micro-batch is MICRO_BATCH rows in order). Mixtral: a
# window (8) on every layer; Qwen3-MoE a dense layer among sparse ones. Their load-balancing loss is on.
PACKED_MOE = {"mixtral": ("2stages",), "qwen3_moe": ("2stages",)}


def micro_batches(rows, dp_size, dp_rank):
    """Rows 0..(GAS * dp_size * MICRO_BATCH): micro-batch (step * dp_size + dp_rank) for each step."""
    from data.collator import collate_causal_lm
    for step in range(GAS):
        start = (step * dp_size + dp_rank) * MICRO_BATCH
        yield collate_causal_lm(rows[start:start + MICRO_BATCH], SEQ, pad_id=0)


def documents(row):
    """(input_ids, labels) of each document of a packed row."""
    start = 0
    for length in row["lengths"]:
        yield row["input_ids"][start:start + length], row["labels"][start:start + length]
        start += length


def hf_loss_sum_and_count(model, ids, labels):
    """transformers' model on one document alone: summed next-token cross-entropy and its token count."""
    import torch
    import torch.nn.functional as F
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    targets = torch.tensor(labels[1:])
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"), int((targets != -100).sum())


def hf_reference(hf_dir, rows, num_micro_batches):
    """(token-weighted loss over every document of `rows`, the cross-entropy its perplexity is of (the same for a
    dense model), the gradients of the training objective (the mean over the first num_micro_batches micro-batches of
    their token-weighted mean), that objective), each document run alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.layout import split_fused  # Phi-3's fused weights as the pipeline's parts
    from tests.parity_worker import per_layer_grads  # Gemma 4's per-layer embeddings as each layer's share
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    trained = num_micro_batches * MICRO_BATCH  # the rows the objective takes, each document run once for both
    scored = [[hf_loss_sum_and_count(model, ids, labels) for ids, labels in documents(row)] for row in rows[:trained]]
    with torch.no_grad():
        scored += [[hf_loss_sum_and_count(model, ids, labels) for ids, labels in documents(row)]
                   for row in rows[trained:]]
    sums, counts = zip(*(document for row in scored for document in row))
    eval_loss = (sum(s.detach() for s in sums) / sum(counts)).item()
    objective = 0
    for index in range(num_micro_batches):
        sums, counts = zip(*(document for row in scored[index * MICRO_BATCH:(index + 1) * MICRO_BATCH]
                             for document in row))
        objective = objective + sum(sums) / sum(counts)
    objective = objective / num_micro_batches
    objective.backward()
    grads = per_layer_grads(split_fused({n: p.grad for n, p in model.named_parameters()}, model.config), model.config)
    return eval_loss, eval_loss, grads, objective.item()


def flattened(rows):
    """transformers' padding-free batch of packed rows (DataCollatorWithFlattening): their documents one after
    another in one row, positions restarting with each, -100 as each document's first label, no attention mask."""
    from transformers import DataCollatorWithFlattening
    features = [{"input_ids": ids, "labels": labels} for row in rows for ids, labels in documents(row)]
    return DataCollatorWithFlattening(return_tensors="pt")(features)


def hf_moe_reference(hf_dir, rows, num_micro_batches):
    """A mixture of experts on 2 stages (one replica): the token-weighted outputs.loss (cross-entropy plus the
    load-balancing term) over the eval micro-batches of `rows`, their token-weighted cross-entropy, the gradients of
    the training objective (the mean of the first num_micro_batches micro-batches' outputs.loss) and that objective,
    each micro-batch's documents flattened into one row."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    coef, objective, totals = model.config.router_aux_loss_coef, 0, torch.zeros(3, dtype=torch.float64)
    for index, start in enumerate(range(0, len(rows), MICRO_BATCH)):
        batch = flattened(rows[start:start + MICRO_BATCH])
        with torch.set_grad_enabled(index < num_micro_batches):
            outputs = model(**batch, use_cache=False)  # no cache, as in training: else no packing is seen
        assert outputs.aux_loss is not None
        count = int((batch["labels"][:, 1:] != -100).sum())
        loss = outputs.loss.detach().double()
        totals += torch.stack([loss * count, (loss - coef * outputs.aux_loss.detach()) * count,
                               torch.tensor(count, dtype=torch.float64)])
        if index < num_micro_batches:
            objective = objective + outputs.loss / num_micro_batches
    objective.backward()
    return ((totals[0] / totals[2]).item(), (totals[1] / totals[2]).item(),
            {n: p.grad for n, p in model.named_parameters()}, objective.item())


def recording_engine(module, ds_dir):
    """A DeepSpeed engine over `module` with its converted weights, whose optimizer records the gradients of one
    step of GAS micro-batches (no clipping)."""
    import deepspeed

    from tests.parity_worker import GradientRecorder
    optimizer = GradientRecorder(module.parameters())
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GAS,
        "steps_per_print": 10**9, "gradient_clipping": 0.0,
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}})
    engine.load_checkpoint(ds_dir, load_module_only=True)
    return engine, optimizer


def packed_parity_worker(rank, cases, rows, out_dir):
    """cases: (model, hf_dir, ds_dir, topology name) each."""
    import torch
    from transformers import AutoConfig

    from checkpoints.layer_files import load_layer_slice
    from engines.pipeline_engine import use_one_backward
    from models.pipeline import build_pipeline_module
    from tests.parity_worker import gradient_errors
    from cluster.distributed import init_distributed, parallel_topology
    from evaluation.eval_set import evaluate

    init_distributed(timeout_minutes=2)
    references = torch.load(f"{out_dir}/references.pt", weights_only=True)
    results = {}
    for model, hf_dir, ds_dir, topology in ProcessGroupPool().runs(cases):  # the engines share their groups
        stages, tensor_parallel = TOPOLOGIES[topology]
        config = AutoConfig.from_pretrained(hf_dir)
        module = build_pipeline_module(config, parallel_topology(stages, tensor_parallel), sequence_parallel=True,
                                       layer_loader=load_layer_slice, loss_chunk_tokens=CHUNK_TOKENS)
        # the trainer's engine: a mixture's expert gradients summed over the tensor-parallel group at the step's end
        engine, optimizer = recording_engine(module, ds_dir)
        use_one_backward(engine)
        reads_data = engine.is_first_stage() or engine.is_last_stage()
        cfg = SimpleNamespace(micro_batch_size=MICRO_BATCH, seq_length=SEQ, gradient_accumulation_steps=GAS,
                              tensor_parallel_size=tensor_parallel)
        eval_loss, eval_ppl = evaluate(engine, rows if reads_data else None, len(rows), cfg, pad_id=0)
        dp_size = engine.grid.get_data_parallel_world_size()
        engine.train_batch(micro_batches(rows, dp_size, engine.grid.data_parallel_id))
        ref_loss, ref_cross_entropy, ref_grads, _ = references[f"{model}/{topology}"]
        grad_errors = gradient_errors(module, optimizer.recorded, ref_grads, config.num_hidden_layers, engine)
        results[f"{model}/{topology}"] = {"eval_loss": eval_loss, "ref_loss": ref_loss, "grad_errors": grad_errors,
                                          "eval_ppl": eval_ppl, "ref_ppl": math.exp(ref_cross_entropy)}
        torch.distributed.barrier()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


def hf_references(cases, rows, world_size):
    """{model/topology: hf_reference over the topology's replicas' micro-batches}, computed once here for all the
    ranks (and the topologies with as many replicas)."""
    by_inputs, references = {}, {}
    for model, hf_dir, _, topology in cases:
        replicas = world_size // math.prod(TOPOLOGIES[topology])
        reference = hf_moe_reference if model in PACKED_MOE else hf_reference
        if (model, replicas) not in by_inputs:
            by_inputs[model, replicas] = reference(hf_dir, rows, GAS * replicas)
        references[f"{model}/{topology}"] = by_inputs[model, replicas]
    return references


def packed_rows(tmp_path):
    """40 pre-tokenized examples of skewed lengths (mostly short, a few close to SEQ) packed into rows of SEQ, rows
    of several documents first (best fit puts the long examples first); and the packing statistics."""
    rng = random.Random(0)
    lengths = [rng.choice([3, 4, 5, 6, 8, 10, 12, 29, 31]) for _ in range(40)]
    records = [{"input_ids": [rng.randrange(96) for _ in range(n)]} for n in lengths]
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    packed, stats = build_dataset(path, None, {"format": "pretokenized", "packing": True}, SEQ,
                                  cache_dir=tmp_path / "cache", vocab_size=96)
    return packed.to_list()[::-1], stats


@pytest.mark.slow
def test_packed_rows_match_transformers_on_each_example(tiny_checkpoints, tiny_moe_checkpoints,
                                                        tiny_layer_type_checkpoints, tmp_path):
    """The eval loss, its perplexity (of the cross-entropy: a mixture of experts' loss holds its load-balancing
    term, its perplexity does not) and the gradients."""
    import torch
    rows, stats = packed_rows(tmp_path)
    assert stats.packed_from == 40 and len(rows) < 40 and any(len(r["lengths"]) > 2 for r in rows[:GAS * 2 * 2])
    rows = rows[:EVAL_ROWS]
    checkpoints = {**tiny_checkpoints, **tiny_moe_checkpoints, **tiny_layer_type_checkpoints}
    cases = [(model, *checkpoints[model], topology)
             for model, topologies in {**PACKED_MODELS, **PACKED_LAYER_TYPES, **PACKED_MOE}.items()
             for topology in topologies]
    torch.save(hf_references(cases, rows, 2), tmp_path / "references.pt")
    spawn(packed_parity_worker, 2, cases, rows, str(tmp_path))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    names = [f"{model}/{topology}" for model, _, _, topology in cases]
    assert all(sorted(rank) == sorted(names) for rank in ranks)
    for name in names:
        for result in (rank[name] for rank in ranks):
            assert result["eval_loss"] == pytest.approx(result["ref_loss"], abs=1e-5), name
            assert result["eval_ppl"] == pytest.approx(result["ref_ppl"], rel=1e-5), name
            bad = {n: e for n, e in result["grad_errors"].items() if not e < 1e-4}
            assert not bad, f"{name}: gradients differ from transformers on each example alone: {bad}"


@pytest.mark.slow
def test_trainer_eval_only_on_packed_chat_equals_transformers_per_conversation(demo_model, tmp_path):
    """trainer_pipe.py through the launcher, data.format=chat with a template file and packing: its eval_loss is
    transformers' token-weighted loss over the assistant tokens of each conversation run alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.chat_tokenizers import write_chat_files
    from tests.launch import check_ok, demo_overrides, launch_trainer, read_metrics

    data, template = write_chat_files(tmp_path, 12)
    out = tmp_path / "run"
    check_ok(launch_trainer(1, demo_overrides(
        demo_model, out, num_stages=1, eval_only="true", eval_file=data, micro_batch_size=2, seq_length=512,
        **{"data.format": "chat", "data.chat_template": template, "data.packing": "true",
           "data.cache_dir": tmp_path / "cache"})))
    (record,) = [r for r in read_metrics(out) if "eval_loss" in r]

    tokenizer = AutoTokenizer.from_pretrained(demo_model["hf"])
    unpacked, _ = build_dataset(data, tokenizer, {"format": "chat", "chat_template": str(template)}, 512,
                                cache_dir=tmp_path / "cache")
    model = AutoModelForCausalLM.from_pretrained(demo_model["hf"], dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in unpacked:
            loss_sum, n = hf_loss_sum_and_count(model, row["input_ids"], row["labels"])
            total, count = total + loss_sum.item(), count + n
    assert len(unpacked) == 12 and count > 100 and record["eval_examples"] < 12  # the trainer's rows were packed
    assert record["eval_loss"] == pytest.approx(total / count, abs=1e-5)

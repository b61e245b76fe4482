"""The cost model and the partitions built from it (fast: no processes, nothing of model size is built)."""
import dataclasses
import functools

import pytest
import torch
from transformers import GraniteConfig, LlamaConfig, Olmo2Config, Phi3Config, Qwen3Config, SmolLM3Config

from models.layout import num_pipeline_layers
from models.attention import StageAttentionInputs
from models.loss import CausalLMLoss
from models.partition import DECODER, HEAD, NORM, balanced_decoder_counts, stage_bounds
from models.pipeline import build_pipeline_layers, partition_stages
from models.pipeline_layers import DecoderLayerPipe, FinalNormPipe, LMHeadPipe, StagePlan
from models.tensor_parallel import TensorParallel
from models.weight_grads import WeightGradQueue
from planner.stage_costs import LayerCosts, balanced_stage_cost, compute_spread, stage_plan
from planner.workload import Workload
from tests.helpers import compose_config
from training.run_spec import plan_spec

# Published sizes (config.json of meta-llama/Llama-2-7b-hf, Meta-Llama-3.1-8B, llama-65b).
PUBLISHED = {
    "llama_7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                            rms_norm_eps=1e-5),
    "llama3_8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                             rms_norm_eps=1e-5),
    "llama_65b": LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=22016, num_hidden_layers=80,
                             num_attention_heads=64, num_key_value_heads=64, max_position_embeddings=2048,
                            rms_norm_eps=1e-6),
    # Qwen/Qwen3-8B, microsoft/phi-4, allenai/OLMo-2-1124-7B, ibm-granite/granite-3.3-8b-instruct,
    # HuggingFaceTB/SmolLM3-3B.
    "granite3_8b": GraniteConfig(vocab_size=49159, hidden_size=4096, intermediate_size=12800, num_hidden_layers=40,
                                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                 rms_norm_eps=1e-5, embedding_multiplier=12.0,
                                 residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0,
                                 tie_word_embeddings=True),
    "smollm3_3b": SmolLM3Config(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536,
                                rms_norm_eps=1e-6, no_rope_layer_interval=4,
                                tie_word_embeddings=True),
    "qwen3_8b": Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                            rms_norm_eps=1e-6, tie_word_embeddings=False),
    "phi4_14b": Phi3Config(vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                           num_attention_heads=40, num_key_value_heads=10, max_position_embeddings=16384,
                           original_max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "olmo2_7b": Olmo2Config(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                            rms_norm_eps=1e-6, tie_word_embeddings=False),
}
# The world size each config's header comment launches.
WORLD_SIZE = {"llama_7b": 8, "llama3_8b": 8, "llama_65b": 16, "qwen3_8b": 8, "phi4_14b": 8, "olmo2_7b": 8,
              "granite3_8b": 8, "smollm3_3b": 8}


def run_config(name):
    return compose_config(config=name)


def configured_plan(name, partition=None):
    cfg = run_config(name)
    config = PUBLISHED[name]
    workload = plan_spec(cfg, WORLD_SIZE[name]).workload
    bounds = bounds_for(config, cfg.num_stages, partition or cfg.partition, workload)
    return cfg, bounds, stage_plan(config, bounds, workload)


def bounds_for(config, num_stages, partition, workload):
    return partition_stages(config, num_stages, partition, balanced_stage_cost(config, workload, num_stages, 80 * 2**30))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_balanced_stages_compute_within_15_percent_and_fit(name):
    cfg, bounds, rows = configured_plan(name)
    assert cfg.partition == "balanced"
    assert len(rows) == cfg.num_stages
    assert compute_spread(rows) <= 1.15, [round(row["compute"], 2) for row in rows]
    assert max(row["memory_bytes"] for row in rows) <= cfg.device_memory_gb * 2**30


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_run_configs_carry_the_published_sizes(name):
    model_config = run_config(name).model_config
    for key, value in model_config.items():
        if key != "model_type":
            assert getattr(PUBLISHED[name], key) == pytest.approx(value), key


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("other", ["parameters", "uniform", "type:decoderlayer"])
def test_balanced_has_the_smallest_largest_stage_compute(name, other):
    _, _, balanced = configured_plan(name)
    _, _, alternative = configured_plan(name, partition=other)
    assert max(row["compute"] for row in balanced) <= max(row["compute"] for row in alternative)


# Granite 3.3's vocabulary (49159 rows) splits over no tensor-parallel size: refused at start-up (below).
@pytest.mark.parametrize("name", sorted(set(PUBLISHED) - {"granite3_8b"}))
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_balanced_stays_balanced_under_tensor_parallelism(name, sequence_parallel):
    cfg, config = run_config(name), PUBLISHED[name]
    tensor_parallel = 2 if name == "phi4_14b" else 4  # Phi-4's 10 key/value heads split over 2, not 4
    workload = dataclasses.replace(plan_spec(cfg, WORLD_SIZE[name]).workload, tensor_parallel=tensor_parallel,
                                   sequence_parallel=sequence_parallel)
    plans = {method: stage_plan(config, bounds_for(config, cfg.num_stages, method, workload), workload)
             for method in ("balanced", "parameters", "uniform")}
    assert compute_spread(plans["balanced"]) <= 1.15
    assert max(row["compute"] for row in plans["balanced"]) <= min(max(row["compute"] for row in plans[method])
                                                                for method in ("parameters", "uniform"))


@pytest.mark.parametrize("name", sorted(set(PUBLISHED) - {"smollm3_3b"}))  # SmolLM3's: 2 stages, no middle one
def test_first_and_last_stage_get_no_extra_layer(name):
    _, _, rows = configured_plan(name)
    counts = [row["decoder_layers"] for row in rows]
    assert counts[0] <= min(counts[1:-1]) and counts[-1] <= min(counts[1:-1]), counts


def test_uneven_layers_go_to_middle_stages():
    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=10,
                         num_attention_heads=4)
    cost = balanced_stage_cost(config, Workload(seq_length=64, activation_checkpoint_interval=1), 4)
    assert balanced_decoder_counts(10, 4, cost) == [2, 3, 3, 2]


def assert_valid_bounds(bounds, num_stages, num_hidden_layers):
    assert len(bounds) == num_stages + 1
    assert bounds[0] == 0 and bounds[-1] == num_pipeline_layers(num_hidden_layers)
    assert all(start < stop for start, stop in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_balanced_bounds_are_valid_and_keep_embedding_and_head_at_the_ends(name):
    cfg, bounds, rows = configured_plan(name)
    layers = PUBLISHED[name].num_hidden_layers
    assert_valid_bounds(bounds, cfg.num_stages, layers)
    assert all(row["decoder_layers"] >= 1 for row in rows)
    assert sum(row["decoder_layers"] for row in rows) == layers
    assert bounds[1] >= 2 and bounds[-2] <= layers  # the embedding has a decoder with it; so has norm + head


def test_explicit_bounds():
    config = PUBLISHED["llama_7b"]
    bounds = stage_bounds(config, 4, [6, 10, 10, 6], [])
    assert_valid_bounds(bounds, 4, 32)
    assert bounds == [0, 7, 17, 27, 35]
    with pytest.raises(ValueError, match="summing to num_hidden_layers"):
        stage_bounds(config, 4, [6, 10, 10, 5], [])
    with pytest.raises(ValueError, match="3 entries for 4 stages"):
        stage_bounds(config, 4, [10, 12, 10], [])


def test_deepspeed_methods_match_the_parity_tests_expectations():
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    class_names = [spec.typename.__name__ for spec in build_pipeline_layers(config)]
    assert stage_bounds(config, 2, "uniform", class_names) == [0, 4, 7]
    assert stage_bounds(config, 2, "type:decoderlayer", class_names) == [0, 3, 7]
    with pytest.raises(ValueError, match="matches none"):
        stage_bounds(config, 2, "type:nosuchlayer", class_names)


def distinct_storage_bytes(tensors, exclude):
    """Bytes of the distinct storages under `tensors`, leaving out those in `exclude` (data pointers)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(size for pointer, size in storages.items() if pointer not in exclude)


def saved_activation_bytes(run, exclude):
    """Bytes of the distinct storages autograd saves while run() builds its graph, leaving out `exclude`."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda t: t):
        run()
    return distinct_storage_bytes(saved, exclude)


def queued_tensor_bytes(queue, exclude):
    """Bytes of the distinct storages the queued weight-gradient work of a WeightGradQueue keeps alive (a closure's
    cells or a partial's arguments, and the tensors of objects and tuples among them)."""
    values = [value for work in queue._pending for params_and_grads in work
              for value in (params_and_grads.args if isinstance(params_and_grads, functools.partial)
                            else [cell.cell_contents for cell in params_and_grads.__closure__ or ()])]
    values += [member for value in values for member in (value if isinstance(value, tuple) else
                                                         getattr(value, "__dict__", {}).values())]
    return distinct_storage_bytes([value for value in values if isinstance(value, torch.Tensor)], exclude)


def small_layer(kv_heads, precision, batch=2, seq=24, loss_chunk_tokens=0):
    """A one-layer config and the cost model's figures for a (batch, seq) micro-batch of it."""
    config = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=kv_heads)
    return config, LayerCosts(config, Workload(seq_length=seq, micro_batch_size=batch, precision=precision,
                                               loss_chunk_tokens=loss_chunk_tokens))


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("kv_heads,chunk", [(4, 0), (2, 0), (2, 7)], ids=["mha", "gqa", "gqa-chunked-loss"])
def test_activation_model_matches_what_autograd_saves(dtype, precision, kv_heads, chunk):
    batch, seq = 2, 24
    config, costs = small_layer(kv_heads, precision, batch, seq, chunk)
    stage_inputs = StageAttentionInputs(config)
    decoder = DecoderLayerPipe(config, stage_inputs).to(dtype)
    norm, head = FinalNormPipe(config).to(dtype), LMHeadPipe(config, chunked_loss=chunk > 0).to(dtype)
    hidden = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    mask = torch.ones(batch, seq, dtype=torch.long)
    positions = torch.arange(seq).expand(batch, seq)
    # The rotary tables belong to the stage, not to a layer; parameters are state, not activations.
    shared = {t.untyped_storage().data_ptr() for t in stage_inputs(hidden, mask, positions) if t is not None}
    params = {p.untyped_storage().data_ptr() for m in (decoder, norm, head) for p in m.parameters()}
    assert saved_activation_bytes(lambda: decoder((hidden, mask, positions)), shared | params) \
        == costs.saved_bytes[DECODER]
    labels = torch.randint(0, config.vocab_size, (batch, seq))
    outputs, losses = [], []
    loss_fn = CausalLMLoss(chunk_tokens=chunk, grad_sum_dtype=torch.float32)  # the Workload's grad_accum_dtype
    measured = saved_activation_bytes(lambda: losses.append(loss_fn(
        outputs.append(head(norm((hidden, mask, positions)))) or outputs[0], labels)), params)
    if chunk:  # the chunked loss holds its gradients, computed in forward, on its backward node
        measured += sum(t.untyped_storage().nbytes() for t in (losses[0].grad_fn.grad_hidden,
                                                               losses[0].grad_fn.grad_weight))
    # The loss's scalars (its value, its divisor) are not modelled; the last output (logits, or the head's input),
    # which the engine holds, is counted apart.
    assert measured == pytest.approx(costs.saved_bytes[NORM] + costs.saved_bytes[HEAD], abs=16)
    last_output = outputs[0][0] if chunk else outputs[0]
    assert last_output.untyped_storage().nbytes() == costs.last_output_bytes


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("family", ["qwen3", "olmo2", "granite", "mistral"])
def test_activation_model_counts_each_familys_layer(dtype, precision, family):
    """What a decoder layer of each family keeps for backward (q/k norms, OLMo 2's fp32-scaled norms; Granite's
    multipliers and Mistral's window keep nothing more), and the stage's window mask."""
    from tests.tiny_models import TINY_CONFIGS
    batch, seq = 2, 24
    config = TINY_CONFIGS[family]()
    costs = LayerCosts(config, Workload(seq_length=seq, micro_batch_size=batch, precision=precision))
    stage_inputs = StageAttentionInputs(config, row_layout="full")  # the Workload's rows: one document each
    decoder = DecoderLayerPipe(config, stage_inputs).to(dtype)
    hidden = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    mask, positions = torch.ones(batch, seq, dtype=torch.long), torch.arange(seq).expand(batch, seq)
    cos, sin, window_mask, _ = stage_inputs(hidden, mask, positions, decoder.self_attn.window)
    shared = {t.untyped_storage().data_ptr() for t in (cos, sin, window_mask) if t is not None}
    params = {p.untyped_storage().data_ptr() for p in decoder.parameters()}
    assert saved_activation_bytes(lambda: decoder((hidden, mask, positions)), shared | params) \
        == costs.saved_bytes[DECODER]
    assert costs.document_mask_bytes == (0 if window_mask is None else window_mask.untyped_storage().nbytes())


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("kv_heads,chunk", [(4, 0), (2, 0), (2, 7)], ids=["mha", "gqa", "gqa-chunked-loss"])
def test_weight_grad_model_matches_what_the_zero_bubble_queue_keeps(dtype, precision, kv_heads, chunk):
    """What a micro-batch waiting for W holds (models/weight_grads.py), per decoder layer and for the LM head."""
    batch, seq = 2, 24
    config, costs = small_layer(kv_heads, precision, batch, seq, chunk)
    parallel = TensorParallel()
    parallel.weight_grads = WeightGradQueue()
    decoder = DecoderLayerPipe(config, StageAttentionInputs(config), plan=StagePlan(parallel=parallel)).to(dtype)
    norm = FinalNormPipe(config, parallel).to(dtype)
    head = LMHeadPipe(config, parallel, chunked_loss=chunk > 0).to(dtype)
    params = {p.untyped_storage().data_ptr() for m in (decoder, norm, head) for p in m.parameters()}
    hidden = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    mask, positions = torch.ones(batch, seq, dtype=torch.long), torch.arange(seq).expand(batch, seq)
    output = decoder((hidden, mask, positions))[0]
    with parallel.weight_grads.defer():
        output.backward(torch.randn_like(output))
    assert queued_tensor_bytes(parallel.weight_grads, params) == costs.weight_grad_bytes[DECODER]
    parallel.weight_grads.run_oldest()
    loss = CausalLMLoss(parallel, chunk)(head(norm((hidden.detach(), mask, positions))),
                                         torch.randint(0, config.vocab_size, (batch, seq)))
    with parallel.weight_grads.defer():
        loss.backward()
    # The chunked loss's W also holds the loss's 4-byte gradient scale, not modelled.
    assert queued_tensor_bytes(parallel.weight_grads, params) == pytest.approx(costs.weight_grad_bytes[HEAD], abs=4)


def test_checkpointed_stage_keeps_one_hidden_state_per_layer_and_recomputes_one():
    config = PUBLISHED["llama_7b"]
    workload = Workload(seq_length=2048, activation_checkpoint_interval=1)
    costs = LayerCosts(config, workload)
    kinds = [DECODER] * 8
    in_flight = 4
    # Per micro-batch in flight: the stage's input (the hidden states, the int64 document ids and positions) and
    # output (its hidden states) and one checkpoint input per layer; the receive buffers (the input twice, the
    # output's gradient); one layer recomputed and its backward.
    received, floating = costs.boundary_bytes(0)
    assert (received, floating) == (costs.hidden_bytes + 2 * 8 * workload.tokens, costs.hidden_bytes)
    expected = (in_flight * (received + costs.hidden_bytes * (1 + 8)) + 2 * received + costs.hidden_bytes
                + costs.saved_bytes[DECODER] + costs.backward_bytes[DECODER])
    assert costs.stage_activation_bytes(kinds, in_flight) == expected


def test_last_stage_keeps_two_micro_batches_of_logits():
    """DeepSpeed's engine frees a last stage's outputs only when their buffer is reused."""
    costs = LayerCosts(PUBLISHED["llama3_8b"], Workload(seq_length=4096, micro_batches=8, loss_chunk_tokens=0))
    two_logits = costs.stage_activation_bytes([DECODER, NORM, HEAD], 1)
    one_logits = LayerCosts(PUBLISHED["llama3_8b"], Workload(seq_length=4096, micro_batches=1,
                                                             loss_chunk_tokens=0)) \
        .stage_activation_bytes([DECODER, NORM, HEAD], 1)
    assert two_logits - one_logits == costs.last_output_bytes


def test_training_flops_per_token_by_hand_and_against_torch_flop_counter():
    """The FLOPs behind the logged tflops_per_device and mfu: a hand count, and torch's own count of a forward and
    backward of the Hugging Face model (eager attention: the CPU's fused attention kernel is not in torch's table)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM
    from models.partition import training_flops_per_token
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, attn_implementation="eager")
    seq = 96
    # Per layer: q and o 64x64, k and v 64x32, gate/up/down 64x160, two norms of 64; LM head 64x256.
    weights = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160 + 2 * 64) + 64 * 256
    attention = 2 * (2 * 2 * seq * 64)  # QK^T and PV over seq scores per token, 4 heads x 16 dims, 2 layers
    assert training_flops_per_token(config, seq) == 3 * (2 * weights + attention)

    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (2, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = counter.get_total_flops() / ids.numel()
    assert training_flops_per_token(config, seq) == pytest.approx(counted, rel=0.05)


def test_balanced_trades_compute_for_a_split_that_fits_the_device():
    """llama3_8b's split by compute alone puts 33.4 GiB on stage 0; on 32 GiB devices `balanced` takes one that
    fits."""
    cfg, config = run_config("llama3_8b"), PUBLISHED["llama3_8b"]
    workload = plan_spec(cfg, WORLD_SIZE["llama3_8b"]).workload
    device_bytes = 32 * 2**30
    plans = {device: stage_plan(config, partition_stages(config, 4, "balanced",
                                                         balanced_stage_cost(config, workload, 4, device)), workload)
             for device in (None, device_bytes)}
    assert max(row["memory_bytes"] for row in plans[None]) > device_bytes
    assert max(row["memory_bytes"] for row in plans[device_bytes]) <= device_bytes
    assert [row["decoder_layers"] for row in plans[device_bytes]] != [row["decoder_layers"] for row in plans[None]]


def test_sliding_windows_cut_the_attention_cost():
    """Per query, the causal half of the keys (seq / 2) less the triangle a window cuts off, averaged over layers:
    a window of 8 in 16 positions cuts (16 - 8)^2 / 2 of the 16 x 16 / 2 scores; Qwen2's windows are on half the
    layers. MFU's count (every score) takes the window's keys instead of the sequence's."""
    from models.partition import mean_attended_keys, training_flops_per_token
    from tests.tiny_models import TINY_CONFIGS
    assert mean_attended_keys(TINY_CONFIGS["llama2"](), 16) == 8
    assert mean_attended_keys(TINY_CONFIGS["mistral"](), 16) == 8 - 8 ** 2 / 32
    assert mean_attended_keys(TINY_CONFIGS["qwen2"](), 16) == (8 + 8 - 8 ** 2 / 32) / 2
    windowed, full = TINY_CONFIGS["mistral"](), TINY_CONFIGS["mistral"]()
    full.sliding_window = None
    attention_saved = 4 * 4 * (16 - 8) * 4 * 8  # layers x 4 x (seq - window) x heads x head_dim, 3 passes
    assert training_flops_per_token(full, 16) - training_flops_per_token(windowed, 16) == 3 * attention_saved


# bench/trainer_profile.py's small (decoder-heavy) shape: its LM head and loss are 1.33 decoder layers of FLOPs
SMALL = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)


@pytest.mark.parametrize("schedule,virtual_stages,zbv_times,micro_batches,counts,chunk_even", [
    # interleaved: ranks hold chunks 0+2 and 1+3 (the head's); evening out chunks gave rank 1 5.33 decoders' work
    ("interleaved_1f1b", 2, None, 4, [2, 2, 3, 1], [2, 3, 2, 1]),
    ("interleaved_1f1b", 2, None, 8, [3, 2, 2, 1], [2, 3, 2, 1]),
    # the V order made for the plan's times (zbv_times=auto): at m = 4 evening out chunks was already the best
    ("zbv", None, "auto", 4, [2, 3, 2, 1], [2, 3, 2, 1]),
    ("zbv", None, "auto", 8, [2, 1, 4, 1], [2, 3, 2, 1]),
])
def test_balanced_chunks_take_the_shortest_simulated_step(schedule, virtual_stages, zbv_times, micro_batches, counts,
                                                          chunk_even):
    """Under a schedule with several chunks per rank `balanced` splits the chunks for the shortest step the
    schedule's order takes on the plan's F, B and W of each chunk (planner/chunk_balance.py): here the least over
    every split of the 8 decoder layers into 4 chunks, which evening out the chunks' compute missed but at m = 4
    under ZB-V. The trainer's path gives those bounds; F + B + W of every chunk is its compute, the chunked loss's
    head all in F."""
    from itertools import combinations

    from omegaconf import OmegaConf

    from models.partition import stage_bounds_from_decoder_counts, stage_kinds
    from planner.chunk_balance import balanced_chunk_counts, chunk_pass_costs, simulated_step
    from planner.stage_costs import StageCostModel
    from training.config_checks import checked_config
    from training.run_spec import configured_stage_bounds
    workload = Workload(seq_length=256, micro_batch_size=4, micro_batches=micro_batches, precision="fp32",
                        pipeline_schedule=schedule, virtual_stages=virtual_stages or 1, zbv_times=zbv_times)
    model = StageCostModel(SMALL, workload, 4)
    splits = [[b - a for a, b in zip((0, *cut), (*cut, 8))] for cut in combinations(range(1, 8), 3)]
    steps = {tuple(split): simulated_step(model, split, 2) for split in splits}
    assert balanced_chunk_counts(SMALL, workload, 2) == counts
    assert steps[tuple(counts)] == pytest.approx(min(steps.values()))
    assert balanced_decoder_counts(8, 4, model.cost) == chunk_even
    assert (steps[tuple(chunk_even)] > 1.01 * steps[tuple(counts)]) == (counts != chunk_even)
    cfg = checked_config(OmegaConf.create(dict(pipeline_schedule=schedule, virtual_stages=virtual_stages,
                                               num_stages=2, gradient_accumulation_steps=micro_batches)))
    assert list(configured_stage_bounds(cfg, SMALL, workload)) == stage_bounds_from_decoder_counts(counts, 8)
    for chunk, costs in enumerate(chunk_pass_costs(model, counts, schedule)):
        kinds = stage_kinds(chunk, 4, counts[chunk])
        assert sum(costs.values()) == pytest.approx(model.compute(kinds))
        assert (costs["B"] < 0.4 * costs["F"]) == (HEAD in kinds)  # the head's gradients computed in F


# Times shaped as this CPU measured the small shape (bench/README.md): the head and loss one decoder layer's
# training time (all in F: the chunked loss), a split backward 4% over a whole one.
CPU_LIKE_UNITS = {"embedding": {"F": 0.0, "B": 0.0, "W": 0.0, "BW": 0.0},
                  "decoder": {"F": 1.0, "B": 1.04, "W": 1.04, "BW": 2.0},
                  "head": {"F": 3.0, "B": 0.0, "W": 0.0, "BW": 0.0}}


@pytest.mark.parametrize("schedule,virtual_stages,micro_batches,flops_counts,flops_slower", [
    ("zbv", None, 4, [2, 3, 2, 1], True), ("zbv", None, 8, [2, 1, 4, 1], True),
    ("interleaved_1f1b", 2, 4, [2, 2, 3, 1], False), ("interleaved_1f1b", 2, 8, [3, 2, 2, 1], False)])
def test_balanced_chunks_on_measured_costs_take_their_shortest_step(schedule, virtual_stages, micro_batches,
                                                                    flops_counts, flops_slower):
    """partition_costs=measured (planner/measured_costs.py): `balanced` simulates each split on the measured F, B, W
    instead of FLOPs. With the head and loss as costly as a decoder layer, each rank gets 4 decoder layers (under
    ZB-V the FLOPs' 1.33-layer head gave rank 1 five), the first chunk the larger (its backward runs whole, 4%
    cheaper under ZB-V): the least simulated step over every split, which the FLOPs' split misses under ZB-V (3%
    longer and more); the trainer's path (configured_stage_bounds with the units) gives those bounds."""
    from itertools import combinations

    from omegaconf import OmegaConf

    from models.partition import stage_bounds_from_decoder_counts
    from planner.chunk_balance import balanced_chunk_counts, simulated_step
    from planner.measured_costs import UnitCosts
    from planner.stage_costs import StageCostModel
    from training.config_checks import checked_config
    from training.run_spec import configured_stage_bounds
    units = UnitCosts(CPU_LIKE_UNITS, "test")
    workload = Workload(seq_length=256, micro_batch_size=4, micro_batches=micro_batches, precision="fp32",
                        pipeline_schedule=schedule, virtual_stages=virtual_stages or 1,
                        zbv_times="auto" if schedule == "zbv" else None)
    model = StageCostModel(SMALL, workload, 4)
    splits = [[b - a for a, b in zip((0, *cut), (*cut, 8))] for cut in combinations(range(1, 8), 3)]
    steps = {tuple(split): simulated_step(model, split, 2, units) for split in splits}
    counts = balanced_chunk_counts(SMALL, workload, 2, units)
    assert counts == [3, 2, 2, 1] and steps[tuple(counts)] == pytest.approx(min(steps.values()))
    assert balanced_chunk_counts(SMALL, workload, 2) == flops_counts
    assert (steps[tuple(flops_counts)] > 1.03 * steps[tuple(counts)]) == flops_slower  # else as short: 4 | 4
    cfg = checked_config(OmegaConf.create(dict(pipeline_schedule=schedule, virtual_stages=virtual_stages,
                                               num_stages=2, gradient_accumulation_steps=micro_batches)))
    bounds = configured_stage_bounds(cfg, SMALL, workload, units)
    assert list(bounds) == stage_bounds_from_decoder_counts(counts, 8)


def test_measured_stage_costs_count_recompute_the_split_and_the_head():
    """A stage's measured time: F, and a whole backward (1F1B, a zero_bubble first stage) or B + W (later
    zero_bubble stages), plus the forward again for checkpointed decoder runs; `balanced` on one chunk per rank
    weighs the head by its measured time: as costly as four decoder layers, the last stage gets one fewer than on
    the plan's FLOPs (1.33 layers)."""
    from models.partition import stage_kinds
    from planner.measured_costs import UnitCosts, measured_stage_cost
    from planner.stage_costs import StageCostModel
    units = UnitCosts({**CPU_LIKE_UNITS, "head": {"F": 12.0, "B": 0.0, "W": 0.0, "BW": 0.0}}, "test")
    kinds = stage_kinds(1, 2, 3)  # three decoders, the norm and the head
    runs = StageCostModel(SMALL, Workload(activation_checkpoint_interval=2), 2).layers.chunks(kinds)
    assert units.pass_seconds(runs, split=False) == pytest.approx({"F": 15.0, "B": 6.0 + 2.0, "W": 0.0})
    assert units.pass_seconds(runs, split=True) == pytest.approx({"F": 15.0, "B": 3.12 + 2.0, "W": 3.12})
    for schedule, last_stage in (("1f1b", 3 + 12 + 6), ("zero_bubble", 3 + 12 + 6.24)):
        model = StageCostModel(SMALL, Workload(pipeline_schedule=schedule), 2)
        cost = measured_stage_cost(model, units)
        assert cost(1, kinds) == (0, pytest.approx(last_stage / 3))
        assert cost(0, stage_kinds(0, 2, 3)) == (0, pytest.approx(3.0))  # the first stage's backward runs whole
        assert balanced_decoder_counts(8, 2, cost) == [6, 2]
        assert balanced_decoder_counts(8, 2, model.cost) == [5, 3]

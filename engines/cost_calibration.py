"""partition_costs=measured (auto: under interleaved_1f1b and zbv): the units `balanced` weighs, timed on this rank's
device at the run's micro-batch shape before the pipeline is built (planner/measured_costs.py says what is done
with them).

Each rank builds the embedding, one decoder layer, and the final norm with the LM head and the loss, in the run's
dtype with random weights, and runs CALIBRATION_REPETITIONS + 1 rounds, each unit in turn: a forward and a whole
backward, then a forward and the backward split as the zero-bubble schedules split it (B deferring the weight
gradients, then W); the first round allocates what the others reuse and is left out, each time is the median of
the others. On CUDA the passes are timed by events on the device's stream (one host sync per round, none in
training); on the CPU by the process's CPU time, which another process on a shared host does not add to. The ranks
all-gather their times and every rank takes the same mean (collectives/), so all of them partition alike.

What it costs: the three units' weights and gradients and one micro-batch's activations at a time, freed before the
pipeline is built: for llama_65b in bf16 at seq 2048, micro-batch 1, a decoder layer holds 0.81 B parameters and
the embedding and the head 0.26 B each (2.7 GB of weights and as much of gradients, 1 GB for the head's fp32
gradient sum), with 0.7 GiB of the layer's activations and 0.3 GiB of backward workspace (planner/stage_costs.py);
2 x (CALIBRATION_REPETITIONS + 1) training passes of each, ~160 TFLOP: well under a second at an H100's bf16 rate
(estimated from the FLOPs, not measured here; tests/gpu/test_one_gpu.py measures the 1B shape's).
"""
import contextlib
import statistics
import time

import torch
from deepspeed.accelerator import get_accelerator

import collectives
from data.collator import row_layout
from models.attention import StageAttentionInputs
from models.context_parallel import NO_CONTEXT_PARALLEL
from models.loss import CausalLMLoss
from models.partition import DECODER, EMBEDDING, HEAD, planned_decoder
from models.pipeline import PRECISION_DTYPES
from models.pipeline_layers import EmbeddingPipe, LMHeadPipe, StagePlan, StageTuple, decoder_pipe, final_norm_pipe
from models.tensor_parallel import TensorParallel
from models.weight_grads import WeightGradQueue
from planner.measured_costs import TIMES, UnitCosts, uses_measured_costs
from engines.instruction_listeners import InstructionClock

CALIBRATION_REPETITIONS = 5  # timed rounds per unit (medians), after one untimed


def measured_partition(spec):
    """spec as the run trains it: where partition_costs asks for measured costs, its stages re-partitioned on the
    mean over every rank of their measured unit times (collective: every rank calls it). Otherwise (and for an
    evaluation, whose speed the split hardly moves) spec."""
    if not uses_measured_costs(spec.cfg) or spec.cfg.eval_only:
        return spec
    return spec.with_unit_costs(agreed_unit_costs(spec.cfg, spec.model_config))


def agreed_unit_costs(cfg, config):
    """Collective: every rank's timed_unit_costs all-gathered, and their mean, the same numbers on every rank."""
    mine = timed_unit_costs(cfg, config)
    get_accelerator().empty_cache()  # the units' blocks back to the device before the stage is built
    every_rank = collectives.all_gather_numbers(mine.numbers())
    mean = [sum(column) / len(every_rank) for column in zip(*every_rank)]
    return UnitCosts.from_numbers(mean, f"{mine.device}, mean of {len(every_rank)} ranks")


@contextlib.contextmanager
def building(dtype, device):
    """Modules built directly in the run's dtype on the device (as build_pipeline_module builds a stage)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def timed_unit_costs(cfg, config):
    """This rank's UnitCosts: each unit's F, B, W and whole backward at cfg's micro-batch shape."""
    device, dtype = collectives.device(), PRECISION_DTYPES[cfg.precision]
    batch, seq = cfg.micro_batch_size, cfg.seq_length
    parallel = TensorParallel()
    parallel.weight_grads = WeightGradQueue()
    ids = torch.randint(config.vocab_size, (batch, seq), device=device)
    documents, positions = torch.zeros_like(ids), torch.arange(seq, device=device).expand(batch, seq)
    chunk_tokens = cfg.loss_chunk_tokens if cfg.loss_impl == "chunked" else 0
    with building(dtype, device):
        hidden = torch.randn(batch, seq, config.hidden_size, requires_grad=True)
        grad = torch.randn(batch, seq, config.hidden_size)
        embedding = EmbeddingPipe(config, parallel)
        decoder = decoder_pipe(config)(config, StageAttentionInputs(config, row_layout(cfg.data)),
                                       planned_decoder(config), StagePlan(cfg.attention_impl, parallel))
        # an MoE model's routing statistics start at zeros, which its decoder layers carry on
        stage_inputs = StageTuple(config).start(hidden, documents, positions, ids)
        norm, head = final_norm_pipe(config)(config, parallel), LMHeadPipe(config, parallel, chunk_tokens > 0)
    loss = CausalLMLoss(parallel, chunk_tokens, NO_CONTEXT_PARALLEL, PRECISION_DTYPES[cfg.grad_accum_dtype])
    units = {EMBEDDING: (lambda: embedding((ids, documents, positions))[0], grad),
             DECODER: (lambda: decoder(stage_inputs)[0], grad),
             HEAD: (lambda: loss(head(norm(stage_inputs)), ids), None)}
    clock = InstructionClock(time.process_time)
    rounds = []
    for _ in range(CALIBRATION_REPETITIONS + 1):  # the units in turn, so that a slow spell falls on all of them
        for unit, (forward, output_grad) in units.items():
            timed_passes(forward, output_grad, parallel.weight_grads, clock, unit)
        rounds.append(clock.take())
    return UnitCosts({unit: {time_: statistics.median(times.get((unit, time_), 0.0) for times in rounds[1:])
                             for time_ in TIMES} for unit in units}, str(device))


def timed_passes(forward, grad, queue, clock, unit):
    """Times forward() and a whole backward (its output's gradient `grad`; None for a loss), then a forward and the
    backward split into B (queue deferring the weight gradients) and W, into clock's (unit, time) kinds."""
    started = clock.start()
    output = forward()
    clock.stop((unit, "F"), started)
    started = clock.start()
    torch.autograd.backward(output, grad)
    clock.stop((unit, "BW"), started)
    output = forward()
    started = clock.start()
    with queue.defer():
        torch.autograd.backward(output, grad)
    clock.stop((unit, "B"), started)
    started = clock.start()
    queue.run_oldest()
    clock.stop((unit, "W"), started)

"""The gradient-clipping norm: one over the whole model, every weight's squared gradient counted once, whatever the
layout. A tied weight's pipeline copy is not counted, a weight every tensor-parallel rank holds whole only on rank 0;
each rank's share is then summed over the pipeline and tensor-parallel ranks (DeepSpeed's model-parallel group).
Under expert parallelism each rank of an expert-parallel group holds other experts of its layers: their squares are
summed over that group first (DeepSpeed #8475: its own clipping averages the ranks' norms as if they held the same
weights).

Where the gradients are:
- fp32 without ZeRO: each parameter's .grad, whole on every data-parallel rank. The project clips them itself
  (use_fp32_clipping): DeepSpeed's fp32 clipping counts only the first stage's gradients, treating the other stages
  as model-parallel replicas, so every stage clipped by a different factor.
- ZeRO-1: each rank's partition of each group's gradients (the experts' partitioned over the ranks holding the same
  experts), summed over the data-parallel group.
- DeepSpeed's bf16 optimizer: its fp32 gradients, whole on every data-parallel rank.
Under ZeRO-1 and bf16 without expert parallelism DeepSpeed's own norms are these; with it, they are replaced
(use_expert_parallel_norm): DeepSpeed reduces the norm of each parameter group in turn over the stages, and a stage
holding experts has one group more than one without, so their reductions would not pair up. Here every rank runs the
same collectives whatever its stage holds.
"""
import torch

import collectives
from deepspeed_internals.access import (counted_once, replace_bf16_grad_norm, replace_fp32_gradient_clipping,
                                        replace_zero_grad_norm, set_global_grad_norm, uses_bf16_optimizer)


def use_fp32_clipping(engine, expert_parallel):
    """The engine clips fp32 gradients (without ZeRO) by the model's norm, and reports it."""
    replace_fp32_gradient_clipping(engine, lambda: clip_fp32_gradients(engine, expert_parallel))


def use_expert_parallel_norm(engine, expert_parallel):
    """Under expert parallelism, ZeRO-1's and the bf16 optimizer's clipping norm is the model's (above)."""
    if expert_parallel.size == 1 or engine.zero_optimization_stage() == 0 and not uses_bf16_optimizer(engine):
        return
    if uses_bf16_optimizer(engine):  # DeepSpeed sums the squares over the model-parallel group itself
        replace_bf16_grad_norm(engine.optimizer, lambda pairs: squares_of(pairs, engine, expert_parallel))
    else:
        replace_zero_grad_norm(engine.optimizer, lambda squares: partitioned_norm(squares, engine))


def squares_of(params_and_grads, engine, expert_parallel):
    """This rank's share of the model's squared gradients from whole gradients [(param, grad)]: its experts' summed
    over the expert-parallel group (every rank of it runs this, with or without experts on its stage)."""
    tensor_rank = engine.grid.get_slice_parallel_rank()
    owned = [(hasattr(param, "expert_slice"), grad) for param, grad in params_and_grads
             if counted_once(param, tensor_rank)]
    dense, experts = (summed_squares([grad for expert, grad in owned if expert == of_experts])
                      for of_experts in (False, True))
    if expert_parallel.size > 1:
        collectives.all_reduce(experts, group=expert_parallel.group)
    return dense + experts


def summed_squares(grads):
    """The sum of the gradients' squares in fp32, each gradient squared NORM_CHUNK_ELEMENTS at a time: a 16-bit
    expert gradient's fp32 copy and squares stay that small, however large the gradient (an fp32 copy of it whole
    would be gigabytes). A gradient within one chunk is summed as one tensor, as before chunking.
    torch.linalg.vector_norm is no better here: on the CPU (torch 2.13) it casts its whole input to the dtype asked
    for, and its fp32 sum of a large tensor drifts further from the exact one than sum's."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=collectives.device())
    return torch.stack([chunk.float().pow(2).sum() for grad in grads
                        for chunk in grad.reshape(-1).split(NORM_CHUNK_ELEMENTS)]).sum()


NORM_CHUNK_ELEMENTS = 1 << 24  # 16M elements: 64 MiB of fp32 squares at most at once (and its copy below fp32)


def model_norm(params_and_grads, engine, expert_parallel):
    """The norm of whole gradients [(param, grad)] over the model (every stage and tensor-parallel rank)."""
    squares = squares_of(params_and_grads, engine, expert_parallel)
    collectives.all_reduce(squares, group=engine.mpu.get_model_parallel_group())
    return squares.sqrt()


def clip_fp32_gradients(engine, expert_parallel):
    params = [p for p in engine.module.parameters() if p.grad is not None]
    total_norm = model_norm([(p, p.grad) for p in params], engine, expert_parallel)
    torch.nn.utils.clip_grads_with_norm_(params, engine.gradient_clipping(), total_norm)
    set_global_grad_norm(engine, total_norm.item())


def partitioned_norm(squares, engine):
    """The norm from this rank's squares of ZeRO's partitions: summed over the data-parallel group (disjoint
    pieces), then over the stages and tensor-parallel ranks."""
    collectives.all_reduce(squares, group=engine.grid.get_data_parallel_group())
    collectives.all_reduce(squares, group=engine.mpu.get_model_parallel_group())
    return squares.sqrt()

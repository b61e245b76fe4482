"""The project's pipeline on one stage against a plain PyTorch loop over transformers' LlamaForCausalLM.

Both train the same config on the same batches with one thread: ours through DeepSpeed's engine (train_batch:
m micro-batches, then AdamW), transformers' as forward, backward per micro-batch and torch's AdamW step. Steps
alternate between the contenders so that background load hits all alike, and each rate comes from the median
step time. Prints tokens/s of each and the ratio to transformers (target: ours >= 1.10x), ours with the default
chunked LM loss and with the full-logits head (loss_impl=logits); with --compile, also ours with every layer compiled
(PipelineModule.compile(), what compile=true does).

  python bench/layer_overhead.py [--steps 6] [--compile]
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (bench_parser, machine_note, parse_args, random_micro_batches, run_config, spawn,  # noqa: E402
                    timed_rounds)

# A few million parameters: 4 layers of hidden 256 with an 8k vocabulary.
MODEL = dict(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=1024)
SEQ_LENGTH, MICRO_BATCH, MICRO_BATCHES = 256, 4, 4
# MODEL's stand-in at the smoke size (--smoke), with its seq_length, micro-batch size and micro-batches per step
SMOKE_MODEL = dict(MODEL, vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
SMOKE_SHAPE = (32, 2, 2)


def run_overrides(seq_length, micro_batch, micro_batches, loss_impl="chunked"):
    return ["num_stages=1", "precision=fp32", "zero_stage=0", f"seq_length={seq_length}",
            f"micro_batch_size={micro_batch}", f"gradient_accumulation_steps={micro_batches}", "max_grad_norm=0",
            "lr_scheduler=constant", f"loss_impl={loss_impl}"]


def pipeline_step(config, compile_layers, loss_impl="chunked", seq_length=SEQ_LENGTH, micro_batch=MICRO_BATCH,
                  micro_batches=MICRO_BATCHES):
    """One training step of the project's engine on one stage, as training/loop.py builds it."""
    import deepspeed

    from deepspeed_internals.access import skip_gradient_allreduce
    from models.pipeline import build_pipeline_module
    from training.deepspeed_config import deepspeed_config
    from cluster.distributed import parallel_topology

    cfg = run_config(run_overrides(seq_length, micro_batch, micro_batches, loss_impl))
    module = build_pipeline_module(config, parallel_topology(1), row_layout="full",  # random_micro_batches' rows
                                   loss_chunk_tokens=cfg.loss_chunk_tokens if loss_impl == "chunked" else 0)
    init_like_transformers(module, config)
    if compile_layers:
        module.compile()
    ds_config, _ = deepspeed_config(cfg, total_steps=10**6)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                           config=ds_config)
    skip_gradient_allreduce(engine)  # as training/loop.py's build_engine without data parallelism
    batches = random_micro_batches(config.vocab_size, seq_length, micro_batch)
    return lambda: engine.train_batch(batches)


def init_like_transformers(module, config):
    """transformers' initialisation (normal, std initializer_range; norms at 1): torch's defaults would spread the
    logits so wide that most of the softmax's e^(x - max) fall below fp32's normal range, and those are slow."""
    import torch

    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)):
                layer.weight.normal_(0.0, config.initializer_range)
                if getattr(layer, "bias", None) is not None:
                    layer.bias.zero_()


def transformers_step(config, seq_length=SEQ_LENGTH, micro_batch=MICRO_BATCH, micro_batches=MICRO_BATCHES, seed=0):
    """One training step of a plain loop: forward and backward per micro-batch, then AdamW."""
    import torch
    from transformers import LlamaForCausalLM

    cfg = run_config(run_overrides(seq_length, micro_batch, micro_batches))
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()
    # fused: transformers' Trainer default (adamw_torch_fused) with torch >= 2.8
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay, fused=True)
    batches = random_micro_batches(config.vocab_size, seq_length, micro_batch, seed=seed)

    def step():
        for _ in range(micro_batches):
            (input_ids, _, _), labels = next(batches)
            (model(input_ids=input_ids, labels=labels).loss / micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def compare(rank, fields, shape, steps, compile_layers):
    """{contender: [seconds of each step]}, steps alternating after two warm-up steps each."""
    from transformers import LlamaConfig

    from cluster.distributed import init_distributed

    init_distributed(timeout_minutes=30)
    config = LlamaConfig(**fields)
    contenders = {"transformers": transformers_step(config, *shape),
                  "pipeline": pipeline_step(config, False, "chunked", *shape),
                  "pipeline, logits head": pipeline_step(config, False, "logits", *shape)}
    if compile_layers:
        contenders["pipeline, compiled layers"] = pipeline_step(config, True, "chunked", *shape)
    for step in contenders.values():  # warm-up: first-use allocations, compilation
        step()
        step()
    return timed_rounds(contenders, steps)


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--compile", action="store_true", help="also time the pipeline with compiled layers")
    args = parse_args(parser, steps=1)
    fields, shape = (SMOKE_MODEL, SMOKE_SHAPE) if args.smoke else (MODEL, (SEQ_LENGTH, MICRO_BATCH, MICRO_BATCHES))
    times = spawn(compare, 1, fields, shape, args.steps, args.compile)[0]
    seq_length, micro_batch, micro_batches = shape
    rates = {name: micro_batches * micro_batch * seq_length / statistics.median(values)
             for name, values in times.items()}
    from transformers import LlamaConfig, LlamaForCausalLM
    parameters = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**fields)).parameters())
    print(f"{parameters / 1e6:.1f}M parameters, seq_length {seq_length}, micro-batch {micro_batch}, "
          f"{micro_batches} micro-batches per step, fp32, 1 thread, median of {args.steps} alternating steps each")
    for name, rate in rates.items():
        print(f"{name:<28} {rate:>9.0f} tokens/s   {rate / rates['transformers']:.3f}x transformers")
    print(machine_note())


if __name__ == "__main__":
    main()

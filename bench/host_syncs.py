"""Host syncs per training step: how many times one step of the trainer's engine (training/loop.py build_engine and
its step: the micro-batches moved to the device, the step's loss units counted, train_batch) makes the host wait for
the device, for 1 and 4 micro-batches and for 1 and 8 loss chunks per micro-batch. The project's own code takes one
per step (the step's count of loss units); the rest is DeepSpeed's. A figure that grows with the micro-batches or
chunks is a sync per micro-batch or chunk.

On CUDA the count is the device's own (torch.cuda.set_sync_debug_mode("warn"): one warning per synchronizing call);
on the CPU it is tests/host_syncs.py's record of the ops that read a tensor's value on the host.

    python bench/host_syncs.py [--steps 2]
    DS_ACCELERATOR=cuda python bench/host_syncs.py       # on one GPU (the GPU check runs it: tests/gpu/)
"""
import contextlib
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_parser, machine_note, parse_args, single_rank_env, trainer_engine  # noqa: E402

MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
SEQ_LENGTH, MICRO_BATCH = 128, 2
CASES = [(micro_batches, chunks) for micro_batches in (1, 4) for chunks in (1, 8)]  # loss chunks per micro-batch


@contextlib.contextmanager
def counting_syncs(on_gpu):
    """Yields a list that holds one entry per host sync made inside the block, once it exits."""
    import torch

    from tests.host_syncs import HostSyncs
    syncs = []
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs += [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    else:
        with HostSyncs() as recorder:
            yield syncs
        syncs += recorder.ops


def syncs_per_step(micro_batches, chunks, steps):
    """Host syncs of each of `steps` steps (after one warm-up step), as the training loop takes them."""
    from deepspeed.accelerator import get_accelerator

    from training.token_mean import global_loss_units, step_micro_batches, token_mean_micro_batches
    engine, stream, _ = trainer_engine(MODEL, [
        f"seq_length={SEQ_LENGTH}", f"micro_batch_size={MICRO_BATCH}", "lr_scheduler=constant",
        f"gradient_accumulation_steps={micro_batches}", "zero_stage=0", "precision=fp32",
        f"loss_chunk_tokens={MICRO_BATCH * SEQ_LENGTH // chunks}"], steps + 1)
    counts = []
    for step in range(steps + 1):
        with counting_syncs(get_accelerator().device_name() == "cuda") as syncs:
            batches = step_micro_batches(engine, stream, micro_batches)
            engine.train_batch(iter(token_mean_micro_batches(engine, batches, global_loss_units(engine, batches))))
        if step:  # the first step builds what later ones reuse
            counts.append(len(syncs))
    return counts


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=2)
    args = parse_args(parser, steps=1)
    os.environ.update(single_rank_env())
    results = {f"{micro_batches} micro-batches x {chunks} chunks": syncs_per_step(micro_batches, chunks, args.steps)
               for micro_batches, chunks in CASES}
    print(f"{machine_note()}; DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR', 'cpu')}\n1 stage, fp32, "
          f"{MICRO_BATCH} x {SEQ_LENGTH} tokens per micro-batch; host syncs in each of {args.steps} steps:")
    for name, counts in results.items():
        print(f"  {name:<28} {', '.join(map(str, counts))}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()

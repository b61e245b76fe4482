"""A sparse decoder layer's backward split for the zero-bubble schedules, in CPU seconds (one thread): F, B and W of
one Mixtral layer at bench/pipeline_efficiency.py's --moe shape, with the router's and experts' weight gradients
in W (models/weight_grads.py, now) and in B (before: only attention's projections waited for W), the undivided
backward beside; then the bubble the schedule simulator (bench/schedule_simulator.py) gives p stages of such layers
under 1F1B, zero_bubble and zbv for each split. Rounds alternate the three, in reverse order every other round;
each figure is the median over the rounds.

  python bench/moe_weight_grads.py [--rounds 20] [--stages 2] [--micro-batches 8] [--hidden-size 512]
"""
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_parser, in_rounds, machine_note, parse_args  # noqa: E402
from pipeline_efficiency import MICRO_BATCH, SEQ_LENGTH, model_config  # noqa: E402
from schedule_simulator import predict  # noqa: E402

SPLITS = ("experts in W", "experts in B", "undivided")


def sparse_layer(config, split):
    """A decoder layer whose backward splits as `split` says, and the queue its W runs from (None: undivided)."""
    from models.attention import StageAttentionInputs
    from models.pipeline_layers import DecoderLayerPipe, StagePlan
    from models.tensor_parallel import TensorParallel
    from models.weight_grads import WeightGradQueue
    import torch
    parallel = TensorParallel()
    if split != "undivided":
        parallel.weight_grads = WeightGradQueue()
    torch.manual_seed(0)
    layer = DecoderLayerPipe(config, StageAttentionInputs(config, row_layout="full"), plan=StagePlan(parallel=parallel))
    if split == "experts in B":  # the MoE block without the queue: its router's and experts' gradients in B
        undivided = TensorParallel()
        for module in layer.mlp.modules():
            if hasattr(module, "parallel"):
                module.parallel = undivided
        layer.mlp.experts.grouped_linear = undivided.grouped_linear
    return layer, parallel.weight_grads


def timed_passes(layer, queue, inputs):
    """CPU seconds of the layer's F, B and W on one micro-batch."""
    import torch
    started = time.process_time()
    hidden, probabilities = (t for t in layer(inputs) if t.is_floating_point())
    forward = time.process_time()
    with queue.defer() if queue is not None else contextlib.nullcontext():
        torch.autograd.backward([hidden, probabilities], [torch.ones_like(hidden), torch.ones_like(probabilities)])
    backward = time.process_time()
    if queue is not None:
        queue.run_oldest()
    weight = time.process_time()
    return {"F": forward - started, "B": backward - forward, "W": weight - backward}


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    args = parse_args(parser, rounds=2, hidden_size=64)
    import torch

    from models.pipeline_layers import StageTuple
    torch.set_num_threads(1)
    config = model_config(args.hidden_size, moe=True)
    hidden = torch.randn(MICRO_BATCH, SEQ_LENGTH, config.hidden_size)
    ones = torch.ones(MICRO_BATCH, SEQ_LENGTH, dtype=torch.long)
    positions = torch.arange(SEQ_LENGTH).expand(MICRO_BATCH, SEQ_LENGTH)
    layers = {split: sparse_layer(config, split) for split in SPLITS}

    def step(split):
        inputs = StageTuple(config).start(hidden.clone().requires_grad_(), ones, positions)
        return timed_passes(*layers[split], inputs)
    in_rounds({split: lambda split=split: step(split) for split in SPLITS}, 1)  # warm-up
    times = in_rounds({split: lambda split=split: step(split) for split in SPLITS}, args.rounds)
    print(f"Mixtral layer: hidden {config.hidden_size}, {config.num_local_experts} experts of "
          f"{config.intermediate_size}, top-{config.num_experts_per_tok}, load-balancing loss on; micro-batch "
          f"{MICRO_BATCH} x {SEQ_LENGTH}, fp32, one thread; median CPU ms of {args.rounds} rounds; p={args.stages} "
          f"m={args.micro_batches} bubbles simulated from them")
    medians = {split: {kind: statistics.median(t[kind] for t in times[split]) for kind in "FBW"} for split in SPLITS}
    one_f_one_b = predict(args.stages, args.micro_batches, [medians["undivided"]])["1f1b"][0]
    for split, median in medians.items():
        simulated = predict(args.stages, args.micro_batches, [median])
        schedules = ("1f1b",) if split == "undivided" else ("zero_bubble", "zbv")
        print(f"{split}: F {1e3 * median['F']:.1f} B {1e3 * median['B']:.1f} W {1e3 * median['W']:.1f} ms; " + ", ".join(
            f"{schedule} bubble {100 * simulated[schedule][1]:.1f}% step {simulated[schedule][0] / one_f_one_b:.3f}x "
            f"1F1B's" for schedule in schedules))
    print(machine_note())


if __name__ == "__main__":
    main()

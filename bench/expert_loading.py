"""What a rank of an expert-parallel run reads of a sparse layer's file: the layer saved whole (every expert, as
conversion and checkpoints write it), loaded into rank r of expert parallelism k (models/expert_parallel.py) by
checkpoints/layer_files.py, which reads each expert tensor's rows of the rank's experts and nothing else. Bytes read
are the process's read syscalls (/proc/self/io rchar) while it loads, the pages cached or not alike. The layer:
Qwen3-30B-A3B's routing (128 experts, top-8) at a quarter of its width (hidden 512, experts 192 wide), bf16.

    python bench/expert_loading.py [--sizes 1 2 4 8]
"""
import os
import tempfile

from common import bench_parser, parse_args

import torch  # noqa: E402

SHAPES = {"full": dict(hidden_size=512, moe_intermediate_size=192, num_experts=128),
          "smoke": dict(hidden_size=32, moe_intermediate_size=16, num_experts=8)}


def read_bytes():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def sparse_layer(config, experts=None):
    from models.expert_parallel import NO_EXPERT_PARALLEL
    from models.attention import StageAttentionInputs
    from models.pipeline_layers import DecoderLayerPipe, StagePlan
    return DecoderLayerPipe(config, StageAttentionInputs(config), plan=StagePlan(experts=experts or NO_EXPERT_PARALLEL))


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shape", choices=SHAPES, default="full")
    args = parse_args(parser, shape="smoke", sizes=[1, 2])
    from transformers import Qwen3MoeConfig

    from checkpoints.layer_files import load_layer_slice
    from models.expert_parallel import ExpertParallel
    config = Qwen3MoeConfig(vocab_size=1024, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=64, num_experts_per_tok=8, **SHAPES[args.shape])
    torch.set_default_dtype(torch.bfloat16)
    whole = sparse_layer(config).state_dict()
    expert_bytes = sum(t.nbytes for key, t in whole.items() if ".experts." in key)
    other_bytes = sum(t.nbytes for key, t in whole.items() if ".experts." not in key)
    print(f"one sparse layer, bf16: experts {expert_bytes / 2**20:.1f} MiB, the rest {other_bytes / 2**20:.2f} MiB")
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "layer_01-model_states.pt")
        torch.save(whole, path)
        for size in args.sizes:
            for rank in sorted({0, size - 1}):
                layer = sparse_layer(config, ExpertParallel(size=size, rank=rank) if size > 1 else None)
                before = read_bytes()
                load_layer_slice(layer, [path], 0, 1)
                read = read_bytes() - before
                print(f"expert parallel {size}, rank {rank}: read {read / 2**20:.2f} MiB; minus the rest: "
                      f"{(read - other_bytes) / expert_bytes:.4f} of the layer's expert bytes (1/{size} = "
                      f"{1 / size:.4f})")


if __name__ == "__main__":
    main()

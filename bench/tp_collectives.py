"""The collectives one stage makes under tensor parallelism 2 with sequence parallelism, per decoder layer.

Each family's tiny model (tests/tiny_models.py) is built as one stage on 2 processes (gloo), once with 2 decoder
layers and once with 4, and runs one micro-batch forward and backward through its loss; every call of collectives/
(the one door to torch.distributed) is counted. The difference between the two builds, halved, is what one decoder
layer calls; the rest is the embedding's, the final norm's and the head's. Counts, not times: the figures do not
depend on the machine or its load, and an older tree's are comparable (copy this script into it and run it there:
bench/README.md's row says how).

  python bench/tp_collectives.py [--families llama3 qwen3_moe ...] [--loss-chunk-tokens 1024]
"""
import collections
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_parser, parse_args, spawn  # noqa: E402

FAMILIES = ["llama3", "tied", "qwen3", "olmo2", "phi3", "qwen3_moe", "mixtral"]
LAYERS = (2, 4)


def counted_collectives():
    """collectives/'s functions replaced by counting wrappers; the Counter they add to."""
    import collectives
    counts = collections.Counter()
    for name in dir(collectives):
        function = getattr(collectives, name)
        if callable(function) and getattr(function, "__module__", None) == "collectives" and \
                name not in ("device", "check_on_device"):
            def counting(*args, _function=function, _name=name, **kwargs):
                counts[_name] += 1
                return _function(*args, **kwargs)
            setattr(collectives, name, counting)
    return counts


def worker(rank, families, loss_chunk_tokens):
    import torch

    from cluster.distributed import init_distributed, parallel_topology
    from data.collator import collate_causal_lm
    from models.pipeline import build_pipeline_module
    from tests.tiny_models import MOE_CONFIGS, TINY_CONFIGS

    init_distributed(timeout_minutes=5)
    counts = counted_collectives()
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(3, 90, (length,), generator=generator).tolist() for length in (16, 11))]
    inputs, labels = collate_causal_lm(rows, 16, pad_id=0)
    results = {}
    for family in families:
        for layers in LAYERS:
            config = copy.deepcopy({**TINY_CONFIGS, **MOE_CONFIGS}[family]())
            config.num_hidden_layers = layers
            if getattr(config, "layer_types", None):
                config.layer_types = config.layer_types[:layers]
            if getattr(config, "mlp_only_layers", None):
                config.mlp_only_layers = []  # every layer sparse: the per-layer difference is a sparse layer's
            torch.manual_seed(0)
            module = build_pipeline_module(config, parallel_topology(1, 2), sequence_parallel=True,
                                           loss_chunk_tokens=loss_chunk_tokens, row_layout="padded")
            counts.clear()
            loss = module.loss_fn(module(inputs), labels)
            forward = dict(counts)
            counts.clear()
            loss.backward()
            results[f"{family}/{layers}"] = {"forward": forward, "backward": dict(counts)}
    torch.distributed.barrier()
    return results


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--families", nargs="+", default=FAMILIES)
    parser.add_argument("--loss-chunk-tokens", type=int, default=1024, help="0: the logits head")
    args = parse_args(parser, families=["llama3", "qwen3_moe"])
    results = spawn(worker, 2, args.families, args.loss_chunk_tokens)[0]
    print(f"tensor parallel 2, sequence parallel, loss_chunk_tokens={args.loss_chunk_tokens}, one micro-batch")
    for family in args.families:
        small, large = (results[f"{family}/{layers}"] for layers in LAYERS)
        layer = {way: {name: (large[way].get(name, 0) - small[way].get(name, 0)) / (LAYERS[1] - LAYERS[0])
                       for name in sorted(set(large[way]) | set(small[way]))} for way in ("forward", "backward")}
        per_layer = {way: sum(calls.values()) for way, calls in layer.items()}
        rest = sum(small[way].get(name, 0) for way in small for name in small[way]) - \
            LAYERS[0] * sum(per_layer.values())
        kinds = ", ".join(f"{name} {calls:g}" for name, calls in sorted(
            (name, layer["forward"].get(name, 0) + layer["backward"].get(name, 0))
            for name in set(layer["forward"]) | set(layer["backward"])) if calls)
        print(f"{family}: per decoder layer {sum(per_layer.values()):g} collectives (forward "
              f"{per_layer['forward']:g}, backward {per_layer['backward']:g}: {kinds}); embedding, final norm and "
              f"head {rest:g}")


if __name__ == "__main__":
    main()

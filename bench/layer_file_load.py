"""Loading layer files into a stage's parameters on the CPU, the current checkpoints/layer_files.py against an
earlier revision's (git), on the same converted ~1B-parameter bf16 model: wall time of reading every layer file into
its built layer, rounds interleaved, and whether both give bit-identical parameters.

    python bench/layer_file_load.py [--before 0fd4eb8] [--rounds 5] [--work-dir DIR]
"""
import os
import shutil
import tempfile

from common import (bench_parser, machine_note, module_at, parse_args, round_ratios, run_python, spread,  # noqa: E402
                    timed_rounds)
from load_memory import MODEL, SMOKE_MODEL, SMOKE_SHARD_SIZE, SHARD_SIZE, make_model  # noqa: E402

import torch  # noqa: E402


def built_layers(ds_dir, fields):
    """{pipeline index: (layer, its files)} of the whole model, built in bf16 as a stage builds them."""
    from transformers import LlamaConfig

    from models.layout import layer_file_path
    from models.pipeline import build_pipeline_layers
    config = LlamaConfig(**fields)
    torch.set_default_dtype(torch.bfloat16)
    layers = {}
    tag_dir = os.path.join(ds_dir, open(os.path.join(ds_dir, "latest")).read().strip())
    for index, spec in enumerate(build_pipeline_layers(config)):
        path = layer_file_path(tag_dir, index)
        if os.path.exists(path):
            layers[index] = (spec.build(), [path])
    torch.set_default_dtype(torch.float32)
    return layers


def load_all(load_layer_slice, layers):
    for layer, paths in layers.values():
        load_layer_slice(layer, paths, 0, 1)


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--before", default="0fd4eb8", help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work-dir", default=None)
    args = parse_args(parser, before="HEAD", rounds=1)
    fields = SMOKE_MODEL if args.smoke else MODEL
    work = args.work_dir or tempfile.mkdtemp()
    hf_dir, ds_dir = os.path.join(work, "hf"), os.path.join(work, "ds")
    if not os.path.exists(ds_dir):
        make_model(0, hf_dir, fields, SMOKE_SHARD_SIZE if args.smoke else SHARD_SIZE)
        run_python(["convert2ckpt.py", "--model_name_or_path", hf_dir, "--output_dir", ds_dir])
    from checkpoints import layer_files
    contenders = {"before": module_at(args.before, "checkpoints/layer_files.py").load_layer_slice,
                  "now": layer_files.load_layer_slice}
    layers = {name: built_layers(ds_dir, fields) for name in contenders}
    seconds = timed_rounds({name: lambda load=load, built=layers[name]: load_all(load, built)
                            for name, load in contenders.items()}, args.rounds)
    identical = all(torch.equal(a, b) for (before, _), (now, _) in zip(layers["before"].values(),
                                                                        layers["now"].values())
                    for a, b in zip(before.state_dict().values(), now.state_dict().values()))
    size = sum(os.path.getsize(p) for _, paths in layers["now"].values() for p in paths) / 2**30
    print(f"{machine_note()}\n{len(layers['now'])} layer files, {size:.2f} GiB (bf16, pages cached after the first "
          f"round), 1 process, {args.rounds} interleaved rounds")
    for name, values in seconds.items():
        print(f"  {name:<7} {spread(values)} s")
    print(f"now / before: {round_ratios(seconds['now'], seconds['before'])}; parameters bit-identical: {identical}")
    if not args.work_dir:
        shutil.rmtree(work)

if __name__ == "__main__":
    main()

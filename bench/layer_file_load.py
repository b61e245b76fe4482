"""Loading layer files into a stage's parameters on the CPU, the current checkpoints/layer_files.py against an
earlier revision's (git), on the same converted ~1B-parameter bf16 model: wall time of reading every layer file into
its built layer, rounds interleaved, and whether both give bit-identical parameters.

    python bench/layer_file_load.py [--before 0fd4eb8] [--rounds 5] [--work-dir DIR]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, machine_note, module_at  # noqa: E402
from load_memory import MODEL, make_model  # noqa: E402

import torch  # noqa: E402



def built_layers(ds_dir):
    """{pipeline index: (layer, its files)} of the whole model, built in bf16 as a stage builds them."""
    from transformers import LlamaConfig

    from models.layout import layer_file_path
    from models.pipeline import build_pipeline_layers
    config = LlamaConfig(**MODEL)
    torch.set_default_dtype(torch.bfloat16)
    layers = {}
    tag_dir = os.path.join(ds_dir, open(os.path.join(ds_dir, "latest")).read().strip())
    for index, spec in enumerate(build_pipeline_layers(config)):
        path = layer_file_path(tag_dir, index)
        if os.path.exists(path):
            layers[index] = (spec.build(), [path])
    torch.set_default_dtype(torch.float32)
    return layers


def load_seconds(load_layer_slice, layers):
    start = time.perf_counter()
    for layer, paths in layers.values():
        load_layer_slice(layer, paths, 0, 1)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="0fd4eb8", help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    work = args.work_dir or tempfile.mkdtemp()
    hf_dir, ds_dir = os.path.join(work, "hf"), os.path.join(work, "ds")
    if not os.path.exists(ds_dir):
        make_model(0, hf_dir)
        subprocess.run([sys.executable, "convert2ckpt.py", "--model_name_or_path", hf_dir, "--output_dir", ds_dir],
                       cwd=ROOT, check=True, capture_output=True)
    from checkpoints import layer_files
    contenders = {"before": module_at(args.before, "checkpoints/layer_files.py").load_layer_slice, "now": layer_files.load_layer_slice}
    layers = {name: built_layers(ds_dir) for name in contenders}
    seconds = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, load in contenders.items():
            seconds[name].append(load_seconds(load, layers[name]))
    identical = all(torch.equal(a, b) for (before, _), (now, _) in zip(layers["before"].values(),
                                                                        layers["now"].values())
                    for a, b in zip(before.state_dict().values(), now.state_dict().values()))
    size = sum(os.path.getsize(p) for _, paths in layers["now"].values() for p in paths) / 2**30
    print(f"{machine_note()}\n{len(layers['now'])} layer files, {size:.2f} GiB (bf16, pages cached after the first "
          f"round), 1 process, {args.rounds} interleaved rounds")
    for name, values in seconds.items():
        print(f"  {name:<7} median {statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f})")
    ratios = [n / b for n, b in zip(seconds["now"], seconds["before"])]
    print(f"now / before: median {statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f}); "
          f"parameters bit-identical: {identical}")


if __name__ == "__main__":
    main()

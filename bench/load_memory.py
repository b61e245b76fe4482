"""Bounded load memory: loading a converted ~1B-parameter model on 2 pipeline ranks against every rank calling
from_pretrained on the whole model, and converting a sharded checkpoint.

1. Makes a random LLaMA of about 1B parameters (bf16, safetensors shards of SHARD_SIZE) in a temporary directory.
2. Conversion (python convert2ckpt.py): peak RSS against the largest shard plus the largest layer (target: within
   +10%), and wall time against reading every shard and writing the same bytes (target: <= 1.5x).
3. Loading: per-rank peak RSS of 2 ranks that build their stage and load its layer files through DeepSpeed
   (engine.load_checkpoint), against 2 processes that each call from_pretrained on the whole model (target: <= 0.6x).
Every figure is the peak RSS of a fresh process (Python, torch and the libraries included).

With --conversion-7b, the conversion figures are also measured on a LLaMA-2-7B-shaped checkpoint (13.5 GB, bf16,
uninitialised weights: their values do not matter to the I/O), where interpreter and import start-up weigh less.

  python bench/load_memory.py [--work-dir DIR] [--conversion-7b]
"""
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MIB, bench_parser, machine_note, parse_args, peak_rss_bytes, run_python, spawn  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=18, num_attention_heads=16,
             num_key_value_heads=16, max_position_embeddings=2048, tie_word_embeddings=False)
SHARD_SIZE = "500MB"
# MODEL's stand-in at the smoke size (--smoke), in several shards of SMOKE_SHARD_SIZE
SMOKE_MODEL = dict(MODEL, vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
SMOKE_SHARD_SIZE = "20KB"
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                 tie_word_embeddings=False)


def parameter_count(fields=MODEL):
    from transformers import LlamaConfig

    from models.partition import layer_parameter_counts
    return sum(layer_parameter_counts(LlamaConfig(**fields)))


def make_model(rank, hf_dir, fields=MODEL, shard_size=SHARD_SIZE, initialise=True):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if initialise:
        model = LlamaForCausalLM(LlamaConfig(**fields)).to(torch.bfloat16)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**fields))
        model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.save_pretrained(hf_dir, max_shard_size=shard_size)


# The I/O floor of a conversion, in a plain interpreter: read every shard, write the same bytes.
COPY_FILES = """
import os, shutil, sys
source, target, suffix = sys.argv[1:]
for name in sorted(os.listdir(source)):
    if name.endswith(suffix):
        with open(os.path.join(source, name), "rb") as src, open(os.path.join(target, name), "wb") as dst:
            shutil.copyfileobj(src, dst, 16 * 2**20)
"""


def copy_seconds(source, suffix, work):
    """(wall seconds, peak RSS) of reading every `suffix` file of source and writing the same bytes (COPY_FILES), the
    second of two runs: the first brings the files into the page cache, as they are for what it is set against."""
    target = os.path.join(work, "copy")
    for _ in range(2):
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
        seconds, peak = timed_python(["-c", COPY_FILES, source, target, suffix])
    shutil.rmtree(target)
    return seconds, peak


# The converter's fixed cost: interpreter, imports, and transformers parsing config.json (which imports its model
# package: seconds with transformers 5).
STARTUP = "import sys, checkpoints.hf_to_ds, transformers; transformers.AutoConfig.from_pretrained(sys.argv[1])"


def pipeline_load(rank, ds_dir):
    """One of 2 pipeline ranks: build its stage in bf16, load its layer files; its peak RSS."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from checkpoints.layer_files import load_layer_slice
    from models.pipeline import build_pipeline_module
    from cluster.distributed import init_distributed, parallel_topology

    init_distributed(timeout_minutes=30)
    module = build_pipeline_module(AutoConfig.from_pretrained(ds_dir), parallel_topology(2), dtype=torch.bfloat16,
                                   layer_loader=load_layer_slice)
    engine, _, _, _ = deepspeed.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True}})
    engine.load_checkpoint(ds_dir, load_module_only=True)
    dist.destroy_process_group()
    return peak_rss_bytes()


def transformers_load(rank, hf_dir):
    """One of 2 ranks loading the whole model; its peak RSS. transformers maps safetensors lazily, so the weights
    are read once (as the first training step would) to count them resident."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.sum()
    return peak_rss_bytes()


def timed_python(args):
    """(wall seconds, peak RSS in bytes) of `python ARGS`, its output left out."""
    _, peak, seconds = run_python(args)
    return seconds, peak


def largest_layer_bytes(ds_dir):
    tag_dir = os.path.join(ds_dir, open(os.path.join(ds_dir, "latest")).read().strip())
    return max(os.path.getsize(os.path.join(tag_dir, n)) for n in os.listdir(tag_dir) if n.startswith("layer_"))


def bench_conversion(hf_dir, ds_dir, work):
    shards = [os.path.join(hf_dir, n) for n in os.listdir(hf_dir) if n.endswith(".safetensors")]
    copied_seconds, _ = copy_seconds(hf_dir, ".safetensors", work)
    startup_seconds, _ = timed_python(["-c", STARTUP, hf_dir])
    convert_seconds, convert_peak = timed_python(["convert2ckpt.py", "--model_name_or_path", hf_dir, "--output_dir",
                                                  ds_dir])
    largest_shard = max(os.path.getsize(s) for s in shards)
    bound = largest_shard + largest_layer_bytes(ds_dir)
    print(f"conversion of {len(shards)} shards ({sum(os.path.getsize(s) for s in shards) / MIB:.0f} MiB): "
          f"peak RSS {convert_peak / MIB:.0f} MiB = {convert_peak / bound:.2f}x (largest shard "
          f"{largest_shard / MIB:.0f} MiB + largest layer {(bound - largest_shard) / MIB:.0f} MiB; target <= 1.10x)")
    work_seconds = convert_seconds - startup_seconds
    print(f"conversion wall time {convert_seconds:.1f} s = {convert_seconds / copied_seconds:.2f}x reading every "
          f"shard and writing the same bytes ({copied_seconds:.1f} s; target <= 1.5x); of which start-up (Python, "
          f"torch, transformers imports, config parsing) {startup_seconds:.1f} s, the conversion itself "
          f"{work_seconds:.1f} s = {work_seconds / copied_seconds:.2f}x", flush=True)


def bench_loading(hf_dir, ds_dir):
    ours, theirs = spawn(pipeline_load, 2, ds_dir), spawn(transformers_load, 2, hf_dir)
    print(f"load, per-rank peak RSS: pipeline (2 stages) {[round(p / MIB) for p in ours]} MiB, from_pretrained "
          f"{[round(p / MIB) for p in theirs]} MiB: {max(ours) / max(theirs):.2f}x (target <= 0.6x)")


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--work-dir", help="where the model and its conversion go (default: a temporary directory)")
    parser.add_argument("--conversion-7b", action="store_true", help="also convert a LLaMA-2-7B-shaped checkpoint")
    args = parse_args(parser)
    fields, shard_size = (SMOKE_MODEL, SMOKE_SHARD_SIZE) if args.smoke else (MODEL, SHARD_SIZE)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        hf_dir, ds_dir = os.path.join(work, "hf"), os.path.join(work, "ds")
        spawn(make_model, 1, hf_dir, fields, shard_size)
        print(f"model: {parameter_count(fields) / 1e9:.2f}B parameters {fields}, bf16, shards of {shard_size}",
              flush=True)
        bench_conversion(hf_dir, ds_dir, work)
        bench_loading(hf_dir, ds_dir)
    if args.conversion_7b:
        with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
            hf_dir = os.path.join(work, "hf")
            spawn(make_model, 1, hf_dir, LLAMA2_7B, "5GB", False)
            print("LLaMA-2-7B-shaped model, bf16, shards of 5GB", flush=True)
            bench_conversion(hf_dir, os.path.join(work, "ds"), work)
    print(machine_note())

if __name__ == "__main__":
    main()

"""async_save against a synchronous save at 1B parameters on this CPU (issue 49): the training time one save takes
from the trainer, and the pace of training steps while the writer process writes.

One rank (a 1-rank gloo group: complete_if_written's all-reduce runs as in training). Its checkpoint: the layer
files of load_memory.py's ~1.1B LLaMA in bf16 (2.2 GB in 21 files, one per layer, as DeepSpeed's pipeline writes
them), without optimizer state (with it, 8x the bytes: more than this shared host holds twice). A step: a fixed fp32
matmul workload on one thread, then the optimizer step (the trainer's core; the copier thread and the writer
process take the other). Rounds alternate, after one
asynchronous save that allocates the snapshot's shared memory (reported apart):
  sync   save_checkpoint's path: each layer's tensors cloned (DeepSpeed's save_state_dict does), the file
         torch.save'd through hashing_saves (fsynced and hashed by a second thread);
  async  BackgroundSave: the save lays the snapshot out (each tensor's reused host buffer, in place of DeepSpeed's
         clone; the trainer waits for that) and hands its copy to a thread; the steps after it run while that
         thread copies (their optimizer step waits for it) and the writer process writes, fsyncs and hashes, each
         step followed by complete_if_written, as the loop does;
  steps  steps with no save in flight, right before the asynchronous save and right after its write: the normal
         pace.
Lost per asynchronous save: the save call + what the steps during the copy and the write took beyond the normal
pace.

  python bench/async_save.py [--rounds 3] [--num-layers 18] [--step-matmuls 12] [--model-step-seq 0]
"""
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_parser, free_port, machine_note, parse_args, spread  # noqa: E402
from load_memory import MODEL, SMOKE_MODEL  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save  # noqa: E402
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine  # noqa: E402
from deepspeed.runtime.pipe.schedule import OptimizerStep  # noqa: E402

from checkpoints.background_save import BackgroundSave  # noqa: E402
from checkpoints.saving import hashing_saves  # noqa: E402
from engines.instruction_listeners import add_instruction_listener  # noqa: E402

STEP_MATMULS = 12  # a step: this many 1024 x 1024 fp32 matmuls (about 0.3 s on one core), unless --step-matmuls
BASELINE_STEPS = 8  # unless --baseline-steps


def layer_files(num_layers, fields=MODEL):
    """{file name: state dict} of the model's layers, bf16, random."""
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{**fields, "num_hidden_layers": num_layers}))
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for parameter in model.parameters():
        parameter.data.normal_()
    files = {"layer_00-model_states.pt": model.model.embed_tokens.state_dict()}
    for index, layer in enumerate(model.model.layers):
        files[f"layer_{index + 1:02d}-model_states.pt"] = layer.state_dict()
    files[f"layer_{len(model.model.layers) + 1:02d}-model_states.pt"] = {
        **{f"norm.{k}": v for k, v in model.model.norm.state_dict().items()}, **model.lm_head.state_dict()}
    return files


class Trainer:
    """The pipeline engine as BackgroundSave hears it: the instruction handlers its steps run; a step's optimizer
    step (here changing nothing) is where a snapshot's copy must be done."""
    _INSTRUCTION_MAP = {OptimizerStep: lambda engine: None}


def step(a, b, trainer, matmuls):
    """Forward and backward (the matmuls), then the optimizer step: (seconds of the step, of its optimizer step, the
    trainer thread's CPU seconds in the step's matmuls: what the writer's and the copier's memory traffic slows,
    whatever else the host runs)."""
    start, cpu_start = time.perf_counter(), time.thread_time()
    for _ in range(matmuls):
        torch.mm(a, b)
    optimizer_start, cpu = time.perf_counter(), time.thread_time() - cpu_start
    trainer._INSTRUCTION_MAP[OptimizerStep](trainer)
    return time.perf_counter() - start, time.perf_counter() - optimizer_start, cpu


def model_step_seconds(num_layers, seq_len, fields=MODEL):
    """CPU seconds of one forward and backward of the model itself, fp32, micro-batch 1 x seq_len, on this thread:
    how long a real step of it is against the bench's matmul step (the step length the copy hides behind)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(**{**fields, "num_hidden_layers": num_layers}))
    tokens = torch.randint(0, fields["vocab_size"], (1, seq_len))
    seconds = []
    for _ in range(2):  # the first allocates what the second reuses
        start = time.thread_time()
        model(input_ids=tokens, labels=tokens).loss.backward()
        seconds.append(time.thread_time() - start)
    return seconds[-1]


def normal_steps(run_step, count):
    return [run_step() for _ in range(count)]


def save_layers(files, tag_dir, engine):
    """The layer files as DeepSpeed's PipelineModule.save_state_dict hands them to the checkpoint engine: each state
    dict cloned first (clone_tensors_for_torch_save) where the engine preserves storage sharing."""
    for name, state in files.items():
        engine.save(clone_tensors_for_torch_save(state) if engine.preserves_storage_sharing() else state,
                    os.path.join(tag_dir, name))


def files_bytes(files):
    return sum(t.numel() * t.element_size() for state in files.values() for t in state.values())


def sync_save(files, tag_dir, engine):
    os.makedirs(tag_dir)
    start = time.perf_counter()
    with hashing_saves(engine):
        save_layers(files, tag_dir, engine)
    return time.perf_counter() - start


def async_save(files, tag_dir, engine, background, run_step):
    """(seconds the save call took, [step(...) while the copy or the write was in flight])."""
    os.makedirs(tag_dir)
    start = time.perf_counter()
    with background.snapshots(engine) as snapshot:
        save_layers(files, tag_dir, engine)
    background.submit(snapshot, tag_dir, completion=lambda written: None, needed_bytes=files_bytes(files))
    call_seconds = time.perf_counter() - start
    during = []
    while True:
        seconds = run_step()
        done = background.complete_if_written()
        during.append(seconds)
        if done:
            return call_seconds, during


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-matmuls", type=int, default=STEP_MATMULS,
                        help="a step's forward and backward: this many matmuls (more: a longer step)")
    parser.add_argument("--num-layers", type=int, default=MODEL["num_hidden_layers"],
                        help="decoder layers (fewer: a quick check of the script, not the 1B figure)")
    parser.add_argument("--model-step-seq", type=int, default=0,
                        help="first time one forward and backward of the model itself at this sequence length")
    parser.add_argument("--baseline-steps", type=int, default=BASELINE_STEPS,
                        help="steps at the normal pace before and after each asynchronous save")
    args = parse_args(parser, rounds=1, step_matmuls=1, num_layers=SMOKE_MODEL["num_hidden_layers"], model_step_seq=16,
                      baseline_steps=2)
    fields = SMOKE_MODEL if args.smoke else MODEL
    torch.set_num_threads(1)
    if args.model_step_seq:
        print(f"the model's own step (fp32, forward + backward, micro-batch 1 x {args.model_step_seq} tokens, one "
              f"thread): {model_step_seconds(args.num_layers, args.model_step_seq, fields):.2f} CPU s", flush=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    files = layer_files(args.num_layers, fields)
    size = files_bytes(files)
    parameters = sum(t.numel() for state in files.values() for t in state.values())
    engine, trainer = TorchCheckpointEngine(), Trainer()
    background = BackgroundSave()
    add_instruction_listener(trainer, background)
    engine.zipfile_serialization = True  # DeepSpeed's default (checkpoint_serialization), which the trainer keeps
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    run_step = functools.partial(step, a, b, trainer, args.step_matmuls)
    out = tempfile.mkdtemp(prefix="async_save_bench.")
    try:
        first_call, _ = async_save(files, os.path.join(out, "first"), engine, background, run_step)
        shutil.rmtree(os.path.join(out, "first"))
        results = {"sync": [], "call": [], "wait": [], "lost": [], "pace": [], "steps_during": [], "normal_step": [],
                   "cpu_pace": [], "cpu_lost": []}
        for round_index in range(args.rounds):
            order = ("sync", "async") if round_index % 2 == 0 else ("async", "sync")
            for kind in order:
                tag_dir = os.path.join(out, f"{kind}{round_index}")
                if kind == "sync":
                    results["sync"].append(sync_save(files, tag_dir, engine))
                else:  # the normal pace: the steps right before the save and right after its write
                    before = normal_steps(run_step, args.baseline_steps)
                    call_seconds, during = async_save(files, tag_dir, engine, background, run_step)
                    normal = before + normal_steps(run_step, args.baseline_steps)
                    normal_step, normal_cpu = (statistics.median(s[i] for s in normal) for i in (0, 2))
                    wait = sum(optimizer for _, optimizer, _ in during)
                    results["call"].append(call_seconds)
                    results["wait"].append(wait)
                    results["lost"].append(call_seconds + sum(seconds - normal_step for seconds, _, _ in during))
                    results["pace"].append(normal_step / statistics.median(seconds for seconds, _, _ in during))
                    results["cpu_lost"].append(call_seconds + wait + sum(cpu - normal_cpu for _, _, cpu in during))
                    results["cpu_pace"].append(normal_cpu / statistics.median(cpu for _, _, cpu in during))
                    results["steps_during"].append(len(during))
                    results["normal_step"].append(normal_step)
                shutil.rmtree(tag_dir)
            print(f"round {round_index + 1}: sync {results['sync'][-1]:.2f} s; async: save call "
                  f"{results['call'][-1]:.2f} s, optimizer steps waiting for the copy {results['wait'][-1]:.2f} s, "
                  f"lost {results['lost'][-1]:.2f} s, {results['steps_during'][-1]} steps during the copy and the "
                  f"write at {results['pace'][-1]:.2f} of the normal pace ({results['normal_step'][-1]:.3f} s a "
                  f"step); by the trainer's CPU time: lost {results['cpu_lost'][-1]:.2f} s, pace "
                  f"{results['cpu_pace'][-1]:.2f}", flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"checkpoint: {parameters / 1e9:.2f}B parameters, {size / 2**30:.2f} GiB bf16 in {len(files)} layer files; "
          f"{args.rounds} interleaved rounds; {machine_note()}")
    print(f"first asynchronous save (allocating the shared memory): {first_call:.2f} s of save call")
    print(f"synchronous save (the trainer waits): {spread(results['sync'], 2)} s")
    print(f"asynchronous save, the save call (the trainer waits): {spread(results['call'], 2)} s")
    print(f"asynchronous save, the optimizer steps' wait for the copy: {spread(results['wait'], 2)} s")
    lost_share = statistics.median(results['lost']) / statistics.median(results['sync'])
    print(f"asynchronous save, training time lost (save call + slower steps during the copy and the write): "
          f"{spread(results['lost'], 2)} s = {lost_share:.1%} of the synchronous save's")
    print(f"steps during the background write: {spread(results['pace'], 2)} of the normal pace, "
          f"{spread(results['steps_during'], 2)} steps of {spread(results['normal_step'], 2)} s")
    print(f"by the trainer thread's CPU time (save call + optimizer steps' wait + the steps' extra CPU time during the "
          f"copy and the write): lost {spread(results['cpu_lost'], 2)} s = "
          f"{statistics.median(results['cpu_lost']) / statistics.median(results['sync']):.1%} of the synchronous "
          f"save's; steps at {spread(results['cpu_pace'], 2)} of the normal pace")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Every bench/ script at its smoke size (`--smoke`): it runs end to end and prints each of its figures with a number,
so that none rots when the code it measures moves. The figures at this size mean nothing. A script is any bench/*.py
that runs as one (its `__main__` guard); the others are the scripts' shared harness. Each script runs forked from the
rank zygote (tests/launch.py run_python), and its workers, child interpreters and training launches fork from it
(bench/common.py): no library is imported again. They run in the quick tier, on one pytest-xdist worker (one zygote),
but for the few in SLOW, whose smoke size still costs several CPU seconds."""
import glob
import importlib.util
import os
import pathlib
import re

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT
from tests.launch import check_ok, run_python
from training.config_checks import check_zbv_times

SCRIPTS = sorted(os.path.basename(path) for path in glob.glob(os.path.join(ROOT, "bench", "*.py"))
                 if "if __name__ == \"__main__\":" in pathlib.Path(path).read_text())
NUMBER = r"[-+]?[\d,]*\d(\.\d+)?(e[-+]?\d+)?"
SLOW = {  # script: why its smoke size is not cheap (CPU seconds measured with --cpu-durations)
    "async_save.py": "its writer is a fresh interpreter (checkpoints/background_save.py starts it with spawn, which "
                     "imports torch again) and the bench's steps run until it has written: ~7 CPU s at any size",
    "goodput.py": "a fault-free and a faulty supervised run, three attempts of DeepSpeed's runner, launcher and 2 "
                  "ranks: ~6 CPU s at the fewest steps that hold a fault and its restart",
}
# Per script, the figures it prints: text, each # in it a number, each space any run of white space.
FIGURES = {
    "adam_step.py": ["per-tensor loop median #", "fused median #", "fused speed-up: #x",
                     "per-tensor loop # MiB, fused # MiB"],
    "async_save.py": ["the model's own step (fp32, forward + backward, micro-batch 1 x # tokens, one thread): # CPU s",
                      "round 1: sync # s; async: save call # s", "first asynchronous save (allocating the shared "
                      "memory): # s", "synchronous save (the trainer waits): median #",
                      "asynchronous save, the save call (the trainer waits): median #",
                      "training time lost (save call + slower steps during the copy and the write): median #",
                      "steps during the background write: median #", "the copy and the write): lost median #"],
    "attention_mask.py": ["(is_causal) saved activations # MiB forward+backward median #",
                          "(mask) saved activations # MiB forward+backward median #", "the mask's saved bytes: # MiB",
                          "the mask of packed documents # MiB"],
    "checksum_cost.py": ["hash xxh3_128 # GB/s", "hash crc32 # GB/s", "hash blake2b # GB/s",
                         "s with checksums, # s without: #x", "verify (pages cached) # s", "+ os.sync(): # s"],
    "context_parallel.py": ["2 data-parallel) activations per rank # MiB tokens/s median #",
                            "context 2 activations per rank # MiB tokens/s median #",
                            "context 2 / whole: activations #x, tokens/s #x"],
    "expert_loading.py": ["one sparse layer, bf16: experts # MiB, the rest # MiB",
                          "expert parallel 2, rank 1: read # MiB; minus the rest: # of the layer's expert bytes "
                          "(1/2 = #)"],
    "expert_parallel.py": ["experts replicated CPU s per step (4 ranks) median # (min #, max #) expert weights per "
                           "rank # MiB", "expert parallel 2 CPU s per step (4 ranks) median # (min #, max #) expert "
                           "weights per rank # MiB", "expert parallel 2 / replicated: CPU s per step #x (rounds #-#), "
                           "expert weights per rank #x"],
    "moe_block.py": ["pipeline CPU s median # (min #, max #)", "transformers grouped_mm CPU s median # (min #, max #)",
                     "transformers eager CPU s median # (min #, max #)",
                     "pipeline speed-up over transformers eager: #x (rounds #-#)",
                     "pipeline speed-up over transformers grouped_mm: #x (rounds #-#)"],
    "moe_dispatch_bytes.py": [*(f"{name}: # experts, top-#" for name in ("deepseek_v3", "qwen3_30b_a3b")),
                              "ranks a token goes to: mean #, max #",
                              "before: there # MiB + back # MiB a rank a layer forward, off the rank # MiB",
                              "now: there # MiB + back # MiB a rank a layer forward, off the rank # MiB",
                              "now / before: the way there #, a layer's forward and backward #, off the rank #"],
    "gated_delta_rule.py": ["transformers CPU s median # (min #, max #)", "pipeline CPU s median # (min #, max #)",
                            "speed-up over transformers: #x (rounds #-#)",
                            "max |pipeline - transformers| / max |transformers|: output #, input gradient #, weight "
                            "gradients #"],
    "hybrid_pipeline.py": ["llama tokens/s median # (min #, max #); CPU s a step: stage 0 #, stage 1 #",
                           "qwen3_5 tokens/s median # (min #, max #); CPU s a step: stage 0 #, stage 1 #",
                           "qwen3_5 / llama tokens/s per round: median # (min #, max #)"],
    "goodput.py": ['"goodput": #', '"target_goodput": #', '"detect_s": #', '"restart_s": #',
                   '"final_weights_equal": true'],
    "grad_accumulation_cost.py": ["sums in bf16: step median # (min #, max #) s, peak median #",
                                  "sums in fp32: step median # (min #, max #) s, peak median #",
                                  "fp32 / bf16 step time: #x (rounds #-#); fp32 - bf16 peak per round: # MiB"],
    "host_syncs.py": [f"{case} #" for case in ("1 micro-batches x 1 chunks", "1 micro-batches x 8 chunks",
                                                   "4 micro-batches x 1 chunks", "4 micro-batches x 8 chunks")],
    "indexed_data.py": ["prepare_data --workers 1 # tokens in # s: # tokens/s",
                        "datasets.map num_proc=1 # tokens in # s: # tokens/s",
                        *(f"{corpus} index {kind}: launch to step 1 logged # s, peak RSS # MiB (loss #"
                          for corpus in ("small", "big") for kind in ("built ", "cached")),
                        "after 1,000,000 samples: # / # / #", "over every prefix of 1,000,000: # samples"],
    "layer_file_load.py": ["before median # (min #, max #) s", "now median # (min #, max #) s",
                           "now / before: #x (rounds #-#); parameters bit-identical: True"],
    "layer_overhead.py": ["transformers # tokens/s #x transformers", "pipeline # tokens/s #x transformers",
                          "pipeline, logits head # tokens/s #x transformers"],
    "lm_loss.py": ["transformers # MiB #x transformers", "trainer, loss_impl=logits # MiB #x transformers",
                   "trainer, loss_impl=chunked # MiB #x transformers",
                   *(f"{way} # MiB #x # #x #-# #" for way in ("logits", "chunked 16"))],
    "load_memory.py": ["conversion of # shards (# MiB): peak RSS # MiB = #x",
                       "conversion wall time # s = #x reading every shard", "the conversion itself # s = #x",
                       "load, per-rank peak RSS: pipeline (2 stages) [#, #] MiB, from_pretrained [#, #] MiB: #x"],
    "lora.py": ["full: # tokens/s, peak RSS # MiB, checkpoint # MiB, export # MiB",
                "lora r2: # tokens/s, peak RSS # MiB, checkpoint # MiB, export # MiB",
                "LoRA / full: tokens/s #x (per round #), peak RSS #x (# vs # MiB), checkpoint # vs # MiB, peft "
                "adapter # MiB vs exported model # MiB"],
    "memory_plan_check.py": [f"{case} {stage} # # #" for case, stage in (
        ("weights, 2 stages, bf16, ZeRO-1, checkpointing", 0),
        ("weights, 2 stages, bf16, ZeRO-1, checkpointing", 1))] + ["largest deviation: #%"],
    "offload_memory_check.py": [f"{case} {stage} # # # #" for case, stage in (
        ("weights, 2 stages, bf16, ZeRO-1, offload, checkpointing", 0),
        ("weights, 2 stages, bf16, ZeRO-1, offload, checkpointing", 1))] + [
        "largest deviation: #%", "CPU Adam: # M parameters/s on one core"],
    "supervisor_teardown.py": ['"kill_to_attempt_end_s": {\n  "this tree": [\n   #'],
    "tensor_parallel_memory.py": [
        *(f"{variant} # / # # # # #" for variant in (
            "tp2, sequence_parallel=false", "tp2, sequence parallel, gather kept",
            "tp2, sequence parallel, gather recomputed")),
        "tp2, sequence parallel, gather recomputed: pool on rank 0: gather float32 # elements (# MiB), input_grad "
        "float32 # elements (# MiB); gathers over the steps: # into the pool (1 distinct storage)"],
    "stage_cpu.py": ["this tree: CPU s per micro-batch median # (rounds #-#)"],
    "tp_collectives.py": [f"{family}: per decoder layer # collectives (forward #, backward #: all_gather_single #, "
                          "all_reduce #, reduce_scatter_single #); embedding, final norm and head #"
                          for family in ("llama3", "qwen3_moe")],
    "trainer_profile.py": ["matrix products # s (#%), attention kernels # s (#%), optimizer # s (#%), the rest # s",
                           "and nothing else: at most #x transformers' loop",
                           "round 1: two loops # tok/s (# per CPU s), 2 stages zbv # tok/s (# per CPU s)",
                           "2 stages zbv ÷ two loops: # (rounds #-#), # of the "
                           "1F1B bound #", "2 stages zbv measured ÷ 2 stages zbv: #",
                           "in CPU seconds, 2 stages zbv ÷ two loops: #",
                           "2 stages zbv: CPU ms per micro-batch F/B/W stage 0 #/#/#, stage 1 #/#/#",
                           "2 stages zbv: compute per step against the plan's FLOPs: stage 0 # ms vs plan # ms (#%)",
                           "2 stages zbv measured: zbv_times=[[#, #, #], [#, #, #]]"],
    "length_buckets.py": [*(f"{name}: # rows, steps # positions wide on average (widths [#" for name in (
        "padded", "buckets", "packing")), "#% of the positions real, # s/step, # real tokens/s, # learned tokens/s",
        "real tokens/s against padding to seq_length: buckets [64, 96, 128, 192] #x, packing #x"],
    "lm_eval_throughput.py": ["in-loop eval_tasks # s # requests/s # request tokens/s # padded tokens/s",
                              "training forward (eval_batch) # s # requests/s # tokens/s",
                              "lm_eval HFLM # s # requests/s # request tokens/s"],
    "grad_accumulation.py": ["# micro-batches: relative error against fp64, worst of #: bf16 sum #, fp32 sum # (#x"],
    "moe_weight_grads.py": [*(f"{split}: F # B # W # ms; zero_bubble bubble #% step #x 1F1B's, zbv bubble #% step #x "
                              "1F1B's" for split in ("experts in W", "experts in B")),
                            "undivided: F # B # W # ms; 1f1b bubble #% step #x 1F1B's"],
    "packing_efficiency.py": [f"packing={p}: # rows of #, #% of row tokens real, # learned tokens/step, # s/step, # "
                              "learned tokens/s" for p in ("false", "true")] + ["packing true / false: #x"],
    "pipeline_efficiency.py": [
        "p=2 m= 2 lockstep cores # tok/s in lockstep # tok/s ratio #",
        *(f"p=2 m= 2 {schedule} cores # tok/s pipeline # tok/s ratio # (rounds #-#; to the cores in lockstep #) "
          "simulated # (step # s, simulated # s, #%; at the copies' compute speed #) 1F1B bound # efficiency vs "
          "bound #"
          for schedule in ("1f1b", "zero_bubble")),
        "zero_bubble, m=2, per micro-batch: stage 0: F # B # W # ms; stage 1: F # B # W # ms; optimizer # ms/step",
        "stage 1 time: compute #%", "the 1F1B bubble alone idles each stage #% of a step",
        "peak RSS until the last W, m= 2 zero_bubble stage 0: # MiB (+#) stage 1: # MiB (+#)",
        "peak RSS over the step, m= 2 1f1b stage 0: # MiB (+#) stage 1: # MiB (+#)",
        "zero_bubble / 1f1b: stage 0 # (rise #) stage 1 # (rise #)"],
    "preference.py": ["sft # tokens/s #x the SFT step", "dpo # tokens/s #x the SFT step",
                      "reference pass # tokens/s #x the SFT step", "sft: a step's peak RSS rise # MiB",
                      "dpo: a step's peak RSS rise # MiB"],
    "resume_layout.py": ["checkpoint # MiB in # files, largest layer optimizer state # MiB",
                         *(f"resume on {layout}: load # s (after allocating the optimizer state, # s); per-rank peak "
                           "RSS while loading +[#, #] MiB above the built engine and its optimizer state ([#, #] MiB) "
                           "= #x" for layout in ("2 stages (as written)", "1 stage x tensor parallel 2")),
                         "copying the same # MiB (read, write): # s, peak RSS # MiB",
                         "DeepSpeed ds_to_universal.py on it"],
    "moe_block.py": ["transformers (grouped_mm) median #", "transformers (eager loop) median #", "pipeline median #",
                     "speed-up over transformers (grouped_mm): #x (rounds #-#)",
                     "speed-up over transformers (eager loop): #x (rounds #-#)",
                     "max |pipeline - transformers|: output #, input gradient #, weight gradients #"],
    "schedule_simulator.py": ["llama_65b on paper", *(f"p=8 m= 64 {name} step # F bubble #%" for name in (
        "1f1b", "zero_bubble", "zero_bubble max_waiting=0", "interleaved_1f1b v=2", "zbv"))],
}


def pattern(figure):
    return re.escape(figure).replace(r"\#", NUMBER).replace(r"\ ", r"\s+")


def test_every_bench_script_names_its_figures():
    assert sorted(FIGURES) == SCRIPTS and set(SLOW) <= set(SCRIPTS)


def test_a_figure_is_found_only_with_its_number():
    assert re.search(pattern("fused speed-up: #x"), "  fused speed-up: 4.59x\n")
    assert re.search(pattern("bf16 sum #, fp32"), "bf16 sum 1.18e-03, fp32")
    assert not re.search(pattern("fused speed-up: #x"), "  fused speed-up: nanx\n")


@pytest.mark.xdist_group("bench")
@pytest.mark.parametrize("script", [pytest.param(script, marks=pytest.mark.slow) if script in SLOW else script
                                    for script in SCRIPTS])
def test_bench_script_prints_its_figures_at_smoke_size(script):
    output = check_ok(run_python([os.path.join("bench", script), "--smoke"], timeout=300)).stdout
    missing = [figure for figure in FIGURES.get(script, ["(no figures named)"])
               if not re.search(pattern(figure), output)]
    assert not missing, f"{missing} not in:\n{output}"


def test_zbv_times_measured_from_a_tiny_chunk_pass_the_trainers_check(monkeypatch):
    """A small chunk's W can take a tenth of its F (the smoke run's [[9, 6, 1], ...] that zbv_times refused): the bench
    raises each time to 1 / ZBV_TIMES_SPREAD of the longest, as the trainer's zbv_times=auto does."""
    spec = importlib.util.spec_from_file_location("trainer_profile", os.path.join(ROOT, "bench", "trainer_profile.py"))
    trainer_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer_profile)
    seconds = [{"F": 9.2e-3, "B": 6.1e-3, "W": 0.6e-3}, {"F": 6e-3, "B": 4e-3, "W": 0.2e-3}]
    monkeypatch.setattr(trainer_profile, "simulated_cpu_step", lambda profiles, schedule, micro_batches: (seconds, 0, 0))
    times = trainer_profile.measured_zbv_times({}, 4)
    assert times == [[9, 6, 2], [6, 4, 2]]
    check_zbv_times(OmegaConf.create({"zbv_times": times, "pipeline_schedule": "zbv", "num_stages": 2}))

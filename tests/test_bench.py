"""Every bench/ script at its smoke size (`--smoke`): it runs end to end and prints each of its figures with a number,
so that none rots when the code it measures moves. The figures at this size mean nothing. A script is any bench/*.py
that runs as one (its `__main__` guard); the others are the scripts' shared harness. Each script runs forked from the
rank zygote (tests/launch.py run_python), and its workers, child interpreters and training launches fork from it
(bench/common.py): no library is imported again."""
import glob
import os
import re

import pytest

from tests.conftest import ROOT
from tests.launch import check_ok, run_python

SCRIPTS = sorted(os.path.basename(path) for path in glob.glob(os.path.join(ROOT, "bench", "*.py"))
                 if "if __name__ == \"__main__\":" in open(path).read())
NUMBER = r"[-+]?[\d,]*\d(\.\d+)?(e[-+]?\d+)?"
# Per script, the figures it prints: text, each # in it a number, each space any run of white space.
FIGURES = {
    "adam_step.py": ["per-tensor loop median #", "fused median #", "fused speed-up: #x",
                     "per-tensor loop # MiB, fused # MiB"],
    "attention_mask.py": ["(is_causal) saved activations # MiB forward+backward median #",
                          "(mask) saved activations # MiB forward+backward median #", "the mask's saved bytes: # MiB",
                          "the mask of packed documents # MiB"],
    "checksum_cost.py": ["hash xxh3_128 # GB/s", "hash crc32 # GB/s", "hash blake2b # GB/s",
                         "s with checksums, # s without: #x", "verify (pages cached) # s", "+ os.sync(): # s"],
    "context_parallel.py": ["2 data-parallel) activations per rank # MiB tokens/s median #",
                            "context 2 activations per rank # MiB tokens/s median #",
                            "context 2 / whole: activations #x, tokens/s #x"],
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
                        "no PREFIX.json: launch to step 1 logged # s, peak RSS # MiB",
                        "PREFIX.json : launch to step 1 logged # s, peak RSS # MiB",
                        "index cached : launch to step 1 logged # s, peak RSS # MiB",
                        "after 1,000,000 samples: # / # / #", "over every prefix of 1,000,000: # samples"],
    "lm_eval_throughput.py": ["in-loop eval_tasks # s # requests/s # request tokens/s # padded tokens/s",
                              "training forward (eval_batch) # s # requests/s # tokens/s",
                              "lm_eval HFLM # s # requests/s # request tokens/s"],
    "grad_accumulation.py": ["# micro-batches: relative error against fp64, worst of #: bf16 sum #, fp32 sum # (#x"],
    "schedule_simulator.py": ["llama_65b on paper", *(f"p=8 m= 64 {name} step # F bubble #%" for name in (
        "1f1b", "zero_bubble", "zero_bubble max_waiting=0", "interleaved_1f1b v=2", "zbv"))],
}


def pattern(figure):
    return re.escape(figure).replace(r"\#", NUMBER).replace(r"\ ", r"\s+")


def test_every_bench_script_names_its_figures():
    assert sorted(FIGURES) == SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_prints_its_figures_at_smoke_size(script):
    output = check_ok(run_python([os.path.join("bench", script), "--smoke"], timeout=300)).stdout
    missing = [figure for figure in FIGURES.get(script, ["(no figures named)"])
               if not re.search(pattern(figure), output)]
    assert not missing, f"{missing} not in:\n{output}"

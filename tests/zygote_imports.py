"""What the rank zygote (tests/rank_zygote.py) imports once for every CPU rank it forks: the libraries only, so that
the project's own modules start fresh in each rank; the one exception is deepspeed_internals.registry (a leaf: DeepSpeed
and the standard library), whose start-up check reads DeepSpeed's source once here (~1 CPU s a rank), not its
verdict: each rank still runs the check on its own DeepSpeed objects."""
import functools
import gc
import importlib
import importlib.util
import os
import sys
import tempfile
import weakref

os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed picks its accelerator on import
for name in ("torch", "deepspeed", "transformers", "transformers.models.llama.modeling_llama", "datasets", "hydra",
             "safetensors.torch", "torch.nn.attention.bias",  # torch._dynamo, ~0.9 s
             # what a run imports on the way (~1 s a rank): its loss plot, its TensorBoard monitor, DeepSpeed's config
             # and its op probe, which compiles a test program (below)
             "matplotlib.pyplot", "torch.utils.tensorboard", "deepspeed.module_inject.auto_ep_config",
             "transformers.tokenization_utils_sentencepiece",
             # imported by DeepSpeed's ZeRO optimizer check: its torch.compile decorators import inductor (~2 s)
             "deepspeed.runtime.zero.muon.muon_optimizer"):
    importlib.import_module(name)
if importlib.util.find_spec("lm_eval"):  # an optional extra: what a run with eval_tasks imports (~0.2 s a rank)
    for name in ("lm_eval.evaluator", "lm_eval.models.huggingface", "lm_eval.tasks"):
        importlib.import_module(name)
importlib.import_module("deepspeed.ops").__compatible_ops__  # noqa: B018 (probed on first access, then kept)
# DeepSpeed's CPU Adam (offload_optimizer=cpu): py-cpuinfo's answer, which it asks in a new Python interpreter
# (deepspeed_internals/access.py ask_cpuinfo_once), and its op's load (a JIT build's checks), once here for every
# rank (~0.8 CPU s of each offload rank's start)
cpuinfo = importlib.import_module("cpuinfo")
cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
cpuinfo.get_cpu_info()
importlib.import_module("deepspeed.ops.op_builder").CPUAdamBuilder().load()
importlib.import_module("deepspeed_internals.registry").check_deepspeed_internals()  # its SOURCES, read once
if sys.dont_write_bytecode:  # PYTHONDONTWRITEBYTECODE: each rank would compile the project's modules again (~0.3 s);
    # their bytecode goes to a cache outside the repository (set after the imports above, which have theirs already)
    sys.dont_write_bytecode, sys.pycache_prefix = False, os.path.join(tempfile.gettempdir(), "rank-zygote-pycache")
# At its exit, each forked process would unregister, one by one, the ~190 torch.library ops these imports registered
# (their finalizers, ~0.05 CPU s a rank, writing to memory shared with the zygote): its end drops them anyway.
unregister = importlib.import_module("torch.library")._del_library
for finalizer in list(weakref.finalize._registry):
    if finalizer.alive and finalizer.peek()[1] is unregister:
        finalizer.atexit = False
# What is loaded by now lives as long as the process: out of the garbage collector's sight, or each full collection
# walks its ~600k objects again in every rank (0.33 CPU s; DeepSpeed's engines call gc.collect() as they start)
gc.freeze()

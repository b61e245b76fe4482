"""What the rank zygote (tests/rank_zygote.py) imports once for every CPU rank it forks: the libraries only, so that
the project's own modules start fresh in each rank."""
import importlib
import os

os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed picks its accelerator on import
for name in ("torch", "deepspeed", "transformers", "transformers.models.llama.modeling_llama", "datasets", "hydra",
             "safetensors.torch", "torch.nn.attention.bias"):  # the last: torch._dynamo, ~0.9 s
    importlib.import_module(name)

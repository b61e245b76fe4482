"""The model's math for one device, the pipeline layers that wrap it, and the transformations that parallelise it.

`from models import from_hf` reads a Hugging Face directory into a single-device torch module (models/causal_lm.py).
"""

# The label of a position that learns nothing (padding, prompts, each later document's first token): transformers'
# and torch's cross-entropy's ignore_index. The data's collators write it, the losses skip it.
IGNORE_INDEX = -100


def __getattr__(name):
    # Imported on first use: the pipeline's processes import models' modules without building this one.
    if name == "from_hf":
        from models.causal_lm import from_hf
        return from_hf
    raise AttributeError(f"module 'models' has no attribute {name!r}")

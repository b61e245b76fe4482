"""Loading DeepSpeed's own training state files (mp_rank_*_model_states.pt, the ZeRO *_optim_states.pt) and the
trainer's RNG state without running code from them: torch.load(weights_only=True), allowing exactly the
non-tensor types those files hold. DeepSpeed 0.19's TorchCheckpointEngine loads them with weights_only=False."""
import numpy as np

from checkpoints.layer_files import load_weights_only
from deepspeed_internals.registry import (DynamicLossScaler, LossScaler, TorchCheckpointEngine, ZeroStageEnum,
                                          fragment_address)

# What DeepSpeed's state files hold besides tensors and containers (found with
# torch.serialization.get_unsafe_globals_in_checkpoint on fp32, bf16 and ZeRO-1 checkpoints; fp16's scaler too).
DEEPSPEED_STATE_TYPES = (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)
# numpy's RNG state is a uint32 array: pickled through numpy's array reconstructor, its dtype and the dtype's class.
NUMPY_ARRAY_TYPES = (np.ndarray, np.dtype, type(np.dtype(np.uint32)), np.zeros(0).__reduce__()[0])
STATE_ADVICE = ("a training checkpoint holds only tensors and DeepSpeed's state types; resume from a checkpoint "
                "written by this trainer, or start from its weights alone after exporting and converting them from "
                "a source you trust.")


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, whose loads run no code from the file."""

    def load(self, path, map_location=None):
        return load_weights_only(path, DEEPSPEED_STATE_TYPES, STATE_ADVICE, mmap=False, map_location=map_location)


def load_rng_file(path):
    return load_weights_only(path, NUMPY_ARRAY_TYPES, STATE_ADVICE, mmap=False)

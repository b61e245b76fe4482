"""The multi-token-prediction layer's tensors between the carried file and a run training it
(models/multi_token_prediction.py). A converted model carries the MTP layer as the hub stores it
(models/layout.py CARRIED_FILE_NAME: DeepSeek-V3's model.layers.{L}.*, one tensor per expert); a run with
mtp_loss_scale > 0 starts the layer from there, its final-norm layer file then holds it under `mtp.` (experts fused,
as the pipeline's decoder layers hold them), and export writes the trained tensors back under the hub's names in
place of the carried ones, the shared embedding's and head's copies DeepSeek-V3 stores beside them included."""
import os

import torch
from safetensors import safe_open

from models.layout import CARRIED_FILE_NAME, expert_piece
from models.multi_token_prediction import mtp_layout_of

MTP_PREFIX = "mtp."  # the MTP layer's keys in the final-norm layer's state dict


def carried_mtp_state(tag_dir, config):
    """{key of MultiTokenPrediction: tensor} from the carried file of a converted tag: each hub tensor under the
    layer's key, an expert's per-expert projections stacked into the fused tensors; the shared copies left out."""
    layout = mtp_layout_of(config)
    state, pieces = {}, {}
    with safe_open(os.path.join(tag_dir, CARRIED_FILE_NAME), framework="pt") as handle:
        for name, key, piece in carried_mtp_names(tag_dir, config):
            if piece is None:
                state[key] = handle.get_tensor(name)
            else:
                pieces.setdefault(key, {})[piece[1]] = (handle.get_tensor(name), piece[2])
    for key, stacked in pieces.items():
        parts = next(iter(stacked.values()))[1]
        experts = len(stacked) // parts
        state[key] = torch.stack([torch.cat([stacked[expert * parts + part][0] for part in range(parts)])
                                  for expert in range(experts)])
    return state


def carried_mtp_names(tag_dir, config):
    """[(hub name, key of MultiTokenPrediction, expert piece or None)] of the MTP tensors a converted tag carries
    (models/layout.py expert_piece); a one-line error, naming what to do, where it carries none."""
    path = os.path.join(tag_dir, CARRIED_FILE_NAME)
    layout = mtp_layout_of(config)
    names = []
    if os.path.isfile(path):
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                piece = expert_piece(name, config)
                key = layout.key_of(piece[0] if piece else name)
                if key is not None:
                    names.append((name, key, piece))
    if not names:
        raise FileNotFoundError(f"mtp_loss_scale > 0: {tag_dir} carries no multi-token-prediction tensors (under "
                                f"{layout.prefix}) to start the MTP layer from; convert the checkpoint again from a "
                                f"Hugging Face directory holding them, or set mtp_loss_scale=0.")
    return names


def shared_copies(config):
    """{hub name of a copy the MTP layer's checkpoint stores: the pipeline's HF name of the tensor it copies}
    (DeepSeek-V3's embedding and head beside its MTP layer), the head the embedding when tied."""
    layout = mtp_layout_of(config)
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if config.tie_word_embeddings else {}
    return {f"{layout.prefix}{copy}": tied.get(source, source) for copy, source in layout.shared}

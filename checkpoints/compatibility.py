"""Whether a saved training checkpoint resumes on this run: the same model, a layout its optimizer state can
follow, and what a change of layout or settings alters or drops."""
import json
import os

from errors import ConfigError
from models.partition import decoder_counts_of_bounds


def check_resume_topology(trainer_state, topology, weights_only, tag_dir):
    """A checkpoint written before the optimizer state was saved per layer: its state is laid out per stage (and per
    data-parallel rank under ZeRO-1) and cannot follow a change."""
    saved = trainer_state.get("topology")
    if saved and "stage_bounds" not in saved:  # written before the stages' layers were recorded
        topology = degrees_of(topology)
    if saved and saved != topology and not weights_only:
        only_layers_differ = "stage_bounds" in saved and degrees_of(saved) == degrees_of(topology)
        partition = (f", or partition={decoder_counts_of_bounds(saved['stage_bounds'])} to build the checkpoint's "
                     f"stages" if only_layers_differ else "")
        raise ConfigError(f"checkpoint {tag_dir} was trained with {saved}, this run has {topology}; its optimizer "
                          f"state (written before checkpoints saved it per layer) cannot follow a topology change. Set "
                          f"resume_weights_only=true to continue from its weights with a fresh optimizer (the data "
                          f"position is kept by consumed samples){partition}.")


def degrees_of(topology):
    """A saved or current topology without its stage bounds: the parallel degrees alone."""
    return {key: value for key, value in topology.items() if key != "stage_bounds"}


MODEL_SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")


def check_same_model(tag_dir, model_config):
    """A checkpoint resumes only onto the model it was trained as: its config.json against the run's model."""
    path = os.path.join(tag_dir, "config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        saved = json.load(f)
    current = model_config.to_dict()
    differ = [f"{key} {saved.get(key)} there, {current.get(key)} here" for key in MODEL_SHAPE_KEYS
              if saved.get(key) != current.get(key)]
    if differ:
        raise ConfigError(f"checkpoint {tag_dir} is of another model than model_name_or_path ({'; '.join(differ)}): "
                          f"resume a checkpoint of this model, or set model_name_or_path to the converted model the "
                          f"checkpoint was trained from.")


def dropped_state(saved_settings, settings):
    """What a resume under `settings` cannot carry over from a checkpoint written under saved_settings."""
    if saved_settings.get("precision") == "fp16" and settings["precision"] != "fp16":
        return [f"fp16's loss scale (the run goes from fp16 to {settings['precision']})"]
    return []


def layout_change(trainer_state, layout, settings):
    """'key: old -> new' for each thing a resume changes about the run that wrote the checkpoint."""
    unsplit = {"tensor_parallel": 1, "context_parallel": 1, "expert_parallel": 1}  # recorded only when > 1
    saved = {**unsplit, **trainer_state.get("topology", {}), **trainer_state.get("settings", {})}
    current = {**unsplit, **layout, **settings}
    return [f"{key} {saved[key]} -> {current[key]}" for key in current if key in saved and saved[key] != current[key]]

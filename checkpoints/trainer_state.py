"""trainer_state.json of a training checkpoint: the step, consumed samples, layout and settings it was written
under, and the optimizer's scalars (checkpoints/optimizer_state.py)."""
import json
import os

TRAINER_STATE_NAME = "trainer_state.json"


def write_trainer_state(tag_dir, trainer_state):
    with open(os.path.join(tag_dir, TRAINER_STATE_NAME), "w") as f:
        json.dump(trainer_state, f, indent=2)


def read_trainer_state(tag_dir):
    """{"step", "consumed_samples", "topology"} of a training checkpoint ({} for a converted model)."""
    path = os.path.join(tag_dir, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)

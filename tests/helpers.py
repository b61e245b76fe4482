"""Small helpers many test modules use, each written once: a run's config composed as trainer_pipe.py composes it,
a JSON-lines file written, a JSON file edited in place. (A launched run's metrics: tests/launch.py read_metrics.)"""
import json
import os

from tests.conftest import ROOT


def compose_configs(runs, config="tiny"):
    """Each list of Hydra overrides in `runs` composed on conf/<config>.yaml as trainer_pipe.py composes it, under
    one Hydra initialisation (~0.1 CPU s a run)."""
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        return [compose(config_name=config, overrides=list(overrides)) for overrides in runs]


def compose_config(overrides=(), config="tiny"):
    """One run's config: conf/<config>.yaml with the Hydra overrides."""
    return compose_configs([overrides], config)[0]


def write_jsonl(path, records):
    """The records as a JSON-lines file at path (a pathlib.Path), which it returns."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def edit_json(path, change):
    """A JSON file rewritten with change(content) applied to its content in place."""
    with open(path) as f:
        content = json.load(f)
    change(content)
    with open(path, "w") as f:
        json.dump(content, f)

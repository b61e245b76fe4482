"""Untrusted, truncated and corrupted files, and model directories without a tokenizer: each refused with the
project's own message naming the file (nothing written, no code run), or, for pre-tokenized data, trained on."""
import json
import os
import pathlib
import re
import shutil

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import LlamaConfig

from checkpoints.files import is_tokenizer_file
from checkpoints.hf_to_ds import convert_hf_to_ds
from tests import test_reliability
from tests.launch import check_ok, demo_overrides, launch_trainer, read_metrics, run_in_process
from tests.test_conversion import assert_nothing_written, convert_cli, save_as_bin
from tests.tiny_models import make_tiny_model
from training.run_spec import tokenizer_dir
from training.run_data import pad_token_id

small_disk = test_reliability.small_disk  # a fixture


class Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def flip_bytes(path, count=64):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def tag_dir(ckpt_dir):
    return pathlib.Path(ckpt_dir) / (pathlib.Path(ckpt_dir) / "latest").read_text().strip()


@pytest.mark.slow
@pytest.mark.parametrize("legacy", [True, False], ids=["legacy_pickle", "zip_with_code"])
def test_bin_whose_pickle_carries_code_is_refused_and_never_run(tmp_path, legacy):
    model = make_tiny_model("llama2", str(tmp_path / "safetensors"))
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    model.config.save_pretrained(hf_dir)
    marker = tmp_path / "payload_ran"

    def save(path, marker_path):
        state = {**model.state_dict(), "extra": Payload(str(marker_path))}
        torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    save(hf_dir / "pytorch_model.bin", marker)

    result = convert_cli("--model_name_or_path", str(hf_dir), "--output_dir", str(tmp_path / "out"))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    reason = ("is not in torch's zip format (a legacy pickle from torch < 1.6, or not a torch file), which cannot "
              "be loaded safely" if legacy else
              "cannot be loaded safely with torch.load(weights_only=True): its pickle refers to code")
    assert f"convert2ckpt: error: '{hf_dir / 'pytorch_model.bin'}' {reason}" in result.stderr
    assert "re-save it with a current torch" in result.stderr and "convert it to safetensors" in result.stderr
    assert not marker.exists()
    assert_nothing_written(tmp_path, str(tmp_path / "out"))
    # The file is armed: an unsafe load of the same content runs the payload.
    armed = tmp_path / "armed_ran"
    save(tmp_path / "armed.bin", armed)
    torch.load(tmp_path / "armed.bin", weights_only=False)
    assert armed.exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_truncated_shard_is_the_converters_error(tiny_checkpoints, tmp_path, kind):
    hf_dir = tmp_path / "hf"
    if kind == "safetensors":
        shutil.copytree(tiny_checkpoints["llama2"][0], hf_dir)
        shard = sorted(hf_dir.glob("model-*.safetensors"))[1]
    else:
        save_as_bin(make_tiny_model("llama2", str(tmp_path / "unused")), str(hf_dir), shards=1)
        shard = hf_dir / "pytorch_model.bin"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:size // 2])
    result = convert_cli("--model_name_or_path", str(hf_dir), "--output_dir", str(tmp_path / "out"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    expected = (f"is truncated: its header places tensor data up to byte {size}, the file has {size // 2} bytes; "
                f"download or copy it again." if kind == "safetensors" else
                "is not a readable torch.save file (PytorchStreamReader failed reading zip archive: failed finding "
                "central directory): truncated or corrupt; download or copy it again.")
    assert f"convert2ckpt: error: '{shard}' {expected}" in result.stderr
    assert_nothing_written(tmp_path, str(tmp_path / "out"))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_damaged_layer_file_is_refused_by_export_naming_it(tiny_checkpoints, tmp_path, damage):
    ds_dir = tmp_path / "ds"
    shutil.copytree(tiny_checkpoints["llama2"][1], ds_dir)
    layer = tag_dir(ds_dir) / "layer_03-model_states.pt"
    recorded = json.loads((tag_dir(ds_dir) / "checksums.json").read_text())["files"]
    assert sorted(recorded) == sorted(n for n in os.listdir(tag_dir(ds_dir)) if n != "checksums.json")
    if damage == "flipped":
        flip_bytes(layer)
    else:
        layer.write_bytes(layer.read_bytes()[:-100])
    result = convert_cli("--to_hf", "--ckpt_dir", str(ds_dir), "--output_dir", str(tmp_path / "out"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    size = layer.stat().st_size
    what = ("is corrupt: its xxh3_128 checksum" if damage == "flipped" else
            f"is {size} bytes, checksums.json recorded {size + 100} when it was written (truncated or replaced)")
    assert f"convert2ckpt: error: checkpoint file '{layer}' {what}" in result.stderr
    assert_nothing_written(tmp_path, str(tmp_path / "out"))
    if damage == "flipped":  # what the check prevents: skipped, the damage exports without a word
        check = convert_cli("--to_hf", "--ckpt_dir", str(ds_dir), "--output_dir", str(tmp_path / "out"),
                            "--skip_checksums")
        assert check.returncode == 0, check.stderr
        exported = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()}
        original = {k: v for f in pathlib.Path(tiny_checkpoints["llama2"][0]).glob("*.safetensors")
                    for k, v in load_file(f).items()}
        assert [k for k in original if not torch.equal(original[k], exported[k])]


@pytest.mark.slow
def test_converted_directorys_config_and_tokenizer_are_checked_before_they_are_read(demo_model, tmp_path):
    """The top-level files of a converted directory (config, tokenizer with its chat template) have their own
    manifest: an edited chat template stops the trainer, an edited config.json stops export, each naming the file."""
    ds_dir = tmp_path / "ds"
    shutil.copytree(demo_model["ds"], ds_dir)
    top_level = sorted(n for n in os.listdir(ds_dir) if (ds_dir / n).is_file() and n not in ("latest", "checksums.json"))
    assert "config.json" in top_level and "tokenizer_config.json" in top_level
    assert sorted(json.loads((ds_dir / "checksums.json").read_text())["files"]) == top_level
    tokenizer_config = ds_dir / "tokenizer_config.json"
    tokenizer_config.write_text(tokenizer_config.read_text().replace("{", "{ ", 1))
    with pytest.raises(ValueError, match=re.escape(f"checkpoint file '{tokenizer_config}' is ") + ".* bytes, checksums.json recorded"):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", model_name_or_path=ds_dir), 2)
    assert not (tmp_path / "run").exists()
    config = ds_dir / "config.json"
    flip_bytes(config, count=1)
    result = convert_cli("--to_hf", "--ckpt_dir", str(ds_dir), "--output_dir", str(tmp_path / "out"))
    assert f"convert2ckpt: error: checkpoint file '{config}' is corrupt" in result.stderr
    assert_nothing_written(tmp_path, str(tmp_path / "out"))


def without_tokenizer(demo_model, target):
    """The demo model converted from a Hugging Face directory that holds no tokenizer files."""
    hf_dir = target.parent / f"{target.name}-hf"
    shutil.copytree(demo_model["hf"], hf_dir, ignore=lambda _, names: [n for n in names if is_tokenizer_file(n)])
    convert_hf_to_ds(str(hf_dir), str(target))
    return target


@pytest.mark.slow
def test_converter_takes_the_tokenizer_from_elsewhere(demo_model, tmp_path):
    hf_dir = tmp_path / "hf"
    shutil.copytree(demo_model["hf"], hf_dir, ignore=lambda _, names: [n for n in names if is_tokenizer_file(n)])
    result = convert_cli("--model_name_or_path", str(hf_dir), "--output_dir", str(tmp_path / "out"),
                         "--tokenizer_name_or_path", str(hf_dir))
    assert result.returncode != 0
    assert f"--tokenizer_name_or_path '{hf_dir}' holds no tokenizer files" in result.stderr
    assert_nothing_written(tmp_path, str(tmp_path / "out"))
    convert_hf_to_ds(str(hf_dir), str(tmp_path / "out"), tokenizer_name_or_path=demo_model["hf"])
    tokenizer_files = sorted(n for n in os.listdir(demo_model["hf"]) if is_tokenizer_file(n))
    assert tokenizer_files and all(
        (tmp_path / "out" / n).read_bytes() == (pathlib.Path(demo_model["hf"]) / n).read_bytes()
        for n in tokenizer_files)


def test_text_data_without_a_tokenizer_names_the_directory_and_key(demo_model, tmp_path):
    ds_dir = without_tokenizer(demo_model, tmp_path / "ds")
    with pytest.raises(ValueError) as error:
        run_in_process(demo_overrides(demo_model, tmp_path / "run", model_name_or_path=ds_dir), 2)
    assert (f"data.format=text needs a tokenizer, and '{ds_dir}' (model_name_or_path) holds no tokenizer files"
            in str(error.value))
    assert "set tokenizer_name_or_path to the directory of the model's tokenizer" in str(error.value)
    assert not (tmp_path / "run").exists()
    cfg = OmegaConf.create({"data": {"format": "text"}, "tokenizer_name_or_path": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match=f"'{tmp_path / 'nowhere'}' \\(tokenizer_name_or_path\\) holds no tokenizer"):
        tokenizer_dir(cfg, str(ds_dir))
    cfg.tokenizer_name_or_path = demo_model["hf"]
    assert tokenizer_dir(cfg, str(ds_dir)) == demo_model["hf"]
    cfg.data.format = "pretokenized"
    assert tokenizer_dir(cfg, str(ds_dir)) is None


def test_pad_id_without_a_tokenizer_comes_from_the_model_config():
    assert pad_token_id(None, LlamaConfig(pad_token_id=3, eos_token_id=2)) == 3
    assert pad_token_id(None, LlamaConfig(pad_token_id=None, eos_token_id=[7, 9])) == 7
    assert pad_token_id(None, LlamaConfig(pad_token_id=None, eos_token_id=None)) == 0


@pytest.mark.slow
def test_pretokenized_run_without_tokenizer_then_corrupt_checkpoint_is_refused(demo_model, tmp_path):
    """A model directory without tokenizer files trains and evaluates on pre-tokenized data (2 stages); its
    checkpoint carries a manifest of every file; one layer file with 64 flipped bytes is then refused by resume
    (every rank fails, the file named) and by export."""
    ds_dir = without_tokenizer(demo_model, tmp_path / "ds")
    generator = torch.Generator().manual_seed(0)
    for split, rows in (("train", 40), ("eval", 8)):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for _ in range(rows):
                length = int(torch.randint(16, 64, (1,), generator=generator))
                f.write(json.dumps({"input_ids": torch.randint(3, 384, (length,), generator=generator).tolist()}) + "\n")
    # A tokenizer_name_or_path that no tokenizer could load from: pre-tokenized data never loads it, checkpoints
    # carry its files.
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("not a tokenizer")
    out = tmp_path / "run"
    overrides = demo_overrides(demo_model, out, model_name_or_path=ds_dir, num_stages=2,
                               tokenizer_name_or_path=tmp_path / "tokenizer",
                               train_file=tmp_path / "train.jsonl", eval_file=tmp_path / "eval.jsonl",
                               zero_stage=1, **{"data.format": "pretokenized"})
    check_ok(launch_trainer(2, overrides + ["max_steps=2"]))
    assert [r["step"] for r in read_metrics(out) if "eval_loss" in r] == [2]
    checkpoint = out / "global_step2"
    recorded = json.loads((checkpoint / "checksums.json").read_text())["files"]
    assert sorted(recorded) == sorted(n for n in os.listdir(checkpoint) if n not in ("checksums.json", "COMPLETE"))
    assert {"layer_00-model_states.pt", "mp_rank_01_model_states.pt", "rng_state_rank00001.pt",
            "layer_02-optim_states.pt", "tokenizer.json"} <= set(recorded)
    assert (checkpoint / "tokenizer.json").read_text() == "not a tokenizer"

    layer = checkpoint / "layer_02-model_states.pt"
    flip_bytes(layer)
    resumed = launch_trainer(2, overrides + ["max_steps=3", "resume=auto"])
    assert resumed.returncode != 0
    said = resumed.stdout + resumed.stderr
    assert said.count(f"trainer_pipe: error: checkpoint file '{layer}' is corrupt") == 2, said[-3000:]  # both ranks
    exported = convert_cli("--to_hf", "--ckpt_dir", str(out), "--output_dir", str(tmp_path / "hf"))
    assert exported.returncode != 0 and f"checkpoint file '{layer}' is corrupt" in exported.stderr


@pytest.mark.slow
def test_a_full_disk_during_conversion_is_one_line_and_leaves_nothing(demo_model, small_disk):
    """Both directions into a disk too small for the weights (another filesystem than the model's): one line naming
    the output, the free space and what the weights need; no traceback, no partial directory, an existing output
    untouched."""
    disk = small_disk(128 * 1024)
    existing = disk / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("kept")
    for direction in (["--model_name_or_path", demo_model["hf"]], ["--to_hf", "--ckpt_dir", demo_model["ds"]]):
        result = convert_cli(*direction, "--output_dir", str(existing), "--overwrite")
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert re.search(rf"convert2ckpt: error: the disk of '{re.escape(str(existing))}' filled up: [0-9.]+ MiB free, "
                         rf"the converted weights need about [0-9.]+ MiB; nothing was written", result.stderr)
        assert sorted(os.listdir(disk)) == ["existing"] and (existing / "keep.txt").read_text() == "kept"
    # With room, the conversion onto this other filesystem (where the kernel's copy_file_range may refuse the
    # cross-device copy) writes the same bytes as on the model's own.
    small_disk(16 * 2**20)
    assert convert_cli("--model_name_or_path", demo_model["hf"], "--output_dir", str(disk / "ds")).returncode == 0
    written, reference = tag_dir(disk / "ds"), tag_dir(demo_model["ds"])
    assert sorted(os.listdir(written)) == sorted(os.listdir(reference))
    assert all((written / n).read_bytes() == (reference / n).read_bytes() for n in os.listdir(reference))

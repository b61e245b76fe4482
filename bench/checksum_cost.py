"""What the checksum manifests (checkpoints/integrity.py) cost.

1. Hash speed in memory: xxh3-128 (the one used) against zlib's CRC-32 and hashlib's BLAKE2b.
2. Conversion: convert2ckpt's HF -> DeepSpeed of a random ~1B LLaMA (bf16, 2 GB in 500 MB safetensors shards), with
   every layer file hashed (as shipped) and with hashing stubbed out; alternated, medians.
3. Save: one rank writing 1 GiB in 4 files through a checkpoint engine (torch.save, as DeepSpeed's), with and without
   save_checkpoint's hashing; then verifying them (what resume and export add), pages cached.

  python bench/checksum_cost.py
"""
import os
import statistics
import sys
import tempfile
import time
import zlib
import hashlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_note  # noqa: E402
from load_memory import make_model  # noqa: E402

import torch  # noqa: E402
import xxhash  # noqa: E402

import checkpoints.hf_to_ds as hf_to_ds  # noqa: E402
from checkpoints.integrity import file_checksum  # noqa: E402
from checkpoints.saving import hashing_saves  # noqa: E402

REPEATS = 5
GIB = 2 ** 30


def timed(function):
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def hash_speeds():
    data = os.urandom(GIB // 4)
    for name, function in (("xxh3_128", lambda: xxhash.xxh3_128(data).hexdigest()),
                           ("crc32", lambda: zlib.crc32(data)), ("blake2b", lambda: hashlib.blake2b(data).digest())):
        seconds = min(timed(function) for _ in range(REPEATS))
        print(f"hash {name:9s} {len(data) / seconds / 1e9:6.2f} GB/s in memory")


def conversion(work):
    """Medians of REPEATS conversions per variant, alternated; each starts after os.sync() so that write-back of the
    previous one does not land in it. Timed with and without the final os.sync() (the bytes on disk)."""
    hf_dir = os.path.join(work, "hf")
    make_model(0, hf_dir, initialise=False)
    size = sum(os.path.getsize(os.path.join(hf_dir, n)) for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    real = hf_to_ds.file_checksum
    out = os.path.join(work, "ds")
    times = {(variant, synced): [] for variant in ("hashed", "not hashed") for synced in (False, True)}
    for _ in range(REPEATS):
        for variant in ("hashed", "not hashed"):
            hf_to_ds.file_checksum = real if variant == "hashed" else (lambda path: {"bytes": 0, "xxh3_128": ""})
            os.sync()
            start = time.perf_counter()
            hf_to_ds.convert_hf_to_ds(hf_dir, out, overwrite=True)
            times[variant, False].append(time.perf_counter() - start)
            os.sync()
            times[variant, True].append(time.perf_counter() - start)
    hf_to_ds.file_checksum = real
    for synced in (False, True):
        hashed, plain = statistics.median(times["hashed", synced]), statistics.median(times["not hashed", synced])
        print(f"conversion of {size / 1e9:.2f} GB{' + os.sync()' if synced else ''}: {hashed:.2f} s with checksums, "
              f"{plain:.2f} s without: {hashed / plain:.3f}x ({(hashed - plain) / plain * 100:+.1f}%)")


class TorchSaveEngine:
    """What DeepSpeed's TorchCheckpointEngine.save does."""

    def save(self, state_dict, path):
        torch.save(state_dict, path)


def save(work):
    """A rank's save: 4 files of 256 MiB through the checkpoint engine, plain and under save_checkpoint's
    hashing_saves (each file hashed by a second thread while the next is written); alternated, medians."""
    states = [{"weight": torch.randn(GIB // 4 // 4)} for _ in range(4)]
    engine = TorchSaveEngine()

    def save_all():
        for i, state in enumerate(states):
            engine.save(state, os.path.join(work, f"file{i}.pt"))

    def save_all_hashed():
        with hashing_saves(engine):
            save_all()
    times = {"plain": [], "hashed": []}
    for _ in range(REPEATS):
        for variant, function in (("plain", save_all), ("hashed", save_all_hashed)):
            os.sync()
            times[variant].append(timed(function))
    verify = min(timed(lambda: [file_checksum(os.path.join(work, f"file{i}.pt")) for i in range(4)])
                 for _ in range(REPEATS))
    plain, hashed = statistics.median(times["plain"]), statistics.median(times["hashed"])
    print(f"save of 1 GiB in 4 files: {hashed:.2f} s with checksums, {plain:.2f} s without: {hashed / plain:.3f}x "
          f"({(hashed - plain) / plain * 100:+.1f}%); verify (pages cached) {verify:.2f} s = {GIB / verify / 1e9:.2f} GB/s")
    for i in range(4):
        os.remove(os.path.join(work, f"file{i}.pt"))


def main():
    hash_speeds()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as work:
        save(work)
        conversion(work)
    print(machine_note())


if __name__ == "__main__":
    main()

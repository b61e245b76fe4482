"""What the checksum manifests (checkpoints/integrity.py) cost.

1. Hash speed in memory: xxh3-128 (the one used) against zlib's CRC-32 and hashlib's BLAKE2b.
2. Conversion: convert2ckpt's HF -> DeepSpeed of a random ~1B LLaMA (bf16, 2 GB in 500 MB safetensors shards), with
   every layer file hashed right after it is written (as shipped) and with hashing stubbed out; alternated, medians.
3. Save: torch.save of a 1 GiB state (what DeepSpeed's checkpoint engine does per file) and the hash of the file
   just written (what save_checkpoint adds); then verifying it (what resume and export add), pages cached.

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
    hf_dir = os.path.join(work, "hf")
    make_model(0, hf_dir, initialise=False)
    size = sum(os.path.getsize(os.path.join(hf_dir, n)) for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    real = hf_to_ds.file_checksum
    times = {"hashed": [], "not hashed": []}
    for _ in range(REPEATS):
        for variant in times:
            hf_to_ds.file_checksum = real if variant == "hashed" else (lambda path: {"bytes": 0, "xxh3_128": ""})
            out = os.path.join(work, "ds")
            os.sync()  # the previous run's dirty pages are written back before this one is timed
            times[variant].append(timed(lambda: hf_to_ds.convert_hf_to_ds(hf_dir, out, overwrite=True)))
    hf_to_ds.file_checksum = real
    hashed, plain = statistics.median(times["hashed"]), statistics.median(times["not hashed"])
    print(f"conversion of {size / 1e9:.2f} GB: {hashed:.2f} s with checksums, {plain:.2f} s without: "
          f"{hashed / plain:.3f}x ({(hashed - plain) / plain * 100:+.1f}%)")


def save(work):
    state = {f"tensor{i}": torch.randn(GIB // 4 // 4) for i in range(4)}  # 4 x 256 MiB fp32
    path = os.path.join(work, "state.pt")
    saves, hashes, verifies = [], [], []
    for _ in range(REPEATS):
        os.sync()
        saves.append(timed(lambda: torch.save(state, path)))
        hashes.append(timed(lambda: file_checksum(path)))
        verifies.append(timed(lambda: file_checksum(path)))
        os.remove(path)
    save_s, hash_s = statistics.median(saves), statistics.median(hashes)
    print(f"save of 1 GiB: torch.save {save_s:.2f} s, hash of the file just written {hash_s:.2f} s: "
          f"+{hash_s / save_s * 100:.1f}% of the save; verify (pages cached) {statistics.median(verifies):.2f} s "
          f"= {GIB / statistics.median(verifies) / 1e9:.2f} GB/s")


def main():
    hash_speeds()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as work:
        save(work)
        conversion(work)
    print(machine_note())


if __name__ == "__main__":
    main()

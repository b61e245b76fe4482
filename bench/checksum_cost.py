"""What the checksum manifests (checkpoints/integrity.py) cost.

1. Hash speed in memory: xxh3-128 (the one used) against zlib's CRC-32 and hashlib's BLAKE2b.
2. Conversion: convert2ckpt's HF -> DeepSpeed of a random ~1B LLaMA (bf16, 2 GB in 500 MB safetensors shards), with
   every layer file hashed (as shipped) and with hashing stubbed out; alternated, medians.
3. Save: one rank writing 1 GiB in 4 files through a checkpoint engine (torch.save, as DeepSpeed's), with and without
   save_checkpoint's hashing; then verifying them (what resume and export add), pages cached.

  python bench/checksum_cost.py [--repeats 5] [--hash-mib 256] [--save-mib 1024]
"""
import os
import statistics
import tempfile
import time
import zlib
import hashlib

from common import MIB, bench_parser, in_rounds, machine_note, parse_args, timed  # noqa: E402
from load_memory import SMOKE_MODEL, SMOKE_SHARD_SIZE, MODEL, SHARD_SIZE, make_model  # noqa: E402

import torch  # noqa: E402
import xxhash  # noqa: E402

import checkpoints.hf_to_ds as hf_to_ds  # noqa: E402
from checkpoints.integrity import file_checksum  # noqa: E402
from checkpoints.saving import hashing_saves  # noqa: E402

def hash_speeds(size, repeats):
    data = os.urandom(size)
    for name, function in (("xxh3_128", lambda: xxhash.xxh3_128(data).hexdigest()),
                           ("crc32", lambda: zlib.crc32(data)), ("blake2b", lambda: hashlib.blake2b(data).digest())):
        seconds = min(timed(function) for _ in range(repeats))
        print(f"hash {name:9s} {len(data) / seconds / 1e9:6.2f} GB/s in memory")


def conversion(work, repeats, smoke):
    """Medians of `repeats` conversions per variant, alternated; each starts after os.sync() so that write-back of
    the previous one does not land in it. Timed with and without the final os.sync() (the bytes on disk)."""
    hf_dir = os.path.join(work, "hf")
    make_model(0, hf_dir, SMOKE_MODEL if smoke else MODEL, SMOKE_SHARD_SIZE if smoke else SHARD_SIZE,
               initialise=False)
    size = sum(os.path.getsize(os.path.join(hf_dir, n)) for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    real = hf_to_ds.file_checksum
    out = os.path.join(work, "ds")

    def convert(checksum):
        """(seconds of a conversion, seconds with its final os.sync())."""
        hf_to_ds.file_checksum = checksum
        os.sync()
        start = time.perf_counter()
        hf_to_ds.convert_hf_to_ds(hf_dir, out, overwrite=True)
        converted = time.perf_counter() - start
        os.sync()
        return converted, time.perf_counter() - start
    try:
        times = in_rounds({"hashed": lambda: convert(real),
                           "not hashed": lambda: convert(lambda path: {"bytes": 0, "xxh3_128": ""})}, repeats)
    finally:
        hf_to_ds.file_checksum = real
    for synced in (False, True):
        hashed, plain = (statistics.median(t[synced] for t in times[variant]) for variant in ("hashed", "not hashed"))
        print(f"conversion of {size / 1e9:.2f} GB{' + os.sync()' if synced else ''}: {hashed:.2f} s with checksums, "
              f"{plain:.2f} s without: {hashed / plain:.3f}x ({(hashed - plain) / plain * 100:+.1f}%)")


class TorchSaveEngine:
    """What DeepSpeed's TorchCheckpointEngine.save does."""

    def save(self, state_dict, path):
        torch.save(state_dict, path)


def save(work, size, repeats):
    """A rank's save: 4 files of size / 4 through the checkpoint engine, plain and under save_checkpoint's
    hashing_saves (each file hashed by a second thread while the next is written); alternated, medians."""
    states = [{"weight": torch.randn(size // 4 // 4)} for _ in range(4)]
    engine = TorchSaveEngine()

    def save_all():
        for i, state in enumerate(states):
            engine.save(state, os.path.join(work, f"file{i}.pt"))

    def save_all_hashed():
        with hashing_saves(engine):
            save_all()

    def synced_then_timed(function):  # the previous save's write-back does not land in this one
        os.sync()
        return timed(function)
    times = in_rounds({"plain": lambda: synced_then_timed(save_all),
                       "hashed": lambda: synced_then_timed(save_all_hashed)}, repeats)
    verify = min(timed(lambda: [file_checksum(os.path.join(work, f"file{i}.pt")) for i in range(4)])
                 for _ in range(repeats))
    plain, hashed = statistics.median(times["plain"]), statistics.median(times["hashed"])
    print(f"save of {size / MIB:.0f} MiB in 4 files: {hashed:.2f} s with checksums, {plain:.2f} s without: "
          f"{hashed / plain:.3f}x ({(hashed - plain) / plain * 100:+.1f}%); verify (pages cached) {verify:.2f} s = "
          f"{size / verify / 1e9:.2f} GB/s")
    for i in range(4):
        os.remove(os.path.join(work, f"file{i}.pt"))


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hash-mib", type=int, default=256, help="the bytes each hash reads")
    parser.add_argument("--save-mib", type=int, default=1024, help="the bytes a rank's save writes")
    args = parse_args(parser, repeats=1, hash_mib=1, save_mib=1)
    hash_speeds(args.hash_mib * MIB, args.repeats)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as work:
        save(work, args.save_mib * MIB, args.repeats)
        conversion(work, args.repeats, args.smoke)
    print(machine_note())


if __name__ == "__main__":
    main()

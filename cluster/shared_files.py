"""Files one rank of the whole job writes into a directory every node shares, and every rank then reads (the
tokenized data cache, the token shards' sample indices).

Global rank 0 builds them (not local rank 0 of each node: two writers of one file collide). The others do not wait
in a collective, whose timeout (dist_timeout_minutes) a first build on a large corpus outlasts, but on the job's
store (the rendezvous TCP store, which no NCCL watchdog times) with their own limit and a progress line; rank 0
posts there the files it vouches for, or its error, which every rank then raises. Then each rank waits, bounded,
until those files show on its node: a shared filesystem (NFS) may cache a negative lookup for a while.
"""
import itertools
import json
import os
import socket
import time

import torch.distributed as dist

from errors import ConfigError

VISIBLE_WITHIN_S = 300  # NFS keeps a negative lookup for at most acdirmax (60 s by default); room to spare
PROGRESS_EVERY_S = 60
ERROR_DELIVERY_S = 30  # how long a failed rank 0 keeps its store up for the others to read its error
_builds = itertools.count()  # every rank builds the same things in the same order: the n-th build's store key


class SharedFileError(RuntimeError):
    """Rank 0 failed, or took longer than allowed, or its files never showed on this node; the message says which.
    Not the user's to fix (rank 0 killed while building, a filesystem slower than allowed): a restart may well help.
    Where rank 0 failed on the user's input (a ConfigError), the other ranks raise a ConfigError too."""


def built_by_rank_zero(build, what, limit_minutes, log=print, poll_s=1.0):
    """build() on global rank 0 (it returns the paths of the files it wrote or found); every other rank waits for it
    on the store, at most limit_minutes, logging progress, then for the files to show here. Returns the paths on
    every rank. Without a process group: build()."""
    if not (dist.is_available() and dist.is_initialized()):
        return build()
    store = dist.distributed_c10d._get_default_store()
    key = f"built_by_rank_zero/{next(_builds)}"
    if dist.get_rank() == 0:
        try:
            paths = [str(path) for path in build()]
        except BaseException as error:
            store.set(key, json.dumps({"error": f"{type(error).__name__}: {error}",
                                       "config": isinstance(error, ConfigError)}))
            wait_for_readers(store, key, dist.get_world_size() - 1)  # the store dies with rank 0
            raise
        store.set(key, json.dumps({"paths": paths}))
        return paths
    word = json.loads(wait_on_store(store, key, what, limit_minutes, log, poll_s))
    if "error" in word:
        store.add(f"{key}/read", 1)
        raise (ConfigError if word["config"] else SharedFileError)(f"rank 0 could not build {what}: {word['error']}")
    wait_for_files(word["paths"], VISIBLE_WITHIN_S, poll_s)
    return word["paths"]


def wait_for_readers(store, key, readers):
    deadline = time.monotonic() + ERROR_DELIVERY_S
    while store.add(f"{key}/read", 0) < readers and time.monotonic() < deadline:
        time.sleep(0.1)


def wait_on_store(store, key, what, limit_minutes, log, poll_s):
    start = time.monotonic()
    next_line = start + PROGRESS_EVERY_S
    while not has_key(store, key, what):
        waited = time.monotonic() - start
        if waited > limit_minutes * 60:
            raise SharedFileError(f"rank 0 has not finished building {what} after {limit_minutes} minutes "
                                  f"(data_build_timeout_minutes); look at rank 0's log for why, or raise the limit")
        if time.monotonic() >= next_line and int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one line per node
            log(f"waiting for rank 0 to build {what}: {waited / 60:.0f} of at most {limit_minutes} minutes")
            next_line += PROGRESS_EVERY_S
        time.sleep(poll_s)
    return store.get(key)


def has_key(store, key, what):
    try:
        return store.check([key])
    except dist.DistNetworkError:  # the store's server is rank 0's
        raise SharedFileError(f"rank 0 stopped while building {what}; its log says why") from None


def wait_for_files(paths, limit_s, poll_s=1.0):
    """Return once every path exists here; after limit_s, an error naming the first missing one."""
    deadline = time.monotonic() + limit_s
    for path in paths:
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise SharedFileError(f"{path}: rank 0 wrote it, but {socket.gethostname()} does not see it after "
                                      f"{limit_s:.0f} s; the data cache (data.cache_dir, default output_dir/"
                                      f"data_cache), output_dir and data.index_dir must be on a filesystem every node "
                                      f"shares")
            if os.path.isdir(os.path.dirname(path) or "."):  # reading the directory revalidates a cached negative
                os.listdir(os.path.dirname(path) or ".")  # lookup (NFS)
            time.sleep(poll_s)

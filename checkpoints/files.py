"""Crash-safe file handling shared by conversion and training: whole directories appear at once or not at all,
and ``latest`` only ever names a complete checkpoint."""
import contextlib
import errno
import os
import shutil
import socket
import tempfile
import uuid

LATEST = "latest"
COMPLETE_MARKER = "COMPLETE"
IN_PROGRESS_MARKER = "IN_PROGRESS"  # the trainer is saving into (or deleting) the tag directory (tag_dirs.py)
TMP_SUFFIX = ".tmp"  # of atomic_path's temporary files
MANIFEST_NAME = "checksums.json"  # per-file checksums of a tag directory (checkpoints/integrity.py)
# Everything in a Hugging Face model directory that is not a weight: configs, tokenizer, chat template.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
WEIGHT_INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# The files a Hugging Face tokenizer is saved as (tokenizer.json, tokenizer.model, tokenizer_config.json, ...).
TOKENIZER_PREFIXES = ("tokenizer",)
TOKENIZER_NAMES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "chat_template.jinja", "chat_template.json")


def is_tokenizer_file(name):
    return name.startswith(TOKENIZER_PREFIXES) or name in TOKENIZER_NAMES


def has_tokenizer_files(directory):
    return os.path.isdir(directory) and any(is_tokenizer_file(name) for name in os.listdir(directory))


def temporary_name(path):
    """A hidden sibling of `path` no other writer picks, on this host or another sharing the directory: containers
    on different nodes routinely give their ranks the same pid (and hostname), so the name adds a random part."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path to write `path`'s content to; when the block ends, the file is fsynced, renamed to
    `path` and the directory fsynced, so a reader (on any node) sees the old file or the whole new one. On an error
    the temporary file is removed and `path` is left as it was."""
    tmp = temporary_name(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def link_or_copy(src, dst):
    """dst holding src's bytes: a hard link (no copy; written files are never changed in place), or where the
    filesystem takes none (another device, no links) a copy, written atomically."""
    try:
        os.link(src, dst)
    except OSError:
        with atomic_path(dst) as tmp:
            shutil.copyfile(src, tmp)


def atomic_write(path, write):
    """write(f) fills a new binary file that then replaces `path` atomically (atomic_path)."""
    with atomic_path(path) as tmp, open(tmp, "xb") as f:
        write(f)


def write_bytes_atomic(path, content):
    atomic_write(path, lambda f: f.write(content))


def write_text_atomic(path, text):
    write_bytes_atomic(path, text.encode())


def fsync_path(path):
    """Block until the file's (or directory's entries') bytes are on stable storage: what a rename or a marker that
    names them may only come after (delayed allocation on ext4/xfs leaves an unsynced file empty after a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_latest(ckpt_dir):
    path = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def check_output_dir(output_dir, overwrite):
    """Refuse to replace a non-empty directory unless asked; called before any work is done."""
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        raise FileExistsError(f"output directory '{output_dir}' exists and is not empty; pass --overwrite to "
                              f"replace it, or choose another --output_dir.")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise FileExistsError(f"output path '{output_dir}' exists and is not a directory.")


@contextlib.contextmanager
def staged_directory(output_dir):
    """Yield a temporary sibling directory; on success its files and directories are fsynced and it replaces
    output_dir (a crash after the rename leaves no empty or short file under the new name), on failure it is removed
    and output_dir is left exactly as it was."""
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(output_dir)}.partial-")
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for directory, _, names in os.walk(staging):
        for name in names:
            fsync_path(os.path.join(directory, name))
        fsync_path(directory)
    previous = None
    if os.path.exists(output_dir):
        previous = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(output_dir)}.old-")
        os.rmdir(previous)
        os.replace(output_dir, previous)
    os.replace(staging, output_dir)
    fsync_path(parent)
    if previous:
        shutil.rmtree(previous, ignore_errors=True)


def copy_model_side_files(src_dir, dst_dir, tokenizer=True):
    """Copy config, generation config and (unless tokenizer=False) tokenizer files: everything but weights and
    checkpoint bookkeeping, from src_dir to dst_dir."""
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        if (os.path.isfile(path) and not name.endswith(WEIGHT_SUFFIXES) and name not in WEIGHT_INDEX_NAMES
                and name not in (LATEST, COMPLETE_MARKER, IN_PROGRESS_MARKER, MANIFEST_NAME)
                and not name.startswith(".")
                and (tokenizer or not is_tokenizer_file(name))):
            shutil.copy2(path, os.path.join(dst_dir, name))


def copy_tokenizer_files(src_dir, dst_dir):
    for name in sorted(os.listdir(src_dir)):
        if is_tokenizer_file(name) and os.path.isfile(os.path.join(src_dir, name)):
            shutil.copy2(os.path.join(src_dir, name), os.path.join(dst_dir, name))


def is_disk_full(error):
    """ENOSPC as an OSError, or as the text of another error that carries it: safetensors' ("os error 28"), torch's
    file writer's ("write(): fd 3 failed with No space left on device"), an OSError's text inside a RuntimeError
    ("[Errno 28] ..."), or torch.save's zip writer seeing a write the full disk cut short ("unexpected pos")."""
    text = str(error)
    return (getattr(error, "errno", None) == errno.ENOSPC or "unexpected pos" in text
            or f"os error {errno.ENOSPC}" in text or f"[Errno {errno.ENOSPC}]" in text
            or os.strerror(errno.ENOSPC) in text)


def free_bytes(path):
    """Free bytes of the filesystem path is on (or will be created on)."""
    while not os.path.exists(path):
        path = os.path.dirname(os.path.abspath(path))
    return shutil.disk_usage(path).free


def size_text(size):
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"

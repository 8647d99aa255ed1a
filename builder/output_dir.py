"""Where `tritium build -o DIR` may write, and how an existing engine is replaced.

DIR may be new, an empty folder, or an earlier Tritium engine (engine.json with a format_version);
anything else (a home folder, a checkpoint, a file, a symbolic link) is refused before any work.
The new engine is written into a sibling temporary folder and swapped in with one rename, so a
reader sees the old engine or the new one, never a mix, and a failed build leaves DIR untouched.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import shutil
import tempfile

ENGINE_CONFIG_FILE = "engine.json"
_RENAME_EXCHANGE = 2  # linux/fs.h


def is_engine_dir(path: str) -> bool:
    """True if `path` holds a Tritium engine config (a JSON object with a format_version)."""
    try:
        with open(os.path.join(path, ENGINE_CONFIG_FILE), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(cfg, dict) and "format_version" in cfg


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def check_output_dir(output: str, source: str) -> str:
    """Absolute output path, or ValueError naming -o and the reason it may not be written."""
    out = os.path.abspath(output)
    src = os.path.realpath(os.path.abspath(source))
    if os.path.islink(out):
        raise ValueError(f"-o {output}: is a symbolic link; give the real folder")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"-o {output}: exists and is not a folder")
    if _inside(src, os.path.realpath(out)):
        raise ValueError(f"-o {output}: holds the source checkpoint {source}; write the engine elsewhere")
    if os.path.isdir(out) and os.listdir(out) and not is_engine_dir(out):
        raise ValueError(f"-o {output}: the folder is not empty and is not a Tritium engine (no {ENGINE_CONFIG_FILE}); "
                         f"refusing to replace it: give a new or empty folder, or an earlier engine")
    return out


def new_build_dir(out: str) -> str:
    """A temporary folder beside `out` (same file system, so the final rename is atomic)."""
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=".tritium-build-", dir=parent)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def replace_dir(tmp: str, out: str) -> None:
    """Move the finished folder `tmp` to `out`, replacing an engine there in one step."""
    if os.path.isdir(out) and not os.listdir(out):
        os.rmdir(out)
    if not os.path.isdir(out):
        os.rename(tmp, out)
        return
    if not is_engine_dir(out):  # checked before the build too; re-checked in case it changed meanwhile
        raise ValueError(f"-o {out}: is no longer an engine folder (it changed during the build); not replaced")
    if _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the old engine
        return
    old = tempfile.mkdtemp(prefix=".tritium-old-", dir=os.path.dirname(out))
    os.rename(out, os.path.join(old, "engine"))  # file systems without RENAME_EXCHANGE: two renames
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)

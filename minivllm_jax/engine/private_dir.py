"""Folders whose contents the engine trusts: the KV disk tier (page files) and the compiled-program
cache (pickles). Whoever can write such a folder can feed the engine KV pages of their choosing or
run code in it, so only a folder owned by this user and writable by no one else is used, and a
folder the engine creates is 0700."""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def ensure_private_dir(path: str | os.PathLike, what: str) -> Path:
    """Create `path` (0700; parents as the umask says) or check the existing one. Raises
    ValueError, saying what to fix, for one owned by another user or writable by group or others."""
    path = Path(path)
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    st = path.stat()  # a symlink is judged by the folder it leads to: that is what gets read
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{what} {path} is not a directory")
    check_owned_by_us(st, f"{what} {path}")
    if st.st_mode & _WRITABLE_BY_OTHERS:
        raise ValueError(
            f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): anyone who can "
            f"write it can plant files the engine trusts; run 'chmod go-w {path}' or use a private directory"
        )
    return path


def check_owned_by_us(st: os.stat_result, what: str) -> None:
    """ValueError unless the file or folder `st` describes belongs to this process's user."""
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise ValueError(
            f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); use a directory of your own"
        )


def check_private_file(st: os.stat_result, what: str) -> None:
    """ValueError unless the file `st` describes is ours and readable and writable by us alone
    (a key file)."""
    check_owned_by_us(st, what)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ValueError(
            f"{what} has mode {stat.S_IMODE(st.st_mode):o}: others may read or change it; run 'chmod 600' on it "
            "or delete it (a new key is made, and the files it signed become misses)"
        )

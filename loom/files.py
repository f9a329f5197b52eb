"""Files and folders Loom writes get the permissions the user's umask gives an ordinary one.

Writing through a temporary name and renaming it into place (a crash never leaves half a file)
inherits the temporary's permissions: ``tempfile.mkstemp`` makes files 0600 and ``mkdtemp``
folders 0700, and safetensors' writer creates its files 0600. A prepared dataset, a run's final
weights or an exported Hugging Face folder were then unreadable to the rest of a group on shared
storage, unlike the config and checkpoint files beside them. ``as_created`` resets a path to
what ``open`` or ``mkdir`` would have made: 0666 or 0777 less the umask.

The umask is read from ``/proc/self/status`` (Linux 4.7+): ``os.umask`` can only read it by
setting it, and a file another thread creates in between (DCP's background writer) would get
the temporary value.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process's umask, without changing it where the system says (else set and restored)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_created(path: str | os.PathLike[str]) -> None:
    """Give ``path`` (a file or a folder) the mode ``open`` / ``mkdir`` would have created it
    with under the current umask."""
    base = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, base & ~current_umask())

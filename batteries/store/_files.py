"""Private files: the journal holds prompts, outputs and budgets.

The helpers are the audit's (`batteries.audit.paths`): new directories 0700,
new files 0600, existing ones left as their owner set them.
"""

from __future__ import annotations

import os
from pathlib import Path


def private_dir(path: Path) -> None:
    """Create `path` and any missing parents as 0700 directories (existing ones untouched)."""
    from batteries.audit.paths import make_private_dir

    make_private_dir(path)


def private_file(path: Path) -> None:
    """Create `path` empty with mode 0600 if it does not exist yet."""
    from batteries.audit.paths import open_private_file

    try:
        fd = open_private_file(path, os.O_WRONLY | os.O_EXCL)
    except FileExistsError:
        return
    os.close(fd)

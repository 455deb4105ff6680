"""Files and folders kvserve writes that hold what users sent (the request log, the KV disk tier): the
owner's alone. Files are created 0600 by the code that opens them; folders through here."""

from __future__ import annotations

from pathlib import Path


def make_private_folders(folder: Path) -> None:
    """Creates the missing folders of `folder`, each 0700 (os.makedirs gives its `mode` only to the last one);
    folders that exist are left as they are."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for each in reversed(missing):
        each.mkdir(mode=0o700, exist_ok=True)

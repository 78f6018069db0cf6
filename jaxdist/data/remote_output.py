"""``prepare --output s3://...``: the prepared folder written straight to object storage.

Each shard is uploaded as soon as it is closed and then removed from local disk, so the corpus
never sits whole on the machine; ``meta.json`` goes last, and a folder is prepared data only
once it is there (``read_meta`` needs it). A prepare killed half way leaves shards without a
``meta.json``: nothing reads them, and the next prepare into the folder replaces them.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from jaxdist.data.prepared import META_FILE
from jaxdist.errors import JaxdistError
from jaxdist.storage.remote import Folder

log = logging.getLogger(__name__)
_SHARD = re.compile(r"tokens-\d{5,}\.bin")


class RemoteOutput:
    def __init__(self, location: str, overwrite: bool):
        self.folder = Folder(location)
        existing = self.folder.sizes()
        unfinished = bool(existing) and META_FILE not in existing and all(_SHARD.fullmatch(n) for n in existing)
        if existing and not unfinished:
            if not overwrite:
                raise JaxdistError(f"output {self.folder} is not empty (pass --overwrite to replace prepared data)")
            if META_FILE not in existing:
                raise JaxdistError(f"output {self.folder} is not empty and holds no prepared data ({META_FILE}); not overwriting it")
            self.folder.remove(META_FILE)  # no longer prepared data from here until the new meta.json
        if unfinished:
            log.info(f"{self.folder}: replacing {len(existing)} shard(s) an unfinished prepare left")
        self.stale = set(existing) - {META_FILE}

    def shard_closed(self, local_dir: Path, name: str) -> None:
        self.folder.put_file(local_dir / name, name)
        os.remove(local_dir / name)
        self.stale.discard(name)

    def commit(self, local_dir: Path) -> None:
        for name in sorted(self.stale):  # an earlier prepare's shards past this one's last
            self.folder.remove(name)
        self.folder.put_file(local_dir / META_FILE, META_FILE)

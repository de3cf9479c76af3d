"""The package digest a result records (``environment.source_sha1``), one rule for the sources a run
imported (:func:`.output.source_digest`) and for a commit's, read from git (``results_index``): so
the two can be compared.  Torch-free, so that the index imports it without torch."""
from __future__ import annotations

import hashlib
from typing import Iterable


def package_digest(sources: Iterable[tuple[str, bytes]]) -> str:
    """SHA-1 (12 hex digits) of a package's Python sources, given as ``(path, bytes)`` with paths as
    ``compass_fx/...``, taken in the order of their parts (as ``sorted`` orders ``Path`` objects)."""
    digest = hashlib.sha1()
    for name, data in sorted(sources, key=lambda source: tuple(source[0].split("/"))):
        digest.update(name.encode() + b"\0" + data)
    return digest.hexdigest()[:12]

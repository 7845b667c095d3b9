"""Endpoints as they may appear in a log line: no user, password, query or fragment.

Export targets and vLLM /metrics URLs are written into warnings; a collector URL can carry a
password (`https://user:secret@host`) or a token in its query, and logs travel further than spans.
"""

from __future__ import annotations

import urllib.parse


def url_for_log(target: str) -> str:
    """`target` without credentials or query; a bare `host:port` (a gRPC target) keeps its form."""
    if "://" not in target:
        return target.split("?", 1)[0].rpartition("@")[2]
    parts = urllib.parse.urlsplit(target)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))

"""The KV inspector page: one self-contained HTML file (``assets/kv_inspector.html``, vanilla JS,
no network) that either fetches live snapshots from ``pagedllm serve --kv-inspector`` or carries
a replayed trace's timeline inside it (``python -m pagedllm.kv.trace FILE --html OUT``)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

PLACEHOLDER = "/*KV_DATA*/null"


def page_html(data: dict[str, Any] | None = None) -> str:
    """The page; with ``data`` (an offline timeline) embedded instead of fetched."""
    html = (resources.files("pagedllm") / "assets" / "kv_inspector.html").read_text("utf-8")
    if data is None:
        return html
    assert PLACEHOLDER in html
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return html.replace(PLACEHOLDER, blob, 1)

"""``python -m pagedllm``: the ``pagedllm`` command (``pagedllm.entrypoints.cli``)."""

from __future__ import annotations

from pagedllm.entrypoints.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

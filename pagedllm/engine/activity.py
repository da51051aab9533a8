"""What the front-end process does besides the core's requests (``EngineClient.activity``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class Activity:
    """The front-end process's own work, beside the core's requests: HTTP requests (the server's
    middleware) and tokenizer jobs in flight, and an ``epoch`` that moves whenever one starts or
    ends. The process gives its freed memory back once nothing is in flight and the epoch stood
    still (``MPClient``): a 1 MB prompt refused after tokenizing frees its memory when it ends,
    not when it starts. Used from the event loop only."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.epoch = 0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        self.in_flight += 1
        self.epoch += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self.epoch += 1

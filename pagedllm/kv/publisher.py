"""The KV events over ZMQ (``--kv-events-endpoint``), for subscribers in other processes.

Like vLLM's ``ZmqEventPublisher``: a PUB socket bound to the endpoint sends one message per engine
step that changed the prefix cache, three frames::

    [topic (bytes), sequence number (8 bytes, big-endian, from 0), msgpack(KVEventBatch)]

A subscriber connects a SUB socket, subscribes to the topic and decodes the last frame with
``decode_batch`` (or any msgpack reader: the structs are arrays, ``[tag, fields...]``, as vLLM's
are). A gap in the sequence numbers means it missed batches (PUB drops for slow subscribers and
sends nothing to one not yet connected): it should rebuild its view from a fresh snapshot.
Sending never blocks the engine: ZMQ queues the message (up to ``SNDHWM``) and sends from its
own I/O thread. pyzmq is imported only when a publisher is made.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from pagedllm.kv.events import KVEventBatch, KVEventBus

DEFAULT_TOPIC = b"kv-events"
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A published batch, from its last frame."""
    return _decoder.decode(payload)


class ZmqEventPublisher:
    """Subscribes to ``bus``'s step batches and publishes each on a PUB socket bound to
    ``endpoint`` (e.g. ``tcp://127.0.0.1:5557``, ``ipc:///tmp/kv-events``)."""

    def __init__(self, bus: KVEventBus, endpoint: str, topic: bytes = DEFAULT_TOPIC,
                 send_hwm: int = 100_000) -> None:
        import zmq

        self.topic = topic
        self.seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, send_hwm)
        self._sock.setsockopt(zmq.LINGER, 1000)  # on close: up to 1 s to flush what is queued
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(0)
            self._ctx.term()
            raise ValueError(f"cannot publish KV events on {endpoint!r} ({e}); pass another "
                             "--kv-events-endpoint (e.g. tcp://127.0.0.1:5557)") from e
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # port 0 resolved
        self._noblock = zmq.NOBLOCK
        self._unsubscribe: Callable[[], None] | None = bus.subscribe_batches(self.publish)

    def publish(self, batch: KVEventBatch) -> None:
        """Send one batch (a batch listener). A PUB socket drops it for a subscriber that is at
        its high-water mark (the sequence number still advances: that subscriber sees the gap)."""
        frames = (self.topic, self.seq.to_bytes(8, "big"), self._encoder.encode(batch))
        self.seq += 1
        self._sock.send_multipart(frames, flags=self._noblock)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
            self._sock.close()
            self._ctx.term()

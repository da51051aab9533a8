"""The KV events over ZMQ (kv/publisher.py): a SUB socket elsewhere receives every step batch,
numbered, and rebuilds the pool's prefix-cache index from them alone; the same through the
engine's --kv-events-endpoint; a taken endpoint is refused with the flag to change."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from pagedllm import LLM, SamplingParams
from pagedllm.kv.block_pool import hash_hex
from pagedllm.kv.events import KVCacheMirror, KVEventBatch
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.publisher import DEFAULT_TOPIC, ZmqEventPublisher, decode_batch

ANY_PORT = 0  # the publisher binds port 0 and reads the endpoint back (``pub.endpoint``)
LOOPBACK = f"tcp://127.0.0.1:{ANY_PORT}"


def _subscribe(ctx: zmq.Context, pub: ZmqEventPublisher) -> zmq.Socket:
    """A SUB socket on ``pub``, past the slow-joiner window: empty batches are published until
    one arrives (bounded), then the rest of the stream is in order."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, DEFAULT_TOPIC)
    sub.connect(pub.endpoint)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pub.publish(KVEventBatch(0.0, []))
        if sub.poll(50):
            while sub.poll(200):  # drain the warm-up batches
                sub.recv_multipart()
            return sub
    raise AssertionError(f"no batch reached a subscriber of {pub.endpoint} in 20 s")


def _receive(sub: zmq.Socket, first_seq: int, n: int) -> list[KVEventBatch]:
    out = []
    for seq in range(first_seq, first_seq + n):
        assert sub.poll(10_000), f"batch {seq} never arrived"
        topic, number, payload = sub.recv_multipart()
        assert topic == DEFAULT_TOPIC and int.from_bytes(number, "big") == seq
        out.append(decode_batch(payload))
    assert not sub.poll(100), "more batches than steps"
    return out


def test_subscriber_socket_rebuilds_the_index() -> None:
    kv = KVCacheManager(6, 2)
    pub = ZmqEventPublisher(kv.events, LOOPBACK)
    ctx = zmq.Context()
    sub = _subscribe(ctx, pub)
    try:
        local: list[KVEventBatch] = []
        kv.events.subscribe_batches(local.append)
        first = pub.seq
        assert kv.allocate_slots("a", 6)
        kv.cache_blocks("a", [1, 2, 3, 4, 5, 6], 6)
        kv.events.end_step()
        kv.free("a")
        assert kv.allocate_slots("b", 12)  # evicts the three
        kv.cache_blocks("b", list(range(12)), 12)
        kv.events.end_step()
        kv.free("b")
        assert kv.reset_prefix_cache()
        assert kv.allocate_slots("c", 4)
        kv.cache_blocks("c", [9, 9, 9, 9], 4)
        kv.events.end_step()
        got = _receive(sub, first, 3)
        assert got == local  # byte-exact across the socket
        mirror = KVCacheMirror(strict=True)
        for batch in got:
            mirror.apply(batch)
        assert mirror.blocks == {hash_hex(v): b.block_id for v, b in kv.pool.cached.items()}
    finally:
        sub.close(0)
        ctx.term()
        pub.close()


def test_engine_publishes_on_kv_events_endpoint(tiny_models: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_models["llama"]), block_size=4, num_kv_blocks=24,
              max_model_len=96, kv_events_endpoint=LOOPBACK)
    pub = llm.engine.kv_publisher
    assert pub is not None and pub.endpoint.startswith("tcp://127.0.0.1:")
    ctx = zmq.Context()
    sub = _subscribe(ctx, pub)
    try:
        first = pub.seq
        system = list(range(5, 17))
        llm.generate([{"prompt_token_ids": system + [40 + i] * (3 + 5 * i)} for i in range(6)],
                     SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                     use_tqdm=False)
        got = _receive(sub, first, pub.seq - first)
        assert got and all(b.events for b in got)
        mirror = KVCacheMirror(strict=True)
        for batch in got:
            mirror.apply(batch)
        assert mirror.blocks.keys() == {hash_hex(v) for v in llm.engine.kv.pool.cached}
    finally:
        sub.close(0)
        ctx.term()
        llm.engine.shutdown()
    assert llm.engine.kv_publisher is not None and not llm.engine.kv.events.active


def test_taken_endpoint_names_the_flag() -> None:
    first = ZmqEventPublisher(KVCacheManager(2, 2).events, LOOPBACK)
    try:
        with pytest.raises(ValueError, match="--kv-events-endpoint"):
            ZmqEventPublisher(KVCacheManager(2, 2).events, first.endpoint)
    finally:
        first.close()

"""KV memory management: block pool, per-request block tables, prefix caching.

Pure Python by design (never imports torch), so the scheduler and capacity planning are
unit-tested and simulated in milliseconds without a model.
"""

from pagedllm.kv.block_pool import BlockHash, BlockPool, FreeBlockQueue, KVBlock
from pagedllm.kv.manager import KVCacheManager, PrefixCacheStats, PrefixHit
from pagedllm.kv.prefix import hash_block_tokens

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "PrefixHit",
    "hash_block_tokens",
]

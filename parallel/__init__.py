"""The ring: shard_map, the ppermute schedule, the LSE merge and the custom_vjp."""

from ringflash.parallel.merge import merge as merge
from ringflash.parallel.ring import ring_attention_local as ring_attention_local

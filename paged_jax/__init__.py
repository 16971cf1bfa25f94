"""paged-jax: a paged KV cache for serving language models in JAX.

Public API:
  * block manager (`paged_jax.block_manager`): `BlockState`, `Reservation`,
    `init`, `reserve`, `release`, `fork`, `truncate` (speculative
    decoding's rollback), `slot_mapping`, `gather_tables`,
    `check_invariants`, `usage`, `NULL_BLOCK`; prefix caching: `register`,
    `share`, `cached_blocks`;
  * speculative decoding (`paged_jax.speculative`): `greedy_accept`,
    `rejection_sample`, `ngram_propose`, `SpeculativeConfig` (the rollback is
    `block_manager.truncate`);
  * prefix-cache index (`import paged_jax.prefix_cache`): `PrefixIndex`,
    `max_hit_blocks`, `check_consistent`;
  * KV cache (`paged_jax.kv_cache`; int8 / fp8 pages with per-token scales:
    `pallas_kernels.quantization`): `KVCache`, `write_kv`, `copy_blocks`,
    `gather_kv`, `check_compatible`;
  * host tier and compaction (`import paged_jax.host_tier`,
    `paged_jax.kv_offload`, `paged_jax.compaction`): `HostTier`, `swap_out`,
    `swap_in`, `drop`; `host_cache`, `copy_to_host`, `copy_to_device`;
    `compact`, `resize`, `resize_cache`;
  * attention (`paged_jax.attention`): `paged_attention`,
    `ragged_paged_attention`, `write_and_ragged_attention`;
  * reference (`paged_jax.reference`): float32 oracles;
  * per-step attention metadata (`paged_jax.step_metadata`): `StepMetadata`,
    `step_metadata`, `sharded_step_metadata`;
  * Flax NNX integration (`paged_jax.flax_attention`): `PagedAttention`,
    `write_and_attend`,
    `dense_causal_attention`; RoPE with Llama 3 scaling (`paged_jax.rope`):
    `RopeConfig`, `Llama3Scaling`, `LinearScaling`, `apply_rope`,
    `inverse_frequencies`;
  * scale-out on a `(data, model)` device mesh (`paged_jax.sharding`):
    `make_mesh`, `create_cache`, `shard_cache`, `init_block_states`,
    `sharded_paged_attention`, `sharded_ragged_paged_attention`,
    `write_kv_sharded`, `copy_blocks_sharded`, `cache_kv_heads`,
    `per_device_cache_bytes`;
  * capacity planning (`import paged_jax.capacity`; the command line is
    `python -m paged_jax.capacity`): `plan`, `CapacityPlan`, `kv_pool_bytes`,
    `bytes_per_block`, `weight_bytes`, `PRESETS`;
  * synthetic request traces (`import paged_jax.traces`): `make_trace`,
    `Trace`, `TraceSpec`;
  * serving (`import paged_jax.serving`): `Engine`, `EngineConfig`, `LLM`,
    `SamplingParams`, `Request`, `RequestOutput`, `ServingModel`.

`capacity`, `traces` and `serving` are not imported here, so that `python -m
paged_jax.capacity` runs the module once (and serving's imports stay off the
kernel user's path).
"""

from paged_jax import block_manager
from paged_jax import flax_attention
from paged_jax import kv_cache
from paged_jax import reference
from paged_jax import rope
from paged_jax import sharding
from paged_jax import speculative
from paged_jax import step_metadata
from paged_jax.attention import IMPLEMENTATIONS
from paged_jax.attention import paged_attention
from paged_jax.attention import ragged_paged_attention
from paged_jax.attention import write_and_ragged_attention
from paged_jax.block_manager import BlockState
from paged_jax.block_manager import NULL_BLOCK
from paged_jax.block_manager import Reservation
from paged_jax.kv_cache import KVCache

__all__ = [
    "BlockState",
    "IMPLEMENTATIONS",
    "KVCache",
    "NULL_BLOCK",
    "Reservation",
    "block_manager",
    "flax_attention",
    "kv_cache",
    "paged_attention",
    "ragged_paged_attention",
    "reference",
    "rope",
    "sharding",
    "speculative",
    "step_metadata",
    "write_and_ragged_attention",
]
__version__ = "0.1.0"

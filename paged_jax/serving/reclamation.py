"""Where the engine reclaims sliding-window blocks (`paged_jax.window_reclaim`).

`EngineConfig.sliding_window_reclamation` (`--sliding-window-reclamation /
--no-sliding-window-reclamation`):

* None (the default): on for a model whose layers all attend within one
  sliding window (Mistral with `sliding_window`), unless the engine runs a
  feature reclamation does not support; then off, the reason in one log line
  and in `Engine.reclamation`.
* True: on, and a `ValueError` (naming the feature) where it cannot be.
* False: off (every block kept, local layers masked and skipped by the
  kernels).

Not supported, and why:

* prefix caching on a model with several windows and no global layer:
  hits are anchored on a global pool's blocks (`pooled_step`'s "Prefix
  caching"). A hybrid model (Gemma 2, 3) has one; a model whose layers all
  share one window (Mistral) has one pool, where a hit needs only its last
  window cached (`window_reclaim.share`, `prefix.PrefixCaching._lookup`);
* the prefix cache's host level (`kv_offloading_size`): it copies whole
  prefixes of one pool;
* swap preemption: the swap tier copies `ceil(L / bs)` blocks per sequence;
* speculative decoding: its rollback (`block_manager.truncate`) would need
  blocks already given back;
* multi-step decode (`num_scheduler_steps > 1`) on a hybrid model: its loop
  runs one pool (on one pool, Mistral, each iteration reclaims as a single
  step does);
* a mesh: the sharded step runs its own bookkeeping.

Hybrid models (Gemma 2, Gemma 3: local and global layers) get one pool
shared by every layer group (`shared_pool.py`, vLLM's layout: a block table
per sub-group of layers, one free list), or, with prefix caching or several
local windows, one pool per distinct window (`window_pool.py`,
`pooled_step.py`); `window_pool.layout` is the rule, logged with the
decision. Global layers keep every block, local layers reclaim. Reclamation
off, every layer shares one pool, every block kept.

`--disable-sliding-window` (vLLM's flag; `LlamaConfig.disable_sliding_window`,
`Llama.without_sliding_window`) is another thing: the model itself runs
without its window, full attention in every layer, so nothing is reclaimed,
and sequences are capped at the smallest window (`max_model_len`), where
full attention is the windowed model's. The model config says so by
`disabled_sliding_window` (that window, or None).
"""

from __future__ import annotations

import dataclasses
import logging

_LOG = logging.getLogger("paged_jax.serving")


@dataclasses.dataclass(frozen=True)
class Reclamation:
  """The engine's decision.

  Attributes:
    window: the sliding window blocks are reclaimed for (every layer's:
      one pool), or None.
    pools: a hybrid model's pool per distinct window (`pooled.pool_windows`
      order, None = global), or None (one pool).
    reason: why it is off ("" when on).
    layout: for `pools`, "shared" (one pool for every layer group,
      `shared_pool`) or why each window has its own pool
      (`window_pool.layout`); "" until the pools are planned.
  """
  window: int | None
  reason: str = ""
  pools: tuple | None = None
  layout: str = ""

  @property
  def on(self) -> bool:
    return self.window is not None or self.pools is not None

  def describe(self) -> str:
    if self.window is not None:
      return f"sliding-window reclamation on (window {self.window} tokens)"
    if self.pools is not None and self.layout == "shared":
      return (f"sliding-window reclamation on (one KV pool shared by the "
              f"layer groups {self.pools})")
    if self.pools is not None:
      why = f"; {self.layout}" if self.layout else ""
      return (f"sliding-window reclamation on (a KV pool per window: "
              f"{self.pools}{why})")
    return f"sliding-window reclamation off: {self.reason}"


def config_conflict(config) -> str | None:
  """The first engine feature in `config` that reclamation does not support
  (a phrase naming its field), or None."""
  if config.kv_offloading_size:
    return (f"kv_offloading_size={config.kv_offloading_size} (the prefix "
            "cache's host level) is not supported with it")
  if config.preemption_mode == "swap":
    return "preemption_mode='swap' is not supported with it"
  if config.speculative_config is not None:
    return "speculative_config (speculative decoding) is not supported with it"
  return None


def caching_conflict(config, pools: tuple | None) -> str | None:
  """Why the engine's features cannot run with reclamation for a model of
  `pools` (`model_window`'s; None: every layer in one window), or None:
  prefix caching and multi-step decode need one pool, or a global one."""
  if config.num_scheduler_steps > 1 and pools is not None:
    return (f"num_scheduler_steps={config.num_scheduler_steps} (multi-step "
            "decode) is not supported with it for a model with a pool per "
            "window")
  if config.enable_prefix_caching and pools is not None and None not in pools:
    return ("enable_prefix_caching=True is not supported with it for a model "
            "with several windows and no global layer (hits are anchored on "
            "the global pool)")
  return None


def check_config(config) -> None:
  """`EngineConfig.__post_init__`'s part: the field's type, and an explicit
  True against an unsupported feature.

  Raises:
    ValueError: naming the value or the conflicting field.
  """
  value = config.sliding_window_reclamation
  if value is not None and not isinstance(value, bool):
    raise ValueError(f"sliding_window_reclamation must be None (auto) or a "
                     f"bool, got {value!r}")
  if value:
    why = config_conflict(config)
    if why:
      raise ValueError(f"sliding_window_reclamation=True: {why}")


def _specs(model_config) -> tuple:
  """The model's `layers.LayerSpec`s (none for a model without them)."""
  return tuple(getattr(model_config, "layer_specs", None) or ())


def disabled_window(model_config) -> int | None:
  """The smallest sliding window the model runs without
  (`disable_sliding_window`), or None (a model config may lack the field)."""
  return getattr(model_config, "disabled_sliding_window", None)


def max_model_len(asked: int | None, default: int, model_config) -> int:
  """The engine's `max_model_len`: `asked` (an explicit value) or `default`,
  for a model run without its sliding window capped at that window (vLLM's
  rule for `--disable-sliding-window`: past the window full attention is not
  the model's attention). Everything else passes unchanged.

  Raises:
    ValueError: an explicit `asked` longer than the window, naming both.
  """
  cap = disabled_window(model_config)
  if cap is None:
    return default if asked is None else asked
  if asked is None:
    return min(default, cap)
  if asked > cap:
    raise ValueError(
        f"max_model_len={asked} is longer than the model's sliding window of "
        f"{cap} tokens: with disable_sliding_window every layer attends to "
        f"the whole sequence, which is the model's attention only up to the "
        f"window, so sequences are capped at {cap}; give max_model_len <= "
        f"{cap}, or keep the window (without disable_sliding_window)")
  return asked


def model_window(model_config) -> tuple[int | None, tuple | None, str]:
  """`(window, None, "")` when every layer attends within one sliding
  window, `(None, pools, "")` for a hybrid model (its distinct windows, first
  appearance first), else `(None, None, why not)`."""
  windows = [s.sliding_window for s in _specs(model_config)]
  distinct = tuple(dict.fromkeys(windows))
  if disabled_window(model_config) is not None:
    return None, None, ("the model runs without its sliding window "
                        "(disable_sliding_window)")
  if set(distinct) <= {None}:
    return None, None, "the model has no sliding-window layers"
  if len(distinct) > 1:
    return None, distinct, ""
  return distinct[0], None, ""


def decide(config, model_config, mesh=None) -> Reclamation:
  """The decision for an engine of `config` serving `model_config` on
  `mesh`, logged in one line when reclamation could apply.

  Raises:
    ValueError: with `sliding_window_reclamation=True` where it cannot run
      (the model has no single window, or a mesh).
  """
  asked = config.sliding_window_reclamation
  if asked is False:
    return Reclamation(None, "sliding_window_reclamation=False")
  window, pools, why = model_window(model_config)
  if not why:
    if mesh is not None:
      why = "a device mesh is not supported with it"
    else:
      why = config_conflict(config) or caching_conflict(config, pools) or ""
  if why:
    if asked:
      raise ValueError(f"sliding_window_reclamation=True: {why}")
    decision = Reclamation(None, why)
    if any(s.sliding_window for s in _specs(model_config)):
      log(decision)  # a window model served without it
    return decision
  decision = Reclamation(window, pools=pools)
  if pools is None:  # (a hybrid model's is logged with its layout: `window_pool.plan`)
    log(decision)
  return decision


def log(decision: Reclamation) -> None:
  """The decision's one log line (`paged_jax.serving`, INFO)."""
  _LOG.info(decision.describe())

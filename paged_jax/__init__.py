"""paged-jax: a paged KV cache for serving language models in JAX."""

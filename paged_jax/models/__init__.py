"""Model implementations that serve through `paged_jax.serving` (the
`ServingModel` protocol): `paged_jax.models.llama` (the NNX Llama, its
Hugging Face checkpoint loader and tensor-parallel layout)."""

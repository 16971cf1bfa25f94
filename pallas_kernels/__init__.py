"""Pallas paged-attention kernels for TPU (Mosaic) and GPU (Triton lowering).

This package depends only on `jax` (and `numpy`). Nothing in it knows about
block managers or models: kernels take K/V pages in the canonical layout
`[num_kv_heads, num_blocks, block_size, head_dim]`, block tables
`i32[num_seqs, max_blocks_per_seq]` and lengths `i32[num_seqs]`.
"""

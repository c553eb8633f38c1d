"""Hugging Face transformers integration: reuse offloaded KV blocks as a prompt's prefix.

Needs `pip install kvtier[hf]` (torch and transformers). Modules: `models` (seeded demo
models), `kv_blocks` (cache <-> paged blocks), `prefix` (greedy generation on top of a loaded
prefix), `generator` (hash, look up, load, generate, store).
"""

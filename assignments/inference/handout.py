# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Assignment: inference with a KV cache
#
# You write:
#
# | function | file | catalogue |
# |---|---|---|
# | `_cached_attention(cache, layer, q, k, v, offset)` | `refmath/inference/kv_cache.py` | K2, K3, K5 |
# | `rope_attention_cached(u, params, config, slot, offset)` | `refmath/models/rope_attention.py` | K2, N10 |
# | `PagedKVCache._needs_copy_on_write`, `.append` (after the checks), `.fork` (after the checks) | `refmath/inference/paged.py` | K10, K11 |
# | `kv_cache_bytes_per_token`, `kv_cache_bytes`, `mla_cache_bytes_per_token` (after the checks) | `refmath/sizing.py` | K6, K7, K9 |
#
# `prefill`, `decode_step`, `generate_cached` and the decoder's full forward are given. Only the
# NumPy path of `_cached_attention` is graded (the `cpu` and `cuda` backend branches, and the
# `xp`/`to_host` moves between host and GPU memory, may stay out).
#
# Public tests: `python -m pytest -q tests`. The hidden tests compare every logit of prefill and
# decode with the full causal forward, the sampled tokens with naive regeneration, the paged cache's
# contents and page sharing after forks, and the sizes of published models.

# %% [markdown]
# **What is graded, and what is refused.** Only the functions listed above are taken from the files
# you submit, each on its own: everything else in those files is ignored, and they run in a module
# of their own beside the given code, which they cannot rebind. Put any helper and any import inside
# the function that uses it. A function is refused (graded as the starter, with a note saying why)
# when it holds code that would run as it is defined (a decorator; a default value other than a
# literal or a name; an annotation that calls something), or when its body reaches past its own
# values: it sets or deletes an attribute of anything but its parameters and its own variables, uses
# a dunder attribute (`__dict__`, `__globals__`...), `globals`, `vars`, `getattr`, `setattr`,
# `delattr`, `exec`, `eval`, `compile` or `__import__`, or imports `sys`, `gc`, `ctypes`, `inspect`,
# `importlib`, `builtins`, `types`, `pickle` or the like. Submit plain UTF-8 files (no links), each
# at most 1 MiB.

# %%
import numpy as np

from refmath.attention import causal_mask

# %% [markdown]
# ## 1. Attention against a cache
#
# The cache of one layer holds keys and values `(B, g, T_max, d_h)`; positions `0..offset-1` are
# filled. A call brings `n` new rows (`n = P` in prefill, `n = 1` in a decode step) at positions
# `offset..offset+n-1`. Store their keys and values, then attend with the `n` queries over every
# filled position. The new queries are the *last* `n` of the `t = offset + n` positions: the mask
# is `causal_mask(n, t)`. Pass that mask and the layer to the `record` method of `cache.counts`
# (the generators count the work with it). With GQA, query head `r` reads stored head `r // (h/g)`:
# group the queries rather than copy the keys `h/g` times.

# %%
print(causal_mask(2, 5))

# %% [markdown]
# ## 2. RoPE at the right position
#
# In `rope_attention_cached`, project the new rows to queries, keys and values (`linear_forward`,
# `split_heads`), rotate queries **and keys** at their true positions (`rope_forward(...,
# offset=offset, base=config.rope_base, layout=config.rope_layout)`), let the slot store and attend
# (`slot.attend(q, k, v, offset)`), merge the heads and project out.
#
# **Question.** Why are keys stored *after* rotation, and what would go wrong if the rotation used
# offset 0 in every decode step?
#
# <!-- BEGIN SOLUTION -->
# A key's rotation depends only on its own position, so it is rotated once and stored; scores then
# see only position differences. With offset 0 every new token would be rotated as if it were at
# position 0, so the relative offsets between the new query and the cached keys would be wrong.
# <!-- END SOLUTION -->

# %% [markdown]
# ## 3. A paged cache with copy on write
#
# Each sequence has a page table (physical page ids in logical order) and a length; token `j` lives
# in logical page `j // p`, slot `j % p` (`page_and_offset`). `append` takes pages from the allocator
# on demand. `fork` starts a child that shares every page of its parent (no copy: each page's
# reference count grows). After a fork, a **full** shared page is never written again, so it can
# stay shared; the **partly filled** last page would be written by the next append of either
# sequence: that sequence first gets a private copy of the filled slots (copy on write), and drops
# its reference to the shared page. `_needs_copy_on_write` says when that is.

# %% [markdown]
# ## 4. Cache sizes
#
# Per token and sequence, each layer caches a key and a value for each key/value head. Write the
# bytes for `L` layers, `g` key/value heads, key width `d_k` (`head_dim`), value width `d_v`
# (`value_dim`, default `d_k`) and `b` bytes per number; then for `B` sequences of `T` tokens. MLA
# caches, per layer, one latent row of width `d_c` and one rotary key of width `d_R` shared by all
# heads. Check with Llama-3-8B (32 layers, 8 KV heads, `d_h = 128`, bf16) before the tests do.

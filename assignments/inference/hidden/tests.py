"""Hidden tests of the inference assignment.

Expected values: the decoder's full causal forward (``refmath.models.decoder.logits``, which never
touches the cached functions a student writes) and naive regeneration built on it, run in the
grader; exact bookkeeping of the paged cache
(what was appended is what is read back, pages shared or copied as copy on write requires); and
published cache sizes. ``check`` never imports the submission. ``run``, whose source and inputs
alone reach the sandbox, receives the model as plain values (the config's fields, the parameter
arrays) and builds it with the submission's refmath.
"""
import numpy as np

from refmath.assignments.checks import Case, all_of, compare, exact, hidden_test, normal

CONFIG = dict(vocab_size=40, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              ffn_multiple_of=16)


def model(**overrides):
    """(config, params, fields): the decoder of these tests, and the config's fields as a dict (what
    run() receives, with the parameter arrays, to build the config on its side)."""
    from refmath.models.decoder import DecoderConfig, init_params
    fields = {**CONFIG, **overrides}
    config = DecoderConfig(**fields)
    params = init_params(config, seed=5)
    # init scales the weights down; larger ones make attention weights far from uniform
    return config, {k: v * 8 if k.endswith(("w_q", "w_k")) else v for k, v in params.items()}, fields


def tokens_of(seed, shape, vocab=40):
    return np.random.default_rng(seed).integers(0, vocab, size=shape)


# ---- the KV cache on the modern decoder --------------------------------------------------------

def _prefill_then_decode():
    """The run() of the tests below: logits of every position, by a prefill of the first n_prompt
    tokens and then one decode step per token."""
    def run(fields, params, tokens, n_prompt):
        from refmath.inference.kv_cache import decode_step, prefill
        from refmath.models.decoder import DecoderConfig
        config = DecoderConfig(**fields)
        first, cache = prefill("llama", params, config, tokens[:, :n_prompt], all_logits=True)
        steps = [decode_step("llama", params, config, cache, tokens[:, t])
                 for t in range(n_prompt, tokens.shape[1])]
        return {"logits": np.concatenate([first, np.stack(steps, axis=1)], axis=1)}
    return run


@hidden_test("prefill + decode_step: every logit equals the full causal recomputation (GQA, batch 2)")
def cached_logits_equal_recompute():
    tokens = tokens_of(1, (2, 11))
    config, params, fields = model()

    def check(out):
        from refmath.models.decoder import logits
        return compare("prefill/decode_step (via _cached_attention, rope_attention_cached)",
                       "logits", out, logits(params, tokens, config),
                       "a 5-token prompt, batch 2, then 6 decode steps; h=4, g=2, 2 layers")
    return Case(_prefill_then_decode(), dict(fields=fields, params=params, tokens=tokens, n_prompt=5),
                check)


@hidden_test("generate_cached: the same sampled tokens as naive regeneration (temperature, top-k)")
def generated_tokens_identical():
    prompt = tokens_of(2, (3, 4))
    options = dict(temperature=0.8, top_k=10, seed=7)
    config, params, fields = model()

    def run(fields, params, prompt, n_new, options):
        from refmath.inference.kv_cache import generate_cached
        from refmath.models.decoder import DecoderConfig
        config = DecoderConfig(**fields)
        return {"tokens": generate_cached("llama", params, config, prompt, n_new, **options).tokens}

    def check(out):
        # naive regeneration with the full causal forward (no cache): the picker draws one uniform
        # number per row and step, rows in order, as generate_cached's loop does
        from refmath.inference.sampling import token_picker
        from refmath.models.decoder import logits
        pick = token_picker(greedy=False, top_p=None, **options)
        expected = prompt
        for _ in range(12):
            last = logits(params, expected, config)[:, -1]
            expected = np.concatenate([expected, [[pick(row)] for row in last]], axis=1)
        return exact("generate_cached", "tokens", out, expected,
                     "3 prompts of 4 tokens, 12 new tokens, temperature 0.8, top-k 10, seed 7")
    return Case(run, dict(fields=fields, params=params, prompt=prompt, n_new=12, options=options), check)


@hidden_test("prefill: MQA and the 'half' RoPE layout, logits of every position (recomputation)")
def prefill_mqa_half_layout():
    tokens = tokens_of(3, (1, 9))
    config, params, fields = model(n_kv_heads=1, rope_layout="half")

    def check(out):
        from refmath.models.decoder import logits
        return compare("prefill/decode_step", "logits", out, logits(params, tokens, config),
                       "a 6-token prompt then 3 steps; h=4, g=1, rope_layout='half'")
    return Case(_prefill_then_decode(), dict(fields=fields, params=params, tokens=tokens, n_prompt=6),
                check)


# ---- the paged cache ---------------------------------------------------------------------------

G, D, PAGE = 2, 3, 4


def kv(seed, n):
    return normal(seed, (n, G, D), (n, G, D))


@hidden_test("PagedKVCache.append: chunks of 3, 1 and 6 tokens read back in order, pages on demand")
def paged_append_gather():
    chunks = [kv(10 + i, n) for i, n in enumerate((3, 1, 6))]

    def run(chunks, page_size, n_kv_heads, head_dim):
        from refmath.inference.paged import PagedKVCache
        cache = PagedKVCache(n_pages=8, page_size=page_size, n_kv_heads=n_kv_heads, head_dim=head_dim)
        cache.add_sequence("a")
        for k, v in chunks:
            cache.append("a", k, v)
        k, v = cache.gather("a")
        return {"k": k, "v": v, "pages": np.array(len(cache.page_table("a"))),
                "used": np.array(cache.pages_used)}

    def check(out):
        inputs = f"page_size {PAGE}, g={G}, d={D}, 10 tokens in chunks of 3, 1, 6"
        return all_of(exact("PagedKVCache.gather", "k", out, np.concatenate([c[0] for c in chunks]), inputs),
                      exact("PagedKVCache.gather", "v", out, np.concatenate([c[1] for c in chunks]), inputs),
                      exact("PagedKVCache.page_table", "pages", out, np.array(3), inputs + " (10 tokens need 3 pages)"),
                      exact("PagedKVCache.pages_used", "used", out, np.array(3), inputs))
    return Case(run, dict(chunks=chunks, page_size=PAGE, n_kv_heads=G, head_dim=D), check)


def _forked(run_free=False):
    """(run, its inputs, the child's k and v, the parent's k and v)."""
    prefix, child_more, parent_more = kv(20, 6), kv(21, 1), kv(22, 3)

    def run(prefix, child_more, parent_more, run_free, page_size, n_kv_heads, head_dim):
        from refmath.inference.paged import PagedKVCache
        cache = PagedKVCache(n_pages=8, page_size=page_size, n_kv_heads=n_kv_heads, head_dim=head_dim)
        cache.add_sequence("parent")
        cache.append("parent", *prefix)
        cache.fork("parent", "child")
        cache.append("child", *child_more)  # its last page is half full and shared: copy on write
        cache.append("parent", *parent_more)  # now the parent's page is its own again: no copy
        parent, child = cache.page_table("parent"), cache.page_table("child")
        out = {"shared_first": np.array(parent[0] == child[0]),
               "copied_second": np.array(parent[1] != child[1]),
               "refcount_first": np.array(cache.allocator.refcount(parent[0])),
               "used": np.array(cache.pages_used)}
        if run_free:
            cache.free_sequence("parent")
            out["used_after_free"] = np.array(cache.pages_used)
        out["child_k"], out["child_v"] = cache.gather("child")
        if not run_free:
            out["parent_k"], out["parent_v"] = cache.gather("parent")
        return out

    expected_child = [np.concatenate([prefix[i], child_more[i]]) for i in (0, 1)]
    expected_parent = [np.concatenate([prefix[i], parent_more[i]]) for i in (0, 1)]
    inputs = dict(prefix=prefix, child_more=child_more, parent_more=parent_more, run_free=run_free,
                  page_size=PAGE, n_kv_heads=G, head_dim=D)
    return run, inputs, expected_child, expected_parent


@hidden_test("PagedKVCache.fork + copy on write: full pages shared, the half-full page copied")
def paged_fork_copy_on_write():
    run, inputs_of_run, child, parent = _forked()

    def check(out):
        inputs = f"page_size {PAGE}: fork at 6 tokens, child +1, parent +3"
        return all_of(exact("PagedKVCache.append", "child_k", out, child[0], inputs),
                      exact("PagedKVCache.append", "child_v", out, child[1], inputs),
                      exact("PagedKVCache.append", "parent_k", out, parent[0], inputs),
                      exact("PagedKVCache.append", "parent_v", out, parent[1], inputs),
                      exact("PagedKVCache.fork", "shared_first", out, np.array(True), inputs + " (first page shared)"),
                      exact("PagedKVCache.append", "copied_second", out, np.array(True), inputs + " (second page copied)"),
                      exact("PagedKVCache.fork", "refcount_first", out, np.array(2), inputs + " (refcount of the shared page)"),
                      exact("PagedKVCache.pages_used", "used", out, np.array(4), inputs + " (3 + 2 pages, 1 shared)"))
    return Case(run, inputs_of_run, check)


@hidden_test("PagedKVCache: freeing the parent leaves the child's shared pages intact")
def paged_free_keeps_shared_pages():
    run, inputs_of_run, child, _ = _forked(run_free=True)

    def check(out):
        inputs = f"page_size {PAGE}: fork at 6 tokens, child +1, parent +3, then parent freed"
        return all_of(exact("PagedKVCache.gather", "child_k", out, child[0], inputs),
                      exact("PagedKVCache.gather", "child_v", out, child[1], inputs),
                      exact("PagedKVCache.pages_used", "used_after_free", out, np.array(2), inputs))
    return Case(run, inputs_of_run, check)


# ---- sizes -------------------------------------------------------------------------------------

KIB, MIB, GIB = 2**10, 2**20, 2**30


@hidden_test("kv_cache_bytes(_per_token): Llama-2-7B, Llama-3-8B, Llama-3-70B and the K7 example")
def sizing_published_configs():
    # (layers, kv_heads, head_dim) of the published configs, bf16
    configs = {"llama-2-7b": (32, 32, 128), "llama-3-8b": (32, 8, 128), "llama-3-70b": (80, 8, 128)}

    def run(configs):
        from refmath.sizing import kv_cache_bytes, kv_cache_bytes_per_token
        out = {f"{name}_per_token": np.array(kv_cache_bytes_per_token(*c, 2)) for name, c in configs.items()}
        for g in (32, 8, 1):  # the K7 worked example: B=1, L=32, T=8192, d_h=128, b=2
            out[f"k7_g{g}"] = np.array(kv_cache_bytes(1, 32, 8192, g, 128, 2))
        out["llama-3-8b_batch"] = np.array(kv_cache_bytes(8, 32, 4096, 8, 128, 2))
        out["wide_values"] = np.array(kv_cache_bytes_per_token(2, 4, 64, 4, value_dim=32))
        return out

    def check(out):
        expected = {"llama-2-7b_per_token": 512 * KIB, "llama-3-8b_per_token": 128 * KIB,
                    "llama-3-70b_per_token": 320 * KIB, "k7_g32": 4 * GIB, "k7_g8": 1 * GIB,
                    "k7_g1": 128 * MIB, "llama-3-8b_batch": 4 * GIB,
                    "wide_values": 3072}  # 2 layers x 4 heads x (64 + 32) x 4 bytes
        return all_of(*(exact("kv_cache_bytes", key, out, np.array(value), key.replace("_", " "))
                        for key, value in expected.items()))
    return Case(run, dict(configs=configs), check)


@hidden_test("mla_cache_bytes_per_token: DeepSeek-V2 (60 layers, d_c 512, d_R 64, bf16)")
def sizing_mla():
    def run():
        from refmath.sizing import mla_cache_bytes_per_token
        return {"per_token": np.array(mla_cache_bytes_per_token(60, 512, 64, 2))}

    def check(out):
        # DeepSeek-V2 caches 576 numbers per token and layer
        return exact("mla_cache_bytes_per_token", "per_token", out, np.array(60 * 576 * 2),
                     "DeepSeek-V2: L=60, d_c=512, d_R=64, b=2")
    return Case(run, {}, check)

"""The flash-attention adapters (flash_attn, flash_attn_varlen, flash_attn_kvcache), checked with
stand-ins written in PyTorch to flash-attention's documented signatures and conventions
((B, T, H, D), bottom-right causal alignment, window_size=(left, right), cu_seqlens, paged caches
through block_table, lse by return_attn_probs). flash-attention itself needs a GPU; there the same
adapters run on the real functions (benchmarks/gpu_check.sh)."""
import math

import pytest

from refmath.conformance.run import check_attention

torch = pytest.importorskip(
    "torch", reason="the flash-attention adapters pass torch tensors: install the 'oracle' extra")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _attend(q, k, v, scale, causal, window, softcap, alibi, top_left=False):
    """q (T_q, H, D), k/v (T_k, G, D) -> o like q, lse (H, T_q) float32; computed in float32."""
    t_q, h, d = q.shape
    t_k, g = k.shape[0], k.shape[1]
    if t_k == 0:  # nothing cached: o = 0, lse = -inf
        return torch.zeros_like(q), torch.full((h, t_q), -math.inf)
    qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))
    kf, vf = kf.repeat_interleave(h // g, dim=0), vf.repeat_interleave(h // g, dim=0)
    s = scale * qf @ kf.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p_pos = torch.arange(t_q)[:, None] + (0 if top_left else t_k - t_q)
    j = torch.arange(t_k)[None, :]
    keep = torch.ones(t_q, t_k, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        keep &= j >= p_pos - left
    if right >= 0:
        keep &= j <= p_pos + right
    if alibi is not None:
        s = s - alibi[:, None, None] * (p_pos - j).abs()
    s = s.masked_fill(~keep, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    o = (e / torch.where(l == 0, torch.ones_like(l), l)) @ vf
    lse = (m + torch.log(l))[..., 0]
    return o.transpose(0, 1).to(q.dtype), lse


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                    _top_left=False):
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outs = [_attend(q[b], k[b], v[b], scale, causal, window_size, softcap, alibi_slopes, _top_left)
            for b in range(q.shape[0])]
    o = torch.stack([x[0] for x in outs])
    lse = torch.stack([x[1] for x in outs])
    return (o, lse, None) if return_attn_probs else o


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False):
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    os, lses = [], []
    for i in range(len(cu_seqlens_q) - 1):
        a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        c, d = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        o, lse = _attend(q[a:b], k[c:d], v[c:d], scale, causal, window_size, softcap, alibi_slopes)
        os.append(o)
        lses.append(lse)
    o, lse = torch.cat(os), torch.cat(lses, dim=1)
    return (o, lse, None) if return_attn_probs else o


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            block_table=None, softmax_scale=None, causal=False, _stale_slot=False):
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b]) + (1 if _stale_slot else 0)
        if block_table is None:
            kb, vb = k_cache[b, :n], v_cache[b, :n]
        else:
            p = k_cache.shape[1]
            pages = block_table[b, : -(-n // p)].long()
            kb = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n]
            vb = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n]
        out.append(_attend(q[b], kb, vb, scale, causal, (-1, -1), 0.0, None)[0])
    return torch.stack(out)


def _failed(results):
    return [(r.case.id, r.reason) for r in results if r.status == "fail"]


def test_flash_attn_func_passes_forward_and_backward_in_bf16():
    # The stand-in's gradients come from autograd, whose dS @ K multiplies masked zeros by NaN keys
    # (as PyTorch's SDPA does): allowed here, it is the stand-in's, not the adapter's.
    results = check_attention(flash_attn_func, "flash_attn", quick=True, dtypes=("bfloat16",),
                              allow_nan_leaks=True)
    assert not _failed(results)
    ran = [r for r in results if r.status == "pass"]
    assert {r.case.contract for r in ran} == {"forward", "backward"}
    assert any("lse" in [c.name for c in r.checks] for r in ran)
    assert any(r.case.softcap for r in ran) and any(r.case.alibi for r in ran)
    assert any(r.case.window and r.case.window[1] > 0 for r in ran)  # left+right


def test_flash_attn_func_with_pytorchs_alignment_is_caught():
    def top_left(*args, **kwargs):
        return flash_attn_func(*args, **kwargs, _top_left=True)

    results = check_attention(top_left, "flash_attn", quick=True, dtypes=("bfloat16",),
                              contracts=("forward",))
    assert {r.case.label for r in results if r.status == "fail"} >= {
        "causal Tq<Tk bottom-right", "causal Tq>Tk bottom-right"}


def test_flash_attn_varlen_func_passes_the_packed_batches():
    results = check_attention(flash_attn_varlen_func, "flash_attn_varlen", dtypes=("bfloat16",))
    assert not _failed(results)
    assert sum(r.status == "pass" for r in results) >= 4


def test_flash_attn_with_kvcache_passes_decode_and_paged_decode():
    results = check_attention(flash_attn_with_kvcache, "flash_attn_kvcache", quick=True,
                              dtypes=("bfloat16", "float16"))
    assert not _failed(results)
    assert {r.case.contract for r in results if r.status == "pass"} == {"decode", "paged"}


def test_flash_attn_with_kvcache_reading_a_stale_slot_is_caught():
    def stale(*args, **kwargs):
        return flash_attn_with_kvcache(*args, **kwargs, _stale_slot=True)

    results = check_attention(stale, "flash_attn_kvcache", quick=True, dtypes=("bfloat16",),
                              contracts=("paged",), fail_fast=True)
    assert results[-1].status == "fail" and "past the decode length" in results[-1].reason

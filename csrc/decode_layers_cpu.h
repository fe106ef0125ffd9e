// Every layer of a decode step in one call (catalogue K2, K3): the plain C++ interface that
// bindings.cpp wraps. Free of pybind11 and Python.
//
// A decode step at batch 1 is a few products that stream the weights (rows_matmul_cpu) and, between
// them, a dozen operations on vectors of a few thousand floats: the norms, RoPE, the cache append,
// the attention over the cache (decode_cpu), the activation, the residual adds. In NumPy each of
// those is a call with its own checks and temporaries, and together they took a fifth of a step of
// a 12-layer model of width 768. Here they are loops over buffers allocated once.
//
// The layer is the pre-norm residual block of refmath.models.decoder and refmath.models.gpt:
//   h = Norm1(x);  q, k, v = h W_Q (+ b_Q), h W_K (+ b_K), h W_V (+ b_V)
//   q, k rotated at the position (RoPE, N10) where the model has it
//   k, v written at row `position` of the layer's cache; o = attention(q, cache rows 0..position)
//   x += o W_O (+ b_O)
//   h = Norm2(x);  x += FFN(h), FFN = [SiLU(h W_g) * (h W_u)] W_d (SwiGLU, N7) or
//                              GELU(h W_1 + b_1) W_2 + b_2 (N5, N6)
#pragma once

#include <cstddef>

#include "weight_formats_cpu.h"

namespace refmath {

enum class LayerNorm { rms, layer };                  // RMSNorm (N2) or LayerNorm (N1)
enum class LayerFfn { swiglu, gelu_tanh, gelu_exact };
enum class LayerRope { none, interleaved, half };     // pairs (2r, 2r+1) or (r, r + d_h/2)

struct DecodeLayersShape {
    std::ptrdiff_t batch = 0, d_model = 0, heads = 0, kv_heads = 0, head_dim = 0, d_ff = 0;
    LayerNorm norm = LayerNorm::rms;
    float eps = 1e-6f;
    LayerFfn ffn = LayerFfn::swiglu;
    LayerRope rope = LayerRope::none;
    float scale = 1.0f;  // the attention's score scale
};

// A weight matrix as rows_matmul_cpu reads it: (in, out) C-contiguous, or its transpose stored
// (out, in) C-contiguous (transposed = true, the decode layout). Or, where `stored` is set, the
// (out, in) rows kept in a narrower format (bf16, f16, Q8_0 blocks) that format_rows_matmul_cpu
// reads (catalogue W1, W2); w is then unused.
struct LayerMatrix {
    const float* w = nullptr;
    bool transposed = false;
    const void* stored = nullptr;
    WeightFormat format = WeightFormat::bf16;
};

// One layer's weights (nullptr where the model has none: biases, LayerNorm's shift, the SwiGLU
// gate of a plain FFN) and its cache blocks (batch, kv_heads, t_max, head_dim), written at row
// `position`. The gains are the ones the norm multiplies by (refmath.models.decoder.gain).
struct DecodeLayer {
    const float *norm1_gain = nullptr, *norm1_shift = nullptr;
    LayerMatrix w_q, w_k, w_v, w_o;
    const float *b_q = nullptr, *b_k = nullptr, *b_v = nullptr, *b_o = nullptr;
    const float *norm2_gain = nullptr, *norm2_shift = nullptr;
    LayerMatrix w_gate, w_up, w_down;
    const float *b_up = nullptr, *b_down = nullptr;
    float *keys = nullptr, *values = nullptr;
};

// Floats of scratch space decode_layers_cpu needs for this shape.
std::ptrdiff_t decode_layers_workspace(const DecodeLayersShape& shape);

// x (batch, d_model) float32, updated in place through every layer. cos and sin (head_dim / 2) are
// the rotation at `position` (unused without RoPE). 0 <= position < t_max. At most `threads`
// threads share each product; the attention chooses its own split of the cache.
// Throws std::invalid_argument (before any work) on a bad size or position.
void decode_layers_cpu(const DecodeLayersShape& shape, const DecodeLayer* layers,
                       std::ptrdiff_t n_layers, std::ptrdiff_t t_max, std::ptrdiff_t position,
                       const float* cos, const float* sin, float* x, float* workspace, int threads);

}  // namespace refmath

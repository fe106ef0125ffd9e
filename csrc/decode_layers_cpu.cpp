// Every layer of a decode step in one call: see decode_layers_cpu.h.
//
// The products and the attention are the kernels refmath already has (rows_matmul_cpu,
// decode_cpu), so they give the numbers they give when NumPy code calls them one by one. What this
// file adds is the small work between them, done serially on buffers of a few thousand floats that
// the last product has just written (so they are in the caches): norms in double sums, RoPE on the
// new query and key, the append, the activation, the residual adds.
#include "decode_layers_cpu.h"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_cpu.h"
#include "rows_matmul_cpu.h"
#include "weight_formats_cpu.h"

namespace refmath {

namespace {

using idx = std::ptrdiff_t;

// The scratch buffers, carved out of one workspace: h (the normalised rows), q, k, v, o, y (a
// branch's output) and two of the FFN's width.
struct Buffers {
    float *h, *q, *k, *v, *o, *y, *f1, *f2;
};

Buffers carve(const DecodeLayersShape& s, float* w) {
    const idx b = s.batch, qw = s.heads * s.head_dim, kw = s.kv_heads * s.head_dim;
    Buffers p;
    p.h = w;
    p.q = p.h + b * s.d_model;
    p.k = p.q + b * qw;
    p.v = p.k + b * kw;
    p.o = p.v + b * kw;
    p.y = p.o + b * qw;
    p.f1 = p.y + b * s.d_model;
    p.f2 = p.f1 + b * s.d_ff;
    return p;
}

// h = Norm(x) row by row: RMSNorm g * x / sqrt(mean(x^2) + eps), or LayerNorm
// g * (x - mean) / sqrt(var + eps) + shift; the sums in double.
void norm_rows(const DecodeLayersShape& s, const float* x, const float* gain, const float* shift,
               float* h) {
    const idx d = s.d_model;
    for (idx r = 0; r < s.batch; ++r) {
        const float* xr = x + r * d;
        float* hr = h + r * d;
        double mean = 0.0;
        if (s.norm == LayerNorm::layer) {
            for (idx i = 0; i < d; ++i) mean += xr[i];
            mean /= static_cast<double>(d);
        }
        double squares = 0.0;
        for (idx i = 0; i < d; ++i) {
            const double c = xr[i] - mean;
            squares += c * c;
        }
        const float inv = static_cast<float>(1.0 / std::sqrt(squares / static_cast<double>(d) + s.eps));
        const float centre = static_cast<float>(mean);
        for (idx i = 0; i < d; ++i) hr[i] = gain[i] * ((xr[i] - centre) * inv);
        if (shift != nullptr)
            for (idx i = 0; i < d; ++i) hr[i] += shift[i];
    }
}

void add_bias(float* y, const float* bias, idx rows, idx width) {
    if (bias == nullptr) return;
    for (idx r = 0; r < rows; ++r)
        for (idx i = 0; i < width; ++i) y[r * width + i] += bias[i];
}

// Rotate each head's coordinate pairs by the position's angles (N10): rows of head_dim floats.
void rotate(const DecodeLayersShape& s, float* rows, idx count, const float* cos, const float* sin) {
    const idx d = s.head_dim, half = d / 2;
    const bool interleaved = s.rope == LayerRope::interleaved;
    for (idx r = 0; r < count; ++r) {
        float* x = rows + r * d;
        for (idx i = 0; i < half; ++i) {
            float& a = x[interleaved ? 2 * i : i];
            float& b = x[interleaved ? 2 * i + 1 : i + half];
            const float a0 = a, b0 = b;
            a = a0 * cos[i] - b0 * sin[i];
            b = a0 * sin[i] + b0 * cos[i];
        }
    }
}

// f1 = activation(f1) (times f2 for SwiGLU), the formulas of refmath.fast.fused: SiLU through the
// overflow-free sigmoid [g >= 0 ? 1 : e] / (1 + e), e = exp(-|g|); GELU tanh or exact.
void activate(const DecodeLayersShape& s, float* f1, const float* f2) {
    const idx n = s.batch * s.d_ff;
    if (s.ffn == LayerFfn::swiglu) {
        for (idx i = 0; i < n; ++i) {
            const float g = f1[i], e = std::exp(-std::fabs(g));
            f1[i] = g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e)) * f2[i];
        }
    } else if (s.ffn == LayerFfn::gelu_tanh) {
        const float c = static_cast<float>(std::sqrt(2.0 / M_PI));
        for (idx i = 0; i < n; ++i) {
            const float z = f1[i];
            f1[i] = 0.5f * z * (1.0f + std::tanh(c * (z + 0.044715f * z * z * z)));
        }
    } else {
        for (idx i = 0; i < n; ++i) {
            const double z = f1[i];
            f1[i] = static_cast<float>(z * 0.5 * std::erfc(-z / std::sqrt(2.0)));
        }
    }
}

void add_into(float* x, const float* y, idx n) {
    for (idx i = 0; i < n; ++i) x[i] += y[i];
}

// One product of x (m, k) by a layer matrix, writing y (m, n).
struct LayerProduct {
    const LayerMatrix& w;
    idx n;
    float* y;
};

// The products of one input by up to three matrices: the float32 ones in one rows_matmul_cpu pass
// (its threads stream them all without parting between them), the ones stored in a narrower format
// in one format_rows_matmul_cpu pass. Both sum in float32.
template <std::size_t N>
void multiply(const float* x, idx m, idx k, const LayerProduct (&products)[N], int threads) {
    RowsProduct plain[N];
    FormatProduct stored[N];
    idx plain_count = 0, stored_count = 0;
    for (const LayerProduct& p : products) {
        if (p.w.stored != nullptr)
            stored[stored_count++] = {p.w.stored, p.w.format, p.n, p.y};
        else
            plain[plain_count++] = {p.w.w, p.n, p.w.transposed, p.y};
    }
    if (stored_count > 0) format_rows_matmul_cpu(x, m, k, stored, stored_count, threads);
    if (plain_count > 0) rows_matmul_cpu(x, m, k, plain, plain_count, threads);
}

void check(const DecodeLayersShape& s, const DecodeLayer* layers, idx n_layers, idx t_max,
           idx position) {
    if (s.batch < 1 || s.d_model < 1 || s.heads < 1 || s.kv_heads < 1 || s.head_dim < 1 ||
        s.d_ff < 1 || s.heads % s.kv_heads != 0)
        throw std::invalid_argument(
            "decode_layers: sizes must be positive with kv_heads dividing heads, got batch " +
            std::to_string(s.batch) + ", d_model " + std::to_string(s.d_model) + ", heads " +
            std::to_string(s.heads) + ", kv_heads " + std::to_string(s.kv_heads) + ", head_dim " +
            std::to_string(s.head_dim) + ", d_ff " + std::to_string(s.d_ff));
    if (s.rope != LayerRope::none && s.head_dim % 2 != 0)
        throw std::invalid_argument("decode_layers: RoPE needs an even head_dim, got " +
                                    std::to_string(s.head_dim));
    if (position < 0 || position >= t_max)
        throw std::invalid_argument("decode_layers: position " + std::to_string(position) +
                                    " is outside the cache's rows [0, " + std::to_string(t_max) + ")");
    if (n_layers < 0 || (n_layers > 0 && layers == nullptr))
        throw std::invalid_argument("decode_layers: no layers given");
}

}  // namespace

std::ptrdiff_t decode_layers_workspace(const DecodeLayersShape& s) {
    const idx qw = s.heads * s.head_dim, kw = s.kv_heads * s.head_dim;
    return s.batch * (2 * s.d_model + 2 * qw + 2 * kw + 2 * s.d_ff);
}

void decode_layers_cpu(const DecodeLayersShape& s, const DecodeLayer* layers, idx n_layers,
                       idx t_max, idx position, const float* cos, const float* sin, float* x,
                       float* workspace, int threads) {
    check(s, layers, n_layers, t_max, position);
    const Buffers p = carve(s, workspace);
    const idx b = s.batch, d = s.d_model, dh = s.head_dim, g = s.kv_heads;
    const idx qw = s.heads * dh, kw = g * dh;
    DecodeShape attention;
    attention.batch = b;
    attention.heads = s.heads;
    attention.kv_heads = g;
    attention.head_dim = dh;
    attention.scale = s.scale;
    const std::vector<std::int32_t> lengths(static_cast<std::size_t>(b),
                                            static_cast<std::int32_t>(position + 1));
    for (idx layer = 0; layer < n_layers; ++layer) {
        const DecodeLayer& w = layers[layer];
        norm_rows(s, x, w.norm1_gain, w.norm1_shift, p.h);
        const LayerProduct qkv[3] = {{w.w_q, qw, p.q}, {w.w_k, kw, p.k}, {w.w_v, kw, p.v}};
        multiply(p.h, b, d, qkv, threads);
        add_bias(p.q, w.b_q, b, qw);
        add_bias(p.k, w.b_k, b, kw);
        add_bias(p.v, w.b_v, b, kw);
        if (s.rope != LayerRope::none) {
            rotate(s, p.q, b * s.heads, cos, sin);
            rotate(s, p.k, b * g, cos, sin);
        }
        // The new key and value go to row `position` of each (sequence, head) block.
        for (idx r = 0; r < b; ++r)
            for (idx u = 0; u < g; ++u) {
                const idx row = ((r * g + u) * t_max + position) * dh;
                for (idx i = 0; i < dh; ++i) {
                    w.keys[row + i] = p.k[(r * g + u) * dh + i];
                    w.values[row + i] = p.v[(r * g + u) * dh + i];
                }
            }
        decode_cpu(attention, p.q, w.keys, w.values, t_max, lengths.data(), p.o);
        const LayerProduct out[1] = {{w.w_o, d, p.y}};
        multiply(p.o, b, qw, out, threads);
        add_bias(p.y, w.b_o, b, d);
        add_into(x, p.y, b * d);

        norm_rows(s, x, w.norm2_gain, w.norm2_shift, p.h);
        if (s.ffn == LayerFfn::swiglu) {
            const LayerProduct gate_up[2] = {{w.w_gate, s.d_ff, p.f1}, {w.w_up, s.d_ff, p.f2}};
            multiply(p.h, b, d, gate_up, threads);
        } else {
            const LayerProduct up[1] = {{w.w_up, s.d_ff, p.f1}};
            multiply(p.h, b, d, up, threads);
            add_bias(p.f1, w.b_up, b, s.d_ff);
        }
        activate(s, p.f1, p.f2);
        const LayerProduct down[1] = {{w.w_down, d, p.y}};
        multiply(p.f1, b, s.d_ff, down, threads);
        add_bias(p.y, w.b_down, b, d);
        add_into(x, p.y, b * d);
    }
}

}  // namespace refmath

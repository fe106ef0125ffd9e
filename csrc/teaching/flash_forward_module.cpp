// The given half of the kernel assignment: a tiled attention forward in float32 that calls the
// student's online_softmax_tile (flash_tile.h) for every (query tile, key tile) pair, as a
// pybind11 module. refmath.teaching_kernel compiles it once and links it with the student's file.
//
//   flash_forward(q, k, v, causal=False, block_q=16, block_k=16, scale=None) -> (o, lse)
//
// q: (..., T_q, d), k: (..., T_k, d), v: (..., T_k, dv), float32 (other floats are converted),
// the same leading dimensions. Causal masking is bottom-right aligned, as refmath's: query i sits at
// key position i + T_k - T_q and sees the keys up to it. A query that sees no key gets o = 0 and
// lse = -inf.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "flash_tile.h"

namespace py = pybind11;
using Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

static std::string shape_of(const Array& a) {
    std::string out = "(";
    for (py::ssize_t i = 0; i < a.ndim(); ++i) out += (i ? ", " : "") + std::to_string(a.shape(i));
    return out + (a.ndim() == 1 ? ",)" : ")");
}

static py::tuple flash_forward(Array q, Array k, Array v, bool causal, int block_q, int block_k,
                               py::object scale_arg) {
    const py::ssize_t nd = q.ndim();
    if (nd < 2 || k.ndim() != nd || v.ndim() != nd)
        throw py::value_error("q, k and v must have the same number (>= 2) of dimensions, got q " +
                              shape_of(q) + ", k " + shape_of(k) + ", v " + shape_of(v));
    long batch = 1;
    for (py::ssize_t i = 0; i < nd - 2; ++i) {
        if (k.shape(i) != q.shape(i) || v.shape(i) != q.shape(i))
            throw py::value_error("q, k and v must share their leading dimensions, got q " +
                                  shape_of(q) + ", k " + shape_of(k) + ", v " + shape_of(v));
        batch *= q.shape(i);
    }
    const int t_q = q.shape(nd - 2), t_k = k.shape(nd - 2), d = q.shape(nd - 1);
    const int dv = v.shape(nd - 1);
    if (k.shape(nd - 1) != d || v.shape(nd - 2) != t_k)
        throw py::value_error("k must be (..., T_k, d) and v (..., T_k, dv) for q (..., T_q, d), got "
                              "q " + shape_of(q) + ", k " + shape_of(k) + ", v " + shape_of(v));
    if (block_q < 1 || block_k < 1)
        throw py::value_error("block_q and block_k must be >= 1, got " + std::to_string(block_q) +
                              " and " + std::to_string(block_k));
    const float scale = scale_arg.is_none() ? 1.0f / std::sqrt(static_cast<float>(d))
                                            : scale_arg.cast<float>();

    std::vector<py::ssize_t> o_shape(q.shape(), q.shape() + nd), lse_shape(q.shape(), q.shape() + nd - 1);
    o_shape[nd - 1] = dv;
    Array o(o_shape), lse(lse_shape);
    const float* qp = q.data();
    const float* kp = k.data();
    const float* vp = v.data();
    float* op = o.mutable_data();
    float* lp = lse.mutable_data();
    const float neg_inf = -std::numeric_limits<float>::infinity();
    std::vector<float> m, l, acc;
    std::vector<unsigned char> visible;
    const int shift = t_k - t_q;  // query i sits at key position i + shift

    for (long b = 0; b < batch; ++b) {
        const float* qb = qp + b * static_cast<long>(t_q) * d;
        const float* kb = kp + b * static_cast<long>(t_k) * d;
        const float* vb = vp + b * static_cast<long>(t_k) * dv;
        for (int i0 = 0; i0 < t_q; i0 += block_q) {
            const int rows = std::min(block_q, t_q - i0);
            m.assign(rows, neg_inf);
            l.assign(rows, 0.0f);
            acc.assign(static_cast<size_t>(rows) * dv, 0.0f);
            // Causal: the last row of the tile sees keys up to i0 + rows - 1 + shift.
            const int k_end = causal ? std::min(t_k, std::max(0, i0 + rows + shift)) : t_k;
            for (int j0 = 0; j0 < k_end; j0 += block_k) {
                const int cols = std::min(block_k, t_k - j0);
                const unsigned char* mask = nullptr;
                // Only a tile that crosses the diagonal needs a mask.
                if (causal && j0 + cols - 1 > i0 + shift) {
                    visible.assign(static_cast<size_t>(rows) * cols, 0);
                    for (int r = 0; r < rows; ++r)
                        for (int c = 0; c < cols; ++c)
                            visible[r * cols + c] = (j0 + c <= i0 + r + shift);
                    mask = visible.data();
                }
                online_softmax_tile(qb + static_cast<long>(i0) * d, kb + static_cast<long>(j0) * d,
                                    vb + static_cast<long>(j0) * dv, mask, rows, cols, d, dv, scale,
                                    m.data(), l.data(), acc.data());
            }
            for (int r = 0; r < rows; ++r) {
                float* out = op + (b * static_cast<long>(t_q) + i0 + r) * dv;
                const bool seen = l[r] > 0.0f || std::isnan(l[r]);
                for (int j = 0; j < dv; ++j) out[j] = seen ? acc[static_cast<size_t>(r) * dv + j] / l[r] : 0.0f;
                lp[b * static_cast<long>(t_q) + i0 + r] = seen ? m[r] + std::log(l[r]) : neg_inf;
            }
        }
    }
    return py::make_tuple(o, lse);
}

PYBIND11_MODULE(flash_teaching, module) {
    module.doc() = "A tiled attention forward in float32 around online_softmax_tile (refmath's "
                   "kernel assignment).";
    module.def("flash_forward", &flash_forward, py::arg("q"), py::arg("k"), py::arg("v"),
               py::arg("causal") = false, py::arg("block_q") = 16, py::arg("block_k") = 16,
               py::arg("scale") = py::none(),
               "(o, lse) of softmax(scale q k^T) v, tile by tile through online_softmax_tile.");
}

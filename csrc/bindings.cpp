// Python bindings of the CPU kernels: the module refmath._C.
//
// These functions trust nothing: refmath/kernels.py validates first and gives the friendlier
// messages, but a direct caller still gets an exception rather than a read past the end of a buffer.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "adamw_cpu.h"
#include "decode_cpu.h"
#include "decode_layers_cpu.h"
#include "flash_cpu.h"
#include "piece_team.h"
#include "rows_matmul_cpu.h"
#include "softmax.h"
#include "stream_read.h"
#include "tile_math.h"
#include "weight_formats_cpu.h"

namespace py = pybind11;

namespace {

// NumPy's NPY_ARRAY_ALIGNED flag; pybind11 exposes the contiguity flags but not this one.
constexpr int kNpyAligned = 0x0100;

template <typename T>
py::array softmax_rows_typed(const py::array& x) {
    const auto rows = static_cast<std::ptrdiff_t>(x.shape(0));
    const auto cols = static_cast<std::ptrdiff_t>(x.shape(1));
    py::array_t<T> y({rows, cols});
    const T* src = static_cast<const T*>(x.data());
    T* dst = y.mutable_data();
    {
        // The kernel touches only raw buffers, so other Python threads may run meanwhile.
        py::gil_scoped_release release;
        refmath::softmax_rows(src, dst, rows, cols);
    }
    return y;
}

py::array softmax_rows(const py::array& x) {
    if (x.ndim() != 2) {
        throw py::value_error("x must have 2 dimensions (rows, cols), got " +
                              std::to_string(x.ndim()));
    }
    if (!(x.flags() & py::array::c_style) || !(x.flags() & kNpyAligned)) {
        throw py::value_error("x must be C-contiguous and aligned (use np.ascontiguousarray)");
    }
    if (py::isinstance<py::array_t<float>>(x)) return softmax_rows_typed<float>(x);
    if (py::isinstance<py::array_t<double>>(x)) return softmax_rows_typed<double>(x);
    throw py::type_error("x must be float32 or float64, got dtype " +
                         std::string(py::str(x.dtype())));
}

// ---- attention and decode: float32 only ----

std::string shape_of(const py::array& a) {
    std::string out = "(";
    for (py::ssize_t i = 0; i < a.ndim(); ++i) out += (i ? ", " : "") + std::to_string(a.shape(i));
    return out + (a.ndim() == 1 ? ",)" : ")");
}

// The checks every array argument passes before its pointer is used: the dtype (exactly T, in the
// machine's byte order), the rank, and a C-contiguous, aligned buffer (what the kernels index).
template <typename T>
const T* checked_data(const py::array& a, const char* name, py::ssize_t ndim, const char* layout,
                      const char* dtype_name) {
    if (!py::isinstance<py::array_t<T>>(a) || !a.dtype().attr("isnative").cast<bool>())
        throw py::type_error(std::string(name) + " must be a native-byte-order " + dtype_name +
                             " array, got dtype " + std::string(py::str(a.dtype())));
    if (a.ndim() != ndim)
        throw py::value_error(std::string(name) + " must have " + std::to_string(ndim) +
                              " dimensions " + layout + ", got shape " + shape_of(a));
    if (!(a.flags() & py::array::c_style) || !(a.flags() & kNpyAligned))
        throw py::value_error(std::string(name) + " must be C-contiguous and aligned "
                              "(refmath.kernels copies it first; direct callers must too)");
    return static_cast<const T*>(a.data());
}

const float* f32(const py::array& a, const char* name, py::ssize_t ndim, const char* layout) {
    return checked_data<float>(a, name, ndim, layout, "float32");
}

void require_dim(const py::array& a, const char* name, py::ssize_t axis, py::ssize_t want,
                 const std::string& what) {
    if (a.shape(axis) != want)
        throw py::value_error(std::string(name) + ".shape[" + std::to_string(axis) + "] must be " +
                              std::to_string(want) + " (" + what + "), got shape " + shape_of(a));
}

void require_same_shape(const py::array& a, const char* a_name, const py::array& b,
                        const char* b_name) {
    bool same = a.ndim() == b.ndim();
    for (py::ssize_t i = 0; same && i < a.ndim(); ++i) same = a.shape(i) == b.shape(i);
    if (!same)
        throw py::value_error(std::string(b_name) + " must have the shape of " + a_name + " " +
                              shape_of(a) + ", got " + shape_of(b));
}

py::array_t<float> new_float32(std::vector<py::ssize_t> shape) { return py::array_t<float>(shape); }

float* out_data(py::array_t<float>& a) { return a.mutable_data(); }

refmath::AttentionShape attention_shape(const py::array& q, const py::array& k, const py::array& v,
                                        bool causal, py::ssize_t window, double scale) {
    f32(q, "q", 4, "(B, H, T_q, D)");
    f32(k, "k", 4, "(B, G, T_k, D)");
    f32(v, "v", 4, "(B, G, T_k, D)");
    require_dim(k, "k", 0, q.shape(0), "the batch size B of q");
    require_dim(k, "k", 3, q.shape(3), "the head width D of q");
    require_same_shape(k, "k", v, "v");
    refmath::AttentionShape s;
    s.batch = q.shape(0);
    s.heads = q.shape(1);
    s.kv_heads = k.shape(1);
    s.t_q = q.shape(2);
    s.t_k = k.shape(2);
    s.head_dim = q.shape(3);
    s.causal = causal;
    s.window = window;
    s.scale = static_cast<float>(scale);
    refmath::check_attention_shape(s);  // std::invalid_argument -> ValueError
    return s;
}

py::tuple flash_forward(const py::array& q, const py::array& k, const py::array& v, bool causal,
                        py::ssize_t window, double scale) {
    const refmath::AttentionShape s = attention_shape(q, k, v, causal, window, scale);
    auto o = new_float32({s.batch, s.heads, s.t_q, s.head_dim});
    auto lse = new_float32({s.batch, s.heads, s.t_q});
    const float *qp = f32(q, "q", 4, ""), *kp = f32(k, "k", 4, ""), *vp = f32(v, "v", 4, "");
    float *op = out_data(o), *lp = out_data(lse);
    {
        py::gil_scoped_release release;  // the kernel touches only raw buffers
        refmath::flash_forward_cpu(s, qp, kp, vp, op, lp);
    }
    return py::make_tuple(o, lse);
}

py::tuple flash_backward(const py::array& dout, const py::array& q, const py::array& k,
                         const py::array& v, const py::array& o, const py::array& lse, bool causal,
                         py::ssize_t window, double scale) {
    const refmath::AttentionShape s = attention_shape(q, k, v, causal, window, scale);
    f32(dout, "do", 4, "(B, H, T_q, D)");
    f32(o, "o", 4, "(B, H, T_q, D)");
    f32(lse, "lse", 3, "(B, H, T_q)");
    require_same_shape(q, "q", dout, "do");
    require_same_shape(q, "q", o, "o");
    for (py::ssize_t axis = 0; axis < 3; ++axis)
        require_dim(lse, "lse", axis, q.shape(axis), "from q's (B, H, T_q)");
    auto dq = new_float32({s.batch, s.heads, s.t_q, s.head_dim});
    auto dk = new_float32({s.batch, s.kv_heads, s.t_k, s.head_dim});
    auto dv = new_float32({s.batch, s.kv_heads, s.t_k, s.head_dim});
    const float *dop = f32(dout, "do", 4, ""), *qp = f32(q, "q", 4, ""), *kp = f32(k, "k", 4, ""),
                *vp = f32(v, "v", 4, ""), *op = f32(o, "o", 4, ""), *lp = f32(lse, "lse", 3, "");
    float *dqp = out_data(dq), *dkp = out_data(dk), *dvp = out_data(dv);
    {
        py::gil_scoped_release release;
        refmath::flash_backward_cpu(s, dop, qp, kp, vp, op, lp, dqp, dkp, dvp);
    }
    return py::make_tuple(dq, dk, dv);
}

refmath::DecodeShape decode_shape(const py::array& q, py::ssize_t kv_heads, double scale,
                                  py::ssize_t splits) {
    f32(q, "q", 3, "(B, H, D)");
    refmath::DecodeShape s;
    s.batch = q.shape(0);
    s.heads = q.shape(1);
    s.kv_heads = kv_heads;
    s.head_dim = q.shape(2);
    s.scale = static_cast<float>(scale);
    s.splits = splits;
    return s;
}

// Sequence lengths are int32 in every compiled kernel, like the page table; refmath/kernels.py
// checks their range before narrowing them.
const std::int32_t* lengths_data(const py::array& lengths, py::ssize_t batch) {
    const auto* p = checked_data<std::int32_t>(lengths, "lengths", 1, "(B,)", "int32");
    require_dim(lengths, "lengths", 0, batch, "one per sequence of q");
    return p;
}

py::array decode(const py::array& q, const py::array& k_cache, const py::array& v_cache,
                 const py::array& lengths, double scale, py::ssize_t splits) {
    f32(k_cache, "k_cache", 4, "(B, G, T_max, D)");
    require_same_shape(k_cache, "k_cache", v_cache, "v_cache");
    refmath::DecodeShape s = decode_shape(q, k_cache.shape(1), scale, splits);
    require_dim(k_cache, "k_cache", 0, s.batch, "the batch size B of q");
    require_dim(k_cache, "k_cache", 3, s.head_dim, "the head width D of q");
    const std::int32_t* lp = lengths_data(lengths, s.batch);
    auto o = new_float32({s.batch, s.heads, s.head_dim});
    const float *qp = f32(q, "q", 3, ""), *kp = f32(k_cache, "k_cache", 4, ""),
                *vp = f32(v_cache, "v_cache", 4, "");
    float* op = out_data(o);
    const py::ssize_t t_max = k_cache.shape(2);
    {
        py::gil_scoped_release release;
        refmath::decode_cpu(s, qp, kp, vp, t_max, lp, op);  // checks lengths before any work
    }
    return o;
}

py::array paged_decode(const py::array& q, const py::array& k_pages, const py::array& v_pages,
                       const py::array& page_table, const py::array& lengths, double scale,
                       py::ssize_t splits) {
    f32(k_pages, "k_pages", 4, "(n_pages, G, page_size, D)");
    require_same_shape(k_pages, "k_pages", v_pages, "v_pages");
    refmath::DecodeShape s = decode_shape(q, k_pages.shape(1), scale, splits);
    require_dim(k_pages, "k_pages", 3, s.head_dim, "the head width D of q");
    const auto* tp = checked_data<std::int32_t>(page_table, "page_table", 2, "(B, max_pages)", "int32");
    require_dim(page_table, "page_table", 0, s.batch, "one row per sequence of q");
    const std::int32_t* lp = lengths_data(lengths, s.batch);
    auto o = new_float32({s.batch, s.heads, s.head_dim});
    const float *qp = f32(q, "q", 3, ""), *kp = f32(k_pages, "k_pages", 4, ""),
                *vp = f32(v_pages, "v_pages", 4, "");
    float* op = out_data(o);
    const py::ssize_t n_pages = k_pages.shape(0), page_size = k_pages.shape(2),
                      max_pages = page_table.shape(1);
    {
        py::gil_scoped_release release;
        // Checks every length and every page id a length needs before any work.
        refmath::paged_decode_cpu(s, qp, kp, vp, n_pages, page_size, tp, max_pages, lp, op);
    }
    return o;
}

double stream_sum(const py::array& x) {
    const float* p = checked_data<float>(x, "x", x.ndim(), "", "float32");
    const auto n = static_cast<std::ptrdiff_t>(x.size());
    py::gil_scoped_release release;
    return refmath::stream_sum(p, n);
}

// x read as rows along its first axis, in the order of the int32 list 'order' (each entry checked).
double stream_sum_rows(const py::array& x, const py::array& order) {
    const float* p = checked_data<float>(x, "x", x.ndim(), "", "float32");
    if (x.ndim() < 1) throw py::value_error("x must have at least one dimension to take rows of");
    const auto* op = checked_data<std::int32_t>(order, "order", 1, "(n,)", "int32");
    const py::ssize_t rows = x.shape(0), n = order.shape(0);
    for (py::ssize_t i = 0; i < n; ++i)
        if (op[i] < 0 || op[i] >= rows)
            throw py::value_error("order[" + std::to_string(i) + "] = " + std::to_string(op[i]) +
                                  " is not a row of x, whose shape is " + shape_of(x));
    const py::ssize_t row_len = rows > 0 ? x.size() / rows : 0;
    py::gil_scoped_release release;
    return refmath::stream_sum_rows(p, row_len, op, n);
}

// ---- one AdamW step over flat buffers (catalogue O4): float32 or float64 ----

// The byte range an array's data occupies; two arrays overlap when their ranges do.
bool overlap(const py::array& a, const py::array& b) {
    if (a.nbytes() == 0 || b.nbytes() == 0) return false;
    const auto* pa = static_cast<const char*>(a.data());
    const auto* pb = static_cast<const char*>(b.data());
    return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

// A 1-D, C-contiguous, aligned array of exactly T in native byte order, written in place when
// 'writes' is set. The arrays updated in place cannot be copied into a better layout here.
template <typename T>
void check_flat(const py::array& a, const std::string& name, const std::string& dtype_name,
                bool writes) {
    // isinstance<array_t<T>> refuses other byte orders too (NumPy does not call them equivalent),
    // without the Python attribute look-up of dtype.isnative, which costs more than a small piece.
    if (!py::isinstance<py::array_t<T>>(a))
        throw py::type_error(name + " must be a native-byte-order " + dtype_name +
                             " array (the dtype of p), got dtype " + std::string(py::str(a.dtype())));
    if (a.ndim() != 1)
        throw py::value_error(name + " must be 1-D, got shape " + shape_of(a));
    if (!(a.flags() & py::array::c_style) || !(a.flags() & kNpyAligned))
        throw py::value_error(name + " must be contiguous and aligned, got a strided view of " +
                              "shape " + shape_of(a));
    if (writes && !a.writeable())
        throw py::value_error(name + " must be writeable: it is updated in place");
}

template <typename T>
void adamw_step_typed(const py::array& p, const std::vector<py::array>& g, const py::array& m,
                      const py::array& v, const std::vector<double>& shrink,
                      const std::vector<double>& scalars, int threads) {
    const std::string dtype_name = std::is_same<T, float>::value ? "float32" : "float64";
    check_flat<T>(p, "p", dtype_name, true);
    check_flat<T>(m, "m", dtype_name, true);
    check_flat<T>(v, "v", dtype_name, true);
    if (m.size() != p.size() || v.size() != p.size())
        throw py::value_error("m and v must have the length of p " + shape_of(p) + ", got m " +
                              shape_of(m) + " and v " + shape_of(v));
    if (overlap(p, m) || overlap(p, v) || overlap(m, v))
        throw py::value_error("p, m and v must be separate arrays: two of them share memory");
    std::vector<refmath::AdamWPiece<T>> pieces(g.size());
    py::ssize_t total = 0;
    for (std::size_t k = 0; k < g.size(); ++k) {
        const std::string name = "g[" + std::to_string(k) + "]";
        check_flat<T>(g[k], name, dtype_name, false);
        if (overlap(g[k], p) || overlap(g[k], m) || overlap(g[k], v))
            throw py::value_error(name + " shares memory with p, m or v, which the step writes");
        pieces[k] = {static_cast<const T*>(g[k].data()), g[k].size(), static_cast<T>(shrink[k])};
        total += g[k].size();
    }
    if (total != p.size())
        throw py::value_error("the gradient pieces g must cover p end to end: their lengths add up "
                              "to " + std::to_string(total) + ", p has " +
                              std::to_string(p.size()));
    // Each scalar rounded once to T, as NumPy rounds a Python float next to an array of dtype T.
    const refmath::AdamWScalars<T> s{static_cast<T>(scalars[0]), static_cast<T>(scalars[1]),
                                     static_cast<T>(scalars[2]), static_cast<T>(scalars[3]),
                                     static_cast<T>(scalars[4]), static_cast<T>(scalars[5]),
                                     static_cast<T>(scalars[6]), static_cast<T>(scalars[7])};
    T* pp = static_cast<T*>(const_cast<void*>(p.data()));
    T* mp = static_cast<T*>(const_cast<void*>(m.data()));
    T* vp = static_cast<T*>(const_cast<void*>(v.data()));
    py::gil_scoped_release release;  // the kernel touches only raw buffers, held alive by g, p, m, v
    refmath::adamw_step_cpu<T>(pp, mp, vp, pieces.data(), static_cast<std::ptrdiff_t>(pieces.size()),
                               s, threads);
}

void adamw_step(const py::array& p, const py::list& g, const py::array& m, const py::array& v,
                const std::vector<double>& shrink, const std::vector<double>& scalars,
                int threads) {
    std::vector<py::array> pieces;
    for (std::size_t k = 0; k < g.size(); ++k) {
        if (!py::isinstance<py::array>(g[k]))
            throw py::type_error("g[" + std::to_string(k) + "] must be a NumPy array, got " +
                                 std::string(py::str(py::type::of(g[k]).attr("__name__"))));
        pieces.push_back(py::reinterpret_borrow<py::array>(g[k]));
    }
    if (shrink.size() != pieces.size())
        throw py::value_error("shrink must hold one factor per gradient piece: " +
                              std::to_string(pieces.size()) + " pieces, " +
                              std::to_string(shrink.size()) + " factors");
    if (scalars.size() != 8)
        throw py::value_error("scalars must be (beta1, 1 - beta1, beta2, 1 - beta2, 1 - beta1^s, "
                              "1 - beta2^s, lr, eps), got " + std::to_string(scalars.size()) +
                              " numbers");
    // A bound that keeps OpenMP from being asked for an absurd team (it would fail creating it).
    if (threads < 1 || threads > 256)
        throw py::value_error("threads must be between 1 and 256, got " + std::to_string(threads));
    if (py::isinstance<py::array_t<float>>(p))
        return adamw_step_typed<float>(p, pieces, m, v, shrink, scalars, threads);
    if (py::isinstance<py::array_t<double>>(p))
        return adamw_step_typed<double>(p, pieces, m, v, shrink, scalars, threads);
    throw py::type_error("p must be float32 or float64, got dtype " + std::string(py::str(p.dtype())));
}

// ---- a few rows times large matrices, for decoding: float32 ----

// A 2-D, C-contiguous, aligned float32 array in native byte order (array_t<float> refuses other
// byte orders; no Python attribute look-up, since a decode step makes a hundred of these calls).
void check_matrix(const py::array& a, const std::string& name, bool writes) {
    if (!py::isinstance<py::array_t<float>>(a))
        throw py::type_error(name + " must be a native-byte-order float32 array, got dtype " +
                             std::string(py::str(a.dtype())));
    if (a.ndim() != 2)
        throw py::value_error(name + " must be 2-D, got shape " + shape_of(a));
    if (!(a.flags() & py::array::c_style) || !(a.flags() & kNpyAligned))
        throw py::value_error(name + " must be C-contiguous and aligned, got a strided view of "
                              "shape " + shape_of(a));
    if (writes && !a.writeable())
        throw py::value_error(name + " must be writeable: the product is written into it");
}

// outs[j] = x w[j] (or x w[j]^T where transposed[j]); x (m, k), outs[j] (m, n_j).
void rows_matmul(const py::array& x, const std::vector<py::array>& ws,
                 const std::vector<bool>& transposed, const std::vector<py::array>& outs) {
    check_matrix(x, "x", false);
    if (ws.size() != transposed.size() || ws.size() != outs.size())
        throw py::value_error("w, transposed and out must have one entry per product, got " +
                              std::to_string(ws.size()) + ", " + std::to_string(transposed.size()) +
                              " and " + std::to_string(outs.size()));
    const py::ssize_t m = x.shape(0), k = x.shape(1);
    std::vector<refmath::RowsProduct> products(ws.size());
    for (std::size_t j = 0; j < ws.size(); ++j) {
        const std::string w_name = "w[" + std::to_string(j) + "]";
        const std::string out_name = "out[" + std::to_string(j) + "]";
        check_matrix(ws[j], w_name, false);
        check_matrix(outs[j], out_name, true);
        const py::ssize_t k_w = ws[j].shape(transposed[j] ? 1 : 0);
        const py::ssize_t n = ws[j].shape(transposed[j] ? 0 : 1);
        if (k_w != k)
            throw py::value_error(w_name + " " + shape_of(ws[j]) + (transposed[j] ? " (transposed)" : "") +
                                  " does not fit x " + shape_of(x) + ": it needs k = " +
                                  std::to_string(k) + " along its " +
                                  (transposed[j] ? "second" : "first") + " axis");
        if (outs[j].shape(0) != m || outs[j].shape(1) != n)
            throw py::value_error(out_name + " must have shape (" + std::to_string(m) + ", " +
                                  std::to_string(n) + "), got " + shape_of(outs[j]));
        if (overlap(outs[j], x) || overlap(outs[j], ws[j]))
            throw py::value_error(out_name + " shares memory with x or " + w_name +
                                  ", which the product reads");
        for (std::size_t i = 0; i < ws.size(); ++i)
            if ((i != j && overlap(outs[j], ws[i])) || (i < j && overlap(outs[j], outs[i])))
                throw py::value_error(out_name + " shares memory with another product's w or out");
        products[j] = {static_cast<const float*>(ws[j].data()), n, static_cast<bool>(transposed[j]),
                       static_cast<float*>(const_cast<void*>(outs[j].data()))};
    }
    const auto* xp = static_cast<const float*>(x.data());
    py::gil_scoped_release release;  // raw buffers only, held alive by x, ws and outs
    refmath::rows_matmul_cpu(xp, m, k, products.data(), static_cast<std::ptrdiff_t>(products.size()),
                             refmath::tile::max_threads());
}


// ---- a few rows times a weight matrix in bf16, f16 or Q8_0 ----

// out (m, n) = x (m, k) times w^T, w (n, k) of 16-bit values ("bf16": uint16 bit patterns,
// "f16": float16) or (n, k / 32) Q8_0 blocks of 34 bytes ("q8_0").
// A weight format's name, and how its stored arrays look: dtype kind, item size, weights an item.
struct StoredFormat {
    refmath::WeightFormat format;
    char kind;
    py::ssize_t itemsize, per_item;
};

StoredFormat stored_format(const std::string& format) {
    if (format == "bf16") return {refmath::WeightFormat::bf16, 'u', 2, 1};
    if (format == "f16") return {refmath::WeightFormat::f16, 'f', 2, 1};
    if (format == "q8_0")
        return {refmath::WeightFormat::q8_0, 'V', refmath::kQ8BlockBytes, refmath::kQ8Block};
    throw py::value_error("format must be 'bf16', 'f16' or 'q8_0', got '" + format + "'");
}

void check_stored_dtype(const py::array& w, const std::string& name, const std::string& format,
                        const StoredFormat& sf) {
    if (w.dtype().kind() != sf.kind || w.itemsize() != sf.itemsize)
        throw py::type_error(name + " in format " + format + " must have dtype kind '" +
                             std::string(1, sf.kind) + "' and " + std::to_string(sf.itemsize) +
                             "-byte items, got dtype " + std::string(py::str(w.dtype())));
}

void format_rows_matmul(const py::array& x, const py::array& w, const std::string& format,
                        const py::array& out) {
    check_matrix(x, "x", false);
    check_matrix(out, "out", true);
    const StoredFormat sf = stored_format(format);
    const refmath::WeightFormat f = sf.format;
    const py::ssize_t per_item = sf.per_item;
    check_stored_dtype(w, "w", format, sf);
    if (w.ndim() != 2 || !(w.flags() & py::array::c_style))
        throw py::value_error("w must be a C-contiguous 2-D array, got shape " + shape_of(w));
    const py::ssize_t m = x.shape(0), k = x.shape(1), n = w.shape(0);
    if (w.shape(1) * per_item != k)
        throw py::value_error("w " + shape_of(w) + " in format " + format + " does not fit x " +
                              shape_of(x) + ": it needs " + std::to_string(k) + " weights a row");
    if (out.shape(0) != m || out.shape(1) != n)
        throw py::value_error("out must have shape (" + std::to_string(m) + ", " +
                              std::to_string(n) + "), got " + shape_of(out));
    if (overlap(out, x) || overlap(out, w))
        throw py::value_error("out shares memory with x or w, which the product reads");
    const auto* xp = static_cast<const float*>(x.data());
    const void* wp = w.data();
    auto* yp = static_cast<float*>(const_cast<void*>(out.data()));  // checked writeable above
    py::gil_scoped_release release;  // raw buffers only, held alive by x, w and out
    refmath::format_rows_matmul_cpu(xp, m, k, wp, f, n, yp, refmath::tile::max_threads());
}

// ---- every layer of a decode step in one call: float32 ----

// A weight of logical shape (rows, cols) = (in, out), stored C-contiguous or as the rows of its
// transpose (the decode layout); what rows_matmul_cpu reads.
refmath::LayerMatrix layer_matrix(const py::array& a, const std::string& name, py::ssize_t rows,
                                  py::ssize_t cols) {
    if (!py::isinstance<py::array_t<float>>(a))
        throw py::type_error(name + " must be a native-byte-order float32 array, got dtype " +
                             std::string(py::str(a.dtype())));
    if (a.ndim() != 2 || a.shape(0) != rows || a.shape(1) != cols)
        throw py::value_error(name + " must have shape (" + std::to_string(rows) + ", " +
                              std::to_string(cols) + "), got " + shape_of(a));
    const auto item = static_cast<py::ssize_t>(sizeof(float));
    const bool plain = (a.flags() & py::array::c_style) != 0;
    const bool transposed = a.strides(0) == item && a.strides(1) == item * rows;
    if (!(plain || transposed) || !(a.flags() & kNpyAligned))
        throw py::value_error(name + " must be C-contiguous or the transpose of a C-contiguous "
                              "array, and aligned");
    return {static_cast<const float*>(a.data()), !plain};
}

// A weight of logical shape (rows, cols) = (in, out) kept in a narrower format as the rows of its
// transpose: (out, in) 16-bit values, or (out, in / 32) Q8_0 blocks; what format_rows_matmul_cpu
// reads.
refmath::LayerMatrix stored_layer_matrix(const py::array& a, const std::string& name,
                                         py::ssize_t rows, py::ssize_t cols,
                                         const std::string& format) {
    const StoredFormat sf = stored_format(format);
    check_stored_dtype(a, name, format, sf);
    if (rows % sf.per_item != 0)
        throw py::value_error(name + ": " + format + " rows hold whole blocks of " +
                              std::to_string(sf.per_item) + " weights, got " +
                              std::to_string(rows) + " inputs");
    if (a.ndim() != 2 || a.shape(0) != cols || a.shape(1) != rows / sf.per_item)
        throw py::value_error(name + " in format " + format + " must have shape (" +
                              std::to_string(cols) + ", " + std::to_string(rows / sf.per_item) +
                              "), got " + shape_of(a));
    if (!(a.flags() & py::array::c_style) || !(a.flags() & kNpyAligned))
        throw py::value_error(name + " must be C-contiguous and aligned");
    refmath::LayerMatrix m;
    m.stored = a.data();
    m.format = sf.format;
    return m;
}

// A float32 vector of n entries, or nullptr where the dict has no entry `key` and it may be absent.
const float* layer_vector(const py::dict& layer, const char* key, py::ssize_t n, bool required,
                          const std::string& where) {
    if (!layer.contains(key)) {
        if (required) throw py::value_error(where + " has no entry '" + key + "'");
        return nullptr;
    }
    const py::array a = layer[key].cast<py::array>();
    const std::string name = where + "['" + key + "']";
    const float* p = checked_data<float>(a, name.c_str(), 1, "", "float32");
    if (a.shape(0) != n)
        throw py::value_error(name + " must have shape (" + std::to_string(n) + ",), got " +
                              shape_of(a));
    return p;
}

template <typename E>
E choice(const std::string& value, const char* name, const std::vector<std::string>& names) {
    for (std::size_t i = 0; i < names.size(); ++i)
        if (value == names[i]) return static_cast<E>(i);
    std::string all;
    for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
    throw py::value_error(std::string(name) + " must be one of " + all + ", got '" + value + "'");
}

// The layers' weights and cache blocks, checked once; step() runs them all on one new row each.
class DecodeLayers {
   public:
    DecodeLayers(py::ssize_t batch, py::ssize_t d_model, py::ssize_t heads, py::ssize_t kv_heads,
                 py::ssize_t head_dim, py::ssize_t d_ff, const std::string& norm, double eps,
                 const std::string& ffn, const std::string& rope, double scale,
                 const py::list& layers, const std::string& weights) {
        s_.batch = batch;
        s_.d_model = d_model;
        s_.heads = heads;
        s_.kv_heads = kv_heads;
        s_.head_dim = head_dim;
        s_.d_ff = d_ff;
        s_.norm = choice<refmath::LayerNorm>(norm, "norm", {"rms", "layer"});
        s_.eps = static_cast<float>(eps);
        s_.ffn = choice<refmath::LayerFfn>(ffn, "ffn", {"swiglu", "gelu_tanh", "gelu_exact"});
        s_.rope = choice<refmath::LayerRope>(rope, "rope", {"none", "interleaved", "half"});
        s_.scale = static_cast<float>(scale);
        if (weights != "f32") stored_format(weights);  // a name it does not know is refused here
        if (batch < 1 || d_model < 1 || heads < 1 || kv_heads < 1 || head_dim < 1 || d_ff < 1 ||
            heads % kv_heads != 0 || (s_.rope != refmath::LayerRope::none && head_dim % 2 != 0))
            throw py::value_error("sizes must be positive, kv_heads must divide heads and RoPE "
                                  "needs an even head_dim");
        const py::ssize_t qw = heads * head_dim, kw = kv_heads * head_dim;
        for (std::size_t i = 0; i < layers.size(); ++i) {
            const std::string where = "layers[" + std::to_string(i) + "]";
            const py::dict l = layers[i].cast<py::dict>();
            keep_.push_back(l);  // holds every array the pointers below read
            auto matrix = [&](const char* key, py::ssize_t rows, py::ssize_t cols) {
                if (!l.contains(key)) throw py::value_error(where + " has no entry '" + key + "'");
                const std::string name = where + "['" + key + "']";
                if (weights != "f32")
                    return stored_layer_matrix(l[key].cast<py::array>(), name, rows, cols, weights);
                return layer_matrix(l[key].cast<py::array>(), name, rows, cols);
            };
            refmath::DecodeLayer w;
            const bool shifted = s_.norm == refmath::LayerNorm::layer;
            w.norm1_gain = layer_vector(l, "norm1_gain", d_model, true, where);
            w.norm1_shift = layer_vector(l, "norm1_shift", d_model, false, where);
            w.norm2_gain = layer_vector(l, "norm2_gain", d_model, true, where);
            w.norm2_shift = layer_vector(l, "norm2_shift", d_model, false, where);
            if (!shifted && (w.norm1_shift || w.norm2_shift))
                throw py::value_error(where + ": RMSNorm takes no shift");
            w.w_q = matrix("w_q", d_model, qw);
            w.w_k = matrix("w_k", d_model, kw);
            w.w_v = matrix("w_v", d_model, kw);
            w.w_o = matrix("w_o", qw, d_model);
            w.b_q = layer_vector(l, "b_q", qw, false, where);
            w.b_k = layer_vector(l, "b_k", kw, false, where);
            w.b_v = layer_vector(l, "b_v", kw, false, where);
            w.b_o = layer_vector(l, "b_o", d_model, false, where);
            const bool gated = s_.ffn == refmath::LayerFfn::swiglu;
            if (gated) w.w_gate = matrix("w_gate", d_model, d_ff);
            w.w_up = matrix("w_up", d_model, d_ff);
            w.w_down = matrix("w_down", d_ff, d_model);
            w.b_up = layer_vector(l, "b_up", d_ff, false, where);
            w.b_down = layer_vector(l, "b_down", d_model, false, where);
            if (gated && w.b_up)
                throw py::value_error(where + ": the SwiGLU FFN takes no b_up");
            for (const char* key : {"keys", "values"}) {
                if (!l.contains(key)) throw py::value_error(where + " has no entry '" + key + "'");
                const py::array c = l[key].cast<py::array>();
                const std::string name = where + "['" + key + "']";
                checked_data<float>(c, name.c_str(), 4, "(B, G, T_max, D)", "float32");
                if (!c.writeable()) throw py::value_error(name + " must be writeable");
                if (c.shape(0) != batch || c.shape(1) != kv_heads || c.shape(3) != head_dim ||
                    (t_max_ >= 0 && c.shape(2) != t_max_))
                    throw py::value_error(name + " must have shape (" + std::to_string(batch) +
                                          ", " + std::to_string(kv_heads) + ", T_max, " +
                                          std::to_string(head_dim) + ") with one T_max for every "
                                          "layer, got " + shape_of(c));
                t_max_ = c.shape(2);
                (key[0] == 'k' ? w.keys : w.values) =
                    static_cast<float*>(const_cast<void*>(c.data()));
            }
            layers_.push_back(w);
        }
    }

    // x (batch, d_model) in place; cos, sin (head_dim / 2,), the rotation at `position`.
    void step(const py::array& x, py::ssize_t position, const py::array& cos, const py::array& sin) {
        float* xp = const_cast<float*>(f32(x, "x", 2, "(B, d_model)"));
        if (x.shape(0) != s_.batch || x.shape(1) != s_.d_model)
            throw py::value_error("x must have shape (" + std::to_string(s_.batch) + ", " +
                                  std::to_string(s_.d_model) + "), got " + shape_of(x));
        if (!x.writeable()) throw py::value_error("x must be writeable: the step updates it");
        const py::ssize_t half = s_.head_dim / 2;
        const float* cp = f32(cos, "cos", 1, "(head_dim / 2,)");
        const float* sp = f32(sin, "sin", 1, "(head_dim / 2,)");
        if (s_.rope != refmath::LayerRope::none && (cos.shape(0) != half || sin.shape(0) != half))
            throw py::value_error("cos and sin must have shape (" + std::to_string(half) +
                                  ",), got " + shape_of(cos) + " and " + shape_of(sin));
        if (layers_.empty()) return;
        if (position < 0 || position >= t_max_)
            throw py::value_error("position " + std::to_string(position) +
                                  " is outside the cache's rows [0, " + std::to_string(t_max_) + ")");
        // Scratch per calling thread, kept between calls: two Python threads stepping at once
        // (the GIL is released below) never share it.
        static thread_local std::vector<float> workspace;
        const auto need = static_cast<std::size_t>(refmath::decode_layers_workspace(s_));
        if (workspace.size() < need) workspace.resize(need);
        py::gil_scoped_release release;  // raw buffers only, held alive by keep_ and the arguments
        refmath::decode_layers_cpu(s_, layers_.data(), static_cast<std::ptrdiff_t>(layers_.size()),
                                   t_max_, position, cp, sp, xp, workspace.data(),
                                   refmath::tile::max_threads());
    }

    py::ssize_t t_max() const { return t_max_; }

   private:
    refmath::DecodeLayersShape s_;
    std::vector<refmath::DecodeLayer> layers_;
    std::vector<py::dict> keep_;
    py::ssize_t t_max_ = -1;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "refmath's CPU kernels (C++17, OpenMP). Call them through refmath.kernels.";
    m.def("softmax_rows", &softmax_rows, py::arg("x"),
          "Softmax over the last axis of a C-contiguous 2-D float32/float64 array; returns a new "
          "array. Fully masked rows (all -inf) give zeros.");
    m.def("flash_forward", &flash_forward, py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("causal"), py::arg("window"), py::arg("scale"),
          "FlashAttention forward, float32: returns (o, lse). q (B, H, T_q, D), k and v "
          "(B, G, T_k, D); window 0 = none. Call it through refmath.kernels.");
    m.def("flash_backward", &flash_backward, py::arg("do"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("causal"), py::arg("window"),
          py::arg("scale"), "FlashAttention-2 backward, float32: returns (dq, dk, dv).");
    m.def("set_backward_schedule", &refmath::set_backward_schedule, py::arg("schedule"),
          "For tests: 0 lets flash_backward choose its schedule, 1 forces one pass, 2 two passes.");
    m.def("decode", &decode, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
          py::arg("lengths"), py::arg("scale"), py::arg("splits"),
          "One decode step over contiguous caches (B, G, T_max, D); lengths int32 (B,); "
          "splits 0 = automatic.");
    m.def("paged_decode", &paged_decode, py::arg("q"), py::arg("k_pages"), py::arg("v_pages"),
          py::arg("page_table"), py::arg("lengths"), py::arg("scale"), py::arg("splits"),
          "One decode step over pages (n_pages, G, page_size, D); page_table int32 "
          "(B, max_pages), lengths int32 (B,); splits 0 = automatic.");
    m.def("stream_sum", &stream_sum, py::arg("x"),
          "Sum of a C-contiguous float32 array read once by all threads (a memory-bandwidth probe).");
    m.def("stream_sum_rows", &stream_sum_rows, py::arg("x"), py::arg("order"),
          "Sum of the rows x[order[0]], x[order[1]], ... of a C-contiguous float32 array, read in "
          "that order by all threads (the read of a paged cache in page-table order).");
    m.def("adamw_step", &adamw_step, py::arg("p"), py::arg("g"), py::arg("m"), py::arg("v"),
          py::arg("shrink"), py::arg("scalars"), py::arg("threads"),
          "One AdamW step in place on the 1-D arrays p, m, v (float32 or float64), reading the "
          "gradients from the list g of 1-D pieces laid end to end over p, piece k decayed by "
          "shrink[k]; scalars (beta1, 1 - beta1, beta2, 1 - beta2, 1 - beta1^s, 1 - beta2^s, lr, "
          "eps). Call it through refmath.kernels.adamw_step.");
    m.def("rows_matmul", &rows_matmul, py::arg("x"), py::arg("w"), py::arg("transposed"),
          py::arg("out"),
          "out[j] = x @ w[j] (x @ w[j].T where transposed[j]) for a few float32 rows x (m, k), "
          "each w[j] C-contiguous, read once by all threads. Call it through "
          "refmath.kernels.rows_matmul.");
    py::class_<DecodeLayers>(m, "DecodeLayers",
                             "Every layer of a decode step, its weights and cache blocks checked "
                             "once. Call it through refmath.inference.compiled_step.")
        .def(py::init<py::ssize_t, py::ssize_t, py::ssize_t, py::ssize_t, py::ssize_t, py::ssize_t,
                      const std::string&, double, const std::string&, const std::string&, double,
                      const py::list&, const std::string&>(),
             py::arg("batch"), py::arg("d_model"), py::arg("heads"), py::arg("kv_heads"),
             py::arg("head_dim"), py::arg("d_ff"), py::arg("norm"), py::arg("eps"), py::arg("ffn"),
             py::arg("rope"), py::arg("scale"), py::arg("layers"), py::arg("weights") = "f32")
        .def("step", &DecodeLayers::step, py::arg("x"), py::arg("position"), py::arg("cos"),
             py::arg("sin"), "Run x (B, d_model) through every layer in place at `position`, "
             "appending each layer's key and value to its cache blocks.")
        .def_property_readonly("t_max", &DecodeLayers::t_max);
    m.def("max_threads", &refmath::tile::max_threads,
          "The number of OpenMP threads the kernels use (1 without OpenMP).");
    m.def("format_rows_matmul", &format_rows_matmul, py::arg("x"), py::arg("w"),
          py::arg("format"), py::arg("out"),
          "out = x w^T for float32 x (m, k) and w (n, k) stored as bf16, f16 or Q8_0 blocks, "
          "summed in float32. Call it through refmath.kernels.format_rows_matmul.");
    m.def("f16_to_f32", &refmath::f16_to_f32, py::arg("bits"),
          "The float32 value of a float16 bit pattern, as the kernels decode it.");
    m.def("set_threads", &refmath::tile::set_thread_limit, py::arg("n"),
          "Run every kernel on at most n OpenMP threads (n > 0), or on OpenMP's own count (0).");
    m.def("thread_limit", &refmath::tile::thread_limit,
          "The count set by set_threads (0: OpenMP's own count).");
    m.def("last_team", &refmath::tile::last_team,
          "Threads the last row product, decode or bandwidth probe was shared among (the setting).");
    m.def("last_threads_used", &refmath::team::last_threads_used,
          "Threads the last call shared by the piece team could use: its count, or fewer while "
          "other processes keep the cores busy (0 before the first).");
    m.def("vector_lanes", [] { return refmath::tile::wide_vectors() ? 16 : 8; },
          "Lanes of the vectors the attention kernels run with now: 16 on a CPU with AVX-512 "
          "(x86-64-v4), else 8 (AVX2, or the baseline instructions emulating them).");
    m.def("narrow_copy", &refmath::tile::narrow_copy,
          "The copy the 8-lane kernels run: 'x86-64-v3' (AVX2, FMA), 'baseline' (SSE2) or "
          "'build target' (no run-time choice).");
    m.def("set_wide_vectors", &refmath::tile::set_wide_vectors, py::arg("on"),
          "Allow (True, the default) or forbid the 16-lane AVX-512 copies of the kernels; "
          "forbidding them runs the 8-lane copies, e.g. to test or time them on such a CPU.");
#ifdef _OPENMP
    m.attr("openmp") = true;
#else
    m.attr("openmp") = false;
#endif
}

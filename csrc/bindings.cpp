// Python bindings of the CPU kernels: the module refmath._C.
//
// These functions trust nothing: refmath/kernels.py validates first and gives the friendlier
// messages, but a direct caller still gets an exception rather than a read past the end of a buffer.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "decode_cpu.h"
#include "flash_cpu.h"
#include "softmax.h"
#include "stream_read.h"
#include "tile_math.h"

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
    m.def("max_threads", &refmath::tile::max_threads,
          "The number of OpenMP threads the kernels use (1 without OpenMP).");
    m.def("vector_lanes", [] { return refmath::tile::wide_vectors() ? 16 : 8; },
          "Lanes of the vectors the attention kernels run with now: 16 on a CPU with AVX-512 "
          "(x86-64-v4), else 8 (AVX2, or the baseline instructions emulating them).");
    m.def("set_wide_vectors", &refmath::tile::set_wide_vectors, py::arg("on"),
          "Allow (True, the default) or forbid the 16-lane AVX-512 copies of the kernels; "
          "forbidding them runs the 8-lane copies, e.g. to test or time them on such a CPU.");
#ifdef _OPENMP
    m.attr("openmp") = true;
#else
    m.attr("openmp") = false;
#endif
}

// Python bindings of the CUDA kernels: the module refmath._cuda.
//
// The functions take raw device pointers (Python ints, e.g. from CuPy's __cuda_array_interface__)
// so this module needs no array library at build time; refmath/kernels.py checks shapes, dtypes and
// contiguity before any pointer gets here. The CUDA runtime is linked statically and only loads the
// driver when first called, so importing this module works on a machine with no GPU or driver.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "flash_ladder.h"
#include "launch.h"

namespace py = pybind11;

namespace {

// (number of devices, status text). Without a driver or a GPU the runtime reports an error such
// as "no CUDA-capable device is detected"; that is an answer here (zero devices), not a failure.
std::pair<int, std::string> device_query() {
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) {
        cudaGetLastError();  // clear it, so the next CUDA call does not report this one
        // Without libcuda.so at all the runtime says "driver version is insufficient"; say both.
        const std::string hint = status == cudaErrorInsufficientDriver
                                     ? "no CUDA driver, or one older than this runtime: "
                                     : "";
        return {0, hint + cudaGetErrorString(status)};
    }
    return {count, "ok"};
}

void softmax_rows(std::uintptr_t in_ptr, std::uintptr_t out_ptr, std::int64_t rows,
                  std::int64_t cols, int dtype_code, std::uintptr_t stream) {
    if (rows < 0 || cols < 0) throw py::value_error("rows and cols must be non-negative");
    if (rows > INT_MAX) throw py::value_error("rows exceeds the grid limit of 2**31 - 1 blocks");
    if (dtype_code != refmath_cuda::kFloat32 && dtype_code != refmath_cuda::kFloat64) {
        throw py::value_error("dtype_code must be 0 (float32) or 1 (float64), got " +
                              std::to_string(dtype_code));
    }
    if (rows > 0 && cols > 0 && (in_ptr == 0 || out_ptr == 0))
        throw py::value_error("a null pointer for a non-empty array");
    cudaError_t status;
    {
        py::gil_scoped_release release;
        status = refmath_cuda::softmax_rows(
            reinterpret_cast<const void*>(in_ptr), reinterpret_cast<void*>(out_ptr), rows, cols,
            static_cast<refmath_cuda::DType>(dtype_code), reinterpret_cast<cudaStream_t>(stream));
    }
    if (status != cudaSuccess) {
        throw std::runtime_error(std::string("refmath._cuda.softmax_rows: ") +
                                 cudaGetErrorString(status));
    }
}

// ---- attention and decode ----
//
// The launchers check their arguments and return an error message ("" once queued); here that
// message becomes a RuntimeError. Arrays arrive as device pointers, streams as cudaStream_t ints.

void raise_if_failed(const std::string& error) {
    if (!error.empty()) throw std::runtime_error("refmath._cuda." + error);
}

template <typename T>
T* device_pointer(std::uintptr_t address) {
    return reinterpret_cast<T*>(address);
}

refmath_cuda::AttentionProblem make_problem(std::int64_t batch, std::int64_t heads,
                                            std::int64_t kv_heads, std::int64_t t_q,
                                            std::int64_t t_k, std::int64_t head_dim, bool causal,
                                            std::int64_t window, double scale, int dtype_code) {
    refmath_cuda::AttentionProblem p;
    p.batch = batch;
    p.heads = heads;
    p.kv_heads = kv_heads;
    p.t_q = t_q;
    p.t_k = t_k;
    p.head_dim = head_dim;
    p.causal = causal;
    p.window = window;
    p.scale = static_cast<float>(scale);
    p.dtype = static_cast<refmath_cuda::DType>(dtype_code);
    return p;
}

// The rung of the ladder (flash_ladder.h) called `version`; a ValueError naming the rungs if none is.
const refmath_cuda::FlashRung& find_rung(const std::string& version) {
    std::string names;
    for (const refmath_cuda::FlashRung& rung : refmath_cuda::kFlashLadder) {
        if (version == rung.name) return rung;
        names += (names.empty() ? "" : ", ") + std::string(rung.name);
    }
    throw py::value_error("version must be one of " + names + ", got '" + version + "'");
}

void flash_forward(const std::string& version, std::uintptr_t q, std::uintptr_t k,
                   std::uintptr_t v, std::uintptr_t o, std::uintptr_t lse, std::int64_t batch,
                   std::int64_t heads, std::int64_t kv_heads, std::int64_t t_q, std::int64_t t_k,
                   std::int64_t head_dim, bool causal, std::int64_t window, double scale,
                   int dtype_code, std::uintptr_t stream) {
    const refmath_cuda::FlashRung& rung = find_rung(version);
    refmath_cuda::FlashForwardArgs args;
    args.problem = make_problem(batch, heads, kv_heads, t_q, t_k, head_dim, causal, window, scale,
                                dtype_code);
    args.q = device_pointer<const void>(q);
    args.k = device_pointer<const void>(k);
    args.v = device_pointer<const void>(v);
    args.o = device_pointer<void>(o);
    args.lse = device_pointer<float>(lse);
    std::string error;
    {
        py::gil_scoped_release release;
        error = rung.launch(args, reinterpret_cast<cudaStream_t>(stream));
    }
    raise_if_failed(error);
}

// The ladder for Python, one dict a rung, oldest first: refmath.kernels.flash_ladder() reads it.
py::list flash_versions() {
    py::list rungs;
    for (const refmath_cuda::FlashRung& rung : refmath_cuda::kFlashLadder) {
        const refmath_cuda::RungNeeds& needs = rung.needs;
        py::list dtypes, head_dims;
        for (refmath_cuda::DType t : {refmath_cuda::kFloat32, refmath_cuda::kFloat64,
                                      refmath_cuda::kFloat16, refmath_cuda::kBFloat16})
            if (needs.dtypes & refmath_cuda::dtype_bit(t)) dtypes.append(refmath_cuda::dtype_name(t));
        for (int width : needs.head_dims)
            if (width) head_dims.append(width);
        py::dict entry;
        entry["name"] = rung.name;
        entry["adds"] = rung.adds;
        entry["dtypes"] = py::tuple(dtypes);
        entry["head_dims"] = py::tuple(head_dims);
        entry["pads_head_dim"] = needs.pads_head_dim;
        entry["compute_capability"] = needs.compute_capability;
        entry["alignment"] = needs.alignment;
        entry["tensor_cores"] = needs.tensor_cores;
        entry["default"] = rung.is_default;
        rungs.append(entry);
    }
    return rungs;
}

void flash_backward(std::uintptr_t dout, std::uintptr_t q, std::uintptr_t k, std::uintptr_t v,
                    std::uintptr_t o, std::uintptr_t lse, std::uintptr_t dq, std::uintptr_t dk,
                    std::uintptr_t dv, std::uintptr_t delta, std::int64_t batch, std::int64_t heads,
                    std::int64_t kv_heads, std::int64_t t_q, std::int64_t t_k, std::int64_t head_dim,
                    bool causal, std::int64_t window, double scale, std::uintptr_t stream) {
    refmath_cuda::FlashBackwardArgs args;
    args.problem = make_problem(batch, heads, kv_heads, t_q, t_k, head_dim, causal, window, scale,
                                refmath_cuda::kFloat32);
    args.dout = device_pointer<const float>(dout);
    args.q = device_pointer<const float>(q);
    args.k = device_pointer<const float>(k);
    args.v = device_pointer<const float>(v);
    args.o = device_pointer<const float>(o);
    args.lse = device_pointer<const float>(lse);
    args.dq = device_pointer<float>(dq);
    args.dk = device_pointer<float>(dk);
    args.dv = device_pointer<float>(dv);
    args.delta = device_pointer<float>(delta);
    std::string error;
    {
        py::gil_scoped_release release;
        error = refmath_cuda::flash_backward(args, reinterpret_cast<cudaStream_t>(stream));
    }
    raise_if_failed(error);
}

void paged_decode(std::uintptr_t q, std::uintptr_t k_pages, std::uintptr_t v_pages,
                  std::uintptr_t page_table, std::uintptr_t lengths, std::uintptr_t workspace,
                  std::uintptr_t o, std::int64_t batch, std::int64_t heads, std::int64_t kv_heads,
                  std::int64_t head_dim, std::int64_t n_pages, std::int64_t page_size,
                  std::int64_t max_pages, std::int64_t splits, double scale, int dtype_code,
                  std::uintptr_t stream) {
    refmath_cuda::DecodeArgs args;
    args.batch = batch;
    args.heads = heads;
    args.kv_heads = kv_heads;
    args.head_dim = head_dim;
    args.n_pages = n_pages;
    args.page_size = page_size;
    args.max_pages = max_pages;
    args.splits = splits;
    args.scale = static_cast<float>(scale);
    args.dtype = static_cast<refmath_cuda::DType>(dtype_code);
    args.q = device_pointer<const void>(q);
    args.k_pages = device_pointer<const void>(k_pages);
    args.v_pages = device_pointer<const void>(v_pages);
    args.page_table = device_pointer<const std::int32_t>(page_table);
    args.lengths = device_pointer<const std::int32_t>(lengths);
    args.workspace = device_pointer<float>(workspace);
    args.o = device_pointer<void>(o);
    std::string error;
    {
        py::gil_scoped_release release;
        error = refmath_cuda::paged_decode(args, reinterpret_cast<cudaStream_t>(stream));
    }
    raise_if_failed(error);
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
    m.doc() = "refmath's CUDA kernels. Call them through refmath.kernels.";
    m.attr("FLOAT32") = static_cast<int>(refmath_cuda::kFloat32);
    m.attr("FLOAT64") = static_cast<int>(refmath_cuda::kFloat64);
    m.attr("FLOAT16") = static_cast<int>(refmath_cuda::kFloat16);
    m.attr("BFLOAT16") = static_cast<int>(refmath_cuda::kBFloat16);
    m.attr("MAX_DECODE_SPLITS") = refmath_cuda::kMaxDecodeSplits;
    m.attr("runtime_version") = CUDART_VERSION;
    m.def("device_query", &device_query,
          "Return (device_count, status): (0, reason) when there is no driver or no GPU.");
    m.def("device_count", []() { return device_query().first; },
          "Number of visible CUDA devices; 0 when there is no driver or no GPU.");
    m.def("softmax_rows", &softmax_rows, py::arg("in_ptr"), py::arg("out_ptr"), py::arg("rows"),
          py::arg("cols"), py::arg("dtype_code"), py::arg("stream") = 0,
          "Row-wise softmax of a C-contiguous (rows, cols) device array into another one, queued "
          "on `stream` (a cudaStream_t as int; 0 is the legacy default stream). dtype_code: "
          "FLOAT32 or FLOAT64. Raises RuntimeError with CUDA's message if the launch fails.");

    // FlashAttention forward: one binding for every rung of the ladder (flash_ladder.h).
    m.def("flash_forward", &flash_forward, py::arg("version"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("batch"), py::arg("heads"),
          py::arg("kv_heads"), py::arg("t_q"), py::arg("t_k"), py::arg("head_dim"),
          py::arg("causal"), py::arg("window"), py::arg("scale"), py::arg("dtype_code"),
          py::arg("stream") = 0,
          "FlashAttention forward by the rung `version` of the ladder (one of flash_versions()) "
          "of C-contiguous device arrays q (B, H, T_q, D), k and v (B, G, T_k, D) into o (like q) "
          "and lse (B, H, T_q, float32), queued on `stream`. window = 0 means no window. Raises "
          "ValueError for an unknown version, RuntimeError with the reason if the arguments are "
          "refused or the launch fails.");
    m.def("flash_versions", &flash_versions,
          "The rungs of the FlashAttention forward ladder, oldest first, one dict each: name, "
          "adds (what it adds to the rung before), dtypes (names) and head_dims (what it takes; "
          "with pads_head_dim any D up to the widest), compute_capability (the major version "
          "it needs, 0: any), alignment (bytes, of q, k, v, o), tensor_cores, default (whether "
          "version=None may choose it).");

    m.def("flash_backward", &flash_backward, py::arg("dout"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
          py::arg("delta"), py::arg("batch"), py::arg("heads"), py::arg("kv_heads"), py::arg("t_q"),
          py::arg("t_k"), py::arg("head_dim"), py::arg("causal"), py::arg("window"), py::arg("scale"),
          py::arg("stream") = 0,
          "FlashAttention backward in float32 (all arrays float32, C-contiguous): dq, dk, dv from "
          "dout, q, k, v, o and lse; delta is a (B, H, T_q) float32 workspace.");

    m.def("paged_decode", &paged_decode, py::arg("q"), py::arg("k_pages"), py::arg("v_pages"),
          py::arg("page_table"), py::arg("lengths"), py::arg("workspace"), py::arg("o"),
          py::arg("batch"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
          py::arg("n_pages"), py::arg("page_size"), py::arg("max_pages"), py::arg("splits"),
          py::arg("scale"), py::arg("dtype_code"), py::arg("stream") = 0,
          "Split-K decode of q (B, H, D) over pages (n_pages, G, page_size, D) through an int32 "
          "page table (B, max_pages) and int32 lengths (B,), into o (B, H, D). workspace: float32 "
          "(B, H, splits, D + 2).");
}

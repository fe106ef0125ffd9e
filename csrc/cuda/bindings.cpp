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

}  // namespace

PYBIND11_MODULE(_cuda, m) {
    m.doc() = "refmath's CUDA kernels. Call them through refmath.kernels.";
    m.attr("FLOAT32") = static_cast<int>(refmath_cuda::kFloat32);
    m.attr("FLOAT64") = static_cast<int>(refmath_cuda::kFloat64);
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
}

// Python bindings of the CPU kernels: the module refmath._C.
//
// These functions trust nothing: refmath/kernels.py validates first and gives the friendlier
// messages, but a direct caller still gets an exception rather than a read past the end of a buffer.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "softmax.h"

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

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "refmath's CPU kernels (C++17, OpenMP). Call them through refmath.kernels.";
    m.def("softmax_rows", &softmax_rows, py::arg("x"),
          "Softmax over the last axis of a C-contiguous 2-D float32/float64 array; returns a new "
          "array. Fully masked rows (all -inf) give zeros.");
#ifdef _OPENMP
    m.attr("openmp") = true;
#else
    m.attr("openmp") = false;
#endif
}

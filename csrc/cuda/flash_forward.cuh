// What every forward launcher of the ladder shares (flash_v1.cu ... flash_v4.cu): the checks of the
// arguments against the rung's line of flash_ladder.h, the grid, and the choice of the kernel's
// template instance for the element type and the head width. A rung's file keeps what is its own:
// the kernel and launch_<name><T, D>, which queues it. Its launcher is then one call:
//
//     std::string flash_forward_v3(const FlashForwardArgs& a, cudaStream_t stream) {
//         auto launch = [&](auto element, auto width, const Band& band, int blocks) {
//             return launch_v3<decltype(element), decltype(width)::value>(a, band, blocks, stream);
//         };
//         return launch_forward<Rung::v3>(a, kBlockQV3, launch);
//     }
//
// `element` is a value of the element type (float, __half or __nv_bfloat16) and `width` a
// std::integral_constant holding the compiled head width: the lambda turns both back into template
// arguments. Only the instances the rung's needs allow are compiled (v3 has no float32 one).
#pragma once

#include <type_traits>

#include "attention_common.cuh"
#include "flash_ladder.h"

namespace refmath_cuda {

// "float16 or bfloat16", "float32, float16 or bfloat16": the element types of a set, for messages.
inline std::string dtype_names(unsigned dtypes) {
    std::string out;
    int left = 0;
    for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) left += (dtypes & dtype_bit(t)) != 0;
    for (DType t : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
        if (!(dtypes & dtype_bit(t))) continue;
        out += dtype_name(t);
        --left;
        out += left > 1 ? ", " : left == 1 ? " or " : "";
    }
    return out;
}

inline bool takes_head_dim(const RungNeeds& needs, std::int64_t d) {
    int widest = 0;
    for (int width : needs.head_dims) {
        if (width == d) return true;
        if (width > widest) widest = width;
    }
    return needs.pads_head_dim && d >= 1 && d <= widest;
}

// " (use v1 or v2)": the rungs whose needs accept what `rung` refused; "" where none does.
template <typename Accepts>
std::string other_rungs(const FlashRung& rung, Accepts accepts) {
    std::string names;
    for (const FlashRung& other : kFlashLadder)
        if (&other != &rung && accepts(other.needs))
            names += (names.empty() ? "" : " or ") + std::string(other.name);
    return names.empty() ? "" : " (use " + names + ")";
}

// The prologue: "" and *blocks > 0 when the kernel may be queued, "" and *blocks = 0 when there is
// nothing to compute (a zero-sized grid is a launch error), else what is wrong.
inline std::string check_forward(const FlashRung& rung, const FlashForwardArgs& a, int block_rows,
                                 std::int64_t* blocks) {
    const AttentionProblem& p = a.problem;
    const RungNeeds& needs = rung.needs;
    const std::string launcher = std::string("flash_forward_") + rung.name;
    *blocks = 0;
    std::string error = check_problem(p, kMaxHeadDim);
    if (!error.empty()) return launcher + ": " + error;
    if (!takes_head_dim(needs, p.head_dim)) {
        std::string widths;
        for (int width : needs.head_dims)
            if (width) widths += (widths.empty() ? "" : " or ") + std::to_string(width);
        return launcher + (needs.tensor_cores ? ": the tensor-core kernel" : ": the kernel") +
               " supports D = " + widths + ", got D=" + std::to_string(p.head_dim) +
               other_rungs(rung, [&](const RungNeeds& n) { return takes_head_dim(n, p.head_dim); });
    }
    if (!(needs.dtypes & dtype_bit(p.dtype)))
        return launcher + ": dtype must be " + dtype_names(needs.dtypes) + ", got " +
               dtype_name(p.dtype) +
               other_rungs(rung, [&](const RungNeeds& n) { return (n.dtypes & dtype_bit(p.dtype)) != 0u; });
    if (p.batch * p.heads * p.t_q == 0) return "";
    if (!a.q || !a.o || !a.lse || (p.t_k > 0 && (!a.k || !a.v)))
        return launcher + ": a null pointer for a non-empty array";
    const auto aligned = [&](const void* ptr) {
        return reinterpret_cast<std::uintptr_t>(ptr) % static_cast<unsigned>(needs.alignment) == 0;
    };
    if (!aligned(a.q) || !aligned(a.o) || (p.t_k > 0 && (!aligned(a.k) || !aligned(a.v))))
        return launcher + ": q, k, v and o must be " + std::to_string(needs.alignment) +
               "-byte aligned (the kernel moves " + std::to_string(needs.alignment) + "-byte vectors)";
    if (needs.compute_capability > 0) {
        const std::string what = launcher + (needs.tensor_cores ? " (tensor cores)" : "");
        error = check_compute_capability(needs.compute_capability, what.c_str());
        if (!error.empty()) return error;
    }
    const std::int64_t n = p.batch * p.heads * ceil_div(static_cast<int>(p.t_q), block_rows);
    error = check_grid(n, launcher.c_str());
    if (!error.empty()) return error;
    *blocks = n;
    return "";
}

template <typename T> constexpr DType kDTypeOf = kFloat32;
template <> constexpr DType kDTypeOf<__half> = kFloat16;
template <> constexpr DType kDTypeOf<__nv_bfloat16> = kBFloat16;

// The first of the rung's compiled widths that is at least D, from the kIndex-th on (check_forward
// made sure there is one, and that it is D itself where the rung does not pad).
template <Rung kRung, typename T, int kIndex, typename Launch>
std::string launch_width(std::int64_t d, const Band& band, int blocks, Launch& launch) {
    constexpr RungNeeds needs = flash_rung(kRung).needs;
    constexpr int width = needs.head_dims[kIndex];
    if constexpr (kIndex + 1 < 4 && needs.head_dims[kIndex + 1] != 0) {
        if (d > width) return launch_width<kRung, T, kIndex + 1>(d, band, blocks, launch);
    }
    return launch(T(), std::integral_constant<int, width>(), band, blocks);
}

template <Rung kRung, typename T, typename Launch>
std::string launch_element(std::int64_t d, const Band& band, int blocks, Launch& launch) {
    if constexpr ((flash_rung(kRung).needs.dtypes & dtype_bit(kDTypeOf<T>)) != 0)
        return launch_width<kRung, T, 0>(d, band, blocks, launch);
    else
        return "unreachable: check_forward refuses this dtype";
}

// The launcher of rung kRung: check_forward, then launch(element, width, band, blocks) for the
// dtype and head width of the problem. block_rows: the query rows one thread block computes.
template <Rung kRung, typename Launch>
std::string launch_forward(const FlashForwardArgs& a, int block_rows, Launch&& launch) {
    std::int64_t blocks = 0;
    const std::string error = check_forward(flash_rung(kRung), a, block_rows, &blocks);
    if (!error.empty() || blocks == 0) return error;
    const Band band = make_band(a.problem);
    const std::int64_t d = a.problem.head_dim;
    const int n = static_cast<int>(blocks);
    switch (a.problem.dtype) {
        case kFloat16: return launch_element<kRung, __half>(d, band, n, launch);
        case kBFloat16: return launch_element<kRung, __nv_bfloat16>(d, band, n, launch);
        default: return launch_element<kRung, float>(d, band, n, launch);
    }
}

}  // namespace refmath_cuda

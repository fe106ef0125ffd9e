// The FlashAttention forward ladder: the one list of its versions, one line a rung.
//
// A rung is a file, csrc/cuda/flash_<name>.cu, whose header says what it changes from the rung
// before and why that is faster, and which defines the launcher flash_forward_<name>. Adding a
// rung is that file and one line in REFMATH_FLASH_LADDER below; everything else reads the list:
//
// * this header declares each launcher and builds kFlashLadder, the table of the rungs;
// * flash_forward.cuh, the prologue every launcher shares, checks the arguments against the
//   rung's needs (its dtypes, head widths, compute capability, alignment) and picks the kernel's
//   template instance for the dtype and the head width;
// * bindings.cpp binds one flash_forward(version, ...) that looks the name up here, and
//   flash_versions(), which gives this table to Python: refmath/kernels.py validates a version
//   and chooses the default from it, the tests take their list of versions from it.
//
// Plain C++ (no CUDA types beyond launch.h's), so the bindings, compiled without nvcc, read it too.
#pragma once

#include <string>

#include "launch.h"

namespace refmath_cuda {

constexpr unsigned dtype_bit(DType dtype) { return 1u << static_cast<int>(dtype); }

// What a rung takes and needs. The launcher checks each (flash_forward.cuh) and refuses input
// outside them with a message; refmath/kernels.py checks the same, with the array's shape in its
// message, before any pointer leaves Python.
struct RungNeeds {
    unsigned dtypes;         // the element types it takes: a set of dtype_bit(...)
    int head_dims[4];        // the head widths D its kernel is compiled for, ascending (0: unused)
    bool pads_head_dim;      // true: any D up to the widest runs on the next compiled width up
                             // (the kernel skips the extra columns); false: D must be one of them
    int compute_capability;  // the major compute capability its instructions need (0: any)
    int alignment;           // bytes that q, k, v and o must be aligned to (its vector accesses)
    bool tensor_cores;       // whether its products run on the tensor cores (mma)
};

// v1 and v2: the FP32 units ("CUDA cores"), any float type the kernels convert from, D <= 256.
constexpr RungNeeds kCudaCoreNeeds = {
    dtype_bit(kFloat32) | dtype_bit(kFloat16) | dtype_bit(kBFloat16), {32, 64, 128, 256}, true, 0, 1,
    false};
// v3 and v4: mma.sync m16n8k16 takes 16-bit operands (fp32 accumulation) and needs compute
// capability 8.0; the kernels are compiled for D = 64 and 128 and move 16-byte vectors.
constexpr RungNeeds kTensorCoreNeeds = {
    dtype_bit(kFloat16) | dtype_bit(kBFloat16), {64, 128, 0, 0}, false, 8, 16, true};

// The ladder. RUNG(name, needs, default, what the rung adds). `default`: whether
// flash_attention_forward(version=None) may choose the rung; it runs the newest default rung that
// takes the input (v3 for float16/bfloat16 with D = 64 or 128, else v2). v4 is chosen by name
// until it has been measured against v3 on a GPU.
#define REFMATH_FLASH_LADDER(RUNG)                                                                 \
    RUNG(v1, kCudaCoreNeeds, false, "one thread per query row: the online softmax, nothing shared") \
    RUNG(v2, kCudaCoreNeeds, true, "K/V tiles in shared memory, read by a whole block of rows")     \
    RUNG(v3, kTensorCoreNeeds, true, "both products on the tensor cores (mma.sync m16n8k16)")      \
    RUNG(v4, kTensorCoreNeeds, false, "v3's math fed by ldmatrix and double-buffered cp.async")

using FlashLauncher = std::string (*)(const FlashForwardArgs& args, cudaStream_t stream);

// Each rung's launcher, defined in csrc/cuda/flash_<name>.cu: "" when queued, else what is wrong.
#define REFMATH_DECLARE_LAUNCHER(name, needs, is_default, adds) \
    std::string flash_forward_##name(const FlashForwardArgs& args, cudaStream_t stream);
REFMATH_FLASH_LADDER(REFMATH_DECLARE_LAUNCHER)
#undef REFMATH_DECLARE_LAUNCHER

// Rung::v3 names v3's line of the table (kFlashLadder[int(Rung::v3)]), at compile time.
#define REFMATH_RUNG_ID(name, needs, is_default, adds) name,
enum class Rung : int { REFMATH_FLASH_LADDER(REFMATH_RUNG_ID) };
#undef REFMATH_RUNG_ID

struct FlashRung {
    const char* name;       // "v1": the file csrc/cuda/flash_v1.cu, the launcher flash_forward_v1
    FlashLauncher launch;
    RungNeeds needs;
    bool is_default;
    const char* adds;       // what this rung adds to the one before, in a line
};

#define REFMATH_RUNG_ENTRY(name, needs, is_default, adds) \
    FlashRung{#name, flash_forward_##name, needs, is_default, adds},
inline constexpr FlashRung kFlashLadder[] = {REFMATH_FLASH_LADDER(REFMATH_RUNG_ENTRY)};
#undef REFMATH_RUNG_ENTRY

constexpr const FlashRung& flash_rung(Rung rung) { return kFlashLadder[static_cast<int>(rung)]; }

}  // namespace refmath_cuda

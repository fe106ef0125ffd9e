"""The CPU kernels' 2^x (csrc/tile_math.h): the scalar exp2_fast and the 8-lane exp2_fast8.

The softmax folds use exp2_fast8 for whole vectors and exp2_fast for the last numbers of a row, so
the two must agree to the last bit, or a result would depend on where a row's tail starts (and
the paged and contiguous decodes, which lesson 12 asserts bit-identical, could differ). A driver
compiled with the host C++ compiler and the extension's floating-point flags checks that over a
sweep of bit patterns, and measures the accuracy against long double exp2.

Accuracy bound, for normal results: the Taylor truncation is below 1e-8 relative (a sixth of an
ulp), the product by 2^n is exact, and the Horner steps round once each, the last step's rounding
(half an ulp) dominating the one before it (at most half an ulp of a term below 0.35): 1.5 ulps
in all, with or without fused multiply-adds.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess

import pytest

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")

DRIVER = r"""
#include "tile_math.h"
#include <cmath>
#include <cstdio>
#include <cstring>
using namespace refmath;

static bool same(float a, float b) {  // the same bits, or both NaN
    if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
    return std::memcmp(&a, &b, sizeof a) == 0;
}

int main() {
    long checked = 0, differ = 0;
    for (unsigned long long b0 = 0; b0 < (1ull << 32); b0 += 8 * 251) {  // 8 lanes, then a stride
        std::uint32_t bits[8];
        for (int i = 0; i < 8; ++i) bits[i] = static_cast<std::uint32_t>(b0 + i);
        tile::f32x8 x;
        std::memcpy(&x, bits, sizeof x);
        const tile::f32x8 y = tile::exp2_fast8(x);
        for (int i = 0; i < 8; ++i, ++checked) differ += !same(y[i], tile::exp2_fast(x[i]));
    }
    std::printf("agree %ld %ld\n", checked, differ);

    double worst = 0;
    for (long i = 0; i < 2000000; ++i) {  // x spread over [-126, 127]: normal results
        const float x = -126.0f + 253.0f * static_cast<float>(i) / 2000000.0f;
        const long double ref = std::exp2l(static_cast<long double>(x));
        const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(ref)) - 23);
        const double err = std::fabs(static_cast<double>(tile::exp2_fast(x) - ref)) / ulp;
        worst = err > worst ? err : worst;
    }
    std::printf("worst_ulp %.6f\n", worst);

    const float special[] = {0.0f, 1.0f, -1.0f, 0.5f, -127.0f, -200.0f, -INFINITY, INFINITY, NAN, 127.0f};
    for (float x : special) std::printf("value %a %a\n", x, tile::exp2_fast(x));  // exact, in hex
}
"""


@pytest.fixture(scope="module")
def driver_output(tmp_path_factory):
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler to build the 2^x driver")
    folder = tmp_path_factory.mktemp("exp2")
    source, binary = folder / "driver.cpp", folder / "driver"
    source.write_text(DRIVER)
    # The extension's floating-point flags (setup.py's CPU_VECTOR_FLAGS), and AVX2 with FMA where
    # the machine runs it, as the kernels' main copy does.
    flags = ["-std=c++17", "-O2", "-ffp-contract=fast", "-fno-trapping-math", "-I", CSRC]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=x86-64-v3")
    subprocess.run([compiler, *flags, str(source), "-o", str(binary)], check=True, timeout=120)
    try:
        return subprocess.run([str(binary)], check=True, capture_output=True, text=True,
                              timeout=120).stdout
    except OSError as err:  # an x86-64-v3 binary on a CPU without AVX2
        pytest.skip(f"the AVX2 driver does not run here: {err}")


def _lines(output, key):
    return [line.split()[1:] for line in output.splitlines() if line.split()[0] == key]


def test_the_scalar_and_8_lane_2x_give_the_same_bits(driver_output):
    [(checked, differ)] = _lines(driver_output, "agree")
    assert int(checked) > 2_000_000
    assert int(differ) == 0


def test_2x_is_within_1_5_ulps_for_normal_results(driver_output):
    [(worst,)] = _lines(driver_output, "worst_ulp")
    assert float(worst) <= 1.5


def test_2x_special_values(driver_output):
    pairs = [(float.fromhex(x), y) for x, y in _lines(driver_output, "value")]
    values = {x: float.fromhex(y) for x, y in pairs if x == x}
    assert values[0.0] == 1.0 and values[1.0] == 2.0 and values[-1.0] == 0.5
    assert values[0.5] == pytest.approx(2**0.5, rel=2**-23)
    assert values[127.0] == 2.0**127
    assert values[float("inf")] == 2.0**127  # clamped to 127, finite
    assert values[-127.0] == 0.0 and values[-200.0] == 0.0 and values[float("-inf")] == 0.0
    [nan_result] = [y for x, y in pairs if x != x]
    assert "nan" in nan_result  # a NaN score must make its row NaN

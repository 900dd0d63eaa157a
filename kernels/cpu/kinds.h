// The projection kinds of the fused decode layer (decode_layer.cpp): which kernel runs a
// projection and which operands it takes; decode_layer.cpp's opening comment lists them.
//
// kernels/cpu/kinds.py mirrors this enum name for name and value for value (kDense is
// Kind.DENSE there, kLinearOneDnn Kind.LINEAR_ONEDNN); tests/kernels/test_kernel_kinds.py
// checks that they agree. A new kind is added to both files.
#pragma once

#include <cstdint>

namespace saltserve_cpu {

enum Kind : int64_t {
  kDense = 0, kInt4 = 1, kQ4 = 2, kInt8 = 3, kLinear = 4, kLinearBf16 = 5, kLinearOneDnn = 6,
  kQ4Vnni = 7, kQ8Vnni = 8, kKQuant = 9
};

}  // namespace saltserve_cpu

// Scalar reads and roundings of the tensor dtypes the kernels exchange with PyTorch
// (dtype codes: 0 float32, 1 float16, 2 bfloat16), rounding as torch's .to() rounds.
// Shared by encode.cpp (cache writes) and decode_ops.cpp (the small decode-step ops).
#pragma once

#include <cstdint>
#include <cstring>

static inline float half_to_float_(uint16_t h) {
    _Float16 f;
    std::memcpy(&f, &h, 2);
    return (float)f;
}

static inline uint16_t float_to_half(float x) {  // round to nearest even, as torch's .to(float16)
    const _Float16 f = (_Float16)x;
    uint16_t h;
    std::memcpy(&h, &f, 2);
    return h;
}

static inline float load_value(const void* p, int64_t i, int dtype) {
    if (dtype == 0) return ((const float*)p)[i];
    if (dtype == 1) return half_to_float_(((const uint16_t*)p)[i]);
    uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline float round_to_dtype(float x, int dtype) {  // bfloat16: to nearest even, as torch does
    if (dtype == 0) return x;
    if (dtype == 1) return half_to_float_(float_to_half(x));
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

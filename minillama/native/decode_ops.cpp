// The small per-layer operations of a decode step, one call each instead of 3-12 PyTorch
// calls (each costs 10-60 us on a small CPU; a 30-layer step makes about a thousand).
//
//   add_rms_norm  s = x + h (optional), y = weight * round(s * rsqrt(mean(s^2) + eps))
//   rope_rows     x <- x cos + rotate_half(x) sin, HF's rotate-half layout, one position
//   silu_mul      y = silu(gate) * up, from the fused gate|up projection
//
// Each rounds to the tensor's dtype wherever the PyTorch reference (model/llama.py) does, so
// bfloat16 results match it closely and float32 ones up to summation order. dtype: 0 float32,
// 2 bfloat16.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtypes.h"
#include "minillama.h"

static inline void put(void* p, int64_t i, float x, int dtype) {
    if (dtype == 0) {
        ((float*)p)[i] = x;
    } else {
        uint32_t u;
        std::memcpy(&u, &x, 4);
        ((uint16_t*)p)[i] = (uint16_t)(u >> 16);  // x is already rounded
    }
}

extern "C" {

// x, h, sum, out: (M, N) in dtype; weight (N) in dtype. With h, the norm is of sum = round(x + h),
// which is written to `sum`; without, of x.
int add_rms_norm(const void* x, const void* h, const void* weight, int dtype, int M, int N, float eps, void* sum,
                 void* out) {
    if (dtype != 0 && dtype != 2) return MINILLAMA_E_DTYPE;
    for (int m = 0; m < M; m++) {
        const int64_t row = (int64_t)m * N;
        float ss = 0.f;
        for (int n = 0; n < N; n++) {
            float v = load_value(x, row + n, dtype);
            if (h) {
                v = round_to_dtype(v + load_value(h, row + n, dtype), dtype);
                put(sum, row + n, v, dtype);
            }
            ss += v * v;
        }
        const float inv = 1.f / std::sqrt(ss / N + eps);
        const void* src = h ? sum : x;
        for (int n = 0; n < N; n++) {
            const float normed = round_to_dtype(load_value(src, row + n, dtype) * inv, dtype);  // float32 math, then the dtype
            put(out, row + n, round_to_dtype(load_value(weight, n, dtype) * normed, dtype), dtype);
        }
    }
    return MINILLAMA_OK;
}

// x: B x H rows of D, row (b, h) at b * bstride + h * D (in place); cos, sin: D floats, one position.
int rope_rows(void* x, int dtype, int B, int H, int D, int64_t bstride, const float* cos, const float* sin) {
    if (dtype != 0 && dtype != 2) return MINILLAMA_E_DTYPE;
    if (D % 2) return MINILLAMA_E_HEAD_DIM;
    const int h = D / 2;
    for (int m = 0; m < B * H; m++) {
        const int64_t row = (int64_t)(m / H) * bstride + (int64_t)(m % H) * D;
        for (int d = 0; d < h; d++) {
            const float x1 = load_value(x, row + d, dtype), x2 = load_value(x, row + d + h, dtype);
            const float c1 = round_to_dtype(cos[d], dtype), s1 = round_to_dtype(sin[d], dtype);
            const float c2 = round_to_dtype(cos[d + h], dtype), s2 = round_to_dtype(sin[d + h], dtype);
            // rotate_half(x) = (-x2, x1); each product and the sum rounded as PyTorch rounds them
            const float a = round_to_dtype(round_to_dtype(x1 * c1, dtype) + round_to_dtype(-x2 * s1, dtype), dtype);
            const float b = round_to_dtype(round_to_dtype(x2 * c2, dtype) + round_to_dtype(x1 * s2, dtype), dtype);
            put(x, row + d, a, dtype);
            put(x, row + d + h, b, dtype);
        }
    }
    return MINILLAMA_OK;
}

// gate_up: (M, 2I) (gate then up, as the fused projection writes them); out: (M, I).
int silu_mul(const void* gate_up, int dtype, int M, int I, void* out) {
    if (dtype != 0 && dtype != 2) return MINILLAMA_E_DTYPE;
    for (int m = 0; m < M; m++) {
        const int64_t row = (int64_t)m * 2 * I;
        for (int i = 0; i < I; i++) {
            const float g = load_value(gate_up, row + i, dtype), u = load_value(gate_up, row + I + i, dtype);
            const float silu = round_to_dtype(g / (1.f + std::exp(-g)), dtype);
            put(out, (int64_t)m * I + i, round_to_dtype(silu * u, dtype), dtype);
        }
    }
    return MINILLAMA_OK;
}

}  // extern "C"

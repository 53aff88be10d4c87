// Cache writes in C++: the new tokens of every layer into storage form, and the tokens that
// leave the residual into packed affine codes, byte for byte what the PyTorch path writes.
//
// prepare_rows   x (model dtype) -> Hadamard rotation (a fast Walsh-Hadamard transform in
//                float32, then rounded to the model dtype, as kv/quantize.py's butterflies
//                are) -> minus the key center -> float16, the dtype residual tokens keep;
// encode_affine  float16 rows -> per group min/max, fp16 scale = (max - min) / (2^b - 1) and
//                fp16 zero = min, codes = round-half-even((x - zero) / scale) clamped, packed
//                as kv/packing.py packs them; groups of G channels of one token (axis 0) or of
//                G tokens of one channel (axis 1, KIVI keys).
// The PyTorch path (kv/layered.py: LayeredStore.append with kv/quantize.py, kv/packing.py) is the
// reference; a test holds the two to identical bytes.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "minillama.h"

// Pack one row of n codes at `bits` bits (kv/packing.py's layouts).
static inline void pack_row(const uint8_t* c, int n, int bits, uint8_t* out) {
    if (bits == 8) {
        std::memcpy(out, c, n);
    } else if (bits == 4) {
        for (int i = 0; i < n / 2; i++) out[i] = c[2 * i] | (c[2 * i + 1] << 4);
    } else if (bits == 2) {
        for (int i = 0; i < n / 4; i++) out[i] = c[4 * i] | (c[4 * i + 1] << 2) | (c[4 * i + 2] << 4) | (c[4 * i + 3] << 6);
    } else {  // 3 bits: eight codes in a little-endian 24-bit word
        for (int i = 0; i < n / 8; i++) {
            uint32_t w = 0;
            for (int j = 0; j < 8; j++) w |= (uint32_t)c[8 * i + j] << (3 * j);
            out[3 * i] = w & 0xFF, out[3 * i + 1] = (w >> 8) & 0xFF, out[3 * i + 2] = (w >> 16) & 0xFF;
        }
    }
}

extern "C" {

// x: rows x D in dtype; center: (rows / rows_per_center) x D fp16 or null; out: rows x D fp16.
// Returns how many outputs are not finite (the caller then takes the PyTorch path, which refuses them).
int64_t prepare_rows(const void* x, int dtype, int64_t rows, int D, int rotate, const uint16_t* center,
                     int64_t rows_per_center, uint16_t* out) {
    if (dtype < 0 || dtype > 2) return -MINILLAMA_E_DTYPE;
    if (rotate && (D & (D - 1))) return -MINILLAMA_E_HEAD_DIM;
    int64_t bad = 0;
    const float norm = (float)(1.0 / std::sqrt((double)D));
#pragma omp parallel for schedule(static) reduction(+ : bad)
    for (int64_t r = 0; r < rows; r++) {
        std::vector<float> v(D);
        for (int d = 0; d < D; d++) v[d] = load_value(x, r * D + d, dtype);
        if (rotate) {
            for (int h = 1; h < D; h *= 2)
                for (int i = 0; i < D; i += 2 * h)
                    for (int j = i; j < i + h; j++) {
                        const float a = v[j], b = v[j + h];
                        v[j] = a + b, v[j + h] = a - b;
                    }
            for (int d = 0; d < D; d++) v[d] = round_to_dtype(v[d] * norm, dtype);
        }
        const uint16_t* c = center ? center + (r / rows_per_center) * D : nullptr;
        for (int d = 0; d < D; d++) {
            const float y = c ? v[d] - half_to_float_(c[d]) : v[d];
            bad += !std::isfinite(y);
            out[r * D + d] = float_to_half(y);
        }
    }
    return bad;
}

// x: (BH, n, D) fp16. axis 0 (per token, G channels a group): scale, zero (BH, n, D/G);
// axis 1 (per channel, G tokens a group, n a multiple of G): scale, zero (BH, n/G, D).
// codes: (BH, n, packed width) uint8.
int encode_affine(const uint16_t* x, int64_t BH, int n, int D, int bits, int G, int axis, uint8_t* codes,
                  uint16_t* scale, uint16_t* zero) {
    if (bits != 2 && bits != 3 && bits != 4 && bits != 8) return MINILLAMA_E_CODES;
    if (G < 1 || D % 8 || (axis == 0 && D % G) || (axis == 1 && n % G)) return MINILLAMA_E_SHAPE;
    const int qmax = (1 << bits) - 1, W = D * bits / 8;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < BH; bh++) {
        std::vector<uint8_t> c((size_t)n * D);
        const uint16_t* xb = x + bh * n * D;
        const int groups = axis == 0 ? n * (D / G) : (n / G) * D;
        for (int g = 0; g < groups; g++) {
            // The group's elements: G consecutive channels of a token, or G consecutive tokens of a channel.
            const int64_t first = axis == 0 ? (int64_t)g * G : (int64_t)(g / D) * G * D + g % D;
            const int64_t step = axis == 0 ? 1 : D;
            float lo = INFINITY, hi = -INFINITY;
            for (int e = 0; e < G; e++) {
                const float v = half_to_float_(xb[first + e * step]);
                lo = std::min(lo, v), hi = std::max(hi, v);
            }
            const uint16_t s16 = float_to_half((hi - lo) / qmax), z16 = float_to_half(lo);
            float s = half_to_float_(s16);
            const float z = half_to_float_(z16);
            if (!(s > 0.f)) s = 1.f;  // a constant group: every code is 0
            for (int e = 0; e < G; e++) {
                const float q = std::nearbyint((half_to_float_(xb[first + e * step]) - z) / s);
                c[first + e * step] = (uint8_t)std::min(std::max(q, 0.f), (float)qmax);
            }
            scale[bh * groups + g] = s16, zero[bh * groups + g] = z16;
        }
        for (int t = 0; t < n; t++) pack_row(&c[(size_t)t * D], D, bits, codes + (bh * n + t) * W);
    }
    return MINILLAMA_OK;
}

}  // extern "C"

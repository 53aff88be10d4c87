// The small per-layer operations of a decode step, one call each instead of 3-12 PyTorch
// calls (each costs 10-60 us on a small CPU; a 30-layer step makes about a thousand).
//
//   add_rms_norm  s = x + h (optional), y = weight * round(s * rsqrt(mean(s^2) + eps))
//   rope_rows     x <- x cos + rotate_half(x) sin, HF's rotate-half layout, one position
//   silu_mul      y = silu(gate) * up, from the fused gate|up projection (16 at a time with AVX-512,
//                 8 with AVX2)
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

// e^x = 2^n e^r with n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts, LN2_HI exact in
// float), e^r = 1 + r + r^2 P(r) by Cephes' expf polynomial: the constants of both SIMD twins.
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_P[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX512F__)
#include <immintrin.h>

// e^x for 16 floats: x = n ln 2 + r (|r| <= ln 2 / 2, ln 2 in two parts), e^r by Cephes' expf
// polynomial (within about an ulp of e^x, as torch's Sleef exp is), times 2^n by vscalefps,
// which gives inf and 0 where e^x overflows and underflows, as std::exp does.
static inline __m512 exp16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));  // 1 + r + r^2 P(r)
    return _mm512_scalef_ps(p, n);
}

// The lanes of mask k of p[i..i + 16) as floats (0 float32, 2 bfloat16); the rest 0.
static inline __m512 load16(const void* p, int64_t i, int dtype, __mmask16 k) {
    if (dtype == 0) return _mm512_maskz_loadu_ps(k, (const float*)p + i);
    const __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t*)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// round_to_dtype for 16 lanes: bfloat16 to nearest even (the same integer steps), float32 as is.
static inline __m512 round16(__m512 x, int dtype) {
    if (dtype == 0) return x;
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
}

// x (already rounded to dtype) into the lanes of mask k of p[i..i + 16).
static inline void store16(void* p, int64_t i, __m512 x, int dtype, __mmask16 k) {
    if (dtype == 0) return _mm512_mask_storeu_ps((float*)p + i, k, x);
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
    _mm256_mask_storeu_epi16((uint16_t*)p + i, k, h);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// exp16's twin for 8 floats on AVX2, without vscalefps: 2^n is applied as two powers of two
// (each within the exponent's range for the clamped n), one after the other, so e^x still
// overflows to inf and underflows to 0 where std::exp does; min/max keep a NaN (it is their
// second operand).
static inline __m256 exp8(__m256 x) {
    const __m256 c = _mm256_max_ps(_mm256_set1_ps(-150.f), _mm256_min_ps(_mm256_set1_ps(150.f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), c);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));  // 1 + r + r^2 P(r)
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);  // n1 + n2 = n, each in [-75, 75]
    auto pow2 = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
    __m256 half = _mm256_mul_ps(p, pow2(n1));
    // The build allows reassociation (build.py): without this barrier GCC multiplies the two
    // powers first, and 2^n1 2^n2 = 2^128 overflows where p 2^128 (n = 128, p < 1) does not.
    __asm__("" : "+x"(half));
    return _mm256_mul_ps(half, pow2(n2));
}

// p[i..i + 8) as floats (0 float32, 2 bfloat16).
static inline __m256 load8(const void* p, int64_t i, int dtype) {
    if (dtype == 0) return _mm256_loadu_ps((const float*)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// round_to_dtype for 8 lanes: bfloat16 to nearest even (the same integer steps), float32 as is.
static inline __m256 round8(__m256 x, int dtype) {
    if (dtype == 0) return x;
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
}

// x (already rounded to dtype) into p[i..i + 8).
static inline void store8(void* p, int64_t i, __m256 x, int dtype) {
    if (dtype == 0) return _mm256_storeu_ps((float*)p + i, x);
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128((__m128i*)((uint16_t*)p + i), packed);
}
#endif

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

// gate_up: (M, 2I) (gate then up, as the fused projection writes them); out: (M, I). With
// AVX-512, sixteen at a time (silu16); else one at a time with std::exp.
int silu_mul(const void* gate_up, int dtype, int M, int I, void* out) {
    if (dtype != 0 && dtype != 2) return MINILLAMA_E_DTYPE;
    for (int m = 0; m < M; m++) {
        const int64_t row = (int64_t)m * 2 * I;
        int i = 0;
#if defined(__AVX512F__)
        for (; i < I; i += 16) {
            const __mmask16 k = (__mmask16)(I - i >= 16 ? 0xFFFF : (1u << (I - i)) - 1);
            const __m512 g = load16(gate_up, row + i, dtype, k), u = load16(gate_up, row + I + i, dtype, k);
            const __m512 silu = round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))), dtype);
            store16(out, (int64_t)m * I + i, round16(_mm512_mul_ps(silu, u), dtype), dtype, k);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= I; i += 8) {  // the scalar loop below takes the last I % 8
            const __m256 g = load8(gate_up, row + i, dtype), u = load8(gate_up, row + I + i, dtype);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const __m256 silu = round8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), dtype);
            store8(out, (int64_t)m * I + i, round8(_mm256_mul_ps(silu, u), dtype), dtype);
        }
#endif
        for (; i < I; i++) {
            const float g = load_value(gate_up, row + i, dtype), u = load_value(gate_up, row + I + i, dtype);
            const float silu = round_to_dtype(g / (1.f + std::exp(-g)), dtype);
            put(out, (int64_t)m * I + i, round_to_dtype(silu * u, dtype), dtype);
        }
    }
    return MINILLAMA_OK;
}

}  // extern "C"

// Skinny matrix products for decode steps: a few rows of activations against float32 or
// bfloat16 weights, or weights in llama.cpp's blocks with their own scales (q8_0, q4_0, q4_1,
// q4_k, q6_k: below; against float activations, or against activations rounded to int8).
//
//   y[m, n] = sum_k x[m, k] * W[n, k]      x (M, K) float32 or bfloat16, W (N, K) row-major, y float32 (M, N)
//
// Decoding reads every weight once per step and does 2*M flops per weight, so for small M
// (one token, or the W windows of a perplexity run) the product is bound by how fast the
// weights stream from memory; BLAS libraries tune for large M and reach a fraction of that.
// Here each thread streams a contiguous share of W's rows, one row at a time front to back (one
// sequential stream), and every weight is read once for all M rows of x, with a few independent
// accumulators per row of x (unrolled along k) so no FMA waits on another. How a weight becomes a
// float costs less than loading it (vectors of 16 floats on AVX-512, 8 on AVX2, 4 with NEON):
//   * AVX-512 BF16 (vdpbf16ps): bf16 weights meet bf16 activations directly, 32 products per
//     instruction, accumulated in float32 -- no conversion at all;
//   * otherwise bf16 is the top half of a float32, so a 32-bit lane holding weights (w0, w1)
//     gives w1 as a float with one AND (0xFFFF0000) and w0 with one shift left by 16. The
//     activations are split once per call into even and odd channels (XNNPACK's "shland"), so
//     two FMAs use both halves: 2 instructions decode 2 vectors of weights (llama.cpp widens
//     with vpmovzxwd + vpslld, 2 instructions per vector);
//   * float32 weights are loaded and multiplied as they are.
// Accumulation is float32 throughout; the result equals torch's F.linear up to summation order.

#include "dtypes.h"
#include "minillama.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include "openmp.h"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LIN_W 16  // floats per vector
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LIN_W 8
#elif defined(__aarch64__)
#include <arm_neon.h>
#define LIN_W 4
#else
#define LIN_W 0
#endif

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Element k of a row in dtype 0 (float32) or 2 (bfloat16), as float32.
static inline float element(const void* row, int64_t k, int dtype) {
    return dtype == 0 ? ((const float*)row)[k] : bf16_to_float(((const uint16_t*)row)[k]);
}

// The plain loop: reference for the vector paths and the whole product on CPUs without them.
static void rows_scalar(const void* x, int xdt, const void* W, int wdt, int M, int n0, int n1, int N, int K, float* y) {
    const int64_t wrow = (int64_t)K * dtype_bytes(wdt), xrow = (int64_t)K * dtype_bytes(xdt);
    for (int n = n0; n < n1; n++) {
        const char* w = (const char*)W + n * wrow;
        for (int m = 0; m < M; m++) {
            const char* xm = (const char*)x + m * xrow;
            float acc = 0.f;
            for (int k = 0; k < K; k++) acc += element(xm, k, xdt) * element(w, k, wdt);
            y[(int64_t)m * N + n] = acc;
        }
    }
}

// How far ahead of its reads a thread asks for its weights (__builtin_prefetch): the hardware
// prefetchers alone start late on a decode step's small matrices (0.2-1.8 MB, one per call, each
// thread a new stream). The requests are non-temporal (locality 0, prefetchnta): a step streams
// ~270 MB of weights that no later read of the step wants back, and as ordinary lines they push
// everything else out of the L3 each token -- the cache's rings the write touches, the Python
// around the step. With the weights in huge pages (native/weights.py) 8 KB ahead measured best
// of 2, 4, 8 and 16 KB (tools/step_ab.py; docs/archive/speed-history.md has the runs).
constexpr int PREFETCH_BYTES = 8192;

#if LIN_W >= 8
// The sum of a vector's 8 floats (AVX2 vectors; the int8 block kernels' too).
static inline float sum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

#if LIN_W == 16
typedef __m512 vf;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
// 32 bf16 weights (64 bytes) -> (even channels, odd channels) as floats
static inline void split_bf16(const uint16_t* w, vf& even, vf& odd) {
    const __m512i v = _mm512_loadu_si512(w);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000)));
}
#elif LIN_W == 8
typedef __m256 vf;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline float vsum(vf v) { return sum8(v); }
static inline void split_bf16(const uint16_t* w, vf& even, vf& odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)w);
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000)));
}
#elif LIN_W == 4
typedef float32x4_t vf;  // NEON
static inline vf vzero() { return vdupq_n_f32(0.f); }
static inline vf vload(const float* p) { return vld1q_f32(p); }
static inline vf vfma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf vadd(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vmul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vset1(float a) { return vdupq_n_f32(a); }
static inline float vsum(vf v) { return vaddvq_f32(v); }
static inline void split_bf16(const uint16_t* w, vf& even, vf& odd) {
    const uint32x4_t v = vld1q_u32((const uint32_t*)w);
    even = vreinterpretq_f32_u32(vshlq_n_u32(v, 16));
    odd = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xFFFF0000u)));
}
#endif

// ---- Weights in blocks of 32 (dtypes.h: DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_1) ----
// A block is a scale d (fp16), for q4_1 an offset m (fp16), and 32 codes q, with w_j = d q_j + o:
// o = m for q4_1, -8 d for q4_0 (its codes 0..15 stand for -8..7), 0 for q8_0 (signed codes). So
//   sum_j w_j x_j = d * (sum_j q_j x_j) + o * (sum_j x_j)
// and the sums of x, one per block, are made once per call: a block costs one dot product of its
// codes (widened to floats) with x, and two multiply-adds. Activations stay float32, so the
// product is exact up to float summation order (minillama/weights/blocks.py: the specification).

// The 32 weights at position b of a row: a block of 32, or sub-block b % 8 of a k-quant's block.
static inline SubBlock unit_at(const uint8_t* row, int dt, int b) {
    if (is_k_quant(dt)) return k_sub_block(row + (b / 8) * block_bytes(dt), dt, b % 8);
    const Block v = block_at(row + b * block_bytes(dt), dt);
    SubBlock u;
    u.d[0] = u.d[1] = v.d, u.o = v.o;
    for (int i = 0; i < 32; i++) u.q[i] = (int8_t)block_code(v, dt, i);
    return u;
}

// The plain loop over 32-weight units (blocks of 32, or a k-quant's sub-blocks): the reference
// for the vector paths and the product on CPUs without them. x (M, K) float32, with `sums` the
// sums of its blocks (M, K / 32); or x's int8 codes (the int8 path below), with `scale` their
// scales and `sums` each scale times the sum of its block's codes.
template <typename X>
static void rows_units_scalar(const X* x, const float* scale, const float* sums, const void* W, int dt, int M, int n0, int n1,
                              int N, int K, float* y) {
    using Dot = std::conditional_t<std::is_same_v<X, float>, float, int32_t>;
    const int nb = K / 32;
    for (int n = n0; n < n1; n++) {
        const uint8_t* w = (const uint8_t*)W + n * row_bytes(dt, K);
        for (int m = 0; m < M; m++) {
            float acc = 0.f;
            for (int b = 0; b < nb; b++) {
                const SubBlock v = unit_at(w, dt, b);
                const X* xb = x + (int64_t)m * K + 32 * b;
                Dot dot[2] = {0, 0};
                for (int j = 0; j < 32; j++) dot[j / 16] += (Dot)v.q[j] * xb[j];
                const float sb = scale ? scale[(int64_t)m * nb + b] : 1.f;
                acc += (v.d[0] * sb) * (float)dot[0] + (v.d[1] * sb) * (float)dot[1] + v.o * sums[(int64_t)m * nb + b];
            }
            y[(int64_t)m * N + n] = acc;
        }
    }
}

#if LIN_W >= 8  // blocks against float x: x86 (on ARM the plain loop)
constexpr int BV = 32 / LIN_W;  // vectors of floats per block: 2 (AVX-512) or 4 (AVX2)

// The 32 codes of a block as BV vectors of floats, in weight order.
static inline void block_codes(const uint8_t* q, int dt, vf* c) {
    const __m128i nibble = _mm_set1_epi8(15);
#if LIN_W == 16
    if (dt == DTYPE_Q8_0) {
        c[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
        c[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))));
    } else {
        const __m128i p = _mm_loadu_si128((const __m128i*)q);
        c[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(p, nibble)));
        c[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(p, 4), nibble)));
    }
#else
    __m128i lo, hi;
    if (dt == DTYPE_Q8_0) {
        lo = _mm_loadu_si128((const __m128i*)q), hi = _mm_loadu_si128((const __m128i*)(q + 16));
        c[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        c[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        c[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        c[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        const __m128i p = _mm_loadu_si128((const __m128i*)q);
        lo = _mm_and_si128(p, nibble), hi = _mm_and_si128(_mm_srli_epi16(p, 4), nibble);
        c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        c[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        c[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    }
#endif
}

// Row n of W (blocks) against M rows of x: each block's codes widened once for all M rows.
template <int M>
static inline void row_blocks(const float* x, const float* sums, const void* W, int dt, int n, int N, int K, float* y) {
    const int nb = K / 32, bb = block_bytes(dt);
    const uint8_t* w = (const uint8_t*)W + n * row_bytes(dt, K);
    vf acc[M];
    float off[M];
    for (int m = 0; m < M; m++) acc[m] = vzero(), off[m] = 0.f;
    for (int b = 0; b < nb; b++, w += bb) {
        __builtin_prefetch(w + PREFETCH_BYTES, 0, 0);
        const Block v = block_at(w, dt);
        vf c[BV];
        block_codes(v.q, dt, c);
        const vf d = vset1(v.d);
        for (int m = 0; m < M; m++) {
            const float* xm = x + (int64_t)m * K + 32 * b;
            vf dot = vmul(c[0], vload(xm));
            for (int i = 1; i < BV; i++) dot = vfma(c[i], vload(xm + i * LIN_W), dot);
            acc[m] = vfma(d, dot, acc[m]);
            off[m] += v.o * sums[(int64_t)m * nb + b];
        }
    }
    for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = vsum(acc[m]) + off[m];
}
#endif

// ---- Blocks against activations rounded to int8 (the "kernels" backend; "kernels-exact" and the
// PyTorch layers keep the float product above) ----
// As llama.cpp multiplies its blocks against Q8_0 activations: each block of 32 of x becomes
// int8 codes c_j and a float scale s (amax / 127, c_j = round(x_j 127 / amax)), and a block costs
// one integer dot product of the weight codes with c (vpdpbusd, or vpmaddubsw + vpmaddwd; sdot on ARM):
//   sum_j w_j (s c_j) = (d s) * (sum_j q_j c_j) + o * (s sum_j c_j)
// The result is the exact product of the weights with the rounded activations x^ = s c
// (weights/blocks.py: round_activations, the specification); |x_j - x^_j| <= s / 2, so each
// output moves by at most sum over blocks of (amax_b / 254) * sum_j |w_j| from the float product.

#if defined(__AVX2__) && defined(__FMA__)
#define LIN_INT8 1
#define LIN_K 1  // the k-quants' float kernel too
// acc + the sums of 4 adjacent products u8 x s8, per 32-bit lane. Without VNNI the pairs are
// summed in int16 first (vpmaddubsw saturates above 32767: the codes here reach 2 * 128 * 127).
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Row n of W (blocks of type DT) against M rows of rounded x, 8 blocks at a time: their scales
// (and q4_1's mins) gathered into one vector and converted at once, each block's codes made
// unsigned once for all M rows (4-bit codes are; q8_0's signs move onto x's codes). Blocks
// alternate between two accumulators, so no multiply-add waits on the one before it.
template <int M, int DT>
static inline void row_int8(const int8_t* c, const float* s, const float* cs, const void* W, int n, int N, int K, float* y) {
    const int nb = K / 32, bb = block_bytes(DT);
    const uint8_t* w = (const uint8_t*)W + n * row_bytes(DT, K);
    constexpr int A = M == 1 ? 4 : 2;  // accumulators per row of x: blocks take turns
    __m256 acc[A][M], off[M];
    for (int m = 0; m < M; m++) {
        off[m] = _mm256_setzero_ps();
        for (int a = 0; a < A; a++) acc[a][m] = off[m];
    }
    float tail[M];  // the offsets of the blocks after the last 8
    for (int m = 0; m < M; m++) tail[m] = 0.f;
    const __m256i nibble = _mm256_set1_epi8(15), halves = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    auto codes = [&](const uint8_t* q, __m256i& u, __m256i& sign) {
        if (DT == DTYPE_Q8_0) {
            sign = _mm256_loadu_si256((const __m256i*)q);
            u = _mm256_abs_epi8(sign);
        } else {  // byte j: weight j low, weight j + 16 high: the 16 bytes twice, the second shifted
            const __m256i p = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)q));
            u = _mm256_and_si256(_mm256_srlv_epi32(p, halves), nibble);
        }
    };
    auto dot = [&](const __m256i& u, const __m256i& sign, int m, int b) {
        __m256i x = _mm256_loadu_si256((const __m256i*)(c + (int64_t)m * K + 32 * b));
        if (DT == DTYPE_Q8_0) x = _mm256_sign_epi8(x, sign);
        return _mm256_cvtepi32_ps(dot_u8s8(_mm256_setzero_si256(), u, x));
    };
    int b = 0;
    for (; b + 8 <= nb; b += 8, w += 8 * bb) {
        for (int at = 0; at < 8 * bb; at += 64) __builtin_prefetch(w + PREFETCH_BYTES + at, 0, 0);
        __m128i hd = _mm_setzero_si128(), hm = _mm_setzero_si128();
        for (int k = 0; k < 8; k++) {
            uint16_t h[2];
            std::memcpy(h, w + k * bb, 4);
            hd = _mm_insert_epi16(hd, h[0], k);
            if (DT == DTYPE_Q4_1) hm = _mm_insert_epi16(hm, h[1], k);
        }
        const __m256 d = _mm256_cvtph_ps(hd);  // the 8 blocks' scales
        // w = d q + o: o = -8 d (q4_0), m (q4_1), 0 (q8_0)
        const __m256 o = DT == DTYPE_Q4_1 ? _mm256_cvtph_ps(hm) : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
        __m256 ds[M];  // d times x's scale, per block
        for (int m = 0; m < M; m++) {
            const int64_t i = (int64_t)m * nb + b;
            ds[m] = _mm256_mul_ps(d, _mm256_loadu_ps(s + i));
            if (DT != DTYPE_Q8_0) off[m] = _mm256_fmadd_ps(o, _mm256_loadu_ps(cs + i), off[m]);
        }
        for (int k = 0; k < 8; k++) {
            __m256i u, sign;
            codes(w + k * bb + (DT == DTYPE_Q4_1 ? 4 : 2), u, sign);
            for (int m = 0; m < M; m++) {
                const __m256 f = _mm256_permutevar8x32_ps(ds[m], _mm256_set1_epi32(k));
                acc[k % A][m] = _mm256_fmadd_ps(dot(u, sign, m, b + k), f, acc[k % A][m]);
            }
        }
    }
    for (; b < nb; b++, w += bb) {  // the last blocks, one at a time
        const Block v = block_at(w, DT);
        __m256i u, sign;
        codes(v.q, u, sign);
        for (int m = 0; m < M; m++) {
            const int64_t i = (int64_t)m * nb + b;
            acc[0][m] = _mm256_fmadd_ps(dot(u, sign, m, b), _mm256_set1_ps(v.d * s[i]), acc[0][m]);
            tail[m] += v.o * cs[i];
        }
    }
    for (int m = 0; m < M; m++) {
        for (int a = 0; a < A; a++) off[m] = _mm256_add_ps(off[m], acc[a][m]);
        y[(int64_t)m * N + n] = sum8(off[m]) + tail[m];
    }
}

// A k-quant block (256 weights) unpacked once for every row of x: its 8 sub-blocks' codes as
// unsigned bytes u (q4_k: low and high nibbles of 4 loads of 32 bytes; q6_k: low nibbles or'ed
// with high pairs, 0..63, standing for q - 32), its scales d sc as vectors (q4_k's 6-bit scales
// and mins by 32-bit masks and shifts, 12 bytes -> 8 + 8: one per sub-block in scale[0]; q6_k's
// 16 int8 scales, one per 16 weights, in scale[0..1]) and q4_k's -dmin m per sub-block (mins).
template <int DT>
static inline void k_block(const uint8_t* w, __m256i* u, __m256* scale, __m256& mins) {
    const __m256i low = _mm256_set1_epi8(15), pair = _mm256_set1_epi8(0x30);
    if (DT == DTYPE_Q4_K) {
        uint16_t h[2];
        uint32_t t[3];
        std::memcpy(h, w, 4), std::memcpy(t, w + 4, 12);
        const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
        const uint32_t sc[2] = {t[0] & six, (t[2] & four) | (((t[0] >> 6) & two) << 4)};  // sub-blocks 0-3, 4-7
        const uint32_t mn[2] = {t[1] & six, ((t[2] >> 4) & four) | (((t[1] >> 6) & two) << 4)};
        const __m256 widened = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sc[1], (int)sc[0])));
        scale[0] = _mm256_mul_ps(widened, _mm256_set1_ps(half_to_float(h[0])));
        mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)mn[1], (int)mn[0]))),
                             _mm256_set1_ps(-half_to_float(h[1])));
        for (int g = 0; g < 4; g++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 16 + 32 * g));
            u[2 * g] = _mm256_and_si256(v, low), u[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
    } else {
        uint16_t h;
        std::memcpy(&h, w + 208, 2);
        const __m256 d = _mm256_set1_ps(half_to_float(h));
        const __m128i sc = _mm_loadu_si128((const __m128i*)(w + 192));
        mins = _mm256_setzero_ps();
        scale[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
        scale[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
        for (int half = 0; half < 2; half++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i*)(w + 64 * half)),
                          ql1 = _mm256_loadu_si256((const __m256i*)(w + 64 * half + 32)),
                          qh = _mm256_loadu_si256((const __m256i*)(w + 128 + 32 * half));
            __m256i* uh = u + 4 * half;  // bits 2k, 2k + 1 of qh are sub-block k's high pair
            uh[0] = _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), pair));
            uh[1] = _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), pair));
            uh[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, pair));
            uh[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), pair));
        }
    }
}

// Row n of k-quant blocks against M rows of rounded x. q6_k's dots start from -32 times each
// lane's sum of x's codes (`lanes`), and each 16 weights (4 lanes) have their own scale; x's
// scales for a block's 8 sub-blocks are one vector (s and cs are contiguous along a row of x).
template <int M, int DT>
static inline void row_int8_k(const int8_t* c, const float* s, const float* cs, const int32_t* lanes, const void* W, int n,
                              int N, int K, float* y) {
    const int nb = K / 256, nx = K / 32;
    const uint8_t* w = (const uint8_t*)W + n * row_bytes(DT, K);
    __m256 acc0[M], acc1[M], off[M];
    for (int m = 0; m < M; m++) acc0[m] = acc1[m] = off[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += block_bytes(DT)) {
        for (int at = 0; at < block_bytes(DT); at += 64) __builtin_prefetch(w + PREFETCH_BYTES + at, 0, 0);
        __m256i u[8];
        __m256 scale[2], mins;  // d sc per sub-block (q6_k: per 16 weights, two vectors); -dmin m
        k_block<DT>(w, u, scale, mins);
        for (int m = 0; m < M; m++) {
            const int64_t i = (int64_t)m * nx + 8 * b;  // x's sub-block 0 of this block
            const int8_t* x = c + (int64_t)m * K + 256 * b;
            const __m256 xs = _mm256_loadu_ps(s + i);  // x's 8 scales
            if (DT == DTYPE_Q4_K) off[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(cs + i), off[m]);
            const __m256 ds = DT == DTYPE_Q4_K ? _mm256_mul_ps(scale[0], xs) : xs;
            for (int j = 0; j < 8; j++) {
                const __m256i xj = _mm256_loadu_si256((const __m256i*)(x + 32 * j));
                const __m256i start =
                    DT == DTYPE_Q6_K ? _mm256_loadu_si256((const __m256i*)(lanes + 8 * (i + j))) : _mm256_setzero_si256();
                const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(start, u[j], xj));
                __m256 f;  // this sub-block's factor in every lane (q6_k: two, by half)
                if (DT == DTYPE_Q4_K) {
                    f = _mm256_permutevar8x32_ps(ds, _mm256_set1_epi32(j));
                } else {
                    const __m256i at = _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1);
                    f = _mm256_mul_ps(_mm256_permutevar8x32_ps(scale[j / 4], _mm256_and_si256(at, _mm256_set1_epi32(7))),
                                      _mm256_permutevar8x32_ps(xs, _mm256_set1_epi32(j)));
                }
                if (j & 1) acc1[m] = _mm256_fmadd_ps(dot, f, acc1[m]);
                else acc0[m] = _mm256_fmadd_ps(dot, f, acc0[m]);
            }
        }
    }
    for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = sum8(_mm256_add_ps(_mm256_add_ps(acc0[m], acc1[m]), off[m]));
}

// The same blocks against float x (kernels-exact, and the rulers): each sub-block's codes widened
// to floats (q6_k's less 32 first), 16 weights a scale; q4_k's mins times the sums of x's blocks.
template <int M, int DT>
static inline void row_float_k(const float* x, const float* sums, const void* W, int n, int N, int K, float* y) {
    const int nb = K / 256, nx = K / 32;
    const uint8_t* w = (const uint8_t*)W + n * row_bytes(DT, K);
    __m256 acc[M], off[M];
    for (int m = 0; m < M; m++) acc[m] = off[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += block_bytes(DT)) {
        for (int at = 0; at < block_bytes(DT); at += 64) __builtin_prefetch(w + PREFETCH_BYTES + at, 0, 0);
        __m256i u[8];
        __m256 scale[2], mins;
        k_block<DT>(w, u, scale, mins);
        alignas(32) float sc[16];
        _mm256_store_ps(sc, scale[0]);
        if (DT == DTYPE_Q6_K) _mm256_store_ps(sc + 8, scale[1]);
        for (int j = 0; j < 8; j++) {
            const __m256i q = DT == DTYPE_Q6_K ? _mm256_sub_epi8(u[j], _mm256_set1_epi8(32)) : u[j];
            const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
            __m256 c[4];  // weights 8i .. 8i + 7 of the sub-block, as floats
            for (int i = 0; i < 4; i++) {
                const __m128i eight = i % 2 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
                c[i] = _mm256_cvtepi32_ps(DT == DTYPE_Q6_K ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight));
            }
            const __m256 d0 = _mm256_set1_ps(DT == DTYPE_Q6_K ? sc[2 * j] : sc[j]),
                         d1 = _mm256_set1_ps(DT == DTYPE_Q6_K ? sc[2 * j + 1] : sc[j]);
            for (int m = 0; m < M; m++) {
                const float* xm = x + (int64_t)m * K + 256 * b + 32 * j;
                const __m256 lo = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(xm + 8), _mm256_mul_ps(c[0], _mm256_loadu_ps(xm)));
                const __m256 hi = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xm + 24), _mm256_mul_ps(c[2], _mm256_loadu_ps(xm + 16)));
                acc[m] = _mm256_fmadd_ps(d1, hi, _mm256_fmadd_ps(d0, lo, acc[m]));
            }
        }
        if (DT == DTYPE_Q4_K)
            for (int m = 0; m < M; m++) off[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(sums + (int64_t)m * nx + 8 * b), off[m]);
    }
    for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = sum8(_mm256_add_ps(acc[m], off[m]));
}

template <int M>
static void rows_int8(const int8_t* c, const float* s, const float* cs, const int32_t* lanes, const void* W, int dt, int n0,
                      int n1, int N, int K, float* y) {
    for (int n = n0; n < n1; n++) {
        if (dt == DTYPE_Q8_0) row_int8<M, DTYPE_Q8_0>(c, s, cs, W, n, N, K, y);
        else if (dt == DTYPE_Q4_0) row_int8<M, DTYPE_Q4_0>(c, s, cs, W, n, N, K, y);
        else if (dt == DTYPE_Q4_1) row_int8<M, DTYPE_Q4_1>(c, s, cs, W, n, N, K, y);
        else if (dt == DTYPE_Q4_K) row_int8_k<M, DTYPE_Q4_K>(c, s, cs, lanes, W, n, N, K, y);
        else row_int8_k<M, DTYPE_Q6_K>(c, s, cs, lanes, W, n, N, K, y);
    }
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define LIN_INT8 1
#define LIN_K 0  // the k-quants' float kernel is x86's; against int8 x they run here too
// Row n of W (blocks of 32) against M rows of rounded x with ARMv8.2's sdot (vdotq_s32: 4 lanes,
// each the sum of 4 products s8 x s8): a block's 32 codes as two vectors of 16 (4-bit codes are
// 0..15, so signed bytes too; the low nibbles are weights 0-15), two dots a row of x, its float
// sum times d s, and o times s sum c beside it, as above.
template <int M, int DT>
static inline void row_int8(const int8_t* c, const float* s, const float* cs, const void* W, int n, int N, int K, float* y) {
    const int nb = K / 32, bb = block_bytes(DT);
    const uint8_t* w = (const uint8_t*)W + n * row_bytes(DT, K);
    float32x4_t acc[2][M];  // blocks alternate between two accumulators
    float off[M];
    for (int m = 0; m < M; m++) acc[0][m] = acc[1][m] = vdupq_n_f32(0.f), off[m] = 0.f;
    for (int b = 0; b < nb; b++, w += bb) {
        __builtin_prefetch(w + PREFETCH_BYTES, 0, 0);
        const Block v = block_at(w, DT);
        int8x16_t lo, hi;  // weights 0-15, 16-31
        if (DT == DTYPE_Q8_0) {
            lo = vld1q_s8((const int8_t*)v.q), hi = vld1q_s8((const int8_t*)v.q + 16);
        } else {
            const uint8x16_t p = vld1q_u8(v.q);
            lo = vreinterpretq_s8_u8(vandq_u8(p, vdupq_n_u8(15))), hi = vreinterpretq_s8_u8(vshrq_n_u8(p, 4));
        }
        for (int m = 0; m < M; m++) {
            const int64_t i = (int64_t)m * nb + b;
            const int8_t* x = c + (int64_t)m * K + 32 * b;
            const int32x4_t dot = vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, vld1q_s8(x)), hi, vld1q_s8(x + 16));
            acc[b & 1][m] = vfmaq_n_f32(acc[b & 1][m], vcvtq_f32_s32(dot), v.d * s[i]);
            off[m] += v.o * cs[i];
        }
    }
    for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = vaddvq_f32(vaddq_f32(acc[0][m], acc[1][m])) + off[m];
}

// A k-quant row: each sub-block of 32 decoded by dtypes.h's k_sub_block (signed codes, a scale per
// 16 weights, q4_k's offset), then two dots a row of x as above.
template <int M, int DT>
static inline void row_int8_k(const int8_t* c, const float* s, const float* cs, const void* W, int n, int N, int K, float* y) {
    const int nb = K / 256, nx = K / 32;
    const uint8_t* w = (const uint8_t*)W + n * row_bytes(DT, K);
    float acc[M] = {};
    for (int b = 0; b < nb; b++, w += block_bytes(DT)) {
        __builtin_prefetch(w + PREFETCH_BYTES, 0, 0);
        for (int j = 0; j < 8; j++) {
            const SubBlock v = k_sub_block(w, DT, j);
            const int8x16_t lo = vld1q_s8(v.q), hi = vld1q_s8(v.q + 16);
            for (int m = 0; m < M; m++) {
                const int64_t i = (int64_t)m * nx + 8 * b + j;
                const int8_t* x = c + (int64_t)m * K + 32 * (8 * b + j);
                const int32x4_t zero = vdupq_n_s32(0);
                const float d0 = (float)vaddvq_s32(vdotq_s32(zero, lo, vld1q_s8(x))),
                            d1 = (float)vaddvq_s32(vdotq_s32(zero, hi, vld1q_s8(x + 16)));
                acc[m] += (v.d[0] * d0 + v.d[1] * d1) * s[i] + v.o * cs[i];
            }
        }
    }
    for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = acc[m];
}

template <int M>
static void rows_int8(const int8_t* c, const float* s, const float* cs, const int32_t*, const void* W, int dt, int n0, int n1,
                      int N, int K, float* y) {
    for (int n = n0; n < n1; n++) {
        if (dt == DTYPE_Q8_0) row_int8<M, DTYPE_Q8_0>(c, s, cs, W, n, N, K, y);
        else if (dt == DTYPE_Q4_0) row_int8<M, DTYPE_Q4_0>(c, s, cs, W, n, N, K, y);
        else if (dt == DTYPE_Q4_1) row_int8<M, DTYPE_Q4_1>(c, s, cs, W, n, N, K, y);
        else if (dt == DTYPE_Q4_K) row_int8_k<M, DTYPE_Q4_K>(c, s, cs, W, n, N, K, y);
        else row_int8_k<M, DTYPE_Q6_K>(c, s, cs, W, n, N, K, y);
    }
}
#else
#define LIN_INT8 0
#define LIN_K 0
#endif

// One row of W at a time, read front to back, so each thread's share of W is one sequential
// stream. (Reading TILE = 4 adjacent rows interleaved, one vector of each in turn, kept more
// weights in flight per x load but streamed slower than one row at a time, which reaches the
// machine's plain streaming read: the prefetchers follow one stream better than four.) Independent accumulator chains come from unrolling along k:
// U chains per row of x, so U * M products are in flight.
template <int M>
constexpr int chains() { return M == 1 ? 4 : M == 2 ? 2 : 1; }

#if LIN_W
// Row n of W against M rows of x, K a multiple of 2 * LIN_W. FLOAT32 weights: x (M, K) floats.
// bf16 weights: xe, xo (M, K/2) the even and odd channels of x.
template <int M, bool BF16>
static inline void row_vector(const float* xa, const float* xb, const void* W, int n, int N, int K, float* y) {
    constexpr int U = chains<M>();
    vf acc[U][M];
    for (int u = 0; u < U; u++)
        for (int m = 0; m < M; m++) acc[u][m] = vzero();
    if (BF16) {
        const int H = K / 2;  // pairs per row
        const uint16_t* w = (const uint16_t*)W + (int64_t)n * K;
        auto step = [&](int k, int u) {  // LIN_W pairs of channels at k
            __builtin_prefetch((const char*)(w + 2 * k) + PREFETCH_BYTES, 0, 0);
            vf we, wo;
            split_bf16(w + 2 * k, we, wo);
            for (int m = 0; m < M; m++)
                acc[u][m] = vfma(wo, vload(xb + (int64_t)m * H + k), vfma(we, vload(xa + (int64_t)m * H + k), acc[u][m]));
        };
        int k = 0;
        for (; k + U * LIN_W <= H; k += U * LIN_W)
            for (int u = 0; u < U; u++) step(k + u * LIN_W, u);
        for (; k < H; k += LIN_W) step(k, 0);
    } else {
        const float* w = (const float*)W + (int64_t)n * K;
        auto step = [&](int k, int u) {
            const vf wv = vload(w + k);
            for (int m = 0; m < M; m++) acc[u][m] = vfma(wv, vload(xa + (int64_t)m * K + k), acc[u][m]);
        };
        int k = 0;
        for (; k + U * LIN_W <= K; k += U * LIN_W)
            for (int u = 0; u < U; u++) step(k + u * LIN_W, u);
        for (; k < K; k += LIN_W) step(k, 0);
    }
    for (int m = 0; m < M; m++) {
        vf total = acc[0][m];
        for (int u = 1; u < U; u++) total = vadd(total, acc[u][m]);
        y[(int64_t)m * N + n] = vsum(total);
    }
}

template <int M, bool BF16>
static void rows_vector(const float* xa, const float* xb, const void* W, int n0, int n1, int N, int K, float* y) {
    for (int n = n0; n < n1; n++) row_vector<M, BF16>(xa, xb, W, n, N, K, y);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define LIN_DPBF16 1
// Row n of bf16 W x bf16 activations with vdpbf16ps: 32 products per instruction, float32 sums.
template <int M>
static inline void row_dpbf16(const uint16_t* x, const uint16_t* W, int n, int N, int K, float* y) {
    constexpr int U = chains<M>();
    __m512 acc[U][M];
    for (int u = 0; u < U; u++)
        for (int m = 0; m < M; m++) acc[u][m] = _mm512_setzero_ps();
    const uint16_t* w = W + (int64_t)n * K;
    auto step = [&](int k, int u) {  // 32 channels at k
        __builtin_prefetch((const char*)(w + k) + PREFETCH_BYTES, 0, 0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
        for (int m = 0; m < M; m++)
            acc[u][m] = _mm512_dpbf16_ps(acc[u][m], wv, (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + k));
    };
    int k = 0;
    for (; k + U * 32 <= K; k += U * 32)
        for (int u = 0; u < U; u++) step(k + u * 32, u);
    for (; k < K; k += 32) step(k, 0);
    for (int m = 0; m < M; m++) {
        __m512 total = acc[0][m];
        for (int u = 1; u < U; u++) total = _mm512_add_ps(total, acc[u][m]);
        y[(int64_t)m * N + n] = _mm512_reduce_add_ps(total);
    }
}

template <int M>
static void rows_dpbf16(const uint16_t* x, const uint16_t* W, int n0, int n1, int N, int K, float* y) {
    for (int n = n0; n < n1; n++) row_dpbf16<M>(x, W, n, N, K, y);
}
#else
#define LIN_DPBF16 0
#endif

// The activations as the paths read them, prepared once per call (prepare_x).
struct PreparedX {
    int M, K, xdt, wdt;
    const void* x;            // as given, (M, K)
    std::vector<float> a, b;  // float32 copies: x, or its even / odd channels (M, K/2) for bf16 weights
    std::vector<float> sums;  // block weights: the sums of x's blocks of 32 (M, K/32)
    bool int8;                // block weights against x rounded to int8 per block:
    std::vector<int8_t> c;    //   x's codes (M, K)
    std::vector<float> s;     //   their scales and the scale times their sum (M, K/32) (sums holds the latter)
    std::vector<int32_t> lanes;  // q6_k: -32 times the sum of each 4 codes of c (M, K/4)
    bool vector;              // a vector path applies (K a multiple of the vector width)
    bool dpbf16;              // bf16 x bf16 on vdpbf16ps
};

static void prepare_x(PreparedX& p) {
    p.dpbf16 = false;
    if (is_block_dtype(p.wdt) && p.int8) {  // x's blocks as int8 codes and a scale
        const int M = p.M, K = p.K;
        p.c.resize((size_t)M * K), p.s.resize((size_t)M * K / 32), p.sums.resize((size_t)M * K / 32);
        for (int64_t b = 0; b < (int64_t)M * K / 32; b++) {
            float x[32], amax = 0.f;
            for (int j = 0; j < 32; j++) x[j] = element(p.x, 32 * b + j, p.xdt), amax = std::max(amax, std::fabs(x[j]));
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            int sum = 0;
            for (int j = 0; j < 32; j++) sum += p.c[32 * b + j] = (int8_t)std::nearbyint(x[j] * inv);  // ties to even
            p.s[b] = amax / 127.f, p.sums[b] = p.s[b] * (float)sum;
        }
        if (p.wdt == DTYPE_Q6_K) {
            p.lanes.resize((size_t)M * K / 4);
            for (int64_t i = 0; i < (int64_t)M * K / 4; i++)
                p.lanes[i] = -32 * (p.c[4 * i] + p.c[4 * i + 1] + p.c[4 * i + 2] + p.c[4 * i + 3]);
        }
        p.vector = LIN_INT8;
        return;
    }
    if (is_block_dtype(p.wdt)) {  // x as float32, and the sum of each of its blocks
        const int M = p.M, K = p.K;
        p.a.resize((size_t)M * K), p.sums.assign((size_t)M * K / 32, 0.f);
        for (int64_t i = 0; i < (int64_t)M * K; i++) p.sums[i / 32] += p.a[i] = element(p.x, i, p.xdt);
        p.vector = is_k_quant(p.wdt) ? LIN_K : LIN_W >= 8;
        return;
    }
#if LIN_DPBF16 || LIN_W
    const int M = p.M, K = p.K;
#endif
#if LIN_DPBF16
    p.dpbf16 = p.xdt == 2 && p.wdt == 2 && K % 32 == 0;
    if (p.dpbf16) {
        p.vector = true;
        return;
    }
#endif
#if LIN_W
    p.vector = p.wdt == 2 ? K % (2 * LIN_W) == 0 : K % LIN_W == 0;
    if (!p.vector) return;
    if (p.wdt == 2) {  // even and odd channels of x, as floats
        p.a.resize((size_t)M * K / 2), p.b.resize((size_t)M * K / 2);
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K / 2; k++) {
                p.a[(size_t)m * K / 2 + k] = element(p.x, (int64_t)m * K + 2 * k, p.xdt);
                p.b[(size_t)m * K / 2 + k] = element(p.x, (int64_t)m * K + 2 * k + 1, p.xdt);
            }
    } else if (p.xdt != 0) {
        p.a.resize((size_t)M * K);
        for (int64_t i = 0; i < (int64_t)M * K; i++) p.a[i] = element(p.x, i, p.xdt);
    }
#else
    p.vector = false;
#endif
}

// Rows m0 .. m0 + MB of x against rows [n0, n1) of W.
template <int MB>
static void rows_block(const PreparedX& p, int m0, const void* W, int n0, int n1, int N, float* y) {
    y += (int64_t)m0 * N;
#if LIN_K
    if (!p.int8 && is_k_quant(p.wdt)) {
        const float *x = p.a.data() + (int64_t)m0 * p.K, *sums = p.sums.data() + (int64_t)m0 * (p.K / 32);
        for (int n = n0; n < n1; n++) {
            if (p.wdt == DTYPE_Q4_K) row_float_k<MB, DTYPE_Q4_K>(x, sums, W, n, N, p.K, y);
            else row_float_k<MB, DTYPE_Q6_K>(x, sums, W, n, N, p.K, y);
        }
        return;
    }
#endif
#if LIN_INT8
    if (p.int8) {
        const int64_t nb = p.K / 32;
        const int8_t* c = p.c.data() + (int64_t)m0 * p.K;
        const float *s = p.s.data() + m0 * nb, *cs = p.sums.data() + m0 * nb;
        const int32_t* lanes = p.lanes.empty() ? nullptr : p.lanes.data() + m0 * nb * 8;
        return rows_int8<MB>(c, s, cs, lanes, W, p.wdt, n0, n1, N, p.K, y);
    }
#endif
#if LIN_W >= 8
    if (is_block_dtype(p.wdt)) {
        const float *x = p.a.data() + (int64_t)m0 * p.K, *sums = p.sums.data() + (int64_t)m0 * (p.K / 32);
        for (int n = n0; n < n1; n++) row_blocks<MB>(x, sums, W, p.wdt, n, N, p.K, y);
        return;
    }
#endif
#if LIN_DPBF16
    if (p.dpbf16) return rows_dpbf16<MB>((const uint16_t*)p.x + (int64_t)m0 * p.K, (const uint16_t*)W, n0, n1, N, p.K, y);
#endif
#if LIN_W
    if (p.wdt == 2) {
        const int64_t h = (int64_t)m0 * (p.K / 2);
        return rows_vector<MB, true>(p.a.data() + h, p.b.data() + h, W, n0, n1, N, p.K, y);
    }
    const float* xa = p.a.empty() ? (const float*)p.x : p.a.data();
    return rows_vector<MB, false>(xa + (int64_t)m0 * p.K, nullptr, W, n0, n1, N, p.K, y);
#endif
}

// Rows [n0, n1) of y: M rows of x in blocks of 4, each block streaming this thread's share of W
// (one pass for M <= 4: a decode step, ppl with up to 4 windows). For larger M the product is
// bound by arithmetic, not bytes: taking the blocks inside the loop over W's rows, so each row
// is read from memory once, measured no faster.
static void rows(const PreparedX& p, const void* W, int n0, int n1, int N, float* y) {
    if (!p.vector && p.int8)
        return rows_units_scalar(p.c.data(), p.s.data(), p.sums.data(), W, p.wdt, p.M, n0, n1, N, p.K, y);
    if (!p.vector && is_block_dtype(p.wdt))
        return rows_units_scalar(p.a.data(), nullptr, p.sums.data(), W, p.wdt, p.M, n0, n1, N, p.K, y);
    if (!p.vector) return rows_scalar(p.x, p.xdt, W, p.wdt, p.M, n0, n1, N, p.K, y);
    const char* first = (const char*)W + n0 * row_bytes(p.wdt, p.K);  // the share's first bytes, asked at once
    for (int b = 0; b < PREFETCH_BYTES; b += 64) __builtin_prefetch(first + b, 0, 0);
    for (int m0 = 0; m0 < p.M; m0 += 4) {
        switch (std::min(4, p.M - m0)) {
            case 1: rows_block<1>(p, m0, W, n0, n1, N, y); break;
            case 2: rows_block<2>(p, m0, W, n0, n1, N, y); break;
            case 3: rows_block<3>(p, m0, W, n0, n1, N, y); break;
            default: rows_block<4>(p, m0, W, n0, n1, N, y);
        }
    }
}

// At most 16 rows of x against all of W. Each thread takes a contiguous share of W's rows (a
// multiple of 4), so each streams one region.
static void gemm16(const void* x, int xdtype, const void* W, int dtype, int M, int N, int K, float* y) {
    PreparedX p{M, K, xdtype, dtype & ~INT8_ACTIVATIONS, x, {}, {}, {}, is_int8_block(dtype), {}, {}, {}, false, false};
    prepare_x(p);
#pragma omp parallel
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int tid = 0, nt = 1;
#endif
        const int share = ((N + nt - 1) / nt + 3) / 4 * 4;
        const int n0 = std::min(N, tid * share), n1 = std::min(N, n0 + share);
        if (n0 < n1) rows(p, W, n0, n1, N, y);
    }
}

// Any number of rows, 16 at a time (the weights stream once per 16 rows: a decode step's batch,
// or the windows and schemes of a perplexity run decoded together).
extern "C" int gemm_rows(const void* x, int xdtype, const void* W, int dtype, int M, int N, int K, float* y) {
    const int wdt = dtype & ~INT8_ACTIVATIONS;
    if ((dtype != 0 && dtype != 2 && !is_block_dtype(wdt)) || (xdtype != 0 && xdtype != 2)) return MINILLAMA_E_DTYPE;
    if (M < 1 || N < 1 || K < 1 || (is_block_dtype(wdt) && K % block_weights(wdt))) return MINILLAMA_E_SHAPE;
    for (int m = 0; m < M; m += 16)
        gemm16((const char*)x + (size_t)m * K * dtype_bytes(xdtype), xdtype, W, dtype, std::min(16, M - m), N, K, y + (size_t)m * N);
    return MINILLAMA_OK;
}

// Rows of blocks (N, K / 32 * bytes) -> weights (N, K) in float32 or bfloat16, computed and rounded
// as weights/blocks.py's dequantize and torch's .to(): what a prompt's chunk multiplies. With many
// rows of x the product is bound by arithmetic, where torch's matrix product beats the skinny
// kernel above; widening the blocks here costs a fraction of doing it in PyTorch.
extern "C" int dequantize_rows(const void* W, int dtype, int N, int K, void* out, int out_dtype) {
    if (!is_block_dtype(dtype) || (out_dtype != 0 && out_dtype != 2)) return MINILLAMA_E_DTYPE;
    if (N < 1 || K < 32 || K % block_weights(dtype)) return MINILLAMA_E_SHAPE;
    const int64_t wrow = row_bytes(dtype, K);
    const int bb = block_bytes(dtype);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t* w = (const uint8_t*)W + n * wrow;
        for (int b = 0; b < K / 32; b++) {
            const bool k = is_k_quant(dtype);
            const Block v = k ? Block{} : block_at(w + b * bb, dtype);
            const SubBlock sb = k ? k_sub_block(w + (b / 8) * bb, dtype, b % 8) : SubBlock{};
            const int64_t at = (int64_t)n * K + 32 * b;
            for (int j = 0; j < 32; j++) {
                const float x = k ? sub_weight(sb, dtype, j) : block_weight(v, dtype, j);
                if (out_dtype == 0) {
                    ((float*)out)[at + j] = x;
                } else {
                    const float r = round_to_dtype(x, 2);
                    uint32_t u;
                    std::memcpy(&u, &r, 4);
                    ((uint16_t*)out)[at + j] = (uint16_t)(u >> 16);
                }
            }
        }
    }
    return MINILLAMA_OK;
}

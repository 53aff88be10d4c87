// Skinny matrix products for decode steps: a few rows of activations against float32 or
// bfloat16 weights (CPU, OpenMP).
//
//   y[m, n] = sum_k x[m, k] * W[n, k]      x float32 (M, K), W (N, K) row-major, y float32 (M, N)
//
// Decoding reads every weight once per step and does 2*M flops per weight, so for small M
// (one token, or the W windows of a perplexity run) speed is set by how fast the weights
// stream from memory. BLAS libraries tune for large M; for M <= 16 they reach a fraction of
// the read bandwidth (on some CPUs a small one: MKL's float32 product of 4 rows reads about
// 3 GB/s on an AMD EPYC with 19 GB/s of bandwidth). This loop streams each weight row once
// for all M rows: the row is widened to float32 in registers and meets every row of x while
// it sits in L1, accumulation is in float32, bfloat16 widens with one shift (it is the top
// half of a float32). The model uses torch's F.linear (the reference) for
// anything else: larger M, float16, CUDA.

#include "minillama.h"

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINILLAMA_AVX2 1
#endif

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Weight element k of row w as float32; dtype 0 = float32, 2 = bfloat16.
template <int DT>
static inline float weight(const void* w, int64_t k) {
    if (DT == 0) return ((const float*)w)[k];
    return bf16_to_float(((const uint16_t*)w)[k]);
}

#ifdef MINILLAMA_AVX2
// 8 weights from position k of a row, widened to float32.
template <int DT>
static inline __m256 load8(const void* w, int64_t k) {
    if (DT == 0) return _mm256_loadu_ps((const float*)w + k);
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)w + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// One row of W against up to 4 rows of x (MB of them, known at compile time). Rows of W are
// walked one at a time: on the machines measured here a single sequential stream per
// thread reads memory faster than several interleaved ones (a 4-row tile streamed bf16
// weights at 7 GB/s, one row at a time at 13 GB/s, of 18 GB/s a plain read reaches).
// With a single x row two accumulators break the FMA dependency chain.
template <int DT, int MB>
static inline void row_dot(const float* x, int K, const void* w, float* out) {
    float acc[MB > 1 ? MB : 2] = {0.f};
    int k = 0;
#ifdef MINILLAMA_AVX2
    if (MB == 1) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (; k + 16 <= K; k += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8<DT>(w, k), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), load8<DT>(w, k + 8), a1);
        }
        acc[0] = hsum(_mm256_add_ps(a0, a1));
    } else {
        __m256 a[MB];
        for (int m = 0; m < MB; m++) a[m] = _mm256_setzero_ps();
        for (; k + 8 <= K; k += 8) {
            const __m256 wk = load8<DT>(w, k);
            for (int m = 0; m < MB; m++) a[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (int64_t)m * K + k), wk, a[m]);
        }
        for (int m = 0; m < MB; m++) acc[m] = hsum(a[m]);
    }
#endif
    for (; k < K; k++) {  // the tail (and the whole row on CPUs without AVX2)
        const float wk = weight<DT>(w, k);
        for (int m = 0; m < MB; m++) acc[m] += x[(int64_t)m * K + k] * wk;
    }
    for (int m = 0; m < MB; m++) out[m] = acc[m];
}

template <int DT>
static void gemm_impl(const float* x, const void* W, int M, int N, int K, float* y) {
    const int64_t row_bytes = (int64_t)K * (DT == 0 ? 4 : 2);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const void* w = (const char*)W + n * row_bytes;
        float out[4];
        for (int m = 0; m < M; m += 4) {  // groups of 4 rows of x; the row of W is in L1 after the first
            const float* xm = x + (int64_t)m * K;
            const int mb = M - m < 4 ? M - m : 4;
            if (mb == 4) row_dot<DT, 4>(xm, K, w, out);
            else if (mb == 3) row_dot<DT, 3>(xm, K, w, out);
            else if (mb == 2) row_dot<DT, 2>(xm, K, w, out);
            else row_dot<DT, 1>(xm, K, w, out);
            for (int j = 0; j < mb; j++) y[(int64_t)(m + j) * N + n] = out[j];
        }
    }
}

extern "C" int gemm_rows(const float* x, const void* W, int dtype, int M, int N, int K, float* y) {
    if (dtype != 0 && dtype != 2) return MINILLAMA_E_DTYPE;
    if (M < 1 || N < 1 || K < 1) return MINILLAMA_E_SHAPE;
    if (dtype == 0) gemm_impl<0>(x, W, M, N, K, y);
    else gemm_impl<2>(x, W, M, N, K, y);
    return MINILLAMA_OK;
}

// Causal attention for a prefill chunk, exact float32 math: the fused kernel behind the PyTorch
// layers' chunks on the kernels backend (model/step.py: chunk_attention), in the manner of
// FlashAttention-2: no score matrix in memory, each key and value read once per block of queries.
//
// A chunk of T new queries attends to L = P + T keys: query t sees keys 0 .. P + t (the whole
// past and itself and earlier). Work is split into tasks of one KV head and a block of QB
// tokens; its rows are the R query heads that share the KV head for each of those tokens
// (grouped-query attention: the keys are read once for all R of them). Per block of 32 keys:
//
//   scores    S = Q K^T for the task's rows and 32 keys, 8 rows at a time against keys packed
//             transposed (d-major, 32 keys a row: two vectors of 16), one fused multiply-add
//             per row, channel and vector -- a small matrix product that keeps its sums in
//             registers. The queries are scaled by log2(e) / sqrt(D) once, so softmax is 2^s.
//   softmax   online (running max m and sum l per row): a block that raises a row's max
//             rescales what the row has summed so far by 2^(m_old - m_new).
//   values    O += P V for RV rows at a time, 4 vectors of channels at a time, each value row
//             read once for those rows.
//
// Written with GCC's vector extensions (vec: 16 floats), so the same source compiles to
// AVX-512, to pairs of AVX2 registers, or to plain SSE: one kernel for every target. The
// specification is model/attention.py's explicit path (attend with no fused function);
// tests/test_prefill_attention.py holds this file to it.

#include "exp2.h"
#include "minillama.h"

#if defined(__AVX__)
#include <immintrin.h>  // hmax's reductions; other targets (SSE, aarch64) take the plain loop
#endif
#include "openmp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#pragma GCC diagnostic ignored "-Wpsabi"  // vec in internal functions only: no ABI crosses a library boundary

namespace {

// W floats a vector, the width of the target's registers; the tiles keep their sums in registers:
// MR x 2 for scores, RV x CV for values (32 registers with AVX-512, 16 with AVX2 or SSE).
#if defined(__AVX512F__)
constexpr int W = 16, NK = 2, MR = 8, RV = 4;
#elif defined(__AVX__)
constexpr int W = 8, NK = 2, MR = 6, RV = 2;
#else
constexpr int W = 4, NK = 2, MR = 6, RV = 2;
#endif
typedef float vec __attribute__((vector_size(W * 4)));
typedef int ivec __attribute__((vector_size(W * 4)));
constexpr int KB = NK * W;    // keys per block: NK vectors
constexpr int CV = 4;         // value channels at a time, in vectors
constexpr int MAX_ROWS = 64;  // rows per task (R query heads x QB tokens, then rounded up to MR)

inline vec load(const float* p) {
    vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

inline vec splat(float x) { return vec{} + x; }

// 2^x for W floats: x = n + f (n the nearest integer, |f| <= 1/2), 2^f by exp2.h's polynomial
// (relative error about 2e-7), n added to the exponent bits. x below -125 gives 0 (a masked
// score, -inf, among them).
inline vec exp2v(vec x) {
    const vec lo = splat(-125.f);
    const vec xc = (x < lo ? lo : x) + 0.5f;
    ivec n = __builtin_convertvector(xc, ivec);  // toward zero: floor(x + 1/2) for x + 1/2 >= 0
    n += __builtin_convertvector(n, vec) > xc;      // one less below zero ("true" lanes are -1)
    const vec f = xc - 0.5f - __builtin_convertvector(n, vec);
    const vec p = exp2_fraction(f);
    ivec bits;
    std::memcpy(&bits, &p, sizeof bits);
    bits += n << 23;
    vec out;
    std::memcpy(&out, &bits, sizeof out);
    return x < lo ? vec{} : out;
}

inline float hmax(vec v) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)v);
#elif defined(__AVX__)
    __m128 x = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
#else
    float m = v[0];
    for (int i = 1; i < W; i++) m = std::max(m, v[i]);
    return m;
#endif
}

inline float hsum(vec v) {
    float s = 0.f;
    for (int i = 0; i < W; i++) s += v[i];
    return s;
}

// s[r][0..KB) = q[r] . k_j for MR rows of D channels, the keys packed d-major: kT[d * KB + j].
template <int D>
inline void scores_tile(const float* q, const float* kT, float* s) {
    vec acc[MR][NK];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NK; c++) acc[r][c] = vec{};
    for (int d = 0; d < D; d++) {
        vec keys[NK];
        for (int c = 0; c < NK; c++) keys[c] = load(kT + d * KB + c * W);
        for (int r = 0; r < MR; r++) {
            const float x = q[r * D + d];
            for (int c = 0; c < NK; c++) acc[r][c] += x * keys[c];
        }
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NK; c++) store(s + r * KB + c * W, acc[r][c]);
}

// o[r] += sum_j p[r][j] v_j for RV rows of D channels, C vectors of channels (from c0) at a
// time, over n <= KB value rows (row j at v + j * vstride).
template <int D, int C>
inline void values_chunk(const float* p, const float* v, int64_t vstride, int n, float* o, int c0) {
    vec acc[RV][C];
    for (int r = 0; r < RV; r++)
        for (int c = 0; c < C; c++) acc[r][c] = load(o + r * D + c0 + c * W);
    for (int j = 0; j < n; j++) {
        vec row[C];
        for (int c = 0; c < C; c++) row[c] = load(v + j * vstride + c0 + c * W);
        for (int r = 0; r < RV; r++) {
            const float w = p[r * KB + j];
            for (int c = 0; c < C; c++) acc[r][c] += w * row[c];
        }
    }
    for (int r = 0; r < RV; r++)
        for (int c = 0; c < C; c++) store(o + r * D + c0 + c * W, acc[r][c]);
}

// The head's channels CV vectors at a time, then the vectors left (80 channels: 4 + 1 on AVX-512).
template <int D>
inline void values_tile(const float* p, const float* v, int64_t vstride, int n, float* o) {
    static_assert(D % W == 0, "a head of whole vectors");
    constexpr int full = D / (CV * W) * (CV * W), tail = (D - full) / W;
    for (int c0 = 0; c0 < full; c0 += CV * W) values_chunk<D, CV>(p, v, vstride, n, o, c0);
    if constexpr (tail > 0) values_chunk<D, tail>(p, v, vstride, n, o, full);
}

struct Strides {
    int64_t b, h, t;  // elements between batches, heads and tokens (channels are contiguous)
};

template <int D>
void causal_attention_impl(const float* q, Strides qs, const float* k, Strides ks, const float* v, Strides vs, int B,
                           int Hq, int Hkv, int T, int L, float* out, Strides os) {
    const int R = Hq / Hkv, P = L - T;
    const int QB = std::max(1, MAX_ROWS / R);  // tokens per task
    const int nblocks = (L + KB - 1) / KB;
    const float scale = 1.4426950408889634f / std::sqrt((float)D);  // log2(e) / sqrt(D): softmax as 2^s

    // The keys of every (batch, KV head) packed transposed, KB at a time: kp[bh][block][d][KB],
    // zeros past the last key (masked anyway: a query's last key is at most L - 1).
    std::vector<float> kp((size_t)B * Hkv * nblocks * D * KB);
#pragma omp parallel for schedule(static) collapse(2)
    for (int bh = 0; bh < B * Hkv; bh++)
        for (int blk = 0; blk < nblocks; blk++) {
            const float* src = k + (bh / Hkv) * ks.b + (bh % Hkv) * ks.h;
            float* dst = kp.data() + ((size_t)bh * nblocks + blk) * D * KB;
            for (int j = 0; j < KB; j++) {
                const int key = blk * KB + j;
                for (int d = 0; d < D; d++) dst[d * KB + j] = key < L ? src[key * ks.t + d] : 0.f;
            }
        }

    const int qblocks = (T + QB - 1) / QB;
    const int tasks = B * Hkv * qblocks;
#pragma omp parallel
    {
        alignas(64) float qt[MAX_ROWS + MR][D];   // the task's queries, scaled; padding rows zero
        alignas(64) float ot[MAX_ROWS + MR][D];   // its output sums
        alignas(64) float st[MAX_ROWS + MR][KB];  // a block's scores, then weights
        float m[MAX_ROWS + MR];                   // a row's running max
        vec l[MAX_ROWS + MR];                     // its running sums of weights, W lanes (summed at the end)
        int last[MAX_ROWS + MR];  // a row's last visible key
        // the longest tasks (the last query blocks) first, the rest as threads come free
#pragma omp for schedule(dynamic, 1)
        for (int task_ = 0; task_ < tasks; task_++) {
            const int task = tasks - 1 - task_;
            const int qb = task % qblocks, bh = task / qblocks, b = bh / Hkv, g = bh % Hkv;
            const int t0 = qb * QB, nt = std::min(QB, T - t0);
            const int rows = nt * R, padded = (rows + MR - 1) / MR * MR;
            for (int row = 0; row < padded; row++) {  // row = token * R + query head within the group
                const int t = t0 + row / R, h = g * R + row % R;
                if (row < rows) {
                    const float* src = q + b * qs.b + h * qs.h + t * qs.t;
                    for (int d = 0; d < D; d++) qt[row][d] = src[d] * scale;
                    last[row] = P + t;
                } else {
                    std::memset(qt[row], 0, sizeof qt[row]);
                    last[row] = L - 1;
                }
                std::memset(ot[row], 0, sizeof ot[row]);
                m[row] = -INFINITY;
                l[row] = vec{};
            }
            const int keys = P + t0 + nt;  // the task's last row sees keys [0, keys)
            const float* kpack = kp.data() + (size_t)bh * nblocks * D * KB;
            const float* vbase = v + b * vs.b + g * vs.h;
            for (int blk = 0; blk * KB < keys; blk++) {
                const int j0 = blk * KB, n = std::min(KB, keys - j0);
                for (int r0 = 0; r0 < padded; r0 += MR) scores_tile<D>(qt[r0], kpack + (size_t)blk * D * KB, st[r0]);
                for (int row = 0; row < padded; row++) {  // online softmax, one row at a time
                    float* s = st[row];
                    const int visible = std::min(KB, last[row] - j0 + 1);  // keys of this block the row sees
                    if (visible <= 0) {  // a block wholly after the row's last key: weights 0
                        std::memset(s, 0, KB * sizeof(float));
                        continue;
                    }
                    for (int j = visible; j < KB; j++) s[j] = -INFINITY;
                    vec top = load(s);
                    for (int c = 1; c < NK; c++) {
                        const vec x = load(s + c * W);
                        top = x > top ? x : top;
                    }
                    const float mnew = std::max(m[row], hmax(top));
                    const float alpha = exp2v(splat(m[row] - mnew))[0];  // 0 on the first block
                    vec sum = l[row] * alpha;
                    for (int c = 0; c < NK; c++) {
                        const vec p = exp2v(load(s + c * W) - mnew);
                        store(s + c * W, p);
                        sum += p;
                    }
                    l[row] = sum;
                    m[row] = mnew;
                    if (alpha != 1.f)
                        for (int c = 0; c < D; c += W) store(ot[row] + c, load(ot[row] + c) * alpha);
                }
                for (int r0 = 0; r0 < padded; r0 += RV) values_tile<D>(st[r0], vbase + j0 * vs.t, vs.t, n, ot[r0]);
            }
            for (int row = 0; row < rows; row++) {
                const int t = t0 + row / R, h = g * R + row % R;
                float* dst = out + b * os.b + h * os.h + t * os.t;
                const float inv = 1.f / hsum(l[row]);
                for (int d = 0; d < D; d++) dst[d] = ot[row][d] * inv;
            }
        }
    }
}

}  // namespace

extern "C" {

// q (B, Hq, T, D), k and v (B, Hkv, L, D), out (B, Hq, T, D): float32, each addressed by its
// own strides in elements (batch, head, token; channels contiguous), out never aliasing q, k, v.
// Query t attends keys 0 .. L - T + t, scaled by 1 / sqrt(D).
int causal_attention(const float* q, const int64_t* q_strides, const float* k, const int64_t* k_strides,
                     const float* v, const int64_t* v_strides, int B, int Hq, int Hkv, int T, int L, int D,
                     float* out, const int64_t* out_strides) {
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_ROWS) return MINILLAMA_E_GQA;
    if (B <= 0 || T <= 0 || L < T) return MINILLAMA_E_SHAPE;
    const Strides qs{q_strides[0], q_strides[1], q_strides[2]}, ks{k_strides[0], k_strides[1], k_strides[2]};
    const Strides vs{v_strides[0], v_strides[1], v_strides[2]}, os{out_strides[0], out_strides[1], out_strides[2]};
    switch (D) {  // the head sizes Llamas use, each its own unrolled kernel
        case 64: causal_attention_impl<64>(q, qs, k, ks, v, vs, B, Hq, Hkv, T, L, out, os); break;
        case 80: causal_attention_impl<80>(q, qs, k, ks, v, vs, B, Hq, Hkv, T, L, out, os); break;
        case 96: causal_attention_impl<96>(q, qs, k, ks, v, vs, B, Hq, Hkv, T, L, out, os); break;
        case 128: causal_attention_impl<128>(q, qs, k, ks, v, vs, B, Hq, Hkv, T, L, out, os); break;
        case 256: causal_attention_impl<256>(q, qs, k, ks, v, vs, B, Hq, Hkv, T, L, out, os); break;
        default: return MINILLAMA_E_HEAD_DIM;
    }
    return MINILLAMA_OK;
}

}  // extern "C"

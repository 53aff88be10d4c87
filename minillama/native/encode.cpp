// Cache writes in C++: the new tokens of every layer into storage form, and the tokens that
// leave the residual into packed affine codes, byte for byte what the PyTorch path writes.
//
// prepare_rows   x (model dtype) -> Hadamard rotation (a fast Walsh-Hadamard transform in
//                float32, then rounded to the model dtype, as kv/quantize.py's butterflies
//                are) -> minus the key center -> float16, the dtype residual tokens keep;
// encode_affine  float16 rows -> per group min/max, fp16 scale = (max - min) / (2^b - 1) and
//                fp16 zero = min, codes = round-half-even((x - zero) / scale) clamped, packed
//                as kv/packing.py packs them; groups of G channels of one token (axis 0) or of
//                G tokens of one channel (axis 1, KIVI keys);
// encode_codebook float16 rows -> per group of G channels the index of the nearest of 2^b
//                levels and a scale (fp16, or one byte on a log grid): the group's RMS, then `refine` rounds of the best
//                scale for the chosen levels, <x, l> / <l, l>, with the sums in double
//                (kv/quantize.py: quantize_codebook, _refined_scale).
// The PyTorch path (kv/layered.py: LayeredStore.append with kv/quantize.py, kv/packing.py) is the
// reference; a test holds the two to identical bytes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "hadamard.h"
#include "minillama.h"
#include "rows.h"

// Pack one row of n codes at `bits` bits (kv/packing.py's layouts).
static inline void pack_row(const uint8_t* c, int n, int bits, uint8_t* out) {
    if (bits == 8) {
        std::memcpy(out, c, n);
    } else if (bits == 4) {
        for (int i = 0; i < n / 2; i++) out[i] = c[2 * i] | (c[2 * i + 1] << 4);
    } else if (bits == 2) {
        for (int i = 0; i < n / 4; i++) out[i] = c[4 * i] | (c[4 * i + 1] << 2) | (c[4 * i + 2] << 4) | (c[4 * i + 3] << 6);
    } else {  // 3 bits (and 1, 5, 6, 7): eight codes in a little-endian word of `bits` bytes
        for (int i = 0; i < n / 8; i++) {
            uint64_t w = 0;
            for (int j = 0; j < 8; j++) w |= (uint64_t)c[8 * i + j] << (bits * j);
            for (int b = 0; b < bits; b++) out[bits * i + b] = (w >> (8 * b)) & 0xFF;
        }
    }
}

// The forms a codebook's scale is stored in (kv/quantize.py: stored_fp16, stored_log8): `store`
// rounds a refinement round's scale, `value` is what it stands for.
struct Fp16Scale {  // double -> float -> fp16, the smallest fp16 (2^-24) where that is not > 0
    using T = uint16_t;
    using Div = float;  // x / s in float32, as kv/quantize.py divides by a float32 scale
    static T store(double s) {
        const uint16_t h = float_to_half((float)s);
        return half_to_float(h) > 0.f ? h : (uint16_t)1;
    }
    static float value(T h) { return half_to_float(h); }
};
struct LogScale {  // one byte, the nearest 2^((u - 128) / 16) in log terms (dtypes.h)
    using T = uint8_t;
    using Div = double;  // x / s in float64, as kv/quantize.py divides by stored_log8's float64 scale
    static T store(double s) { return log_scale_code(s); }
    static float value(T u) { return log_scales.t[u]; }
};

// sum a_e b_e in double: each product of float32s is exact there, and the sum is exact but for
// the last bit of a double where the terms span more than its 53 bits, so the order of the
// additions (eight lanes here, torch's own in kv/quantize.py) moves an fp16 scale only at a
// rounding tie that close (none in 22 million random groups, tests/test_cache.py).
static double dot(const float* a, const float* b, int n) {
    double lane[8] = {0.0};
    int e = 0;
    for (; e + 8 <= n; e += 8)
        for (int j = 0; j < 8; j++) lane[j] += (double)a[e + j] * b[e + j];
    double sum = 0.0;
    for (; e < n; e++) sum += (double)a[e] * b[e];
    for (int j = 0; j < 8; j++) sum += lane[j];
    return sum;
}

// n elements of scratch: on the stack where they fit (every row of a decode token's write, whose
// D is at most 512), else on the heap. A decode token codes a few hundred groups, and a heap
// allocation each cost as much as the coding.
template <class T>
struct Scratch {
    T stack[512];
    std::vector<T> heap;
    explicit Scratch(size_t n) : heap(n > 512 ? n : 0) {}
    T* data() { return heap.empty() ? stack : heap.data(); }
};

#ifdef MINILLAMA_AVX512
// nearest_levels' count for a vector of elements at a time, by a branchless binary search: the
// count k of boundaries below v (they ascend, so those below are a prefix) found in log2(L)
// steps, each looking up boundary k + step - 1 by a permute -- the same count the loop makes.
// float32 (fp16 scales) 16 elements a vector, float64 (one-byte scales) 8; L <= 16 (one or two
// registers of boundaries). Returns how many elements it coded (whole vectors).
template <int L>
static int nearest_levels_simd(const float* x, int G, float s, const float* mids, uint8_t* c) {
    alignas(64) float t[16] = {0};
    std::memcpy(t, mids, sizeof(float) * (L - 1));
    const __m512 table = _mm512_load_ps(t), sv = _mm512_set1_ps(s);
    int e = 0;
    for (; e + 16 <= G; e += 16) {
        const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + e), sv);
        __m512i k = _mm512_setzero_si512();
        for (int step = L / 2; step >= 1; step /= 2) {
            const __m512i probe = _mm512_add_epi32(k, _mm512_set1_epi32(step - 1));
            const __mmask16 below = _mm512_cmp_ps_mask(_mm512_permutexvar_ps(probe, table), v, _CMP_LT_OQ);
            k = _mm512_mask_add_epi32(k, below, k, _mm512_set1_epi32(step));
        }
        _mm_storeu_si128((__m128i*)(c + e), _mm512_cvtepi32_epi8(k));
    }
    return e;
}

template <int L>
static int nearest_levels_simd(const float* x, int G, double s, const float* mids, uint8_t* c) {
    alignas(64) double t[16] = {0};
    for (int l = 0; l < L - 1; l++) t[l] = mids[l];
    const __m512d lo = _mm512_load_pd(t), hi = _mm512_load_pd(t + 8), sv = _mm512_set1_pd(s);
    int e = 0;
    for (; e + 8 <= G; e += 8) {
        const __m512d v = _mm512_div_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + e)), sv);
        __m512i k = _mm512_setzero_si512();
        for (int step = L / 2; step >= 1; step /= 2) {
            const __m512i probe = _mm512_add_epi64(k, _mm512_set1_epi64(step - 1));
            const __mmask8 below = _mm512_cmp_pd_mask(_mm512_permutex2var_pd(lo, probe, hi), v, _CMP_LT_OQ);
            k = _mm512_mask_add_epi64(k, below, k, _mm512_set1_epi64(step));
        }
        _mm_storel_epi64((__m128i*)(c + e), _mm512_cvtepi64_epi8(k));
    }
    return e;
}
#endif

// The nearest of L levels (their L - 1 boundaries `mids`, ascending) for each of x[0..G) / s:
// how many boundaries lie below it, as torch.bucketize counts them (counted, not searched: the
// compiler vectorizes it across x; AVX-512 builds search, above, where the levels fit a register).
// The division is in V: float32 for fp16 scales, float64 for one-byte ones, as the reference
// divides (a quotient within one rounding of a boundary otherwise picks the other level).
template <int L, class V>
static void nearest_levels(const float* x, int G, V s, const float* mids, uint8_t* c) {
    int e = 0;
#ifdef MINILLAMA_AVX512
    if constexpr (L <= 16) e = nearest_levels_simd<L>(x, G, s, mids, c);
#endif
    for (; e < G; e++) {
        const V v = (V)x[e] / s;
        int k = 0;
        for (int l = 0; l < L - 1; l++) k += (V)mids[l] < v;
        c[e] = (uint8_t)k;
    }
}

// The scale's refinement both Lloyd-Max encoders share (kv/quantize.py: _refined_scale): from
// `stored`, rounds of pick(s, c) (the n_codes codes nearest x / s), levels(c, l) (the G values
// they stand for) and the best scale for them, <x, l> / <l, l>. A round's scale is a function of
// its codes alone, so once a round picks the codes the round before picked, every later round
// repeats it: stopping there is the same fixed point, the same bytes, in fewer rounds (most
// groups settle in two or three). Returns the stored scale; c holds the codes it picks.
template <class Scale, class Pick, class Levels>
static typename Scale::T refine_scale(const float* x, int G, typename Scale::T stored, int refine, int n_codes,
                                      uint8_t* c, uint8_t* prev, float* l, Pick pick, Levels levels) {
    for (int round = 0; round < refine; round++) {
        pick(Scale::value(stored), c);
        if (round > 0 && std::memcmp(c, prev, n_codes) == 0) return stored;  // settled
        std::memcpy(prev, c, n_codes);
        levels(c, l);
        stored = Scale::store(dot(x, l, G) / std::max(dot(l, l, G), 1e-12));
    }
    pick(Scale::value(stored), c);
    return stored;
}

// One (sequence, head)'s block x (n, D) fp16 -> codebook codes (c, n x D unpacked) and scales
// (n x D/G), packed into codes: encode_codebook's body.
template <int BITS, class Scale>
static void encode_codebook_block(const uint16_t* xb, int n, int D, int G, const float* levels, int refine,
                                  uint8_t* codes, typename Scale::T* scale, uint8_t* c) {
    constexpr int L = 1 << BITS;
    const int W = D * BITS / 8;
    float mids[L - 1];  // the boundaries between neighbouring levels, as torch.bucketize takes them
    for (int l = 0; l + 1 < L; l++) mids[l] = (levels[l + 1] + levels[l]) / 2;
#ifdef MINILLAMA_AVX512
    alignas(64) float book[16] = {0};  // the levels in a register, looked up by a permute
    if constexpr (L <= 16) std::memcpy(book, levels, sizeof(float) * L);
#endif
    Scratch<float> xs(G), ls(G);  // a group's values and its chosen levels
    Scratch<uint8_t> prevs(G);    // the codes of the round before
    float *x = xs.data(), *l = ls.data();
    uint8_t* prev = prevs.data();
    for (int64_t g = 0; g < (int64_t)n * (D / G); g++) {
        const uint16_t* xg = xb + g * G;
        for (int e = 0; e < G; e++) x[e] = half_to_float(xg[e]);
        const typename Scale::T rms = Scale::store(std::sqrt(dot(x, x, G) / G));
        scale[g] = refine_scale<Scale>(
            x, G, rms, refine, G, c + g * G, prev, l,
            [&](float s, uint8_t* cg) {
                nearest_levels<L, typename Scale::Div>(x, G, (typename Scale::Div)s, mids, cg);
            },
            [&](const uint8_t* cg, float* lg) {
                int e = 0;
#ifdef MINILLAMA_AVX512
                if constexpr (L <= 16)
                    for (; e + 16 <= G; e += 16)
                        _mm512_storeu_ps(lg + e, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(cg + e))),
                                                                       _mm512_load_ps(book)));
#endif
                for (; e < G; e++) lg[e] = levels[cg[e]];
            });
    }
    for (int t = 0; t < n; t++) pack_row(&c[(size_t)t * D], D, BITS, codes + (int64_t)t * W);
}

// `scale`: fp16 scales, or one-byte log scales where log_scale is set.
static void encode_codebook_block(const uint16_t* xb, int n, int D, int bits, int G, const float* levels, int refine,
                                  int log_scale, uint8_t* codes, void* scale, uint8_t* c) {
#define ENCODE(BITS)                                                                                                   \
    return log_scale ? encode_codebook_block<BITS, LogScale>(xb, n, D, G, levels, refine, codes, (uint8_t*)scale, c)   \
                     : encode_codebook_block<BITS, Fp16Scale>(xb, n, D, G, levels, refine, codes, (uint16_t*)scale, c)
    switch (bits) {  // 1 and 5-8: the widths of frequency-block keys (kv/freq_blocks.py)
        case 1: ENCODE(1);
        case 2: ENCODE(2);
        case 3: ENCODE(3);
        case 4: ENCODE(4);
        case 5: ENCODE(5);
        case 6: ENCODE(6);
        case 7: ENCODE(7);
        default: ENCODE(8);
    }
#undef ENCODE
}

// Sign-structured vector codes (kv/quantize.py: quantize_vectors with signs, _nearest_signed):
// each `dim` channels of x / s become one byte k = p + P s, the pattern p (of P, all >= 0,
// `patterns` P x dim) minimizing |p|^2 - 2 <|x / s|, p> in double, sums coordinate by coordinate
// in order (each product of two floats exact), the first p of equal distances, and s's bit c set
// where coordinate c is negative: the reference's code, byte for byte.
static void nearest_vectors(const float* x, int G, float s, int dim, const float* patterns, const double* norms, int P,
                            uint8_t* c) {
    for (int v = 0; v < G / dim; v++) {
        double a[8];
        int sign = 0;
        for (int i = 0; i < dim; i++) {
            const float y = x[v * dim + i] / s;  // float32, as the reference divides
            a[i] = (double)std::fabs(y);
            sign |= (y < 0.f) << i;
        }
        int best = 0;
        double nearest = 0.0;
        for (int p = 0; p < P; p++) {
            double dot = a[0] * patterns[p * dim];
            for (int i = 1; i < dim; i++) dot = dot + a[i] * patterns[p * dim + i];
            const double d = norms[p] - 2.0 * dot;
            if (p == 0 || d < nearest) nearest = d, best = p;
        }
        c[v] = (uint8_t)(best + P * sign);
    }
}

// One (sequence, head)'s block x (n, D) fp16 -> vector codes (n x D/dim bytes) and fp16 scales
// (n x D/G): the RMS, then refine_scale's rounds for the chosen vectors.
static void encode_vector_block(const uint16_t* xb, int n, int D, int G, int dim, const float* patterns, int P,
                                int refine, uint8_t* codes, uint16_t* scale) {
    Scratch<double> norms_(P);
    double* norms = norms_.data();
    for (int p = 0; p < P; p++) {
        double q = (double)patterns[p * dim] * patterns[p * dim];
        for (int i = 1; i < dim; i++) q = q + (double)patterns[p * dim + i] * patterns[p * dim + i];
        norms[p] = q;
    }
    const int V = G / dim;  // codes a group
    Scratch<float> xs(G), ls(G);
    Scratch<uint8_t> prevs(V);
    float *x = xs.data(), *l = ls.data();
    uint8_t* prev = prevs.data();
    for (int64_t g = 0; g < (int64_t)n * (D / G); g++) {
        for (int e = 0; e < G; e++) x[e] = half_to_float(xb[g * G + e]);
        const uint16_t rms = Fp16Scale::store(std::sqrt(dot(x, x, G) / G));
        scale[g] = refine_scale<Fp16Scale>(
            x, G, rms, refine, V, codes + g * V, prev, l,
            [&](float s, uint8_t* cg) { nearest_vectors(x, G, s, dim, patterns, norms, P, cg); },
            [&](const uint8_t* cg, float* lg) {  // pattern cg % P, coordinate i negated where bit i of cg / P is set
                for (int v = 0; v < V; v++)
                    for (int i = 0; i < dim; i++)
                        lg[v * dim + i] = patterns[(cg[v] % P) * dim + i] * ((cg[v] / P) >> i & 1 ? -1.f : 1.f);
            });
    }
}

// Whether encode_vector_block codes this: one byte a vector (bits x dim = 8), P = 2^8 / 2^dim
// patterns, whole vectors in a group and whole groups in a row.
static bool vector_codable(int D, int bits, int G, int dim, int P) {
    return dim >= 1 && dim <= 8 && bits * dim == 8 && P == (256 >> dim) && G >= dim && G % dim == 0 && D % G == 0;
}

// One row x (D, dtype) into storage form: rotated (rotate 1: hadamard.h's blocks; nb > 1: nb
// frequency blocks of D / nb channels; each block of n scaled by 1/sqrt(n)), less the center c
// (D fp16, or null), as fp16 in out; how many outputs are not finite. v: D floats of scratch.
static int prepare_row(const void* x, int dtype, int D, int rotate, int nb, const uint16_t* c, float* v,
                       uint16_t* out) {
    for (int d = 0; d < D; d++) v[d] = load_value(x, d, dtype);
    if (rotate > 1) {  // the channels in frequency-block order (hadamard.h)
        Scratch<float> row(D);
        std::memcpy(row.data(), v, sizeof(float) * D);
        frequency_blocks(row.data(), D, nb, v);
    }
    for (int i = 0, n; rotate && i < D; i += n) {
        n = nb > 1 ? D / nb : hadamard_block(D - i);
        fwht(v + i, n);
        const float norm = (float)(1.0 / std::sqrt((double)n));
        for (int d = i; d < i + n; d++) v[d] = round_to_dtype(v[d] * norm, dtype);
    }
    int bad = 0;
    for (int d = 0; d < D; d++) {
        const float y = c ? v[d] - half_to_float(c[d]) : v[d];
        bad += !std::isfinite(y);
        out[d] = float_to_half(y);
    }
    return bad;
}

// Whether a rotation of D channels in max(rotate, 1) blocks is one prepare_row makes.
static bool rotation_ok(int D, int rotate) {
    const int n = D / std::max(rotate, 1);
    return rotate >= 0 && !(rotate > 1 && (D % (2 * rotate) || (n & (n - 1))));
}

extern "C" {

// x: rows x D in dtype; center: (rows / rows_per_center) x D fp16 or null; out: rows x D fp16.
// rotate: 0 none, 1 by H over the row, nb > 1 in nb RoPE frequency blocks (kv/quantize.py:
// block_rotate: the channels in frequency_block_order, then each block of n = D / nb by H_n).
// Returns how many outputs are not finite (the caller then takes the PyTorch path, which refuses them).
int64_t prepare_rows(const void* x, int dtype, int64_t rows, int D, int rotate, const uint16_t* center,
                     int64_t rows_per_center, uint16_t* out) {
    if (dtype < 0 || dtype > 2) return -MINILLAMA_E_DTYPE;
    if (!rotation_ok(D, rotate)) return -MINILLAMA_E_HEAD_DIM;
    const int nb = std::max(rotate, 1);
    const size_t row_bytes = (size_t)D * dtype_bytes(dtype);
    int64_t bad = 0;
    // A decode token's few dozen rows take less time than waking a thread: one thread below 256.
#pragma omp parallel reduction(+ : bad) if (rows >= 256)
    {
    std::vector<float> v(D);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* c = center ? center + (r / rows_per_center) * D : nullptr;
        bad += prepare_row((const char*)x + r * row_bytes, dtype, D, rotate, nb, c, v.data(), out + r * D);
    }
    }
    return bad;
}

// One (sequence, head)'s block x (n, D) fp16 -> codes (n, packed width), scale and zero (groups):
// encode_affine's body.
static void encode_block(const uint16_t* xb, int n, int D, int bits, int G, int axis, uint8_t* codes, uint16_t* scale,
                         uint16_t* zero, uint8_t* c) {
    const int qmax = (1 << bits) - 1, W = D * bits / 8;
    const int groups = axis == 0 ? n * (D / G) : (n / G) * D;
    for (int g = 0; g < groups; g++) {
        // The group's elements: G consecutive channels of a token, or G consecutive tokens of a channel.
        const int64_t first = axis == 0 ? (int64_t)g * G : (int64_t)(g / D) * G * D + g % D;
        const int64_t step = axis == 0 ? 1 : D;
        float lo = INFINITY, hi = -INFINITY;
        for (int e = 0; e < G; e++) {
            const float v = half_to_float(xb[first + e * step]);
            lo = std::min(lo, v), hi = std::max(hi, v);
        }
        const uint16_t s16 = float_to_half((hi - lo) / qmax), z16 = float_to_half(lo);
        float s = half_to_float(s16);
        const float z = half_to_float(z16);
        if (!(s > 0.f)) s = 1.f;  // a constant group: every code is 0
        for (int e = 0; e < G; e++) {
            const float q = std::nearbyint((half_to_float(xb[first + e * step]) - z) / s);
            c[first + e * step] = (uint8_t)std::min(std::max(q, 0.f), (float)qmax);
        }
        scale[g] = s16, zero[g] = z16;
    }
    for (int t = 0; t < n; t++) pack_row(&c[(size_t)t * D], D, bits, codes + (int64_t)t * W);
}

static bool encodable(int n, int D, int bits, int G, int axis) {
    return (bits == 2 || bits == 3 || bits == 4 || bits == 8) && G >= 1 && D % 8 == 0 && (axis != 0 || D % G == 0) &&
           (axis != 1 || n % G == 0);
}

// x: (BH, n, D) fp16. axis 0 (per token, G channels a group): scale, zero (BH, n, D/G);
// axis 1 (per channel, G tokens a group, n a multiple of G): scale, zero (BH, n/G, D).
// codes: (BH, n, packed width) uint8.
int encode_affine(const uint16_t* x, int64_t BH, int n, int D, int bits, int G, int axis, uint8_t* codes,
                  uint16_t* scale, uint16_t* zero) {
    if (bits != 2 && bits != 3 && bits != 4 && bits != 8) return MINILLAMA_E_CODES;
    if (!encodable(n, D, bits, G, axis)) return MINILLAMA_E_SHAPE;
    const int W = D * bits / 8, groups = axis == 0 ? n * (D / G) : (n / G) * D;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < BH; bh++) {
        std::vector<uint8_t> c((size_t)n * D);
        encode_block(x + bh * n * D, n, D, bits, G, axis, codes + bh * n * W, scale + bh * groups, zero + bh * groups,
                     c.data());
    }
    return MINILLAMA_OK;
}

// x: (BH, n, D) fp16 -> codes (BH, n, packed width), scale (BH, n, D/G): fp16, or one byte each
// with log_scale; levels: the 2^bits ascending levels (kv/quantize.py: gaussian_codebook).
int encode_codebook(const uint16_t* x, int64_t BH, int n, int D, int bits, int G, const float* levels, int refine,
                    int log_scale, uint8_t* codes, void* scale) {
    if (bits < 1 || bits > 8) return MINILLAMA_E_CODES;
    if (G < 1 || D % 8 || D % G || refine < 0) return MINILLAMA_E_SHAPE;
    const int W = D * bits / 8;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < BH; bh++) {
        std::vector<uint8_t> c((size_t)n * D);
        const int64_t first = bh * (int64_t)n * (D / G);  // the head's first scale
        void* at = log_scale ? (void*)((uint8_t*)scale + first) : (void*)((uint16_t*)scale + first);
        encode_codebook_block(x + bh * n * D, n, D, bits, G, levels, refine, log_scale, codes + bh * n * W, at, c.data());
    }
    return MINILLAMA_OK;
}

// x (BH, n, D) fp16 -> sign-structured vector codes (BH, n, D / dim) bytes and fp16 scales
// (BH, n, D / G): kv/quantize.py's quantize_vectors with signs, byte for byte.
int encode_vectors(const uint16_t* x, int64_t BH, int n, int D, int bits, int G, int dim, const float* patterns, int P,
                   int refine, uint8_t* codes, uint16_t* scale) {
    if (!vector_codable(D, bits, G, dim, P)) return MINILLAMA_E_CODES;
    if (refine < 0) return MINILLAMA_E_SHAPE;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < BH; bh++)
        encode_vector_block(x + bh * n * D, n, D, G, dim, patterns, P, refine, codes + bh * n * (D / dim),
                            scale + bh * (int64_t)n * (D / G));
    return MINILLAMA_OK;
}

// One decode token into a group's rings (kv/layered.py: LayeredStore.append, one token): per
// layer and (sequence, head) row, the storage form (prepare_row) of the new vector; then, when
// a unit leaves the residual, that block (the oldest residual rows, then the new token when it is
// part of it) encoded (encode_affine, encode_codebook where the write has levels, or copied for
// float16 bodies) into the body's next slots;
// then the new row into its sinks or residual slot (after the block is read: it may take the
// slot the block's first row leaves). In three steps, so that a step's writes of every group
// are all made or none: check_write (the fields), fresh_row (the storage form, checked finite),
// commit_row (the stores, which cannot fail).
static int check_write(const TokenWrite& w) {
    if (!w.x || !w.layers || w.L < 1 || w.BH < 1 || w.D < 1 || w.D > 512) return MINILLAMA_E_SHAPE;
    if (w.dtype < 0 || w.dtype > 2) return MINILLAMA_E_DTYPE;
    if (!rotation_ok(w.D, w.rotate)) return MINILLAMA_E_HEAD_DIM;
    if (w.flush < 0 || w.flush > 256 || w.from_res < 0 || w.from_res > w.flush || w.flush - w.from_res > 1)
        return MINILLAMA_E_SHAPE;
    if (w.src_codes.buf && (!w.src_scale.buf || !w.src_levels || w.src_bits < 2 || w.src_bits > 4 || w.D > 512))
        return MINILLAMA_E_CODES;
    if (w.blocks) {  // every head's widths fill the row's bytes; one-byte scales, no zeros
        const int n = w.blocks > 0 ? w.D / w.blocks : 0;
        if (w.blocks < 0 || w.D % w.blocks || n % 8 || w.bits < 1 || w.bits > 8 || w.axis || !w.levels || !w.widths ||
            !w.log_scale || w.refine < 0 || w.heads < 1 || w.BH % w.heads || !w.scale.buf || w.zero.buf)
            return MINILLAMA_E_CODES;
        for (int h = 0; h < w.heads; h++) {
            int bits = 0;
            for (int b = 0; b < w.blocks; b++) {
                if (w.widths[h * w.blocks + b] > 8) return MINILLAMA_E_CODES;
                bits += w.widths[h * w.blocks + b];
            }
            if (bits != w.blocks * w.bits) return MINILLAMA_E_CODES;
        }
        return MINILLAMA_OK;
    }
    if (w.vdim)  // sign-structured vector codes: `levels` holds the patterns, fp16 scales, no zeros
        return vector_codable(w.D, w.bits, w.group, w.vdim, w.patterns) && w.levels && !w.axis && !w.log_scale &&
                       w.refine >= 0 && w.scale.buf && !w.zero.buf
                   ? MINILLAMA_OK
                   : MINILLAMA_E_CODES;
    if (w.bits != 0 && w.flush && !encodable(w.flush, w.D, w.bits, w.group, w.axis)) return MINILLAMA_E_CODES;
    if (w.levels && (w.axis != 0 || w.bits < 2 || w.bits > 4 || w.refine < 0 || !w.scale.buf || w.zero.buf))
        return MINILLAMA_E_CODES;
    return MINILLAMA_OK;
}

// Row r (L * BH order) of a write's new vectors in storage form, fp16 in out: the row of layer
// layers[r / BH] in x, rotated, less its center; how many outputs are not finite. v: D floats.
static int fresh_row(const TokenWrite& w, int64_t r, float* v, uint16_t* out) {
    const int nb = std::max(w.rotate, 1);
    const size_t row_bytes = (size_t)w.D * dtype_bytes(w.dtype);
    const char* x = (const char*)w.x + ((int64_t)w.layers[r / w.BH] * w.BH + r % w.BH) * row_bytes;
    return prepare_row(x, w.dtype, w.D, w.rotate, nb, w.center ? w.center + r * w.D : nullptr, v, out);
}

// Frequency-block keys (kv/freq_blocks.py: encode_blocks): block b of the flush rows (flush, D),
// its n = D / nb channels, coded at the head's width w_b by the Lloyd-Max encoder with one byte
// scale (width 0: no codes, scale 0); each row's blocks' packed codes end to end in codes (flush,
// W), the scales in scale (flush, nb).
static void encode_block_keys(const TokenWrite& w, const uint16_t* heads_widths, const uint16_t* block, uint8_t* codes,
                              uint8_t* scale, std::vector<uint16_t>& xb, std::vector<uint8_t>& cb, uint8_t* unpacked) {
    const int nb = w.blocks, n = w.D / nb, W = w.D * w.bits / 8;
    uint8_t sb[256];
    for (int b = 0, at = 0; b < nb; b++) {
        const int width = heads_widths[b];
        if (width == 0) {
            for (int i = 0; i < w.flush; i++) scale[i * nb + b] = 0;
            continue;
        }
        for (int i = 0; i < w.flush; i++) std::memcpy(&xb[(size_t)i * n], block + (size_t)i * w.D + b * n, (size_t)n * 2);
        encode_codebook_block(xb.data(), w.flush, n, width, n, w.levels + (1 << width) - 2, w.refine, 1, cb.data(), sb, unpacked);
        const int Wb = n * width / 8;
        for (int i = 0; i < w.flush; i++) {
            std::memcpy(codes + (size_t)i * W + at, &cb[(size_t)i * Wb], Wb);
            scale[i * nb + b] = sb[i];
        }
        at += Wb;
    }
}

// A tier's row (codebook codes, one scale) decoded as kv/quantize.py's dequantize_codebook
// decodes it -- level x scale in float32, the levels by rows.h's decode_row as the attention
// kernels read them -- then rounded to float16, as the PyTorch append rounds a tier row that
// moves to the body (kv/layered.py: _through_tier).
static void decode_tier_row(const TokenWrite& w, const char* codes, const char* scale, uint16_t* out) {
    float levels[512];
    decode_row((const uint8_t*)codes, w.src_bits, w.D, w.src_levels, levels);
    const float s = w.src_log_scale ? log_scales.t[*(const uint8_t*)scale] : half_to_float(*(const uint16_t*)scale);
    for (int d = 0; d < w.D; d++) out[d] = float_to_half(levels[d] * s);
}

// One thread's scratch for the rows it commits, grown to the largest write it has made (each
// thread keeps its own between calls: OpenMP's threads persist, so a token allocates nothing).
struct RowScratch {
    std::vector<uint16_t> block, scale, zero, xb;  // xb: block keys' one block of channels
    std::vector<uint8_t> codes, unpacked, cb;      // cb: ... and its packed codes
    void fit(const TokenWrite* writes, int n) {
        size_t most = 1;  // max(flush, 1) x D over the writes: bounds every buffer's elements
        for (int i = 0; i < n; i++) most = std::max(most, (size_t)std::max(writes[i].flush, 1) * writes[i].D);
        if (block.size() >= most) return;
        block.resize(most), scale.resize(most), zero.resize(most), xb.resize(most);
        codes.resize(most), unpacked.resize(most), cb.resize(most);
    }
};

// Row r (L * BH order: one layer's one (sequence, head)) of a write: the block leaving the
// residual (or the tier) coded into the body (or the tier), then the new row into its slot.
// Rows are independent; a group's writes of one row are made in order by one thread.
static void commit_row(const TokenWrite& w, const uint16_t* fresh, int64_t r, RowScratch& s) {
    const int D = w.D;
    const size_t row_bytes = (size_t)D * 2;
    auto at = [](const RingRef& ring, int64_t row, int slot) {  // row (L * BH order) of a ring, slot wrapped
        return (char*)ring.buf + ((size_t)row * ring.slots + (size_t)(slot % ring.slots)) * ring.width;
    };
    const int W = w.bits ? D * w.bits / 8 : 0;
    const int srows = w.axis ? 1 : w.flush, swidth = w.blocks ? w.blocks : w.axis ? D : (w.group > 0 ? D / w.group : 0);
    const size_t scale_bytes = w.levels && w.log_scale ? 1 : 2;
    const uint16_t* row = fresh ? fresh + r * D : nullptr;  // null: the write stores no new row
    uint16_t* block = s.block.data();
    if (w.flush) {
        for (int i = 0; i < w.from_res; i++) {
            if (w.src_codes.buf)
                decode_tier_row(w, at(w.src_codes, r, w.res_first + i), at(w.src_scale, r, w.res_first + i),
                                &block[(size_t)i * D]);
            else
                std::memcpy(&block[(size_t)i * D], at(w.res, r, w.res_first + i), row_bytes);
        }
        if (w.flush > w.from_res) std::memcpy(&block[(size_t)w.from_res * D], row, row_bytes);
        if (w.bits == 0) {  // a float16 body: the rows themselves
            for (int i = 0; i < w.flush; i++) std::memcpy(at(w.codes, r, w.codes_slot + i), &block[(size_t)i * D], row_bytes);
        } else {
            uint8_t* codes = s.codes.data();
            if (w.vdim)
                encode_vector_block(block, w.flush, D, w.group, w.vdim, w.levels, w.patterns, w.refine, codes,
                                    s.scale.data());
            else if (w.blocks)
                encode_block_keys(w, w.widths + (r % w.heads) * w.blocks, block, codes, (uint8_t*)s.scale.data(), s.xb, s.cb,
                                  s.unpacked.data());
            else if (w.levels)
                encode_codebook_block(block, w.flush, D, w.bits, w.group, w.levels, w.refine, w.log_scale, codes,
                                      s.scale.data(), s.unpacked.data());
            else
                encode_block(block, w.flush, D, w.bits, w.group, w.axis, codes, s.scale.data(), s.zero.data(),
                             s.unpacked.data());
            for (int i = 0; i < w.flush; i++) std::memcpy(at(w.codes, r, w.codes_slot + i), &codes[(size_t)i * W], W);
            for (int i = 0; i < srows; i++) {
                std::memcpy(at(w.scale, r, w.scale_slot + i), (const char*)s.scale.data() + (size_t)i * swidth * scale_bytes,
                            (size_t)swidth * scale_bytes);
                if (w.zero.buf) std::memcpy(at(w.zero, r, w.scale_slot + i), &s.zero[(size_t)i * swidth], (size_t)swidth * 2);
            }
        }
    }
    if (w.to.buf) std::memcpy(at(w.to, r, w.to_slot), row, row_bytes);
}

// A decode token into every group of a cache (n writes, one per group of layers that share
// codecs): every write is checked and every new row made and found finite before anything is
// stored, so on an error status nothing has changed and the caller takes the PyTorch path,
// which refuses non-finite values clearly.
int write_tokens(const TokenWrite* writes, int n) {
    if (n < 1) return MINILLAMA_E_SHAPE;
    for (int i = 0; i < n; i++)
        if (const int status = check_write(writes[i])) return status;
    // Each write's new rows in storage form, (L * BH, D), end to end in one buffer this thread keeps.
    static thread_local std::vector<uint16_t> fresh_rows;
    auto stores_row = [](const TokenWrite& w) { return w.to.buf || w.flush > w.from_res; };
    size_t total = 0;
    int64_t most = 0;  // rows of the largest write
    bool codes = false;
    for (int i = 0; i < n; i++) {
        const TokenWrite& w = writes[i];
        most = std::max(most, (int64_t)w.L * w.BH);
        codes = codes || (w.flush > 0 && w.bits > 0);
        if (stores_row(w)) total += (size_t)w.L * w.BH * w.D;
    }
    if (fresh_rows.size() < total) fresh_rows.resize(total);
    Scratch<uint16_t*> fresh_at(n);  // each write's rows in fresh_rows; null: it stores no new row
    uint16_t** fresh = fresh_at.data();
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        const TokenWrite& w = writes[i];
        fresh[i] = stores_row(w) ? fresh_rows.data() + at : nullptr;
        if (stores_row(w)) at += (size_t)w.L * w.BH * w.D;
    }
    // One parallel region (the threads woken once) when a write codes anything; a step that only
    // copies rows stays on this thread. Row r of every write is made by one thread, in the
    // writes' order (a tier's unit leaves a slot before the next row takes it); rows are split
    // between threads, round robin, as the writes' sizes differ. First every new row is made and
    // checked, and only if all are finite is anything stored.
    int64_t bad = 0;
#pragma omp parallel if (codes)
    {
        float v[512];
#pragma omp for schedule(static) reduction(+ : bad)
        for (int64_t r = 0; r < most; r++)
            for (int i = 0; i < n; i++)
                if (fresh[i] && r < (int64_t)writes[i].L * writes[i].BH)
                    bad += fresh_row(writes[i], r, v, fresh[i] + r * writes[i].D);
        if (!bad) {  // the same on every thread: the reduction is complete after the loop's barrier
            static thread_local RowScratch scratch;
            scratch.fit(writes, n);
#pragma omp for schedule(static, 1)
            for (int64_t r = 0; r < most; r++)
                for (int i = 0; i < n; i++)
                    if (r < (int64_t)writes[i].L * writes[i].BH) commit_row(writes[i], fresh[i], r, scratch);
        }
    }
    return bad ? MINILLAMA_E_NONFINITE : MINILLAMA_OK;
}

}  // extern "C"

// Integer-domain decode attention over packed 2-, 3- and 4-bit codes (AVX2 + BMI2; AVX-512 builds too).
//
// The float kernels (portable_attention.cpp) widen every code to a float and multiply in
// float: more instructions per element than an fp16 cache's one conversion, so a cache
// that reads 4x fewer bytes decoded slower. Here the codes stay bytes, as in llama.cpp's
// q8 x q4 dot products:
//
// scores  A row of codes c_t (D bytes, unpacked with one BMI2 pdep per 8 codes) meets an
//         int8 query: q ~= a * q8 with one scale a = max|q| / 127 per block of 8 channels
//         (the channels one 32-bit lane of the dot product sums, see quantize_query_lanes). `vpmaddubsw`
//         multiplies unsigned code bytes by signed query bytes and adds pairs (<= 2*15*127,
//         no saturation), `vpmaddwd` with ones widens to 32 bits; eight tokens' partial
//         sums are reduced together by a transposing `vphaddd` tree, so no horizontal sum
//         per token. Then, per token,
//             per-token codes (one scale s_t and zero z_t per row):  q.k_t = a s_t I_t + z_t sum(q)
//             per-channel codes (KIVI, scale s_gd and zero z_gd per group of tokens): the scale
//             is folded into the query first, qs_d = q_d s_gd ~= a_g qs8_d, once per group, and
//                                                                 q.k_t = a_g I_t + sum_d q_d z_gd.
//         Error: |q - a q8| <= a/2 per channel, so |score error| <= sum_d a(d)/2 * s_t * c_td
//         (per-token codes), sum_d a_g(d)/2 * c_td (per-channel, the scales are inside a_g), and
//         a(d) is at most the head's max|q| / 127.
// values  o_d = sum_t p_t (s_tg c_td + z_tg) = sum_t w_tg c_td + sum_t p_t z_tg with w = p s >= 0.
//         w is quantized to unsigned bytes per block of 32 tokens (w ~= b * w8, b = max w / 255,
//         per query head and channel group); two tokens' codes are interleaved byte by byte so
//         that `vpmaddubsw` of (w8_t, w8_t+1) against (c_td, c_t+1,d) sums over tokens, per
//         channel. Sums stay in 16 bits for 4 token pairs (<= 4 * 2 * 255 * 15 < 32767), then
//         widen to 32 bits, and to float once per block. The bytes are rounded with error
//         diffusion (w8_t = round(w_t / b + d_t-1), d_t the remainder, |d_t| <= 1/2), so the
//         error sum_t b (d_t-1 - d_t) c_td = b (sum_t d_t (c_t+1,d - c_td) - d_last c_last,d) is
//         again at most b/2 per token times the largest code, as with plain rounding, but no
//         longer biased: weights below b/2 are not all lost.
//         The zero term is summed in float.
// Only codes with one scale per row (per-token codes with group == D, or per-token values
// with groups of 32 channels) and KIVI per-channel keys take this path; the exact float
// kernels stay selectable (--backend kernels-exact) and are the reference for tests.

#include "rows.h"

#include <cmath>

#if defined(__AVX2__) && defined(__BMI2__)
#include <immintrin.h>
#define MINILLAMA_INT 1
#else
#define MINILLAMA_INT 0
#endif

extern "C" int int_attention_available() { return MINILLAMA_INT; }

#if MINILLAMA_INT

// D codes of BITS bits (8 codes per BITS bytes, lowest bits first) -> D bytes. BITS is a
// compile-time constant so that each 8-code load is one plain load, not a memcpy call.
template <int BITS>
static inline void unpack_bytes(const uint8_t* row, int D, uint8_t* __restrict__ out) {
    constexpr uint64_t mask = BITS == 4 ? 0x0F0F0F0F0F0F0F0Full : BITS == 3 ? 0x0707070707070707ull : 0x0303030303030303ull;
    if (BITS == 3 && D % 64 == 0) {  // 64 codes = 24 bytes = three 64-bit words; eight 24-bit fields
        for (int c = 0; c < D / 64; c++) {
            uint64_t w[3];
            std::memcpy(w, row + 24 * c, 24);
            const uint64_t f[8] = {w[0], w[0] >> 24, (w[0] >> 48) | (w[1] << 16), w[1] >> 8, w[1] >> 32,
                                   (w[1] >> 56) | (w[2] << 8), w[2] >> 16, w[2] >> 40};
            for (int j = 0; j < 8; j++) {
                const uint64_t x = _pdep_u64(f[j] & 0xFFFFFF, mask);
                std::memcpy(out + 64 * c + 8 * j, &x, 8);
            }
        }
        return;
    }
    for (int j = 0; j < D / 8; j++) {
        uint64_t w = 0;
        std::memcpy(&w, row + j * BITS, BITS);
        const uint64_t x = _pdep_u64(w, mask);  // each code into its own byte
        std::memcpy(out + 8 * j, &x, 8);
    }
}

// x (D floats) -> int8 codes with one scale per 32-bit lane of dot_codes' result: lane m sums
// channels d with (d % 32) / 4 == m, so giving each lane its own a_m = max|x_d| / 127 over its
// channels keeps small channels precise beside large ones (KIVI's folded query mixes channel
// scales that differ by 100x). Returns the 8 lane scales in `a`.
static inline void quantize_query_lanes(const float* x, int D, int8_t* __restrict__ q8, float* __restrict__ a) {
    float m[8] = {0.f};
    for (int d = 0; d < D; d++) m[(d % 32) / 4] = std::max(m[(d % 32) / 4], std::fabs(x[d]));
    float inv[8];
    for (int l = 0; l < 8; l++) a[l] = m[l] > 0.f ? m[l] / 127.f : 1.f, inv[l] = 1.f / a[l];
    for (int d = 0; d < D; d++) q8[d] = (int8_t)std::nearbyint(x[d] * inv[(d % 32) / 4]);
}

// 8 fp16 values -> 8 floats.
static inline __m256 load_half8(const uint16_t* h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h)); }

// sum_d code_d * q8_d over one row of D code bytes: eight 32-bit partial sums.
static inline __m256i dot_codes(const uint8_t* codes, const int8_t* q8, int D) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    for (int d = 0; d < D; d += 32) {
        const __m256i c = _mm256_loadu_si256((const __m256i*)(codes + d));
        const __m256i q = _mm256_loadu_si256((const __m256i*)(q8 + d));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(c, q), ones));
    }
    return acc;
}

// out[r * ls + j] = q_r . k_(i0 + j) for the body of a per-token (kind 1, group == D) or
// per-channel (kind 2) affine codec; q is (R, D) float32, in the codec's space.
template <int BITS, int DC, int RC>
static void score_int_impl(const RowSource& s, int64_t bh, int R_, int D_, const float* q, int i0, int n, float* out,
                           int ls) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;
    const int W = D * BITS / 8;
    alignas(32) int8_t q8[8][128];   // per query head (R <= 8), D <= 128
    alignas(32) uint8_t rows[8][128];
    __m256 part[8][8];                 // [head][token of the chunk]: lane sums times lane scales
    alignas(32) float qa[8][8];        // [head][lane]: the query's int8 scales
    alignas(32) float qs[128];
    float qsum[8], qz[8];  // sum_d q_d (per-token zeros); sum_d q_d z_gd (per-channel zeros)
    if (s.kind == 1)
        for (int r = 0; r < R; r++) {
            quantize_query_lanes(q + r * D, D, q8[r], qa[r]);
            qsum[r] = 0.f;
            for (int d = 0; d < D; d++) qsum[r] += q[r * D + d];
        }
    const int end = i0 + n;
    Cursor at(s.start, i0, s.slots);
    int group_row = -1;
    for (int i = i0; i < end;) {
        int len = std::min(8, end - i);
        if (s.kind == 2) {  // a chunk never straddles two per-channel groups
            const int g = i / s.group;
            len = std::min(len, (g + 1) * s.group - i);
            if (g != group_row) {  // fold this group's scales into the query, its zeros into qz
                group_row = g;
                const int64_t row = (bh * s.sslots + (s.sstart + g) % s.sslots) * D;
                for (int r = 0; r < R; r++) {
                    __m256 z8 = _mm256_setzero_ps();
                    for (int d = 0; d < D; d += 8) {
                        const __m256 qd = _mm256_loadu_ps(q + r * D + d);
                        _mm256_store_ps(qs + d, _mm256_mul_ps(qd, load_half8(s.scale + row + d)));
                        z8 = _mm256_fmadd_ps(qd, load_half8(s.zero + row + d), z8);
                    }
                    qz[r] = hsum(z8);
                    quantize_query_lanes(qs, D, q8[r], qa[r]);
                }
            }
        }
        alignas(32) float sc[8] = {0.f}, zt[8] = {0.f};
        for (int t = 0; t < 8; t++) {
            if (t < len) {
                const int64_t slot = bh * s.slots + at.slot;
                unpack_bytes<BITS>((const uint8_t*)s.data + slot * W, D, rows[t]);
                if (s.kind == 1) sc[t] = half_to_float(s.scale[slot]), zt[t] = half_to_float(s.zero[slot]);
                at.next();
            }
            for (int r = 0; r < R; r++)
                part[r][t] = t < len ? _mm256_mul_ps(_mm256_cvtepi32_ps(dot_codes(rows[t], q8[r], D)), _mm256_load_ps(qa[r]))
                                     : _mm256_setzero_ps();
        }
        for (int r = 0; r < R; r++) {
            alignas(32) float dots[8];
            _mm256_store_ps(dots, hsum8(part[r]));
            float* o = out + (int64_t)r * ls + (i - i0);
            for (int t = 0; t < len; t++) o[t] = s.kind == 1 ? sc[t] * dots[t] + zt[t] * qsum[r] : dots[t] + qz[r];
        }
        i += len;
    }
}

// acc_r += sum_j p[r * lp + j] v_(i0 + j) for the body of a per-token affine codec with groups
// of G channels, G == D or G == 32 (every 32 consecutive channels share a scale).
template <int BITS, int DC, int RC>
static void value_int_impl(const RowSource& s, int64_t bh, int R_, int D_, const float* p, int lp, int i0, int n,
                           float* acc) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;
    const int W = D * BITS / 8, G = s.group, NG = D / G, NV = D / 8;
    constexpr int SB = 32;  // tokens per block of byte weights
    // Pairs of tokens that fit in 16 bits before widening: 2 * 255 * (2^BITS - 1) per pair.
    constexpr int WIDEN = 32767 / (2 * 255 * ((1 << BITS) - 1));
    alignas(32) uint8_t rows[SB][128];
    alignas(32) uint16_t wpairs[8][SB / 2][4];  // [head][pair][group]: (w8_t | w8_t+1 << 8)
    __m256 accf[8][16];                          // [head][block of 8 channels], natural order
    __m256i acc32[16], acc16[8];
    float zsum[8][4] = {{0.f}}, bscale[8][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) accf[r][v] = _mm256_setzero_ps();
    const int end = i0 + n;
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < end; i += SB) {
        const int len = std::min(SB, end - i);
        int64_t slots[SB];
        for (int t = 0; t < len; t++) {
            slots[t] = bh * s.slots + at.slot, at.next();
            unpack_bytes<BITS>((const uint8_t*)s.data + slots[t] * W, D, rows[t]);
        }
        if (len % 2) std::memset(rows[len], 0, D);  // an odd last token pairs with zeros
        // w = p s per head and group, as bytes: w ~= b * w8, b = max w / 255 over the block.
        alignas(32) float wq[8][4][SB];  // [head][group][token]: w / b, in byte steps
        for (int g = 0; g < NG; g++) {
            float sc[SB], zc[SB];
            for (int t = 0; t < SB; t++)
                sc[t] = t < len ? half_to_float(s.scale[slots[t] * NG + g]) : 0.f,
                zc[t] = t < len ? half_to_float(s.zero[slots[t] * NG + g]) : 0.f;
            for (int r = 0; r < R; r++) {
                const float* pr = p + (int64_t)r * lp + (i - i0);
                float w[SB], m = 0.f, z = 0.f;
                for (int t = 0; t < SB; t++) {
                    const float pt = t < len ? pr[t] : 0.f;
                    w[t] = pt * sc[t];
                    m = std::max(m, w[t]);
                    z += pt * zc[t];
                }
                zsum[r][g] += z;
                const float b = m > 0.f ? m / 255.f : 1.f, inv = 1.f / b;
                bscale[r][g] = b;
                for (int t = 0; t < SB; t++) wq[r][g][t] = w[t] * inv;
            }
        }
        // Error diffusion: each token's rounding remainder is carried into the next
        // token's weight, so the block's byte weights sum to its float weights within
        // b/2. Plain rounding sent every weight below b/2 to zero, a mass the long tail
        // of a softmax loses systematically (seen as a ppl shift). The carry is a serial
        // chain per head and group; the chains are stepped together, token by token, so
        // the CPU overlaps them instead of waiting on one.
        {
            float carry[8][4] = {{0.f}};
            alignas(32) uint8_t w8[8][4][SB];
            for (int t = 0; t < SB; t++)
                for (int r = 0; r < R; r++)
                    for (int g = 0; g < NG; g++) {
                        const float x = wq[r][g][t] + carry[r][g];
                        const int qv = std::min(255, std::max(0, (int)std::nearbyint(x)));
                        carry[r][g] = x - (float)qv;
                        w8[r][g][t] = (uint8_t)qv;
                    }
            for (int r = 0; r < R; r++)
                for (int g = 0; g < NG; g++)
                    for (int t = 0; t < SB; t += 2) wpairs[r][t / 2][g] = (uint16_t)(w8[r][g][t] | (w8[r][g][t + 1] << 8));
        }
        for (int r = 0; r < R; r++) {
            for (int v = 0; v < NV; v++) acc32[v] = _mm256_setzero_si256();
            for (int v = 0; v < NV / 2; v++) acc16[v] = _mm256_setzero_si256();
            for (int t = 0, pairs = 0; t < len; t += 2) {
                for (int c = 0; c < D / 32; c++) {  // 32 channels: (token t, token t+1) byte pairs
                    const __m256i x = _mm256_load_si256((const __m256i*)(rows[t] + 32 * c));
                    const __m256i y = _mm256_load_si256((const __m256i*)(rows[t + 1] + 32 * c));
                    const __m256i wv = _mm256_set1_epi16((int16_t)wpairs[r][t / 2][32 * c / G]);
                    acc16[2 * c] = _mm256_add_epi16(acc16[2 * c], _mm256_maddubs_epi16(wv, _mm256_unpacklo_epi8(x, y)));
                    acc16[2 * c + 1] = _mm256_add_epi16(acc16[2 * c + 1], _mm256_maddubs_epi16(wv, _mm256_unpackhi_epi8(x, y)));
                }
                if (++pairs == WIDEN || t + 2 >= len) {  // widen before 16 bits can overflow
                    pairs = 0;
                    for (int v = 0; v < NV / 2; v++) {
                        acc32[2 * v] = _mm256_add_epi32(acc32[2 * v], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc16[v])));
                        acc32[2 * v + 1] = _mm256_add_epi32(acc32[2 * v + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc16[v], 1)));
                        acc16[v] = _mm256_setzero_si256();
                    }
                }
            }
            // acc32[4c + k] holds channels 32c + {0, 16, 8, 24}[k] .. +7 (unpacklo/hi work per 128-bit lane).
            for (int c = 0; c < D / 32; c++) {
                const __m256 b = _mm256_set1_ps(bscale[r][32 * c / G]);
                const int block[4] = {4 * c, 4 * c + 2, 4 * c + 1, 4 * c + 3};
                for (int k = 0; k < 4; k++)
                    accf[r][block[k]] = _mm256_fmadd_ps(b, _mm256_cvtepi32_ps(acc32[4 * c + k]), accf[r][block[k]]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) {
            float* a = acc + (size_t)r * D + 8 * v;
            _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_add_ps(accf[r][v], _mm256_set1_ps(zsum[r][8 * v / G]))));
        }
}

// Code width and the default model's shapes (D 64, 3 query heads per KV head) known at compile time.
#define INT_DISPATCH(fn, ...)                                                         \
    do {                                                                              \
        const int bits = s.bits;                                                      \
        if (D == 64 && R == 3) {                                                      \
            if (bits == 4) fn<4, 64, 3>(__VA_ARGS__);                                 \
            else if (bits == 3) fn<3, 64, 3>(__VA_ARGS__);                            \
            else fn<2, 64, 3>(__VA_ARGS__);                                           \
        } else {                                                                      \
            if (bits == 4) fn<4, 0, 0>(__VA_ARGS__);                                  \
            else if (bits == 3) fn<3, 0, 0>(__VA_ARGS__);                             \
            else fn<2, 0, 0>(__VA_ARGS__);                                            \
        }                                                                             \
    } while (0)

void score_int(SCORE_ARGS) { INT_DISPATCH(score_int_impl, s, bh, R, D, q, i0, n, out, ls); }
void value_int(VALUE_ARGS) { INT_DISPATCH(value_int_impl, s, bh, R, D, p, lp, i0, n, acc); }

#else

// Without AVX2 and BMI2 nothing routes here (int_attention_available() is 0); the symbols
// exist so that the library links the same way on every CPU.
void score_int(SCORE_ARGS) {}
void value_int(VALUE_ARGS) {}

#endif

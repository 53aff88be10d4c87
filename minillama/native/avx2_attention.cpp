// AVX2 block kernels for the rows most caches hold: exact float math, every row read once for
// all R query heads that share it, eight lanes at a time. The AVX2 twin of avx512_attention.cpp
// (AVX-512), for CPUs without AVX-512 (Zen 2/3, most laptops); same idea, half the width:
//
//   decode    a row becomes NV = D / 8 registers of floats without a trip through memory: fp16
//             by vcvtph2ps, bf16 by a shift, codes by a zero-extension of 8 bytes and a shift
//             and mask per field, then vcvtdq2ps, or a lookup (vpermps; two and a blend for 16
//             levels) for codebook codes. The codes are not interleaved back into channel
//             order: 4-bit codes come out as (even, odd) channels of each 16, 2-bit codes as
//             channels 4j + k of each 32 (the "decode order", channel_of below); 3- and 8-bit
//             codes are in channel order. The query is permuted once into the same order (q.k
//             is a sum) and values are summed in decode order and put back once per block.
//   scores    per token and query head NV fused multiply-adds leave one register of 8 partial
//             sums; eight tokens' registers are reduced together by a transposing tree
//             (hsum8: 21 one-micro-op instructions for 8 dot products). Per-token scales and zeros are
//             applied after the sum, eight tokens at a time, q.k_t = s_t (q . c_t) + z_t sum(q),
//             when one scale covers the row; narrower groups scale the row in registers first
//             (each register's lanes lie in one group: groups are multiples of its span).
//             KIVI's per-channel scales are folded into the query once per group of tokens:
//             q.k_t = (q s_g) . c_t + q . z_g.
//   values    eight decoded rows form a tile in L1; each query head's output registers take
//             w_t x row_t from it, w_t = p_t s_t when one scale covers the row (its zero adds
//             z_t sum(p) once).
//
// Everything else -- keys before RoPE, calibrated codecs, trits, per-channel values, other head
// sizes -- returns false and the generic kernels (portable_attention.cpp) run. The specification
// is model/attention.py; tests/test_attention_routes.py holds every route to it.

#include "rows.h"

#include <cmath>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__))
#include <immintrin.h>

namespace {

constexpr int PREFETCH = 48;  // rows ahead: 6 KB of fp16 rows at head_dim 64

// The channel that decode position `pos` holds for rows of this order (0: natural order).
inline int channel_of(int order, int pos) {
    const int k = pos / 8, j = pos % 8;
    if (order == 4) return 16 * (k / 2) + 2 * j + (k % 2);
    if (order == 2) return 32 * (k / 4) + 4 * j + (k % 4);
    return pos;
}

// The code width that permutes channels (4 or 2), or 0 for rows decoded in channel order.
inline int order_of(const RowSource& s) { return s.kind == ROW_FLOAT ? 0 : (s.bits == 4 || s.bits == 2 ? s.bits : 0); }

// How many consecutive channels one decode register's lanes come from.
inline int span_of(int order) { return order == 4 ? 16 : order == 2 ? 32 : 8; }

inline int row_bytes_of(const RowSource& s, int D) { return s.kind == ROW_FLOAT ? D * (s.bits == 0 ? 4 : 2) : D * s.bits / 8; }

// Whether these kernels read rows of this kind: float rows, or 2/3/4/8-bit codes per token
// (affine or codebook, groups a multiple of a register's span) or per channel (keys only).
inline bool fast_kind(const RowSource& s, int D, bool values) {
    if ((D != 64 && D != 128) || s.cos || s.center) return false;
    if (s.kind == ROW_FLOAT) return s.bits >= 0 && s.bits <= 2;
    if (!(s.bits == 2 || s.bits == 3 || s.bits == 4 || s.bits == 8)) return false;
    if (s.kind == ROW_TOKEN)
        return s.group > 0 && D % s.group == 0 && s.group % span_of(order_of(s)) == 0 && (!s.codebook || s.bits <= 4);
    return s.kind == ROW_CHANNEL && !values && s.group > 0 && !s.codebook;
}

// Ask now for the eight rows PREFETCH slots after this chunk's first, so that they arrive while
// this chunk is computed on (one call per chunk: per row, the address arithmetic cost more than
// the prefetches on short code rows). Near the ring's end the hardware prefetcher has it.
inline void prefetch_chunk(const RowSource& s, int64_t bh, int slot, int row_bytes) {
    const int first = slot + PREFETCH;
    if (first + 8 > s.slots) return;
    const char* p = (const char*)s.data + (bh * s.slots + first) * (int64_t)row_bytes;
    for (int b = 0; b < 8 * row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// A codebook of up to 16 levels in two registers (levels 0-7, 8-15).
struct Levels {
    __m256 lo, hi;
    bool book, wide;
    Levels(const float* codebook, int bits) : lo(_mm256_setzero_ps()), hi(_mm256_setzero_ps()), book(codebook), wide(bits > 3) {
        if (!codebook) return;
        alignas(32) float t[16] = {0.f};
        std::memcpy(t, codebook, sizeof(float) << bits);
        lo = _mm256_load_ps(t), hi = _mm256_load_ps(t + 8);
    }
    // codes (0 .. 2^bits - 1 per lane) -> floats: the codes themselves, or their levels
    inline __m256 operator()(__m256i c) const {
        if (!book) return _mm256_cvtepi32_ps(c);
        const __m256 a = _mm256_permutevar8x32_ps(lo, c);
        if (!wide) return a;  // up to 8 levels: one lookup
        return _mm256_blendv_ps(a, _mm256_permutevar8x32_ps(hi, c), _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
    }
};

inline __m256i bytes8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

// The row formats these kernels decode, each its own instantiation so that the decode of a
// row compiles to straight-line code and the row stays in registers.
enum Format { F32, F16, BF16, CODE2, CODE3, CODE4, CODE8 };

inline int format_of(const RowSource& s) {
    if (s.kind == ROW_FLOAT) return s.bits == 0 ? F32 : s.bits == 1 ? F16 : BF16;
    return s.bits == 2 ? CODE2 : s.bits == 3 ? CODE3 : s.bits == 4 ? CODE4 : CODE8;
}

// One stored row (slot) of a head as NV registers in decode order: float values, or codes
// (levels for codebooks), not yet scaled.
template <int FMT, int NV>
inline void decode(const RowSource& s, int64_t slot, const Levels& levels, __m256* v) {
    constexpr int D = 8 * NV;
    if (FMT == F32) {
        const float* x = (const float*)s.data + slot * D;
        for (int k = 0; k < NV; k++) v[k] = _mm256_loadu_ps(x + 8 * k);
    } else if (FMT == F16) {
        const uint16_t* x = (const uint16_t*)s.data + slot * D;
        for (int k = 0; k < NV; k++) v[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x + 8 * k)));
    } else if (FMT == BF16) {
        const uint16_t* x = (const uint16_t*)s.data + slot * D;
        for (int k = 0; k < NV; k++)
            v[k] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(x + 8 * k))), 16));
    } else if (FMT == CODE4) {  // byte j: channel 2j in the low nibble, 2j + 1 in the high one
        const uint8_t* row = (const uint8_t*)s.data + slot * (D / 2);
        for (int m = 0; m < NV / 2; m++) {
            const __m256i b = bytes8(row + 8 * m);
            v[2 * m] = levels(_mm256_and_si256(b, _mm256_set1_epi32(15)));
            v[2 * m + 1] = levels(_mm256_srli_epi32(b, 4));
        }
    } else if (FMT == CODE2) {  // byte j: channels 4j .. 4j + 3, two bits each from the lowest
        const uint8_t* row = (const uint8_t*)s.data + slot * (D / 4);
        const __m256i m2 = _mm256_set1_epi32(3);
        for (int m = 0; m < NV / 4; m++) {
            const __m256i b = bytes8(row + 8 * m);
            v[4 * m] = levels(_mm256_and_si256(b, m2));
            v[4 * m + 1] = levels(_mm256_and_si256(_mm256_srli_epi32(b, 2), m2));
            v[4 * m + 2] = levels(_mm256_and_si256(_mm256_srli_epi32(b, 4), m2));
            v[4 * m + 3] = levels(_mm256_srli_epi32(b, 6));
        }
    } else if (FMT == CODE8) {
        const uint8_t* row = (const uint8_t*)s.data + slot * D;
        for (int k = 0; k < NV; k++) v[k] = levels(bytes8(row + 8 * k));
    } else {  // 3-bit: codes 8k .. 8k + 7 are the 24-bit word at byte 3k, lowest bits first
        const uint8_t* row = (const uint8_t*)s.data + slot * (3 * D / 8);
        const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), m3 = _mm256_set1_epi32(7);
        for (int k = 0; k < NV; k++) {
            uint32_t w;  // four bytes from 3k; the last word is read from 3k - 1 so as not to pass the row's end
            if (k + 1 < NV) {
                std::memcpy(&w, row + 3 * k, 4);
            } else {
                std::memcpy(&w, row + 3 * k - 1, 4);
                w >>= 8;
            }
            v[k] = levels(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts), m3));
        }
    }
}

// A chunk's scores (lane t: token t) into o, the first len of them.
inline void store_scores(__m256 dots, float* o, int len) {
    if (len == 8) {
        _mm256_storeu_ps(o, dots);
    } else {
        alignas(32) float x[8];
        _mm256_store_ps(x, dots);
        std::memcpy(o, x, sizeof(float) * len);
    }
}

// One head's scores of a chunk: the eight tokens' partial-sum registers reduced, then per-token
// scales and zeros applied (tscale non-null: q.k_t = s_t (q . c_t) + z_t sum(q)) or the
// per-channel zeros' constant added (qz non-null: q . z_g), and the chunk's `len` scores stored.
inline void finish_scores(const __m256* part, const float* tscale, const float* tzero, float qsum, const float* qz, float* o,
                          int len) {
    __m256 dots = hsum8(part);
    if (tscale)
        dots = _mm256_fmadd_ps(_mm256_load_ps(tscale), dots, _mm256_mul_ps(_mm256_load_ps(tzero), _mm256_set1_ps(qsum)));
    else if (qz)
        dots = _mm256_add_ps(dots, _mm256_set1_ps(*qz));
    store_scores(dots, o, len);
}

// A chunk's rows in turn: row(t, slot) for the first len of its eight tokens (the cursor stepped
// past each), and every head's partial sums zeroed for the rest.
template <class Row>
inline void chunk_rows(const RowSource& s, int64_t bh, Cursor& at, int len, int R, __m256 (*part)[8], Row row) {
    for (int t = 0; t < 8; t++) {
        if (t >= len) {
            for (int r = 0; r < R; r++) part[r][t] = _mm256_setzero_ps();
            continue;
        }
        const int64_t slot = bh * s.slots + at.slot;
        at.next();
        row(t, slot);
    }
}

// The eight partial sums of q . v over a decoded row (NV registers), in two FMA chains so that
// neither waits on the other's latency.
template <int NV>
inline __m256 dot_row(const __m256* v, const float* q) {
    __m256 a0 = _mm256_mul_ps(v[0], _mm256_load_ps(q)), a1 = _mm256_mul_ps(v[1], _mm256_load_ps(q + 8));
    for (int k = 2; k < NV; k += 2) {
        a0 = _mm256_fmadd_ps(v[k], _mm256_load_ps(q + 8 * k), a0);
        a1 = _mm256_fmadd_ps(v[k + 1], _mm256_load_ps(q + 8 * k + 8), a1);
    }
    return _mm256_add_ps(a0, a1);
}

// Per-token groups narrower than the row: the group of each decode register (its lanes share one).
template <int NV>
struct RegisterGroups {
    int of[NV];
    RegisterGroups(int order, int group) {
        for (int k = 0; k < NV; k++) of[k] = group > 0 ? channel_of(order, 8 * k) / group : 0;
    }
};

// Scale a decoded row by its groups' scales (fp16 or one-byte) and zeros (NG of them), in registers.
template <int NV>
inline void scale_groups(const RowSource& s, int64_t slot, int NG, const RegisterGroups<NV>& groups, __m256* v) {
    float sc[16], zc[16];
    for (int g = 0; g < NG; g++)
        sc[g] = scale_of(s, slot * NG + g), zc[g] = s.zero ? half_to_float(s.zero[slot * NG + g]) : 0.f;
    for (int k = 0; k < NV; k++)
        v[k] = _mm256_fmadd_ps(v[k], _mm256_set1_ps(sc[groups.of[k]]), _mm256_set1_ps(zc[groups.of[k]]));
}

// The decode-order gather indices of a row of this order: register k takes channels idx[k].
template <int NV>
struct DecodeIndex {
    __m256i idx[NV];
    explicit DecodeIndex(int order) {
        for (int k = 0; k < NV; k++) {
            alignas(32) int t[8];
            for (int j = 0; j < 8; j++) t[j] = channel_of(order, 8 * k + j);
            idx[k] = _mm256_load_si256((const __m256i*)t);
        }
    }
};

// score_fast's per-head state (Prep): the queries in decode order, folded with a group's scales
// for per-channel keys, and what the zeros add.
template <int NV>
struct FastQuery {
    alignas(32) float qd[16][8 * NV];  // [head][decode position]
    alignas(32) float qs[16][8 * NV];  // per-channel keys: qd times this group's scales
    float qsum[16], qz[16];            // sum_d q_d (per-token zeros); q . z_g (per-channel zeros)
};

template <int FMT, int NV>
bool score_fast(const RowSource& s, int64_t bh, int R, const float* q, int i0, int n, float* out, int ls, Prep& prep) {
    constexpr int D = 8 * NV;
    static_assert(sizeof(FastQuery<NV>) <= sizeof(Prep::bytes), "Prep is too small");
    FastQuery<NV>& st = *reinterpret_cast<FastQuery<NV>*>(prep.bytes);
    const int order = order_of(s);
    const DecodeIndex<NV> decode_index(order);
    if (!prep.ready) {
        for (int r = 0; r < R; r++) {
            __m256 sum = _mm256_setzero_ps();
            for (int k = 0; k < NV; k++) _mm256_store_ps(&st.qd[r][8 * k], _mm256_i32gather_ps(q + r * D, decode_index.idx[k], 4));
            for (int k = 0; k < NV; k++) sum = _mm256_add_ps(sum, _mm256_loadu_ps(q + r * D + 8 * k));
            st.qsum[r] = hsum(sum);
        }
        prep.ready = true, prep.group = -1;
    }
    const bool channel = s.kind == ROW_CHANNEL, one_group = s.kind == ROW_TOKEN && s.group == D;
    const int NG = s.kind == ROW_TOKEN ? D / s.group : 0, row_bytes = row_bytes_of(s, D);
    const RegisterGroups<NV> groups(order, s.kind == ROW_TOKEN ? s.group : 0);
    const Levels levels(s.codebook, s.bits);
    alignas(32) __m256 part[16][8];  // [head][token of the chunk]
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n;) {
        int len = std::min(8, i0 + n - i);
        if (channel) {  // a chunk never straddles two groups of tokens
            const int g = i / s.group;
            len = std::min(len, (g + 1) * s.group - i);
            if (g != prep.group) {  // fold this group's scales into the query, its zeros into qz
                prep.group = g;
                const int64_t row = (bh * s.sslots + (s.sstart + g) % s.sslots) * D;
                alignas(32) float sc[D];  // the group's scales, in channel order, then gathered into decode order
                for (int k = 0; k < NV; k++) _mm256_store_ps(sc + 8 * k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s.scale + row + 8 * k))));
                __m256 sd[NV];
                for (int k = 0; k < NV; k++) sd[k] = _mm256_i32gather_ps(sc, decode_index.idx[k], 4);
                for (int r = 0; r < R; r++) {
                    __m256 z = _mm256_setzero_ps();
                    for (int k = 0; k < NV; k++) {
                        _mm256_store_ps(&st.qs[r][8 * k], _mm256_mul_ps(_mm256_load_ps(&st.qd[r][8 * k]), sd[k]));
                        const __m256 zk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s.zero + row + 8 * k)));
                        z = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + 8 * k), zk, z);
                    }
                    st.qz[r] = hsum(z);
                }
            }
        }
        prefetch_chunk(s, bh, at.slot, row_bytes);
        alignas(32) float tscale[8] = {0.f}, tzero[8] = {0.f};
        chunk_rows(s, bh, at, len, R, part, [&](int t, int64_t slot) {
            __m256 v[NV];
            decode<FMT, NV>(s, slot, levels, v);
            if (one_group) {  // applied after the sum
                tscale[t] = scale_of(s, slot);
                tzero[t] = s.zero ? half_to_float(s.zero[slot]) : 0.f;
            } else if (s.kind == ROW_TOKEN) {  // narrower groups: scale the row first
                scale_groups<NV>(s, slot, NG, groups, v);
            }
            for (int r = 0; r < R; r++) part[r][t] = dot_row<NV>(v, channel ? st.qs[r] : st.qd[r]);
        });
        for (int r = 0; r < R; r++)
            finish_scores(part[r], one_group ? tscale : nullptr, tzero, st.qsum[r], channel ? &st.qz[r] : nullptr,
                          out + (int64_t)r * ls + (i - i0), len);
        i += len;
    }
    return true;
}

template <int FMT, int NV>
bool value_fast(const RowSource& s, int64_t bh, int R, const float* p, int lp, int i0, int n, float* acc_out) {
    constexpr int D = 8 * NV, KB = NV < 8 ? NV : 8;  // KB: output registers a head keeps live at once
    const int order = order_of(s);
    const bool one_group = s.kind == ROW_TOKEN && s.group == D;
    const int NG = s.kind == ROW_TOKEN ? D / s.group : 0, row_bytes = row_bytes_of(s, D);
    const RegisterGroups<NV> groups(order, s.kind == ROW_TOKEN ? s.group : 0);
    const Levels levels(s.codebook, s.bits);
    alignas(32) float acc[16][D];  // [head][decode position]
    float zsum[16] = {0.f};        // one_group: sum_t p_t z_t per head
    std::memset(acc, 0, sizeof(float) * R * D);
    alignas(32) __m256 tile[8][NV];
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n; i += 8) {
        const int len = std::min(8, i0 + n - i);
        prefetch_chunk(s, bh, at.slot, row_bytes);
        alignas(32) float tscale[8], tzero[8];
        for (int t = 0; t < len; t++) {
            const int64_t slot = bh * s.slots + at.slot;
            at.next();
            decode<FMT, NV>(s, slot, levels, tile[t]);
            if (one_group) {
                tscale[t] = scale_of(s, slot);
                tzero[t] = s.zero ? half_to_float(s.zero[slot]) : 0.f;
            } else if (s.kind == ROW_TOKEN) {
                scale_groups<NV>(s, slot, NG, groups, tile[t]);
            }
        }
        for (int r = 0; r < R; r++) {
            const float* pr = p + (int64_t)r * lp + (i - i0);
            alignas(32) float w[8];  // the tokens' weights, times their row scales (one group)
            if (len == 8) {  // in registers: a scalar loop here compiled to rep movs, 30+ cycles a call
                const __m256 pv = _mm256_loadu_ps(pr);
                _mm256_store_ps(w, one_group ? _mm256_mul_ps(pv, _mm256_load_ps(tscale)) : pv);
            } else {
                for (int t = 0; t < len; t++) w[t] = one_group ? pr[t] * tscale[t] : pr[t];
            }
            for (int k0 = 0; k0 < NV; k0 += KB) {
                __m256 a[KB];
                for (int k = 0; k < KB; k++) a[k] = _mm256_load_ps(&acc[r][8 * (k0 + k)]);
                for (int t = 0; t < len; t++) {
                    const __m256 wt = _mm256_set1_ps(w[t]);
                    for (int k = 0; k < KB; k++) a[k] = _mm256_fmadd_ps(wt, tile[t][k0 + k], a[k]);
                }
                for (int k = 0; k < KB; k++) _mm256_store_ps(&acc[r][8 * (k0 + k)], a[k]);
            }
            if (one_group)
                for (int t = 0; t < len; t++) zsum[r] += pr[t] * tzero[t];
        }
    }
    for (int r = 0; r < R; r++) {  // back to channel order, into the caller's sums
        float* o = acc_out + (size_t)r * D;
        for (int pos = 0; pos < D; pos++) o[channel_of(order, pos)] += acc[r][pos] + zsum[r];
    }
    return true;
}

// One instantiation per row format and head size.
#define BY_FORMAT(fn, ...)                                                                       \
    do {                                                                                         \
        switch (format_of(s)) {                                                                  \
            case F32: return D == 64 ? fn<F32, 8>(__VA_ARGS__) : fn<F32, 16>(__VA_ARGS__);       \
            case F16: return D == 64 ? fn<F16, 8>(__VA_ARGS__) : fn<F16, 16>(__VA_ARGS__);       \
            case BF16: return D == 64 ? fn<BF16, 8>(__VA_ARGS__) : fn<BF16, 16>(__VA_ARGS__);    \
            case CODE2: return D == 64 ? fn<CODE2, 8>(__VA_ARGS__) : fn<CODE2, 16>(__VA_ARGS__); \
            case CODE3: return D == 64 ? fn<CODE3, 8>(__VA_ARGS__) : fn<CODE3, 16>(__VA_ARGS__); \
            case CODE4: return D == 64 ? fn<CODE4, 8>(__VA_ARGS__) : fn<CODE4, 16>(__VA_ARGS__); \
            default: return D == 64 ? fn<CODE8, 8>(__VA_ARGS__) : fn<CODE8, 16>(__VA_ARGS__);    \
        }                                                                                        \
    } while (0)

// Integer scores of 4-bit keys (KIVI per-channel codes, or per-token codes with one scale per
// row; 3-bit affine codes unpacked to the same bytes by split3), as llama.cpp's q4 x q8 dot
// products: the codes stay bytes. A row of D codes is D / 2
// bytes; its low nibbles are the even channels and its high nibbles the odd ones, so the query
// is rounded to int8 once per head (per group of tokens for KIVI, whose scales are folded in
// first) and laid out the same way, even channels then odd. vpmaddubsw multiplies the unsigned
// codes by the signed query bytes and adds neighbours (at most 2 * 15 * 127 per int16, the two
// halves' sum at most 7620: no saturation), vpmaddwd with ones widens to 32 bits: lane l then
// holds channels 8l .. 8l + 7, and each lane has its own step a_l = max |x| / 127 over those
// eight channels (the folded KIVI query mixes channel scales that differ by 100x). Lanes become
// floats times their steps, and eight tokens' registers are reduced by one transposing tree.
// Error: |q_d - a q8_d| <= a/2, so a score is off by at most sum_d a_l(d) / 2 * c_td times the
// row's scale (per-token) -- the bound tests/test_integer_attention.py holds every integer
// kernel to. 4-bit codebook keys (Lloyd-Max, one scale a row) take the same query but look their
// codes up as int16 levels (levels16, as the VNNI kernel does: off by at most max |L| / 4094)
// and multiply with vpmaddwd (book_query below).
template <int NV>
struct Int4Query {
    alignas(32) int8_t qe[16][4 * NV];  // [head][byte]: the even channels' int8 query, byte j = channel 2j
    alignas(32) int8_t qo[16][4 * NV];  // the odd channels, byte j = channel 2j + 1
    alignas(32) float qa[16][NV];       // [head][lane]: the int8 step of channels 8l .. 8l + 7
    float qsum[16], qz[16];             // sum_d q_d (per-token zeros); q . z_g (per-channel zeros)
    // Codebooks: the levels' low and high bytes (levels16) for vpshufb in both 128-bit lanes, each
    // head's query widened to int16 in the order the looked-up levels come out (book_query), and
    // the steps of those lanes times the level step.
    alignas(32) uint8_t tlo[32], thi[32];
    alignas(32) int16_t qw[16][NV / 8][4][16];  // [head][32-byte load][E0, E1, O0, O1][lane]
    alignas(32) float qwa[16][NV / 8][2][8];    // [head][load][sums of E0 + O0, of E1 + O1][int32 lane]
};

// x (D = 8 NV floats) -> Int4Query's bytes and steps of head r, eight channels per register:
// KIVI queries are rounded again for every group of tokens, so this is vectorized: the maxima
// of eight blocks come out of one transposing tree, and one division gives their eight steps.
template <int NV>
inline void round_query(const float* x, Int4Query<NV>& st, int r) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i dword_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i even_odd = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                                              0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256i q32[NV];
    for (int l0 = 0; l0 < NV; l0 += 8) {  // lane block l: channels 8l .. 8l + 7, one step
        __m256 v[8];
        for (int l = 0; l < 8; l++) v[l] = _mm256_and_ps(_mm256_loadu_ps(x + 8 * (l0 + l)), absmask);
        const __m256 m = hmax8(v), zero = _mm256_cmp_ps(m, _mm256_setzero_ps(), _CMP_EQ_OQ);  // lane l: block l0 + l's max |x|
        _mm256_storeu_ps(st.qa[r] + l0, _mm256_blendv_ps(_mm256_mul_ps(m, _mm256_set1_ps(1.f / 127.f)), _mm256_set1_ps(1.f), zero));
        alignas(32) float inv[8];
        _mm256_store_ps(inv, _mm256_blendv_ps(_mm256_div_ps(_mm256_set1_ps(127.f), m), _mm256_set1_ps(1.f), zero));
        for (int l = 0; l < 8; l++)  // round to nearest even, |q| <= 127
            q32[l0 + l] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * (l0 + l)), _mm256_set1_ps(inv[l])));
    }
    for (int c = 0; c < NV / 4; c++) {  // 32 channels: int32 -> int8 in channel order, then even | odd
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q32[4 * c], q32[4 * c + 1]),
                                             _mm256_packs_epi32(q32[4 * c + 2], q32[4 * c + 3]));
        const __m256i split = _mm256_permute4x64_epi64(
            _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(w, dword_order), even_odd), 0xD8);
        _mm_store_si128((__m128i*)(st.qe[r] + 16 * c), _mm256_castsi256_si128(split));      // channels 32c + 0, 2, .. 30
        _mm_store_si128((__m128i*)(st.qo[r] + 16 * c), _mm256_extracti128_si256(split, 1));  // 32c + 1, 3, .. 31
    }
}

// A codebook row's 32-byte load b (channels 64b .. 64b + 63) becomes four registers of int16
// levels: the low nibbles (even channels) looked up in both byte tables and interleaved, the
// unpacklo half E0 (channels 2j, j = 0-7 | 16-23 of the load's bytes) and the unpackhi half E1
// (j = 8-15 | 24-31), then O0, O1 for the high nibbles (2j + 1). vpmaddwd of E0 and of O0 with
// the query in the same order, added, leaves int32 lane i = channels 4i .. 4i + 3 of the lane's
// 32: two lanes per 8-channel block of one query step. Per head: the query and those steps.
template <int NV>
inline void book_query(Int4Query<NV>& st, int r, float level_step) {
    for (int b = 0; b < NV / 8; b++) {
        for (int k = 0; k < 8; k++)
            for (int half = 0; half < 2; half++) {  // lane 8 half + k of E0: byte 16 half + k, of E1: byte 16 half + 8 + k
                const int j = 32 * b + 16 * half + k;
                st.qw[r][b][0][8 * half + k] = st.qe[r][j], st.qw[r][b][1][8 * half + k] = st.qe[r][j + 8];
                st.qw[r][b][2][8 * half + k] = st.qo[r][j], st.qw[r][b][3][8 * half + k] = st.qo[r][j + 8];
            }
        for (int i = 0; i < 8; i++) {  // int32 lane i: channels 64b + 32 (i / 4) + 4 (i % 4) (+ 16 for E1 + O1)
            const int block = 8 * b + 4 * (i / 4) + (i % 4) / 2;
            st.qwa[r][b][0][i] = st.qa[r][block] * level_step, st.qwa[r][b][1][i] = st.qa[r][block + 2] * level_step;
        }
    }
}

// 3-bit affine rows become the same even / odd code bytes as a 4-bit row's nibbles (rows.h's
// Codes3: result 0 byte i of lane h is channel 32h + 2i, result 1 channel 32h + 2i + 1), so they
// score with the same loop and contract.
inline void split3(const uint8_t* src, __m256i& even, __m256i& odd) {
    static const Codes3 codes3([](int k, int h, int j) { return 32 * h + 16 * (k % 2) + 2 * j + k / 2; });
    __m256i b[2];
    codes3(src, b);
    even = b[0], odd = b[1];
}

// Chunk b of a row's codes as bytes: even channels (2i of the chunk's lane) and odd ones.
template <bool THREE>
inline void codes_of(const uint8_t* row, int b, __m256i nib, __m256i& even, __m256i& odd) {
    if (THREE) return split3(row + 24 * b, even, odd);
    const __m256i x = _mm256_loadu_si256((const __m256i*)(row + 32 * b));
    even = _mm256_and_si256(x, nib), odd = _mm256_and_si256(_mm256_srli_epi16(x, 4), nib);
}

template <int NV, bool BOOK, bool THREE>  // THREE: 3-bit affine rows (split3), else 4-bit
bool score_int4(const RowSource& s, int64_t bh, int R, const float* q, int i0, int n, float* out, int ls, Prep& prep) {
    constexpr int D = 8 * NV, NB = D / 64, W = THREE ? 3 * D / 8 : D / 2;  // NB: 64-channel chunks per row; W: row bytes
    static_assert(sizeof(Int4Query<NV>) <= sizeof(Prep::bytes), "Prep is too small");
    Int4Query<NV>& st = *reinterpret_cast<Int4Query<NV>*>(prep.bytes);
    const bool channel = s.kind == ROW_CHANNEL;  // BOOK (s.codebook) is a template argument: the affine loop has no lookups
    if (!prep.ready) {
        float level_step = 1.f;
        if (BOOK) {
            int16_t l16[16];
            level_step = levels16(s.codebook, 16, l16);
            for (int c = 0; c < 32; c++)
                st.tlo[c] = (uint8_t)(l16[c % 16] & 0xFF), st.thi[c] = (uint8_t)((uint16_t)l16[c % 16] >> 8);
        }
        if (!channel)
            for (int r = 0; r < R; r++) {
                round_query<NV>(q + r * D, st, r);
                float sum = 0.f;
                for (int d = 0; d < D; d++) sum += q[r * D + d];
                st.qsum[r] = sum;
                if (BOOK) book_query<NV>(st, r, level_step);
            }
        prep.ready = true, prep.group = -1;
    }
    const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i tlo = _mm256_load_si256((const __m256i*)st.tlo), thi = _mm256_load_si256((const __m256i*)st.thi);
    alignas(32) __m256 part[16][8];  // [head][token of the chunk]
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n;) {
        int len = std::min(8, i0 + n - i);
        if (channel) {  // a chunk never straddles two groups of tokens
            const int g = i / s.group;
            len = std::min(len, (g + 1) * s.group - i);
            if (g != prep.group) {  // fold this group's scales into the query, its zeros into qz
                prep.group = g;
                const int64_t row = (bh * s.sslots + (s.sstart + g) % s.sslots) * D;
                __m256 sc[NV], zc[NV];  // the group's scales and zeros, once for every head
                for (int k = 0; k < NV; k++) {
                    sc[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s.scale + row + 8 * k)));
                    zc[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s.zero + row + 8 * k)));
                }
                for (int r = 0; r < R; r++) {
                    alignas(32) float x[D];
                    __m256 z = _mm256_setzero_ps();
                    for (int k = 0; k < NV; k++) {
                        const __m256 qk = _mm256_loadu_ps(q + r * D + 8 * k);
                        _mm256_store_ps(x + 8 * k, _mm256_mul_ps(qk, sc[k]));
                        z = _mm256_fmadd_ps(qk, zc[k], z);
                    }
                    round_query<NV>(x, st, r);
                    st.qz[r] = hsum(z);
                }
            }
        }
        prefetch_chunk(s, bh, at.slot, W);
        alignas(32) float tscale[8] = {0.f}, tzero[8] = {0.f};
        chunk_rows(s, bh, at, len, R, part, [&](int t, int64_t slot) {
            const uint8_t* rowp = (const uint8_t*)s.data + slot * W;
            if (BOOK) {  // int16 levels times the int16 query (book_query's order), vpmaddwd
                tscale[t] = scale_of(s, slot);
                __m256i lv[NB][4];
                for (int b = 0; b < NB; b++) {
                    __m256i even, odd;
                    codes_of<THREE>(rowp, b, nib, even, odd);
                    const __m256i el = _mm256_shuffle_epi8(tlo, even), eh = _mm256_shuffle_epi8(thi, even);
                    const __m256i ol = _mm256_shuffle_epi8(tlo, odd), oh = _mm256_shuffle_epi8(thi, odd);
                    lv[b][0] = _mm256_unpacklo_epi8(el, eh), lv[b][1] = _mm256_unpackhi_epi8(el, eh);
                    lv[b][2] = _mm256_unpacklo_epi8(ol, oh), lv[b][3] = _mm256_unpackhi_epi8(ol, oh);
                }
                for (int r = 0; r < R; r++) {
                    __m256 acc = _mm256_setzero_ps();
                    for (int b = 0; b < NB; b++) {
                        const __m256i* w = (const __m256i*)st.qw[r][b];
                        const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(lv[b][0], _mm256_load_si256(w)),
                                                           _mm256_madd_epi16(lv[b][2], _mm256_load_si256(w + 2)));
                        const __m256i c = _mm256_add_epi32(_mm256_madd_epi16(lv[b][1], _mm256_load_si256(w + 1)),
                                                           _mm256_madd_epi16(lv[b][3], _mm256_load_si256(w + 3)));
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_load_ps(st.qwa[r][b][0]), acc);
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_load_ps(st.qwa[r][b][1]), acc);
                    }
                    part[r][t] = acc;
                }
                return;
            }
            __m256i lo[NB], hi[NB];
            for (int b = 0; b < NB; b++) codes_of<THREE>(rowp, b, nib, lo[b], hi[b]);
            if (!channel) tscale[t] = half_to_float(s.scale[slot]), tzero[t] = half_to_float(s.zero[slot]);
            for (int r = 0; r < R; r++) {
                __m256 acc = _mm256_setzero_ps();
                for (int b = 0; b < NB; b++) {
                    const __m256i e = _mm256_maddubs_epi16(lo[b], _mm256_load_si256((const __m256i*)(st.qe[r] + 32 * b)));
                    const __m256i o = _mm256_maddubs_epi16(hi[b], _mm256_load_si256((const __m256i*)(st.qo[r] + 32 * b)));
                    const __m256i lanes = _mm256_madd_epi16(_mm256_add_epi16(e, o), ones);  // lane l: channels 64b + 8l ..
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_load_ps(st.qa[r] + 8 * b), acc);
                }
                part[r][t] = acc;
            }
        });
        for (int r = 0; r < R; r++)
            finish_scores(part[r], channel ? nullptr : tscale, tzero, st.qsum[r], channel ? &st.qz[r] : nullptr,
                          out + (int64_t)r * ls + (i - i0), len);
        i += len;
    }
    return true;
}

// Integer scores of 2-bit codebook keys (Lloyd-Max, one scale a row): the codes become byte
// levels and meet an int8 query in vpmaddubsw, as score_int4's nibbles do. A row's 16 bytes per
// 64 channels are split by shifts into four registers, register k holding channel 4j + k in byte
// j (the packing's own order: nothing is interleaved back), two tokens a register (one per
// 128-bit half). One vpshufb per register turns codes into the book's levels as small integers
// (rows.h: levels8, K in 4..16; the Gaussian book's 0.4528 and 1.5104 are 3 and 10 steps of
// 0.15104 within 0.1%) plus an offset that makes them unsigned (0, 7, 13, 20); the query, laid
// out in the same order, is rounded to int8 per block of 16 channels (an int32 lane after
// vpmaddwd sums the four registers' bytes 4m .. 4m + 3: channels 16m .. 16m + 15). The offset's
// share, offset * sum_d a q8_d, is taken off once per head. Per pair of tokens and head: four
// vpmaddubsw (at most 2 * 32 * 127 an int16, four of them 32512: no saturation), three 16-bit
// adds, one vpmaddwd, one conversion and one FMA; eight tokens' four registers reduce by three
// vhaddps. Error: |q_d - a q8_d| <= a/2 with a the step of d's block of 16, plus the levels'
// copy's error (tests/test_integer_attention.py holds the kernel to both).
template <int NB>  // 64-channel chunks a row (D = 64 NB)
struct Int2Query {
    alignas(32) int8_t qk[16][NB][4][32];  // [head][chunk][register k][byte]: q8 of channel 64b + 4 (j % 16) + k
    alignas(32) float qa[16][NB][8];       // [head][chunk][lane]: the step of channels 64b + 16 (l % 4) .. + 15, times the level step
    float off[16];                         // offset * level step * sum_d a q8_d: the offset's share of a score
    alignas(32) uint8_t table[32];         // code -> level + offset, in both 128-bit halves
};

// A 2-bit book's byte levels and the offset that makes them unsigned; null where they do not hold.
inline const SmallLevels* int2_levels(const RowSource& s, int& offset) {
    if (!s.codebook) return nullptr;
    const SmallLevels& bl = small_levels(s.codebook, 4, 4, 16);
    int lo = 0, hi = 0;
    for (int c = 0; c < 4; c++) lo = std::min(lo, (int)bl.l8[c]), hi = std::max(hi, (int)bl.l8[c]);
    offset = -lo;
    // within 0.5% a level, and four vpmaddubsw pairs of (level + offset) x 127 fit int16
    return bl.worst <= 0.005f && hi - lo <= 32 ? &bl : nullptr;
}

template <int NB>
bool score_int2(const RowSource& s, int64_t bh, int R, const float* q, int i0, int n, float* out, int ls, Prep& prep) {
    constexpr int D = 64 * NB, W = D / 4;  // W: row bytes
    static_assert(sizeof(Int2Query<NB>) <= sizeof(Prep::bytes), "Prep is too small");
    Int2Query<NB>& st = *reinterpret_cast<Int2Query<NB>*>(prep.bytes);
    if (!prep.ready) {
        int offset = 0;
        const SmallLevels& bl = *int2_levels(s, offset);  // score_int2 below has checked it holds
        for (int c = 0; c < 32; c++) st.table[c] = (uint8_t)(c % 16 < 4 ? bl.l8[c % 16] + offset : 0);
        for (int r = 0; r < R; r++) {
            const float* x = q + r * D;
            float share = 0.f;
            for (int blk = 0; blk < D / 16; blk++) {  // 16 channels, one int8 step
                float m = 0.f;
                for (int d = 16 * blk; d < 16 * blk + 16; d++) m = std::max(m, std::fabs(x[d]));
                const float a = m > 0.f ? m / 127.f : 1.f, inv = m > 0.f ? 127.f / m : 1.f;
                int sum = 0;
                for (int d = 16 * blk; d < 16 * blk + 16; d++) {
                    const int q8 = (int)std::nearbyint(x[d] * inv);  // round to nearest even, |q8| <= 127
                    const int b = d / 64, c = d % 64;
                    st.qk[r][b][c % 4][c / 4] = st.qk[r][b][c % 4][16 + c / 4] = (int8_t)q8;
                    sum += q8;
                }
                const int b = blk / 4, lane = blk % 4;
                st.qa[r][b][lane] = st.qa[r][b][lane + 4] = a * bl.t;
                share += a * (float)sum;
            }
            st.off[r] = (float)offset * bl.t * share;
        }
        prep.ready = true;
    }
    const __m256i three = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    const __m256i table = _mm256_load_si256((const __m256i*)st.table);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the hadd tree's [t0 t2 t4 t6 | t1 t3 t5 t7] -> t0 .. t7
    alignas(32) __m256 acc[16][4];  // [head][pair of tokens]: lanes 0-3 the first token's, 4-7 the second's
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n;) {
        const int len = std::min(8, i0 + n - i);
        prefetch_chunk(s, bh, at.slot, W);
        alignas(32) float tscale[8] = {0.f};
        for (int pair = 0; pair < 4; pair++) {
            for (int r = 0; r < R; r++) acc[r][pair] = _mm256_setzero_ps();
            if (2 * pair >= len) continue;
            const uint8_t* rows[2];
            for (int h = 0; h < 2; h++) {
                const int t = 2 * pair + h;
                if (t < len) {
                    const int64_t slot = bh * s.slots + at.slot;
                    at.next();
                    rows[h] = (const uint8_t*)s.data + slot * W;
                    tscale[t] = scale_of(s, slot);
                } else {
                    rows[h] = rows[0];  // the chunk's last token again: this score is not stored
                }
            }
            for (int b = 0; b < NB; b++) {
                const __m256i x = _mm256_loadu2_m128i((const __m128i*)(rows[1] + 16 * b), (const __m128i*)(rows[0] + 16 * b));
                const __m256i l0 = _mm256_shuffle_epi8(table, _mm256_and_si256(x, three));
                const __m256i l1 = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(x, 2), three));
                const __m256i l2 = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(x, 4), three));
                const __m256i l3 = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(x, 6), three));
                for (int r = 0; r < R; r++) {
                    const __m256i* w = (const __m256i*)st.qk[r][b];
                    const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(l0, _mm256_load_si256(w)),
                                                         _mm256_maddubs_epi16(l1, _mm256_load_si256(w + 1)));
                    const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(l2, _mm256_load_si256(w + 2)),
                                                         _mm256_maddubs_epi16(l3, _mm256_load_si256(w + 3)));
                    const __m256i lanes = _mm256_madd_epi16(_mm256_add_epi16(s01, s23), ones);  // lane m: channels 64b + 16 (m % 4) ..
                    acc[r][pair] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_load_ps(st.qa[r][b]), acc[r][pair]);
                }
            }
        }
        const __m256 ts = _mm256_load_ps(tscale);
        for (int r = 0; r < R; r++) {
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
            const __m256 dots = _mm256_permutevar8x32_ps(h, order);  // lane t: token t's q . (levels + offset)
            store_scores(_mm256_mul_ps(ts, _mm256_sub_ps(dots, _mm256_set1_ps(st.off[r]))), out + (int64_t)r * ls + (i - i0), len);
        }
        i += len;
    }
    return true;
}

// Scores of keys stored in RoPE frequency blocks (ROW_BLOCKS; kv/freq_blocks.py: lm{b}f{nb}),
// exact float math as score_fast, for the rows the generic loop (row_attention.cpp: decode) reads
// one code at a time. Block b of head h holds n = D / nb channels at its own width w (0-8), the
// blocks' codes one little-endian bit stream, and one byte scale: x = book_w[code] * scale. Eight
// codes of a block are w whole bytes (n is a multiple of 8), so one `pdep` spreads them into eight
// bytes and their levels come from registers: one vpermps for up to 8 levels, two and a blend for
// 16, four and three blends for 32, a gather beyond; a block's scale multiplies its eight-channel
// registers once for every head. The query is already in the blocks' order and rotation (the
// driver's rotate_blocks); a key center adds q . center once per head.
using BlockQuery = BlockTables;  // rows.h, in runs of eight channels

// Eight codes of width W (1-8) from the bytes at p (W of them; 8 read where the row has them) as
// their levels.
template <int W>
inline __m256 block_levels(const uint8_t* p, bool whole, const float* t, const float* book) {
    uint64_t bits = 0;
    if (whole) std::memcpy(&bits, p, 8);
    else  // the row's last bytes: no read past them
        for (int j = 0; j < W; j++) bits |= (uint64_t)p[j] << (8 * j);
    const __m256i c = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)_pdep_u64(bits, 0x0101010101010101ULL * ((1u << W) - 1))));
    if (W > 5) return _mm256_i32gather_ps(book, c, 4);
    const __m256 a = _mm256_permutevar8x32_ps(_mm256_load_ps(t), c);
    if (W <= 3) return a;
    const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(c, 28));
    const __m256 lo = _mm256_blendv_ps(a, _mm256_permutevar8x32_ps(_mm256_load_ps(t + 8), c), bit3);
    if (W == 4) return lo;
    const __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(t + 16), c),
                                       _mm256_permutevar8x32_ps(_mm256_load_ps(t + 24), c), bit3);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c, 27)));
}

// One block of a row (width W, its eight-channel groups g0 .. g1 - 1) as levels times its scale:
// the width is a template argument, so the decode has no branch.
template <int W>
inline void decode_block(const BlockQuery& st, int g0, int g1, const uint8_t* row, int row_bytes, float scale, const float* book,
                         __m256* v) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (int g = g0; g < g1; g++)
        v[g] = _mm256_mul_ps(block_levels<W>(row + st.byte[g], st.byte[g] + 8 <= row_bytes, st.books[W < 6 ? W : 0], book), sc);
}

template <int NV>
bool score_blocks(const RowSource& s, int64_t bh, int R, const float* q, int i0, int n, float* out, int ls, Prep& prep) {
    constexpr int D = 8 * NV;
    static_assert(sizeof(BlockQuery) <= sizeof(Prep::bytes), "Prep is too small");
    BlockQuery& st = *reinterpret_cast<BlockQuery*>(prep.bytes);
    const int nb = s.nlevels, W = D * s.bits / 8, per = NV / nb;  // per: eight-channel groups a block
    if (!prep.ready) {
        st.prepare(s, bh, R, D, q, 8);
        prep.ready = true;
    }
    alignas(32) __m256 part[16][8];  // [head][token of the chunk]
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n;) {
        const int len = std::min(8, i0 + n - i);
        prefetch_chunk(s, bh, at.slot, W);
        chunk_rows(s, bh, at, len, R, part, [&](int t, int64_t slot) {
            const uint8_t* row = (const uint8_t*)s.data + slot * W;
            __m256 v[NV];
            for (int b = 0; b < nb; b++) {
                const int g0 = b * per, g1 = g0 + per, w = s.levels[bh * nb + b];
                const float scale = log_scales.t[s.scale8[slot * nb + b]], *book = s.codebook + (1 << w) - 2;
                if (w == 0)  // a dropped block reads as zeros
                    for (int g = g0; g < g1; g++) v[g] = _mm256_setzero_ps();
                else
                    with_width(w, [&](auto width) { decode_block<decltype(width)::value>(st, g0, g1, row, W, scale, book, v); });
            }
            for (int r = 0; r < R; r++) part[r][t] = dot_row<NV>(v, st.q[r]);
        });
        for (int r = 0; r < R; r++)
            finish_scores(part[r], nullptr, nullptr, 0.f, &st.qc[r], out + (int64_t)r * ls + (i - i0), len);
        i += len;
    }
    return true;
}

}  // namespace

bool score_fast(SCORE_ARGS, Prep& prep) {
    if (R > 16 || !fast_kind(s, D, false)) return false;
    BY_FORMAT(score_fast, s, bh, R, q, i0, n, out, ls, prep);
}

bool fast_reads(const RowSource& s, int D, bool values) { return fast_kind(s, D, values); }

bool int4_keys(const RowSource& s, int D) {
    if ((D != 64 && D != 128) || (s.bits != 4 && s.bits != 3) || s.cos || s.center) return false;
    // 16 levels, one scale a row. 3-bit books stay on the float kernels: split3's four vpmullw a row
    // on top of the lookups' vpmaddwd measured no faster there (docs/archive/speed-history.md).
    if (s.codebook) return s.bits == 4 && s.kind == ROW_TOKEN && s.group == D;
    if (!s.zero) return false;
    if (s.kind == ROW_CHANNEL) return s.group > 0;
    return s.kind == ROW_TOKEN && s.group == D;
}

bool score_int4(SCORE_ARGS, Prep& prep) {
    if (R > 16 || !int4_keys(s, D)) return false;
#define BY_D(BOOK, THREE)                                                                                              \
    return D == 64 ? score_int4<8, BOOK, THREE>(s, bh, R, q, i0, n, out, ls, prep)                                      \
                   : score_int4<16, BOOK, THREE>(s, bh, R, q, i0, n, out, ls, prep)
    if (s.bits == 3) BY_D(false, true);
    if (s.codebook) BY_D(true, false);
    BY_D(false, false);
#undef BY_D
}

bool int2_keys(const RowSource& s, int D) {
    int offset;
    return (D == 64 || D == 128) && s.bits == 2 && s.kind == ROW_TOKEN && s.group == D && !s.zero && !s.cos &&
           !s.center && int2_levels(s, offset) != nullptr;
}

bool score_int2(SCORE_ARGS, Prep& prep) {
    if (R > 16 || !int2_keys(s, D)) return false;
    return D == 64 ? score_int2<1>(s, bh, R, q, i0, n, out, ls, prep) : score_int2<2>(s, bh, R, q, i0, n, out, ls, prep);
}

bool block_keys(const RowSource& s, int D) {
    if ((D != 64 && D != 128) || s.kind != ROW_BLOCKS || s.cos || !s.scale8 || !s.codebook) return false;
    return s.nlevels >= 1 && s.nlevels <= 8 && D % (8 * s.nlevels) == 0;
}

bool score_blocks(SCORE_ARGS, Prep& prep) {
    if (R > 16 || !block_keys(s, D)) return false;
    return D == 64 ? score_blocks<8>(s, bh, R, q, i0, n, out, ls, prep) : score_blocks<16>(s, bh, R, q, i0, n, out, ls, prep);
}

bool value_fast(VALUE_ARGS) {
    if (R > 16 || !fast_kind(s, D, true)) return false;
    BY_FORMAT(value_fast, s, bh, R, p, lp, i0, n, acc);
}

#else

bool int4_keys(const RowSource&, int) { return false; }
bool score_int4(SCORE_ARGS, Prep&) { return false; }
bool int2_keys(const RowSource&, int) { return false; }
bool score_int2(SCORE_ARGS, Prep&) { return false; }
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__))  // else avx512_attention.cpp has them
bool block_keys(const RowSource&, int) { return false; }
bool score_blocks(SCORE_ARGS, Prep&) { return false; }
#endif

#endif

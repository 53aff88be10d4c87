// AVX-512 block kernels for the rows most caches hold: exact float math, every row read once
// for all R query heads that share it, sixteen lanes at a time.
//
// The generic kernels (portable_attention.cpp) decode a row into a float buffer and loop over
// it per query head; the compiler keeps neither the row nor the sums in registers, and each
// dot product ends in its own horizontal sum. Here, for head_dim 64 or 128 (NV = D / 16
// registers per row):
//
//   decode    a row becomes NV registers of floats without a trip through memory: fp16 by
//             vcvtph2ps, bf16 by a shift, codes by a zero-extension and shifts/masks per
//             field, then vcvtdq2ps, or a table lookup (vpermps) for codebook codes. The codes
//             are not interleaved back into channel order: 4-bit codes come out as (even,
//             odd) channels of each 32, 2-bit codes as channels 4j + k of each 64 (the
//             "decode order", channel_of below). Keys do not care -- the query is permuted
//             once into the same order (q.k is a sum) -- and values are summed in decode order
//             and put back in channel order once per block.
//   scores    per token and query head NV fused multiply-adds leave one register of 16 partial
//             sums; sixteen tokens' registers are reduced together by a transposing tree
//             (reduce16: 46 instructions for 16 dot products, instead of 16 horizontal sums).
//             Per-token scales and zeros are applied after the sum, sixteen tokens at a time:
//             q.k_t = s_t (q . c_t) + z_t sum(q); KIVI's per-channel scales are folded into
//             the query once per group of tokens: q.k_t = (q s_g) . c_t + q . z_g.
//   values    sixteen decoded rows (scaled per group when groups are narrower than a row)
//             form a tile in L1; each query head's output registers take w_t x row_t from it,
//             w_t = p_t s_t when one scale covers the row (its zero adds z_t sum(p)).
//
// Everything else -- keys before RoPE, calibrated codecs, trits, per-channel values, other
// head sizes -- returns false and the generic kernels run; CPUs without AVX-512 take the AVX2
// twin of these kernels (avx2_attention.cpp). Integer (VNNI) kernels for the same rows are in
// avx512_vnni_attention.cpp. The specification is model/attention.py; tests/test_fused.py and
// tests/test_attention_routes.py hold this file to it.

#include "rows.h"

#include <cmath>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include "avx512.h"

namespace {

constexpr int PREFETCH = 48;  // rows ahead: 6 KB of fp16 rows at head_dim 64, as avx2_attention.cpp

// The channel that decode position `pos` holds for rows of this code width (0: natural order).
inline int channel_of(int order, int pos) {
    const int k = pos / 16, j = pos % 16;
    if (order == 4) return 32 * (k / 2) + 2 * j + (k % 2);
    if (order == 2) return 64 * (k / 4) + 4 * j + (k % 4);
    return pos;
}

// 0 for float rows and codes widened in channel order, else the code width that permutes them.
inline int order_of(const RowSource& s) { return s.kind == ROW_FLOAT ? 0 : (s.bits == 4 || s.bits == 2 ? s.bits : 0); }

// Ask for the row `ahead` slots after this one now, so that it arrives from DRAM while this one
// is computed on (the hardware prefetcher alone left a single thread at a third of its bandwidth).
inline void prefetch_row(const RowSource& s, int64_t bh, int slot, int ahead, int row_bytes) {
    const int target = slot + ahead < s.slots ? slot + ahead : slot + ahead - s.slots;
    if (target < 0 || target >= s.slots) return;
    const char* p = (const char*)s.data + (bh * s.slots + target) * (int64_t)row_bytes;
    for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

inline int row_bytes_of(const RowSource& s, int D) { return s.kind == ROW_FLOAT ? D * (s.bits == 0 ? 4 : 2) : D * s.bits / 8; }

// Whether the fast kernels read rows of this kind: float rows, or 2/3/4/8-bit codes per token
// (affine or codebook) or per channel (keys only, see below).
inline bool fast_kind(const RowSource& s, int D, bool values) {
    if ((D != 64 && D != 128) || s.cos || s.center) return false;
    if (s.kind == ROW_FLOAT) return s.bits >= 0 && s.bits <= 2;
    const bool bits = s.bits == 2 || s.bits == 4 || s.bits == 8 || (s.bits == 3 && MINILLAMA_VBMI);
    if (s.kind == ROW_TOKEN)
        return bits && s.group > 0 && D % s.group == 0 && D / s.group <= 16 && (!s.codebook || s.bits <= 4);
    return s.kind == ROW_CHANNEL && !values && bits && s.group > 0;
}

inline __m512 widen(__m512i codes, const float* codebook, __m512 levels) {
    return codebook ? _mm512_permutexvar_ps(codes, levels) : _mm512_cvtepi32_ps(codes);
}

// One stored row (slot) of head bh as NV registers in decode order: float values, or codes
// (levels for codebooks), not yet scaled.
template <int NV>
inline void decode(const RowSource& s, int64_t slot, __m512 levels, __m512* v) {
    constexpr int D = 16 * NV;
    if (s.kind == ROW_FLOAT) {
        if (s.bits == 0) {
            const float* x = (const float*)s.data + slot * D;
            for (int k = 0; k < NV; k++) v[k] = _mm512_loadu_ps(x + 16 * k);
        } else if (s.bits == 1) {
            const uint16_t* x = (const uint16_t*)s.data + slot * D;
            for (int k = 0; k < NV; k++) v[k] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(x + 16 * k)));
        } else {
            const uint16_t* x = (const uint16_t*)s.data + slot * D;
            for (int k = 0; k < NV; k++)
                v[k] = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + 16 * k))), 16));
        }
        return;
    }
    const uint8_t* row = (const uint8_t*)s.data + slot * (D * s.bits / 8);
    if (s.bits == 4) {  // byte j: channel 2j in the low nibble, 2j + 1 in the high one
        for (int m = 0; m < NV / 2; m++) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + 16 * m)));
            v[2 * m] = widen(_mm512_and_si512(b, _mm512_set1_epi32(15)), s.codebook, levels);
            v[2 * m + 1] = widen(_mm512_srli_epi32(b, 4), s.codebook, levels);
        }
    } else if (s.bits == 2) {  // byte j: channels 4j .. 4j + 3, two bits each from the lowest
        for (int m = 0; m < NV / 4; m++) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + 16 * m)));
            for (int k = 0; k < 4; k++)
                v[4 * m + k] = widen(_mm512_and_si512(_mm512_srli_epi32(b, 2 * k), _mm512_set1_epi32(3)), s.codebook, levels);
        }
    } else if (s.bits == 8) {
        for (int k = 0; k < NV; k++)
            v[k] = widen(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + 16 * k))), s.codebook, levels);
    } else {
#if MINILLAMA_VBMI
        // 3-bit: 8 codes per 3 bytes, lowest bits first. Lane j of register k takes the 3-byte
        // word of its 8 codes (bytes 3 (2k + j / 8) ..), shifted by 3 (j % 8).
        const __m512i bytes = _mm512_maskz_loadu_epi8((__mmask64)((1ull << (3 * D / 8)) - 1), row);
        const __m512i shifts = _mm512_set_epi32(21, 18, 15, 12, 9, 6, 3, 0, 21, 18, 15, 12, 9, 6, 3, 0);
        for (int k = 0; k < NV; k++) {
            alignas(64) uint8_t idx[64];
            for (int j = 0; j < 16; j++) {
                const int word = 3 * (2 * k + j / 8);
                idx[4 * j] = word, idx[4 * j + 1] = word + 1, idx[4 * j + 2] = word + 2, idx[4 * j + 3] = word + 2;
            }
            const __m512i words = _mm512_permutexvar_epi8(_mm512_load_si512(idx), bytes);
            v[k] = widen(_mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(7)), s.codebook, levels);
        }
#endif
    }
}

// Lane t of the result = the sum of the 16 lanes of v[t] (a transposing tree: 46 instructions).
inline __m512 reduce16(const __m512* v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  // halves: lanes 0-7 partial sums of v[2i], lanes 8-15 of v[2i + 1]
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++)  // quarters q: 4 partial sums of v[4i + q]
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
    const __m512 d = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))));
    // lane 4q + l of d is the sum of v[4l + q]
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), d);
}

inline __m512 load_levels(const float* codebook, int bits) {
    if (!codebook) return _mm512_setzero_ps();
    return _mm512_maskz_loadu_ps((__mmask16)((1u << (1 << bits)) - 1), codebook);
}

// A per-group scale (and zero) register for each decode register: lane j of register k takes
// the group of channel channel_of(order, 16 k + j). `g` holds the row's groups as floats.
template <int NV>
struct GroupLanes {
    __m512i idx[NV];
    GroupLanes(int order, int group) {
        for (int k = 0; k < NV; k++) {
            alignas(64) int t[16];
            for (int j = 0; j < 16; j++) t[j] = channel_of(order, 16 * k + j) / group;
            idx[k] = _mm512_load_si512(t);
        }
    }
};

// score_fast's per-head state (Prep): the queries in decode order, folded with a group's scales
// for per-channel keys, and what the zeros add.
template <int NV>
struct FastQuery {
    alignas(64) float qd[16][16 * NV];  // [head][decode position]
    alignas(64) float qs[16][16 * NV];  // per-channel keys: qd times this group's scales
    float qsum[16], qz[16];             // sum_d q_d (per-token zeros); q . z_g (per-channel zeros)
};

// The decode-order gather indices of a row of this order: register k takes channels idx[k].
template <int NV>
struct DecodeIndex {
    __m512i idx[NV];
    explicit DecodeIndex(int order) {
        for (int k = 0; k < NV; k++) {
            alignas(64) int t[16];
            for (int j = 0; j < 16; j++) t[j] = channel_of(order, 16 * k + j);
            idx[k] = _mm512_load_si512(t);
        }
    }
};

template <int NV>
bool score_fast(const RowSource& s, int64_t bh, int R, const float* q, int i0, int n, float* out, int ls, Prep& prep) {
    constexpr int D = 16 * NV;
    static_assert(sizeof(FastQuery<NV>) <= sizeof(Prep::bytes), "Prep is too small");
    FastQuery<NV>& st = *reinterpret_cast<FastQuery<NV>*>(prep.bytes);
    const int order = order_of(s);
    const DecodeIndex<NV> decode_index(order);
    if (!prep.ready) {
        for (int r = 0; r < R; r++) {
            __m512 sum = _mm512_setzero_ps();
            for (int k = 0; k < NV; k++) {
                _mm512_store_ps(&st.qd[r][16 * k], _mm512_i32gather_ps(decode_index.idx[k], q + r * D, 4));
                sum = _mm512_add_ps(sum, _mm512_loadu_ps(q + r * D + 16 * k));
            }
            st.qsum[r] = _mm512_reduce_add_ps(sum);
        }
        prep.ready = true, prep.group = -1;
    }
    const bool channel = s.kind == ROW_CHANNEL, one_group = s.kind == ROW_TOKEN && s.group == D;
    const int NG = s.kind == ROW_TOKEN ? D / s.group : 0, row_bytes = row_bytes_of(s, D);
    const GroupLanes<NV> lanes(order, s.kind == ROW_TOKEN ? s.group : D);
    const __m512 levels = load_levels(s.codebook, s.bits);
    alignas(64) __m512 part[16][16];  // [head][token of the chunk]
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n;) {
        int len = std::min(16, i0 + n - i);
        if (channel) {  // a chunk never straddles two groups of tokens
            const int g = i / s.group;
            len = std::min(len, (g + 1) * s.group - i);
            if (g != prep.group) {  // fold this group's scales into the query, its zeros into qz
                prep.group = g;
                const int64_t row = (bh * s.sslots + (s.sstart + g) % s.sslots) * D;
                alignas(64) float sc[D];
                __m512 zc[NV];
                for (int k = 0; k < NV; k++) {
                    _mm512_store_ps(sc + 16 * k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s.scale + row + 16 * k))));
                    zc[k] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s.zero + row + 16 * k)));
                }
                __m512 sd[NV];  // the scales in decode order
                for (int k = 0; k < NV; k++) sd[k] = _mm512_i32gather_ps(decode_index.idx[k], sc, 4);
                for (int r = 0; r < R; r++) {
                    __m512 z = _mm512_setzero_ps();
                    for (int k = 0; k < NV; k++) {
                        _mm512_store_ps(&st.qs[r][16 * k], _mm512_mul_ps(_mm512_load_ps(&st.qd[r][16 * k]), sd[k]));
                        z = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + 16 * k), zc[k], z);
                    }
                    st.qz[r] = _mm512_reduce_add_ps(z);
                }
            }
        }
        alignas(64) float tscale[16] = {0.f}, tzero[16] = {0.f};
        for (int t = 0; t < 16; t++) {
            if (t >= len) {
                for (int r = 0; r < R; r++) part[r][t] = _mm512_setzero_ps();
                continue;
            }
            const int64_t slot = bh * s.slots + at.slot;
            prefetch_row(s, bh, at.slot, PREFETCH, row_bytes);
            at.next();
            __m512 v[NV];
            decode<NV>(s, slot, levels, v);
            if (one_group) {  // applied after the sum
                tscale[t] = scale_of(s, slot);
                tzero[t] = s.zero ? half_to_float(s.zero[slot]) : 0.f;
            } else if (s.kind == ROW_TOKEN) {  // narrower groups: scale the row first
                const __m512 sg = scales16(s, slot * NG, (__mmask16)((1u << NG) - 1));
                const __m512 zg = s.zero ? halves16(s.zero + slot * NG, (__mmask16)((1u << NG) - 1)) : _mm512_setzero_ps();
                for (int k = 0; k < NV; k++)
                    v[k] = _mm512_fmadd_ps(v[k], _mm512_permutexvar_ps(lanes.idx[k], sg), _mm512_permutexvar_ps(lanes.idx[k], zg));
            }
            for (int r = 0; r < R; r++) {
                const float* qr = channel ? st.qs[r] : st.qd[r];
                __m512 acc = _mm512_mul_ps(v[0], _mm512_load_ps(qr));
                for (int k = 1; k < NV; k++) acc = _mm512_fmadd_ps(v[k], _mm512_load_ps(qr + 16 * k), acc);
                part[r][t] = acc;
            }
        }
        const __mmask16 keep = (__mmask16)((1u << len) - 1);
        for (int r = 0; r < R; r++) {
            __m512 dots = reduce16(part[r]);
            if (one_group)
                dots = _mm512_fmadd_ps(_mm512_load_ps(tscale), dots, _mm512_mul_ps(_mm512_load_ps(tzero), _mm512_set1_ps(st.qsum[r])));
            else if (channel)
                dots = _mm512_add_ps(dots, _mm512_set1_ps(st.qz[r]));
            _mm512_mask_storeu_ps(out + (int64_t)r * ls + (i - i0), keep, dots);
        }
        i += len;
    }
    return true;
}

template <int NV>
bool value_fast(const RowSource& s, int64_t bh, int R, const float* p, int lp, int i0, int n, float* acc_out) {
    constexpr int D = 16 * NV;
    const int order = order_of(s);
    const bool one_group = s.kind == ROW_TOKEN && s.group == D;
    const int NG = s.kind == ROW_TOKEN ? D / s.group : 0, row_bytes = row_bytes_of(s, D);
    const GroupLanes<NV> lanes(order, s.kind == ROW_TOKEN ? s.group : D);
    const __m512 levels = load_levels(s.codebook, s.bits);
    alignas(64) __m512 acc[16][NV];  // [head][register], decode order
    float zsum[16] = {0.f};          // one_group: sum_t p_t z_t per head
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NV; k++) acc[r][k] = _mm512_setzero_ps();
    alignas(64) __m512 tile[16][NV];
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n; i += 16) {
        const int len = std::min(16, i0 + n - i);
        float tscale[16], tzero[16];
        for (int t = 0; t < len; t++) {
            const int64_t slot = bh * s.slots + at.slot;
            prefetch_row(s, bh, at.slot, PREFETCH, row_bytes);
            at.next();
            decode<NV>(s, slot, levels, tile[t]);
            if (one_group) {
                tscale[t] = scale_of(s, slot);
                tzero[t] = s.zero ? half_to_float(s.zero[slot]) : 0.f;
            } else if (s.kind == ROW_TOKEN) {
                const __m512 sg = scales16(s, slot * NG, (__mmask16)((1u << NG) - 1));
                const __m512 zg = s.zero ? halves16(s.zero + slot * NG, (__mmask16)((1u << NG) - 1)) : _mm512_setzero_ps();
                for (int k = 0; k < NV; k++)
                    tile[t][k] = _mm512_fmadd_ps(tile[t][k], _mm512_permutexvar_ps(lanes.idx[k], sg),
                                                 _mm512_permutexvar_ps(lanes.idx[k], zg));
            }
        }
        for (int r = 0; r < R; r++) {
            const float* pr = p + (int64_t)r * lp + (i - i0);
            __m512 a[NV];
            for (int k = 0; k < NV; k++) a[k] = acc[r][k];
            for (int t = 0; t < len; t++) {
                const __m512 w = _mm512_set1_ps(one_group ? pr[t] * tscale[t] : pr[t]);
                for (int k = 0; k < NV; k++) a[k] = _mm512_fmadd_ps(w, tile[t][k], a[k]);
            }
            for (int k = 0; k < NV; k++) acc[r][k] = a[k];
            if (one_group)
                for (int t = 0; t < len; t++) zsum[r] += pr[t] * tzero[t];
        }
    }
    for (int r = 0; r < R; r++) {  // back to channel order, into the caller's sums
        alignas(64) float x[D];
        for (int k = 0; k < NV; k++) _mm512_store_ps(x + 16 * k, acc[r][k]);
        float* o = acc_out + (size_t)r * D;
        for (int pos = 0; pos < D; pos++) o[channel_of(order, pos)] += x[pos] + zsum[r];
    }
    return true;
}

// Float rows (float32, fp16, bf16: BITS 0, 1, 2) have no scales, zeros or decode order, and
// are the rows an fp16 cache streams at long context, so they get kernels of their own, with the
// query heads in tiles of T known at compile time: a tile's queries (scores) or output sums
// (values) stay in registers for the whole block, where the general kernels above reload them
// for every row. Each row is read from memory once per block; a second tile (R > T) reads it
// again from L1.
template <int NV, int BITS>
inline void load_float_row(const RowSource& s, int64_t slot, __m512* v) {
    constexpr int D = 16 * NV;
    if (BITS == 0) {
        const float* x = (const float*)s.data + slot * D;
        for (int k = 0; k < NV; k++) v[k] = _mm512_loadu_ps(x + 16 * k);
    } else {
        const uint16_t* x = (const uint16_t*)s.data + slot * D;
        for (int k = 0; k < NV; k++) {
            const __m256i h = _mm256_loadu_si256((const __m256i*)(x + 16 * k));
            v[k] = BITS == 1 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
    }
}

// The row at the cursor (its slot of head bh) into v, the one PREFETCH rows ahead asked for, the
// cursor moved on.
template <int NV, int BITS>
inline void next_float_row(const RowSource& s, int64_t bh, Cursor& at, __m512* v) {
    const int64_t slot = bh * s.slots + at.slot;
    prefetch_row(s, bh, at.slot, PREFETCH, 16 * NV * (BITS == 0 ? 4 : 2));
    at.next();
    load_float_row<NV, BITS>(s, slot, v);
}

// Scores of T query heads (q: T rows of D, ls apart in out) over rows [i0, i0 + n).
template <int NV, int BITS, int T>
void score_float_tile(const RowSource& s, int64_t bh, const float* q, int i0, int n, float* out, int ls) {
    constexpr int D = 16 * NV;
    __m512 qr[T][NV];
    for (int r = 0; r < T; r++)
        for (int k = 0; k < NV; k++) qr[r][k] = _mm512_loadu_ps(q + r * D + 16 * k);
    alignas(64) __m512 part[T][16];  // [head][token of the chunk]: 16 partial sums each
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n; i += 16) {
        const int len = std::min(16, i0 + n - i);
        for (int t = 0; t < len; t++) {
            __m512 v[NV];
            next_float_row<NV, BITS>(s, bh, at, v);
            for (int r = 0; r < T; r++) {
                __m512 acc = _mm512_mul_ps(v[0], qr[r][0]);
                for (int k = 1; k < NV; k++) acc = _mm512_fmadd_ps(v[k], qr[r][k], acc);
                part[r][t] = acc;
            }
        }
        for (int t = len; t < 16; t++)
            for (int r = 0; r < T; r++) part[r][t] = _mm512_setzero_ps();
        const __mmask16 keep = (__mmask16)((1u << len) - 1);
        for (int r = 0; r < T; r++) _mm512_mask_storeu_ps(out + (int64_t)r * ls + (i - i0), keep, reduce16(part[r]));
    }
}

// acc (T rows of D) += p (T rows, lp apart) . rows [i0, i0 + n).
template <int NV, int BITS, int T>
void value_float_tile(const RowSource& s, int64_t bh, const float* p, int lp, int i0, int n, float* acc) {
    constexpr int D = 16 * NV;
    __m512 a[T][NV];
    for (int r = 0; r < T; r++)
        for (int k = 0; k < NV; k++) a[r][k] = _mm512_setzero_ps();
    Cursor at(s.start, i0, s.slots);
    for (int t = 0; t < n; t++) {
        __m512 v[NV];
        next_float_row<NV, BITS>(s, bh, at, v);
        for (int r = 0; r < T; r++) {
            const __m512 w = _mm512_set1_ps(p[(int64_t)r * lp + t]);
            for (int k = 0; k < NV; k++) a[r][k] = _mm512_fmadd_ps(w, v[k], a[r][k]);
        }
    }
    for (int r = 0; r < T; r++)
        for (int k = 0; k < NV; k++) {
            float* o = acc + (int64_t)r * D + 16 * k;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), a[r][k]));
        }
}

// The R heads in tiles of at most TMAX (4 at head_dim 64, 2 at 128: T * NV registers of
// queries or sums, leaving room for the row), as even as the count allows (R 5: 2 + 3).
template <int NV, int BITS>
void float_rows(bool values, const RowSource& s, int64_t bh, int R, const float* x, int lx, int i0, int n, float* out, int ls) {
    constexpr int D = 16 * NV, TMAX = NV == 4 ? 4 : 2;
    const int tiles = (R + TMAX - 1) / TMAX;
    for (int j = 0, r0 = 0; j < tiles; j++) {
        const int T = (R - r0) / (tiles - j);
        const float* xr = values ? x + (int64_t)r0 * lx : x + (int64_t)r0 * D;
        float* o = values ? out + (int64_t)r0 * D : out + (int64_t)r0 * ls;
#define MINILLAMA_TILE(N)                                                      \
    case N:                                                                    \
        if (values)                                                            \
            value_float_tile<NV, BITS, N>(s, bh, xr, lx, i0, n, o);            \
        else                                                                   \
            score_float_tile<NV, BITS, N>(s, bh, xr, i0, n, o, ls);            \
        break;
        switch (T) {
            MINILLAMA_TILE(1)
            MINILLAMA_TILE(2)
            MINILLAMA_TILE(3)
            MINILLAMA_TILE(4)
        }
#undef MINILLAMA_TILE
        r0 += T;
    }
}

template <int NV>
void float_rows(bool values, const RowSource& s, int64_t bh, int R, const float* x, int lx, int i0, int n, float* out, int ls) {
    if (s.bits == 0) return float_rows<NV, 0>(values, s, bh, R, x, lx, i0, n, out, ls);
    if (s.bits == 1) return float_rows<NV, 1>(values, s, bh, R, x, lx, i0, n, out, ls);
    float_rows<NV, 2>(values, s, bh, R, x, lx, i0, n, out, ls);
}

#ifdef __BMI2__
// Scores of keys stored in RoPE frequency blocks (ROW_BLOCKS; kv/freq_blocks.py: lm{b}f{nb}), the
// sixteen-lane twin of avx2_attention.cpp's score_blocks. Block b of head h holds D / nb channels
// at its own width w (0-8), the blocks' codes one little-endian bit stream, and one byte scale:
// x = book_w[code] * scale. Sixteen codes of a block are 2w whole bytes, so two `pdep`s spread
// them into sixteen bytes and their levels come from registers: one vpermps for up to 16 levels,
// vpermi2ps for 32, a gather beyond. The query is already in the blocks' order and rotation (the
// driver's rotate_blocks); a key center adds q . center once per head.
struct BlockQuery : BlockTables {  // rows.h, in runs of sixteen channels; and for the whole-row decode:
    // VBMI, rows of 64 or 128 channels and widths of at most 5: each 64 channels' codes at once.
    bool whole_row;
    alignas(64) uint8_t spread[128];  // vpermb: qword j (codes 8j .. 8j + 7) <- the w bytes that hold them, from base[j / 8]
    alignas(64) uint8_t mask[128];    // per code byte: 2^w - 1 of its block
    long long shifts[16];             // vpmultishiftqb: byte i of qword j <- bit offset w i
    int base[2];                      // per 64 channels: the first byte of their codes in the row
    const float* group_book[8];       // per sixteen channels: their block's book in `books` (width 0: zeros)
};

// Sixteen codes of width W (1-8) from the bytes at p (2W of them; W + 8 read where the row has
// them) as their levels.
template <int W>
inline __m512 block_levels(const uint8_t* p, bool whole, const float* t, const float* book) {
    uint64_t lo = 0, hi = 0;
    if (whole) {
        std::memcpy(&lo, p, 8);
        std::memcpy(&hi, p + W, 8);
    } else {  // the row's last bytes: no read past them
        for (int j = 0; j < W; j++) lo |= (uint64_t)p[j] << (8 * j), hi |= (uint64_t)p[W + j] << (8 * j);
    }
    const uint64_t spread = 0x0101010101010101ULL * ((1u << W) - 1);
    const __m512i c = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)_pdep_u64(hi, spread), (long long)_pdep_u64(lo, spread)));
    if (W > 5) return _mm512_i32gather_ps(c, book, 4);
    if (W <= 4) return _mm512_permutexvar_ps(c, _mm512_load_ps(t));
    return _mm512_permutex2var_ps(_mm512_load_ps(t), c, _mm512_load_ps(t + 16));
}

// One block of a row (width W, its sixteen-channel groups g0 .. g1 - 1) as levels times its
// scale: the width is a template argument, so the decode has no branch.
template <int W>
inline void decode_block(const BlockQuery& st, int g0, int g1, const uint8_t* row, int row_bytes, float scale, const float* book,
                         __m512* v) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int g = g0; g < g1; g++)
        v[g] = _mm512_mul_ps(block_levels<W>(row + st.byte[g], st.byte[g] + W + 8 <= row_bytes, st.books[W < 6 ? W : 0], book), sc);
}

#if MINILLAMA_VBMI
// score_blocks for rows of 64 or 128 channels whose widths are at most 5 (every block's book one
// or two registers): each 64 channels' codes, whatever their blocks' widths, come out as one byte
// each in three instructions -- vpermb puts the w bytes holding codes 8j .. 8j + 7 in qword j,
// vpmultishiftqb takes the w bits at offsets 0, w, .., 7w of it into bytes, a mask keeps them
// (the three operands made per head in Prep; at widths <= 5 the 64 channels' codes span at most
// 40 bytes, one register from their first byte) -- then sixteen codes at a time widen to lanes
// and vpermi2ps looks up their block's levels. The chunk walk is written out here and in the
// pdep decode below: one walk taking the decode as a lambda was slower, its row registers
// passed through the stack.
template <int NV>
bool score_block_rows(const RowSource& s, int64_t bh, int R, int i0, int n, float* out, int ls, const BlockQuery& st) {
    constexpr int D = 16 * NV, HALVES = NV / 4;
    const int nb = s.nlevels, W = D * s.bits / 8, per = NV / nb;
    __m512i spread[HALVES], mask[HALVES], shifts[HALVES];
    __mmask64 bytes[HALVES];  // each half's code bytes, from its first, up to the row's end
    int base[HALVES];         // each half's first code byte (the first half's is the row's first)
    for (int h = 0; h < HALVES; h++) {
        spread[h] = _mm512_load_si512(st.spread + 64 * h), mask[h] = _mm512_load_si512(st.mask + 64 * h);
        shifts[h] = _mm512_loadu_si512(st.shifts + 8 * h);
        base[h] = h == 0 ? 0 : st.base[h];
        bytes[h] = W - base[h] >= 64 ? ~0ull : (1ull << (W - base[h])) - 1;
    }
    __m512 lo[NV], hi[NV];  // each sixteen channels' book, as the two tables of vpermi2ps
    for (int g = 0; g < NV; g++) lo[g] = _mm512_load_ps(st.group_book[g]), hi[g] = _mm512_load_ps(st.group_book[g] + 16);
    struct Lanes {  // byte 4 j of idx[g] <- code byte 16 g + j
        uint8_t idx[4][64];
        constexpr Lanes() : idx{} {
            for (int g = 0; g < 4; g++)
                for (int j = 0; j < 16; j++) idx[g][4 * j] = (uint8_t)(16 * g + j);
        }
    };
    alignas(64) static constexpr Lanes lanes{};
    alignas(64) __m512 part[16][16];  // [head][token of the chunk]
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n;) {
        const int len = std::min(16, i0 + n - i);
        for (int t = 0; t < 16; t++) {
            if (t >= len) {
                for (int r = 0; r < R; r++) part[r][t] = _mm512_setzero_ps();
                continue;
            }
            const int64_t slot = bh * s.slots + at.slot;
            prefetch_row(s, bh, at.slot, PREFETCH, W);
            at.next();
            const uint8_t* sc8 = s.scale8 + slot * nb;
            __m512 v[NV];
            for (int h = 0; h < HALVES; h++) {
                const __m512i row = _mm512_maskz_loadu_epi8(bytes[h], (const uint8_t*)s.data + slot * W + base[h]);
                const __m512i codes =
                    _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts[h], _mm512_permutexvar_epi8(spread[h], row)), mask[h]);
                for (int k = 0; k < 4; k++) {  // codes 16 k .. 16 k + 15 of the half to the low bytes of the lanes
                    const int g = 4 * h + k;
                    const __m512i c = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, _mm512_load_si512(lanes.idx[k]), codes);
                    v[g] = _mm512_mul_ps(_mm512_permutex2var_ps(lo[g], c, hi[g]), _mm512_set1_ps(log_scales.t[sc8[g / per]]));
                }
            }
            for (int r = 0; r < R; r++) {
                __m512 acc = _mm512_mul_ps(v[0], _mm512_load_ps(st.q[r]));
                for (int k = 1; k < NV; k++) acc = _mm512_fmadd_ps(v[k], _mm512_load_ps(st.q[r] + 16 * k), acc);
                part[r][t] = acc;
            }
        }
        const __mmask16 keep = (__mmask16)((1u << len) - 1);
        for (int r = 0; r < R; r++)
            _mm512_mask_storeu_ps(out + (int64_t)r * ls + (i - i0), keep, _mm512_add_ps(reduce16(part[r]), _mm512_set1_ps(st.qc[r])));
        i += len;
    }
    return true;
}
#endif

template <int NV>
bool score_blocks(const RowSource& s, int64_t bh, int R, const float* q, int i0, int n, float* out, int ls, Prep& prep) {
    constexpr int D = 16 * NV;
    static_assert(sizeof(BlockQuery) <= sizeof(Prep::bytes), "Prep is too small");
    BlockQuery& st = *reinterpret_cast<BlockQuery*>(prep.bytes);
    const int nb = s.nlevels, W = D * s.bits / 8, per = NV / nb;  // per: sixteen-channel groups a block
    if (!prep.ready) {
        st.prepare(s, bh, R, D, q, 16);
        st.whole_row = MINILLAMA_VBMI && (D == 64 || D == 128);  // each 64 codes, one byte each, fill one register
        block_decode_operands(s.levels + bh * nb, nb, D, st.spread, st.mask, st.shifts, st.base);
        for (int b = 0; b < nb; b++) {
            const int w = s.levels[bh * nb + b];
            st.whole_row = st.whole_row && w <= 5;
            for (int g = b * per; g < (b + 1) * per; g++) st.group_book[g] = st.books[w <= 5 ? w : 0];
        }
        prep.ready = true;
    }
#if MINILLAMA_VBMI
    if constexpr (NV == 4 || NV == 8)
        if (st.whole_row) return score_block_rows<NV>(s, bh, R, i0, n, out, ls, st);
#endif
    alignas(64) __m512 part[16][16];  // [head][token of the chunk]
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n;) {
        const int len = std::min(16, i0 + n - i);
        for (int t = 0; t < 16; t++) {
            if (t >= len) {
                for (int r = 0; r < R; r++) part[r][t] = _mm512_setzero_ps();
                continue;
            }
            const int64_t slot = bh * s.slots + at.slot;
            prefetch_row(s, bh, at.slot, PREFETCH, W);
            at.next();
            const uint8_t* row = (const uint8_t*)s.data + slot * W;
            __m512 v[NV];
            for (int b = 0; b < nb; b++) {
                const int g0 = b * per, g1 = g0 + per, w = s.levels[bh * nb + b];
                const float scale = log_scales.t[s.scale8[slot * nb + b]], *book = s.codebook + (1 << w) - 2;
                if (w == 0)  // a dropped block reads as zeros
                    for (int g = g0; g < g1; g++) v[g] = _mm512_setzero_ps();
                else
                    with_width(w, [&](auto width) { decode_block<decltype(width)::value>(st, g0, g1, row, W, scale, book, v); });
            }
            for (int r = 0; r < R; r++) {
                __m512 acc = _mm512_mul_ps(v[0], _mm512_load_ps(st.q[r]));
                for (int k = 1; k < NV; k++) acc = _mm512_fmadd_ps(v[k], _mm512_load_ps(st.q[r] + 16 * k), acc);
                part[r][t] = acc;
            }
        }
        const __mmask16 keep = (__mmask16)((1u << len) - 1);
        for (int r = 0; r < R; r++)
            _mm512_mask_storeu_ps(out + (int64_t)r * ls + (i - i0), keep, _mm512_add_ps(reduce16(part[r]), _mm512_set1_ps(st.qc[r])));
        i += len;
    }
    return true;
}
#endif

}  // namespace

bool score_fast(SCORE_ARGS, Prep& prep) {
    if (R > 16 || !fast_kind(s, D, false)) return false;
    if (s.kind == ROW_FLOAT) {
        (D == 64 ? float_rows<4> : float_rows<8>)(false, s, bh, R, q, 0, i0, n, out, ls);
        return true;
    }
    return D == 64 ? score_fast<4>(s, bh, R, q, i0, n, out, ls, prep) : score_fast<8>(s, bh, R, q, i0, n, out, ls, prep);
}

bool fast_reads(const RowSource& s, int D, bool values) { return fast_kind(s, D, values); }

bool block_keys(const RowSource& s, int D) {
#ifdef __BMI2__
    if ((D != 64 && D != 128) || s.kind != ROW_BLOCKS || s.cos || !s.scale8 || !s.codebook) return false;
    return s.nlevels >= 1 && s.nlevels <= 8 && D % (16 * s.nlevels) == 0;
#else
    return false;
#endif
}

bool score_blocks(SCORE_ARGS, Prep& prep) {
    if (R > 16 || !block_keys(s, D)) return false;
#ifdef __BMI2__
    return D == 64 ? score_blocks<4>(s, bh, R, q, i0, n, out, ls, prep) : score_blocks<8>(s, bh, R, q, i0, n, out, ls, prep);
#else
    (void)bh, (void)q, (void)i0, (void)n, (void)out, (void)ls, (void)prep;
    return false;
#endif
}

bool value_fast(VALUE_ARGS) {
    if (R > 16 || !fast_kind(s, D, true)) return false;
    if (s.kind == ROW_FLOAT) {
        (D == 64 ? float_rows<4> : float_rows<8>)(true, s, bh, R, p, lp, i0, n, acc, 0);
        return true;
    }
    return D == 64 ? value_fast<4>(s, bh, R, p, lp, i0, n, acc) : value_fast<8>(s, bh, R, p, lp, i0, n, acc);
}

#else

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))  // else avx2_attention.cpp has them
bool score_fast(SCORE_ARGS, Prep&) { return false; }
bool value_fast(VALUE_ARGS) { return false; }
bool fast_reads(const RowSource&, int, bool) { return false; }
#endif

#endif

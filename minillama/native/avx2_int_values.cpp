// AVX2 integer values for 2-, 3- and 4-bit per-token codes: the codes never become floats.
//
//   o_d = sum_t p_t (s_tg c_td + z_tg) = sum_t w_tg c_td + sum_t p_t z_tg,   w = p s >= 0
//
// The same math as avx2_int_attention.cpp's value_int (byte weights, error diffusion, the bound
// tests/test_integer_attention.py holds), laid out so that no sum goes through memory per row:
//
//   weights  per block of 32 tokens, per query head r and channel group g: w_t = p_t s_tg,
//            b = max_t w / 255, w8_t = round(w_t / b + carry) with the remainder carried into the
//            next token (error diffusion: a softmax's long tail keeps its mass). The carries are
//            serial along tokens but independent across (head, group) chains, so eight chains are
//            stepped together in one register, token by token, after a transpose.
//   codes    two tokens' rows are interleaved byte by byte straight from the packed bytes
//            (vpunpcklbw), then the fields split by shift and mask (3-bit rows are unpacked
//            to bytes first, unpack3, 9 pairs a widening): every 16-bit lane holds
//            (c_t,d, c_t+1,d) for one channel. `vpmaddubsw` of (w8_t, w8_t+1) against it adds
//            the pair's products. A block's pairs are unpacked once into L1; then each query head
//            alone reads them with its own weights, its 16-bit and 32-bit sums in registers (three
//            heads' sums at once did not fit the 16 registers and went through the stack every
//            pair). 16-bit sums are widened to 32 bits before they can overflow
//            (2 * 255 * 15 per pair: every 4 pairs for 4-bit codes, 21 for 2-bit), or once a
//            block where its byte weights' sum bounds every 16-bit sum below 2^15 (a peaked
//            softmax: the weights of a block are normalized to its largest), and to float times
//            b once per block.
//   lanes    a register of 16 lanes covers channels in two halves of 32 (its 128-bit lanes), so
//            groups of 32 or more channels give each half one weight; the sums come out in a
//            permuted channel order that is undone once per call (store_channels).
//
//   books    a codebook's levels (Lloyd-Max lm2*: no zeros) are small integers L8 = L / t
//            (levels8 with K <= 16, taken only where every level holds within 0.5%: the 2-bit
//            book's are 3 and 10), looked up from the codes by one vpshufb per field; the same
//            maddubs then multiplies unsigned weights by signed levels, widened every
//            32767 / (2 * 255 * max |L8|) pairs, and the sums are scaled by t once per call.
//
// Affine codes with zeros (KIVI int2/3/4 values, Hadamard or not) and such codebooks, in groups
// of 32, 64 or 128 channels, take this path; the rest stay on the exact kernels (avx2_attention.cpp).

#include "rows.h"

#include <cstdlib>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__))
#include <immintrin.h>

namespace {

constexpr int SB = 32;  // tokens per block of byte weights

// Which channel each 16-bit lane sums, in a 64-channel chunk: lane j = 8h + i of field register
// e lies in half h (channels 32h .. 32h + 31). 4-bit rows (byte b holds channels 2b, 2b + 1;
// fields 0, 1 come from bytes 0-7 | 16-23 by unpacklo per 128-bit lane, 2, 3 from 8-15 | 24-31):
// channel 2 (i + 16h + 8 (e / 2)) + e % 2. 2-bit rows (byte b holds 4b .. 4b + 3; the halves
// hold bytes 0-7 | 8-15, field e is the e-th code of each byte): channel 4 (i + 8h) + e.
//
// 3-bit rows (8 codes per 3 bytes) are first unpacked to one byte a code (unpack3), the 16-byte
// pieces of each 64 channels stored in the order 0, 2, 1, 3, so a 32-byte load holds channels
// 0-15 | 32-47 (then 16-31 | 48-63): field e, lane 8h + i is channel 32h + 8e + i, each half in
// its own 32 channels as above.
//
// pair_codes: two tokens' rows -> four field registers of byte pairs (c_t,d, c_t+1,d), 64 channels.
template <int BITS>
inline void pair_codes(const uint8_t* x, const uint8_t* y, __m256i* f) {
    if (BITS == 3) {  // unpacked bytes: interleave, nothing to split
        for (int m = 0; m < 2; m++) {
            const __m256i a = _mm256_load_si256((const __m256i*)(x + 32 * m)), b = _mm256_load_si256((const __m256i*)(y + 32 * m));
            f[2 * m] = _mm256_unpacklo_epi8(a, b), f[2 * m + 1] = _mm256_unpackhi_epi8(a, b);
        }
    } else if (BITS == 4) {  // fields 0, 1: unpacklo's low and high nibbles; 2, 3: unpackhi's
        const __m256i a = _mm256_loadu_si256((const __m256i*)x), b = _mm256_loadu_si256((const __m256i*)y);
        const __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b), m = _mm256_set1_epi8(15);
        f[0] = _mm256_and_si256(lo, m), f[1] = _mm256_and_si256(_mm256_srli_epi16(lo, 4), m);
        f[2] = _mm256_and_si256(hi, m), f[3] = _mm256_and_si256(_mm256_srli_epi16(hi, 4), m);
    } else {  // field e: bits 2e, 2e + 1 of every byte
        const __m128i a = _mm_loadu_si128((const __m128i*)x), b = _mm_loadu_si128((const __m128i*)y);
        const __m256i z = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)), m = _mm256_set1_epi8(3);
        f[0] = _mm256_and_si256(z, m), f[1] = _mm256_and_si256(_mm256_srli_epi16(z, 2), m);
        f[2] = _mm256_and_si256(_mm256_srli_epi16(z, 4), m), f[3] = _mm256_and_si256(_mm256_srli_epi16(z, 6), m);
    }
}

// One 3-bit row of D codes -> D bytes in pair_codes' piece order (channels 0-15 | 32-47, then
// 16-31 | 48-63 of each 64: rows.h's Codes3 with register k's lanes holding 8k .. and 32 + 8k ..).
inline void unpack3(const uint8_t* row, int D, uint8_t* __restrict__ out) {
    static const Codes3 codes3([](int k, int h, int j) { return 32 * h + 8 * k + j; });
    for (int c = 0; c < D / 64; c++) {
        __m256i b[2];
        codes3(row + 24 * c, b);
        _mm256_store_si256((__m256i*)(out + 64 * c), b[0]);
        _mm256_store_si256((__m256i*)(out + 64 * c + 32), b[1]);
    }
}

// Rows i of a (8 rows of 8 floats) become columns.
inline void transpose8(__m256* a) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]), t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20), a[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
}

// wq[c][t] (chains c of 8; NB blocks of SB tokens, in byte steps) -> w8 by error diffusion
// along t within each block, written as 16-bit pairs: pairs[blk][j][c] = w8_2j | w8_2j+1 << 8.
// One token's step is a chain of dependent instructions (add, round, clamp, subtract: ~11
// cycles); the blocks' chains are independent, so they are stepped in turn and overlap.
template <int NB>
inline void diffuse8(float (*wq)[NB * SB], uint16_t (*pairs)[SB / 2 + 1][8]) {
    __m256 carry[NB];
    const __m256 top = _mm256_set1_ps(255.f);
    for (int b = 0; b < NB; b++) carry[b] = _mm256_setzero_ps();
    for (int t0 = 0; t0 < SB; t0 += 8) {
        __m256 col[NB][8];  // [block][token][chain] after the transposes
        for (int b = 0; b < NB; b++) {
            for (int c = 0; c < 8; c++) col[b][c] = _mm256_load_ps(&wq[c][b * SB + t0]);
            transpose8(col[b]);
        }
        __m256 w8[NB][8];
        for (int t = 0; t < 8; t++)
            for (int b = 0; b < NB; b++) {  // x >= -1/2 rounds to (-)0: only the top needs a clamp
                const __m256 x = _mm256_add_ps(col[b][t], carry[b]);
                w8[b][t] = _mm256_min_ps(_mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), top);
                carry[b] = _mm256_sub_ps(x, w8[b][t]);
            }
        for (int b = 0; b < NB; b++)
            for (int t = 0; t < 8; t += 2) {  // w8_t + 256 w8_t+1 < 65536, exact in float
                const __m256i v = _mm256_cvtps_epi32(_mm256_fmadd_ps(w8[b][t + 1], _mm256_set1_ps(256.f), w8[b][t]));
                _mm_store_si128((__m128i*)pairs[b][(t0 + t) / 2], _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
            }
    }
}

// Eight consecutive scales (fp16, or one-byte log scales looked up in log_scales) from index i.
inline __m256 scales8(const RowSource& s, int64_t i) {
    if (s.scale8) return _mm256_i32gather_ps(log_scales.t, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(s.scale8 + i))), 4);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s.scale + i)));
}

inline __m256 zeros8(const RowSource& s, int64_t i) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s.zero + i))); }

// A block's per-token scales and zeros (NG per slot; none for codebooks: 0) as floats
// [group][token], zero past len.
inline void block_scales(const RowSource& s, const int64_t* slots, int len, int NG, float* sc, float* zc, int ls) {
    if (len == SB && NG <= 2 && slots[SB - 1] == slots[0] + SB - 1) {  // contiguous: eight at a time
        const int64_t first = slots[0] * NG;
        const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // (t g0, t g1) x 4 -> g0 x 4 | g1 x 4
        for (int m = 0; m < 2; m++) {
            float* dst = m ? zc : sc;
            if (m && !s.zero) {
                for (int g = 0; g < NG; g++) std::memset(dst + g * ls, 0, sizeof(float) * SB);
                continue;
            }
            for (int t = 0; t < SB; t += 8) {
                if (NG == 1) {
                    _mm256_store_ps(dst + t, m ? zeros8(s, first + t) : scales8(s, first + t));
                    continue;
                }
                const __m256 x = m ? zeros8(s, first + 2 * t) : scales8(s, first + 2 * t);
                const __m256 y = m ? zeros8(s, first + 2 * t + 8) : scales8(s, first + 2 * t + 8);
                const __m256 a = _mm256_permutevar8x32_ps(x, split), b = _mm256_permutevar8x32_ps(y, split);
                _mm256_store_ps(dst + t, _mm256_permute2f128_ps(a, b, 0x20));
                _mm256_store_ps(dst + ls + t, _mm256_permute2f128_ps(a, b, 0x31));
            }
        }
        return;
    }
    for (int g = 0; g < NG; g++)
        for (int t = 0; t < SB; t++)
            sc[g * ls + t] = t < len ? scale_of(s, slots[t] * NG + g) : 0.f,
                        zc[g * ls + t] = t < len && s.zero ? half_to_float(s.zero[slots[t] * NG + g]) : 0.f;
}

inline float hmax(__m256 m) {
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
    return _mm256_cvtss_f32(_mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1)));
}

// The four field registers of one half (lane i of field e: the channel above, less 32h) -> the
// half's 32 channels in order, each plus z, added into out.
template <int BITS>
inline void store_channels(const __m256* a, float z, float* out) {
    __m256 o[4];
    if (BITS == 3) {  // lane i of a[e] is channel 8e + i
        for (int m = 0; m < 4; m++) o[m] = a[m];
    } else if (BITS == 2) {  // lane i of a[k] is channel 4i + k: a 4 x 8 transpose
        const __m256 t0 = _mm256_unpacklo_ps(a[0], a[1]), t1 = _mm256_unpackhi_ps(a[0], a[1]);
        const __m256 t2 = _mm256_unpacklo_ps(a[2], a[3]), t3 = _mm256_unpackhi_ps(a[2], a[3]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);  // 0-3 | 16-19, 4-7 | 20-23
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);  // 8-11 | 24-27, 12-15 | 28-31
        o[0] = _mm256_permute2f128_ps(u0, u1, 0x20), o[1] = _mm256_permute2f128_ps(u2, u3, 0x20);
        o[2] = _mm256_permute2f128_ps(u0, u1, 0x31), o[3] = _mm256_permute2f128_ps(u2, u3, 0x31);
    } else {  // lane i of a[0] is channel 2i, of a[1] 2i + 1; a[2], a[3] the same from 16
        for (int m = 0; m < 2; m++) {
            const __m256 lo = _mm256_unpacklo_ps(a[2 * m], a[2 * m + 1]), hi = _mm256_unpackhi_ps(a[2 * m], a[2 * m + 1]);
            o[2 * m] = _mm256_permute2f128_ps(lo, hi, 0x20), o[2 * m + 1] = _mm256_permute2f128_ps(lo, hi, 0x31);
        }
    }
    for (int m = 0; m < 4; m++) _mm256_storeu_ps(out + 8 * m, _mm256_add_ps(_mm256_loadu_ps(out + 8 * m), _mm256_add_ps(o[m], _mm256_set1_ps(z))));
}

// A codebook's levels as small integers for these kernels (levels8 with K 4..16), usable where
// every level holds within 0.5% (not the 4-bit book, which the exact kernels then read).
inline const SmallLevels& byte_levels(const RowSource& s) { return small_levels(s.codebook, 1 << s.bits, 4, 16); }

template <int BITS, int NC, bool BOOK>  // NC: chunks of 64 channels (D = 64 NC)
void value_bytes(const RowSource& s, int64_t bh, int R, const float* p, int lp, int i0, int n, float* acc_out) {
    constexpr int D = 64 * NC, W = D * BITS / 8;
    const SmallLevels& book = byte_levels(s);
    const int8_t* l8 = book.l8;
    const float level_step = BOOK ? book.t : 1.f;  // a level is level_step * L8; affine codes are their own levels
    int big8 = (1 << BITS) - 1;  // the largest |code| or |level|: how many pairs fit 16 bits
    if (BOOK) {
        big8 = 1;
        for (int l = 0; l < 1 << BITS; l++) big8 = std::max(big8, std::abs((int)l8[l]));
    }
    const int WIDEN = 32767 / (2 * 255 * big8);
    const bool adaptive = WIDEN < SB / 2;  // a block can need more than one widening: check each block's weights
    alignas(32) int8_t table[32];  // code -> level, in both 128-bit lanes (vpshufb)
    for (int c = 0; c < 32; c++) table[c] = BOOK ? l8[c % 16] : 0;
    const __m256i levels = _mm256_load_si256((const __m256i*)table);
    constexpr int NB = 4, T = NB * SB;  // blocks per pass: their error-diffusion chains overlap
    const int G = s.group, NG = D / G, chains = R * NG, CG = (chains + 7) / 8;
    alignas(32) static const uint8_t zero_row[128] = {0};
    constexpr int CW = BITS == 3 ? 64 : W / NC;  // bytes of a 64-channel chunk as pair_codes reads it
    alignas(32) uint8_t unpacked[BITS == 3 ? NB * SB : 1][BITS == 3 ? D : 1];  // 3-bit rows as bytes
    alignas(32) float wq[64][T];                     // [chain = head * NG + group][token]: w / b
    alignas(32) uint16_t pairs[8][NB][SB / 2 + 1][8];  // [chain / 8][block][pair][chain % 8]: a pair's byte weights
    __m256 accf[16][NC][8];                          // the same in float, times b, over the call
    __m256 zacc[64];                                 // [chain]: sum_t p_t z_tg, eight lanes
    float b[64][NB];                                 // [chain][block]: the byte step
    float wsum[64][NB];                              // [chain][block]: sum_t w / b, within 1/2 of the block's sum of w8
    // A pair's weights for a chunk: the 32 bits at its first chain hold (group of half 0, the
    // next chain); vpshufb spreads them over the halves (G 32: two groups) or both from the first.
    const __m256i spread = G == 32 ? _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3)
                                   : _mm256_set1_epi16(0x0100);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++)
            for (int v = 0; v < 8; v++) accf[r][c][v] = _mm256_setzero_ps();
    for (int c = 0; c < chains; c++) zacc[c] = _mm256_setzero_ps();
    for (int c = chains; c < 8 * CG; c++) std::memset(wq[c], 0, sizeof(wq[c]));
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n; i += T) {
        const int len = std::min(T, i0 + n - i);
        const uint8_t* rows[T + 1];
        int64_t slots[T];
        const int run = std::min(len, s.slots - at.slot);  // tokens before the ring wraps to slot 0
        for (int t = 0; t < len; t++) slots[t] = bh * s.slots + (t < run ? at.slot + t : t - run);
        for (int t = 0; t < len; t++) rows[t] = (const uint8_t*)s.data + slots[t] * W;
        if (BITS == 3)
            for (int t = 0; t < len; t++) unpack3(rows[t], D, unpacked[t]), rows[t] = unpacked[t];
        at.slot = (int)((at.slot + (int64_t)len) % s.slots);
        rows[len] = zero_row;  // an odd last token pairs with zero codes
        alignas(32) float sc[4][T], zc[4][T];  // [group][token]
        for (int k = 0; k < NB; k++)
            if (k * SB < len) block_scales(s, slots + k * SB, std::min(SB, len - k * SB), NG, sc[0] + k * SB, zc[0] + k * SB, T);
        for (int r = 0; r < R; r++) {
            alignas(32) float tail[T];
            const float* pr = p + (int64_t)r * lp + (i - i0);
            if (len < T) {
                std::memcpy(tail, pr, sizeof(float) * len);
                std::memset(tail + len, 0, sizeof(float) * (T - len));
                pr = tail;
            }
            for (int g = 0; g < NG; g++) {
                const int c = r * NG + g;
                for (int k = 0; k < NB; k++) {
                    if (k * SB >= len) {  // past the last token: no weights (its scales were never read)
                        std::memset(wq[c] + k * SB, 0, sizeof(float) * SB);
                        wsum[c][k] = 0.f;
                        continue;
                    }
                    __m256 w[SB / 8], m = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
                    for (int e = 0; e < SB / 8; e++) {
                        const int t = k * SB + 8 * e;
                        const __m256 pk = _mm256_loadu_ps(pr + t);
                        w[e] = _mm256_mul_ps(pk, _mm256_load_ps(sc[g] + t));
                        m = _mm256_max_ps(m, w[e]);
                        sum = _mm256_add_ps(sum, w[e]);
                        zacc[c] = _mm256_fmadd_ps(pk, _mm256_load_ps(zc[g] + t), zacc[c]);
                    }
                    const float big = hmax(m), up = big > 0.f ? 255.f / big : 1.f;
                    b[c][k] = big > 0.f ? big / 255.f : 1.f;
                    const __m256 inv = _mm256_set1_ps(up);
                    for (int e = 0; e < SB / 8; e++) _mm256_store_ps(wq[c] + k * SB + 8 * e, _mm256_mul_ps(w[e], inv));
                    if (adaptive) {
                        __m128 x = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
                        x = _mm_hadd_ps(x, x);
                        wsum[c][k] = _mm_cvtss_f32(_mm_hadd_ps(x, x)) * up;
                    }
                }
            }
        }
        for (int cg = 0; cg < CG; cg++) diffuse8<NB>(wq + 8 * cg, pairs[cg]);
        for (int k = 0; k < NB && k * SB < len; k++) {  // block k: tokens k SB .. k SB + SB - 1 of this pass
            const int blen = std::min(SB, len - k * SB), npairs = (blen + 1) / 2;
            const uint8_t* const* brows = rows + k * SB;
            for (int c = 0; c < NC; c++) {
                // The block's pairs of rows as field registers once, in L1 (codes[j][e]); then each
                // head alone multiplies them by its weights, its sums in registers.
                alignas(32) __m256i codes[SB / 2][4];
                for (int j = 0; j < npairs; j++) {
                    const uint8_t* y = brows[2 * j + 1] == zero_row ? zero_row : brows[2 * j + 1] + c * CW;
                    pair_codes<BITS>(brows[2 * j] + c * CW, y, codes[j]);
                    if (BOOK)
                        for (int e = 0; e < 4; e++) codes[j][e] = _mm256_shuffle_epi8(levels, codes[j][e]);
                }
                for (int r = 0; r < R; r++) {
                    const int ch = r * NG + 64 * c / G;  // the head's chain for half 0 of this chunk
                    const uint16_t* first = &pairs[ch / 8][k][0][ch % 8];
                    // A 16-bit sum is at most big8 times its chain's sum of byte weights (error
                    // diffusion keeps that within 1/2 of sum w / b): where that fits, the whole block
                    // stays in 16 bits and is widened once -- a peaked softmax's usual case.
                    const float most = !adaptive ? 0.f : G == 32 ? std::max(wsum[ch][k], wsum[ch + 1][k]) : wsum[ch][k];
                    const int widen = adaptive && (most + 1.f) * (float)big8 <= 32767.f ? SB / 2 : WIDEN;
                    __m256i acc32[8];  // [field k, half h]
                    for (int v = 0; v < 8; v++) acc32[v] = _mm256_setzero_si256();
                    for (int j0 = 0; j0 < npairs; j0 += widen) {  // `widen` pairs in 16 bits, then widen
                        const int j1 = std::min(j0 + widen, npairs);
                        __m256i acc16[4];
                        for (int e = 0; e < 4; e++) acc16[e] = _mm256_setzero_si256();
                        for (int j = j0; j < j1; j++) {
                            int32_t two;  // (half 0's chain, the next one)
                            std::memcpy(&two, first + 8 * j, 4);
                            const __m256i w = _mm256_shuffle_epi8(_mm256_set1_epi32(two), spread);
                            for (int e = 0; e < 4; e++) acc16[e] = _mm256_add_epi16(acc16[e], _mm256_maddubs_epi16(w, codes[j][e]));
                        }
                        for (int e = 0; e < 4; e++) {
                            acc32[2 * e] = _mm256_add_epi32(acc32[2 * e], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc16[e])));
                            acc32[2 * e + 1] = _mm256_add_epi32(acc32[2 * e + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc16[e], 1)));
                        }
                    }
                    for (int v = 0; v < 8; v++) {  // v = 2e + h: half h of field e, channels of group (64c + 32h) / G
                        const __m256 step = _mm256_set1_ps(b[r * NG + (64 * c + 32 * (v % 2)) / G][k] * level_step);
                        accf[r][c][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc32[v]), step, accf[r][c][v]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++)  // back to channel order, into the caller's sums, with the zeros' term
        for (int c = 0; c < NC; c++)
            for (int h = 0; h < 2; h++) {
                const __m256 a[4] = {accf[r][c][h], accf[r][c][2 + h], accf[r][c][4 + h], accf[r][c][6 + h]};
                store_channels<BITS>(a, hsum(zacc[r * NG + (64 * c + 32 * h) / G]), acc_out + (size_t)r * D + 64 * c + 32 * h);
            }
}

}  // namespace

bool byte_values(const RowSource& s, int D) {
    if ((D != 64 && D != 128) || s.kind != ROW_TOKEN || s.cos || s.center || !(s.bits >= 2 && s.bits <= 4)) return false;
    if (!(s.group >= 32 && s.group % 32 == 0 && D % s.group == 0)) return false;
    return s.codebook ? byte_levels(s).worst <= 0.005f : s.zero != nullptr;
}

bool value_bytes(VALUE_ARGS) {
    if (R > 16 || !byte_values(s, D)) return false;
#define BY_BITS(BOOK)                                                                                                 \
    s.bits == 4   ? (D == 64 ? value_bytes<4, 1, BOOK>(s, bh, R, p, lp, i0, n, acc) : value_bytes<4, 2, BOOK>(s, bh, R, p, lp, i0, n, acc))   \
    : s.bits == 3 ? (D == 64 ? value_bytes<3, 1, BOOK>(s, bh, R, p, lp, i0, n, acc) : value_bytes<3, 2, BOOK>(s, bh, R, p, lp, i0, n, acc))   \
                  : (D == 64 ? value_bytes<2, 1, BOOK>(s, bh, R, p, lp, i0, n, acc) : value_bytes<2, 2, BOOK>(s, bh, R, p, lp, i0, n, acc))
    if (s.codebook) BY_BITS(true);
    else BY_BITS(false);
#undef BY_BITS
    return true;
}

#else

bool byte_values(const RowSource&, int) { return false; }
bool value_bytes(VALUE_ARGS) { return false; }

#endif

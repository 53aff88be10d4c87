// Shared by the decode-attention kernels: reading one stored row (packed codes, fp16/bf16
// floats) into float32, the denormal guard, ring cursors and the block split.
// Header-only (static inline): each kernel source includes it.
#pragma once

#include "dtypes.h"
#include "minillama.h"

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

// Attention weights of far-away tokens are tiny; products with them become denormal
// floats, which x86 handles in slow microcode. Each worker flushes them to zero while it
// runs a block and restores its own floating-point state afterwards, so nothing outside
// the kernel sees a change (unlike -ffast-math, which would flip it for the whole process).
// ARM's FPCR has the same switch (FZ, bit 24); elsewhere nothing changes.
struct FlushDenormals {
#if defined(__x86_64__) || defined(__i386__)
    unsigned int saved;
    FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
    ~FlushDenormals() { _mm_setcsr(saved); }
#elif defined(__aarch64__)
    uint64_t saved;
    FlushDenormals() {
        __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved));
        __asm__ __volatile__("msr fpcr, %0" : : "r"(saved | (1ull << 24)));
    }
    ~FlushDenormals() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved)); }
#endif
};

// Scale i of a part's scale rows: fp16, or a one-byte log scale (scale8).
static inline float scale_of(const RowSource& s, int64_t i) {
    return s.scale8 ? log_scales.t[s.scale8[i]] : half_to_float(s.scale[i]);
}

// A codebook's n levels as int16, L16 = round(L 2047 / max |L|), for the integer kernels (VNNI
// and AVX2): a level is off by at most max |L| / 4094 (int8 levels moved the small ones by 3%,
// see avx512_vnni_attention.cpp's vnni_keys), and 2047 keeps a value sub-block's 32 products within
// int32 (32 x 32767 x 2047 < 2^31). Returns the step (a level is step * L16).
static inline float levels16(const float* book, int n, int16_t* out) {
    float big = 0.f;
    for (int l = 0; l < n; l++) big = std::max(big, std::fabs(book[l]));
    const float step = big > 0.f ? big / 2047.f : 1.f;
    for (int l = 0; l < n; l++) out[l] = (int16_t)std::nearbyint(book[l] / step);
    return step;
}

// A codebook's n levels as small integers: L8 = round(L / t), t = max |L| / K with K in
// kmin..kmax chosen for the smallest worst relative error of a level (the first, largest K on a
// tie); returns t and that error. The VNNI key scores take K in 96..127 (Gaussian Lloyd-Max
// books: 2-bit 0.08% at K 120, 3-bit 0.27% at 114, 4-bit 1.3% at 107; at K = 127 a 3-bit book's
// smallest level moved by 3.2%, a bias perplexity showed); the AVX2 byte values and 2-bit keys K in 4..16,
// where the 2-bit book's levels 0.4528 and 1.5104 are 3 and 10 within 0.1%.
static inline float levels8(const float* book, int n, int kmin, int kmax, int8_t* out, float* worst) {
    float big = 0.f;
    for (int l = 0; l < n; l++) big = std::max(big, std::fabs(book[l]));
    if (big == 0.f) {
        for (int l = 0; l < n; l++) out[l] = 0;
        return *worst = 0.f, 1.f;
    }
    float best_t = big / kmax, best = INFINITY;
    for (int K = kmax; K >= kmin; K--) {
        const float t = big / K;
        float err = 0.f;
        for (int l = 0; l < n; l++)
            if (book[l] != 0.f) err = std::max(err, std::fabs(std::nearbyint(book[l] / t) * t - book[l]) / std::fabs(book[l]));
        if (err < best) best = err, best_t = t;
    }
    for (int l = 0; l < n; l++) out[l] = (int8_t)std::nearbyint(book[l] / best_t);
    *worst = best;
    return best_t;
}

// levels8 of the last book this thread asked for with these K (compared by value): the search
// once, not per kernel call. book = nullptr: no levels (t 1, worst 1).
struct SmallLevels {
    float book[16];
    int n, kmin, kmax;
    int8_t l8[16];
    float t, worst;
};
static inline const SmallLevels& small_levels(const float* book, int n, int kmin, int kmax) {
    static thread_local SmallLevels last{{0.f}, 0, 0, 0, {0}, 1.f, 1.f};
    static const SmallLevels none{{0.f}, 0, 0, 0, {0}, 1.f, 1.f};
    if (!book) return none;
    if (last.n != n || last.kmin != kmin || last.kmax != kmax || std::memcmp(last.book, book, sizeof(float) * n)) {
        last.n = n, last.kmin = kmin, last.kmax = kmax, std::memcpy(last.book, book, sizeof(float) * n);
        last.t = levels8(book, n, kmin, kmax, last.l8, &last.worst);
    }
    return last;
}

// Byte -> codes lookup tables for 4- and 2-bit packing (one byte holds 2 or 4 codes):
// a table load replaces the shifts and masks, which vectorize poorly.
struct Tables {
    float nib[256][2];
    float crumb[256][4];
    Tables() {
        for (int b = 0; b < 256; b++) {
            nib[b][0] = b & 15; nib[b][1] = b >> 4;
            for (int j = 0; j < 4; j++) crumb[b][j] = (b >> (2 * j)) & 3;
        }
    }
};
static const Tables tables;

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MINILLAMA_AVX512 1
// SIMD unpacking, same results as the lookup tables below: split each byte into its
// codes with shifts and masks, interleave them back into order, widen to float.

// Up to 16 one-byte log scales (the lanes of `m`; 0 elsewhere) -> floats, exactly log_scales.t:
// 2^((u & 15) / 16) by a permute of one register, times 2^((u >> 4) - 8) by vscalefps.
static inline __m512 log_scales16(const uint8_t* p, __mmask16 m) {
    const __m512i u = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
    const __m512 frac = _mm512_permutexvar_ps(u, _mm512_loadu_ps(log_scales.t + 128));  // t[128 + j] = 2^(j / 16)
    const __m512 octave = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(u, 4), _mm512_set1_epi32(8)));
    return _mm512_maskz_mov_ps(m, _mm512_scalef_ps(frac, octave));
}

// Up to 16 fp16 values (the lanes of `m`; 0 elsewhere) -> floats.
static inline __m512 halves16(const uint16_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

// Up to 16 scales of a part from index `first` (the lanes of `m`): fp16 or one-byte log scales.
static inline __m512 scales16(const RowSource& s, int64_t first, __mmask16 m) {
    return s.scale8 ? log_scales16(s.scale8 + first, m) : halves16(s.scale + first, m);
}

// 16 bytes of 4-bit codes (low nibble first) -> 32 floats.
static inline void unpack16_int4(const uint8_t* p, float* __restrict__ out) {
    const __m128i b = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    _mm512_storeu_ps(out, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi))));       // codes 0..15
    _mm512_storeu_ps(out + 16, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi))));  // codes 16..31
}

// 16 bytes of 2-bit codes (lowest bits first) -> 64 floats.
static inline void unpack16_int2(const uint8_t* p, float* __restrict__ out) {
    const __m128i b = _mm_loadu_si128((const __m128i*)p), m = _mm_set1_epi8(3);
    const __m128i c0 = _mm_and_si128(b, m), c1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
    const __m128i c2 = _mm_and_si128(_mm_srli_epi16(b, 4), m), c3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
    const __m128i p01lo = _mm_unpacklo_epi8(c0, c1), p01hi = _mm_unpackhi_epi8(c0, c1);  // (c0, c1) of bytes 0-7, 8-15
    const __m128i p23lo = _mm_unpacklo_epi8(c2, c3), p23hi = _mm_unpackhi_epi8(c2, c3);
    const __m128i q[4] = {_mm_unpacklo_epi16(p01lo, p23lo), _mm_unpackhi_epi16(p01lo, p23lo),   // bytes 0-3, 4-7
                          _mm_unpacklo_epi16(p01hi, p23hi), _mm_unpackhi_epi16(p01hi, p23hi)};  // bytes 8-11, 12-15
    for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + 16 * j, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[j])));
}

#ifdef __AVX512VBMI__
// Codes 8i..8i+15 of a 3-bit row already in a register (8 codes per 3 bytes, lowest bits
// first) -> 16 floats: each 32-bit lane gathers its 3-byte word, shifts and masks.
static inline void unpack16_int3(__m512i bytes, int i, float* __restrict__ out) {
    alignas(64) uint8_t idx[64];
    for (int j = 0; j < 16; j++) {
        const int word = 3 * (i + j / 8);
        idx[4 * j] = word, idx[4 * j + 1] = word + 1, idx[4 * j + 2] = word + 2, idx[4 * j + 3] = word + 2;
    }
    const __m512i words = _mm512_permutexvar_epi8(_mm512_load_si512(idx), bytes);
    const __m512i shifts = _mm512_set_epi32(21, 18, 15, 12, 9, 6, 3, 0, 21, 18, 15, 12, 9, 6, 3, 0);
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(7));
    _mm512_storeu_ps(out, _mm512_cvtepi32_ps(codes));
}
#endif
#elif defined(__AVX2__)
#include <immintrin.h>
#define MINILLAMA_AVX2 1
// The same unpacking for AVX2 CPUs (8 floats per register).

// 64 3-bit codes (24 bytes, 8 codes per 3 bytes, lowest bits first) -> two registers of 32 code
// bytes in an order of the caller's choosing, without leaving registers. The bytes are loaded as
// 0-15 | 8-23 (each 128-bit lane then holds what its codes need); per register k of four,
// vpshufb puts the one or two bytes holding each of its 16 codes into a 16-bit lane (W = b | b'
// << 8), vpmullw by 2^(13 - o) lifts the code's bits (offset o = 3c mod 8) to the top three and
// vpsrlw 13 brings it down; vpackuswb of registers 0, 1 and of 2, 3 gives the bytes. Byte i of
// lane h of result m is the code of channel(k, h, j) with k = 2m + i / 8, j = i % 8: lane 0's
// channels must lie in 0-31 and lane 1's in 32-63.
struct Codes3 {
    alignas(32) int8_t shuffle[4][32];  // [register][byte]
    alignas(32) int16_t lift[4][16];    // [register][16-bit lane]
    template <class Channel>
    explicit Codes3(Channel channel) {
        for (int k = 0; k < 4; k++)
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 8; j++) {
                    const int c = channel(k, h, j), byte = 3 * c / 8 - 8 * h, o = 3 * c % 8;  // lane 1 starts at byte 8
                    shuffle[k][16 * h + 2 * j] = (int8_t)byte;
                    shuffle[k][16 * h + 2 * j + 1] = (int8_t)(o > 5 ? byte + 1 : -128);  // a second byte only if the code straddles
                    lift[k][8 * h + j] = (int16_t)(1 << (13 - o));
                }
    }
    inline void operator()(const uint8_t* src, __m256i* out) const {
        const __m256i bytes = _mm256_loadu2_m128i((const __m128i*)(src + 8), (const __m128i*)src);
        __m256i code[4];
        for (int k = 0; k < 4; k++)
            code[k] = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(bytes, _mm256_load_si256((const __m256i*)shuffle[k])),
                                                           _mm256_load_si256((const __m256i*)lift[k])),
                                        13);
        out[0] = _mm256_packus_epi16(code[0], code[1]), out[1] = _mm256_packus_epi16(code[2], code[3]);
    }
};

// 16 bytes of 4-bit codes (low nibble first) -> 32 floats.
static inline void unpack16_int4(const uint8_t* p, float* __restrict__ out) {
    const __m128i b = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m128i c[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};  // codes 0..15, 16..31
    for (int j = 0; j < 2; j++) {
        _mm256_storeu_ps(out + 16 * j, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c[j])));
        _mm256_storeu_ps(out + 16 * j + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c[j], 8))));
    }
}

// 16 bytes of 2-bit codes (lowest bits first) -> 64 floats.
static inline void unpack16_int2(const uint8_t* p, float* __restrict__ out) {
    const __m128i b = _mm_loadu_si128((const __m128i*)p), m = _mm_set1_epi8(3);
    const __m128i c0 = _mm_and_si128(b, m), c1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
    const __m128i c2 = _mm_and_si128(_mm_srli_epi16(b, 4), m), c3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
    const __m128i p01lo = _mm_unpacklo_epi8(c0, c1), p01hi = _mm_unpackhi_epi8(c0, c1);
    const __m128i p23lo = _mm_unpacklo_epi8(c2, c3), p23hi = _mm_unpackhi_epi8(c2, c3);
    const __m128i q[4] = {_mm_unpacklo_epi16(p01lo, p23lo), _mm_unpackhi_epi16(p01lo, p23lo),
                          _mm_unpacklo_epi16(p01hi, p23hi), _mm_unpackhi_epi16(p01hi, p23hi)};
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps(out + 16 * j, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[j])));
        _mm256_storeu_ps(out + 16 * j + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q[j], 8))));
    }
}
#endif

#ifdef __AVX2__
// Sums across the lanes of 256-bit registers, for the AVX2 kernels and the 256-bit code of the
// AVX-512 builds (avx2_int_attention.cpp is compiled for both).

// The sum of a register's eight lanes.
static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// Lane t of the result = the eight lanes of v[t] combined by op (add or max): a transposing
// tree of unpacks, shuffles and lane swaps, one micro-op each (vhaddps is several on Zen).
template <class Op>
static inline __m256 tree8(const __m256* v, Op op) {
    __m256 p[4], u[2];
    for (int i = 0; i < 4; i++) p[i] = op(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        u[i] = op(_mm256_shuffle_ps(p[2 * i], p[2 * i + 1], 0x44), _mm256_shuffle_ps(p[2 * i], p[2 * i + 1], 0xEE));
    return op(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

static inline __m256 hsum8(const __m256* v) { return tree8(v, [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); }); }
static inline __m256 hmax8(const __m256* v) { return tree8(v, [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); }); }
#endif

// Unpack one row of D codes (bits 8, 4, 3 or 2; 5 = trits) into floats.
static inline void unpack_row(const uint8_t* row, int bits, int D, float* __restrict__ out) {
    if (bits == 4) {
        int i = 0;
#if defined(MINILLAMA_AVX512) || defined(MINILLAMA_AVX2)
        for (; i + 16 <= D / 2; i += 16) unpack16_int4(row + i, out + 2 * i);
#endif
        for (; i < D / 2; i++) std::memcpy(out + 2 * i, tables.nib[row[i]], 2 * sizeof(float));
    } else if (bits == 2) {
        int i = 0;
#if defined(MINILLAMA_AVX512) || defined(MINILLAMA_AVX2)
        for (; i + 16 <= D / 4; i += 16) unpack16_int2(row + i, out + 4 * i);
#endif
        for (; i < D / 4; i++) std::memcpy(out + 4 * i, tables.crumb[row[i]], 4 * sizeof(float));
    } else if (bits == 8) {
        for (int d = 0; d < D; d++) out[d] = row[d];
    } else if (bits == 3) {
        int i = 0;
#if defined(MINILLAMA_AVX512) && defined(__AVX512VBMI__)
        if (D <= 168) {  // the whole packed row (3D/8 <= 63 bytes) fits one register
            const __m512i bytes = _mm512_maskz_loadu_epi8((__mmask64)((1ull << (3 * D / 8)) - 1), row);
            for (; i + 2 <= D / 8; i += 2) unpack16_int3(bytes, i, out + 8 * i);
        }
#endif
        for (; i < D / 8; i++) {
            uint32_t w = row[3 * i] | (row[3 * i + 1] << 8) | (row[3 * i + 2] << 16);
            for (int j = 0; j < 8; j++) out[8 * i + j] = (w >> (3 * j)) & 7;
        }
    } else {  // trits, five per byte, stored as code + 1 in {0, 1, 2}; return -1/0/+1
        int d = 0;
        for (int i = 0; d < D; i++) {
            int v = row[i];
            for (int j = 0; j < 5 && d < D; j++, d++) { out[d] = (float)(v % 3) - 1.0f; v /= 3; }
        }
    }
}

// Unpack a row and, for codebook codecs, map each code to its level.
static inline void decode_row(const uint8_t* row, int bits, int D, const float* codebook, float* __restrict__ out) {
    unpack_row(row, bits, D, out);
    if (!codebook) return;
    int d = 0;
#ifdef MINILLAMA_AVX512
    if (bits <= 4) {  // at most 16 levels: one register, a permute looks them up
        alignas(64) float table[16] = {0};
        std::memcpy(table, codebook, sizeof(float) << bits);
        const __m512 levels = _mm512_load_ps(table);
        for (; d + 16 <= D; d += 16)
            _mm512_storeu_ps(out + d, _mm512_permutexvar_ps(_mm512_cvttps_epi32(_mm512_loadu_ps(out + d)), levels));
    }
#elif defined(MINILLAMA_AVX2)
    if (bits <= 4) {  // 16 levels in two registers: permute both, blend on bit 3 of the code
        alignas(32) float table[16] = {0};
        std::memcpy(table, codebook, sizeof(float) << bits);
        const __m256 lo = _mm256_load_ps(table), hi = _mm256_load_ps(table + 8);
        for (; d + 8 <= D; d += 8) {
            const __m256i code = _mm256_cvttps_epi32(_mm256_loadu_ps(out + d));
            const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(code, 28));  // bit 3 -> sign bit
            _mm256_storeu_ps(out + d, _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, code),
                                                      _mm256_permutevar8x32_ps(hi, code), upper));
        }
    }
#endif
    for (; d < D; d++) out[d] = codebook[(int)out[d]];
}

// One stored row of unquantized floats (dtype 0 f32, 1 f16, 2 bf16) into float32.
static inline void load_row(const void* base, int64_t offset, int dtype, int D, float* __restrict__ out) {
    if (dtype == 0) {
        std::memcpy(out, (const float*)base + offset, D * sizeof(float));
    } else if (dtype == 1) {
        const half* h = (const half*)base + offset;
        int d = 0;
#ifdef MINILLAMA_AVX512
        for (; d + 16 <= D; d += 16) _mm512_storeu_ps(out + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + d))));
#elif defined(MINILLAMA_AVX2) && defined(__F16C__)
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + d))));
#endif
        for (; d < D; d++) out[d] = (float)h[d];
    } else {
        const uint16_t* b = (const uint16_t*)base + offset;
        int d = 0;
#ifdef MINILLAMA_AVX2
        for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(out + d, _mm256_castsi256_ps(_mm256_slli_epi32(
                                          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(b + d))), 16)));
#endif
        for (; d < D; d++) {
            uint32_t u = (uint32_t)b[d] << 16;
            std::memcpy(out + d, &u, 4);
        }
    }
}

// Walks the ring slots of consecutive logical tokens without a division per token.
struct Cursor {
    int slot, slots;
    Cursor(int start, int first, int slots) : slot((int)(((int64_t)start + first) % slots)), slots(slots) {}
    void next() { if (++slot == slots) slot = 0; }
    void skip(int n) { slot = (int)(((int64_t)slot + n) % slots); }  // n tokens at once
};

// A block's output accumulator, added to `dst` (R x D floats): on the stack when its size is
// known at compile time (the compiler can then keep it in registers across the token loop),
// else `dst` itself. The destructor writes the stack copy back.
template <int N>
struct Accumulator {
    alignas(64) float local[N > 0 ? N : 1];
    float* dst;
    float* data;
    int n;
    Accumulator(float* dst, int n) : dst(dst), data(N > 0 ? local : dst), n(n) {
        if (N > 0) std::memcpy(local, dst, sizeof(float) * n);
    }
    ~Accumulator() { if (N > 0) std::memcpy(dst, local, sizeof(float) * n); }
};

// Per-token codecs: the row's scale and zero are applied to the decoded row once, in
// registers (D multiply-adds), and the row then serves all R query heads that share this
// KV head; nothing is written back. With few channel groups per row this beats folding
// the scales into q or p per group and query head, which needs a loop over groups.
// `first` is the index of the row's first group in the part's scale (and zero) rows.
static inline void scale_row(const RowSource& src, int64_t first, int D, float* c) {
    for (int g = 0; g < D / src.group; g++) {
        const float s = scale_of(src, first + g), z = src.zero ? half_to_float(src.zero[first + g]) : 0.f;
        for (int d = g * src.group; d < (g + 1) * src.group; d++) c[d] = c[d] * s + z;
    }
}

// The block kernels (one block of rows of one part, for one KV head), one per row family;
// layer_attention.cpp picks one by the part's route. Scores: q (R, D) float32 in the key
// codec's space; out[r * ls + j] = q_r . row (i0 + j). Values: acc (R, D) += sum_j
// p[r * lp + j] * row (i0 + j). Rows are logical (age order) indices of the part; R <= 16.
#define SCORE_ARGS const RowSource &s, int64_t bh, int R, int D, const float *q, int i0, int n, float *out, int ls
#define VALUE_ARGS const RowSource &s, int64_t bh, int R, int D, const float *p, int lp, int i0, int n, float *acc
void score_float(SCORE_ARGS);
void value_float(VALUE_ARGS);
void score_token(SCORE_ARGS);
void value_token(VALUE_ARGS);
void score_channel(SCORE_ARGS);
void value_channel(VALUE_ARGS);
void score_int(SCORE_ARGS);
void value_int(VALUE_ARGS);
void score_rows(SCORE_ARGS);
void value_rows(VALUE_ARGS);
// What a fast score kernel derives from one head's queries (the queries in decode order, int8
// queries and their scales, the query folded with a group's scales): filled by the first block
// of a head and part (ready = false: the caller resets it per head and part), reused by the rest.
struct Prep {
    bool ready;
    int group;  // per-channel keys: the group of tokens the folded query is for (-1: none yet)
    alignas(64) unsigned char bytes[20 * 1024];
};
// avx512_attention.cpp (AVX-512) or avx2_attention.cpp (AVX2): the same math for the common rows;
// false when it does not apply.
bool score_fast(SCORE_ARGS, Prep& prep);
bool value_fast(VALUE_ARGS);
// Whether score_fast (values = false) or value_fast (true) reads these rows on this build.
bool fast_reads(const RowSource& s, int D, bool values);
// Integer scores of 4-bit keys (affine or codebook) and 3-bit affine ones on AVX2 CPUs (avx2_attention.cpp); int4_keys: whether
// score_int4 reads them.
bool int4_keys(const RowSource& s, int D);
bool score_int4(SCORE_ARGS, Prep& prep);
// Integer scores of 2-bit codebook keys (one scale a row) on AVX2 CPUs (avx2_attention.cpp, byte levels);
// int2_keys: whether score_int2 reads them.
bool int2_keys(const RowSource& s, int D);
bool score_int2(SCORE_ARGS, Prep& prep);
// Keys in RoPE frequency blocks (ROW_BLOCKS), exact float math: eight channels at a time on AVX2
// (avx2_attention.cpp), sixteen on AVX-512 (avx512_attention.cpp); block_keys: whether score_blocks
// reads them.
bool block_keys(const RowSource& s, int D);
bool score_blocks(SCORE_ARGS, Prep& prep);

// f(std::integral_constant<int, W>()) for a block's runtime width w = 1 .. 8 (the block kernels'
// decoders take the width as a template argument, so the decode of a block has no branch); both
// block-key kernels (avx512_attention.cpp, avx2_attention.cpp) dispatch through it.
template <typename F>
__attribute__((always_inline)) inline void with_width(int w, F&& f) {
    switch (w) {
        case 1: return f(std::integral_constant<int, 1>());
        case 2: return f(std::integral_constant<int, 2>());
        case 3: return f(std::integral_constant<int, 3>());
        case 4: return f(std::integral_constant<int, 4>());
        case 5: return f(std::integral_constant<int, 5>());
        case 6: return f(std::integral_constant<int, 6>());
        case 7: return f(std::integral_constant<int, 7>());
        default: return f(std::integral_constant<int, 8>());
    }
}

// The operands of the whole-row decode of block keys (vpermb, vpmultishiftqb, a mask: the exact
// kernel in avx512_attention.cpp and the integer one in avx512_vnni_attention.cpp), for one head's widths
// (nb blocks of D / nb channels, D 64 or 128). Qword q holds codes 8q .. 8q + 7: spread[8q + i]
// picks the w whole bytes that hold them, counted from base[q / 8] (the first code byte of each
// 64 channels); byte i of shifts[q] is code i's bit offset w i in them; mask[8q + i] = 2^w - 1
// (0 for a dropped block).
static inline void block_decode_operands(const uint16_t* widths, int nb, int D, uint8_t* spread, uint8_t* mask,
                                         long long* shifts, int* base) {
    const int per = D / 8 / nb;  // qwords a block
    for (int q = 0, byte = 0; q < D / 8; q++) {  // byte: the first of qword q's codes in the row
        const int w = widths[q / per];
        if (q % 8 == 0) base[q / 8] = byte;
        long long sh = 0;
        for (int i = 0; i < 8; i++) {
            spread[8 * q + i] = (uint8_t)std::min(63, byte - base[q / 8] + std::min(i, std::max(w - 1, 0)));
            mask[8 * q + i] = (uint8_t)((1 << w) - 1);
            sh |= (long long)(w * i) << (8 * i);
        }
        shifts[q] = sh;
        byte += w;  // 8 codes of w bits
    }
}

// What both SIMD block-key kernels derive from a head's queries and widths once per call (Prep):
// the queries (already in the blocks' order and rotation: layer_attention.cpp), q . center, the
// first byte in a row of each run of `lanes` channels (a block is whole runs), and the books of
// widths 1-5 zero-padded to 32 levels (books[0] all zeros: a dropped block; wider books are read
// from the codebook itself).
struct BlockTables {
    alignas(64) float q[16][128];    // [head][channel in block order]
    float qc[16];                    // q . center (centered keys), else 0
    int byte[16];                    // per run of lanes channels: its first byte in the row
    alignas(64) float books[6][32];  // [w]: the book of width w, zero-padded
    void prepare(const RowSource& s, int64_t bh, int R, int D, const float* query, int lanes) {
        for (int r = 0; r < R; r++) {
            std::memcpy(q[r], query + r * D, sizeof(float) * D);
            float c = 0.f;
            if (s.center)
                for (int d = 0; d < D; d++) c += query[r * D + d] * s.center[bh * D + d];
            qc[r] = c;
        }
        for (int w = 0; w <= 5; w++)
            for (int l = 0; l < 32; l++) books[w][l] = w && l < (1 << w) ? s.codebook[(1 << w) - 2 + l] : 0.f;
        const int nb = s.nlevels;
        for (int b = 0, bit = 0, k = 0; b < nb; b++) {
            const int w = s.levels[bh * nb + b];
            for (int j = 0; j < D / nb; j += lanes, k++, bit += lanes * w) byte[k] = bit / 8;
        }
    }
};
// Integer (VNNI) scores of 2-, 3- and 4-bit keys, and of frequency-block keys at head_dim 64 (avx512_vnni_attention.cpp);
// vnni_keys: whether score_vnni reads these rows (a head with a block wider than 4 bits: false at run time).
bool vnni_keys(const RowSource& s, int D);
bool score_vnni(SCORE_ARGS, Prep& prep);
// Integer (VNNI, int16 weights) values of per-token codes; vnni_values: whether value_vnni reads them.
bool vnni_values(const RowSource& s, int D);
bool value_vnni(VALUE_ARGS);
// Integer values of 2-, 3- and 4-bit per-token codes (and 2-bit books) on AVX2 CPUs (avx2_int_values.cpp, byte weights);
// byte_values: whether value_bytes reads these rows.
bool byte_values(const RowSource& s, int D);
bool value_bytes(VALUE_ARGS);
extern "C" int int_attention_available(void);

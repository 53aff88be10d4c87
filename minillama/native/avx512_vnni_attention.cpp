// AVX-512 VNNI block kernels: integer dot products over the packed codes, every row read once
// for all R query heads that share it.
//
//   keys    (score_vnni) 4-bit codes (2- and 3-bit ones widened to them), per token (one scale a row;
//           affine or a codebook) or KIVI per channel: sixteen tokens' rows transposed so that
//           each vpdpbusd lane is one token, against an int8 query with one step per 8 channels.
//           Keys in RoPE frequency blocks at head_dim 64 (score_vnni_blocks, with VBMI): the same
//           arithmetic with a book and a byte scale per block.
//   values  (value_vnni) 2/3/4/8-bit per-token codes (affine or a codebook): token pairs' codes
//           as int16 lanes, vpdpwssd against int16 attention weights.
//
// Both are approximate with a stated bound (below; tests/test_integer_attention.py holds it),
// taken only where the route says so (kv/fused_attention.py: route; layer_attention.cpp:
// exact_is_faster); model/attention.py is the specification. CPUs without VNNI get false from
// every entry point and the exact kernels (avx512_attention.cpp, avx2_attention.cpp) or the
// generic integer ones (avx2_int_attention.cpp) read these rows.

#include "rows.h"

#include <cmath>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#include "avx512.h"

namespace {

// Ask for `count` consecutive rows starting `ahead` slots after `slot` (the rows a later chunk
// reads) now, and their per-token scales when the codec has them: into L1 (HINT _MM_HINT_T0)
// for the next chunks, so that they arrive from DRAM while this chunk is computed on, or into L2
// (_MM_HINT_T1) from further ahead. always_inline is what makes these prefetches exist: GCC
// takes a function whose only effect is a prefetch for pure (its local-pure-const pass) and
// deletes the calls (without it, no prefetch instruction is left in this file's object code).
template <int HINT = _MM_HINT_T0>
__attribute__((always_inline)) inline void prefetch_rows(const RowSource& s, int64_t bh, int slot, int ahead, int count, int row_bytes,
                                                          int scales) {
    const int first = slot + ahead;
    if (first + count > s.slots) return;  // near the ring's end: the hardware prefetcher has it
    const char* p = (const char*)s.data + (bh * s.slots + first) * (int64_t)row_bytes;
    for (int b = 0; b < count * row_bytes; b += 64) _mm_prefetch(p + b, (_mm_hint)HINT);
    if (scales) {
        const int64_t at = (bh * s.slots + first) * scales;
        const char* q = s.scale8 ? (const char*)(s.scale8 + at) : (const char*)(s.scale + at);
        for (int b = 0; b < count * scales * (s.scale8 ? 1 : 2); b += 64) _mm_prefetch(q + b, (_mm_hint)HINT);
    }
}

#if MINILLAMA_VBMI
// 64 codes of BITS = 2 or 3 bits (8 codes per BITS bytes, lowest bits first) -> 64 bytes,
// channel order: qword j gets bytes BITS j .. BITS j + BITS - 1 (vpermb), then vpmultishiftqb
// takes the 8 bits at offsets 0, BITS, .., 7 BITS of it into bytes and a mask keeps the codes:
// 64 codes in four instructions (BMI2's pdep, 8 codes at a time, measured ~100 cycles per call
// on this project's VMs). Unpack holds the two constant operands, made at compile time.
template <int BITS>
struct Unpack {
    alignas(64) uint8_t spread[64] = {};  // vpermb: byte 8j + b <- byte BITS j + b
    long long shifts = 0;                 // vpmultishiftqb: byte j of each qword <- bit offset BITS j
    constexpr Unpack() {
        for (int j = 0; j < 8; j++) {
            for (int b = 0; b < BITS; b++) spread[8 * j + b] = (uint8_t)(BITS * j + b);
            shifts |= (long long)(BITS * j) << (8 * j);
        }
    }
};

template <int BITS>
inline __m512i codes(const uint8_t* row) {
    static constexpr Unpack<BITS> table{};  // constant-initialized: no guard in the loops that call this
    const __m512i bytes = _mm512_maskz_loadu_epi8((__mmask64)((1ull << (8 * BITS)) - 1), row);
    const __m512i spread = _mm512_permutexvar_epi8(_mm512_load_si512(table.spread), bytes);
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(table.shifts), spread),
                            _mm512_set1_epi8((1 << BITS) - 1));
}

// 64 codes of a 2- or 3-bit row -> the 4-bit layout score_vnni reads (32 bytes, byte j = channel
// 2j | channel 2j + 1 << 4): codes<BITS>, then each byte pair summed as lo + 16 hi.
inline __m256i codes_as_nibbles(const uint8_t* codes64, int bits) {
    const __m512i unpacked = bits == 3 ? codes<3>(codes64) : codes<2>(codes64);
    return _mm512_cvtepi16_epi8(_mm512_maddubs_epi16(unpacked, _mm512_set1_epi16(0x1001)));
}

// 16 rows of 2- or 3-bit codes (D = 8 NC channels) widened to 4-bit rows in the registers
// Transpose16 takes: two rows per register for D = 64, one for D = 128. (Written to the stack
// in 32-byte halves and read back as 64-byte registers, they could not be store-forwarded.)
template <int NC>
inline void narrow_rows(const uint8_t* const* row, int bits, __m512i* x) {
    for (int r = 0; r < NC; r++) {
        const __m256i lo = NC == 8 ? codes_as_nibbles(row[2 * r], bits) : codes_as_nibbles(row[r], bits);
        const __m256i hi = NC == 8 ? codes_as_nibbles(row[2 * r + 1], bits) : codes_as_nibbles(row[r] + 8 * bits, bits);
        x[r] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
}
#endif

// Integer scores for 4-bit keys: per-token codes with one scale per row (affine or a codebook),
// or KIVI per-channel codes. NC = D / 8: the dword chunks of a row (8 channels each). 2- and 3-bit
// rows (with vpermb) are first widened to that 4-bit layout, 16 rows at a time in registers
// (narrow_rows), and then read as 4-bit rows whose codes stop at 3 or 7.
//
// Sixteen tokens at a time, chunk c of every token's row is brought into one register (lane t =
// the 4 bytes of channels 8c .. 8c + 7 of token t: sixteen consecutive rows transposed by
// Transpose16, a gather where the ring wraps or a chunk is short), so that vpdpbusd sums code x query products
// straight into each token's own lane: no horizontal sums at all. The low nibbles of a chunk
// are channels 8c + 0, 2, 4, 6 and the high nibbles 8c + 1, 3, 5, 7; the int8 query is laid out
// the same way, with one scale per chunk of 8 channels (a_c = max |x| / 127 over the chunk; the
// error of a score is at most sum_d a_c(d) / 2 * |code_d| times the row's scale, as the generic
// integer kernels state). A codebook's levels become int8 where that keeps every level within
// 0.5% (levels8: 2- and 3-bit Lloyd-Max books), offset by 128 to be unsigned and looked up per
// nibble with vpshufb; else 16-bit, L16 = round(L 2047 / max |L|), offset by 2048 and split into
// two bytes, each looked up so (a level off by at most max |L| / 4094). The offset's sum is
// taken back out exactly.
// score_vnni's per-head state (Prep): the int8 queries as the dwords vpdpbusd broadcasts
// (qw[r][2c] the even channels of chunk c, qw[r][2c + 1] the odd ones) and their scales.
template <int NC>
struct VnniQuery {
    alignas(64) int32_t qw[16][2 * NC];
    alignas(64) float qa[16][8 * NC];  // [head][8 chunk + j]: the int8 step of the chunk (quantize16's lanes)
    float offset[16];              // codebooks: 2048 (16-bit levels) or 128 (byte levels) sum_d a q8_d, the unsigned offset's share
    float qsum[16], qz[16];        // sum_d q_d (per-token zeros); q . z_g (per-channel zeros)
};

// Each lane: the max of the 8 lanes of its half of m (lanes 0-7 or 8-15), by in-lane shuffles.
inline __m512 max_per_8(__m512 m) {
    m = _mm512_max_ps(m, _mm512_permute_ps(m, 0xB1));        // neighbours
    m = _mm512_max_ps(m, _mm512_permute_ps(m, 0x4E));        // pairs: each 128-bit lane's max
    return _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, 0xB1));  // 128-bit lanes 0-1, 2-3
}

// 1 / a to a few ulp: rcp14 and one Newton step (no division).
inline __m512 reciprocal(__m512 a) {
    const __m512 inv = _mm512_rcp14_ps(a);
    return _mm512_mul_ps(inv, _mm512_fnmadd_ps(a, inv, _mm512_set1_ps(2.f)));
}

// 16 floats (two chunks of 8 channels) -> int8 per chunk (a = max |x| / 127 over the chunk),
// laid out for vpdpbusd: the even channels' 4 bytes, then the odd ones', per chunk (16 bytes
// to qw); the steps to qa[0..15] (lanes 0-7 chunk 0's, 8-15 chunk 1's). Returns the int8
// values as int32 lanes. The chunk maxima by in-lane shuffles, the division as a refined
// reciprocal (rcp14 and one Newton step: a few ulp of 1/a, so a rounding tie may go the other
// way -- still within a/2 of x, the stated bound). KIVI keys run this per head and group of 32
// tokens, the largest cost of their scores after the dot products (docs/archive/speed-rounds.md).
inline __m512i quantize16(__m512 x, int32_t* qw, float* qa) {
    const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const __m512 m = max_per_8(_mm512_abs_ps(x));  // each chunk's max
    const __m512 a = _mm512_mul_ps(_mm512_max_ps(m, _mm512_set1_ps(1e-30f)), _mm512_set1_ps(1.f / 127.f));  // all-zero chunk: q8 = 0
    const __m512i q8 = _mm512_cvtps_epi32(_mm512_mul_ps(x, reciprocal(a)));  // round to nearest even
    _mm_storeu_si128((__m128i*)qw, _mm_shuffle_epi8(_mm512_cvtepi32_epi8(q8), split));  // lo, hi of chunk 0, then of 1
    _mm512_store_ps(qa, a);
    return q8;
}

// x (D = 8 NC floats) -> quantize16 per 16 channels; for a codebook also its offset's share,
// book_offset sum_d a q8_d.
template <int NC>
inline void quantize_chunks(const float* x, int32_t* qw, float* qa, float* offset, float book_offset) {
    float off = 0.f;
    for (int k = 0; k < NC / 2; k++) {  // 16 channels = 2 chunks per register
        const __m512i q8 = quantize16(_mm512_loadu_ps(x + 16 * k), qw + 4 * k, qa + 16 * k);
        if (book_offset != 0.f) off += book_offset * _mm512_reduce_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q8), _mm512_load_ps(qa + 16 * k)));
    }
    *offset = off;
}

// The rows of 16 consecutive tokens (NC dwords each: two rows per register for NC = 8, one for
// NC = 16) turned into NC registers, register c holding dword c of every token (lane t = token t):
// the layout vpdpbusd wants, without a gather (a 16-lane gather is a micro-coded 16 loads; at
// NC gathers per 16 tokens it cost more than the integer arithmetic). log2(NC) stages of
// two-source permutes: each merges two registers that hold the same chunks of different tokens
// and splits the union into its lower and upper chunks. The index vectors are worked out once,
// by following where every (token, chunk) element goes; tests/test_attention_routes.py checks
// the result (every route against the reference, contexts of 1000 tokens, head_dim 64 and 128).
template <int NC>
struct Transpose16 {
    static constexpr int STAGES = NC == 8 ? 3 : 4;
    alignas(64) int32_t idx[STAGES][NC][16];  // output o of a stage, lane l: lane of a (< 16) or b (16 +)
    // The butterfly: stage st makes outputs 2P and 2P + 1 from registers a and a + 2^st.
    static constexpr int pair_a(int st, int P) { return ((P >> st) << (st + 1)) | (P & ((1 << st) - 1)); }
    Transpose16() {
        int at[NC][16][2];  // [register][lane]: (token, chunk)
        for (int r = 0; r < NC; r++)
            for (int l = 0; l < 16; l++) at[r][l][0] = NC == 8 ? 2 * r + l / 8 : r, at[r][l][1] = NC == 8 ? l % 8 : l;
        for (int st = 0; st < STAGES; st++) {
            int next[NC][16][2];
            for (int P = 0; P < NC / 2; P++) {
                const int a = pair_a(st, P), b = a + (1 << st);
                int lanes[32];  // a's and b's lanes (b's as 16 +), sorted by (chunk, token)
                for (int l = 0; l < 32; l++) lanes[l] = l;
                auto key = [&](int l) { const int* e = l < 16 ? at[a][l] : at[b][l - 16]; return e[1] * 64 + e[0]; };
                std::sort(lanes, lanes + 32, [&](int x, int y) { return key(x) < key(y); });
                for (int h = 0; h < 2; h++)
                    for (int l = 0; l < 16; l++) {
                        const int from = lanes[16 * h + l];
                        const int* e = from < 16 ? at[a][from] : at[b][from - 16];
                        idx[st][2 * P + h][l] = from;
                        next[2 * P + h][l][0] = e[0], next[2 * P + h][l][1] = e[1];
                    }
            }
            std::memcpy(at, next, sizeof(at));
        }
    }
    // 16 rows from `rows` (16 NC consecutive dwords) -> w[c] (the butterfly leaves chunk c in
    // register c), unrolled so that the compiler sees every register index and keeps x in registers.
    void operator()(const int32_t* rows, __m512i* w) const {
        __m512i x[NC];
#pragma GCC unroll 16
        for (int r = 0; r < NC; r++) x[r] = _mm512_loadu_si512(rows + 16 * r);
        apply(x, w);
    }
    // The same for rows already in registers (x[r]: dwords 16 r .. 16 r + 15 of the 16 rows).
    void apply(__m512i* x, __m512i* w) const {
        __m512i y[NC];
#pragma GCC unroll 4
        for (int st = 0; st < STAGES; st++) {
#pragma GCC unroll 16
            for (int o = 0; o < NC; o++) {
                const int a = pair_a(st, o / 2);
                y[o] = _mm512_permutex2var_epi32(x[a], _mm512_load_si512(idx[st][o]), x[a + (1 << st)]);
            }
#pragma GCC unroll 16
            for (int o = 0; o < NC; o++) x[o] = y[o];
        }
#pragma GCC unroll 16
        for (int c = 0; c < NC; c++) w[c] = x[c];
    }
};

// A 16-bit codebook's levels as the bytes (H, Lo) of a chunk's low nibbles, then of its high
// ones: four lookups. At head_dim 64 (per_head) they are looked up again for every head: made
// once a chunk for all heads they were 32 registers the compiler kept on the stack, 6 loads a
// KV token, slower than a lookup per head. At head_dim 128 the chunk's codes alone fill the
// registers, and a lookup per head was slower there.
template <int NC>
struct Levels16 {
    static constexpr bool per_head = NC == 8;
    static void look_up(__m512i lut_h, __m512i lut_l, __m512i lo, __m512i hi, __m512i* b) {
        b[0] = _mm512_shuffle_epi8(lut_h, lo), b[1] = _mm512_shuffle_epi8(lut_l, lo);
        b[2] = _mm512_shuffle_epi8(lut_h, hi), b[3] = _mm512_shuffle_epi8(lut_l, hi);
    }
};

template <int NC, bool PIPELINED>
bool score_vnni(const RowSource& s, int64_t bh, int R, const float* q, int i0, int n, float* out, int ls, Prep& prep) {
    constexpr int D = 8 * NC, NV = D / 16;
    static_assert(sizeof(VnniQuery<NC>) <= sizeof(Prep::bytes), "Prep is too small");
    VnniQuery<NC>& st = *reinterpret_cast<VnniQuery<NC>*>(prep.bytes);
    static const Transpose16<NC> transpose;
    const bool channel = s.kind == ROW_CHANNEL, book = s.codebook != nullptr, narrow = s.bits < 4;
    const int row_bytes = s.bits * D / 8;
    // A codebook's 16-bit levels (levels16), offset to U = L16 + 2048 in [1, 4095] and split into
    // bytes U = 256 H + Lo: one vpshufb table each, two vpdpbusd per chunk, and the offset's
    // share 2048 sum(q8) taken back out (st.offset).
    __m512i lut_h = _mm512_setzero_si512(), lut_l = _mm512_setzero_si512();
    float level_step = 1.f;  // a codebook level is level_step * L16 (or L8)
    // Books whose int8 levels stay within 0.5% of every level (levels8) are read as bytes
    // U = L8 + 128 instead: one table, one vpdpbusd per nibble half, 128 sum(q8) taken back out.
    const SmallLevels& bl = small_levels(book ? s.codebook : nullptr, 1 << s.bits, 96, 127);
    const int8_t* l8 = bl.l8;
    const float t8 = bl.t, worst = book ? bl.worst : 1.f;
    const bool byte_levels = book && worst <= 0.005f;
    if (byte_levels) {
        alignas(64) uint8_t tb[64];
        for (int j = 0; j < 64; j++) tb[j] = (uint8_t)(128 + l8[j % 16]);
        lut_l = _mm512_load_si512(tb), level_step = t8;
    } else if (book) {
        int16_t l16[16];
        level_step = levels16(s.codebook, 1 << s.bits, l16);
        for (int l = 1 << s.bits; l < 16; l++) l16[l] = 0;  // codes past the book's levels never occur
        alignas(64) uint8_t th[64], tl[64];
        for (int j = 0; j < 64; j++) {
            const int u = 2048 + l16[j % 16];
            th[j] = (uint8_t)(u >> 8), tl[j] = (uint8_t)(u & 255);
        }
        lut_h = _mm512_load_si512(th), lut_l = _mm512_load_si512(tl);
    }
    if (!prep.ready) {
        if (!channel)
            for (int r = 0; r < R; r++) {
                quantize_chunks<NC>(q + r * D, st.qw[r], st.qa[r], &st.offset[r], byte_levels ? 128.f : book ? 2048.f : 0.f);
                __m512 sum = _mm512_setzero_ps();
                for (int k = 0; k < NV; k++) sum = _mm512_add_ps(sum, _mm512_loadu_ps(q + r * D + 16 * k));
                st.qsum[r] = _mm512_reduce_add_ps(sum);
            }
        prep.ready = true, prep.group = -1;
    }
    const __m512i nib = _mm512_set1_epi8(15);
    const int words = D / 8;  // 4-byte words per row: one per chunk
    // 16 rows of 2- or 3-bit codes (row[t]: token t's) -> the transposed chunk registers, as 4-bit rows
    auto widened = [&](const uint8_t* const* row, __m512i* w) __attribute__((always_inline)) {
#if MINILLAMA_VBMI
        __m512i x[NC];
        narrow_rows<NC>(row, s.bits, x);
        transpose.apply(x, w);
#else
        (void)row, (void)w;  // never called: without VBMI vnni_keys refuses 2- and 3-bit rows
#endif
    };
    // 16 consecutive rows from ring slot `first` (of this head) -> the transposed chunk registers
    auto whole_rows = [&](int64_t first, __m512i* w) __attribute__((always_inline)) {
        if (narrow) {
            const uint8_t* row[16];
            for (int t = 0; t < 16; t++) row[t] = (const uint8_t*)s.data + (first + t) * (int64_t)row_bytes;
            widened(row, w);
        } else {
            transpose((const int32_t*)s.data + first * words, w);
        }
    };
    // Software pipelining (PIPELINED: head_dim 64, 2- and 3-bit keys; a build of its own, as the
    // ahead registers change the allocation): the next chunk's rows widened and transposed before
    // this chunk's dot products, so that those find their inputs ready while the next chunk's long
    // chain of unpacks and permutes runs beside them. For 4-bit rows (a shorter chain: loads and
    // three permute stages) the eight more live registers cost spills that outweigh it.
    static_assert(!PIPELINED || NC == 8, "pipelined at head_dim 64 only");
    __m512i ahead[NC];
    bool have_ahead = false;
    // The tokens of the chunk from token `from`: 16, fewer at the end and, for per-channel keys,
    // at the end of a group of tokens (a chunk never spans two groups' scales)
    auto chunk_len = [&](int from) {
        const int len = std::min(16, i0 + n - from);
        return channel ? std::min(len, (from / s.group + 1) * s.group - from) : len;
    };
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n;) {
        const int len = chunk_len(i);
        if (channel) {
            const int g = i / s.group;
            if (g != prep.group) {  // fold this group's scales into the query, its zeros into qz
                prep.group = g;
                const int64_t row = (bh * s.sslots + (s.sstart + g) % s.sslots) * D;
                __m512 sc[NV], zc[NV];  // the group's per-channel scales and zeros, read once for every head
                for (int k = 0; k < NV; k++)
                    sc[k] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s.scale + row + 16 * k))),
                    zc[k] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s.zero + row + 16 * k)));
                for (int r = 0; r < R; r++) {
                    __m512 z = _mm512_setzero_ps();
                    for (int k = 0; k < NV; k++) {
                        const __m512 qk = _mm512_loadu_ps(q + r * D + 16 * k);
                        quantize16(_mm512_mul_ps(qk, sc[k]), st.qw[r] + 4 * k, st.qa[r] + 16 * k);
                        z = _mm512_fmadd_ps(qk, zc[k], z);
                    }
                    st.qz[r] = _mm512_reduce_add_ps(z);
                }
            }
        }
        prefetch_rows(s, bh, at.slot, 32, 16, row_bytes, channel ? 0 : 1);  // two chunks ahead
        prefetch_rows<_MM_HINT_T1>(s, bh, at.slot, 256, 16, row_bytes, 0);  // and sixteen ahead into L2
        const bool whole = len == 16 && at.slot + 16 <= s.slots;  // 16 consecutive rows: transposed, not gathered
        alignas(64) int32_t slot[16];  // 2- and 3-bit rows of a short or wrapping chunk: each token's ring slot
        if (narrow && !whole) {
            Cursor c = at;
            for (int t = 0; t < len; t++) slot[t] = c.slot, c.next();
        }
        // Where each of the 16 tokens' rows starts, in 4-byte words (a short chunk repeats a row).
        __m512i base = _mm512_setzero_si512();
        alignas(64) float tscale[16] = {0.f}, tzero[16] = {0.f};
        const int64_t whole_first = bh * s.slots + at.slot;
        if (whole) {
            if (!channel) {
                _mm512_store_ps(tscale, scales16(s, whole_first, 0xFFFF));
                if (s.zero) _mm512_store_ps(tzero, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s.zero + whole_first))));
            }
            for (int t = 0; t < 16; t++) at.next();
        } else if (at.slot + len <= s.slots) {
            const int64_t first = bh * s.slots + at.slot;
            base = _mm512_mullo_epi32(_mm512_min_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                       _mm512_set1_epi32(len - 1)), _mm512_set1_epi32(words));
            base = _mm512_add_epi32(base, _mm512_set1_epi32((int32_t)(first * words)));
            if (!channel)
                for (int t = 0; t < len; t++)
                    tscale[t] = scale_of(s, first + t), tzero[t] = s.zero ? half_to_float(s.zero[first + t]) : 0.f;
            for (int t = 0; t < len; t++) at.next();
        } else {  // the ring wraps inside the chunk
            alignas(64) int32_t index[16];
            for (int t = 0; t < 16; t++) {
                const int64_t slot = bh * s.slots + at.slot;
                index[t] = (int32_t)(slot * words);
                if (t < len) {
                    if (!channel) tscale[t] = scale_of(s, slot), tzero[t] = s.zero ? half_to_float(s.zero[slot]) : 0.f;
                    if (t < len - 1) at.next();
                }
            }
            at.next();
            base = _mm512_load_si512(index);
        }
        __m512i lo[NC], hi[NC], rows[NC];
        alignas(64) __m512i bytes[Levels16<NC>::per_head ? 1 : NC][4];  // head_dim 128: a 16-bit codebook's level bytes
        if (whole && have_ahead) {
            for (int c = 0; c < NC; c++) rows[c] = ahead[c];
        } else if (whole) {
            whole_rows(whole_first, rows);
        } else if (narrow) {  // widened to 4-bit rows first (a short chunk repeats its last row)
            const uint8_t* row[16];
            for (int t = 0; t < 16; t++) row[t] = (const uint8_t*)s.data + (bh * s.slots + slot[std::min(t, len - 1)]) * (int64_t)row_bytes;
            widened(row, rows);
        }
        have_ahead = false;  // the next chunk's rows, if it is whole (PIPELINED, above)
        if (PIPELINED && i + len < i0 + n) {
            if (chunk_len(i + len) == 16 && at.slot + 16 <= s.slots) whole_rows(bh * s.slots + at.slot, ahead), have_ahead = true;
        }
        for (int c = 0; c < NC; c++) {
            const __m512i w = whole || narrow ? rows[c] : _mm512_i32gather_epi32(_mm512_add_epi32(base, _mm512_set1_epi32(c)), s.data, 4);
            lo[c] = _mm512_and_si512(w, nib);
            hi[c] = _mm512_and_si512(_mm512_srli_epi32(w, 4), nib);
            if (byte_levels) {
                lo[c] = _mm512_shuffle_epi8(lut_l, lo[c]), hi[c] = _mm512_shuffle_epi8(lut_l, hi[c]);
            } else if (book) {
                if constexpr (!Levels16<NC>::per_head) Levels16<NC>::look_up(lut_h, lut_l, lo[c], hi[c], bytes[c]);
            }
        }
        const __mmask16 keep = (__mmask16)((1u << len) - 1);
        for (int r = 0; r < R; r++) {
            __m512 f = _mm512_setzero_ps();
            for (int c = 0; c < NC; c++) {
                const __m512i qe = _mm512_set1_epi32(st.qw[r][2 * c]), qo = _mm512_set1_epi32(st.qw[r][2 * c + 1]);
                __m512i acc;
                if (book && !byte_levels) {  // sum q8 U = 256 sum q8 H + sum q8 Lo
                    __m512i b[4];
                    if constexpr (Levels16<NC>::per_head)
                        Levels16<NC>::look_up(lut_h, lut_l, lo[c], hi[c], b);
                    else
                        for (int k = 0; k < 4; k++) b[k] = bytes[c][k];
                    __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), b[0], qe);
                    __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), b[1], qe);
                    h = _mm512_dpbusd_epi32(h, b[2], qo), l = _mm512_dpbusd_epi32(l, b[3], qo);
                    acc = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
                } else {
                    acc = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[c], qe), hi[c], qo);
                }
                f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(st.qa[r][8 * c]), f);
            }
            if (book) f = _mm512_sub_ps(f, _mm512_set1_ps(st.offset[r]));
            if (channel) {
                f = _mm512_add_ps(f, _mm512_set1_ps(st.qz[r]));
            } else {
                f = _mm512_mul_ps(f, _mm512_mul_ps(_mm512_load_ps(tscale), _mm512_set1_ps(level_step)));
                f = _mm512_fmadd_ps(_mm512_load_ps(tzero), _mm512_set1_ps(st.qsum[r]), f);
            }
            _mm512_mask_storeu_ps(out + (int64_t)r * ls + (i - i0), keep, f);
        }
        i += len;
    }
    return true;
}

// Integer values for 2/3/4/8-bit affine per-token codes, or codebooks of up to 16 levels, with
// groups of 16 channels or more: o_d = sum_t w_tg c_td + sum_t p_t z_tg, w_tg = p_t s_tg (c the
// code, or its level L16 for a codebook, which has no zeros).
//
// Per sub-block of 32 tokens, each head's weights w_tg become int16, w ~= b w16 with b =
// max_t w_tg / 32767 per head and group (plain rounding: a weight is off by at most b/2, which is
// max w / 65534 -- the softmax's long tail is kept, no error diffusion needed at this width). Two
// tokens' codes of one channel share a 32-bit lane as int16 (c_t | c_t+1 << 16), made from the
// packed bytes without unpacking a row (pair_fields), so vpdpwssd with the pair's weight dword
// (w16_t | w16_t+1 << 16) adds both tokens' products into the channel's lane: no horizontal
// sums, 32 multiply-adds per instruction. The int32 sums (at most 32 tokens x 255 x 32767)
// become floats once per sub-block, times b; the channels come back in order once per call.

#if !MINILLAMA_VBMI
// Without vpermb, 3-bit rows (8 codes per 3 bytes, lowest bits first) are unpacked to D bytes in
// channel order first and paired as bytes (pair_fields<8>).
inline void unpack3(const uint8_t* row, int D, uint8_t* __restrict__ out) {
    for (int j = 0; j < D / 8; j++) {
        const uint32_t w = row[3 * j] | (row[3 * j + 1] << 8) | (row[3 * j + 2] << 16);
        for (int k = 0; k < 8; k++) out[8 * j + k] = (w >> (3 * k)) & 7;
    }
}
#endif

// The int16 weights of one head and group over a sub-block of 32 tokens: w_t = p_t s_t (zero
// past `len`), w16 = round(w / b) with b = max |w| / 32767; returns b, and adds the lanes of
// p_t z_t to zacc (summed across lanes once per call). The max reaches every lane by in-lane
// shuffles and 1/b is a refined reciprocal: no scalar reduction, division or broadcast on the
// way to the int16 weights, which run per head, group and 32 tokens.
inline float weights16(const float* p, const float* sc, const float* zc, int len, __m512i* w16, __m512* zacc) {
    const __mmask16 m0 = (__mmask16)(len >= 16 ? 0xFFFF : (1u << len) - 1);
    const __mmask16 m1 = (__mmask16)(len >= 32 ? 0xFFFF : len > 16 ? (1u << (len - 16)) - 1 : 0);
    const __m512 p0 = _mm512_maskz_loadu_ps(m0, p), p1 = _mm512_maskz_loadu_ps(m1, p + 16);
    const __m512 w0 = _mm512_mul_ps(p0, _mm512_loadu_ps(sc)), w1 = _mm512_mul_ps(p1, _mm512_loadu_ps(sc + 16));
    *zacc = _mm512_fmadd_ps(p0, _mm512_loadu_ps(zc), _mm512_fmadd_ps(p1, _mm512_loadu_ps(zc + 16), *zacc));
    __m512 m = max_per_8(_mm512_max_ps(_mm512_abs_ps(w0), _mm512_abs_ps(w1)));
    m = _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, 0x4E));  // every lane: max |w|
    const __m512 b = _mm512_mul_ps(_mm512_max_ps(m, _mm512_set1_ps(1e-30f)), _mm512_set1_ps(1.f / 32767.f));
    const __m512 inv = reciprocal(b);  // |w inv| <= 32767 (1 + 2^-22): cvt rounds within int16
    const __m256i lo = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(w0, inv)));
    const __m256i hi = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(w1, inv)));
    *w16 = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // 32 int16: token t in lane t
    return _mm512_cvtss_f32(b);
}

// Two tokens' packed rows (2 NV BITS bytes each) -> NV registers of int16 pairs (c_t,d | c_t+1,d << 16),
// straight from the packed bytes: 16-byte piece m of both rows is interleaved byte by byte and
// widened (dword j = bytes j of x and y), then its F = 8 / BITS fields are split by shift and mask.
// Register K = F m + k, lane j holds channel (16 m + j) F + k: the decode order of channel_of for
// 2- and 4-bit codes, natural order for bytes.
template <int BITS, int NV>
inline void pair_fields(const uint8_t* x, const uint8_t* y, __m512i* f) {
    constexpr int F = 8 / BITS, NP = NV / F;
    const __m512i mask = _mm512_set1_epi16((1 << BITS) - 1);
    for (int m = 0; m < NP; m++) {
        const __m128i a = _mm_loadu_si128((const __m128i*)(x + 16 * m)), b = _mm_loadu_si128((const __m128i*)(y + 16 * m));
        const __m512i z = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
        for (int k = 0; k < F; k++) f[F * m + k] = BITS == 8 ? z : _mm512_and_si512(_mm512_srli_epi16(z, BITS * k), mask);
    }
}

#if MINILLAMA_VBMI
// Two tokens' 3-bit rows -> NV pair registers as pair_fields<8> makes them from bytes (register
// m, lane j: channel 16 m + j), each by one two-source byte permute with the odd bytes zeroed.
template <int NV>
inline void pair_codes3(const uint8_t* x, const uint8_t* y, __m512i* f) {
    struct Index {  // constant-initialized: no guard, so no call the caller's loop must save registers around
        uint8_t b[4][64];
        constexpr Index() : b{} {
            for (int m = 0; m < 4; m++)
                for (int j = 0; j < 16; j++) b[m][4 * j] = (uint8_t)(16 * m + j), b[m][4 * j + 2] = (uint8_t)(64 + 16 * m + j), b[m][4 * j + 1] = b[m][4 * j + 3] = 0;
        }
    };
    alignas(64) static constexpr Index index{};
    for (int h = 0; h < NV / 4; h++) {  // 64 channels at a time
        const __m512i a = codes<3>(x + 24 * h), c = codes<3>(y + 24 * h);
        for (int m = 0; m < 4; m++)
            f[4 * h + m] = _mm512_maskz_permutex2var_epi8((__mmask64)0x5555555555555555ull, a, _mm512_load_si512(index.b[m]), c);
    }
}
#endif

// acc += x . w as int16 pairs (vpdpwssd) in inline asm: with the intrinsic GCC 12 copies the
// accumulator to a fresh register and back around most multiply-adds of a tile, or keeps the
// tile's accumulators on the stack (the accumulator passed by value and returned, so it stays a
// register).
inline __attribute__((always_inline)) __m512i dpwssd(__m512i acc, __m512i x, __m512i w) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
    return acc;
}

// acc[r][K] += pairs x the head's pair weights for RT query heads from r, their accumulators in
// registers (a runtime head count leaves them in memory: a load and a store per multiply-add).
// wq[r] holds pair i's weight dwords at i NG (one per group); piece m's lanes take their group's (gidx[m]),
// one permute per piece, head and pair, shared by the piece's F registers. Then out += acc b.
template <int NV, int F, int RT, bool ONE, typename Pairs>
inline void pair_heads(const Pairs& pairs, int npairs, const int32_t (*wq)[8 * 16 + 16], int NG, const float (*b)[16],
                       const __m512i* gidx, __m512 (*out)[NV]) {
    constexpr int NP = NV / F;
    __m512i acc[RT][NV];
    for (int r = 0; r < RT; r++)
        for (int k = 0; k < NV; k++) acc[r][k] = _mm512_setzero_si512();
    // One loop body per case (ONE: one group per row): with both paths in the loop GCC kept a
    // copy of every accumulator in memory, a store per multiply-add.
    for (int i = 0; i < npairs; i++) {
        __m512i w[RT], x[NV];
        pairs(i, x);
        if (ONE) {  // one broadcast per head serves every piece
            for (int r = 0; r < RT; r++) w[r] = _mm512_set1_epi32(wq[r][i]);
            for (int k = 0; k < NV; k++)
                for (int r = 0; r < RT; r++) acc[r][k] = dpwssd(acc[r][k], x[k], w[r]);
        } else {
            for (int m = 0; m < NP; m++) {
                for (int r = 0; r < RT; r++) w[r] = _mm512_permutexvar_epi32(gidx[m], _mm512_loadu_si512(wq[r] + i * NG));
                for (int k = 0; k < F; k++)
                    for (int r = 0; r < RT; r++) acc[r][F * m + k] = dpwssd(acc[r][F * m + k], x[F * m + k], w[r]);
            }
        }
    }
    for (int r = 0; r < RT; r++)
        for (int m = 0; m < NP; m++) {
            const __m512 bm = _mm512_permutexvar_ps(gidx[m], _mm512_loadu_ps(b[r]));
            for (int k = 0; k < F; k++)
                out[r][F * m + k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][F * m + k]), bm, out[r][F * m + k]);
        }
}

template <int NV, int F, int RT, typename Pairs>
inline void pair_heads(const Pairs& pairs, int npairs, const int32_t (*wq)[8 * 16 + 16], int NG, const float (*b)[16],
                       const __m512i* gidx, __m512 (*out)[NV]) {
    if (NG == 1) return pair_heads<NV, F, RT, true>(pairs, npairs, wq, NG, b, gidx, out);
    pair_heads<NV, F, RT, false>(pairs, npairs, wq, NG, b, gidx, out);
}

// Every head through pair_heads, in tiles of up to T = tile_heads(NV) heads: the accumulators and
// one weight register per head, of 32 registers (29 / (NV + 1)), but 4 at head_dim 64, where 8
// heads make two even tiles (5 and 3 were no faster).
// pairs(i, x) puts pair i's NV registers in x.
constexpr int tile_heads(int NV) { return NV == 4 ? 4 : 29 / (NV + 1); }

template <int NV, int F, typename Pairs>
inline void pair_all(const Pairs& pairs, int npairs, const int32_t (*wq)[8 * 16 + 16], int NG, const float (*b)[16],
                     const __m512i* gidx, __m512 (*out)[NV], int R) {
    constexpr int T = tile_heads(NV);
    int r = 0;
    for (; r + T <= R; r += T) pair_heads<NV, F, T>(pairs, npairs, wq + r, NG, b + r, gidx, out + r);
    switch (R - r) {
        case 0: return;
        case 1: return pair_heads<NV, F, 1>(pairs, npairs, wq + r, NG, b + r, gidx, out + r);
        case 2: return pair_heads<NV, F, (T > 2 ? 2 : 1)>(pairs, npairs, wq + r, NG, b + r, gidx, out + r);
        case 3: return pair_heads<NV, F, (T > 3 ? 3 : 1)>(pairs, npairs, wq + r, NG, b + r, gidx, out + r);
        default: return pair_heads<NV, F, (T > 4 ? 4 : 1)>(pairs, npairs, wq + r, NG, b + r, gidx, out + r);
    }
}

// Sign-structured vector codes (ROW_VECTOR, nlevels 16: code k = 16 s + p, vector = pattern p with
// coordinate c negated where bit c of s is set): two tokens' rows -> NV pair registers as
// pair_fields<8> makes them from bytes (register m, lane j: channel 16 m + j), in registers.
// The 16 patterns' 64 int16 levels are two tables of one vpermi2w; each code is spread to the 8
// int16 lanes of its 4 channels x 2 tokens by one vpermw (lane l of register m: channel
// 16 m + l / 2 of token l % 2), carrying 4 p in bits 2-5 and s in bits 8-11, so the lookup
// index is that | c and the sign is a bit test.
template <int NV>
inline void pair_signed(const uint8_t* x, const uint8_t* y, __m512i t0, __m512i t1, __m512i* f) {
    struct Index {
        int16_t spread[4][32], channel[32], sign[32];
        constexpr Index() : spread{}, channel{}, sign{} {
            for (int l = 0; l < 32; l++) {
                for (int m = 0; m < 4; m++) spread[m][l] = (int16_t)((l % 2) * 16 + 4 * m + l / 8);
                channel[l] = (int16_t)((l / 2) % 4), sign[l] = (int16_t)(256 << ((l / 2) % 4));
            }
        }
    };
    alignas(64) static constexpr Index index{};
    const __m512i channel = _mm512_load_si512(index.channel), sign = _mm512_load_si512(index.sign);
    for (int h = 0; h < NV / 4; h++) {  // 64 channels = 16 codes of each token
        const __m256i codes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(x + 16 * h))),
                                                      _mm_loadu_si128((const __m128i*)(y + 16 * h)), 1);
        const __m512i c = _mm512_cvtepu8_epi16(codes);  // lanes 0-15: x's codes, 16-31: y's
        const __m512i v = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(15)), 2),
                                          _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0xF0)), 4));
        for (int m = 0; m < 4; m++) {
            const __m512i spread = _mm512_permutexvar_epi16(_mm512_load_si512(index.spread[m]), v);
            const __m512i level = _mm512_permutex2var_epi16(t0, _mm512_or_si512(spread, channel), t1);
            f[4 * h + m] = _mm512_mask_sub_epi16(level, _mm512_test_epi16_mask(spread, sign), _mm512_setzero_si512(), level);
        }
    }
}

// Two tokens' rows -> their NV pair registers: 3-bit codes through pair_codes3 (VBMI), else
// pair_fields of the packed bytes (PB: the code width, 8 for 3-bit rows unpacked to bytes);
// a codebook's levels replace the codes (vpermw on the int16 lanes).
template <int BITS, int PB, int NV>
inline void make_pair(const uint8_t* x, const uint8_t* y, bool book, __m512i lut, __m512i* f) {
#if MINILLAMA_VBMI
    if (BITS == 3)
        pair_codes3<NV>(x, y, f);
    else
#endif
        pair_fields<PB, NV>(x, y, f);
    if (book)
        for (int k = 0; k < NV; k++) f[k] = _mm512_permutexvar_epi16(f[k], lut);
}

// BITS: the stored code width; 3-bit rows are paired by pair_codes3, or without VBMI unpacked to
// bytes first and paired as 8-bit ones (PB: the width pair_fields sees). VEC: vector codes, one
// byte per 4 channels of a sign x 16-pattern book (pair_signed, its 64 pattern numbers as int16).
template <int BITS, int NV, bool VEC = false>
bool value_vnni(const RowSource& s, int64_t bh, int R, const float* p, int lp, int i0, int n, float* acc_out) {
    constexpr int D = 16 * NV, SB = 32, PB = VEC || BITS == 3 ? 8 : BITS, F = 8 / PB, NP = NV / F;
    const int G = s.group, NG = D / G;
    __m512i gidx[NP];  // lane j of piece m: the group of its channels
    // A codebook's 16-bit levels (levels16), looked up per 16-bit lane (vpermw).
    const bool book = !VEC && s.codebook != nullptr;
    __m512i lut = _mm512_setzero_si512();
    float level_step = 1.f;
    __m512i patterns[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // sign x pattern book: 64 int16
    if (VEC) {
        alignas(64) int16_t t[64];
        level_step = levels16(s.codebook, 64, t);  // vectors 0..15: the patterns, every sign positive
        patterns[0] = _mm512_load_si512(t), patterns[1] = _mm512_load_si512(t + 32);
    }
    if (book) {
        alignas(64) int16_t t[32] = {0};
        level_step = levels16(s.codebook, 1 << BITS, t);
        lut = _mm512_load_si512(t);
    }
    for (int m = 0, g = 0; m < NP; m++) {  // counted, not divided: 32 divisions a call cost ~3 cycles a token
        alignas(64) int32_t t[16];
        for (int j = 0; j < 16; j++) {
            while ((16 * m + j) * F >= (g + 1) * G) g++;
            t[j] = g;
        }
        gidx[m] = _mm512_load_si512(t);
    }
    alignas(64) __m512 out[16][NV];  // [head][register]: float sums in decode order
    __m512 zacc[16][8];  // [head][group]: the lanes of sum_t p_t z_tg
    alignas(64) float zsum[16][16] = {{0.f}};  // [head][group]: sum_t p_t z_tg
    for (int r = 0; r < R; r++) {
        for (int k = 0; k < NV; k++) out[r][k] = _mm512_setzero_ps();
        for (int g = 0; g < NG; g++) zacc[r][g] = _mm512_setzero_ps();
    }
#if !MINILLAMA_VBMI
    alignas(64) uint8_t rows[SB][128];  // 3-bit rows unpacked to bytes
#endif
    alignas(64) __m512i pairs[SB / 2][NV];  // pair_fields of tokens 2i, 2i + 1
    __m512i w16[8];                         // one head's int16 weights per group (32 tokens each)
    alignas(64) int32_t wq[16][8 * SB / 2 + 16];  // [head][pair q][group g] at q NG + g: the pair's weight dword
    alignas(64) float b[16][16] = {{0.f}};  // [head][group]: the int16 step
    constexpr int RB = VEC ? D / 4 : D * BITS / 8;
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n; i += SB) {
        const int len = std::min(SB, i0 + n - i);
        prefetch_rows(s, bh, at.slot, SB, SB, RB, NG);  // the next sub-block
        alignas(64) float sc[8][SB], zc[8][SB];         // [group][token], zero past len
        const int64_t first = bh * s.slots + at.slot;
        const bool straight = at.slot + len <= s.slots;  // the sub-block's rows are consecutive slots
        if (straight && NG <= 2 && len == SB) {  // 16 tokens' NG scales at a time, split by group
            const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
            auto load16 = [&](int m, int64_t j) {  // 16 scales (m = 0) or zeros (1) from index j
                return m ? halves16(s.zero + j, 0xFFFF) : scales16(s, j, 0xFFFF);
            };
            for (int m = 0; m < 2; m++) {
                float(*dst)[SB] = m ? zc : sc;
                for (int h = 0; h < SB; h += 16) {
                    if (m && !s.zero) {  // a codebook without zeros
                        for (int g = 0; g < NG; g++) _mm512_store_ps(dst[g] + h, _mm512_setzero_ps());
                        continue;
                    }
                    const __m512 a = load16(m, first * NG + NG * h);
                    if (NG == 1) {
                        _mm512_store_ps(dst[0] + h, a);
                        continue;
                    }
                    const __m512 c = load16(m, first * NG + NG * h + 16);
                    _mm512_store_ps(dst[0] + h, _mm512_permutex2var_ps(a, even, c));
                    _mm512_store_ps(dst[1] + h, _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), c));
                }
            }
        } else {
            Cursor c = at;
            for (int t = 0; t < SB; t++) {
                const int64_t slot = bh * s.slots + c.slot;
                if (t < len) c.next();
                for (int g = 0; g < NG; g++)
                    sc[g][t] = t < len ? scale_of(s, slot * NG + g) : 0.f,
                    zc[g][t] = t < len && s.zero ? half_to_float(s.zero[slot * NG + g]) : 0.f;
            }
        }
        alignas(64) static const uint8_t zeros[128] = {0};
        const uint8_t* row[SB + 1];  // each token's packed row; an odd last token pairs with zeros
        if (straight) {  // consecutive slots: no cursor per token
            const uint8_t* base = (const uint8_t*)s.data + first * RB;
            for (int t = 0; t < len; t++) row[t] = base + t * RB;
            at.skip(len);
        } else {
            for (int t = 0; t < len; t++) row[t] = (const uint8_t*)s.data + (bh * s.slots + at.slot) * RB, at.next();
        }
#if !MINILLAMA_VBMI
        if (BITS == 3)
            for (int t = 0; t < len; t++) unpack3(row[t], D, rows[t]), row[t] = rows[t];
#endif
        row[len] = zeros;
        for (int r = 0; r < R; r++) {
            for (int g = 0; g < NG; g++)
                b[r][g] = level_step * weights16(p + (int64_t)r * lp + (i - i0), sc[g], zc[g], len, &w16[g], &zacc[r][g]);
            int32_t* dst = wq[r];  // pair q's dword of group g at q NG + g (pair q: tokens 2q, 2q + 1)
            if (NG == 1) {
                _mm512_store_si512(dst, w16[0]);
            } else if (NG == 2) {  // interleave the two groups' pair dwords, in registers
                const __m512i lo = _mm512_unpacklo_epi32(w16[0], w16[1]);  // per 128-bit lane: pairs 4l, 4l + 1
                const __m512i hi = _mm512_unpackhi_epi32(w16[0], w16[1]);  // pairs 4l + 2, 4l + 3
                const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
                _mm512_store_si512(dst, _mm512_permutex2var_epi32(lo, first, hi));
                _mm512_store_si512(dst + 16, _mm512_permutex2var_epi32(lo, _mm512_add_epi32(first, _mm512_set1_epi32(8)), hi));
            } else {
                alignas(64) int32_t dwords[8][SB / 2];  // [group][pair]
                for (int g = 0; g < NG; g++) _mm512_store_si512(dwords[g], w16[g]);
                for (int q = 0; q < SB / 2; q++)
                    for (int g = 0; g < NG; g++) dst[q * NG + g] = dwords[g][q];
            }
        }
        const int npairs = (len + 1) / 2;
        auto make = [&](int q, __m512i* f) __attribute__((always_inline)) {  // pair q's NV registers
            if (VEC)
                pair_signed<NV>(row[2 * q], row[2 * q + 1], patterns[0], patterns[1], f);
            else
                make_pair<BITS, PB, NV>(row[2 * q], row[2 * q + 1], book, lut, f);
        };
        if (R <= tile_heads(NV)) {  // one tile of heads: each pair made in registers, used at once
            pair_all<NV, F>(make, npairs, wq, NG, b, gidx, out, R);
        } else {  // several tiles: the pairs made once, read back from L1 by each tile
            for (int q = 0; q < npairs; q++) make(q, pairs[q]);
            auto load = [&](int q, __m512i* f) __attribute__((always_inline)) {
                for (int k = 0; k < NV; k++) f[k] = _mm512_load_si512(&pairs[q][k]);
            };
            pair_all<NV, F>(load, npairs, wq, NG, b, gidx, out, R);
        }
    }
    struct Order {  // channel c sits at lane j of register F m + k of the sums: c = (16 m + j) F + k
        alignas(64) int32_t idx[D];
        constexpr Order() : idx{} {
            for (int c = 0; c < D; c++) idx[c] = (F * (c / (16 * F)) + c % F) * 16 + (c % (16 * F)) / F;
        }
    };
    static constexpr Order order{};
    for (int r = 0; r < R; r++) {  // back to channel order, with the zeros' share
        for (int g = 0; g < NG; g++) zsum[r][g] = _mm512_reduce_add_ps(zacc[r][g]);
        alignas(64) float o[NV][16];
        for (int m = 0; m < NP; m++) {
            const __m512 z = _mm512_permutexvar_ps(gidx[m], _mm512_loadu_ps(zsum[r]));
            for (int k = 0; k < F; k++) _mm512_store_ps(o[F * m + k], _mm512_add_ps(out[r][F * m + k], z));
        }
        float* dst = acc_out + (size_t)r * D;
        for (int n = 0; n < NV; n++)  // channels 16 n .. 16 n + 15, gathered from the decode order
            _mm512_storeu_ps(dst + 16 * n, _mm512_add_ps(_mm512_loadu_ps(dst + 16 * n),
                                                         _mm512_i32gather_ps(_mm512_load_si512(order.idx + 16 * n), &o[0][0], 4)));
    }
    return true;
}

#if MINILLAMA_VBMI
// Integer scores of keys in RoPE frequency blocks (ROW_BLOCKS; kv/freq_blocks.py: lm{b}f{nb}) at
// head_dim 64, every block's width at most 4: score_vnni's arithmetic with a book and a scale per
// block. Block b of head h holds 64 / nb channels at its own width w_b (0-4), the blocks' codes
// one little-endian bit stream, and one byte scale: x = book_w[code] * scale_b. A row's 64 codes
// come out one byte each in three instructions (vpermb, vpmultishiftqb, a mask: the operands
// avx512_attention.cpp's whole-row decode makes, built per head here), are packed two to a byte as
// the 4-bit rows score_vnni reads and transposed sixteen tokens at a time (Transpose16); each
// chunk of 8 channels looks its levels up in its own block's book -- bytes where every block's
// book keeps its levels within 0.5% (widths 1-3), else 16-bit levels (levels16: a 4-bit block) --
// and vpdpbusd sums them against the int8 query. A block's chunks are summed in float, less the
// offset's share, times the block's level step and each token's scale of that block. The bound
// is score_vnni's, block by block: a score is off by at most
// sum_b s_tb sum_{d in b} (a_c / 2 (|L_d| + e_d) + |q_d| e_d) (tests/test_integer_attention.py).
struct BlockBooks {  // a width's book as the integer kernels read it (levels8, levels16), made once a thread
    float book[16];
    int8_t l8[16];
    int16_t l16[16];
    float t8, t16, worst;
    bool made = false;
};

static const BlockBooks& block_book(const float* codebook, int w) {
    static thread_local BlockBooks books[5];
    BlockBooks& b = books[w];
    const float* book = codebook + (1 << w) - 2;
    if (!b.made || std::memcmp(b.book, book, sizeof(float) << w)) {
        std::memcpy(b.book, book, sizeof(float) << w);
        b.t8 = levels8(book, 1 << w, 96, 127, b.l8, &b.worst);
        b.t16 = levels16(book, 1 << w, b.l16);
        b.made = true;
    }
    return b;
}

struct VnniBlocks {
    alignas(64) int32_t qw[16][16];  // the int8 queries as score_vnni lays them out (NC = 8)
    alignas(64) float qa[16][64];    // [head][channel]: its chunk's int8 step
    float offset[16][8];             // [head][block]: the unsigned offset's share, U0 sum_{d in b} a q8_d
    alignas(64) uint8_t spread[64], mask[64];  // the whole-row decode (rows.h: block_decode_operands)
    long long shifts[8];
    alignas(64) uint8_t lut_h[8][64], lut_l[8][64];  // [chunk]: its block's level bytes, vpshufb tables
    float step[8];                                   // [block]: a level is step * L8 (or L16)
    bool byte_levels;
};

bool score_vnni_blocks(const RowSource& s, int64_t bh, int R, const float* q, int i0, int n, float* out, int ls, Prep& prep) {
    constexpr int D = 64, NC = 8;
    static_assert(sizeof(VnniBlocks) <= sizeof(Prep::bytes), "Prep is too small");
    VnniBlocks& st = *reinterpret_cast<VnniBlocks*>(prep.bytes);
    static const Transpose16<NC> transpose;
    const int nb = s.nlevels, per = NC / nb, W = D * s.bits / 8;  // per: chunks a block
    const uint16_t* widths = s.levels + bh * nb;
    if (!prep.ready) {
        st.byte_levels = true;
        for (int b = 0; b < nb; b++)
            if (widths[b]) st.byte_levels = st.byte_levels && block_book(s.codebook, widths[b]).worst <= 0.005f;
        const int u0 = st.byte_levels ? 128 : 2048;  // U = L8 + 128, or L16 + 2048 in two bytes
        for (int b = 0; b < nb; b++) {
            const int w = widths[b];
            int16_t level[16] = {0};  // width 0: a dropped block reads as zeros
            st.step[b] = 1.f;
            if (w) {
                const BlockBooks& book = block_book(s.codebook, w);
                st.step[b] = st.byte_levels ? book.t8 : book.t16;
                for (int l = 0; l < (1 << w); l++) level[l] = st.byte_levels ? book.l8[l] : book.l16[l];
            }
            for (int c = b * per; c < (b + 1) * per; c++)
                for (int j = 0; j < 64; j++) {
                    const int u = u0 + level[j % 16];
                    st.lut_l[c][j] = (uint8_t)(u & 255), st.lut_h[c][j] = (uint8_t)(u >> 8);
                }
        }
        int base;  // one half of 64 channels: its codes start the row
        block_decode_operands(widths, nb, D, st.spread, st.mask, st.shifts, &base);
        for (int r = 0; r < R; r++) {
            for (int k = 0; k < NC / 2; k++) {  // 16 channels = 2 chunks per register
                alignas(64) int32_t q8[16];
                _mm512_store_si512(q8, quantize16(_mm512_loadu_ps(q + r * D + 16 * k), st.qw[r] + 4 * k, st.qa[r] + 16 * k));
                for (int h = 0; h < 2; h++) {  // chunk 2k + h, of block (2k + h) / per
                    float sum = 0.f;
                    for (int j = 0; j < 8; j++) sum += (float)q8[8 * h + j];
                    const int b = (2 * k + h) / per;
                    if ((2 * k + h) % per == 0) st.offset[r][b] = 0.f;
                    st.offset[r][b] += u0 * st.qa[r][16 * k + 8 * h] * sum;
                }
            }
        }
        prep.ready = true;
    }
    const __m512i spread = _mm512_load_si512(st.spread), mask = _mm512_load_si512(st.mask);
    const __m512i shifts = _mm512_loadu_si512(st.shifts), nib = _mm512_set1_epi8(15);
    const __mmask64 bytes = W >= 64 ? ~0ull : (1ull << W) - 1;
    // A row's 64 codes as score_vnni's 4-bit row: byte j = code 2j | code 2j + 1 << 4.
    auto nibbles = [&](const uint8_t* row) __attribute__((always_inline)) {
        const __m512i codes = _mm512_and_si512(
            _mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(spread, _mm512_maskz_loadu_epi8(bytes, row))), mask);
        return _mm512_cvtepi16_epi8(_mm512_maddubs_epi16(codes, _mm512_set1_epi16(0x1001)));
    };
    // Each block's scale of 16 consecutive tokens (nb <= 4: their 16 nb bytes in one register):
    // byte t nb + b of the tokens' scales to lane t, for every block b.
    alignas(64) static constexpr struct Deal {
        uint8_t idx[3][4][64];  // [nb / 2 for 2, 4][block]: vpermb index, 16 lanes
        constexpr Deal() : idx{} {
            for (int k = 1; k <= 2; k++)
                for (int b = 0; b < 2 * k; b++)
                    for (int t = 0; t < 16; t++) idx[k][b][t] = (uint8_t)(t * 2 * k + b);
        }
    } deal{};
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n;) {
        const int len = std::min(16, i0 + n - i);
        prefetch_rows(s, bh, at.slot, 32, 16, W, nb);  // two chunks ahead
        __m512 tscale[8];  // [block]: lane t, token t's scale of the block
        __m512i x[NC], w[NC];
        const int64_t first = bh * s.slots + at.slot;
        if (len == 16 && at.slot + 16 <= s.slots) {  // 16 consecutive rows
            const uint8_t* row = (const uint8_t*)s.data + first * W;
            for (int r = 0; r < NC; r++)
                x[r] = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles(row + 2 * r * W)), nibbles(row + (2 * r + 1) * W), 1);
            if (nb <= 4) {
                const __m512i all = _mm512_maskz_loadu_epi8(nb == 4 ? ~0ull : (1ull << (16 * nb)) - 1, s.scale8 + first * nb);
                for (int b = 0; b < nb; b++) {
                    const __m512i u = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(_mm512_permutexvar_epi8(_mm512_load_si512(deal.idx[nb / 2][b]), all)));
                    const __m512 frac = _mm512_permutexvar_ps(u, _mm512_loadu_ps(log_scales.t + 128));  // as log_scales16
                    tscale[b] = _mm512_scalef_ps(frac, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(u, 4), _mm512_set1_epi32(8))));
                }
            } else {
                for (int b = 0; b < nb; b++) {
                    alignas(64) float t16[16];
                    for (int t = 0; t < 16; t++) t16[t] = log_scales.t[s.scale8[(first + t) * nb + b]];
                    tscale[b] = _mm512_load_ps(t16);
                }
            }
            at.skip(16);
        } else {  // a short chunk (repeating its last row) or one where the ring wraps
            const uint8_t* row[16];
            alignas(64) float t16[8][16] = {};
            for (int t = 0; t < 16; t++) {
                const int64_t slot = bh * s.slots + at.slot;
                row[t] = (const uint8_t*)s.data + slot * W;
                if (t < len) {
                    for (int b = 0; b < nb; b++) t16[b][t] = log_scales.t[s.scale8[slot * nb + b]];
                    if (t < len - 1) at.next();
                }
            }
            at.next();
            for (int r = 0; r < NC; r++)
                x[r] = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles(row[2 * r])), nibbles(row[2 * r + 1]), 1);
            for (int b = 0; b < nb; b++) tscale[b] = _mm512_load_ps(t16[b]);
        }
        transpose.apply(x, w);
        __m512i lo[NC], hi[NC];
        for (int c = 0; c < NC; c++) {
            lo[c] = _mm512_and_si512(w[c], nib);
            hi[c] = _mm512_and_si512(_mm512_srli_epi32(w[c], 4), nib);
            if (st.byte_levels) {  // every head's levels the same: looked up once
                const __m512i tl = _mm512_load_si512(st.lut_l[c]);
                lo[c] = _mm512_shuffle_epi8(tl, lo[c]), hi[c] = _mm512_shuffle_epi8(tl, hi[c]);
            }
        }
        const __mmask16 tokens = (__mmask16)((1u << len) - 1);
        for (int r = 0; r < R; r++) {
            __m512 f = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                __m512 fb = _mm512_setzero_ps();
                for (int c = b * per; c < (b + 1) * per; c++) {
                    const __m512i qe = _mm512_set1_epi32(st.qw[r][2 * c]), qo = _mm512_set1_epi32(st.qw[r][2 * c + 1]);
                    __m512i acc;
                    if (st.byte_levels) {
                        acc = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[c], qe), hi[c], qo);
                    } else {  // sum q8 U = 256 sum q8 H + sum q8 Lo, the lookups per head (score_vnni's Levels16)
                        const __m512i th = _mm512_load_si512(st.lut_h[c]), tl = _mm512_load_si512(st.lut_l[c]);
                        __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_shuffle_epi8(th, lo[c]), qe);
                        __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_shuffle_epi8(tl, lo[c]), qe);
                        h = _mm512_dpbusd_epi32(h, _mm512_shuffle_epi8(th, hi[c]), qo);
                        l = _mm512_dpbusd_epi32(l, _mm512_shuffle_epi8(tl, hi[c]), qo);
                        acc = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
                    }
                    fb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(st.qa[r][8 * c]), fb);
                }
                fb = _mm512_mul_ps(_mm512_sub_ps(fb, _mm512_set1_ps(st.offset[r][b])), _mm512_set1_ps(st.step[b]));
                f = _mm512_fmadd_ps(fb, tscale[b], f);
            }
            _mm512_mask_storeu_ps(out + (int64_t)r * ls + (i - i0), tokens, f);
        }
        i += len;
    }
    return true;
}

// Whether score_vnni_blocks reads these block keys: head_dim 64, 2 to 8 blocks, every width 0-4.
static bool vnni_block_keys(const RowSource& s, int D) {
    if (D != 64 || s.kind != ROW_BLOCKS || !s.codebook || !s.levels || !s.scale8 || s.cos || s.center) return false;
    if (s.nlevels != 2 && s.nlevels != 4 && s.nlevels != 8) return false;
    return s.bits >= 1 && s.bits <= 4;  // each head's widths are checked by score_vnni's caller: block_widths_fit
}
#endif

}  // namespace

bool vnni_keys(const RowSource& s, int D) {
#if MINILLAMA_VBMI
    if (s.kind == ROW_BLOCKS) return vnni_block_keys(s, D);
#endif
    // Codebooks: bytes scaled to max |L| = 127 moved the small levels by up to 3% (3-bit
    // Lloyd-Max: 0.2451 -> 14/59), a bias, not noise, that perplexity showed; score_vnni takes
    // bytes only at a scale that holds every level within 0.5% (levels8), else 16-bit levels.
    if ((D != 64 && D != 128) || !(s.bits == 4 || ((s.bits == 2 || s.bits == 3) && MINILLAMA_VBMI)) || s.cos || s.center)
        return false;
    if (s.codebook) return s.kind == ROW_TOKEN && s.group == D;
    if (s.kind == ROW_CHANNEL) return s.group > 0 && s.zero;
    return s.kind == ROW_TOKEN && s.group == D && s.zero;
}

bool vnni_values(const RowSource& s, int D) {
    if ((D != 64 && D != 128) || s.cos || s.center) return false;
    if (s.kind == ROW_VECTOR)  // a sign x 16-pattern book of 4 channels, whole vectors per group of 16 or more
        return s.vdim == 4 && s.nlevels == 16 && s.bits == 8 && s.codebook && s.group >= 16 && D % s.group == 0;
    if (s.kind != ROW_TOKEN) return false;
    if (!(s.bits == 2 || s.bits == 3 || s.bits == 4 || s.bits == 8) || s.group < 16 || D % s.group) return false;
    return s.codebook ? s.bits <= 4 : s.zero != nullptr;  // affine codes, or up to 16 levels (int16, see value_vnni)
}

bool value_vnni(VALUE_ARGS) {
    if (R > 16 || !vnni_values(s, D)) return false;
    if (s.kind == ROW_VECTOR)
        return D == 64 ? value_vnni<8, 4, true>(s, bh, R, p, lp, i0, n, acc) : value_vnni<8, 8, true>(s, bh, R, p, lp, i0, n, acc);
#define V(BITS) return D == 64 ? value_vnni<BITS, 4>(s, bh, R, p, lp, i0, n, acc) : value_vnni<BITS, 8>(s, bh, R, p, lp, i0, n, acc)
    switch (s.bits) {
        case 2: V(2);
        case 3: V(3);
        case 4: V(4);
        default: V(8);
    }
#undef V
}

bool score_vnni(SCORE_ARGS, Prep& prep) {
    if (R > 16 || !vnni_keys(s, D)) return false;
#if MINILLAMA_VBMI
    if (s.kind == ROW_BLOCKS) {  // a head with a block wider than 4 bits: false, the caller reads it exactly
        for (int b = 0; b < s.nlevels; b++)
            if (s.levels[bh * s.nlevels + b] > 4) return false;
        return score_vnni_blocks(s, bh, R, q, i0, n, out, ls, prep);
    }
#endif
    if (D == 64 && s.bits < 4) return score_vnni<8, true>(s, bh, R, q, i0, n, out, ls, prep);
    return D == 64 ? score_vnni<8, false>(s, bh, R, q, i0, n, out, ls, prep) : score_vnni<16, false>(s, bh, R, q, i0, n, out, ls, prep);
}

#else

bool vnni_keys(const RowSource&, int) { return false; }
bool score_vnni(SCORE_ARGS, Prep&) { return false; }
bool vnni_values(const RowSource&, int) { return false; }
bool value_vnni(VALUE_ARGS) { return false; }

#endif

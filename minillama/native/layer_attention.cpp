// One decode step's attention for one layer in a single call: every part of the cache,
// the new token itself, the softmax and the Hadamard rotations.
//
// kv/fused_attention.py describes each part of the cache (sinks, body, tier, residual of K and of
// V) as a RowSource plus a route (which block kernel reads it). The held tokens, in age
// order, are one sequence whatever part holds them; the driver here splits that sequence,
// not the heads, across the threads (flash-decoding / split-K): with 3 KV heads on 2 cores a
// split by head leaves a core idle for a third of the time, a split of the context never does.
// Each thread walks its range of tokens for every head in blocks of up to 512 tokens:
//   1. scores: the K part(s) covering the block score the head's R queries (each K row is
//      read once for all R query heads that share it) into an R x block tile that stays in L1;
//   2. online softmax (Milakov & Gimelshein 2018; FlashAttention): with m the running max and
//      l the running sum of exp(s - m), a block with a new max m' rescales l and the partial
//      output by exp(m - m') once, and p_j = exp(s_j - m') weights the block's values;
//   3. values: the V part(s) covering the block add p . V to the partial output.
// Then, once per head, the threads' partials (m_t, l_t, o_t) and the new token's own score
// and value merge: o = sum_t exp(m_t - M) o_t / sum_t exp(m_t - M) l_t. One parallel region
// per layer; the only buffers are a grow-only workspace of the calling thread and the tiles
// on each thread's stack.
// The queries (and the new key) are first moved into the key codec's space (Hadamard-rotated
// for *h key codecs: a fast Walsh-Hadamard transform, normalized, the same H as
// kv/quantize.py); the output is rotated back once per query for *h value codecs.
// model/attention.py is the specification; tests hold every route to it.

#include "exp2.h"
#include "hadamard.h"
#include "rows.h"

#include <cmath>
#include "openmp.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// Whether a SIMD integer kernel reads these rows on this build: VNNI (AVX-512) keys and values,
// or on AVX2 score_int4 (4-bit keys, affine or codebook; 3-bit affine keys), score_int2 (2-bit
// codebook keys) and value_bytes (2-, 3- and 4-bit values).
static bool simd_integer_reads(int values, const RowSource& s, int D) {
    return values ? vnni_values(s, D) || byte_values(s, D) : vnni_keys(s, D) || int4_keys(s, D) || int2_keys(s, D);
}

// Whether `route` can read rows described by `src` (values = 1: as values, 0: as keys) for R
// query heads per KV head of size D. The float and exact kernels take any R; their row buffers
// hold D <= 512 floats. The integer kernels (avx2_int_attention.cpp) keep per-head arrays for R <= 8
// and rows of D <= 128 bytes; their scores need one scale per row (group == D) for per-token codes.
extern "C" int route_supported(int route, int values, const RowSource* src, int R, int D) {
    const RowSource& s = *src;
    if (D < 2 || D > 512 || D % 2) return MINILLAMA_E_HEAD_DIM;
    if (R < 1 || R > 16) return MINILLAMA_E_GQA;
    const bool float_bits = s.bits >= 0 && s.bits <= 2;
    const bool code_bits = s.bits == 2 || s.bits == 3 || s.bits == 4 || s.bits == 8 || (s.bits == 5 && s.kind == ROW_TOKEN);
    switch (route) {
        case ROUTE_FLOAT:
            return s.kind == ROW_FLOAT && float_bits ? MINILLAMA_OK : MINILLAMA_E_CODES;
        case ROUTE_TOKEN:
            return s.kind == ROW_TOKEN && code_bits && s.group > 0 && D % s.group == 0 ? MINILLAMA_OK : MINILLAMA_E_CODES;
        case ROUTE_CHANNEL:
            return s.kind == ROW_CHANNEL && code_bits && s.bits != 5 && s.group > 0 ? MINILLAMA_OK : MINILLAMA_E_CODES;
        case ROUTE_INTEGER:
            if (!int_attention_available()) return MINILLAMA_E_CODES;
            if (simd_integer_reads(values, s, D)) return MINILLAMA_OK;
            if (R > 8) return MINILLAMA_E_GQA;
            if (D % 32 || D > 128) return MINILLAMA_E_HEAD_DIM;
            if (!(s.bits >= 2 && s.bits <= 4) || !s.zero || s.codebook) return MINILLAMA_E_CODES;
            if (s.kind == ROW_CHANNEL) return !values && s.group > 0 ? MINILLAMA_OK : MINILLAMA_E_CODES;
            if (s.kind != ROW_TOKEN) return MINILLAMA_E_CODES;
            return s.group == D || (values && s.group == 32) ? MINILLAMA_OK : MINILLAMA_E_CODES;
        case ROUTE_ROWS:
            if (s.kind == ROW_FLOAT) return float_bits ? MINILLAMA_OK : MINILLAMA_E_CODES;
            if (s.kind == ROW_TOKEN && (s.group <= 0 || D % s.group)) return MINILLAMA_E_CODES;
            if (s.kind == ROW_BLOCKS)  // nb blocks of a power-of-two size, widths 0-8, a byte scale a block
                return s.codebook && s.levels && s.scale8 && s.nlevels > 0 && D % (2 * s.nlevels) == 0 &&
                               s.bits >= 1 && s.bits <= 8
                           ? MINILLAMA_OK
                           : MINILLAMA_E_CODES;
            if (s.kind == ROW_VECTOR)  // byte codes of vdim channels, whole vectors per scale group
                return s.bits == 8 && s.codebook && s.vdim > 0 && s.group > 0 && D % s.group == 0 && s.group % s.vdim == 0
                           ? MINILLAMA_OK
                           : MINILLAMA_E_CODES;
            return (s.kind == ROW_TOKEN || s.kind == ROW_CHANNEL) && code_bits ? MINILLAMA_OK : MINILLAMA_E_CODES;
        default:
            return MINILLAMA_E_CODES;
    }
}

// Whether the exact SIMD kernels read these rows faster than the integer route would: where no
// SIMD integer kernel reads them (VNNI on AVX-512; on AVX2 score_int4 for 4- and 3-bit keys,
// score_int2 for 2-bit codebook keys and value_bytes for 2-, 3- and 4-bit values) but
// score_fast / value_fast do. On an AVX2 CPU the generic integer kernels' byte unpacking through
// memory and scalar weights cost more than widening the codes to floats.
extern "C" int exact_is_faster(int values, const RowSource* src, int D) {
    const RowSource& s = *src;
    if (simd_integer_reads(values, s, D)) return 0;
    return fast_reads(s, D, values) ? 1 : 0;
}

// The block kernel a route names (rows.h): the SIMD kernels where they apply (exact float math in
// avx512_attention.cpp for AVX-512 and avx2_attention.cpp for AVX2, with the frequency-block keys of
// the rows route there, or on the integer route VNNI in avx512_vnni_attention.cpp), else the generic one.
static inline void score_block(int route, SCORE_ARGS, Prep& prep) {
    if (route == ROUTE_INTEGER && s.kind == ROW_BLOCKS) {  // VNNI, or exactly for a head with wider blocks
        if (!score_vnni(s, bh, R, D, q, i0, n, out, ls, prep) && !score_blocks(s, bh, R, D, q, i0, n, out, ls, prep))
            score_rows(s, bh, R, D, q, i0, n, out, ls);
        return;
    }
    if (route == ROUTE_INTEGER ? score_vnni(s, bh, R, D, q, i0, n, out, ls, prep) || score_int4(s, bh, R, D, q, i0, n, out, ls, prep) ||
                                     score_int2(s, bh, R, D, q, i0, n, out, ls, prep)
                               : route == ROUTE_ROWS ? score_blocks(s, bh, R, D, q, i0, n, out, ls, prep)
                                                     : score_fast(s, bh, R, D, q, i0, n, out, ls, prep))
        return;
    switch (route) {
        case ROUTE_FLOAT: return score_float(s, bh, R, D, q, i0, n, out, ls);
        case ROUTE_TOKEN: return score_token(s, bh, R, D, q, i0, n, out, ls);
        case ROUTE_CHANNEL: return score_channel(s, bh, R, D, q, i0, n, out, ls);
        case ROUTE_INTEGER: return score_int(s, bh, R, D, q, i0, n, out, ls);
        default: return score_rows(s, bh, R, D, q, i0, n, out, ls);
    }
}

static inline void value_block(int route, VALUE_ARGS) {
    if (route == ROUTE_INTEGER ? value_vnni(s, bh, R, D, p, lp, i0, n, acc) || value_bytes(s, bh, R, D, p, lp, i0, n, acc)
                               : route != ROUTE_ROWS && value_fast(s, bh, R, D, p, lp, i0, n, acc))
        return;
    switch (route) {
        case ROUTE_FLOAT: return value_float(s, bh, R, D, p, lp, i0, n, acc);
        case ROUTE_TOKEN: return value_token(s, bh, R, D, p, lp, i0, n, acc);
        case ROUTE_CHANNEL: return value_channel(s, bh, R, D, p, lp, i0, n, acc);
        case ROUTE_INTEGER: return value_int(s, bh, R, D, p, lp, i0, n, acc);
        default: return value_rows(s, bh, R, D, p, lp, i0, n, acc);
    }
}

// The driver's blocks. The threads split the held tokens into ranges of whole SPLITs (so two
// threads share a context from 2 x 128 tokens on); each thread walks its range in blocks of
// block_size(R) tokens, whose R x block tile of scores stays in L1 between the scores and the
// values (at most TILE floats, 32 KB: all of it from 8 heads a KV head on). Larger blocks spread each kernel call's fixed cost
// (lookup tables, weight steps, the channel-order epilogue) over more tokens: each doubling up
// to 1024 was faster, 2048 (a tile past L1) no faster (tools/kernel_ab.py, the same plans through
// two builds in one process, in turn). Both are multiples of 32: a block holds whole groups of the
// integer value kernels' weights and of KIVI's per-channel key scales.
static const int SPLIT = 128;
static const int TILE = 8192;
static inline int block_size(int R) { return std::min(1024, TILE / R / 32 * 32); }

// One part of the cache through its kernel, alone (tests).
// values = 0: x = q (B*H, R, D), scores go to out's columns (rows ld apart); values = 1:
// x = p (rows ld apart), p . V is added to out (B*H, R, D).
extern "C" int attend_part(int values, int route, const float* x, const RowSource* src, int B, int H, int R, int D,
                           int n, int ld, float* out) {
    if (const int status = route_supported(route, values, src, R, D)) return status;
    if (B < 1 || H < 1 || n < 0 || ld < n) return MINILLAMA_E_SHAPE;
    const RowSource& s = *src;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        FlushDenormals guard;
        static thread_local Prep prep;
        prep.ready = false;
        for (int i0 = 0; i0 < n; i0 += block_size(R)) {
            const int len = std::min(block_size(R), n - i0);
            if (values) {
                value_block(route, s, bh, R, D, x + (int64_t)bh * R * ld + i0, ld, i0, len, out + (int64_t)bh * R * D);
            } else {
                score_block(route, s, bh, R, D, x + (int64_t)bh * R * D, i0, len, out + (int64_t)bh * R * ld + i0, ld, prep);
            }
        }
    }
    return MINILLAMA_OK;
}

static inline void load_vec(const void* base, int64_t offset, int dtype, int D, float* out) {
    load_row(base, offset, dtype, D, out);
}

static inline void store_vec(float* x, int D, int dtype, void* base, int64_t offset) {
    if (dtype == 0) {
        std::memcpy((float*)base + offset, x, D * sizeof(float));
    } else if (dtype == 1) {
        for (int d = 0; d < D; d++) ((half*)base)[offset + d] = (half)x[d];
    } else {
        uint16_t* b = (uint16_t*)base + offset;
        for (int d = 0; d < D; d++) {  // round to nearest even, as torch does
            uint32_t u;
            std::memcpy(&u, x + d, 4);
            b[d] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
        }
    }
}

// x <- its nb frequency blocks in order (hadamard.h), each block x_b H (kv/quantize.py:
// block_rotate). nb = 1 is x H.
static inline void rotate_blocks(float* x, int D, int nb) {
    if (nb > 1) {
        float blocked[512];
        frequency_blocks(x, D, nb, blocked);
        std::memcpy(x, blocked, D * sizeof(float));
    }
    for (int i = 0; i < D; i += D / nb) hadamard(x + i, D / nb);
}

// exp(x) for n floats in place, vectorized: 2^(x log2 e) split as 2^k * 2^f, f in [-1/2, 1/2],
// 2^f by a degree-6 polynomial (relative error ~2e-7, like expf); x below -87 gives 0.
static inline float exp_one(float x) {
    x = std::max(x, -87.3f);
    const float t = x * 1.44269504f, k = std::nearbyint(t), f = t - k;
    float p = exp2_fraction(f);
    int32_t bits;
    std::memcpy(&bits, &p, 4);
    bits += (int32_t)k << 23;
    std::memcpy(&p, &bits, 4);
    return p;
}

// The max of `m` and the row, by vector maxima where the build has them: GCC leaves a plain
// loop, and sixteen running maxima written by hand, as scalar vmaxss (49 in this file's object
// code, one instruction a token; the plain loop was 47% of the driver's time at 8192 tokens in
// perf), whatever way the max is spelled.
static inline float block_max(const float* row, int n, float m) {
    int j = 0;
#if defined(__AVX512F__)
    __m512 v = _mm512_set1_ps(m);
    for (; j + 16 <= n; j += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(row + j));
    m = _mm512_reduce_max_ps(v);
#elif defined(__AVX2__)
    __m256 v = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(row + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (float x : lanes) m = std::max(m, x);
#endif
    for (; j < n; j++) m = std::max(m, row[j]);
    return m;
}

// row <- exp(row - m) in place; returns the sum of the new row, in the same pass.
static inline float exp_sum(float* row, int n, float m) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < n; j++) {
        const float e = exp_one(row[j] - m);
        row[j] = e;
        sum += e;
    }
    return sum;
}

// What each thread keeps per head: the running max and sum of the softmax, and its partial output.
struct Partial {
    float* m;    // (R)
    float* l;    // (R)
    float* acc;  // (R, D)
};

// Where the held tokens of K (or V) live: its parts in age order, each starting at a token index.
struct Segments {
    const Part* parts;
    int count;
    int first[MINILLAMA_MAX_PARTS];  // index of each part's first token in the held sequence
};

// Scores (values = 0) or values (values = 1) of the held tokens [a, b) of head bh: each part
// covering some of them reads its own rows; `x` is q or p, `out` the scores tile or the output;
// `preps` the score kernels' per-part state for this head.
static inline void run_block(const Segments& seg, int values, int64_t bh, int R, int D, const float* x, int lx, int a,
                             int b, float* out, int lo, Prep* preps) {
    for (int i = 0; i < seg.count; i++) {
        const Part& part = seg.parts[i];
        const int lo_tok = std::max(a, seg.first[i]), hi_tok = std::min(b, seg.first[i] + part.n);
        if (lo_tok >= hi_tok) continue;
        const int i0 = lo_tok - seg.first[i], len = hi_tok - lo_tok;
        if (values) {
            value_block(part.route, part.src, bh, R, D, x + (lo_tok - a), lx, i0, len, out);
        } else {
            score_block(part.route, part.src, bh, R, D, x, i0, len, out + (lo_tok - a), lo, preps[i]);
        }
    }
}

// A grow-only workspace of the calling thread: no allocation per call once it is big enough.
static float* workspace(size_t floats) {
    static thread_local std::vector<float> buffer;
    if (buffer.size() < floats) buffer.resize(floats);
    return buffer.data();
}

extern "C" int attend_layer(const LayerPlan* plan) {
    const LayerPlan& P = *plan;
    const int B = P.B, H = P.H, R = P.R, D = P.D, BH = B * H;
    // Check every part before anything is written: a plan the kernels cannot read changes nothing.
    if (P.dtype < 0 || P.dtype > 2) return MINILLAMA_E_DTYPE;
    if (B < 1 || H < 1 || P.nk < 0 || P.nk > MINILLAMA_MAX_PARTS || P.nv < 0 || P.nv > MINILLAMA_MAX_PARTS)
        return MINILLAMA_E_SHAPE;
    if (R < 1 || R > 16) return MINILLAMA_E_GQA;
    if (P.rotate_k > 1 && ((D / P.rotate_k) & (D / P.rotate_k - 1))) return MINILLAMA_E_HEAD_DIM;  // blocks of 2^k
    if (P.rotate_k < 0 || P.rotate_v < 0 || P.rotate_v > 1 || (P.rotate_k > 1 && (D % (2 * P.rotate_k) || D > 512)))
        return MINILLAMA_E_HEAD_DIM;
    Segments ks{P.kparts, P.nk, {}}, vs{P.vparts, P.nv, {}};
    int held = 0, held_v = 0;
    for (int i = 0; i < P.nk; i++) {
        if (const int status = route_supported(P.kparts[i].route, 0, &P.kparts[i].src, R, D)) return status;
        ks.first[i] = held, held += P.kparts[i].n;
    }
    for (int i = 0; i < P.nv; i++) {
        if (const int status = route_supported(P.vparts[i].route, 1, &P.vparts[i].src, R, D)) return status;
        vs.first[i] = held_v, held_v += P.vparts[i].n;
    }
    if (held != held_v) return MINILLAMA_E_SHAPE;
    const int threads = std::max(1, std::min(omp_get_max_threads(), (held + SPLIT - 1) / SPLIT));
    const int block = block_size(R);
    // The workspace: queries in key space (BH, R, D), the new key and value (BH, D) each, the
    // own scores (BH, R), and each thread's partials (threads, BH) x (R m, R l, R x D acc).
    const size_t per_partial = (size_t)R * (D + 2);
    float* q = workspace((size_t)BH * R * D + 2 * (size_t)BH * D + (size_t)BH * R + threads * BH * per_partial);
    float *kown = q + (size_t)BH * R * D, *vown = kown + (size_t)BH * D, *own = vown + (size_t)BH * D;
    float* partials = own + (size_t)BH * R;
    auto partial = [&](int t, int bh) {
        float* base = partials + ((size_t)t * BH + bh) * per_partial;
        return Partial{base, base + R, base + 2 * R};
    };
    const float scale = 1.f / std::sqrt((float)D);
#pragma omp parallel num_threads(threads)
    {
        FlushDenormals guard;  // far-away weights are tiny: no denormal microcode (rows.h)
#pragma omp for schedule(static)
        for (int bh = 0; bh < BH; bh++) {  // q and the new k, v into the codecs' spaces
            for (int r = 0; r < R; r++) {
                float* qr = &q[((size_t)bh * R + r) * D];
                load_vec(P.q, ((int64_t)bh * R + r) * D, P.dtype, D, qr);
                if (P.rotate_k) rotate_blocks(qr, D, P.rotate_k);
                for (int d = 0; d < D; d++) qr[d] *= scale;  // every score comes out scaled by 1/sqrt(D)
            }
            float* k = &kown[(size_t)bh * D];
            load_vec(P.k, (int64_t)bh * D, P.dtype, D, k);
            if (P.rotate_k) rotate_blocks(k, D, P.rotate_k);
            if (P.k_center)
                for (int d = 0; d < D; d++) k[d] -= P.k_center[(size_t)bh * D + d];
            float* v = &vown[(size_t)bh * D];
            load_vec(P.v, (int64_t)bh * D, P.dtype, D, v);
            if (P.rotate_v) hadamard(v, D);
            for (int r = 0; r < R; r++) {  // the new token's own (scaled) score
                float dot = 0.f;
                for (int d = 0; d < D; d++) dot += q[((size_t)bh * R + r) * D + d] * k[d];
                own[(size_t)bh * R + r] = dot;  // q holds the scale
            }
        }  // (an implicit barrier: every thread needs every query)
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        // This thread's tokens: a contiguous range of whole SPLITs, the same for every head.
        const int splits = (held + SPLIT - 1) / SPLIT;
        const int a = std::min(held, (int)((int64_t)splits * t / nt) * SPLIT);
        const int b = std::min(held, (int)((int64_t)splits * (t + 1) / nt) * SPLIT);
        alignas(64) float tile[TILE];  // (R, block): scores, then p
        static thread_local Prep preps[MINILLAMA_MAX_PARTS];  // per K part: what its kernel derived from this head's queries
        for (int bh = 0; bh < BH; bh++) {
            for (Prep& p : preps) p.ready = false;
            Partial st = partial(t, bh);
            for (int r = 0; r < R; r++) st.m[r] = -INFINITY, st.l[r] = 0.f;
            std::fill(st.acc, st.acc + (size_t)R * D, 0.f);
            const float* qh = &q[(size_t)bh * R * D];
            for (int i = a; i < b; i += block) {
                const int n = std::min(block, b - i);
                run_block(ks, 0, bh, R, D, qh, D, i, i + n, tile, block, preps);
                for (int r = 0; r < R; r++) {  // the online softmax step of this block
                    float* row = tile + (size_t)r * block;
                    const float m = block_max(row, n, st.m[r]);
                    const float sum = exp_sum(row, n, m);
                    if (m > st.m[r]) {  // a new max: rescale what was summed before it
                        const float c = st.m[r] == -INFINITY ? 0.f : exp_one(st.m[r] - m);
                        st.l[r] *= c;
                        for (int d = 0; d < D; d++) st.acc[(size_t)r * D + d] *= c;
                        st.m[r] = m;
                    }
                    st.l[r] += sum;
                }
                run_block(vs, 1, bh, R, D, tile, block, i, i + n, st.acc, 0, nullptr);
            }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int row = 0; row < BH * R; row++) {  // merge the threads' partials and the new token
            const int bh = row / R, r = row % R;
            float M = own[row];
            for (int u = 0; u < nt; u++) M = std::max(M, partial(u, bh).m[r]);
            const float w_own = exp_one(own[row] - M);
            float L = w_own;
            float o[512];
            const float* v = &vown[(size_t)bh * D];
            for (int d = 0; d < D; d++) o[d] = w_own * v[d];
            for (int u = 0; u < nt; u++) {
                const Partial pu = partial(u, bh);
                if (pu.m[r] == -INFINITY) continue;  // this thread held no token
                const float c = exp_one(pu.m[r] - M);
                L += c * pu.l[r];
                for (int d = 0; d < D; d++) o[d] += c * pu.acc[(size_t)r * D + d];
            }
            const float inv = 1.f / L;
            for (int d = 0; d < D; d++) o[d] *= inv;
            if (P.rotate_v) hadamard(o, D);  // back from rotated space, once per query
            store_vec(o, D, P.dtype, P.out, (int64_t)row * D);
        }
    }
    return MINILLAMA_OK;
}

extern "C" int set_parts(LayerPlan* const* plans, int n, int values, const int* live, int nparts) {
    for (int i = 0; i < n; i++)
        if (!plans[i] || nparts > (values ? plans[i]->nv : plans[i]->nk)) return MINILLAMA_E_SHAPE;
    for (int i = 0; i < n; i++) {
        Part* parts = values ? plans[i]->vparts : plans[i]->kparts;
        for (int j = 0; j < nparts; j++) {
            const int* l = live + 4 * j;
            parts[j].n = l[0], parts[j].src.start = l[1], parts[j].src.sstart = l[2], parts[j].src.pos0 = l[3];
        }
    }
    return MINILLAMA_OK;
}

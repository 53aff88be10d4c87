// Fused decode attention over packed KV codes (CPU, OpenMP).
//
// Reads packed codes, fp16 scales and zeros straight from the cache's ring buffers and
// never writes a dequantized copy of the history:
//   keys, per-channel groups (KIVI):  q.k_t = sum_d (q_d s_gd) c_td + sum_d q_d z_gd
//       -> the scale is folded into the query once per group of tokens;
//   keys and values, per-token groups: the row's scale and zero are applied to the row in
//       registers once (one multiply-add per element), and the row then serves the R query
//       heads that share its KV head; for values that is o_d = sum_t p_t (s_tg c_td + z_tg);
//   values, per-channel groups:       o_d = sum_g s_gd (sum_{t in g} p_t c_td) + z_gd sum_{t in g} p_t.
// Ternary codes are {0,1,2} meaning {-1,0,+1} times a per-group scale (zero = 0);
// codebook codes index a table of levels (Lloyd-Max), times a per-group scale (zero = 0).
// Hadamard rotations happen outside (on q and on the output), once per query.
//
// Layout: every buffer is (B, H, slots, width) contiguous, used as a ring: logical
// token i lives in slot (start + i) % slots; per-channel scale rows in
// (sstart + i / group) % sslots. q is (B, H, R, D) float32 (R query heads per KV head);
// scores and p are (B, H, R, n) with rows `ld` floats apart (ld >= n), so that each part of
// the cache (sinks, body, residual) fills its own columns of one score matrix; out is
// (B, H, R, D) and value kernels add to it.
// The pure-PyTorch reference in attention.py is the specification these must match.

#include "rows.h"

// Scores of q against unquantized keys stored as f32/f16/bf16.
template <int DC, int RC>
static void scores_float_impl(const float* __restrict__ q, const void* keys, int dtype, int B, int H, int R_, int D_, int slots, int start, int n, int ld,
                  float* __restrict__ scores) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;  // compile-time sizes unroll the inner loops
#pragma omp parallel for collapse(2) schedule(static)
    for (int bh = 0; bh < B * H; bh++)
    for (int blk = 0; blk < n_blocks(n); blk++) {
        FlushDenormals guard;  // once per block, not per token
        float k[512];
        Cursor at(start, blk * BLOCK, slots);
        for (int i = blk * BLOCK; i < std::min(n, (blk + 1) * BLOCK); i++, at.next()) {
            load_row(keys, ((int64_t)bh * slots + at.slot) * D, dtype, D, k);
            for (int r = 0; r < R; r++) {
                const float* qr = q + ((int64_t)bh * R + r) * D;
                float acc = 0.f;
                for (int d = 0; d < D; d++) acc += qr[d] * k[d];
                scores[((int64_t)bh * R + r) * ld + i] = acc;
            }
        }
    }
}

// out = p . V for unquantized values.
template <int DC, int RC>
static void values_float_impl(const float* __restrict__ p, const void* vals, int dtype, int B, int H, int R_, int D_, int slots, int start, int n, int ld,
                  float* __restrict__ out) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;  // compile-time sizes unroll the inner loops
    int nb = n_blocks(n);
    std::vector<float> part((size_t)B * H * nb * R * D);
#pragma omp parallel for collapse(2) schedule(static)
    for (int bh = 0; bh < B * H; bh++)
    for (int blk = 0; blk < nb; blk++) {
        FlushDenormals guard;
        Accumulator<DC * RC> accum(&part[((size_t)bh * nb + blk) * R * D], R * D);
        float* acc = accum.data;
        float v[512];
        Cursor at(start, blk * BLOCK, slots);
        for (int i = blk * BLOCK; i < std::min(n, (blk + 1) * BLOCK); i++, at.next()) {
            load_row(vals, ((int64_t)bh * slots + at.slot) * D, dtype, D, v);
            for (int r = 0; r < R; r++) {
                float w = p[((int64_t)bh * R + r) * ld + i];
                float* a = &acc[(size_t)r * D];
                for (int d = 0; d < D; d++) a[d] += w * v[d];
            }
        }
    }
    reduce_blocks(part, B * H, nb, R * D, out);
}

// Keys quantized per token in groups of `group` channels (affine; ternary or codebook when zero == nullptr).
template <int DC, int RC>
static void scores_token_impl(const float* __restrict__ q, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                  const float* codebook, int B, int H, int R_,
                  int D_, int bits, int group, int slots, int start, int n, int ld, float* __restrict__ scores) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;  // compile-time sizes unroll the inner loops
    int W = bits == 5 ? (D + 4) / 5 : D * bits / 8, G = D / group;
#pragma omp parallel for collapse(2) schedule(static)
    for (int bh = 0; bh < B * H; bh++)
    for (int blk = 0; blk < n_blocks(n); blk++) {
        FlushDenormals guard;
        float c[512];
        Cursor at(start, blk * BLOCK, slots);
        for (int i = blk * BLOCK; i < std::min(n, (blk + 1) * BLOCK); i++, at.next()) {
            int64_t slot = (int64_t)bh * slots + at.slot;
            decode_row(codes + slot * W, bits, D, codebook, c);
            scale_row(scale + slot * G, zero ? zero + slot * G : nullptr, D, group, c);
            for (int r = 0; r < R; r++) {
                const float* qr = q + ((int64_t)bh * R + r) * D;
                float acc = 0.f;
                for (int d = 0; d < D; d++) acc += qr[d] * c[d];
                scores[((int64_t)bh * R + r) * ld + i] = acc;
            }
        }
    }
}

// out = p . V for values quantized per token (affine; ternary or codebook when zero == nullptr).
template <int DC, int RC>
static void values_token_impl(const float* __restrict__ p, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                  const float* codebook, int B, int H, int R_,
                  int D_, int bits, int group, int slots, int start, int n, int ld, float* __restrict__ out) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;  // compile-time sizes unroll the inner loops
    int W = bits == 5 ? (D + 4) / 5 : D * bits / 8, G = D / group;
    int nb = n_blocks(n);
    std::vector<float> part((size_t)B * H * nb * R * D);
#pragma omp parallel for collapse(2) schedule(static)
    for (int bh = 0; bh < B * H; bh++)
    for (int blk = 0; blk < nb; blk++) {
        FlushDenormals guard;
        Accumulator<DC * RC> accum(&part[((size_t)bh * nb + blk) * R * D], R * D);
        float* acc = accum.data;
        float c[512];
        Cursor at(start, blk * BLOCK, slots);
        for (int i = blk * BLOCK; i < std::min(n, (blk + 1) * BLOCK); i++, at.next()) {
            int64_t slot = (int64_t)bh * slots + at.slot;
            decode_row(codes + slot * W, bits, D, codebook, c);
            scale_row(scale + slot * G, zero ? zero + slot * G : nullptr, D, group, c);
            for (int r = 0; r < R; r++) {
                float pt = p[((int64_t)bh * R + r) * ld + i];
                float* a = &acc[(size_t)r * D];
                for (int d = 0; d < D; d++) a[d] += pt * c[d];
            }
        }
    }
    reduce_blocks(part, B * H, nb, R * D, out);
}

// Keys quantized per channel over groups of `group` tokens (KIVI).
template <int DC, int RC>
static void scores_channel_impl(const float* __restrict__ q, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero, int B, int H, int R_,
                    int D_, int bits, int group, int slots, int start, int sslots, int sstart, int n, int ld, float* __restrict__ scores) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;  // compile-time sizes unroll the inner loops
    int W = D * bits / 8;
    int span = (BLOCK / group > 0 ? BLOCK / group : 1) * group;  // whole groups per block
    int nb = (n + span - 1) / span;
#pragma omp parallel for collapse(2) schedule(static)
    for (int bh = 0; bh < B * H; bh++)
    for (int blk = 0; blk < nb; blk++) {
        FlushDenormals guard;
        std::vector<float> qs((size_t)R * D), cz(R);
        float c[512];
        Cursor at(start, blk * span, slots);
        for (int i = blk * span, in_group = 0; i < std::min(n, (blk + 1) * span); i++, at.next()) {
            if (in_group++ == 0) {  // new group: fold its scales into the query, its zeros into a constant
                int64_t row = (int64_t)bh * sslots + (sstart + i / group) % sslots;
                for (int r = 0; r < R; r++) {
                    const float* qr = q + ((int64_t)bh * R + r) * D;
                    float z = 0.f;
                    for (int d = 0; d < D; d++) {
                        qs[(size_t)r * D + d] = qr[d] * half_to_float(scale[row * D + d]);
                        z += qr[d] * half_to_float(zero[row * D + d]);
                    }
                    cz[r] = z;
                }
            }
            if (in_group == group) in_group = 0;
            int64_t slot = (int64_t)bh * slots + at.slot;
            unpack_row(codes + slot * W, bits, D, c);
            for (int r = 0; r < R; r++) {
                const float* __restrict__ qr = &qs[(size_t)r * D];
                float acc = cz[r];
                for (int d = 0; d < D; d++) acc += qr[d] * c[d];
                scores[((int64_t)bh * R + r) * ld + i] = acc;
            }
        }
    }
}

// out = p . V for values quantized per channel over groups of tokens.
template <int DC, int RC>
static void values_channel_impl(const float* __restrict__ p, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero, int B, int H, int R_,
                    int D_, int bits, int group, int slots, int start, int sslots, int sstart, int n, int ld, float* __restrict__ out) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;  // compile-time sizes unroll the inner loops
    int W = D * bits / 8;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        std::vector<float> acc((size_t)R * D, 0.f), gacc((size_t)R * D, 0.f), psum(R, 0.f);
        float c[512];
        Cursor at(start, 0, slots);
        for (int i = 0; i < n; i++, at.next()) {
            int64_t slot = (int64_t)bh * slots + at.slot;
            unpack_row(codes + slot * W, bits, D, c);
            for (int r = 0; r < R; r++) {
                float pt = p[((int64_t)bh * R + r) * ld + i];
                psum[r] += pt;
                float* a = &gacc[(size_t)r * D];
                for (int d = 0; d < D; d++) a[d] += pt * c[d];
            }
            if (i % group == group - 1 || i == n - 1) {  // close the group: apply its scale and zero once
                int64_t row = (int64_t)bh * sslots + (sstart + i / group) % sslots;
                for (int r = 0; r < R; r++)
                    for (int d = 0; d < D; d++) {
                        acc[(size_t)r * D + d] += half_to_float(scale[row * D + d]) * gacc[(size_t)r * D + d] +
                                                  half_to_float(zero[row * D + d]) * psum[r];
                        gacc[(size_t)r * D + d] = 0.f;
                    }
                for (int r = 0; r < R; r++) psum[r] = 0.f;
            }
        }
        for (int x = 0; x < R * D; x++) out[(int64_t)bh * R * D + x] += acc[x];
    }
}


// Head sizes and query-heads-per-KV-head known at compile time let the compiler keep the
// query in registers and fully unroll the per-token loops; other shapes use the generic code.
#define DISPATCH(fn, ...)                                                   \
    do {                                                                    \
        if (D == 64 && R == 1) fn<64, 1>(__VA_ARGS__);                      \
        else if (D == 64 && R == 3) fn<64, 3>(__VA_ARGS__);                 \
        else if (D == 64) fn<64, 0>(__VA_ARGS__);                           \
        else if (D == 128 && R == 1) fn<128, 1>(__VA_ARGS__);               \
        else if (D == 128 && R == 4) fn<128, 4>(__VA_ARGS__);               \
        else if (D == 128) fn<128, 0>(__VA_ARGS__);                         \
        else fn<0, 0>(__VA_ARGS__);                                         \
    } while (0)

extern "C" {

void scores_float(const float* q, const void* keys, int dtype, int B, int H, int R, int D, int slots, int start, int n, int ld,
                  float* scores) {
    DISPATCH(scores_float_impl, q, keys, dtype, B, H, R, D, slots, start, n, ld, scores);
}

void values_float(const float* p, const void* vals, int dtype, int B, int H, int R, int D, int slots, int start, int n, int ld,
                  float* out) {
    DISPATCH(values_float_impl, p, vals, dtype, B, H, R, D, slots, start, n, ld, out);
}

void scores_token(const float* q, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                  const float* codebook, int B, int H, int R,
                  int D, int bits, int group, int slots, int start, int n, int ld, float* scores) {
    DISPATCH(scores_token_impl, q, codes, scale, zero, codebook, B, H, R, D, bits, group, slots, start, n, ld, scores);
}

void values_token(const float* p, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                  const float* codebook, int B, int H, int R,
                  int D, int bits, int group, int slots, int start, int n, int ld, float* out) {
    DISPATCH(values_token_impl, p, codes, scale, zero, codebook, B, H, R, D, bits, group, slots, start, n, ld, out);
}

void scores_channel(const float* q, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero, int B, int H, int R,
                    int D, int bits, int group, int slots, int start, int sslots, int sstart, int n, int ld, float* scores) {
    DISPATCH(scores_channel_impl, q, codes, scale, zero, B, H, R, D, bits, group, slots, start, sslots, sstart, n, ld, scores);
}

void values_channel(const float* p, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero, int B, int H, int R,
                    int D, int bits, int group, int slots, int start, int sslots, int sstart, int n, int ld, float* out) {
    DISPATCH(values_channel_impl, p, codes, scale, zero, B, H, R, D, bits, group, slots, start, sslots, sstart, n, ld, out);
}

}  // extern "C"

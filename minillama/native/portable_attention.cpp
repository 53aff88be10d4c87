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
// (sstart + i / group) % sslots.
//
// Each kernel reads one block of rows [i0, i0 + n) of one KV head bh (blocks.h): scores of
// the head's R queries q (R, D) float32 go to out[r * ls + j]; values add p[r * lp + j] times
// row i0 + j to acc (R, D). The driver (layer_attention.cpp) owns the threads and the softmax.
// The pure-PyTorch reference in attention.py is the specification these must match.

#include "rows.h"

// Scores of q against unquantized keys stored as f32/f16/bf16.
template <int DC, int RC>
static void score_float_impl(const RowSource& s, int64_t bh, int R_, int D_, const float* __restrict__ q, int i0,
                             int n, float* __restrict__ out, int ls) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;  // compile-time sizes unroll the inner loops
    float k[512];
    Cursor at(s.start, i0, s.slots);
    for (int j = 0; j < n; j++, at.next()) {
        load_row(s.data, (bh * s.slots + at.slot) * D, s.bits, D, k);
        for (int r = 0; r < R; r++) {
            const float* qr = q + (int64_t)r * D;
            float acc = 0.f;
            for (int d = 0; d < D; d++) acc += qr[d] * k[d];
            out[(int64_t)r * ls + j] = acc;
        }
    }
}

// acc += p . V for unquantized values.
template <int DC, int RC>
static void value_float_impl(const RowSource& s, int64_t bh, int R_, int D_, const float* __restrict__ p, int lp, int i0,
                             int n, float* __restrict__ acc_out) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;
    Accumulator<DC * RC> accum(acc_out, R * D);
    float* acc = accum.data;
    float v[512];
    Cursor at(s.start, i0, s.slots);
    for (int j = 0; j < n; j++, at.next()) {
        load_row(s.data, (bh * s.slots + at.slot) * D, s.bits, D, v);
        for (int r = 0; r < R; r++) {
            const float w = p[(int64_t)r * lp + j];
            float* a = &acc[(size_t)r * D];
            for (int d = 0; d < D; d++) a[d] += w * v[d];
        }
    }
}

// Keys quantized per token in groups of `group` channels (affine; ternary or codebook when zero == nullptr).
template <int DC, int RC>
static void score_token_impl(const RowSource& s, int64_t bh, int R_, int D_, const float* __restrict__ q, int i0,
                             int n, float* __restrict__ out, int ls) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;
    const int W = s.bits == 5 ? (D + 4) / 5 : D * s.bits / 8, G = D / s.group;
    float c[512];
    Cursor at(s.start, i0, s.slots);
    for (int j = 0; j < n; j++, at.next()) {
        const int64_t slot = bh * s.slots + at.slot;
        decode_row((const uint8_t*)s.data + slot * W, s.bits, D, s.codebook, c);
        scale_row(s, slot * G, D, c);
        for (int r = 0; r < R; r++) {
            const float* qr = q + (int64_t)r * D;
            float acc = 0.f;
            for (int d = 0; d < D; d++) acc += qr[d] * c[d];
            out[(int64_t)r * ls + j] = acc;
        }
    }
}

// acc += p . V for values quantized per token (affine; ternary or codebook when zero == nullptr).
template <int DC, int RC>
static void value_token_impl(const RowSource& s, int64_t bh, int R_, int D_, const float* __restrict__ p, int lp, int i0,
                             int n, float* __restrict__ acc_out) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;
    const int W = s.bits == 5 ? (D + 4) / 5 : D * s.bits / 8, G = D / s.group;
    Accumulator<DC * RC> accum(acc_out, R * D);
    float* acc = accum.data;
    float c[512];
    Cursor at(s.start, i0, s.slots);
    for (int j = 0; j < n; j++, at.next()) {
        const int64_t slot = bh * s.slots + at.slot;
        decode_row((const uint8_t*)s.data + slot * W, s.bits, D, s.codebook, c);
        scale_row(s, slot * G, D, c);
        for (int r = 0; r < R; r++) {
            const float pt = p[(int64_t)r * lp + j];
            float* a = &acc[(size_t)r * D];
            for (int d = 0; d < D; d++) a[d] += pt * c[d];
        }
    }
}

// Keys quantized per channel over groups of `group` tokens (KIVI).
template <int DC, int RC>
static void score_channel_impl(const RowSource& s, int64_t bh, int R_, int D_, const float* __restrict__ q, int i0,
                               int n, float* __restrict__ out, int ls) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;
    const int W = D * s.bits / 8;
    float qs[16 * 512], cz[16] = {}, c[512];
    Cursor at(s.start, i0, s.slots);
    for (int i = i0, group_row = -1; i < i0 + n; i++, at.next()) {
        if (i / s.group != group_row) {  // new group: fold its scales into the query, its zeros into a constant
            group_row = i / s.group;
            const int64_t row = (bh * s.sslots + (s.sstart + group_row) % s.sslots) * D;
            for (int r = 0; r < R; r++) {
                const float* qr = q + (int64_t)r * D;
                float z = 0.f;
                for (int d = 0; d < D; d++) {
                    qs[(size_t)r * D + d] = qr[d] * half_to_float(s.scale[row + d]);
                    z += qr[d] * half_to_float(s.zero[row + d]);
                }
                cz[r] = z;
            }
        }
        unpack_row((const uint8_t*)s.data + (bh * s.slots + at.slot) * W, s.bits, D, c);
        for (int r = 0; r < R; r++) {
            const float* __restrict__ qr = &qs[(size_t)r * D];
            float acc = cz[r];
            for (int d = 0; d < D; d++) acc += qr[d] * c[d];
            out[(int64_t)r * ls + (i - i0)] = acc;
        }
    }
}

// acc += p . V for values quantized per channel over groups of tokens: per group,
// o_d += s_gd (sum_{t in g} p_t c_td) + z_gd sum_{t in g} p_t.
template <int DC, int RC>
static void value_channel_impl(const RowSource& s, int64_t bh, int R_, int D_, const float* __restrict__ p, int lp,
                               int i0, int n, float* __restrict__ acc) {
    const int D = DC ? DC : D_, R = RC ? RC : R_;
    const int W = D * s.bits / 8;
    float gacc[16 * 512], psum[16] = {0.f}, c[512];
    std::fill(gacc, gacc + R * D, 0.f);
    Cursor at(s.start, i0, s.slots);
    for (int i = i0; i < i0 + n; i++, at.next()) {
        unpack_row((const uint8_t*)s.data + (bh * s.slots + at.slot) * W, s.bits, D, c);
        for (int r = 0; r < R; r++) {
            const float pt = p[(int64_t)r * lp + (i - i0)];
            psum[r] += pt;
            float* a = &gacc[(size_t)r * D];
            for (int d = 0; d < D; d++) a[d] += pt * c[d];
        }
        if (i % s.group == s.group - 1 || i == i0 + n - 1) {  // close the group: apply its scale and zero once
            const int64_t row = (bh * s.sslots + (s.sstart + i / s.group) % s.sslots) * D;
            for (int r = 0; r < R; r++) {
                for (int d = 0; d < D; d++) {
                    acc[(size_t)r * D + d] += half_to_float(s.scale[row + d]) * gacc[(size_t)r * D + d] +
                                              half_to_float(s.zero[row + d]) * psum[r];
                    gacc[(size_t)r * D + d] = 0.f;
                }
                psum[r] = 0.f;
            }
        }
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

void score_float(SCORE_ARGS) { DISPATCH(score_float_impl, s, bh, R, D, q, i0, n, out, ls); }
void value_float(VALUE_ARGS) { DISPATCH(value_float_impl, s, bh, R, D, p, lp, i0, n, acc); }
void score_token(SCORE_ARGS) { DISPATCH(score_token_impl, s, bh, R, D, q, i0, n, out, ls); }
void value_token(VALUE_ARGS) { DISPATCH(value_token_impl, s, bh, R, D, p, lp, i0, n, acc); }
void score_channel(SCORE_ARGS) { DISPATCH(score_channel_impl, s, bh, R, D, q, i0, n, out, ls); }
void value_channel(VALUE_ARGS) { DISPATCH(value_channel_impl, s, bh, R, D, p, lp, i0, n, acc); }

// One decode step's attention for one layer in a single call: every part of the cache,
// the new token itself, the softmax and the Hadamard rotations.
//
// kv/fused_attention.py describes each part of the cache (sinks, body, residual of K and of
// V) as a RowSource plus a route (which kernel reads it); this file runs them in order:
//   1. q (and the new key) into the key codec's space: Hadamard-rotated for *h key codecs
//      (a fast Walsh-Hadamard transform, normalized, the same H as kv/quantize.py);
//   2. scores: each K part fills its columns of one (B*H, R, held+1) matrix, the new token
//      its own last column; then a softmax of scores / sqrt(D);
//   3. values: each V part adds p . V_part, the new token adds p_own * v; the output is
//      rotated back once for *h value codecs.
// Doing this in C++ instead of ~20 PyTorch calls per layer matters on small CPUs, where each
// call costs 10-60 us: about 0.4 ms per layer, 13 ms per decode step on the 2-core machine.

#include "rows.h"

#include <cmath>

// Whether `route` can read rows described by `src` (values = 1: as values, 0: as keys) for R
// query heads per KV head of size D. The float and exact kernels take any R; their row buffers
// hold D <= 512 floats. The integer kernels (int_attention.cpp) keep per-head arrays for R <= 8
// and rows of D <= 128 bytes; their scores need one scale per row (group == D) for per-token codes.
extern "C" int route_supported(int route, int values, const RowSource* src, int R, int D) {
    const RowSource& s = *src;
    if (D < 2 || D > 512 || D % 2) return MINILLAMA_E_HEAD_DIM;
    if (R < 1) return MINILLAMA_E_GQA;
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
            if (R > 8) return MINILLAMA_E_GQA;
            if (D % 32 || D > 128) return MINILLAMA_E_HEAD_DIM;
            if (!(s.bits >= 2 && s.bits <= 4) || !s.zero || s.codebook) return MINILLAMA_E_CODES;
            if (s.kind == ROW_CHANNEL) return !values && s.group > 0 ? MINILLAMA_OK : MINILLAMA_E_CODES;
            if (s.kind != ROW_TOKEN) return MINILLAMA_E_CODES;
            return s.group == D || (values && s.group == 32) ? MINILLAMA_OK : MINILLAMA_E_CODES;
        case ROUTE_ROWS:
            if (s.kind == ROW_FLOAT) return float_bits ? MINILLAMA_OK : MINILLAMA_E_CODES;
            if (s.kind == ROW_CALIBRATED && (s.nlevels < 1 || s.nlevels > 256)) return MINILLAMA_E_CODES;
            if (s.kind == ROW_TOKEN && (s.group <= 0 || D % s.group)) return MINILLAMA_E_CODES;
            return s.kind >= ROW_TOKEN && s.kind <= ROW_CALIBRATED && code_bits ? MINILLAMA_OK : MINILLAMA_E_CODES;
        default:
            return MINILLAMA_E_CODES;
    }
}

// One part of the cache through its kernel. values = 0: x = q (B*H, R, D), scores go to
// out's columns (rows ld apart); values = 1: x = p (rows ld apart), p . V is added to out.
extern "C" int attend_part(int values, int route, const float* x, const RowSource* src, int B, int H, int R, int D,
                           int n, int ld, float* out) {
    if (const int status = route_supported(route, values, src, R, D)) return status;
    if (B < 1 || H < 1 || n < 0 || ld < n) return MINILLAMA_E_SHAPE;
    const RowSource& s = *src;
    switch (route) {
        case ROUTE_FLOAT:
            (values ? values_float : scores_float)(x, s.data, s.bits, B, H, R, D, s.slots, s.start, n, ld, out);
            break;
        case ROUTE_TOKEN:
            (values ? values_token : scores_token)(x, (const uint8_t*)s.data, s.scale, s.zero, s.codebook, B, H, R, D,
                                                   s.bits, s.group, s.slots, s.start, n, ld, out);
            break;
        case ROUTE_CHANNEL:
            (values ? values_channel : scores_channel)(x, (const uint8_t*)s.data, s.scale, s.zero, B, H, R, D, s.bits,
                                                       s.group, s.slots, s.start, s.sslots, s.sstart, n, ld, out);
            break;
        case ROUTE_INTEGER:
            (values ? values_int : scores_int)(x, src, B, H, R, D, n, ld, out);
            break;
        default:
            (values ? values_rows : scores_rows)(x, src, B, H, R, D, n, ld, out);
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
        for (int d = 0; d < D; d++) ((_Float16*)base)[offset + d] = (_Float16)x[d];
    } else {
        uint16_t* b = (uint16_t*)base + offset;
        for (int d = 0; d < D; d++) {  // round to nearest even, as torch does
            uint32_t u;
            std::memcpy(&u, x + d, 4);
            b[d] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
        }
    }
}

// x <- x H, H the normalized Sylvester-Hadamard matrix (D a power of two).
static inline void hadamard(float* x, int D) {
    for (int h = 1; h < D; h *= 2)
        for (int i = 0; i < D; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b, x[j + h] = a - b;
            }
    const float norm = 1.f / std::sqrt((float)D);
    for (int d = 0; d < D; d++) x[d] *= norm;
}

extern "C" int attend_layer(const LayerPlan* plan) {
    const LayerPlan& P = *plan;
    const int B = P.B, H = P.H, R = P.R, D = P.D, BH = B * H;
    // Check every part before anything is written: a plan the kernels cannot read changes nothing.
    if (P.dtype < 0 || P.dtype > 2) return MINILLAMA_E_DTYPE;
    if (B < 1 || H < 1 || P.nk < 0 || P.nk > 3 || P.nv < 0 || P.nv > 3) return MINILLAMA_E_SHAPE;
    if ((P.rotate_k || P.rotate_v) && (D & (D - 1))) return MINILLAMA_E_HEAD_DIM;
    int held = 0, held_v = 0;
    for (int i = 0; i < P.nk; i++) {
        if (const int status = route_supported(P.kparts[i].route, 0, &P.kparts[i].src, R, D)) return status;
        held += P.kparts[i].n;
    }
    for (int i = 0; i < P.nv; i++) {
        if (const int status = route_supported(P.vparts[i].route, 1, &P.vparts[i].src, R, D)) return status;
        held_v += P.vparts[i].n;
    }
    if (held != held_v) return MINILLAMA_E_SHAPE;
    const int ld = held + 1;
    std::vector<float> q((size_t)BH * R * D), kown((size_t)BH * D), vown((size_t)BH * D);
    std::vector<float> s((size_t)BH * R * ld), o((size_t)BH * R * D, 0.f);
    for (int bh = 0; bh < BH; bh++) {
        for (int r = 0; r < R; r++) {
            float* qr = &q[((size_t)bh * R + r) * D];
            load_vec(P.q, ((int64_t)bh * R + r) * D, P.dtype, D, qr);
            if (P.rotate_k) hadamard(qr, D);
        }
        float* k = &kown[(size_t)bh * D];
        load_vec(P.k, (int64_t)bh * D, P.dtype, D, k);
        if (P.rotate_k) hadamard(k, D);
        if (P.k_center)
            for (int d = 0; d < D; d++) k[d] -= P.k_center[(size_t)bh * D + d];
        float* v = &vown[(size_t)bh * D];
        load_vec(P.v, (int64_t)bh * D, P.dtype, D, v);
        if (P.rotate_v) hadamard(v, D);
    }
    int column = 0;
    for (int i = 0; i < P.nk; i++) {  // every held key: its columns of the score matrix
        const Part& part = P.kparts[i];
        attend_part(0, part.route, q.data(), &part.src, B, H, R, D, part.n, ld, s.data() + column);
        column += part.n;
    }
    const float scale = 1.f / std::sqrt((float)D);
    for (int bh = 0; bh < BH; bh++)
        for (int r = 0; r < R; r++) {  // the new token's own score, then the softmax of the row
            float* row = &s[((size_t)bh * R + r) * ld];
            const float* qr = &q[((size_t)bh * R + r) * D];
            float own = 0.f;
            for (int d = 0; d < D; d++) own += qr[d] * kown[(size_t)bh * D + d];
            row[held] = own;
            float m = -INFINITY;
            for (int j = 0; j < ld; j++) m = std::max(m, row[j] * scale);
            float sum = 0.f;
            for (int j = 0; j < ld; j++) sum += (row[j] = std::exp(row[j] * scale - m));
            const float inv = 1.f / sum;
            for (int j = 0; j < ld; j++) row[j] *= inv;
            float* out = &o[((size_t)bh * R + r) * D];
            for (int d = 0; d < D; d++) out[d] = row[held] * vown[(size_t)bh * D + d];
        }
    column = 0;
    for (int i = 0; i < P.nv; i++) {  // every held value, weighted by its columns of p
        const Part& part = P.vparts[i];
        attend_part(1, part.route, s.data() + column, &part.src, B, H, R, D, part.n, ld, o.data());
        column += part.n;
    }
    for (int row = 0; row < BH * R; row++) {
        float* x = &o[(size_t)row * D];
        if (P.rotate_v) hadamard(x, D);  // back from rotated space, once per query
        store_vec(x, D, P.dtype, P.out, (int64_t)row * D);
    }
    return MINILLAMA_OK;
}

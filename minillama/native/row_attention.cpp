// Decode attention one stored row at a time, for every codec: the general kernels.
//
// portable_attention.cpp has kernels specialised per codec family that fold scales into the
// query and never materialise a row. These cases need each row in plain float form first:
//   * keys stored before RoPE (rope=pre): the row is decoded, its key center added back,
//     and rotated for its own position (x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin in
//     HF's rotate-half layout) before the dot product with the (rotated) query;
//   * vector codes (vq2hs): each byte names one of 256 codebook vectors of vdim channels, times
//     the group's scale;
//   * frequency blocks (lm3f2:...): block b of head h holds n = D / nb channels at its own width
//     w (a little-endian bit stream, kv/packing.py), x = book_w[code] * its byte scale.
// A RowSource describes where a part's rows live and how to decode them; the kernels below
// are the plain loops over tokens (scores: R dot products per row; values: R weighted adds).
// The reference in model/attention.py is the specification.

#include "rows.h"

// Row i (logical, in age order) of head bh, as float32 in plain space.
static inline void decode(const RowSource& s, int64_t bh, int i, int slot, int D, float* __restrict__ out) {
    if (s.kind == 0) {
        load_row(s.data, (bh * s.slots + slot) * D, s.bits, D, out);
    } else if (s.kind == ROW_BLOCKS) {
        const int nb = s.nlevels, n = D / nb, W = D * s.bits / 8;
        const uint8_t* row = (const uint8_t*)s.data + (bh * s.slots + slot) * W;
        const uint8_t* scale = s.scale8 + (bh * s.slots + slot) * nb;
        int bit = 0;  // where the next code starts in the row
        for (int b = 0; b < nb; b++) {
            const int w = s.levels[bh * nb + b];
            const float* book = s.codebook + (1 << w) - 2;
            const float sc = log_scales.t[scale[b]];
            for (int j = 0; j < n; j++, bit += w) {
                const int byte = bit >> 3, pair = row[byte] | (byte + 1 < W ? row[byte + 1] << 8 : 0);
                out[b * n + j] = w ? book[(pair >> (bit & 7)) & ((1 << w) - 1)] * sc : 0.f;
            }
        }
    } else if (s.kind == ROW_VECTOR) {
        const uint8_t* row = (const uint8_t*)s.data + (bh * s.slots + slot) * (D / s.vdim);
        for (int j = 0; j < D / s.vdim; j++) std::memcpy(out + j * s.vdim, s.codebook + row[j] * s.vdim, s.vdim * sizeof(float));
        scale_row(s, (bh * s.slots + slot) * (D / s.group), D, out);
    } else {
        const int W = s.bits == 5 ? (D + 4) / 5 : D * s.bits / 8;
        const uint8_t* row = (const uint8_t*)s.data + (bh * s.slots + slot) * W;
        if (s.kind == 1) {
            decode_row(row, s.bits, D, s.codebook, out);
            const int G = D / s.group;
            scale_row(s, (bh * s.slots + slot) * G, D, out);
        } else {  // ROW_CHANNEL
            unpack_row(row, s.bits, D, out);
            const int64_t r = (bh * s.sslots + (s.sstart + i / s.group) % s.sslots) * D;
            for (int d = 0; d < D; d++) out[d] = out[d] * half_to_float(s.scale[r + d]) + half_to_float(s.zero[r + d]);
        }
    }
    if (s.center)
        for (int d = 0; d < D; d++) out[d] += s.center[bh * D + d];
    if (s.cos) {
        const int h = D / 2;
        const float *c = s.cos + (int64_t)(s.pos0 + i) * h, *sn = s.sin + (int64_t)(s.pos0 + i) * h;
        for (int d = 0; d < h; d++) {
            const float x1 = out[d], x2 = out[d + h];
            out[d] = x1 * c[d] - x2 * sn[d];
            out[d + h] = x2 * c[d] + x1 * sn[d];
        }
    }
}

// out[r * ls + j] = q_r . row (i0 + j), for the rows of one part decoded one at a time.
void score_rows(SCORE_ARGS) {
    float row[512];
    Cursor at(s.start, i0, s.slots);
    for (int j = 0; j < n; j++, at.next()) {
        decode(s, bh, i0 + j, at.slot, D, row);
        for (int r = 0; r < R; r++) {
            const float* qr = q + (int64_t)r * D;
            float a = 0.f;
            for (int d = 0; d < D; d++) a += qr[d] * row[d];
            out[(int64_t)r * ls + j] = a;
        }
    }
}

// acc_r += sum_j p[r * lp + j] * row (i0 + j).
void value_rows(VALUE_ARGS) {
    float row[512];
    Cursor at(s.start, i0, s.slots);
    for (int j = 0; j < n; j++, at.next()) {
        decode(s, bh, i0 + j, at.slot, D, row);
        for (int r = 0; r < R; r++) {
            const float w = p[(int64_t)r * lp + j];
            float* a = acc + (size_t)r * D;
            for (int d = 0; d < D; d++) a[d] += w * row[d];
        }
    }
}

// Dense-and-sparse outliers (kv/outliers.py): a part whose rows keep `nout` entries each exact,
// in the model's own channels, beside a dense code. The part's kernel (any route) reads the dense
// code; these add the sparse part to what it made, for tokens i0 .. i0 + n - 1 of head bh:
//   scores  s_j += q . o_j             q (R, D) in the storage space, o_j the token's sparse row:
//                                      q . (o_j H) = (q H) . o_j, H its own inverse, so the query
//                                      is rotated back once a call and each outlier is one product;
//   values  acc += p_j (o_j H)         in the storage space, where the dense values are summed:
//                                      outlier c of value v adds v H[c][d] = v (-1)^popcount(c & d)
//                                      / sqrt(D) to channel d (Sylvester's order, hadamard.h).
// The reference decodes the same rows densely (kv/quantize.py: outlier_rows); tests hold the two
// to the same attention.
#pragma once

#include <cmath>
#include <cstring>

#include "dtypes.h"
#include "hadamard.h"
#include "minillama.h"

// The rows of tokens i0, i0 + 1, ... of head bh in a part's ring (starting at `start`, wrapping
// at `slots`), one division for the whole run.
struct OutlierRows {
    int64_t base;
    int slot, slots;
    OutlierRows(const RowSource& s, int64_t bh, int i0)
        : base(bh * s.slots), slot((int)(((int64_t)s.start + i0) % s.slots)), slots(s.slots) {}
    int64_t next() {  // this token's row, then on to the next token's
        const int64_t row = base + slot;
        if (++slot == slots) slot = 0;
        return row;
    }
};

static inline void outlier_scores(const RowSource& s, int64_t bh, int R, int D, const float* q, int i0, int n,
                                  float* out, int ld) {
    float qu[16 * 512];  // (R, D): the queries in the model's channels
    std::memcpy(qu, q, sizeof(float) * R * D);
    if (s.orot)
        for (int r = 0; r < R; r++) {
            fwht(qu + r * D, D);
            const float norm = 1.f / std::sqrt((float)D);
            for (int d = 0; d < D; d++) qu[r * D + d] *= norm;
        }
    OutlierRows rows(s, bh, i0);
    for (int j = 0; j < n; j++) {
        const int64_t row = rows.next() * s.nout;
        for (int o = 0; o < s.nout; o++) {
            const int c = s.oidx[row + o];
            const float v = half_to_float(s.oval[row + o]);
            for (int r = 0; r < R; r++) out[(int64_t)r * ld + j] += qu[r * D + c] * v;
        }
    }
}

static inline void outlier_values(const RowSource& s, int64_t bh, int R, int D, const float* p, int lp, int i0, int n,
                                  float* acc) {
    const float norm = 1.f / std::sqrt((float)D);
    OutlierRows rows(s, bh, i0);
    for (int j = 0; j < n; j++) {
        const int64_t row = rows.next() * s.nout;
        for (int o = 0; o < s.nout; o++) {
            const int c = s.oidx[row + o];
            const float v = half_to_float(s.oval[row + o]);
            for (int r = 0; r < R; r++) {
                const float w = p[(int64_t)r * lp + j] * v;
                if (w == 0.f) continue;
                float* a = acc + (int64_t)r * D;
                if (!s.orot) {
                    a[c] += w;
                    continue;
                }
                const float wn = w * norm;
                for (int d = 0; d < D; d++) a[d] += __builtin_parity((unsigned)(c & d)) ? -wn : wn;
            }
        }
    }
}

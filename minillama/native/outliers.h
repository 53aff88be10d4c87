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

// Each outlier of tokens i0 .. i0 + n - 1 of head bh in a part's ring (rows from `start`, wrapping
// at `slots`; one division for the run): f(j, channel, value), token by token.
template <class F>
static inline void each_outlier(const RowSource& s, int64_t bh, int i0, int n, F f) {
    int slot = (int)(((int64_t)s.start + i0) % s.slots);
    for (int j = 0; j < n; j++) {
        const int64_t row = (bh * s.slots + slot) * s.nout;
        for (int o = 0; o < s.nout; o++) f(j, (int)s.oidx[row + o], half_to_float(s.oval[row + o]));
        if (++slot == s.slots) slot = 0;
    }
}

static inline void outlier_scores(const RowSource& s, int64_t bh, int R, int D, const float* q, int i0, int n,
                                  float* out, int ld) {
    float qu[16 * 512];  // (R, D): the queries in the model's channels
    std::memcpy(qu, q, sizeof(float) * R * D);
    if (s.orot)
        for (int r = 0; r < R; r++) hadamard(qu + r * D, D);
    each_outlier(s, bh, i0, n, [&](int j, int c, float v) {
        for (int r = 0; r < R; r++) out[(int64_t)r * ld + j] += qu[r * D + c] * v;
    });
}

static inline void outlier_values(const RowSource& s, int64_t bh, int R, int D, const float* p, int lp, int i0, int n,
                                  float* acc) {
    const float norm = 1.f / std::sqrt((float)D);
    each_outlier(s, bh, i0, n, [&](int j, int c, float v) {
        for (int r = 0; r < R; r++) {
            const float w = p[(int64_t)r * lp + j] * v;
            float* a = acc + (int64_t)r * D;
            if (w == 0.f) continue;
            if (!s.orot) {
                a[c] += w;
                continue;
            }
            const float wn = w * norm;
            for (int d = 0; d < D; d++) a[d] += __builtin_parity((unsigned)(c & d)) ? -wn : wn;
        }
    });
}

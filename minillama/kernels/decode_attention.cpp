// Fused decode attention over packed KV codes (CPU, OpenMP).
//
// Reads packed codes, fp16 scales and zeros straight from the cache's ring buffers and
// never writes a dequantized copy of the history:
//   keys, per-channel groups (KIVI):  q.k_t = sum_d (q_d s_gd) c_td + sum_d q_d z_gd
//       -> the scale is folded into the query once per group of tokens;
//   keys, per-token groups:           q.k_t = sum_g s_tg (sum_{d in g} q_d c_td) + z_tg sum_{d in g} q_d;
//   values, per-token groups:         o_d = sum_t (p_t s_tg) c_td + sum_t p_t z_tg
//       -> the scale is folded into the attention weight;
//   values, per-channel groups:       o_d = sum_g s_gd (sum_{t in g} p_t c_td) + z_gd sum_{t in g} p_t.
// Ternary codes are {0,1,2} meaning {-1,0,+1} times a per-group scale (zero = 0);
// codebook codes index a table of levels (Lloyd-Max), times a per-group scale (zero = 0).
// Hadamard rotations happen outside (on q and on the output), once per query.
//
// Layout: every buffer is (B, H, slots, width) contiguous, used as a ring: logical
// token i lives in slot (start + i) % slots; per-channel scale rows in
// (sstart + i / group) % sslots. q is (B, H, R, D) float32 (R query heads per KV head);
// scores are (B, H, R, n); p is (B, H, R, n); out is (B, H, R, D) and is overwritten.
// The pure-PyTorch reference in attention.py is the specification these must match.

#include <cstdint>
#include <cstring>
#include <vector>

static inline float half_to_float(uint16_t h) {
    return (float)(*reinterpret_cast<const _Float16*>(&h));
}

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Unpack one row of D codes (bits 8, 4, 3 or 2; 5 = trits) into floats.
static inline void unpack_row(const uint8_t* row, int bits, int D, float* out) {
    if (bits == 8) {
        for (int d = 0; d < D; d++) out[d] = row[d];
    } else if (bits == 4) {
        for (int i = 0; i < D / 2; i++) { out[2 * i] = row[i] & 15; out[2 * i + 1] = row[i] >> 4; }
    } else if (bits == 2) {
        for (int i = 0; i < D / 4; i++) {
            uint8_t b = row[i];
            out[4 * i] = b & 3; out[4 * i + 1] = (b >> 2) & 3; out[4 * i + 2] = (b >> 4) & 3; out[4 * i + 3] = b >> 6;
        }
    } else if (bits == 3) {
        for (int i = 0; i < D / 8; i++) {
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

static inline float load_float(const void* base, int64_t idx, int dtype) {  // dtype: 0 f32, 1 f16, 2 bf16
    if (dtype == 0) return ((const float*)base)[idx];
    uint16_t h = ((const uint16_t*)base)[idx];
    return dtype == 1 ? half_to_float(h) : bf16_to_float(h);
}

extern "C" {

// Scores of q against unquantized keys stored as f32/f16/bf16.
void scores_float(const float* q, const void* keys, int dtype, int B, int H, int R, int D, int slots, int start, int n,
                  float* scores) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        for (int i = 0; i < n; i++) {
            int64_t slot = (start + i) % slots;
            int64_t base = ((int64_t)bh * slots + slot) * D;
            float k[512];
            for (int d = 0; d < D; d++) k[d] = load_float(keys, base + d, dtype);
            for (int r = 0; r < R; r++) {
                const float* qr = q + ((int64_t)bh * R + r) * D;
                float acc = 0.f;
                for (int d = 0; d < D; d++) acc += qr[d] * k[d];
                scores[((int64_t)bh * R + r) * n + i] = acc;
            }
        }
    }
}

// out = p . V for unquantized values.
void values_float(const float* p, const void* vals, int dtype, int B, int H, int R, int D, int slots, int start, int n,
                  float* out) {
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        std::vector<float> acc((size_t)R * D, 0.f);
        float v[512];
        for (int i = 0; i < n; i++) {
            int64_t base = ((int64_t)bh * slots + (start + i) % slots) * D;
            for (int d = 0; d < D; d++) v[d] = load_float(vals, base + d, dtype);
            for (int r = 0; r < R; r++) {
                float w = p[((int64_t)bh * R + r) * n + i];
                float* a = &acc[(size_t)r * D];
                for (int d = 0; d < D; d++) a[d] += w * v[d];
            }
        }
        std::memcpy(out + (int64_t)bh * R * D, acc.data(), sizeof(float) * R * D);
    }
}

// Keys quantized per token in groups of `group` channels (affine; ternary or codebook when zero == nullptr).
void scores_token(const float* q, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                  const float* codebook, int B, int H, int R,
                  int D, int bits, int group, int slots, int start, int n, float* scores) {
    int W = bits == 5 ? (D + 4) / 5 : D * bits / 8, G = D / group;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        std::vector<float> qsum((size_t)R * G, 0.f);  // sum of q over each channel group (for the zeros)
        for (int r = 0; r < R; r++)
            for (int d = 0; d < D; d++) qsum[r * G + d / group] += q[((int64_t)bh * R + r) * D + d];
        float c[512];
        for (int i = 0; i < n; i++) {
            int64_t slot = (int64_t)bh * slots + (start + i) % slots;
            unpack_row(codes + slot * W, bits, D, c);
            if (codebook)
                for (int d = 0; d < D; d++) c[d] = codebook[(int)c[d]];
            for (int r = 0; r < R; r++) {
                const float* qr = q + ((int64_t)bh * R + r) * D;
                float acc = 0.f;
                for (int g = 0; g < G; g++) {
                    float dot = 0.f;
                    for (int d = g * group; d < (g + 1) * group; d++) dot += qr[d] * c[d];
                    acc += half_to_float(scale[slot * G + g]) * dot;
                    if (zero) acc += half_to_float(zero[slot * G + g]) * qsum[r * G + g];
                }
                scores[((int64_t)bh * R + r) * n + i] = acc;
            }
        }
    }
}

// out = p . V for values quantized per token (affine, or ternary when zero == nullptr).
void values_token(const float* p, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                  const float* codebook, int B, int H, int R,
                  int D, int bits, int group, int slots, int start, int n, float* out) {
    int W = bits == 5 ? (D + 4) / 5 : D * bits / 8, G = D / group;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        std::vector<float> acc((size_t)R * D, 0.f), zacc((size_t)R * G, 0.f);
        float c[512];
        for (int i = 0; i < n; i++) {
            int64_t slot = (int64_t)bh * slots + (start + i) % slots;
            unpack_row(codes + slot * W, bits, D, c);
            if (codebook)
                for (int d = 0; d < D; d++) c[d] = codebook[(int)c[d]];
            for (int r = 0; r < R; r++) {
                float pt = p[((int64_t)bh * R + r) * n + i];
                float* a = &acc[(size_t)r * D];
                for (int g = 0; g < G; g++) {
                    float w = pt * half_to_float(scale[slot * G + g]);  // scale folded into the weight
                    for (int d = g * group; d < (g + 1) * group; d++) a[d] += w * c[d];
                    if (zero) zacc[r * G + g] += pt * half_to_float(zero[slot * G + g]);
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int d = 0; d < D; d++)
                out[((int64_t)bh * R + r) * D + d] = acc[(size_t)r * D + d] + zacc[r * G + d / group];
    }
}

// Keys quantized per channel over groups of `group` tokens (KIVI).
void scores_channel(const float* q, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero, int B, int H, int R,
                    int D, int bits, int group, int slots, int start, int sslots, int sstart, int n, float* scores) {
    int W = D * bits / 8;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        std::vector<float> qs((size_t)R * D), cz(R);
        float c[512];
        for (int i = 0; i < n; i++) {
            if (i % group == 0) {  // new group: fold its scales into the query, its zeros into a constant
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
            int64_t slot = (int64_t)bh * slots + (start + i) % slots;
            unpack_row(codes + slot * W, bits, D, c);
            for (int r = 0; r < R; r++) {
                const float* qr = &qs[(size_t)r * D];
                float acc = cz[r];
                for (int d = 0; d < D; d++) acc += qr[d] * c[d];
                scores[((int64_t)bh * R + r) * n + i] = acc;
            }
        }
    }
}

// out = p . V for values quantized per channel over groups of tokens.
void values_channel(const float* p, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero, int B, int H, int R,
                    int D, int bits, int group, int slots, int start, int sslots, int sstart, int n, float* out) {
    int W = D * bits / 8;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        std::vector<float> acc((size_t)R * D, 0.f), gacc((size_t)R * D, 0.f), psum(R, 0.f);
        float c[512];
        for (int i = 0; i < n; i++) {
            int64_t slot = (int64_t)bh * slots + (start + i) % slots;
            unpack_row(codes + slot * W, bits, D, c);
            for (int r = 0; r < R; r++) {
                float pt = p[((int64_t)bh * R + r) * n + i];
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
        std::memcpy(out + (int64_t)bh * R * D, acc.data(), sizeof(float) * R * D);
    }
}

}  // extern "C"

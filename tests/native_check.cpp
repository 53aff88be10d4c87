// A check of the kernels against scalar twins written here, for a machine with no Python: it is
// compiled with the kernel sources into one program (tests/test_arm.py cross-compiles it for
// aarch64 and runs it under qemu-aarch64). Prints one line per check and exits 1 on a mismatch.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../minillama/native/dtypes.h"
#include "../minillama/native/hadamard.h"
#include "../minillama/native/minillama.h"

static int failures = 0;

static void report(const char* what, double err, double bound) {
    const bool ok = err <= bound;
    std::printf("%s %s: max error %.3g (bound %.3g)\n", ok ? "ok" : "FAIL", what, err, bound);
    failures += !ok;
}

static std::vector<float> randn(size_t n, unsigned seed) {
    std::mt19937 g(seed);
    std::normal_distribution<float> d;
    std::vector<float> x(n);
    for (auto& v : x) v = d(g);
    return x;
}

// y = x W^T, the projections' kernel, with x and W in float32 (dtype 0) or bfloat16 (2), against
// a double-precision loop over the same values (dtypes.h: round_to_dtype, load_value).
static void check_gemm(int dtype, int M, int N, int K) {
    auto stored = [&](std::vector<float> v) {  // v rounded to dtype, as its bytes
        std::vector<uint8_t> bytes(v.size() * dtype_bytes(dtype));
        for (size_t i = 0; i < v.size(); i++) {
            const float r = round_to_dtype(v[i], dtype);
            std::memcpy(&bytes[i * dtype_bytes(dtype)], (const char*)&r + (dtype ? 2 : 0), dtype_bytes(dtype));
        }
        return bytes;
    };
    const auto x = stored(randn((size_t)M * K, 1)), w = stored(randn((size_t)N * K, 2));
    std::vector<float> y((size_t)M * N);
    if (gemm_rows(x.data(), dtype, w.data(), dtype, M, N, K, y.data()) != MINILLAMA_OK)
        return report("gemm_rows status", 1, 0);
    double err = 0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = 0;
            for (int k = 0; k < K; k++)
                s += (double)load_value(x.data(), (int64_t)m * K + k, dtype) * load_value(w.data(), (int64_t)n * K + k, dtype);
            err = std::max(err, std::fabs(s - y[(size_t)m * N + n]));
        }
    char what[64];
    std::snprintf(what, sizeof what, "gemm_rows %s (%d rows of x)", dtype ? "bfloat16" : "float32", M);
    report(what, err, 1e-3);
}

// Weights in blocks of 32 (q8_0, q4_0, q4_1: random bytes, small scales) against x rounded to int8
// per block: gemm_rows against the product of the block weights (dtypes.h: block_weight) with
// the rounded x, in doubles. The rounding is the specification's (weights/blocks.py).
// Weight j of unit b (32 weights: a block, or a k-quant's sub-block) of a row, as dtypes.h reads it.
static double unit_weight(const uint8_t* row, int dt, int b, int j) {
    if (is_k_quant(dt)) return sub_weight(k_sub_block(row + (b / 8) * block_bytes(dt), dt, b % 8), dt, j);
    return block_weight(block_at(row + b * block_bytes(dt), dt), dt, j);
}

static void check_int8_blocks(int dt, const char* name, int M, int N, int K) {
    const int bb = block_bytes(dt);
    std::mt19937 g(8);
    std::vector<uint8_t> W((size_t)N * K / block_weights(dt) * bb);
    for (auto& b : W) b = (uint8_t)g();
    for (size_t at = 0; at < W.size(); at += bb) {  // each block's fp16 scale (and q4_1's min, q4_k's dmin)
        const uint16_t d = float_to_half(0.01f + 0.001f * (g() % 16)), m = float_to_half(-0.05f);
        const uint16_t small = float_to_half(0.0005f), dmin = float_to_half(0.001f);
        if (dt == DTYPE_Q4_K) std::memcpy(&W[at], &small, 2), std::memcpy(&W[at + 2], &dmin, 2);
        else if (dt == DTYPE_Q6_K) std::memcpy(&W[at + 208], &small, 2);
        else std::memcpy(&W[at], &d, 2);
        if (dt == DTYPE_Q4_1) std::memcpy(&W[at + 2], &m, 2);
    }
    const auto x = randn((size_t)M * K, 9);
    std::vector<float> y((size_t)M * N);
    if (gemm_rows(x.data(), 0, W.data(), dt | INT8_ACTIVATIONS, M, N, K, y.data()) != MINILLAMA_OK)
        return report("gemm_rows int8 status", 1, 0);
    double err = 0, scale = 0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double sum = 0, mag = 0;
            for (int b = 0; b < K / 32; b++) {
                const float* xb = &x[(size_t)m * K + 32 * b];
                float amax = 0.f;
                for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(xb[j]));
                const uint8_t* row = &W[(size_t)n * K / block_weights(dt) * bb];
                for (int j = 0; j < 32; j++) {
                    const double xr = amax / 127.f * std::nearbyint(xb[j] * (127.f / amax)), wj = unit_weight(row, dt, b, j);
                    sum += xr * wj, mag += std::fabs(xr * wj);
                }
            }
            err = std::max(err, std::fabs(sum - y[(size_t)m * N + n])), scale = std::max(scale, mag);
        }
    char what[64];
    std::snprintf(what, sizeof what, "gemm_rows %s x int8 (%d rows of x)", name, M);
    report(what, err, 1e-5 * scale);
}

// Causal attention of T new queries over P + T keys, against the softmax written out.
static void check_causal(int Hq, int Hkv, int T, int P, int D) {
    const int L = P + T;
    const auto q = randn((size_t)Hq * T * D, 3), k = randn((size_t)Hkv * L * D, 4), v = randn((size_t)Hkv * L * D, 5);
    std::vector<float> out((size_t)Hq * T * D);
    const int64_t qs[3] = {(int64_t)Hq * T * D, (int64_t)T * D, D}, ks[3] = {(int64_t)Hkv * L * D, (int64_t)L * D, D};
    if (causal_attention(q.data(), qs, k.data(), ks, v.data(), ks, 1, Hq, Hkv, T, L, D, out.data(), qs) != MINILLAMA_OK)
        return report("causal_attention status", 1, 0);
    double err = 0;
    for (int h = 0; h < Hq; h++)
        for (int t = 0; t < T; t++) {
            const float* qr = &q[((size_t)h * T + t) * D];
            const int g = h / (Hq / Hkv), last = P + t;
            std::vector<double> w(last + 1);
            double top = -1e300, sum = 0;
            for (int j = 0; j <= last; j++) {
                double s = 0;
                for (int d = 0; d < D; d++) s += (double)qr[d] * k[((size_t)g * L + j) * D + d];
                w[j] = s / std::sqrt((double)D), top = std::max(top, w[j]);
            }
            for (auto& x : w) sum += (x = std::exp(x - top));
            for (int d = 0; d < D; d++) {
                double o = 0;
                for (int j = 0; j <= last; j++) o += w[j] / sum * v[((size_t)g * L + j) * D + d];
                err = std::max(err, std::fabs(o - out[((size_t)h * T + t) * D + d]));
            }
        }
    char what[64];
    std::snprintf(what, sizeof what, "causal_attention D=%d", D);
    report(what, err, 1e-4);
}

// The cache write's rotation: prepare_rows against hadamard.h's scalar passes, bit for bit.
static void check_rotation(int D) {
    const int rows = 5;
    const auto x = randn((size_t)rows * D, 6);
    std::vector<uint16_t> out((size_t)rows * D);
    if (prepare_rows(x.data(), 0, rows, D, 1, nullptr, 1, out.data()) != 0) return report("prepare_rows status", 1, 0);
    double err = 0;
    for (int r = 0; r < rows; r++) {
        std::vector<float> y(x.begin() + (size_t)r * D, x.begin() + (size_t)(r + 1) * D);
        for (int i = 0, n; i < D; i += n) {
            n = hadamard_block(D - i);
            fwht_reference(y.data() + i, n);
            for (int d = i; d < i + n; d++) y[d] *= (float)(1.0 / std::sqrt((double)n));
        }
        for (int d = 0; d < D; d++) err = std::max(err, (double)(out[(size_t)r * D + d] != float_to_half(y[d])));
    }
    char what[64];
    std::snprintf(what, sizeof what, "prepare_rows Hadamard D=%d (mismatched halves)", D);
    report(what, err, 0);
}

// Per-token 4-bit affine codes: every code decodes to within half a step of its input.
static void check_affine(int D, int G) {
    const int n = 7;
    const auto x = randn((size_t)n * D, 7);
    std::vector<uint16_t> h(x.size());
    for (size_t i = 0; i < x.size(); i++) h[i] = float_to_half(x[i]);
    std::vector<uint8_t> codes((size_t)n * D / 2);
    std::vector<uint16_t> scale((size_t)n * D / G), zero((size_t)n * D / G);
    if (encode_affine(h.data(), 1, n, D, 4, G, 0, codes.data(), scale.data(), zero.data()) != MINILLAMA_OK)
        return report("encode_affine status", 1, 0);
    double err = 0;
    for (int t = 0; t < n; t++)
        for (int d = 0; d < D; d++) {
            const int c = codes[((size_t)t * D + d) / 2] >> (4 * (d % 2)) & 15, g = (t * D + d) / G;
            const float s = half_to_float(scale[g]), z = half_to_float(zero[g]);
            err = std::max(err, (double)std::fabs(c * s + z - half_to_float(h[(size_t)t * D + d])) / s);
        }
    report("encode_affine int4 (error in steps)", err, 0.5 + 1e-3);
}

int main() {
    check_gemm(0, 3, 40, 96);
    for (int M : {1, 2, 5}) check_gemm(2, M, 37, 160);
    std::printf("features %d (NEON %d, dot products %d)\n", minillama_features(),
                !!(minillama_features() & MINILLAMA_FEATURE_NEON), !!(minillama_features() & MINILLAMA_FEATURE_DOTPROD));
    for (int M : {1, 3, 6}) {
        check_int8_blocks(DTYPE_Q8_0, "q8_0", M, 37, 160);
        check_int8_blocks(DTYPE_Q4_0, "q4_0", M, 37, 160);
        check_int8_blocks(DTYPE_Q4_1, "q4_1", M, 37, 160);
        check_int8_blocks(DTYPE_Q4_K, "q4_k", M, 19, 512);
        check_int8_blocks(DTYPE_Q6_K, "q6_k", M, 19, 512);
    }
    for (int D : {64, 80, 96, 128}) check_causal(4, 2, 9, 21, D);
    for (int D : {64, 80, 96}) check_rotation(D);
    check_affine(64, 32);
    check_affine(80, 16);
    std::printf("%s\n", failures ? "FAILED" : "all checks passed");
    return failures ? 1 : 0;
}

// Scalar reads and roundings of the tensor dtypes the kernels exchange with PyTorch
// (dtype codes: 0 float32, 1 float16, 2 bfloat16), rounding as torch's .to() rounds.
// Shared by encode.cpp (cache writes), decode_ops.cpp (the small decode-step ops), step.cpp and
// linear.cpp (element sizes) and rows.h (the one-byte log scales the attention kernels read).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// IEEE half precision as the compiler names it: _Float16 on x86 (GCC 12+, clang), __fp16 on
// ARM, whose C++ front ends have no _Float16. Conversions from float round to nearest even.
#if defined(__aarch64__) || defined(__arm__)
typedef __fp16 half;
#else
typedef _Float16 half;
#endif

static inline int dtype_bytes(int dtype) { return dtype == 0 ? 4 : 2; }  // one element's bytes

// Weights in blocks of 32 with their own scale (minillama/weights/blocks.py has the layouts and
// the reference): dtype codes for matrices only, never for activations.
enum BlockDtype { DTYPE_Q8_0 = 8, DTYPE_Q4_0 = 9, DTYPE_Q4_1 = 10, DTYPE_Q4_K = 11, DTYPE_Q6_K = 12 };
static inline bool is_block_dtype(int dtype) { return dtype >= DTYPE_Q8_0 && dtype <= DTYPE_Q6_K; }
static inline bool is_k_quant(int dtype) { return dtype == DTYPE_Q4_K || dtype == DTYPE_Q6_K; }
static inline int block_weights(int dtype) { return is_k_quant(dtype) ? 256 : 32; }  // weights per block
// A block dtype | INT8_ACTIVATIONS: the product rounds the activations to int8 per block of 32
// (native/linear.cpp: gemm_rows), as llama.cpp does; without it the activations stay float.
constexpr int INT8_ACTIVATIONS = 256;
static inline bool is_int8_block(int dtype) { return (dtype & INT8_ACTIVATIONS) && is_block_dtype(dtype & ~INT8_ACTIVATIONS); }
static inline int block_bytes(int dtype) {
    return dtype == DTYPE_Q8_0 ? 34 : dtype == DTYPE_Q4_0 ? 18 : dtype == DTYPE_Q4_1 ? 20 : dtype == DTYPE_Q4_K ? 144 : 210;
}
// The bytes of one weight row of K columns (K a multiple of block_weights for the block dtypes).
static inline int64_t row_bytes(int dtype, int64_t K) {
    return is_block_dtype(dtype) ? K / block_weights(dtype) * block_bytes(dtype) : K * dtype_bytes(dtype);
}

static inline float half_to_float(uint16_t h) {
    half f;
    std::memcpy(&f, &h, 2);
    return (float)f;
}

static inline uint16_t float_to_half(float x) {  // round to nearest even, as torch's .to(float16)
    const half f = (half)x;
    uint16_t h;
    std::memcpy(&h, &f, 2);
    return h;
}

static inline float load_value(const void* p, int64_t i, int dtype) {
    if (dtype == 0) return ((const float*)p)[i];
    if (dtype == 1) return half_to_float(((const uint16_t*)p)[i]);
    uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline float round_to_dtype(float x, int dtype) {  // bfloat16: to nearest even, as torch does
    if (dtype == 0) return x;
    if (dtype == 1) return half_to_float(float_to_half(x));
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// One-byte log scales (kv/quantize.py: log_scales): byte u stands for 2^((u - 128) / 16), made
// exactly as there, 2^(j / 16) rounded once to float times a power of two; `bounds` are the
// geometric midpoints sqrt(t[u] t[u + 1]) in double (exact products, a correctly rounded root)
// that the encoder rounds a scale by (log_scale_code).
struct LogScales {
    float t[256];
    double bounds[255];
    LogScales() {
        for (int u = 0; u < 256; u++) t[u] = std::ldexp((float)std::exp2((u & 15) / 16.0), (u >> 4) - 8);
        for (int u = 0; u < 255; u++) bounds[u] = std::sqrt((double)t[u] * (double)t[u + 1]);
    }
};
static const LogScales log_scales;

// The byte of the grid point nearest s in log terms: how many midpoints lie below s (as
// torch.bucketize counts them); 0 (the grid's smallest scale) where s is not > 0.
static inline uint8_t log_scale_code(double s) {
    if (!(s > 0.0)) return 0;
    int lo = 0, hi = 255;  // the answer lies in [lo, hi]
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (log_scales.bounds[mid] < s) lo = mid + 1;
        else hi = mid;
    }
    return (uint8_t)lo;
}

// One block of 32 weights (minillama/weights/blocks.py): w_j = d q_j + o, with o = m for q4_1,
// -8 d for q4_0 (codes 0..15 stand for -8..7) and 0 for q8_0 (signed codes).
struct Block {
    float d, o;        // w_j = d q_j + o
    const uint8_t* q;  // 32 int8 codes (q8_0) or 16 bytes of nibbles: byte j = q_j | q_(j+16) << 4
};

static inline Block block_at(const uint8_t* b, int dt) {
    uint16_t h[2];
    std::memcpy(h, b, 4);  // d, and m for q4_1
    const float d = half_to_float(h[0]);
    if (dt == DTYPE_Q8_0) return {d, 0.f, b + 2};
    if (dt == DTYPE_Q4_0) return {d, -8.f * d, b + 2};
    return {d, half_to_float(h[1]), b + 4};
}

// Code j of a block, as the plain loop reads it.
static inline float block_code(const Block& v, int dt, int j) {
    if (dt == DTYPE_Q8_0) return (float)(int8_t)v.q[j];
    return (float)(j < 16 ? v.q[j] & 15 : v.q[j - 16] >> 4);
}

// Weight j of a block exactly as blocks.py's dequantize computes it (q4_0: d (q - 8)).
static inline float block_weight(const Block& v, int dt, int j) {
    const float q = block_code(v, dt, j);
    return dt == DTYPE_Q4_0 ? v.d * (q - 8.f) : dt == DTYPE_Q8_0 ? v.d * q : v.d * q + v.o;
}

// Sub-block j (0-7) of 32 weights of a k-quant block (minillama/weights/blocks.py: _q4_k, _q6_k):
// weight i = d[i / 16] q_i + o, codes q 0..15 (q4_k, o = -dmin m) or -32..31 (q6_k, o = 0, a
// scale per 16 weights), each multiplied as blocks.py multiplies (dequantize_rows is bit for bit).
struct SubBlock {
    float d[2], o;
    int8_t q[32];
};

static inline SubBlock k_sub_block(const uint8_t* b, int dt, int j) {
    SubBlock v;
    if (dt == DTYPE_Q4_K) {
        uint16_t h[2];
        std::memcpy(h, b, 4);
        const uint8_t* s = b + 4;
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        v.d[0] = v.d[1] = half_to_float(h[0]) * (float)sc, v.o = -(half_to_float(h[1]) * (float)m);
        const uint8_t* q = b + 16 + 32 * (j / 2);  // the 32 bytes of this sub-block's group of 64
        for (int i = 0; i < 32; i++) v.q[i] = (int8_t)(j % 2 ? q[i] >> 4 : q[i] & 15);
        return v;
    }
    uint16_t hd;
    std::memcpy(&hd, b + 208, 2);
    const float d = half_to_float(hd);
    const int half = j / 4, k = j % 4;  // 128 weights a half: sub-blocks 4 half + k
    const uint8_t *ql = b + 64 * half + 32 * (k % 2), *qh = b + 128 + 32 * half;
    for (int i = 0; i < 32; i++) v.q[i] = (int8_t)(((k < 2 ? ql[i] & 15 : ql[i] >> 4) | (((qh[i] >> (2 * k)) & 3) << 4)) - 32);
    v.d[0] = d * (float)(int8_t)b[192 + 2 * j], v.d[1] = d * (float)(int8_t)b[192 + 2 * j + 1], v.o = 0.f;
    return v;
}

// Weight i of a sub-block exactly as blocks.py computes it.
static inline float sub_weight(const SubBlock& v, int dt, int i) {
    const float w = v.d[i / 16] * (float)v.q[i];
    return dt == DTYPE_Q4_K ? w + v.o : w;
}

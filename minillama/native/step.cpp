// One decode step of one Llama layer in a single call: the same operations, in the same order
// and with the same roundings, as model/llama.py's DecoderLayer for one token per sequence:
//
//   normed = RMSNorm(x) * w_in
//   q, k, v = normed @ W_qkv^T (+ b)            one skinny product for the three (linear.cpp)
//   q, k = RoPE(q), RoPE(k)                      the new token's position
//   a = attention(q, k, v, cache)                every held part of the layer (layer_attention.cpp)
//   x = x + a @ W_o^T (+ b);  normed = RMSNorm(x) * w_post
//   g, u = normed @ W_gu^T (+ b);  x = x + (silu(g) * u) @ W_down^T (+ b)
//
// Each product accumulates in float32 and is rounded to the model's dtype once, with its bias
// added before the rounding, as torch's F.linear does; norms, RoPE and SiLU round where the
// PyTorch reference rounds (decode_ops.cpp). On a small CPU each PyTorch call costs tens of
// microseconds and a layer made ~20 of them besides its kernels: here it is one call. The new
// key (before RoPE when the cache keeps pre-RoPE keys) and value are written out for the
// cache's append, which Python makes once for all layers after the step. decode_step runs the
// whole step: embedding rows, every layer, final norm and LM head (model/llama.py: Llama._run).

#include "dtypes.h"
#include "minillama.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

// Adds the wall time since the last lap to one phase of s.timing (when profiling; else nothing).
struct Laps {
    double* timing;
    std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
    void lap(int phase) {
        if (!timing) return;
        const auto now = std::chrono::steady_clock::now();
        timing[phase] += std::chrono::duration<double>(now - last).count();
        last = now;
    }
};

static inline void put_rounded(float v, int dtype, void* out, int64_t i) {
    if (dtype == 0) {
        ((float*)out)[i] = v;
    } else {
        const float r = round_to_dtype(v, dtype);
        uint32_t u;
        std::memcpy(&u, &r, 4);
        ((uint16_t*)out)[i] = (uint16_t)(u >> 16);
    }
}

// out (M, N) in dtype = round(y + bias), y float32 (M, N), bias (N) in dtype or null.
static void round_product(const float* y, const void* bias, int dtype, int M, int N, void* out) {
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float v = y[(int64_t)m * N + n];
            if (bias) v += load_value(bias, n, dtype);
            put_rounded(v, dtype, out, (int64_t)m * N + n);
        }
}

// rows x (M, N) of dtype elements: out = round(x + h)
static void add_rounded(const void* x, const void* h, int dtype, int64_t n, void* out) {
    for (int64_t i = 0; i < n; i++) put_rounded(load_value(x, i, dtype) + load_value(h, i, dtype), dtype, out, i);
}

// y (B, sum n) float32 <- x (B, E) times parts of one row's weights stored in different types (a
// Q4_K_M file keeps some v rows in Q6_K): one product a part, side by side in y's columns.
static int products_apart(const void* x, int dt, int B, int E, const void* const* w, const int* wd, const int* n, int parts,
                          float* y) {
    int total = 0, widest = 0;
    for (int i = 0; i < parts; i++) total += n[i], widest = std::max(widest, n[i]);
    std::vector<float> part((size_t)B * widest);
    for (int i = 0, at = 0; i < parts; at += n[i], i++) {
        if (int st = gemm_rows(x, dt, w[i], wd[i], B, n[i], E, part.data())) return st;
        for (int r = 0; r < B; r++) std::memcpy(y + (size_t)r * total + at, part.data() + (size_t)r * n[i], (size_t)n[i] * 4);
    }
    return MINILLAMA_OK;
}

static int decode_layer(const LayerStep* step) {
    const LayerStep& s = *step;
    const int B = s.B, E = s.hidden, D = s.D, Hq = s.Hq, Hkv = s.Hkv, dt = s.dtype;
    if (dt != 0 && dt != 2) return MINILLAMA_E_DTYPE;
    if (B < 1 || Hq % Hkv || D % 2 || !s.attn || s.nattn < 1) return MINILLAMA_E_SHAPE;
    int rows = 0;
    for (int i = 0; i < s.nattn; i++) {
        if (!s.attn[i] || s.attn[i]->B < 1) return MINILLAMA_E_SHAPE;
        rows += s.attn[i]->B;
    }
    if (rows != B) return MINILLAMA_E_SHAPE;
    const int QKV = (Hq + 2 * Hkv) * D, es = dtype_bytes(dt);
    char* b = (char*)s.scratch;  // the scratch layout, in order (step_scratch_bytes says how much)
    auto take = [&](size_t bytes) { char* p = b; b += (bytes + 63) / 64 * 64; return (void*)p; };
    void* normed = take((size_t)B * E * es);
    void* qkv = take((size_t)B * QKV * es);
    void* q = take((size_t)B * Hq * D * es);
    void* k = take((size_t)B * Hkv * D * es);
    void* a = take((size_t)B * Hq * D * es);
    void* h = take((size_t)B * E * es);
    void* gu = take((size_t)B * 2 * s.I * es);
    void* act = take((size_t)B * s.I * es);
    float* y = (float*)take((size_t)B * std::max(std::max(QKV, 2 * s.I), E) * 4);

    Laps t{s.timing};
    if (int st = add_rms_norm(s.x, nullptr, s.w_in, dt, B, E, s.eps, nullptr, normed)) return st;
    t.lap(STEP_REST);
    if (!s.w_kv[0]) {
        if (int st = gemm_rows(normed, dt, s.w_qkv, s.wdtype[0], B, QKV, E, y)) return st;
    } else {  // q, k and v stored in different types
        const void* w[3] = {s.w_qkv, s.w_kv[0], s.w_kv[1]};
        const int wd[3] = {s.wdtype[0], s.kv_dtype[0], s.kv_dtype[1]}, n[3] = {Hq * D, Hkv * D, Hkv * D};
        if (int st = products_apart(normed, dt, B, E, w, wd, n, 3, y)) return st;
    }
    t.lap(STEP_PROJECTIONS);
    round_product(y, s.b_qkv, dt, B, QKV, qkv);
    for (int bb = 0; bb < B; bb++) {  // q, k, v out of the fused row; the stored key (and v) for the cache
        const char* row = (const char*)qkv + (size_t)bb * QKV * es;
        std::memcpy((char*)q + (size_t)bb * Hq * D * es, row, (size_t)Hq * D * es);
        std::memcpy((char*)k + (size_t)bb * Hkv * D * es, row + (size_t)Hq * D * es, (size_t)Hkv * D * es);
        std::memcpy((char*)s.v_new + (size_t)bb * Hkv * D * es, row + (size_t)(Hq + Hkv) * D * es, (size_t)Hkv * D * es);
    }
    if (s.pre_rope) std::memcpy(s.k_new, k, (size_t)B * Hkv * D * es);  // stored before RoPE
    rope_rows(q, dt, B, Hq, D, (int64_t)Hq * D, s.cos, s.sin);
    rope_rows(k, dt, B, Hkv, D, (int64_t)Hkv * D, s.cos, s.sin);
    if (!s.pre_rope) std::memcpy(s.k_new, k, (size_t)B * Hkv * D * es);

    t.lap(STEP_REST);
    for (int i = 0, row = 0; i < s.nattn; row += s.attn[i]->B, i++) {  // each cache's rows through its plan
        LayerPlan plan = *s.attn[i];  // the cache's parts; the step's own q, k, v and output
        plan.H = Hkv, plan.R = Hq / Hkv, plan.D = D, plan.dtype = dt;
        plan.q = (char*)q + (size_t)row * Hq * D * es, plan.k = (char*)k + (size_t)row * Hkv * D * es;
        plan.v = (char*)s.v_new + (size_t)row * Hkv * D * es, plan.out = (char*)a + (size_t)row * Hq * D * es;
        if (int st = attend_layer(&plan)) return st;
    }
    t.lap(STEP_ATTENTION);

    if (int st = gemm_rows(a, dt, s.w_o, s.wdtype[1], B, E, Hq * D, y)) return st;
    t.lap(STEP_PROJECTIONS);
    round_product(y, s.b_o, dt, B, E, h);
    add_rms_norm(s.x, h, s.w_post, dt, B, E, s.eps, s.x, normed);  // x <- round(x + h), normed
    t.lap(STEP_REST);
    if (!s.w_up) {
        if (int st = gemm_rows(normed, dt, s.w_gu, s.wdtype[2], B, 2 * s.I, E, y)) return st;
    } else {  // gate and up stored in different types
        const void* w[2] = {s.w_gu, s.w_up};
        const int wd[2] = {s.wdtype[2], s.up_dtype}, n[2] = {s.I, s.I};
        if (int st = products_apart(normed, dt, B, E, w, wd, n, 2, y)) return st;
    }
    t.lap(STEP_PROJECTIONS);
    round_product(y, s.b_gu, dt, B, 2 * s.I, gu);
    silu_mul(gu, dt, B, s.I, act);
    t.lap(STEP_REST);
    if (int st = gemm_rows(act, dt, s.w_down, s.wdtype[3], B, E, s.I, y)) return st;
    t.lap(STEP_PROJECTIONS);
    round_product(y, s.b_down, dt, B, E, h);
    add_rounded(s.x, h, dt, (int64_t)B * E, s.x);
    t.lap(STEP_REST);
    return MINILLAMA_OK;
}

extern "C" int decode_step(const LayerStep* steps, int n, StepEnds* ends) {
    if (n < 1 || !ends) return MINILLAMA_E_SHAPE;
    const LayerStep& first = steps[0];
    const int B = first.B, E = first.hidden, dt = first.dtype, V = ends->vocab;
    if (dt != 0 && dt != 2) return MINILLAMA_E_DTYPE;
    const int edt = ends->embed_dtype, hdt = ends->head_dtype;
    if (edt != dt && !is_block_dtype(edt)) return MINILLAMA_E_DTYPE;
    const size_t row = (size_t)E * dtype_bytes(dt), erow = row_bytes(edt, E);
    for (int b = 0; b < B; b++)  // every token checked before anything is written
        if (ends->tokens[b] < 0 || ends->tokens[b] >= V) return MINILLAMA_E_SHAPE;
    for (int b = 0; b < B; b++) {  // x = embedding rows (every layer's x is this one buffer)
        const uint8_t* e = (const uint8_t*)ends->embed + ends->tokens[b] * erow;
        if (!is_block_dtype(edt)) {
            std::memcpy((char*)first.x + b * row, e, row);
            continue;
        }
        // a row of blocks, widened and rounded to dt as the weights a prompt's chunk multiplies are
        if (int st = dequantize_rows(e, edt, 1, E, (char*)first.x + b * row, dt)) return st;
    }
    for (int i = 0; i < n; i++) {
        LayerStep layer = steps[i];  // this step's angles
        layer.cos = ends->cos, layer.sin = ends->sin;
        if (const int status = decode_layer(&layer)) return status;
    }
    Laps t{first.timing};
    // The final norm; with a head, into the first piece of the scratch (decode_layer's `normed`).
    void* normed = ends->head ? first.scratch : ends->out;
    if (int st = add_rms_norm(first.x, nullptr, ends->norm, dt, B, E, ends->eps, nullptr, normed)) return st;
    if (ends->head) {  // logits rounded once, as F.linear rounds
        if (int st = gemm_rows(normed, dt, ends->head, hdt, B, V, E, ends->product)) return st;
        round_product(ends->product, nullptr, dt, B, V, ends->out);
    }
    t.lap(STEP_HEAD);
    // The cache write, while the threads are still awake: its failure (a value that is not
    // finite, a write it does not make) leaves the cache as it was and the step's outputs valid.
    ends->write_status = ends->nwrites ? write_tokens(ends->writes, ends->nwrites) : MINILLAMA_OK;
    t.lap(STEP_WRITE);
    return MINILLAMA_OK;
}

extern "C" int64_t step_scratch_bytes(int B, int hidden, int Hq, int Hkv, int D, int I, int dtype) {
    const int64_t es = dtype_bytes(dtype), QKV = (int64_t)(Hq + 2 * Hkv) * D;
    const int64_t sizes[] = {B * hidden * es, B * QKV * es, (int64_t)B * Hq * D * es, (int64_t)B * Hkv * D * es,
                             (int64_t)B * Hq * D * es, B * hidden * es, (int64_t)B * 2 * I * es, (int64_t)B * I * es,
                             B * std::max(std::max(QKV, (int64_t)2 * I), (int64_t)hidden) * 4};
    int64_t total = 0;
    for (int64_t n : sizes) total += (n + 63) / 64 * 64;
    return total;
}

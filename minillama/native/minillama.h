// The C ABI of minillama's native kernels: every function Python calls (native/abi.py binds
// them with ctypes) and every struct passed to them, declared once.
//
// Conventions:
//   * dtype codes: 0 float32, 1 float16, 2 bfloat16 (native/abi.py: DTYPE_CODE);
//   * tensors are raw pointers to contiguous row-major memory; shapes are given in comments;
//   * a ring buffer of rows is (B*H, slots, width) and logical row i (age order) lives in slot
//     (start + i) % slots (kv/ring.py);
//   * every entry point checks what it supports and returns a status: 0 done, or one of
//     MINILLAMA_E_* with nothing written; Python turns a status into a reason and takes the
//     PyTorch reference instead (native/abi.py: STATUS). Nothing here aborts the process.
//
// Struct layouts are pinned with static_asserts (as llama.cpp's ggml-common.h pins its
// blocks); native/abi.py compares ctypes' sizes with minillama_abi_size() when it loads.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

enum MinillamaStatus {
    MINILLAMA_OK = 0,
    MINILLAMA_E_DTYPE = 1,      // a dtype code the kernel does not take
    MINILLAMA_E_HEAD_DIM = 2,   // head_dim outside what the kernel supports
    MINILLAMA_E_GQA = 3,        // query heads per KV head outside what the kernel supports
    MINILLAMA_E_CODES = 4,      // code width, group or row kind the kernel does not read
    MINILLAMA_E_SHAPE = 5,      // other sizes that do not fit (parts, rows, groups)
    MINILLAMA_E_NONFINITE = 6,  // an input or result that is not finite
};

// How a stored row is decoded (kv/codecs.py: Codec.row_kind).
enum RowKind {
    ROW_FLOAT = 0,       // unquantized rows (f32 / f16 / bf16)
    ROW_TOKEN = 1,       // per-token codes: affine (scale, zero), ternary or codebook (scale only)
    ROW_CHANNEL = 2,     // KIVI per-channel codes: scale and zero per channel and group of tokens
    ROW_VECTOR = 3,      // one byte per vdim channels: the index of a codebook vector, x a scale per group
    ROW_BLOCKS = 4,      // nb frequency blocks (nlevels), per head each at its own width (levels), a byte scale each
};

// The parts a layer's K (or V) can hold, in age order: sinks, quantized body, tier, exact residual.
#define MINILLAMA_MAX_PARTS 4

// Which kernel reads a part of the cache (kv/fused_attention.py: route()).
enum Route { ROUTE_FLOAT = 0, ROUTE_TOKEN = 1, ROUTE_CHANNEL = 2, ROUTE_INTEGER = 3, ROUTE_ROWS = 4 };

// Where one part's rows live and how to decode them.
struct RowSource {
    int kind;   // RowKind
    int bits;   // code width (5 = trits); for ROW_FLOAT the dtype code
    int group;  // channels per scale (ROW_TOKEN) or tokens per scale row (ROW_CHANNEL)
    const void* data;  // (B*H, slots, width): codes, or float rows
    int slots, start;  // the ring of rows
    const uint16_t* scale;  // fp16: ROW_TOKEN (B*H, slots, D/group); ROW_CHANNEL (B*H, sslots, D)
    const uint16_t* zero;   // same shape as scale, or null (ternary, codebook)
    int sslots, sstart;     // ROW_CHANNEL: the ring of scale rows
    const float* codebook;  // ROW_TOKEN: Gaussian Lloyd-Max levels, or null; ROW_BLOCKS: the books of widths 1-8 at 2^w - 2
    const uint16_t* levels; // ROW_BLOCKS: (B*H, nlevels) each block's width
    int nlevels;            // ROW_VECTOR: 16 (a sign x pattern book); ROW_BLOCKS: blocks per row
    int vdim;               // ROW_VECTOR: channels per code (codebook: 256 vectors of vdim floats)
    const float* center;    // (B*H, D) float32 key center to add back, or null
    const float* cos;       // (positions, D/2) float32, or null: rotate each row for its position
    const float* sin;
    int pos0;               // position of the part's first token (consecutive after it)
    const uint8_t* scale8;  // ROW_TOKEN codebooks with one-byte log scales (rows.h: log_scale), instead of scale
};

struct Part {
    int route, n;  // Route; rows held
    RowSource src;
};

// A ring of rows shared by the layers of a group (kv/layered.py): row r (layer-major, then
// sequence and head) has `slots` slots of `width` bytes.
struct RingRef {
    void* buf;
    int slots, width;
};

// One decode token into one group's rings (encode.cpp: write_tokens, one per group). The group's
// layers' new vectors, x's rows of `layers` (L * BH, D) in `dtype`, are put in storage form
// (rotated, minus the fp16 center (L * BH, D));
// when flush > 0, `from_res` rows of the residual from slot res_first, then (flush > from_res)
// the new row, are encoded into the body from codes_slot (and scale_slot): affine codes of
// `bits` (2, 3, 4, 8) in groups of `group` channels (axis 0) or tokens (axis 1), or bits = 0:
// float16 rows copied into `codes`, the body's values ring; then the new row goes to `to` at
// to_slot unless to.buf is null (it was encoded).
struct TokenWrite {
    int L, BH, D;
    const void* x;         // every layer's new rows, (layers, BH, D)
    const int32_t* layers; // (L,): the write's layer l is x's layer layers[l]
    int dtype, rotate;
    const uint16_t* center;
    RingRef to;
    int to_slot;
    int flush, from_res, res_first;
    RingRef res;
    int bits, group, axis;
    RingRef codes, scale, zero;  // zero: none for a codebook
    int codes_slot, scale_slot;
    const float* levels;  // a codebook's 2^bits ascending levels (encode_codebook), or null: affine codes
    int refine;           // a codebook's scale refinement rounds
    int log_scale;        // a codebook's scales are one-byte log scales (rows.h: log_scale), not fp16
    int blocks;              // frequency-block keys (kv/freq_blocks.py): blocks a row, else 0; `levels`
                             // then holds the books of widths 1-8 at 2^w - 2, `bits` the row's average width
    const uint16_t* widths;  // (heads, blocks): each head's block widths (0-8)
    int heads;               // row r (L * BH order) is head r % heads
    // A tier (kv/store.py) as the block's source: with src_codes.buf the from_res rows are decoded
    // from codebook codes (src_bits wide, one scale a row: fp16, or one log byte with
    // src_log_scale) and rounded to float16, instead of read from the float16 ring `res`.
    RingRef src_codes, src_scale;
    const float* src_levels;  // the tier codebook's 2^src_bits levels
    int src_bits, src_log_scale;
    // Sign-structured vector codes (kv/codecs.py: VectorCodebook with signs): vdim channels a
    // one-byte code, `levels` then holds the book's `patterns` non-negative vectors (patterns x
    // vdim); vdim 0: scalar codes.
    int vdim, patterns;
};

// One layer's decode attention: q (B, H*R, D) against every held part of K and V plus the new
// token's own k, v (B, H, D); out (B, H*R, D). q, k, v and out in `dtype`.
struct LayerPlan {
    int B, H, R, D;
    const void* q;
    const void* k;
    const void* v;
    int dtype;
    int rotate_k;              // keys stored rotated: q and the new key by H (1) or in rotate_k frequency blocks
    int rotate_v;              // values stored rotated: rotate the new value and, once, the output
    const float* k_center;     // (B*H, D) float32, subtracted from the new key (centered keys), or null
    int nk, nv;                // parts of K and of V (at most MINILLAMA_MAX_PARTS each: sinks, body, tier, residual)
    Part kparts[MINILLAMA_MAX_PARTS], vparts[MINILLAMA_MAX_PARTS];
    void* out;
};

// One decode step of one layer (step.cpp): RMSNorm, q/k/v, RoPE, attention, o_proj, residual,
// RMSNorm, gate/up, SiLU x up, down, residual. Weights, norms, biases and x in `dtype`. The B
// rows may belong to several caches (a group of KV schemes decoded as one batch, kv/group.py):
// attention reads each cache's rows through its own plan.
struct LayerStep {
    int B, hidden, Hq, Hkv, D, I, dtype;
    float eps;
    const void* w_in;    // (hidden) input_layernorm
    const void* w_post;  // (hidden) post_attention_layernorm
    const void* w_qkv;   // ((Hq + 2 Hkv) D, hidden), q | k | v rows
    const void* b_qkv;   // ((Hq + 2 Hkv) D) or null
    const void* w_o;     // (hidden, Hq D)
    const void* b_o;
    const void* w_gu;    // (2 I, hidden), gate | up rows
    const void* b_gu;
    const void* w_down;  // (hidden, I)
    const void* b_down;
    const float* cos;    // (D) float32: this token's RoPE angles (every sequence is at the same position)
    const float* sin;
    int pre_rope;        // the cache keeps keys before RoPE: k_new gets the unrotated key
    int wdtype[4];       // the weights of w_qkv, w_o, w_gu, w_down: dtype, or a block dtype (dtypes.h: BlockDtype)
    const void* w_kv[2]; // null, or k and v apart from q (stored in another type): w_qkv then holds q's rows only
    int kv_dtype[2];     // their dtypes, as wdtype's
    const void* w_up;    // null, or up apart from gate (another type): w_gu then holds gate's rows only
    int up_dtype;        // its dtype, as wdtype's
    void* x;             // (B, hidden): the residual stream, updated in place
    void* k_new;         // (B, Hkv, D): the new key as the cache stores it
    void* v_new;         // (B, Hkv, D): the new value
    const LayerPlan* const* attn;  // the caches' parts of this layer, one plan per cache whose rows follow
    int nattn;                     // each other in the batch (plan B rows each; q, k, v, out are the step's own)
    void* scratch;       // step_scratch_bytes(...) bytes
    double* timing;      // null, or STEP_PHASES seconds the call adds its phases' wall time to (profiling)
};
// The phases decode_layer times when asked: projections (the four products), attention, the rest
// (norms, rounding, RoPE, SiLU, copies); decode_step adds the final norm and LM head.
enum { STEP_PROJECTIONS = 0, STEP_ATTENTION = 1, STEP_REST = 2, STEP_HEAD = 3, STEP_WRITE = 4, STEP_PHASES = 5 };

// What a whole decode step does around its layers (decode_step): each sequence's embedding row
// in, RoPE angles for every layer, and the final norm and LM head out. In the layers' dtype.
struct StepEnds {
    const void* embed;      // (vocab, hidden): the embedding table
    const int64_t* tokens;  // (B): this step's token of each sequence
    const float* cos;       // (D) float32: the RoPE angles of the step's position (every layer's)
    const float* sin;
    const void* norm;       // (hidden): the final RMSNorm weight
    const void* head;       // (vocab, hidden): the LM head, or null: out gets the normed hidden state
    float* product;         // (B, vocab) float32: the head's product before rounding
    void* out;              // (B, vocab) logits or (B, hidden) hidden states
    int vocab;
    float eps;              // the final norm's
    // The cache write of the step's token (encode.cpp: write_tokens, made last, all or nothing):
    // `nwrites` writes that read the layers' k_new, v_new, or none; its status comes back in
    // write_status (not OK: nothing was written, and the caller writes the token its own way).
    const TokenWrite* writes;
    int nwrites;
    int write_status;
    int embed_dtype;  // the embedding table's and the LM head's weights: the layers' dtype, or a
    int head_dtype;   // block dtype (dtypes.h: BlockDtype; the embedding's rows dequantized into x)
};

// -- entry points -------------------------------------------------------------------------

// Attention (layer_attention.cpp). attend_part: one part alone; values = 0: x = q (B*H, R, D) and
// scores go to out's columns (rows ld apart); values = 1: x = p (rows ld apart), p . V added to out.
int attend_layer(const LayerPlan* plan);
int attend_part(int values, int route, const float* x, const RowSource* src, int B, int H, int R, int D, int n,
                int ld, float* out);
// Whether `route` reads `src` (as values, or as keys) for R query heads per KV head of size D: 0 or a status.
int route_supported(int route, int values, const RowSource* src, int R, int D);
// 1 when the exact kernels read `src` faster than the integer route would on this build, else 0.
int exact_is_faster(int values, const RowSource* src, int D);

// A prefill chunk's causal attention (prefill_attention.cpp), float32: q (B, Hq, T, D), k and v
// (B, Hkv, L, D), out (B, Hq, T, D), each by its strides in elements (batch, head, token; channels
// contiguous). Query t sees keys 0 .. L - T + t. D 64, 80, 96, 128 or 256.
int causal_attention(const float* q, const int64_t* q_strides, const float* k, const int64_t* k_strides,
                     const float* v, const int64_t* v_strides, int B, int Hq, int Hkv, int T, int L, int D,
                     float* out, const int64_t* out_strides);

// Projections (linear.cpp): y (M, N) float32 = x (M, K) @ W (N, K)^T; x and W float32 or bfloat16
// (dtype codes), any M (the weights stream once per 16 rows).
int gemm_rows(const void* x, int xdtype, const void* W, int dtype, int M, int N, int K, float* y);
int dequantize_rows(const void* W, int dtype, int N, int K, void* out, int out_dtype);  // blocks -> (N, K)

// Small decode-step ops (decode_ops.cpp), float32 or bfloat16, rounded as PyTorch rounds.
int add_rms_norm(const void* x, const void* h, const void* weight, int dtype, int M, int N, float eps, void* sum,
                 void* out);
int rope_rows(void* x, int dtype, int B, int H, int D, int64_t bstride, const float* cos, const float* sin);
int silu_mul(const void* gate_up, int dtype, int M, int I, void* out);

// Cache writes (encode.cpp). prepare_rows returns how many outputs are not finite, or -status.
int64_t prepare_rows(const void* x, int dtype, int64_t rows, int D, int rotate, const uint16_t* center,
                     int64_t rows_per_center, uint16_t* out);
int encode_affine(const uint16_t* x, int64_t BH, int n, int D, int bits, int G, int axis, uint8_t* codes,
                  uint16_t* scale, uint16_t* zero);
int encode_vectors(const uint16_t* x, int64_t BH, int n, int D, int bits, int G, int dim, const float* patterns, int P,
                   int refine, uint8_t* codes, uint16_t* scale);
int encode_codebook(const uint16_t* x, int64_t BH, int n, int D, int bits, int G, const float* levels, int refine,
                    int log_scale, uint8_t* codes, void* scale);
int write_tokens(const TokenWrite* writes, int n);

// What a step changes in the plans of the layers that share a codec (layer_attention.cpp): for
// the first nparts parts of keys (values = 0) or values of each of plans[0..n), the row count,
// ring start, scale ring start and first position from live[4 i .. 4 i + 3].
int set_parts(LayerPlan* const* plans, int n, int values, const int* live, int nparts);

// A decode step (step.cpp): the embedding rows of ends->tokens into steps[0].x, steps[0..n) (the
// layers in order, sharing x; the first status that is not 0 stops it), then the final norm and
// LM head into ends->out; and the scratch each layer needs.
int decode_step(const LayerStep* steps, int n, StepEnds* ends);
int64_t step_scratch_bytes(int B, int hidden, int Hq, int Hkv, int D, int I, int dtype);

// What this build was compiled for (a bitmask of MINILLAMA_FEATURE_*), and struct sizes.
enum MinillamaFeature {
    MINILLAMA_FEATURE_AVX2 = 1,      // AVX2 + FMA + F16C
    MINILLAMA_FEATURE_BMI2 = 2,
    MINILLAMA_FEATURE_AVX512 = 4,    // AVX-512 F + BW + VL
    MINILLAMA_FEATURE_AVX512_BF16 = 8,
    MINILLAMA_FEATURE_AVX512_VNNI = 16,
    MINILLAMA_FEATURE_AVX512_VBMI = 32,
    MINILLAMA_FEATURE_NEON = 64,       // aarch64's Advanced SIMD
    MINILLAMA_FEATURE_DOTPROD = 128,   // ARMv8.2 int8 dot products (sdot/udot)
    MINILLAMA_FEATURE_NO_OPENMP = 256, // built without OpenMP: one thread
};
int minillama_features(void);
int minillama_abi_size(int which);  // 0 RowSource, 1 Part, 2 LayerPlan, 3 LayerStep, 4 TokenWrite, 5 StepEnds
}

// The layouts ctypes mirrors (x86-64 and aarch64 LP64: 8-byte pointers, 4-byte ints).
static_assert(sizeof(void*) == 8, "minillama's native kernels assume a 64-bit target");
static_assert(sizeof(RowSource) == 120, "RowSource layout changed: update native/abi.py");
static_assert(offsetof(RowSource, data) == 16 && offsetof(RowSource, codebook) == 56 && offsetof(RowSource, vdim) == 76,
              "RowSource layout");
static_assert(sizeof(Part) == 128, "Part layout changed: update native/abi.py");
static_assert(sizeof(LayerPlan) == 72 + 2 * MINILLAMA_MAX_PARTS * sizeof(Part) + 8, "LayerPlan layout changed: update native/abi.py");
static_assert(sizeof(LayerStep) == 32 + 12 * 8 + 24 + 24 + 16 + 6 * 8 + 8, "LayerStep layout changed: update native/abi.py");
static_assert(sizeof(StepEnds) == 8 * 8 + 8 + 8 + 8 + 8, "StepEnds layout changed: update native/abi.py");
static_assert(sizeof(RingRef) == 16 && sizeof(TokenWrite) == 264, "TokenWrite layout changed: update native/abi.py");

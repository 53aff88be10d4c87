// The fast Walsh-Hadamard transform's butterflies and the frequency blocks' channel order, shared
// by the cache write (encode.cpp: prepare_rows) and decode attention (layer_attention.cpp: the
// query, the new key and value, the output; outliers.h: the query back in the model's channels).
#pragma once

#include <cmath>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// x (D floats, D a power of two) <- x H_D without the 1 / sqrt(D): Sylvester's order, the
// matrix kv/quantize.py builds; log2(D) passes of D / 2 butterflies (a, b) -> (a + b, a - b).
// The readable form; fwht below runs it for D < 8 and on builds without AVX2.
static inline void fwht_reference(float* x, int D) {
    for (int h = 1; h < D; h *= 2)
        for (int i = 0; i < D; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b, x[j + h] = a - b;
            }
}

// The same passes in the same order on whole registers, so every element gets the same
// additions and subtractions as in fwht_reference, bit for bit (tests/test_cache.py holds every
// build target's cache write to kv/quantize.py's bytes). A pass of span h narrower than a
// register: y = x with each lane swapped for its partner j ^ h, then a + b where bit h of the
// lane is clear and partner - self where it is set; wider spans add and subtract whole
// registers. Scalar, a 64-channel transform was ~2,000 instructions, and a layer's decode
// attention runs 24 of them (the queries, the new key and value, the outputs).
static inline void fwht(float* x, int D) {
#if defined(__AVX2__)
    if (D % 8 == 0) {
        int h = 8;  // the spans below h are done inside registers
#if defined(__AVX512F__)
        if (D % 16 == 0) {
            for (int i = 0; i < D; i += 16) {
                __m512 v = _mm512_loadu_ps(x + i);  // (16,): one register's channels
                const __m512 y1 = _mm512_permute_ps(v, 0xB1);  // neighbours swapped
                v = _mm512_mask_sub_ps(_mm512_add_ps(v, y1), 0xAAAA, y1, v);
                const __m512 y2 = _mm512_permute_ps(v, 0x4E);  // pairs swapped
                v = _mm512_mask_sub_ps(_mm512_add_ps(v, y2), 0xCCCC, y2, v);
                const __m512 y4 = _mm512_shuffle_f32x4(v, v, 0xB1);  // 128-bit lanes swapped in pairs
                v = _mm512_mask_sub_ps(_mm512_add_ps(v, y4), 0xF0F0, y4, v);
                const __m512 y8 = _mm512_shuffle_f32x4(v, v, 0x4E);  // 256-bit halves swapped
                v = _mm512_mask_sub_ps(_mm512_add_ps(v, y8), 0xFF00, y8, v);
                _mm512_storeu_ps(x + i, v);
            }
            h = 16;
        }
#endif
        if (h == 8)
            for (int i = 0; i < D; i += 8) {
                __m256 v = _mm256_loadu_ps(x + i);  // (8,): one register's channels
                __m256 y = _mm256_permute_ps(v, 0xB1);  // neighbours swapped
                v = _mm256_blend_ps(_mm256_add_ps(v, y), _mm256_sub_ps(y, v), 0xAA);
                y = _mm256_permute_ps(v, 0x4E);  // pairs swapped
                v = _mm256_blend_ps(_mm256_add_ps(v, y), _mm256_sub_ps(y, v), 0xCC);
                y = _mm256_permute2f128_ps(v, v, 1);  // 128-bit halves swapped
                v = _mm256_blend_ps(_mm256_add_ps(v, y), _mm256_sub_ps(y, v), 0xF0);
                _mm256_storeu_ps(x + i, v);
            }
        for (; h < D; h *= 2)  // wider spans: whole registers added and subtracted, 8 floats at a time
            for (int i = 0; i < D; i += 2 * h)
                for (int j = i; j < i + h; j += 8) {
                    const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + h);
                    _mm256_storeu_ps(x + j, _mm256_add_ps(a, b)), _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
                }
        return;
    }
#endif
    fwht_reference(x, D);
}

// x <- x H, H the normalized Sylvester-Hadamard matrix for a power-of-two D, else one such block
// per power of two in D, largest first (80 = 64 + 16: kv/quantize.py's hadamard_blocks);
// hadamard_block(left) is the next block's size when `left` channels are left.
static inline int hadamard_block(int left) {
    int n = 1;
    while (2 * n <= left) n *= 2;
    return n;
}

static inline void hadamard(float* x, int D) {
    for (int i = 0, n; i < D; i += n) {
        n = hadamard_block(D - i);
        fwht(x + i, n);
        const float norm = 1.f / std::sqrt((float)n);
        for (int d = i; d < i + n; d++) x[d] *= norm;
    }
}

// out <- x's D channels in nb RoPE frequency blocks (kv/quantize.py: frequency_block_order): block
// i holds frequencies i F .. (i + 1) F - 1, F = D / 2 / nb, with both channels of each rotate-half
// pair (f, f + D/2).
static inline void frequency_blocks(const float* x, int D, int nb, float* out) {
    const int f = D / 2 / nb, half = D / 2;
    for (int i = 0, k = 0; i < nb; i++)
        for (int h = 0; h <= half; h += half)
            for (int c = h + i * f; c < h + (i + 1) * f; c++) out[k++] = x[c];
}

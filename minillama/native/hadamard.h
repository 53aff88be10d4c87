// The fast Walsh-Hadamard transform's butterflies and the frequency blocks' channel order, shared
// by the cache write (encode.cpp: prepare_rows) and decode attention (layer_attention.cpp: the
// query, the new key and value, the output).
#pragma once

// x (D floats, D a power of two) <- x H_D without the 1 / sqrt(D): Sylvester's order, the
// matrix kv/quantize.py builds; log2(D) passes of D / 2 butterflies (a, b) -> (a + b, a - b).
static inline void fwht(float* x, int D) {
    for (int h = 1; h < D; h *= 2)
        for (int i = 0; i < D; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b, x[j + h] = a - b;
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

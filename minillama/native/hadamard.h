// The fast Walsh-Hadamard transform's butterflies, shared by the cache write (encode.cpp:
// prepare_rows) and decode attention (layer_attention.cpp: the query, the new value, the output).
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

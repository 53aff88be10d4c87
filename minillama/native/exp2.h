// 2^f for |f| <= 1/2: the polynomial both softmax kernels take e^x (= 2^k 2^f) from
// (layer_attention.cpp's exp_one for a float, prefill_attention.cpp's exp2v for a vector).
#pragma once

// Degree-6 minimax coefficients (relative error about 2e-7, like expf's); T a float or a GCC
// vector of floats (the same operations, lane by lane).
template <class T>
static inline T exp2_fraction(T f) {
    T p = f * 1.535336188e-4f + 1.339887440e-3f;
    p = p * f + 9.618437357e-3f;
    p = p * f + 5.550332471e-2f;
    p = p * f + 2.402264791e-1f;
    p = p * f + 6.931472028e-1f;
    return p * f + 1.0f;
}

// Matrix-vector product for one decode token against bfloat16 weights (CPU, OpenMP).
//
//   y[n] = sum_k x[k] * W[n, k]          x float32 (K), W bfloat16 (N, K) row-major, y float32 (N)
//
// Decoding one token reads every weight once and does two flops per weight, so speed is
// set by how fast the weights stream from memory. PyTorch's bfloat16 linear for a single
// row reaches about half of this machine's read bandwidth; this loop reaches most of it:
// four rows at a time share each load of x, bfloat16 widens to float32 with one shift
// (a bfloat16 is the top half of a float32), accumulation is in float32. The model falls
// back to torch's F.linear (the reference) for anything else: batches, other dtypes, CUDA.

#include <cstdint>
#include <cstring>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// K known at compile time (the common hidden and intermediate sizes) fully unrolls the row loop.
template <int KC>
static void gemv_bf16_impl(const float* x, const uint16_t* W, int N, int K_, float* y) {
    const int K = KC ? KC : K_;
#pragma omp parallel for schedule(static)
    for (int n0 = 0; n0 < N; n0 += 4) {
        if (n0 + 4 <= N) {
            const uint16_t* w0 = W + (int64_t)n0 * K;
            const uint16_t *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
            for (int k = 0; k < K; k++) {
                float xk = x[k];
                a0 += xk * bf16_to_float(w0[k]);
                a1 += xk * bf16_to_float(w1[k]);
                a2 += xk * bf16_to_float(w2[k]);
                a3 += xk * bf16_to_float(w3[k]);
            }
            y[n0] = a0, y[n0 + 1] = a1, y[n0 + 2] = a2, y[n0 + 3] = a3;
        } else {
            for (int n = n0; n < N; n++) {
                const uint16_t* w = W + (int64_t)n * K;
                float a = 0.f;
                for (int k = 0; k < K; k++) a += x[k] * bf16_to_float(w[k]);
                y[n] = a;
            }
        }
    }
}

extern "C" void gemv_bf16(const float* x, const uint16_t* W, int N, int K, float* y) {
    if (K == 576) gemv_bf16_impl<576>(x, W, N, K, y);
    else if (K == 1536) gemv_bf16_impl<1536>(x, W, N, K, y);
    else if (K == 2048) gemv_bf16_impl<2048>(x, W, N, K, y);
    else if (K == 4096) gemv_bf16_impl<4096>(x, W, N, K, y);
    else gemv_bf16_impl<0>(x, W, N, K, y);
}

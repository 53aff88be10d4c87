// What this build of the kernels was compiled for, and the sizes of the structs of the C ABI
// (minillama.h), which native/abi.py compares with its ctypes mirrors when the library loads.

#include "openmp.h"

#include "minillama.h"

// How many threads the kernels' parallel regions use from now on (the calling thread's OpenMP
// setting: the decode step's regions are all started from the thread that calls it).
extern "C" void minillama_set_threads(int n) { omp_set_num_threads(n > 0 ? n : 1); }

extern "C" int minillama_threads(void) { return omp_get_max_threads(); }

extern "C" int minillama_features(void) {
    int f = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    f |= MINILLAMA_FEATURE_AVX2;
#endif
#ifdef __BMI2__
    f |= MINILLAMA_FEATURE_BMI2;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    f |= MINILLAMA_FEATURE_AVX512;
#endif
#ifdef __AVX512BF16__
    f |= MINILLAMA_FEATURE_AVX512_BF16;
#endif
#ifdef __AVX512VNNI__
    f |= MINILLAMA_FEATURE_AVX512_VNNI;
#endif
#ifdef __AVX512VBMI__
    f |= MINILLAMA_FEATURE_AVX512_VBMI;
#endif
#ifdef __ARM_NEON
    f |= MINILLAMA_FEATURE_NEON;
#endif
#ifdef __ARM_FEATURE_DOTPROD
    f |= MINILLAMA_FEATURE_DOTPROD;
#endif
#ifndef _OPENMP
    f |= MINILLAMA_FEATURE_NO_OPENMP;
#endif
    return f;
}

extern "C" int minillama_abi_size(int which) {
    switch (which) {
        case 0: return (int)sizeof(RowSource);
        case 1: return (int)sizeof(Part);
        case 2: return (int)sizeof(LayerPlan);
        case 3: return (int)sizeof(LayerStep);
        case 4: return (int)sizeof(TokenWrite);
        case 5: return (int)sizeof(StepEnds);
        default: return -1;
    }
}

// What the AVX-512 kernels share (avx512_attention.cpp: exact float math; avx512_vnni_attention.cpp:
// integer dot products): the intrinsics, and whether this build has the byte shuffles of VBMI.
// Included only where AVX-512 F/BW/DQ are on.
#pragma once

#include <immintrin.h>

#ifdef __AVX512VBMI__
#define MINILLAMA_VBMI 1  // vpermb: the byte shuffle the 3-bit unpacking needs
#else
#define MINILLAMA_VBMI 0
#endif

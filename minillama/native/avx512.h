// What the AVX-512 kernels share (fast_attention.cpp: exact float math; vnni_attention.cpp:
// integer dot products): which byte shuffles this build has, and software prefetch of the rows
// a later chunk reads. Included only where AVX-512 F/BW/DQ are on.
#pragma once

#include "rows.h"

#include <immintrin.h>

#ifdef __AVX512VBMI__
#define MINILLAMA_VBMI 1  // vpermb: the byte shuffle the 3-bit unpacking needs
#else
#define MINILLAMA_VBMI 0
#endif

// Ask for the row `ahead` slots after this one now, so that it arrives from DRAM while this one
// is computed on (the hardware prefetcher alone left a single thread at a third of its bandwidth).
static inline void prefetch_row(const RowSource& s, int64_t bh, int slot, int ahead, int row_bytes) {
    const int target = slot + ahead < s.slots ? slot + ahead : slot + ahead - s.slots;
    if (target < 0 || target >= s.slots) return;
    const char* p = (const char*)s.data + (bh * s.slots + target) * (int64_t)row_bytes;
    for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// The same for `count` consecutive rows starting `ahead` slots after `slot` (the rows a later
// chunk reads), and their per-token scales when the codec has them.
static inline void prefetch_rows(const RowSource& s, int64_t bh, int slot, int ahead, int count, int row_bytes, int scales) {
    const int first = slot + ahead;
    if (first + count > s.slots) return;  // near the ring's end: the hardware prefetcher has it
    const char* p = (const char*)s.data + (bh * s.slots + first) * (int64_t)row_bytes;
    for (int b = 0; b < count * row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    if (scales) {
        const char* q = (const char*)(s.scale + (bh * s.slots + first) * scales);
        for (int b = 0; b < count * scales * 2; b += 64) _mm_prefetch(q + b, _MM_HINT_T0);
    }
}

// OpenMP where the compiler has it (-fopenmp defines _OPENMP: GCC, clang with libomp), else one
// thread: the few calls the kernels make answer as a team of one, and the `#pragma omp` lines
// are ignored (build.py adds -Wno-unknown-pragmas then). Apple's clang ships without OpenMP.
#pragma once

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads() { return 1; }
static inline int omp_get_thread_num() { return 0; }
static inline int omp_get_num_threads() { return 1; }
static inline void omp_set_num_threads(int) {}
#endif

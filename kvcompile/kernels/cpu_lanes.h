/* What the native CPU kernels share (cpu_decode.c, cpu_linear.c): 16-float vectors in GCC's vector extensions,
   split by the compiler where registers are narrower, and their sum across lanes. */

#include <stdint.h>
#include <string.h>

typedef float lanes __attribute__((vector_size(64)));
typedef float lanes8 __attribute__((vector_size(32)));
typedef float lanes4 __attribute__((vector_size(16)));

#define INLINE static inline __attribute__((always_inline))

INLINE lanes load(const float *p) {
    lanes v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The sum of 16 lanes as a tree of halves (a plain loop would add them one after another: strict float order). */
INLINE float sum_lanes(lanes a) {
    lanes8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    lanes4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

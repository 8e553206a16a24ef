/* What the native CPU kernels share (cpu_decode.c, cpu_linear.c): 16-float vectors in GCC's vector extensions,
   split by the compiler where registers are narrower, their sum across lanes, and the register-wide vector a sum
   carried across a loop is kept in. */

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

INLINE lanes8 load8(const float *p) {
    lanes8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The sum of 8 lanes as a tree of halves (a plain loop would add them one after another: strict float order). */
INLINE float sum_lanes8(lanes8 b) {
    lanes4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* The sum of 16 lanes as a tree of halves. */
INLINE float sum_lanes(lanes a) {
    return sum_lanes8(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* A register's width of floats, for a sum carried across a loop: 16 with AVX-512, else 8. A 16-lane accumulator on
   8-lane registers lives on the stack, every step a store and a reload (the AVX2 build's decode ran 3-9x slower than
   with 8-lane sums, measured). */
#ifdef __AVX512F__
typedef lanes reg;
#define REG 16
#define load_reg load
#define sum_reg sum_lanes
#else
typedef lanes8 reg;
#define REG 8
#define load_reg load8
#define sum_reg sum_lanes8
#endif

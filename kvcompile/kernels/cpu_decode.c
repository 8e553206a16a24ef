/* A decode step's attention over a page pool on the CPU in one pass, reading each row where it lies in the pool.

   The eager PyTorch path converts every code to fp32 in memory before a product reads it again, so format pages
   cost one more pass than fp32 pages (docs/results.md), and it gathers ragged heads before reading them. Here each
   (KV head, chunk of pages) keeps a running softmax (flash-decoding): a page's key rows are unpacked into a buffer
   that stays in the L1 cache and scored at once, the page's weights taken, and its value rows unpacked and summed
   in; the codes are read once, as bytes, with the scales folded in, and a head is read only as far as it holds.
   Integer keys of 8, 4 and 2 bits are scored 16 rows at a time with AVX-512 VNNI where the CPU has it
   (``score_tile``: u8 codes times the query split into three int8 levels, no sum across lanes per row); the
   weights of 16 value rows are taken as one vector. Both measured on one layer at 8k x 4 (docs/results.md).

   Row kinds (``kind``), with the layouts of ``packing`` and ``formats`` (``cpu_native.py`` names them):
     2, 3, 4, 8  IntCodec: ``8 / bits`` planes of D * bits / 8 channels (int3: a 2-bit plane of the low bits, then a
                 1-bit plane of the high bit); fp16 scale and minimum per group of channels (a multiple of 16):
                 score s * (q . c) + m * sum(q) per group; weights p * s on the codes, p * m summed apart
     -2, -4      ChannelCodec (KIVI's keys only): fp16 scale and minimum per channel and page, folded into the
                 query once per page: (q * s) . c + q . m
     0           float8 e4m3 codes, one fp32 scale per row (widened through binary16: ``e4m3_row``)
     32          fp32 rows, no metadata (a ragged decode: each head read only as far as it holds)
   Built and loaded by ``cpu_native.py``; the PyTorch decode (``reference.stored_decode``, the gathering decode) is
   the reference it is tested against. */

#include "cpu_lanes.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef _Float16 half;

#define MAX_D 512
#define FP8 0
#define FP32 32

/* q . x over n channels (a multiple of 16), two chains of a register's width of partial sums. */
INLINE float dot(const float *restrict q, const float *restrict x, int n) {
    reg a = {0}, b = {0};
    for (int d = 0; d < n; d += 2 * REG) {
        a += load_reg(q + d) * load_reg(x + d);
        if (d + REG < n) b += load_reg(q + d + REG) * load_reg(x + d + REG);
    }
    return sum_reg(a + b);
}

INLINE void unpack_plane(const uint8_t *restrict c, int width, int bits, float *restrict x) {
    const int planes = 8 / bits, mask = (1 << bits) - 1;
#ifdef __AVX512F__
    if (planes > 1 && width % 16 == 0) { /* 16 bytes widened once, every plane shifted out of them */
        for (int j = 0; j < width; j += 16) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + j)));
            for (int i = 0; i < planes; ++i) {
                const __m512i codes = _mm512_and_si512(_mm512_srli_epi32(v, i * bits), _mm512_set1_epi32(mask));
                _mm512_storeu_ps(x + i * width + j, _mm512_cvtepi32_ps(codes));
            }
        }
        return;
    }
#elif defined(__AVX2__)
    if (planes > 1 && width % 8 == 0) { /* 8 bytes widened once, every plane shifted out of them */
        for (int j = 0; j < width; j += 8) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + j)));
            for (int i = 0; i < planes; ++i) {
                const __m256i codes = _mm256_and_si256(_mm256_srli_epi32(v, i * bits), _mm256_set1_epi32(mask));
                _mm256_storeu_ps(x + i * width + j, _mm256_cvtepi32_ps(codes));
            }
        }
        return;
    }
#else
    typedef uint8_t bytes16 __attribute__((vector_size(16)));
    typedef int32_t ints __attribute__((vector_size(64)));
    if (planes == 4 && width % 16 == 0) { /* 2-bit planes: 16 bytes widened once, every plane shifted out of them */
        for (int j = 0; j < width; j += 16) {
            bytes16 b;
            memcpy(&b, c + j, sizeof b);
            const ints v = __builtin_convertvector(b, ints);
            for (int i = 0; i < planes; ++i) {
                const lanes f = __builtin_convertvector((v >> (i * bits)) & mask, lanes);
                memcpy(x + i * width + j, &f, sizeof f);
            }
        }
        return;
    }
#endif
    for (int i = 0; i < planes; ++i) /* 8 bits (the form the compiler vectorizes best), and 4 bits without AVX2 */
        for (int j = 0; j < width; ++j) x[i * width + j] = (float)((c[j] >> (i * bits)) & mask);
}

/* float8 e4m3fn codes -> their values / 256: a code's bits shifted into a binary16 are that number exactly (the
   subnormals included), widened by the hardware 16 at a time (AVX-512) or 8 (AVX2 and F16C), else through a table
   of all 256 built at load. The encoder never writes NaN (it clamps). D: a multiple of 16. */
#ifdef __AVX512F__
INLINE void e4m3_row(const uint8_t *restrict c, int D, float *restrict x) {
    for (int d = 0; d < D; d += 16) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + d)));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                          _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
        _mm512_storeu_ps(x + d, _mm512_cvtph_ps(h));
    }
}
#elif defined(__AVX2__) && defined(__F16C__)
INLINE void e4m3_row(const uint8_t *restrict c, int D, float *restrict x) {
    for (int d = 0; d < D; d += 8) {
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(c + d)));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                       _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
        _mm256_storeu_ps(x + d, _mm256_cvtph_ps(h));
    }
}
#else
static float e4m3_table[256];

__attribute__((constructor)) static void build_e4m3_table(void) {
    for (int b = 0; b < 256; ++b) {
        const uint16_t bits = (uint16_t)(((b & 0x80) << 8) | ((b & 0x7F) << 7));
        half h;
        memcpy(&h, &bits, sizeof h);
        e4m3_table[b] = (float)h;
    }
}

INLINE void e4m3_row(const uint8_t *restrict c, int D, float *restrict x) {
    for (int d = 0; d < D; ++d) x[d] = e4m3_table[c[d]];
}
#endif

/* One stored row's codes -> x [D], unscaled (integer codes as numbers 0 .. 2^bits - 1). Not for fp32 rows. */
INLINE void unpack_row(const uint8_t *restrict c, int D, int kind, float *restrict x) {
    const int bits = kind < 0 ? -kind : kind;
    if (kind == FP8) {
        e4m3_row(c, D, x);
    } else if (bits == 3) {
        float high[MAX_D];
        unpack_plane(c, D / 4, 2, x);
        unpack_plane(c + D / 4, D / 8, 1, high);
        for (int d = 0; d < D; ++d) x[d] += 4.0f * high[d];
    } else {
        unpack_plane(c, D * bits / 8, bits, x);
    }
}

/* Integer rows' group scales and minima for 16 rows (nr of them real; fp16 pairs, 2 * groups a row, the rows'
   contiguous): scale[k][i], low[k][i] in fp32, 0 past nr. With AVX-512, widened 16 halves at a time and each group's
   lanes gathered, instead of one conversion per value. */
INLINE void grid16(const half *restrict m, int nr, const int groups, float (*restrict scale)[16],
                   float (*restrict low)[16]) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    float f[16 * MAX_D / 8]; /* 2 * groups <= D / 8 values a row */
    const int n = nr * 2 * groups;
    for (int j = 0; j < 32 * groups; j += 16) {
        const __mmask16 real = n - j >= 16 ? 0xFFFF : n > j ? (__mmask16)((1u << (n - j)) - 1) : 0;
        _mm512_storeu_ps(f + j, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(real, m + j)));
    }
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(2 * groups));
    for (int k = 0; k < groups; ++k) {
        const __m512i at = _mm512_add_epi32(rows, _mm512_set1_epi32(2 * k));
        _mm512_storeu_ps(scale[k], _mm512_i32gather_ps(at, f, 4));
        _mm512_storeu_ps(low[k], _mm512_i32gather_ps(_mm512_add_epi32(at, _mm512_set1_epi32(1)), f, 4));
    }
#else
    for (int k = 0; k < groups; ++k)
        for (int i = 0; i < 16; ++i) {
            scale[k][i] = i < nr ? (float)m[i * 2 * groups + 2 * k] : 0.0f;
            low[k][i] = i < nr ? (float)m[i * 2 * groups + 2 * k + 1] : 0.0f;
        }
#endif
}

/* exp(x) for 16 lanes of x <= 0 (Cody-Waite reduction, degree-5 polynomial on [-ln2/2, ln2/2]: relative error
   below 1e-7 on [-87, 0], measured);
   below -87 it returns about 1e-38, never 0, so the caller zeroes what must be 0. */
INLINE lanes exp_lanes(lanes x) {
    typedef int32_t ints __attribute__((vector_size(64)));
    const ints low = x < -87.0f; /* -1 where x is below the floor */
    ints xi, floor_i;
    const lanes floor_x = (lanes){0} - 87.0f;
    memcpy(&xi, &x, sizeof xi);
    memcpy(&floor_i, &floor_x, sizeof floor_i);
    xi = (xi & ~low) | (floor_i & low);
    memcpy(&x, &xi, sizeof x);
    lanes fx = x * 1.44269504088896341f + 0.5f;
    lanes n = __builtin_convertvector(__builtin_convertvector(fx, ints), lanes);
    n += __builtin_convertvector(n > fx, lanes); /* truncation -> floor: a true comparison is -1 */
    const lanes r = x - n * 0.693359375f + n * 2.12194440e-4f;
    lanes p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ints e = (__builtin_convertvector(n, ints) + 127) << 23;
    lanes scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

#define MAX_G 8
#define MAX_P 256

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI_KEYS 1
#define LEVELS 3 /* int8 levels of a query row: three carry its fp32 precision (the residual is below 1e-7 of its
                    largest channel) */

static int32_t swap_index[4][2][16]; /* transpose16's lane choices, one pair per block size 8, 4, 2, 1 */

__attribute__((constructor)) static void build_swap_index(void) {
    for (int s = 0, h = 8; h >= 1; ++s, h /= 2)
        for (int l = 0; l < 16; ++l) {
            swap_index[s][0][l] = l & h ? 16 + l - h : l;
            swap_index[s][1][l] = l & h ? 16 + l : l + h;
        }
}

/* 16 rows of 16 int32 -> their transpose, in place: rows i and i + h trade the lanes of bit h, for h = 8, 4, 2, 1
   (each stage exchanges bit h of the row with bit h of the lane; all four exchange the row with the lane). */
INLINE void transpose16(__m512i *r) {
    for (int s = 0, h = 8; h >= 1; ++s, h /= 2) {
        const __m512i lo = _mm512_loadu_si512(swap_index[s][0]), hi = _mm512_loadu_si512(swap_index[s][1]);
        for (int i = 0; i < 16; ++i)
            if (!(i & h)) {
                const __m512i a = r[i], b = r[i + h];
                r[i] = _mm512_permutex2var_epi32(a, lo, b);
                r[i + h] = _mm512_permutex2var_epi32(a, hi, b);
            }
    }
}

/* q [D] as LEVELS rows of int8 codes ql [LEVELS, D] and their scales: q = sum over l of sig[l] * ql[l] (each level
   codes what the ones before left, within half its step). */
INLINE void query_levels(const float *restrict q, int D, int8_t *restrict ql, float *restrict sig) {
    float rest[MAX_D];
    memcpy(rest, q, D * sizeof(float));
    for (int l = 0; l < LEVELS; ++l) {
        float top = 0.0f;
        for (int d = 0; d < D; ++d) top = __builtin_fabsf(rest[d]) > top ? __builtin_fabsf(rest[d]) : top;
        const float inv = top > 0.0f ? 127.0f / top : 0.0f;
        sig[l] = top / 127.0f;
        for (int d = 0; d < D; ++d) {
            const float c = __builtin_nearbyintf(rest[d] * inv);
            ql[l * D + d] = (int8_t)c;
            rest[d] -= c * sig[l];
        }
    }
}

/* The scores of nr (<= 16) integer key rows from row0 (kind 8, 4 or 2: ``bits``, W bytes a row) for every query
   row g, as ``score`` computes them one row at a time: VNNI's u8 x s8 product sums 4 channels in each of 16 lanes,
   so the 16 rows' codes are transposed (a vector then holds 4 channels of every row) and each query level is
   broadcast 4 channels at a time; no sum across lanes. Writes w[g * Pv + r0 + i] for i < nr. */
INLINE void score_tile(const uint8_t *restrict kc, const void *restrict km, int64_t row0, int nr, int W,
                       const int bits, const int D, const int groups, const int8_t *restrict ql,
                       const float *restrict sig, const float *restrict qsum, const float *restrict bias, int G,
                       float *restrict w, int Pv, int r0) {
    const int E = W / 4, planes = 8 / bits, n = D / groups;
    const __m512i mask = _mm512_set1_epi8((char)((1 << bits) - 1));
    const half *m = (const half *)km;
    float scale[MAX_D / 16][16], low[MAX_D / 16][16], dots[MAX_G][MAX_D / 16][16];
    for (int g = 0; g < G; ++g)
        for (int k = 0; k < groups; ++k) memset(dots[g][k], 0, sizeof dots[g][k]);
    grid16(m + row0 * 2 * groups, nr, groups, scale, low);
    for (int e0 = 0; e0 < E; e0 += 16) {
        const int ne = E - e0 < 16 ? E - e0 : 16;
        __m512i t[16];
        for (int i = 0; i < 16; ++i)
            t[i] = i < nr ? _mm512_maskz_loadu_epi32((__mmask16)((1u << ne) - 1), kc + (row0 + i) * W + 4 * e0)
                          : _mm512_setzero_si512();
        transpose16(t);
        __m512i u[8 / 2 * 16]; /* plane p's codes of element e: u[p * ne + e], one byte a channel */
        for (int p = 0; p < planes; ++p)
            for (int e = 0; e < ne; ++e)
                u[p * ne + e] = bits == 8 ? t[e] : _mm512_and_si512(_mm512_srli_epi32(t[e], p * bits), mask);
        for (int g = 0; g < G; ++g)
            for (int p = 0; p < planes; ++p) {
                __m512i acc[LEVELS];
                int k = (p * W + 4 * e0) / n;
                for (int l = 0; l < LEVELS; ++l) acc[l] = _mm512_setzero_si512();
                for (int e = 0; e <= ne; ++e) {
                    const int c = p * W + 4 * (e0 + e);
                    if (e == ne || c >= (k + 1) * n) { /* a group's products done: into fp32 with the levels' scales */
                        lanes sum = load(dots[g][k]);
                        for (int l = 0; l < LEVELS; ++l) {
                            const __m512 f = _mm512_cvtepi32_ps(acc[l]);
                            lanes fl;
                            memcpy(&fl, &f, sizeof fl);
                            sum += sig[g * LEVELS + l] * fl;
                            acc[l] = _mm512_setzero_si512();
                        }
                        memcpy(dots[g][k], &sum, sizeof sum);
                        if (e == ne) break;
                        k = c / n;
                    }
                    for (int l = 0; l < LEVELS; ++l) {
                        int32_t four;
                        memcpy(&four, ql + (g * LEVELS + l) * D + c, sizeof four);
                        acc[l] = _mm512_dpbusd_epi32(acc[l], u[p * ne + e], _mm512_set1_epi32(four));
                    }
                }
            }
    }
    for (int g = 0; g < G; ++g) {
        lanes s = {0};
        for (int k = 0; k < groups; ++k) s += load(scale[k]) * load(dots[g][k]) + load(low[k]) * qsum[g * groups + k];
        for (int i = 0; i < nr; ++i) w[g * Pv + r0 + i] = s[i] + (bias ? bias[row0 + i] : 0.0f);
    }
}
#endif

/* A key row's score for query row g (x: the row unpacked; fp32 rows: the row itself). */
INLINE float score(const int kind, const float *restrict qg, const float *restrict sg, const float *restrict qs,
                   float qm, const float *restrict x, const void *restrict meta, int64_t row, int D, int groups) {
    if (kind == FP32) return dot(qg, x, D);
    if (kind == FP8) return 256.0f * ((const float *)meta)[row] * dot(qg, x, D);
    if (kind < 0) return dot(qs, x, D) + qm;
    const half *m = (const half *)meta + row * 2 * groups;
    const int n = D / groups;
    reg sum = {0}; /* each group's products scaled as vectors: one sum across lanes a row */
    float acc = 0.0f;
    for (int k = 0; k < groups; ++k) {
        reg v = {0};
        for (int d = k * n; d < (k + 1) * n; d += REG) v += load_reg(qg + d) * load_reg(x + d);
        sum += (float)m[2 * k] * v;
        acc += (float)m[2 * k + 1] * sg[k];
    }
    return acc + sum_reg(sum);
}

INLINE void attend_body(const float *restrict q, const float *restrict qsum, const uint8_t *restrict kc,
                        const void *restrict km, int kW, const int kgroups, const int kkind,
                        const uint8_t *restrict vc, const void *restrict vm, int vW, const int vgroups, const int vkind,
                        const float *restrict bias,
                        const int32_t *restrict table, const int32_t *restrict lengths, int BH, int G, const int D,
                        int P, int NP, int chunk, int threads, int C_all, int c_first, float *restrict m_out,
                        float *restrict l_out, float *restrict o_out) {
    const int C = (NP + chunk - 1) / chunk, Pv = (P + 15) / 16 * 16;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int bh = 0; bh < BH; ++bh)
        for (int c = 0; c < C; ++c) {
            float x[MAX_D], qs[MAX_G * MAX_D], qm[MAX_G], w[MAX_G * MAX_P], m[MAX_G], l[MAX_G] = {0};
            float o[MAX_G * MAX_D] = {0}, lows[MAX_G * MAX_D / 16] = {0}, vb[16 * MAX_D], we[MAX_G * MAX_D], held[MAX_P];
            const float *qh = q + (int64_t)bh * G * D, *sh = qsum + (int64_t)bh * G * kgroups;
            for (int g = 0; g < G; ++g) m[g] = -__builtin_inff();
#ifdef VNNI_KEYS
            const int vnni = kkind == 8 || kkind == 4 || kkind == 2;
            int8_t ql[MAX_G * LEVELS * MAX_D];
            float sig[MAX_G * LEVELS];
            if (vnni)
                for (int g = 0; g < G; ++g) query_levels(qh + g * D, D, ql + g * LEVELS * D, sig + g * LEVELS);
#else
            const int vnni = 0;
#endif
            for (int pg = c * chunk; pg < NP && pg < (c + 1) * chunk; ++pg) {
                const int rows = lengths[bh] - pg * P < P ? lengths[bh] - pg * P : P;
                if (rows <= 0) break;
                const int64_t page = table[(int64_t)bh * NP + pg];
                if (pg + 1 < NP && (pg + 1) * P < lengths[bh]) { /* the next page's rows, fetched while this one is
                    read: pages lie anywhere in the pool, where the hardware's prefetcher does not follow */
                    const int64_t next = table[(int64_t)bh * NP + pg + 1];
                    for (int64_t at = 0; at < (int64_t)P * kW; at += 64) __builtin_prefetch(kc + next * P * kW + at);
                    for (int64_t at = 0; at < (int64_t)P * vW; at += 64) __builtin_prefetch(vc + next * P * vW + at);
                }
                for (int r = 0; r < Pv; ++r) held[r] = r < rows ? 1.0f : 0.0f;
                for (int g = 0; g < G; ++g) /* rows past the length: finite after exp_lanes, then weighed 0 */
                    for (int r = rows; r < Pv; ++r) w[g * Pv + r] = -__builtin_inff();
                if (kkind < 0) { /* the page's channel grid folded into the query */
                    const half *grid = (const half *)km + page * 2 * D;
                    for (int g = 0; g < G; ++g) {
                        qm[g] = 0.0f;
                        for (int d = 0; d < D; ++d) {
                            qs[g * D + d] = qh[g * D + d] * (float)grid[2 * d];
                            qm[g] += qh[g * D + d] * (float)grid[2 * d + 1];
                        }
                    }
                }
#ifdef VNNI_KEYS
                if (vnni)
                    for (int r0 = 0; r0 < rows; r0 += 16)
                        score_tile(kc, km, page * P + r0, rows - r0 < 16 ? rows - r0 : 16, kW, kkind, D, kgroups, ql,
                                   sig, sh, bias, G, w, Pv, r0);
#endif
                for (int r = 0; r < rows * !vnni; ++r) { /* scores */
                    const int64_t row = page * P + r;
                    const float *xr = kkind == FP32 ? (const float *)(kc + row * kW) : x;
                    if (kkind != FP32) unpack_row(kc + row * kW, D, kkind, x);
                    const float b = bias ? bias[row] : 0.0f;
                    for (int g = 0; g < G; ++g)
                        w[g * Pv + r] = score(kkind, qh + g * D, sh + g * kgroups, qs + g * D, qm[g], xr, km, row,
                                              D, kgroups) + b;
                }
                for (int g = 0; g < G; ++g) { /* the page's weights; the running state rescaled to a new maximum */
                    float top = m[g];
                    for (int r = 0; r < rows; ++r) top = w[g * Pv + r] > top ? w[g * Pv + r] : top;
                    if (top > m[g]) {
                        const float shrink = m[g] == -__builtin_inff() ? 0.0f : exp_lanes((lanes){0} + (m[g] - top))[0];
                        l[g] *= shrink;
                        for (int d = 0; d < D; ++d) o[g * D + d] *= shrink;
                        for (int k = 0; k < vgroups; ++k) lows[g * vgroups + k] *= shrink;
                        m[g] = top;
                    }
                    for (int r = 0; r < Pv; r += 16) {
                        lanes e = exp_lanes(load(w + g * Pv + r) - m[g]);
                        if (r + 16 > rows) e *= load(held + r); /* rows past the head's length weigh 0 */
                        memcpy(w + g * Pv + r, &e, sizeof e);
                        l[g] += sum_lanes(e);
                    }
                }
                for (int r0 = 0; r0 < rows; r0 += 16) { /* weighted values, 16 rows at a time: o stays in registers */
                    const int nr = rows - r0 < 16 ? rows - r0 : 16;
                    const float *xs[16];
                    const int n = D / vgroups;
                    float sc[MAX_D / 16][16], lo[MAX_D / 16][16]; /* each group's scale and minimum, by row */
                    const int integer = vkind != FP32 && vkind != FP8;
                    if (integer) grid16((const half *)vm + (page * P + r0) * 2 * vgroups, nr, vgroups, sc, lo);
                    for (int i = 0; i < 16; ++i) {
                        const int64_t row = page * P + r0 + i;
                        if (i < nr) {
                            xs[i] = vkind == FP32 ? (const float *)(vc + row * vW) : vb + i * D;
                            if (vkind != FP32) unpack_row(vc + row * vW, D, vkind, vb + i * D);
                        }
                        if (!integer) { /* fp32 and fp8 rows: one scale a row (fp8's times 256, as e4m3_row leaves
                                           the codes), no minimum; rows past nr weigh 0 */
                            sc[0][i] = i >= nr ? 0.0f : vkind == FP8 ? 256.0f * ((const float *)vm)[row] : 1.0f;
                            lo[0][i] = 0.0f;
                        }
                    }
                    for (int g = 0; g < G; ++g) { /* the weights on the codes, 16 rows at once; p * m summed apart */
                        const lanes p = load(w + g * Pv + r0);
                        for (int k = 0; k < vgroups; ++k) {
                            const lanes e = p * load(sc[k]);
                            memcpy(we + (g * vgroups + k) * 16, &e, sizeof e);
                            if (vkind != FP32 && vkind != FP8) lows[g * vgroups + k] += sum_lanes(p * load(lo[k]));
                        }
                    }
                    for (int g = 0; g < G; ++g)
                        for (int d = 0; d < D; d += REG) {
                            const float *wg = we + (g * vgroups + d / n) * 16;
                            reg acc = load_reg(o + g * D + d);
                            for (int i = 0; i < nr; ++i) acc += wg[i] * load_reg(xs[i] + d);
                            memcpy(o + g * D + d, &acc, sizeof acc);
                        }
                }
            }
            const int64_t at = ((int64_t)bh * C_all + c_first + c) * G; /* this pool's chunks among all */
            for (int g = 0; g < G; ++g) {
                m_out[at + g] = m[g];
                l_out[at + g] = l[g];
                for (int d = 0; d < D; ++d) o_out[(at + g) * D + d] = o[g * D + d] + lows[g * vgroups + d / (D / vgroups)];
            }
        }
}

/* The chunks' states merged per (KV head, query row): out [BH, G, D] normalized and lse [BH, G] (an empty head: 0 and
   -inf). */
static void merge_chunks(const float *m, const float *l, const float *o, int BH, int G, int D, int C, int threads,
                         float *out, float *lse) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int i = 0; i < BH * G; ++i) {
        const int bh = i / G, g = i % G;
        float top = -__builtin_inff(), total = 0.0f;
        for (int c = 0; c < C; ++c) top = m[(bh * C + c) * G + g] > top ? m[(bh * C + c) * G + g] : top;
        float *y = out + (int64_t)i * D;
        for (int d = 0; d < D; ++d) y[d] = 0.0f;
        if (top == -__builtin_inff()) {
            lse[i] = top;
            continue;
        }
        for (int c = 0; c < C; ++c) {
            const int64_t at = (int64_t)(bh * C + c) * G + g;
            if (m[at] == -__builtin_inff()) continue;
            const float a = exp_lanes((lanes){0} + (m[at] - top))[0];
            total += a * l[at];
            for (int d = 0; d < D; ++d) y[d] += a * o[at * D + d];
        }
        for (int d = 0; d < D; ++d) y[d] /= total;
        lse[i] = top + __builtin_logf(total);
    }
}

/* Softmax attention of one decode query row per (KV head, query row g) over the pool rows the page table [BH, NP]
   lists, up to each head's length: out [BH, G, D] and its log-sum-exp lse [BH, G]. q [BH, G, D] is scaled already;
   qsum [BH, G, key groups]: each key group's sum of q (integer keys); bias [N * P] (or NULL): added to each row's
   score. Each of this pool's C chunks of ``chunk`` pages keeps its own running state in scratch ([BH, C_all, G]
   twice, then [BH, C_all, G, D]) at chunks c_first .. c_first + C - 1 of C_all, so several pools (a head's rows in a
   format pool and in model-dtype pages) fill one scratch; ``merge``: merge all C_all chunks into out and lse. */
void pool_attend(const float *q, const float *qsum, const uint8_t *kc, const void *km, int kW, int kgroups,
                 int kkind, const uint8_t *vc, const void *vm, int vW, int vgroups, int vkind, const float *bias,
                 const int32_t *table, const int32_t *lengths, int BH, int G, int D, int P, int NP, int chunk,
                 int threads, int C_all, int c_first, int merge, float *scratch, float *out, float *lse) {
    float *m_out = scratch, *l_out = scratch + (int64_t)BH * C_all * G, *o_out = scratch + 2 * (int64_t)BH * C_all * G;
#define ATTEND_D(k, v, d, kg, vg) attend_body(q, qsum, kc, km, kW, kg, k, vc, vm, vW, vg, v, bias, table, lengths, \
                                              BH, G, d, P, NP, chunk, threads, C_all, c_first, m_out, l_out, o_out)
    /* common head dims as constants with the groups the shipped formats have (8 bits: 64 channels, fewer: 32), so
       the products over a row unroll; other dims and groups as they come */
#define GROUPS(k, d) ((k) == 8 ? (d) / 64 : (k) >= 2 && (k) <= 4 ? (d) / 32 : 1)
#define SHIPPED(k, d, g) ((k) < 2 || (k) > 8 || (g) == GROUPS(k, d))
#define ATTEND(k, v) (D == 64 && SHIPPED(k, 64, kgroups) && SHIPPED(v, 64, vgroups)                                     \
                          ? ATTEND_D(k, v, 64, GROUPS(k, 64), GROUPS(v, 64))                                              \
                      : D == 128 && SHIPPED(k, 128, kgroups) && SHIPPED(v, 128, vgroups)                                  \
                          ? ATTEND_D(k, v, 128, GROUPS(k, 128), GROUPS(v, 128))                                           \
                          : ATTEND_D(k, v, D, kgroups, vgroups))
    /* one copy per pair of kinds a format has, so the unpacking is compiled for constants */
    if (kkind == FP32 && vkind == FP32) ATTEND(FP32, FP32);
    else if (kkind == 8 && vkind == 8) ATTEND(8, 8);
    else if (kkind == 4 && vkind == 4) ATTEND(4, 4);
    else if (kkind == 3 && vkind == 3) ATTEND(3, 3);
    else if (kkind == 2 && vkind == 2) ATTEND(2, 2);
    else if (kkind == FP8 && vkind == FP8) ATTEND(FP8, FP8);
    else if (kkind == -4 && vkind == 4) ATTEND(-4, 4);
    else if (kkind == -2 && vkind == 2) ATTEND(-2, 2);
#undef ATTEND
#undef ATTEND_D
#undef GROUPS
#undef SHIPPED
    if (merge) merge_chunks(m_out, l_out, o_out, BH, G, D, C_all, threads, out, lse);
}

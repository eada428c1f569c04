/* Group-wise INT4 matmul for x86-64 CPUs with AVX2, FMA and F16C, called through ctypes by
 * tandem/kernels/int4_native.py (its docstring states the contract; this file the layouts).
 *
 * Weight layout ("row-chunked"): packed[N, K/2] uint8. Row n, values k..k+31 (k a multiple of 32)
 * occupy 16 bytes; byte i holds q[k+i] in its low nibble and q[k+16+i] in its high nibble, so one
 * 16-byte load widens into the 16-bit lanes of values k..k+15 and k+16..k+31.
 *
 * Group parameters of row n, group g (w = (q - 8) * scale + zero):
 *   mode 0: params float16 [N, G, 2] = (scale, zero) (GGUF Q4_1 keeps d and m in float16 too)
 *   mode 1: codes int8 [N, G, 2] and superblock_scales bf16 [N, G / groups_per_superblock, 2];
 *           scale = code_s * superblock_scale_s and zero = code_z * superblock_scale_z, computed
 *           in float32 (exact: 8-bit times 8-bit significands), as Int8GroupParams.expand().
 *   mode 3 (GGUF's Q4_0 / Q4_1 / Q4_K as stored, group size 32): codes int8 [N, G, 2] and
 *           block scales float16 [N, G / groups_per_superblock, 2] = (D, M); here
 *           w = q * scale - offset with scale = code_s * D and offset = code_o * M (exact float32
 *           products), as BlockParams.expand(); dequantised, q * scale - offset rounds once, as
 *           the gguf package's dequantize does. The matmul is vnni_cpu.c's arithmetic, with
 *           AVX512-VNNI (on the tile unit where AMX runs) or AVX2 (blocks_avx2.c): the same bits
 *           on every CPU.
 *   mode 4 (builds with AVX512-VNNI only: tandem_block_tiles() says so): mode 3's bytes in tile
 *           order, N % 16 == 0. Each block of 16 rows keeps its bytes where mode 3 has them (packed
 *           from 16 b * K / 2, codes from 16 b * G * 2 bytes, block scales from 16 b * S * 2
 *           halves), ordered for 64-byte loads: packed [run r][dword j][row i] (row i's bytes
 *           4j..4j+3 of run r), codes [group g][row i][2], block scales [super-block][row i][2].
 *
 * Arithmetic: each run of 32 activations is scaled to int16 (scale = max|x| / 32767, round to
 * nearest: relative error under 2^-16 of the run's largest value, finer than bfloat16), the
 * 4-bit codes are multiplied by it exactly in int32 (vpmaddwd), and each run's integer dot
 * product is scaled back in float32. The zero term uses float32 sums of x.
 *
 * Threads: OpenMP over rows, as many as torch uses. Built with -fopenmp, the library needs
 * libgomp.so.1; torch's CPU build has already loaded a libgomp with that soname, so both share one
 * OpenMP runtime and thread pool.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Row n's (scale, zero - 8 * scale) per group into out[2 * G] (for tandem_int4_dequantize; the
 * matmul's row kernels read the parameters inline). */
static inline void row_params(int mode, const void *params, const uint16_t *superblock_scales,
                              int64_t groups_per_superblock, int64_t n, int64_t num_groups,
                              float *out) {
    if (mode == 0) {
        const uint16_t *p = (const uint16_t *)params + n * num_groups * 2;
        for (int64_t g = 0; g < num_groups; g++) {
            float scale = _cvtsh_ss(p[2 * g]), zero = _cvtsh_ss(p[2 * g + 1]);
            out[2 * g] = scale;
            out[2 * g + 1] = zero - 8.0f * scale;
        }
        return;
    }
    if (mode == 3) {
        const int8_t *c = (const int8_t *)params + n * num_groups * 2;
        const uint16_t *s = superblock_scales + n * (num_groups / groups_per_superblock) * 2;
        const __m256 negate_odd = _mm256_castsi256_ps(
            _mm256_set_epi32((int)0x80000000, 0, (int)0x80000000, 0, (int)0x80000000, 0, (int)0x80000000, 0));
        int64_t g = 0;
        if (groups_per_superblock == 1 || groups_per_superblock % 4 == 0) {
            /* 4 groups a step: int8 codes (s, o) times float16 (D, M), odd lanes negated */
            for (; g + 4 <= num_groups; g += 4) {
                __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 2 * g))));
                __m256 blocks;
                if (groups_per_superblock == 1) {
                    blocks = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 2 * g)));
                } else {
                    const uint16_t *b = s + 2 * (g / groups_per_superblock);
                    const float d = _cvtsh_ss(b[0]), m = _cvtsh_ss(b[1]);
                    blocks = _mm256_setr_ps(d, m, d, m, d, m, d, m);
                }
                _mm256_storeu_ps(out + 2 * g, _mm256_xor_ps(_mm256_mul_ps(codes, blocks), negate_odd));
            }
        }
        for (; g < num_groups; g++) {
            const uint16_t *block = s + 2 * (g / groups_per_superblock);
            out[2 * g] = (float)c[2 * g] * _cvtsh_ss(block[0]);
            out[2 * g + 1] = -((float)c[2 * g + 1] * _cvtsh_ss(block[1]));
        }
        return;
    }
    /* int8 -> float32, 8 codes per step; then times each super-block's scales. */
    const int8_t *c = (const int8_t *)params + n * num_groups * 2;
    int64_t i = 0;
    for (; i + 8 <= 2 * num_groups; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + i)))));
    for (; i < 2 * num_groups; i++) out[i] = (float)c[i];
    const uint16_t *s = superblock_scales + n * (num_groups / groups_per_superblock) * 2;
    for (int64_t g = 0; g < num_groups; g += groups_per_superblock, s += 2) {
        const float block_scale = bf16_to_float(s[0]), block_zero = bf16_to_float(s[1]);
        for (int64_t j = g; j < g + groups_per_superblock; j++) {
            const float scale = out[2 * j] * block_scale;
            out[2 * j] = scale;
            out[2 * j + 1] = out[2 * j + 1] * block_zero - 8.0f * scale;
        }
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[m * ldy] for m < MB, weight row n: xq [MB, K] int16, xscale [MB, K/32], xsum [MB, G].
 * The row's nibbles are widened once per run of 32 and feed all MB activation rows; each row has
 * two accumulators (alternate runs) to halve the FMA dependency chain. Group parameters are read
 * inline (MODE as in the file comment), so no per-row parameter array is built. */
#define ROW_KERNEL(MODE, MB, GS)                                                                       \
    static inline void row_kernel_##MODE##_##MB##_##GS(                                                   \
        const uint8_t *w, const void *params, const uint16_t *superblock_scales,                   \
        int64_t groups_per_superblock, int64_t n, const int16_t *xq, const float *xscale,          \
        const float *xsum, int64_t K, float *y, int64_t ldy) {                                     \
        const int64_t group_size = GS;                                                             \
        __m256 acc[MB][2];                                                                         \
        float bias[MB];                                                                            \
        for (int m = 0; m < MB; m++) {                                                             \
            acc[m][0] = acc[m][1] = _mm256_setzero_ps();                                           \
            bias[m] = 0.0f;                                                                        \
        }                                                                                          \
        const __m128i low_mask = _mm_set1_epi8(0x0F);                                              \
        const int64_t num_groups = K / group_size, runs = K / 32, runs_per_group = group_size / 32; \
        const uint16_t *p16 = (const uint16_t *)params + n * num_groups * 2;                       \
        const int8_t *p8 = (const int8_t *)params + n * num_groups * 2;                            \
        const uint16_t *block = MODE ? superblock_scales + n * (num_groups / groups_per_superblock) * 2 : 0; \
        float block_scale = 0.0f, block_zero = 0.0f;                                               \
        for (int64_t g = 0, r = 0, left_in_block = 0; g < num_groups; g++) {                       \
            float scale, zero;                                                                     \
            if (MODE == 0) {                                                                       \
                scale = _cvtsh_ss(p16[2 * g]);                                                     \
                zero = _cvtsh_ss(p16[2 * g + 1]);                                                  \
            } else {                                                                               \
                if (left_in_block == 0) {                                                          \
                    block_scale = bf16_to_float(block[0]);                                         \
                    block_zero = bf16_to_float(block[1]);                                          \
                    block += 2;                                                                    \
                    left_in_block = groups_per_superblock;                                         \
                }                                                                                  \
                left_in_block--;                                                                   \
                scale = (float)p8[2 * g] * block_scale;                                            \
                zero = (float)p8[2 * g + 1] * block_zero;                                          \
            }                                                                                      \
            const float offset = zero - 8.0f * scale;                                              \
            for (int m = 0; m < MB; m++) bias[m] += offset * xsum[m * num_groups + g];             \
            for (int64_t end = r + runs_per_group; r < end; r++) {                                 \
                __m128i bytes = _mm_loadu_si128((const __m128i *)(w + 16 * r));                    \
                __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low_mask));                 \
                __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask)); \
                for (int m = 0; m < MB; m++) {                                                     \
                    const int16_t *xr = xq + m * K + 32 * r;                                       \
                    __m256i dot = _mm256_add_epi32(                                                \
                        _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xr)),            \
                        _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 16))));    \
                    __m256 s = _mm256_set1_ps(scale * xscale[m * runs + r]);                       \
                    __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[m][0]);           \
                    acc[m][0] = acc[m][1]; /* alternate: a register rename, not a move */          \
                    acc[m][1] = sum;                                                               \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int m = 0; m < MB; m++) y[m * ldy] = hsum(_mm256_add_ps(acc[m][0], acc[m][1])) + bias[m]; \
    }

ROW_KERNEL(0, 1, 32)
ROW_KERNEL(0, 2, 32)
ROW_KERNEL(0, 3, 32)
ROW_KERNEL(0, 4, 32)
ROW_KERNEL(0, 1, 64)
ROW_KERNEL(0, 2, 64)
ROW_KERNEL(0, 3, 64)
ROW_KERNEL(0, 4, 64)
ROW_KERNEL(0, 1, 128)
ROW_KERNEL(0, 2, 128)
ROW_KERNEL(0, 3, 128)
ROW_KERNEL(0, 4, 128)
ROW_KERNEL(0, 1, 256)
ROW_KERNEL(0, 2, 256)
ROW_KERNEL(0, 3, 256)
ROW_KERNEL(0, 4, 256)
ROW_KERNEL(1, 1, 32)
ROW_KERNEL(1, 2, 32)
ROW_KERNEL(1, 3, 32)
ROW_KERNEL(1, 4, 32)
ROW_KERNEL(1, 1, 64)
ROW_KERNEL(1, 2, 64)
ROW_KERNEL(1, 3, 64)
ROW_KERNEL(1, 4, 64)
ROW_KERNEL(1, 1, 128)
ROW_KERNEL(1, 2, 128)
ROW_KERNEL(1, 3, 128)
ROW_KERNEL(1, 4, 128)
ROW_KERNEL(1, 1, 256)
ROW_KERNEL(1, 2, 256)
ROW_KERNEL(1, 3, 256)
ROW_KERNEL(1, 4, 256)

/* -- mode 0 (float16 parameters): the nibble-plane kernel -------------------------------------
 * A run's 16 bytes read as 8 little-endian 16-bit words: word j holds q[2j] in bits 0-3, q[16+2j]
 * in bits 4-7, q[2j+1] in bits 8-11 and q[17+2j] in bits 12-15. Masks and shifts (no byte
 * shuffles) give four "planes" of 16-bit lanes, and the activations are laid out to match: in a
 * block of b consecutive runs (b = 4 with AVX-512, else 2, and 1 for a last odd run) plane P's
 * lane 8i + j holds x[run i][2j], x[2j+1], x[16+2j], x[17+2j] for P = 0, 1, 2, 3, the planes one
 * after another (8b lanes each). vpmaddwd of plane and activations gives int32 lanes of which
 * lanes 4i..4i+3 belong to run i, scaled in float32 by that run's scale * activation step. The
 * products and sums are the same exact integers as the row kernels above; only the float32
 * accumulation order differs. */
#if defined(__AVX512BW__) && defined(__AVX512F__)
#define TANDEM_BLOCK_RUNS 4
#else
#define TANDEM_BLOCK_RUNS 2
#endif

static inline int64_t block_runs(int64_t r, int64_t runs) {
    if (TANDEM_BLOCK_RUNS == 4 && r + 4 <= runs) return 4;
    return r + 2 <= runs ? 2 : 1;
}

/* xq [K] int16 in run order -> out [K] in the plane layout above. */
static void pack_planes(const int16_t *xq, int64_t K, int16_t *out) {
    const int64_t runs = K / 32;
    for (int64_t r = 0; r < runs;) {
        const int64_t b = block_runs(r, runs);
        int16_t *o = out + 32 * r;
        for (int64_t i = 0; i < b; i++) {
            const int16_t *x = xq + 32 * (r + i);
            for (int j = 0; j < 8; j++) {
                o[8 * i + j] = x[2 * j];
                o[8 * b + 8 * i + j] = x[2 * j + 1];
                o[16 * b + 8 * i + j] = x[16 + 2 * j];
                o[24 * b + 8 * i + j] = x[17 + 2 * j];
            }
        }
        r += b;
    }
}

/* The scales of row n's groups (the even float16s of its (scale, zero) pairs) as float32. */
static inline void group_scales(const uint16_t *pairs, int64_t G, float *out) {
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pairs + 2 * g)));
        __m256 v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pairs + 2 * g + 8)));
        __m256 even = _mm256_shuffle_ps(v0, v1, 0x88); /* s0 s1 s4 s5 | s2 s3 s6 s7 */
        _mm256_storeu_ps(out + g, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)));
    }
    for (; g < G; g++) out[g] = _cvtsh_ss(pairs[2 * g]);
}

static inline __m256i planes_dot256(__m256i w, const int16_t *x) {
    const __m256i low = _mm256_set1_epi16(0x000F);
    __m256i p0 = _mm256_and_si256(w, low), p2 = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
    __m256i p1 = _mm256_and_si256(_mm256_srli_epi16(w, 8), low), p3 = _mm256_srli_epi16(w, 12);
    __m256i s01 = _mm256_add_epi32(_mm256_madd_epi16(p0, _mm256_loadu_si256((const __m256i *)x)),
                                   _mm256_madd_epi16(p1, _mm256_loadu_si256((const __m256i *)(x + 16))));
    __m256i s23 = _mm256_add_epi32(_mm256_madd_epi16(p2, _mm256_loadu_si256((const __m256i *)(x + 32))),
                                   _mm256_madd_epi16(p3, _mm256_loadu_si256((const __m256i *)(x + 48))));
    return _mm256_add_epi32(s01, s23);
}

static inline __m128i planes_dot128(__m128i w, const int16_t *x) {
    const __m128i low = _mm_set1_epi16(0x000F);
    __m128i p0 = _mm_and_si128(w, low), p2 = _mm_and_si128(_mm_srli_epi16(w, 4), low);
    __m128i p1 = _mm_and_si128(_mm_srli_epi16(w, 8), low), p3 = _mm_srli_epi16(w, 12);
    __m128i s01 = _mm_add_epi32(_mm_madd_epi16(p0, _mm_loadu_si128((const __m128i *)x)),
                                _mm_madd_epi16(p1, _mm_loadu_si128((const __m128i *)(x + 8))));
    __m128i s23 = _mm_add_epi32(_mm_madd_epi16(p2, _mm_loadu_si128((const __m128i *)(x + 16))),
                                _mm_madd_epi16(p3, _mm_loadu_si128((const __m128i *)(x + 24))));
    return _mm_add_epi32(s01, s23);
}

#if TANDEM_BLOCK_RUNS == 4
static inline __m512i planes_dot512(__m512i w, const int16_t *x) {
    const __m512i low = _mm512_set1_epi16(0x000F);
    __m512i p0 = _mm512_and_si512(w, low), p2 = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
    __m512i p1 = _mm512_and_si512(_mm512_srli_epi16(w, 8), low), p3 = _mm512_srli_epi16(w, 12);
#if defined(__AVX512VNNI__)
    __m512i s = _mm512_madd_epi16(p0, _mm512_loadu_si512(x));
    s = _mm512_dpwssd_epi32(s, p1, _mm512_loadu_si512(x + 32));
    s = _mm512_dpwssd_epi32(s, p2, _mm512_loadu_si512(x + 64));
    return _mm512_dpwssd_epi32(s, p3, _mm512_loadu_si512(x + 96));
#else
    __m512i s01 = _mm512_add_epi32(_mm512_madd_epi16(p0, _mm512_loadu_si512(x)),
                                   _mm512_madd_epi16(p1, _mm512_loadu_si512(x + 32)));
    __m512i s23 = _mm512_add_epi32(_mm512_madd_epi16(p2, _mm512_loadu_si512(x + 64)),
                                   _mm512_madd_epi16(p3, _mm512_loadu_si512(x + 96)));
    return _mm512_add_epi32(s01, s23);
#endif
}
#endif

/* y[m * ldy] for m < MB, weight row n (mode 0): xp [MB, K] plane layout, xscale [MB, runs],
 * xpair [MB, 2G] = (-8 xsum_g, xsum_g), so that the bias sum_g (zero_g - 8 scale_g) xsum_g is
 * one dot product with the row's (scale, zero) pairs. */
#define LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define AT(p, j) _cvtsh_ss((p)[j])
#define PLANE_KERNEL(MB)                                                                               \
    static inline void plane_kernel_##MB(const uint8_t *w, const uint16_t *pairs, const int16_t *xp,     \
                                         const float *xscale, const float *xpair, int64_t K,        \
                                         int64_t group_size, float *y, int64_t ldy) {               \
        const int64_t runs = K / 32, G = K / group_size, runs_per_group = group_size / 32;        \
        float scales[G], run_scales[MB][runs];                                                     \
        group_scales(pairs, G, scales);                                                            \
        for (int m = 0; m < MB; m++) {                                                             \
            if (runs_per_group == 1) {                                                             \
                int64_t r = 0;                                                                     \
                for (; r + 8 <= runs; r += 8)                                                      \
                    _mm256_storeu_ps(&run_scales[m][r], _mm256_mul_ps(_mm256_loadu_ps(scales + r), \
                                                                      _mm256_loadu_ps(xscale + m * runs + r))); \
                for (; r < runs; r++) run_scales[m][r] = scales[r] * xscale[m * runs + r];         \
            } else {                                                                               \
                for (int64_t g = 0, r = 0; g < G; g++)                                             \
                    for (int64_t k = 0; k < runs_per_group; k++, r++)                              \
                        run_scales[m][r] = scales[g] * xscale[m * runs + r];                       \
            }                                                                                      \
        }                                                                                          \
        __m256 acc256[MB], bias[MB];                                                               \
        __m128 acc128[MB];                                                                         \
        for (int m = 0; m < MB; m++) {                                                             \
            acc256[m] = bias[m] = _mm256_setzero_ps();                                             \
            acc128[m] = _mm_setzero_ps();                                                          \
        }                                                                                          \
        int64_t i = 0;                                                                             \
        for (; i + 8 <= 2 * G; i += 8) {                                                           \
            __m256 sz = LOAD8(pairs + i);                                                          \
            for (int m = 0; m < MB; m++)                                                           \
                bias[m] = _mm256_fmadd_ps(sz, _mm256_loadu_ps(xpair + m * 2 * G + i), bias[m]);     \
        }                                                                                          \
        float tail[MB];                                                                            \
        for (int m = 0; m < MB; m++) {                                                             \
            tail[m] = 0.0f;                                                                        \
            /* fmaf: one rounding whatever the instantiation (a `+= *` may or may not be       \
             * contracted, differently per MB: a row's bits would depend on the call's size) */  \
            for (int64_t j = i; j < 2 * G; j++) tail[m] = fmaf(AT(pairs, j), xpair[m * 2 * G + j], tail[m]); \
        }                                                                                          \
        PLANE_KERNEL_WIDE(MB)                                                                      \
        int64_t r = 0;                                                                             \
        while (r < runs) {                                                                         \
            const int64_t b = block_runs(r, runs);                                                 \
            if (b == 4) {                                                                          \
                PLANE_BLOCK4(MB)                                                                   \
            } else if (b == 2) {                                                                   \
                __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 16 * r));                    \
                for (int m = 0; m < MB; m++) {                                                     \
                    __m256 sc = _mm256_set_m128(_mm_set1_ps(run_scales[m][r + 1]), _mm_set1_ps(run_scales[m][r])); \
                    __m256i dot = planes_dot256(wv, xp + m * K + 32 * r);                          \
                    acc256[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc256[m]);           \
                }                                                                                  \
            } else {                                                                               \
                __m128i wv = _mm_loadu_si128((const __m128i *)(w + 16 * r));                       \
                for (int m = 0; m < MB; m++) {                                                     \
                    __m128i dot = planes_dot128(wv, xp + m * K + 32 * r);                          \
                    acc128[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(dot), _mm_set1_ps(run_scales[m][r]), acc128[m]); \
                }                                                                                  \
            }                                                                                      \
            r += b;                                                                                \
        }                                                                                          \
        for (int m = 0; m < MB; m++) {                                                             \
            __m256 total = _mm256_add_ps(acc256[m], bias[m]);                                      \
            PLANE_KERNEL_FOLD(m)                                                                   \
            __m128 t = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1)), acc128[m]); \
            t = _mm_add_ps(t, _mm_movehl_ps(t, t));                                                \
            t = _mm_add_ss(t, _mm_movehdup_ps(t));                                                 \
            y[m * ldy] = _mm_cvtss_f32(t) + tail[m];                                               \
        }                                                                                          \
    }

#if TANDEM_BLOCK_RUNS == 4
#define PLANE_KERNEL_WIDE(MB)                                                                      \
    __m512 acc512[MB];                                                                             \
    for (int m = 0; m < MB; m++) acc512[m] = _mm512_setzero_ps();                                  \
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
#define PLANE_BLOCK4(MB)                                                                           \
    __m512i wv = _mm512_loadu_si512(w + 16 * r);                                                   \
    for (int m = 0; m < MB; m++) {                                                                 \
        __m512 sc = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(&run_scales[m][r]))); \
        __m512i dot = planes_dot512(wv, xp + m * K + 32 * r);                                      \
        acc512[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc512[m]);                       \
    }
#define PLANE_KERNEL_FOLD(m)                                                                       \
    total = _mm256_add_ps(total, _mm256_add_ps(_mm512_castps512_ps256(acc512[m]),                  \
                                               _mm512_extractf32x8_ps(acc512[m], 1)));
#else
#define PLANE_KERNEL_WIDE(MB)
#define PLANE_BLOCK4(MB)
#define PLANE_KERNEL_FOLD(m)
#endif

PLANE_KERNEL(1)
PLANE_KERNEL(2)
PLANE_KERNEL(3)
PLANE_KERNEL(4)

/* Activations as the kernels read them: each run of 32 of x [M, K] scaled to int16 (its largest
 * |x| to 32767, rounded to nearest, ties to even) into xq [M, K], the run's step (largest / 32767)
 * into xscale [M, K / 32] and, when xsum is not NULL, the float32 sums of x per group of
 * group_size (each run's values added in order, runs in order) into xsum [M, K / group_size].
 * Rows are independent: threads split them. */
static void round_activations(const float *x, int64_t M, int64_t K, int64_t group_size, int16_t *xq,
                              float *xscale, float *xsum, int num_threads) {
    const int64_t runs = K / 32, num_groups = K / group_size;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 16384)
    for (int64_t m = 0; m < M; m++) {
        if (xsum)
            for (int64_t g = 0; g < num_groups; g++) xsum[m * num_groups + g] = 0.0f;
        for (int64_t r = 0; r < runs; r++) {
            const float *xr = x + m * K + 32 * r;
            int16_t *out = xq + m * K + 32 * r;
#if defined(__AVX512F__)
            const __m512 sign = _mm512_set1_ps(-0.0f);
            const __m512 a = _mm512_loadu_ps(xr), b = _mm512_loadu_ps(xr + 16);
            /* NaNs left out of the largest, as fmaxf leaves them out; they round to 0 as lrintf's
             * integer does, cast to int16 */
            const __m512 abs_a = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), _mm512_andnot_ps(sign, a));
            const __m512 abs_b = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(b, b, _CMP_ORD_Q), _mm512_andnot_ps(sign, b));
            const float largest = _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));
            const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f);
            /* rounded as lrintf rounds (the current mode: to nearest, ties to even) */
            _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inverse))));
            _mm256_storeu_si256((__m256i *)(out + 16),
                                _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, inverse))));
#else
            float largest = 0.0f;
            for (int i = 0; i < 32; i++) largest = fmaxf(largest, fabsf(xr[i]));
            const float inverse = largest > 0.0f ? 32767.0f / largest : 0.0f;
            for (int i = 0; i < 32; i++) out[i] = (int16_t)lrintf(xr[i] * inverse);
#endif
            xscale[m * runs + r] = largest / 32767.0f;
            if (xsum) {
                float total = 0.0f;
                for (int i = 0; i < 32; i++) total += xr[i];
                xsum[m * num_groups + (32 * r) / group_size] += total;
            }
        }
    }
}

#include "vnni_cpu.c" /* and amx_cpu.c */

/* y[M, N] = x[M, K] @ dequantised(W)[N, K]^T, float32, contiguous. K % group_size == 0 and
 * group_size is 32, 64, 128 or 256. Returns 0; -1 when scratch memory cannot be allocated; -2 for
 * any other group size. */
int tandem_int4_mm(const float *x, const uint8_t *packed, int mode, const void *params,
                   const uint16_t *superblock_scales, int64_t groups_per_superblock, int64_t M,
                   int64_t N, int64_t K, int64_t group_size, float *y, int num_threads) {
    if (group_size != 32 && group_size != 64 && group_size != 128 && group_size != 256) return -2;
    if ((mode == 3 || mode == 4) && group_size != 32) return -2;
    if (mode == 4 && (!TANDEM_HAVE_VNNI_INT4 || N % 16 != 0)) return -3;
    const int64_t num_groups = K / group_size, runs = K / 32;
    int16_t *xq = malloc(sizeof(int16_t) * M * K);
    float *xscale = malloc(sizeof(float) * M * runs);
    float *xsum = malloc(sizeof(float) * M * num_groups);
    if (!xq || !xscale || !xsum) {
        free(xq); free(xscale); free(xsum);
        return -1;
    }
    round_activations(x, M, K, group_size, xq, xscale, xsum, num_threads);
    if (mode == 3 || mode == 4) {
        const int status = gguf_blocks_mm(mode == 4, xq, xscale, xsum, packed, params, superblock_scales,
                                          groups_per_superblock, M, N, K, y, num_threads);
        free(xq); free(xscale); free(xsum);
        return status;
    }
    if (mode == 0) {
        int16_t *xp = malloc(sizeof(int16_t) * M * K);
        float *xpair = malloc(sizeof(float) * M * 2 * num_groups);
        if (!xp || !xpair) {
            free(xq); free(xscale); free(xsum); free(xp); free(xpair);
            return -1;
        }
        for (int64_t m = 0; m < M; m++) {
            pack_planes(xq + m * K, K, xp + m * K);
            for (int64_t g = 0; g < num_groups; g++) {
                xpair[m * 2 * num_groups + 2 * g] = -8.0f * xsum[m * num_groups + g];
                xpair[m * 2 * num_groups + 2 * g + 1] = xsum[m * num_groups + g];
            }
        }
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *w = packed + n * (K / 2);
            const uint16_t *pairs = (const uint16_t *)params + n * 2 * num_groups;
            int64_t m = 0;
#define PCALL(MB)                                                                                  \
    plane_kernel_##MB(w, pairs, xp + m * K, xscale + m * runs, xpair + m * 2 * num_groups, K, group_size, \
                      y + m * N + n, N)
            for (; m + 4 <= M; m += 4) PCALL(4);
            switch (M - m) {
                case 3: PCALL(3); break;
                case 2: PCALL(2); break;
                case 1: PCALL(1); break;
                default: break;
            }
#undef PCALL
        }
        free(xq); free(xscale); free(xsum); free(xp); free(xpair);
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *w = packed + n * (K / 2);
        int64_t m = 0;
#define CALL(MB, GS)                                                                               \
    (mode ? row_kernel_1_##MB##_##GS : row_kernel_0_##MB##_##GS)(                                  \
        w, params, superblock_scales, groups_per_superblock, n, xq + m * K, xscale + m * runs,    \
        xsum + m * num_groups, K, y + m * N + n, N)
#define ROWS(GS)                                                                                   \
    for (; m + 4 <= M; m += 4) CALL(4, GS);                                                        \
    switch (M - m) {                                                                               \
        case 3: CALL(3, GS); break;                                                                \
        case 2: CALL(2, GS); break;                                                                \
        case 1: CALL(1, GS); break;                                                                \
        default: break;                                                                            \
    }
        switch (group_size) {
            case 32: ROWS(32); break;
            case 64: ROWS(64); break;
            case 128: ROWS(128); break;
            default: ROWS(256); break;
        }
#undef ROWS
#undef CALL
    }
    free(xq); free(xscale); free(xsum);
    return 0;
}

/* Whether this build reads mode 4 (the tile order): where it has AVX512-VNNI. */
int tandem_block_tiles(void) { return TANDEM_HAVE_VNNI_INT4; }

/* Row n of a mode-4 weight in mode 3's layout: its K / 2 bytes, G code pairs and S block-scale pairs
 * (the inverse of the tile order above, for one row). */
static void untile_row(const uint8_t *packed, const int8_t *codes, const uint16_t *block_scales, int64_t n,
                       int64_t K, int64_t G, int64_t S, uint8_t *row, int8_t *row_codes, uint16_t *row_scales) {
    const int64_t b = n / 16, i = n % 16;
    const uint8_t *block = packed + b * 16 * (K / 2);
    for (int64_t r = 0; r < K / 32; r++)
        for (int j = 0; j < 4; j++) memcpy(row + 16 * r + 4 * j, block + 256 * r + 64 * j + 4 * i, 4);
    for (int64_t g = 0; g < G; g++) memcpy(row_codes + 2 * g, codes + b * 16 * G * 2 + 32 * g + 2 * i, 2);
    for (int64_t s = 0; s < S; s++) memcpy(row_scales + 2 * s, block_scales + b * 16 * S * 2 + 32 * s + 2 * i, 4);
}

/* out[N, K] float32 = dequantised W (for large M: dequantise once, then a float32 GEMM). Mode 4 rows
 * are read back into mode 3's layout first: the same arithmetic, the same bits. */
void tandem_int4_dequantize(const uint8_t *packed, int mode, const void *params,
                            const uint16_t *superblock_scales, int64_t groups_per_superblock,
                            int64_t N, int64_t K, int64_t group_size, float *out, int num_threads) {
    const int64_t num_groups = K / group_size, num_superblocks = num_groups / groups_per_superblock;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        float p[2 * num_groups];
        const uint8_t *w = packed + n * (K / 2);
        uint8_t row[mode == 4 ? K / 2 : 1];
        int8_t row_codes[mode == 4 ? 2 * num_groups : 1];
        uint16_t row_scales[mode == 4 ? 2 * num_superblocks : 1];
        if (mode == 4) {
            untile_row(packed, (const int8_t *)params, superblock_scales, n, K, num_groups, num_superblocks, row,
                       row_codes, row_scales);
            row_params(3, row_codes, row_scales, groups_per_superblock, 0, num_groups, p);
            w = row;
        } else {
            row_params(mode, params, superblock_scales, groups_per_superblock, n, num_groups, p);
        }
        float *o = out + n * K;
        for (int64_t k = 0; k < K; k += 32) {
            float scale = p[2 * (k / group_size)], bias = p[2 * (k / group_size) + 1];
            for (int i = 0; i < 16; i++) {
                o[k + i] = (float)(w[k / 2 + i] & 0x0F) * scale + bias;
                o[k + 16 + i] = (float)(w[k / 2 + i] >> 4) * scale + bias;
            }
        }
    }
}

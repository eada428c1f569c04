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

/* y[M, N] = x[M, K] @ dequantised(W)[N, K]^T, float32, contiguous. K % group_size == 0 and
 * group_size is 32, 64, 128 or 256. Returns 0; -1 when scratch memory cannot be allocated; -2 for
 * any other group size. */
int tandem_int4_mm(const float *x, const uint8_t *packed, int mode, const void *params,
                   const uint16_t *superblock_scales, int64_t groups_per_superblock, int64_t M,
                   int64_t N, int64_t K, int64_t group_size, float *y, int num_threads) {
    if (group_size != 32 && group_size != 64 && group_size != 128 && group_size != 256) return -2;
    const int64_t num_groups = K / group_size, runs = K / 32;
    int16_t *xq = malloc(sizeof(int16_t) * M * K);
    float *xscale = malloc(sizeof(float) * M * runs);
    float *xsum = malloc(sizeof(float) * M * num_groups);
    if (!xq || !xscale || !xsum) {
        free(xq); free(xscale); free(xsum);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < num_groups; g++) xsum[m * num_groups + g] = 0.0f;
        for (int64_t r = 0; r < runs; r++) {
            const float *xr = x + m * K + 32 * r;
            float largest = 0.0f, total = 0.0f;
            for (int i = 0; i < 32; i++) {
                largest = fmaxf(largest, fabsf(xr[i]));
                total += xr[i];
            }
            float step = largest / 32767.0f, inverse = largest > 0.0f ? 32767.0f / largest : 0.0f;
            for (int i = 0; i < 32; i++) xq[m * K + 32 * r + i] = (int16_t)lrintf(xr[i] * inverse);
            xscale[m * runs + r] = step;
            xsum[m * num_groups + (32 * r) / group_size] += total;
        }
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

/* out[N, K] float32 = dequantised W (for large M: dequantise once, then a float32 GEMM). */
void tandem_int4_dequantize(const uint8_t *packed, int mode, const void *params,
                            const uint16_t *superblock_scales, int64_t groups_per_superblock,
                            int64_t N, int64_t K, int64_t group_size, float *out, int num_threads) {
    const int64_t num_groups = K / group_size;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        float p[2 * num_groups];
        row_params(mode, params, superblock_scales, groups_per_superblock, n, num_groups, p);
        const uint8_t *w = packed + n * (K / 2);
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

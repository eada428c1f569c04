/* A Llama decoder stack for small steps (decodes, speculative verification) in one call: every
 * layer's RMSNorm, INT4 q/k/v, RoPE, paged KV write, paged attention, INT4 o, RMSNorm, INT4
 * gate/up, SiLU, INT4 down and both residual adds, for T token rows at once; with, where a layer
 * has them, biases after each matmul, per-head q/k RMSNorm before RoPE (Qwen3, Gemma 3), a
 * sliding window, soft-capped scores, norms after attention and MLP and a RoPE of its own (Gemma),
 * and GeLU for SiLU (TandemLayer, TandemDecoderDims). Gemma's (1 + w) norm weights arrive as
 * 1 + w; the embedding scale and the final norm and soft-capping are the caller's. Called through
 * ctypes by tandem/kernels/native_decoder.py (its docstring states the contract); the plain-torch
 * reference is LlamaForCausalLM.forward with Int4Linear layers (same kernel, same arithmetic up
 * to float32 summation order).
 *
 * Why: at batch 1 the eager step is some 2,000 small torch ops (dispatch, allocation, one OpenMP
 * region each), about half of its time on two cores. Here a layer is 4 INT4 matmuls (one OpenMP
 * region each) and one parallel attention region; everything else is a loop over T x hidden.
 *
 * Layouts (all contiguous):
 *   x             [T, H] float32, the residual stream: embeddings in, last layer's output out
 *   positions     [T] int64, each row's position; the row attends keys 0..position of its request
 *   slot_mapping  [T] int64, the cache slot its K/V are written to (block * block_size + offset)
 *   block_tables  [B, max_blocks] int64; row_tables [T] int64: the row of block_tables for row t
 *   k/v caches    [num_blocks, block_size, Hk, D] float32 | bfloat16 | e4m3 codes, per layer;
 *                 e4m3 adds k/v scales [num_blocks, block_size, Hk] float16 (value = code * scale)
 *   captured      [T, num_capture * H] float32: outputs of the layers in capture_layers (ascending)
 * Every row's K/V of a layer are written before any row attends, so several rows of one request
 * (a verification step) see each other causally through the cache, as in the torch path.
 * tandem_decoder_layers_heads runs the same stack over a head-block pool (compressed requests,
 * one decode row each; TandemHeadPaging), as head_attention.head_paged_attention attends.
 */
#include "int4_cpu.c"
#include "logits_cpu.c"

typedef struct {
    const uint8_t *packed;             /* [N, K/2] pack_rows layout */
    const void *params;                /* mode 0: float16 [N, G, 2]; 1, 3: int8 codes [N, G, 2] */
    const uint16_t *superblock_scales; /* mode 1: bfloat16, 3: float16 [N, S, 2] */
    int64_t groups_per_superblock;
    int64_t rows, cols, group_size, mode;
} TandemInt4Weight;

typedef struct {
    TandemInt4Weight qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* [H] float32 */
    void *k_cache, *v_cache;
    uint16_t *k_scale, *v_scale; /* e4m3 caches only, else NULL */
    /* Optional parts (NULL / 0 when the layer has none): biases added after each matmul
     * (q/k/v [(Hq + 2 Hk) * D], o [H], gate/up [2 I], down [H]); RMSNorm weights [D] of each q and
     * k head before RoPE (Qwen3); the sliding window (> 0: a row at position p attends keys
     * p - window + 1 .. p only) and soft-capping of scores (> 0: cap * tanh(score / cap)). */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    const float *q_norm, *k_norm;
    int64_t window;
    float softcap;
    /* Gemma 2/3: norms [H] of the attention output and of the MLP output before their residual
     * adds (post_norm is then the MLP input's norm); this layer's own RoPE tables [max_positions,
     * D] (Gemma 3's sliding layers), NULL for the stack's. */
    const float *post_attn_norm, *post_ffn_norm;
    const float *rope_cos, *rope_sin;
} TandemLayer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size;
    int64_t kv_dtype; /* 0 float32, 1 bfloat16, 2 e4m3 + float16 scales, 3 float16 */
    float eps, scale; /* RMSNorm epsilon; attention scale (head_dim ** -0.5) */
    const float *rope_cos, *rope_sin; /* [max_positions, D] float32 */
    int64_t activation; /* of the gated MLP: 0 SiLU, 1 GeLU (tanh approximation), 2 GeLU (exact) */
} TandemDecoderDims;

/* A compressed request's KV paged per (layer, KV head) (tandem/kernels/head_attention.py): every
 * layer's k/v cache is the one head-block pool [num_head_blocks, block_size, D] (e4m3: scales
 * [num_head_blocks, block_size]); each (layer, request, KV head) has its own block table and token
 * count. Decode rows only: row t is request t, and its K/V are written before it attends. */
typedef struct {
    const int64_t *slots;  /* [L, T, Hk] flat head slot of row t's K/V in each layer and KV head */
    const int64_t *tables; /* [L, T, Hk, max_blocks] head block tables */
    const int64_t *lens;   /* [L, T, Hk] tokens each head holds, this step's row included */
    int64_t max_blocks;
} TandemHeadPaging;

/* -- element conversions (torch's rounding: nearest, ties to even) ------------------------------ */

/* The eager path's float16 cache write (`attention.finite_kv` then `.to(float16)`): a non-finite
 * value is 0, a finite one clamped to float16's range, then rounded to nearest, ties to even. */
static inline uint16_t float_to_f16(float f) {
    if (!isfinite(f)) f = 0.0f;
    return _cvtss_sh(fminf(fmaxf(f, -65504.0f), 65504.0f), _MM_FROUND_TO_NEAREST_INT);
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float e4m3_values[256]; /* code -> value (0x7f / 0xff: NaN, never written) */
static int e4m3_ready = 0;

static void e4m3_init(void) {
    if (e4m3_ready) return;
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e == 0 ? ldexpf((float)m / 8.0f, -6) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        if ((c & 0x7f) == 0x7f) v = NAN;
        e4m3_values[c] = (c & 0x80) ? -v : v;
    }
    e4m3_ready = 1;
}

/* |v| <= 448 (the caller clamps) -> the nearest e4m3 code, ties to the even code (= even mantissa). */
static inline uint8_t float_to_e4m3(float v) {
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    float a = fabsf(v);
    if (!(a == a)) return 0x7f; /* NaN */
    int lo = 0, hi = 126;       /* largest code with value <= a */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (e4m3_values[mid] <= a) lo = mid; else hi = mid - 1;
    }
    int code = lo;
    if (lo < 126) {
        float below = a - e4m3_values[lo], above = e4m3_values[lo + 1] - a;
        if (above < below || (above == below && (lo & 1))) code = lo + 1;
    }
    return (uint8_t)code | sign;
}

/* -- element-wise functions, 16 lanes at a time where the build has AVX-512 ---------------------
 * exp by Cephes' expf reduction and polynomial (within 2 ulp of the exact value over the range
 * used here), so a value's result depends on nothing but the value; the activations and the
 * softmax use it, with masked tails so that every element takes the same arithmetic. Special
 * values as expf gives them: NaN stays NaN (a poisoned row must stay visible: the engine fails
 * requests whose logits are not finite), +inf and values past float32's range give +inf, and
 * those below about -104 give 0. */
#if defined(__AVX512F__)
static inline __m512 exp512(__m512 x) {
    /* max / min return their second operand when one is NaN: NaN lanes stay NaN */
    const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(88.72283f), _mm512_max_ps(_mm512_set1_ps(-87.33654f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512 result = _mm512_scalef_ps(p, n);
    result = _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283f), _CMP_GT_OQ),
                                _mm512_set1_ps(INFINITY));
    return _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-103.97208f), _CMP_LT_OQ),
                              _mm512_setzero_ps());
}

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }
#endif

/* out[i] = act(gate[i]) * up[i], i < I: activation 0 SiLU, 1 GeLU (tanh approximation), 2 GeLU. */
static void gated_activation(int64_t activation, const float *gate, const float *up, int64_t I, float *out) {
#if defined(__AVX512F__)
    if (activation != 2) {
        const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
        for (int64_t i = 0; i < I; i += 16) {
            const __mmask16 k = tail_mask(I - i);
            const __m512 g = _mm512_maskz_loadu_ps(k, gate + i), u = _mm512_maskz_loadu_ps(k, up + i);
            __m512 a;
            if (activation == 0) { /* g / (1 + exp(-g)) */
                a = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            } else { /* 0.5 g (1 + tanh(z)), tanh(z) = 1 - 2 / (1 + exp(2z)) */
                const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
                const __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                               _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, g));
                const __m512 e = exp512(_mm512_add_ps(z, z));
                const __m512 tanh_z = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(one, e)));
                a = _mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_add_ps(one, tanh_z));
            }
            _mm512_mask_storeu_ps(out + i, k, _mm512_mul_ps(a, u));
        }
        return;
    }
#endif
    if (activation == 0)
        for (int64_t i = 0; i < I; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    else if (activation == 1)
        for (int64_t i = 0; i < I; i++) {
            const float g = gate[i];
            out[i] = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * up[i];
        }
    else
        for (int64_t i = 0; i < I; i++) out[i] = 0.5f * gate[i] * (1.0f + erff(gate[i] * 0.7071067811865476f)) * up[i];
}

/* The cache slot of a request's token j: its block's slot `table[j / bs] * bs` plus j % bs, by
 * shifts when the block size is a power of two (`shift`: log2 of it, else -1): no division per key. */
static inline int64_t cache_slot(const int64_t *table, int64_t j, int64_t bs, int shift) {
    if (shift >= 0) return (table[j >> shift] << shift) + (j & (bs - 1));
    return table[j / bs] * bs + j % bs;
}

/* For each of `group` score rows (scores[g * stride + first .. length - 1]): s = exp(s - largest[g]),
 * and total[g] = their sum, added in order of j from 0.0f; up to 4 rows' sums are carried side by
 * side (each still in its own order: the bits of one sum at a time, without its serial latency). */
static inline void softmax_rows(float *scores, int64_t group, int64_t stride, int64_t first, int64_t length,
                                const float *largest, float *total) {
    const int64_t n = length - first;
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t rows = group - g0 < 4 ? group - g0 : 4;
        float *row[4];
        for (int64_t g = 0; g < 4; g++) row[g] = scores + (g0 + (g < rows ? g : 0)) * stride + first;
#if defined(__AVX512F__)
        for (int64_t g = 0; g < rows; g++) {
            const __m512 shift = _mm512_set1_ps(largest[g0 + g]);
            for (int64_t j = 0; j < n; j += 16) {
                const __mmask16 k = tail_mask(n - j);
                _mm512_mask_storeu_ps(row[g] + j, k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row[g] + j), shift)));
            }
        }
#else
        for (int64_t g = 0; g < rows; g++)
            for (int64_t j = 0; j < n; j++) row[g][j] = expf(row[g][j] - largest[g0 + g]);
#endif
        float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            t0 += row[0][j];
            t1 += row[1][j];
            t2 += row[2][j];
            t3 += row[3][j];
        }
        const float sums[4] = {t0, t1, t2, t3};
        for (int64_t g = 0; g < rows; g++) total[g0 + g] = sums[g];
    }
}

/* -- the pieces of a layer ------------------------------------------------------------------- */

/* Fewest token rows for which the element-wise parts of a layer (norms, RoPE and the KV writes,
 * the MLP's activation, residual adds) are split across threads; each row's arithmetic is the same
 * either way. */
#define PARALLEL_MIN_ROWS 8

static void rms_norm_rows(const float *x, const float *weight, float eps, int64_t T, int64_t H, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float total = 0.0f;
        for (int64_t i = 0; i < H; i++) total += xr[i] * xr[i];
        const float inverse = 1.0f / sqrtf(total / (float)H + eps);
        for (int64_t i = 0; i < H; i++) out[t * H + i] = weight[i] * (xr[i] * inverse);
    }
}

/* rms_norm_rows with the rows split across threads (from PARALLEL_MIN_ROWS rows). */
static void rms_norm_rows_threaded(const float *x, const float *weight, float eps, int64_t T, int64_t H, float *out,
                                   int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < T; t++) rms_norm_rows(x + t * H, weight, eps, 1, H, out + t * H);
}

/* x[T * H] += y[T * H], split across threads (from PARALLEL_MIN_ROWS rows). */
static void add_rows(float *x, const float *y, int64_t T, int64_t H, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = t * H; i < (t + 1) * H; i++) x[i] += y[i];
}

/* y[T, N] += bias[N] per row; nothing when bias is NULL. */
static void add_bias(float *y, const float *bias, int64_t T, int64_t N) {
    if (!bias) return;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < N; i++) y[t * N + i] += bias[i];
}

int tandem_q8_mm(const float *x, const int8_t *codes_il, const float *scales_il, int64_t M, int64_t N, int64_t K,
                 float *y, int num_threads);

/* y [T, rows] = x [T, cols] @ W^T. mode 0 / 1 / 3: INT4 (tandem_int4_mm); mode 2: Q8_0 INT8 in the
 * output-interleaved layout of tandem_q8_mm (packed: the codes, params: the float32 scales). */
static int linear(const TandemInt4Weight *w, const float *x, int64_t T, float *y, int num_threads) {
    if (w->mode == 2)
        return tandem_q8_mm(x, (const int8_t *)w->packed, (const float *)w->params, T, w->rows, w->cols, y,
                            num_threads);
    return tandem_int4_mm(x, w->packed, (int)w->mode, w->params, w->superblock_scales,
                          w->groups_per_superblock, T, w->rows, w->cols, w->group_size, y, num_threads);
}

/* x[H*D] per row, in place: x * cos + rotate_half(x) * sin at the row's position. */
static void rope_rows(float *x, int64_t num_heads, int64_t D, const float *cos, const float *sin) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        float *v = x + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* One (token, head) vector into cache row `row` (torch's write_kv / quantize_fp8): slot *
 * num_kv_heads + head in the shared layout, the flat head slot in a head-block pool. */
static void write_vector(const TandemDecoderDims *d, void *cache, uint16_t *scales, int64_t row, const float *v) {
    const int64_t D = d->head_dim;
    if (d->kv_dtype == 0) {
        memcpy((float *)cache + row * D, v, sizeof(float) * D);
    } else if (d->kv_dtype == 1) {
        uint16_t *out = (uint16_t *)cache + row * D;
        for (int64_t i = 0; i < D; i++) out[i] = float_to_bf16(v[i]);
    } else if (d->kv_dtype == 3) {
        uint16_t *out = (uint16_t *)cache + row * D;
        for (int64_t i = 0; i < D; i++) out[i] = float_to_f16(v[i]);
    } else {
        float amax = 0.0f;
        for (int64_t i = 0; i < D; i++) amax = fmaxf(amax, fabsf(v[i]));
        float s = fminf(fmaxf(amax / 448.0f, 1e-8f), 65504.0f);
        const uint16_t half_scale = _cvtss_sh(s, _MM_FROUND_TO_NEAREST_INT);
        s = _cvtsh_ss(half_scale);
        uint8_t *out = (uint8_t *)cache + row * D;
        for (int64_t i = 0; i < D; i++) out[i] = float_to_e4m3(fminf(fmaxf(v[i] / s, -448.0f), 448.0f));
        scales[row] = half_scale;
    }
}

#if defined(__AVX512F__)
/* 16 bfloat16 values widened to float32 (exact: the 16 bits are the float's upper half). */
static inline __m512 bf16_row16(const uint16_t *in) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)in)), 16));
}

/* 16 e4m3 codes as e4m3_values gives them, bit for bit. The code's 7 magnitude bits shifted left by
 * 7 are a float16 of exactly the value / 256 (exponent bias 15 against e4m3's 7; e4m3's subnormals
 * land on float16's), the sign bit moves to float16's; magnitude 0x7f is NaN (as the table: NAN,
 * negated for a negative code). */
static inline __m512 e4m3_row16(const uint8_t *in) {
    const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)in));
    const __m256i magnitude = _mm256_and_si256(c, _mm256_set1_epi16(0x7f));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8);
    __m256i bits = _mm256_or_si256(sign, _mm256_slli_epi16(magnitude, 7));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7f));
    bits = _mm256_mask_mov_epi16(bits, nan, _mm256_or_si256(sign, _mm256_set1_epi16(0x7e00)));
    return _mm512_mul_ps(_mm512_cvtph_ps(bits), _mm512_set1_ps(256.0f));
}

/* 16 float16 values widened to float32 (exact). */
static inline __m512 f16_row16(const uint16_t *in) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)in));
}

/* 16 values of a cache row from element `at` as float32: kv_dtype 0 float32, 1 bfloat16, 2 e4m3
 * (unscaled: the row's scale is the caller's), 3 float16. */
static inline __m512 cache_row16(const void *cache, int kv_dtype, int64_t at) {
    if (kv_dtype == 2) return e4m3_row16((const uint8_t *)cache + at);
    if (kv_dtype == 3) return f16_row16((const uint16_t *)cache + at);
    return kv_dtype ? bf16_row16((const uint16_t *)cache + at) : _mm512_loadu_ps((const float *)cache + at);
}
#endif

/* The cache's row (slot, head) as float32 values times *scale (1 unless e4m3): a float32 cache's
 * row itself, else the row widened into scratch [D]. */
static inline const float *read_vector(const TandemDecoderDims *d, const void *cache, const uint16_t *scales,
                                       int64_t row, float *scratch, float *scale) {
    const int64_t D = d->head_dim;
    *scale = 1.0f;
    if (d->kv_dtype == 0) return (const float *)cache + row * D;
    if (d->kv_dtype == 1 || d->kv_dtype == 3) { /* bfloat16, float16 */
        const uint16_t *in = (const uint16_t *)cache + row * D;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= D; i += 16) _mm512_storeu_ps(scratch + i, cache_row16(cache, (int)d->kv_dtype, row * D + i));
#endif
        for (; i < D; i++) scratch[i] = d->kv_dtype == 1 ? bf16_to_float(in[i]) : _cvtsh_ss(in[i]);
        return scratch;
    }
    const uint8_t *in = (const uint8_t *)cache + row * D;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= D; i += 16) _mm512_storeu_ps(scratch + i, e4m3_row16(in + i));
#endif
    for (; i < D; i++) scratch[i] = e4m3_values[in[i]];
    *scale = _cvtsh_ss(scales[row]);
    return scratch;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; i++) total += a[i] * b[i];
    return total;
}

#if defined(__AVX512F__)
/* r[i] = the sum of v[i]'s 16 lanes (a transposing tree: each lane adds only its own vector's
 * partial sums, in an order that depends on nothing else). */
static inline __m512 sum_lanes16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: v[2i]'s halves added; 8-15: v[2i+1]'s */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    /* the tree leaves vector i in lane (i % 4) * 4 + i / 4 */
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), r);
}

/* Scores of up to 16 keys (keys[i], n of them; scale[i] each) against `group` query heads
 * q [group, D] (D % 16 == 0) into scores[g * stride + i]: per key, the 16-lane products
 * q[d..d+15] * k[d..d+15] summed over d in order, the lanes added by sum_lanes16, times its scale.
 * A key's score depends on nothing but its query and itself. */
static inline void key_block_scores(const float *q, int64_t group, int64_t D, const float *const keys[16],
                                    const float scale[16], int64_t n, float *scores, int64_t stride) {
    if (D == 64 && group <= 4) { /* each key read once for the group's heads (the same sums) */
        __m512 parts[4][16];
        for (int64_t i = 0; i < 16; i++) {
            const float *k = keys[i < n ? i : 0];
            const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16);
            const __m512 k2 = _mm512_loadu_ps(k + 32), k3 = _mm512_loadu_ps(k + 48);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * 64;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), k0);
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16), k1, acc);
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 32), k2, acc);
                parts[g][i] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 48), k3, acc);
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float out[16];
            _mm512_storeu_ps(out, _mm512_mul_ps(sum_lanes16(parts[g]), _mm512_loadu_ps(scale)));
            for (int64_t i = 0; i < n; i++) scores[g * stride + i] = out[i];
        }
        return;
    }
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * D;
        __m512 parts[16];
        for (int64_t i = 0; i < 16; i++) {
            const float *k = keys[i < n ? i : 0];
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(k));
            for (int64_t e = 16; e < D; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + e), _mm512_loadu_ps(k + e), acc);
            parts[i] = acc;
        }
        float out[16];
        _mm512_storeu_ps(out, _mm512_mul_ps(sum_lanes16(parts), _mm512_loadu_ps(scale)));
        for (int64_t i = 0; i < n; i++) scores[g * stride + i] = out[i];
    }
}
#endif

#if defined(__AVX512F__)
/* o[g * 64 ..] = sum over j of (scores[g, j] / total[g]) * value row j, for the G query heads of
 * one group (head_dim 64; a bfloat16, e4m3 or float16 cache (kv_dtype 1, 2, 3) widened in registers, an e4m3
 * row times its scale from `scales`): each value row read once for all G heads, each head's sums in
 * order of j as the per-head loop adds them (the same bits). */
static inline __attribute__((always_inline)) void grouped_values64(int G, int kv_dtype, const void *values,
                                                                  const uint16_t *scales, const int64_t *table,
                                                                  int64_t bs, int shift, int64_t row_heads, int64_t head,
                                                                  int64_t first, int64_t length, const float *scores,
                                                                  const float *total, float *o) {
    __m512 sum[4][4];
    float inverse[4];
    for (int g = 0; g < G; g++) {
        inverse[g] = 1.0f / total[g];
        for (int e = 0; e < 4; e++) sum[g][e] = _mm512_setzero_ps();
    }
    for (int64_t j = first; j < length; j++) {
        const int64_t row = cache_slot(table, j, bs, shift) * row_heads + head, at = row * 64;
        const float s = kv_dtype == 2 ? _cvtsh_ss(scales[row]) : 1.0f;
        const __m512 v0 = cache_row16(values, kv_dtype, at), v1 = cache_row16(values, kv_dtype, at + 16);
        const __m512 v2 = cache_row16(values, kv_dtype, at + 32), v3 = cache_row16(values, kv_dtype, at + 48);
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(kv_dtype == 2 ? scores[g * length + j] * inverse[g] * s
                                                          : scores[g * length + j] * inverse[g]);
            sum[g][0] = _mm512_fmadd_ps(p, v0, sum[g][0]);
            sum[g][1] = _mm512_fmadd_ps(p, v1, sum[g][1]);
            sum[g][2] = _mm512_fmadd_ps(p, v2, sum[g][2]);
            sum[g][3] = _mm512_fmadd_ps(p, v3, sum[g][3]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int e = 0; e < 4; e++) _mm512_storeu_ps(o + g * 64 + 16 * e, sum[g][e]);
}
#endif

/* out[T, Hq * D] = softmax(q K^T * scale) V per (row, query head), keys 0..positions[t] of the
 * row's request (only the last layer->window of them when it is set; scores soft-capped when
 * layer->softcap is set) (block_tables row row_tables[t], or t when row_tables is NULL). q rows are
 * q_stride floats apart. The query heads of one GQA group are done together, so each cached key
 * and value is read (and widened from its cache dtype) once per group. */
static void attention(const TandemDecoderDims *d, const TandemLayer *layer, const float *q_base, int64_t q_stride,
                      int64_t T, const int64_t *positions, const int64_t *block_tables, int64_t max_blocks,
                      const int64_t *row_tables, float *out, int num_threads, const TandemHeadPaging *paging,
                      int64_t layer_index) {
    const int64_t Hq = d->num_heads, Hk = d->num_kv_heads, D = d->head_dim, bs = d->block_size;
    const int64_t group = Hq / Hk;
    const int shift = (bs & (bs - 1)) == 0 ? __builtin_ctzll((unsigned long long)bs) : -1;
    int64_t max_len = 0;
    for (int64_t t = 0; t < T; t++) max_len = positions[t] + 1 > max_len ? positions[t] + 1 : max_len;
    /* A head holds at most its request's tokens so far: max_len bounds it too. */
    const int64_t *head_lens = paging ? paging->lens + layer_index * T * Hk : NULL;
    const int64_t *head_tables = paging ? paging->tables + layer_index * T * Hk * paging->max_blocks : NULL;
    const int64_t head_width = paging ? paging->max_blocks : 0;
    const int64_t row_heads = paging ? 1 : Hk; /* cache rows per slot */
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_len * group));
        float *acc = malloc(sizeof(float) * (size_t)(group * D));
        float *key_rows = malloc(sizeof(float) * (size_t)(16 * D)); /* widened keys (not float32 caches) */
        float vec[D];
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t t = 0; t < T; t++) {
            for (int64_t kv_head = 0; kv_head < Hk; kv_head++) {
                const float *q = q_base + t * q_stride + kv_head * group * D; /* the group's heads */
                int64_t length = positions[t] + 1, head = kv_head;
                const int64_t *table = block_tables ? block_tables + (row_tables ? row_tables[t] : t) * max_blocks : NULL;
                if (paging) { /* this head's own table and count; its pool rows are its slots */
                    length = head_lens[t * Hk + kv_head];
                    table = head_tables + (t * Hk + kv_head) * head_width;
                    head = 0;
                }
                /* keys first..length-1: the window's (blocks before it may be freed) */
                const int64_t first = (!paging && layer->window > 0 && length > layer->window) ? length - layer->window : 0;
                const float cap = layer->softcap;
                float largest[group], total[group];
                for (int64_t g = 0; g < group; g++) largest[g] = -INFINITY, total[g] = 0.0f;
#if defined(__AVX512F__)
                if (D % 16 == 0) { /* 16 keys at a time (key_block_scores) */
                    for (int64_t j0 = first; j0 < length; j0 += 16) {
                        const int64_t n = length - j0 < 16 ? length - j0 : 16;
                        const float *keys[16];
                        float key_scale[16] = {0.0f};
                        for (int64_t i = 0; i < n; i++) {
                            const int64_t j = j0 + i, row = cache_slot(table, j, bs, shift) * row_heads + head;
                            keys[i] = read_vector(d, layer->k_cache, layer->k_scale, row, key_rows + i * D, &key_scale[i]);
                            key_scale[i] *= d->scale;
                        }
                        key_block_scores(q, group, D, keys, key_scale, n, scores + j0, length);
                    }
                    for (int64_t g = 0; g < group; g++) {
                        if (cap > 0.0f) {
                            for (int64_t j = first; j < length; j++) {
                                const float score = scores[g * length + j] = cap * tanhf(scores[g * length + j] / cap);
                                largest[g] = fmaxf(largest[g], score);
                            }
                            continue;
                        }
                        /* fmaxf's answer: a NaN score is passed over (max_ps returns its second
                         * operand when either is NaN), and the largest of the rest is exact */
                        __m512 m = _mm512_set1_ps(-INFINITY);
                        for (int64_t j = first; j < length; j += 16) {
                            const __mmask16 k = tail_mask(length - j);
                            m = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, scores + g * length + j), m);
                        }
                        largest[g] = _mm512_reduce_max_ps(m);
                    }
                } else
#endif
                for (int64_t j = first; j < length; j++) {
                    const int64_t row = cache_slot(table, j, bs, shift) * row_heads + head;
                    float s;
                    const float *key = read_vector(d, layer->k_cache, layer->k_scale, row, vec, &s);
                    s *= d->scale;
                    for (int64_t g = 0; g < group; g++) {
                        float score = dot(q + g * D, key, D) * s;
                        if (cap > 0.0f) score = cap * tanhf(score / cap);
                        scores[g * length + j] = score;
                        largest[g] = fmaxf(largest[g], score);
                    }
                }
                softmax_rows(scores, group, length, first, length, largest, total);
                float *o = out + t * Hq * D + kv_head * group * D;
#if defined(__AVX512F__)
                const int kv_dtype = (int)d->kv_dtype;
                if (D == 64 && group <= 4 && kv_dtype <= 3) { /* the group's sums in registers, one pass */
                    const void *values = layer->v_cache;
                    const uint16_t *v_scales = layer->v_scale;
                    switch (group + 4 * kv_dtype) {
#define GROUP_VALUES(G, KV) \
    grouped_values64(G, KV, values, v_scales, table, bs, shift, row_heads, head, first, length, scores, total, o)
                        case 1: GROUP_VALUES(1, 0); break;
                        case 2: GROUP_VALUES(2, 0); break;
                        case 3: GROUP_VALUES(3, 0); break;
                        case 4: GROUP_VALUES(4, 0); break;
                        case 5: GROUP_VALUES(1, 1); break;
                        case 6: GROUP_VALUES(2, 1); break;
                        case 7: GROUP_VALUES(3, 1); break;
                        case 8: GROUP_VALUES(4, 1); break;
                        case 9: GROUP_VALUES(1, 2); break;
                        case 10: GROUP_VALUES(2, 2); break;
                        case 11: GROUP_VALUES(3, 2); break;
                        case 12: GROUP_VALUES(4, 2); break;
                        case 13: GROUP_VALUES(1, 3); break;
                        case 14: GROUP_VALUES(2, 3); break;
                        case 15: GROUP_VALUES(3, 3); break;
                        default: GROUP_VALUES(4, 3); break;
#undef GROUP_VALUES
                    }
                    continue;
                }
                if (D % 16 == 0 && D <= 256 && kv_dtype <= 3) { /* each head's sum in registers */
                    const void *values = layer->v_cache;
                    for (int64_t g = 0; g < group; g++) {
                        const float inverse = 1.0f / total[g];
                        __m512 sum[16];
                        for (int64_t e = 0; e < D / 16; e++) sum[e] = _mm512_setzero_ps();
                        for (int64_t j = first; j < length; j++) {
                            const int64_t row = cache_slot(table, j, bs, shift) * row_heads + head, at = row * D;
                            const __m512 p = _mm512_set1_ps(kv_dtype == 2 ? scores[g * length + j] * inverse *
                                                                                _cvtsh_ss(layer->v_scale[row])
                                                                          : scores[g * length + j] * inverse);
                            for (int64_t e = 0; e < D / 16; e++)
                                sum[e] = _mm512_fmadd_ps(p, cache_row16(values, kv_dtype, at + 16 * e), sum[e]);
                        }
                        for (int64_t e = 0; e < D / 16; e++) _mm512_storeu_ps(o + g * D + 16 * e, sum[e]);
                    }
                    continue;
                }
#endif
                for (int64_t i = 0; i < group * D; i++) acc[i] = 0.0f;
                for (int64_t j = first; j < length; j++) {
                    const int64_t row = cache_slot(table, j, bs, shift) * row_heads + head;
                    float s;
                    const float *value = read_vector(d, layer->v_cache, layer->v_scale, row, vec, &s);
                    for (int64_t g = 0; g < group; g++) {
                        const float p = scores[g * length + j] / total[g] * s;
                        float *a = acc + g * D;
#pragma omp simd
                        for (int64_t i = 0; i < D; i++) a[i] += p * value[i];
                    }
                }
                memcpy(o, acc, sizeof(float) * group * D);
            }
        }
        free(scores);
        free(acc);
        free(key_rows);
    }
}

/* Decode attention on its own (the eager model's decode rows): q [T, Hq * D] float32, one row
 * per request, block_tables [T, max_blocks], out [T, Hq * D]. Cache layouts as in the file comment. */
void tandem_paged_attention(const float *q, int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t kv_dtype, float scale, void *k_cache, void *v_cache,
                            uint16_t *k_scale, uint16_t *v_scale, const int64_t *positions,
                            const int64_t *block_tables, int64_t max_blocks, int64_t window, float softcap,
                            float *out, int num_threads) {
    e4m3_init();
    TandemDecoderDims d;
    memset(&d, 0, sizeof d);
    d.num_heads = num_heads, d.num_kv_heads = num_kv_heads, d.head_dim = head_dim;
    d.block_size = block_size, d.kv_dtype = kv_dtype, d.scale = scale;

    TandemLayer layer;
    memset(&layer, 0, sizeof layer);
    layer.k_cache = k_cache, layer.v_cache = v_cache, layer.k_scale = k_scale, layer.v_scale = v_scale;
    layer.window = window, layer.softcap = softcap;
    attention(&d, &layer, q, num_heads * head_dim, T, positions, block_tables, max_blocks, NULL, out, num_threads,
              NULL, 0);
}

/* Runs every layer over x in place. Returns 0, -1 when scratch memory cannot be allocated, -2 for
 * an unsupported INT4 group size (the first matmul that fails stops the stack). With `paging`,
 * the KV is a head-block pool (see TandemHeadPaging) and slot_mapping / block_tables / row_tables
 * are unused. */
static int decoder_layers(const TandemDecoderDims *d, const TandemLayer *layers, float *x, int64_t T,
                          const int64_t *positions, const int64_t *slot_mapping, const int64_t *block_tables,
                          int64_t max_blocks, const int64_t *row_tables, const int64_t *capture_layers,
                          int64_t num_capture, float *captured, int num_threads, const TandemHeadPaging *paging) {
    e4m3_init();
    const int64_t H = d->hidden, I = d->intermediate, D = d->head_dim;
    const int64_t Hq = d->num_heads, Hk = d->num_kv_heads, width = (Hq + 2 * Hk) * D;
    float *normed = malloc(sizeof(float) * T * (H > I ? H : I));
    float *qkv = malloc(sizeof(float) * T * width);
    float *attn = malloc(sizeof(float) * T * Hq * D);
    float *proj = malloc(sizeof(float) * T * (2 * I > H ? 2 * I : H));
    int status = (normed && qkv && attn && proj) ? 0 : -1;
    for (int64_t l = 0, next_capture = 0; status == 0 && l < d->num_layers; l++) {
        const TandemLayer *layer = layers + l;
        rms_norm_rows_threaded(x, layer->input_norm, d->eps, T, H, normed, num_threads);
        if ((status = linear(&layer->qkv, normed, T, qkv, num_threads)) != 0) break;
        add_bias(qkv, layer->qkv_bias, T, width);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T >= PARALLEL_MIN_ROWS)
        for (int64_t t = 0; t < T; t++) {
            const float *cos_table = layer->rope_cos ? layer->rope_cos : d->rope_cos;
            const float *sin_table = layer->rope_sin ? layer->rope_sin : d->rope_sin;
            const float *cos = cos_table + positions[t] * D, *sin = sin_table + positions[t] * D;
            float *row = qkv + t * width;
            if (layer->q_norm) /* in place: each head's sum of squares is taken before it is written */
                for (int64_t h = 0; h < Hq; h++) rms_norm_rows(row + h * D, layer->q_norm, d->eps, 1, D, row + h * D);
            if (layer->k_norm)
                for (int64_t h = 0; h < Hk; h++)
                    rms_norm_rows(row + (Hq + h) * D, layer->k_norm, d->eps, 1, D, row + (Hq + h) * D);
            rope_rows(row, Hq + Hk, D, cos, sin); /* q heads then k heads: contiguous */
            for (int64_t h = 0; h < Hk; h++) {
                const int64_t cache_row = paging ? paging->slots[(l * T + t) * Hk + h] : slot_mapping[t] * Hk + h;
                write_vector(d, layer->k_cache, layer->k_scale, cache_row, row + (Hq + h) * D);
                write_vector(d, layer->v_cache, layer->v_scale, cache_row, row + (Hq + Hk + h) * D);
            }
        }
        attention(d, layer, qkv, width, T, positions, block_tables, max_blocks, row_tables, attn, num_threads,
                  paging, l);
        if ((status = linear(&layer->o, attn, T, proj, num_threads)) != 0) break;
        add_bias(proj, layer->o_bias, T, H);
        if (layer->post_attn_norm) rms_norm_rows_threaded(proj, layer->post_attn_norm, d->eps, T, H, proj, num_threads);
        add_rows(x, proj, T, H, num_threads);
        rms_norm_rows_threaded(x, layer->post_norm, d->eps, T, H, normed, num_threads);
        if ((status = linear(&layer->gate_up, normed, T, proj, num_threads)) != 0) break;
        add_bias(proj, layer->gate_up_bias, T, 2 * I);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T >= PARALLEL_MIN_ROWS)
        for (int64_t t = 0; t < T; t++)
            gated_activation(d->activation, proj + t * 2 * I, proj + t * 2 * I + I, I, normed + t * I);
        if ((status = linear(&layer->down, normed, T, proj, num_threads)) != 0) break;
        add_bias(proj, layer->down_bias, T, H);
        if (layer->post_ffn_norm) rms_norm_rows_threaded(proj, layer->post_ffn_norm, d->eps, T, H, proj, num_threads);
        add_rows(x, proj, T, H, num_threads);
        if (next_capture < num_capture && capture_layers[next_capture] == l) {
            for (int64_t t = 0; t < T; t++)
                memcpy(captured + (t * num_capture + next_capture) * H, x + t * H, sizeof(float) * H);
            next_capture++;
        }
    }
    free(normed); free(qkv); free(attn); free(proj);
    return status;
}

int tandem_decoder_layers(const TandemDecoderDims *d, const TandemLayer *layers, float *x, int64_t T,
                          const int64_t *positions, const int64_t *slot_mapping, const int64_t *block_tables,
                          int64_t max_blocks, const int64_t *row_tables, const int64_t *capture_layers,
                          int64_t num_capture, float *captured, int num_threads) {
    return decoder_layers(d, layers, x, T, positions, slot_mapping, block_tables, max_blocks, row_tables,
                          capture_layers, num_capture, captured, num_threads, NULL);
}

/* The stack over a head-block pool: T decode rows, row t of request t (TandemHeadPaging). */
int tandem_decoder_layers_heads(const TandemDecoderDims *d, const TandemLayer *layers, float *x, int64_t T,
                                const int64_t *positions, const int64_t *head_slots, const int64_t *head_tables,
                                int64_t max_blocks, const int64_t *head_lens, int num_threads) {
    const TandemHeadPaging paging = {head_slots, head_tables, head_lens, max_blocks};
    return decoder_layers(d, layers, x, T, positions, NULL, NULL, 0, NULL, NULL, 0, NULL, num_threads, &paging);
}

/* -- INT8 (Q8_0) matmul: the linears of weight_dtype="int8" and INT4/INT8 models' LM head ---------
 * W in Q8_0 (w_ij = codes_ij * scale[i, j / 32]), stored for this kernel in blocks of 16 outputs:
 *   codes_il [Np / 16, K / 2, 16, 2] int8: block b, input pair p, lane l = (w[16b+l, 2p], w[16b+l, 2p+1])
 *   scales_il [Np / 16, K / 32, 16] float32 (the float16 scales, widened exactly)
 * with Np = N rounded up to 16 (padding rows are zero). Activations are rounded to int16 per run of
 * 32 as in tandem_int4_mm. For each output (m, n): d_r = the exact integer dot product of run r,
 * then acc = fma((float)d_r, scale[n, r] * xscale[m, r], acc) for r = 0, 1, ... in order, y = acc.
 * That arithmetic is per (m, n): the same whatever M, the rows around m, the thread count or the
 * instruction set (AVX-512 holds 16 outputs per register, AVX2 two halves of 8), so a row's
 * result never depends on its call (batch invariance) and one kernel serves decode and prefill.
 * Work per 16 outputs, Q8_ROWS rows and input pair: one widened load of the codes and Q8_ROWS
 * multiply-adds (vpdpwssd where the CPU has AVX512-VNNI). 8 rows with AVX-512's 32 registers, 4 with
 * AVX2's 16 (measured, docs/performance.md). Returns 0, -1 when scratch cannot be allocated. */
#if defined(__AVX512BW__) && defined(__AVX512F__)
#define Q8_ROWS 8
#else
#define Q8_ROWS 4
#endif

#if defined(__AVX512BW__) && defined(__AVX512F__)
/* MB rows (a constant where inlined: the accumulators then stay in registers and no row count is
 * tested per input pair). Each run's integer dot products are summed in PARTS partial sums (pair
 * p into part p % PARTS), enough independent multiply-add chains to hide their latency with few
 * rows; integers, so d_r is exact and the same whatever the split. */
static inline __attribute__((always_inline)) void q8_block_rows512(const int8_t *wb, const float *sb,
                                                                   const int32_t *xpairs, const float *xscale,
                                                                   const int MB, int64_t K, int64_t runs,
                                                                   float out[Q8_ROWS][16]) {
    enum { MAX_PARTS = 4 };
    const int parts = MB <= 2 ? 4 : MB <= 4 ? 2 : 1;
    const int64_t pairs = K / 2;
    __m512 acc[Q8_ROWS];
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t r = 0; r < runs; r++) {
        __m512i d[MAX_PARTS][Q8_ROWS];
        for (int j = 0; j < parts; j++)
            for (int m = 0; m < MB; m++) d[j][m] = _mm512_setzero_si512();
        for (int64_t p = 16 * r; p < 16 * r + 16; p += parts) {
            for (int j = 0; j < parts; j++) {
                const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wb + 32 * (p + j))));
                for (int m = 0; m < MB; m++) {
                    const __m512i xv = _mm512_set1_epi32(xpairs[m * pairs + p + j]);
#if defined(__AVX512VNNI__)
                    d[j][m] = _mm512_dpwssd_epi32(d[j][m], wv, xv);
#else
                    d[j][m] = _mm512_add_epi32(d[j][m], _mm512_madd_epi16(wv, xv));
#endif
                }
            }
        }
        const __m512 ws = _mm512_loadu_ps(sb + 16 * r);
        for (int m = 0; m < MB; m++) {
            __m512i dot = d[0][m];
            for (int j = 1; j < parts; j++) dot = _mm512_add_epi32(dot, d[j][m]);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, _mm512_set1_ps(xscale[m * runs + r])),
                                     acc[m]);
        }
    }
    for (int m = 0; m < MB; m++) _mm512_storeu_ps(out[m], acc[m]);
}
#else
/* AVX2: MB rows (a constant where inlined), 16 outputs as two halves of 8. */
static inline __attribute__((always_inline)) void q8_block_rows256(const int8_t *wb, const float *sb,
                                                                   const int32_t *xpairs, const float *xscale,
                                                                   const int MB, int64_t K, int64_t runs,
                                                                   float out[Q8_ROWS][16]) {
    const int64_t pairs = K / 2;
    __m256 lo[Q8_ROWS], hi[Q8_ROWS];
    for (int m = 0; m < MB; m++) lo[m] = hi[m] = _mm256_setzero_ps();
    for (int64_t r = 0; r < runs; r++) {
        __m256i dlo[Q8_ROWS], dhi[Q8_ROWS];
        for (int m = 0; m < MB; m++) dlo[m] = dhi[m] = _mm256_setzero_si256();
        for (int64_t p = 16 * r; p < 16 * r + 16; p++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(wb + 32 * p));
            const __m256i wlo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));      /* outputs 0..7 */
            const __m256i whi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1)); /* outputs 8..15 */
            for (int m = 0; m < MB; m++) {
                const __m256i xv = _mm256_set1_epi32(xpairs[m * pairs + p]);
                dlo[m] = _mm256_add_epi32(dlo[m], _mm256_madd_epi16(wlo, xv));
                dhi[m] = _mm256_add_epi32(dhi[m], _mm256_madd_epi16(whi, xv));
            }
        }
        const __m256 wslo = _mm256_loadu_ps(sb + 16 * r), wshi = _mm256_loadu_ps(sb + 16 * r + 8);
        for (int m = 0; m < MB; m++) {
            const __m256 xs = _mm256_set1_ps(xscale[m * runs + r]);
            lo[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dlo[m]), _mm256_mul_ps(wslo, xs), lo[m]);
            hi[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dhi[m]), _mm256_mul_ps(wshi, xs), hi[m]);
        }
    }
    for (int m = 0; m < MB; m++) {
        _mm256_storeu_ps(out[m], lo[m]);
        _mm256_storeu_ps(out[m] + 8, hi[m]);
    }
}
#endif

static void q8_block_rows(const int8_t *wb, const float *sb, const int32_t *xpairs, const float *xscale,
                          int64_t mb, int64_t K, int64_t runs, float out[Q8_ROWS][16]) {
#if defined(__AVX512BW__) && defined(__AVX512F__)
    switch (mb) {
        case 8: q8_block_rows512(wb, sb, xpairs, xscale, 8, K, runs, out); break;
        case 7: q8_block_rows512(wb, sb, xpairs, xscale, 7, K, runs, out); break;
        case 6: q8_block_rows512(wb, sb, xpairs, xscale, 6, K, runs, out); break;
        case 5: q8_block_rows512(wb, sb, xpairs, xscale, 5, K, runs, out); break;
        case 4: q8_block_rows512(wb, sb, xpairs, xscale, 4, K, runs, out); break;
        case 3: q8_block_rows512(wb, sb, xpairs, xscale, 3, K, runs, out); break;
        case 2: q8_block_rows512(wb, sb, xpairs, xscale, 2, K, runs, out); break;
        default: q8_block_rows512(wb, sb, xpairs, xscale, 1, K, runs, out); break;
    }
#else
    switch (mb) {
        case 4: q8_block_rows256(wb, sb, xpairs, xscale, 4, K, runs, out); break;
        case 3: q8_block_rows256(wb, sb, xpairs, xscale, 3, K, runs, out); break;
        case 2: q8_block_rows256(wb, sb, xpairs, xscale, 2, K, runs, out); break;
        default: q8_block_rows256(wb, sb, xpairs, xscale, 1, K, runs, out); break;
    }
#endif
}

/* Rows [m_begin, M) of tandem_q8_mm with the vector kernel (xq, xscale as round_activations gives
 * them for all M rows). */
static void q8_vector_rows(const int16_t *xq, const float *xscale, const int8_t *codes_il, const float *scales_il,
                           int64_t m_begin, int64_t M, int64_t N, int64_t K, float *y, int num_threads) {
    const int64_t runs = K / 32, blocks = (N + 15) / 16;
    const int32_t *xpairs = (const int32_t *)xq; /* row m's pair p: xq[m, 2p] | xq[m, 2p + 1] << 16 */
#pragma omp parallel for schedule(static) collapse(2) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t m0 = m_begin; m0 < M; m0 += Q8_ROWS) {
            float out[Q8_ROWS][16];
            const int64_t mb = M - m0 < Q8_ROWS ? M - m0 : Q8_ROWS;
            q8_block_rows(codes_il + b * K * 16, scales_il + b * runs * 16, xpairs + m0 * (K / 2), xscale + m0 * runs,
                          mb, K, runs, out);
            const int64_t width = N - 16 * b < 16 ? N - 16 * b : 16;
            for (int64_t m = 0; m < mb; m++) memcpy(y + (m0 + m) * N + 16 * b, out[m], sizeof(float) * width);
        }
    }
}

int tandem_q8_mm(const float *x, const int8_t *codes_il, const float *scales_il, int64_t M, int64_t N, int64_t K,
                 float *y, int num_threads) {
    const int64_t runs = K / 32;
    int16_t *xq = malloc(sizeof(int16_t) * M * K);
    float *xscale = malloc(sizeof(float) * M * runs);
    if (!xq || !xscale) {
        free(xq); free(xscale);
        return -1;
    }
    round_activations(x, M, K, 32, xq, xscale, NULL, num_threads);
    /* on the tile unit where it runs, the rest with the vector kernel: the same bits either way */
    const int64_t tiled = amx_usable() ? amx_q8_tiled_rows(M, N, K) : 0;
    int status = 0;
    if (tiled > 0) status = amx_q8_mm(xq, xscale, codes_il, scales_il, tiled, N, K, y, num_threads);
    if (status == 0 && tiled < M) q8_vector_rows(xq, xscale, codes_il, scales_il, tiled, M, N, K, y, num_threads);
    free(xq); free(xscale);
    return status;
}

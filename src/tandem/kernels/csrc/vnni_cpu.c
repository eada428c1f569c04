/* GGUF 4-bit blocks as stored (tandem_int4_mm mode 3, group size 32) with AVX512-VNNI, on the tile
 * unit (amx_cpu.c, included below) where it runs: one arithmetic for every CPU (Ice Lake and later
 * Xeons, AMD Zen 4 and later with AVX512-VNNI), with AMX or without, at every call size.
 * Included by int4_cpu.c; builds without AVX512-VNNI run the same arithmetic with AVX2
 * (blocks_avx2.c), so every x86-64 CPU the library runs on gives the same bits.
 *
 * The arithmetic, for each output (m, n), d_r the exact integer dot product of run r of the int16
 * activations (round_activations) with the codes (0..15):
 *   acc  = fma((float)d_r, scale[n, r] * xscale[m, r], acc)     for r = 0, 1, ... in order
 *   bias = fma(-offset[n, r], xsum[m, r], bias)                 for r = 0, 1, ... in order
 *   y    = acc + bias
 * with (scale, -offset) as row_params gives them (w = q * scale - offset). Per (m, n), so the same
 * whatever M, the rows around m or the unit that computed d_r (batch invariance; an AMX machine and
 * one with AVX512-VNNI only give the same bits).
 *
 * Exact integers: each int16 activation splits into a signed high byte and an unsigned low byte
 * (x = 256 * hi + lo), and d_r = 256 * hi_dot + lo_dot. The codes of 16 outputs sit in "B rows" of
 * 64 bytes (the tile unit's B layout): B row j of run r holds each output's 4 codes of k = 4j..4j+3,
 * so vpdpbusd of a B row with 4 broadcast high bytes (codes unsigned, bytes signed), and of 4
 * broadcast low bytes with it (bytes unsigned, codes 0..15 as signed), gives 16 outputs' partial
 * dot products in the lanes: no horizontal sums, and each B row, read once per block of 16 outputs,
 * feeds every activation row. */
#include <omp.h>

/* xq [M, K] int16 -> hi, lo [Mp, K] bytes (Mp >= M: padding rows zero). */
static void split_activations(const int16_t *xq, int64_t M, int64_t K, int64_t Mp, int8_t *hi, uint8_t *lo,
                              int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 16384)
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = m * K; i < (m + 1) * K; i++) {
            hi[i] = (int8_t)(xq[i] >> 8);
            lo[i] = (uint8_t)(xq[i] & 0xFF);
        }
    memset(hi + M * K, 0, (size_t)((Mp - M) * K));
    memset(lo + M * K, 0, (size_t)((Mp - M) * K));
}

/* A gguf_blocks_mm call's scratch: the activations split into bytes (Mp rows) and words_per_thread
 * 4-byte words for each thread's block of 16 outputs (B rows, parameters). */
typedef struct {
    int8_t *hi;
    uint8_t *lo;
    float *words;
} BlocksScratch;

static void blocks_scratch_free(BlocksScratch *s) {
    free(s->hi);
    free(s->lo);
    free(s->words);
}

/* Allocates *s and splits xq into it; returns 0, or -1 (nothing left allocated) without memory. */
static int blocks_scratch(const int16_t *xq, int64_t M, int64_t K, int64_t Mp, int64_t words_per_thread,
                          int num_threads, BlocksScratch *s) {
    s->hi = malloc((size_t)(Mp * K));
    s->lo = malloc((size_t)(Mp * K));
    s->words = malloc(sizeof(float) * (size_t)(num_threads * words_per_thread));
    if (!s->hi || !s->lo || !s->words) {
        blocks_scratch_free(s);
        return -1;
    }
    split_activations(xq, M, K, Mp, s->hi, s->lo, num_threads);
    return 0;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define TANDEM_HAVE_VNNI_INT4 1

/* dst[0..width) = row[0..width), width <= 16 */
static inline void store_row16(float *dst, const float row[16], int64_t width) {
    _mm512_mask_storeu_ps(dst, (__mmask16)((1u << width) - 1), _mm512_loadu_ps(row));
}

/* Rows 0..mb-1 of block b's 16 outputs into y [., N] (row stride N; the last block may be
 * partial). */
static inline void store_block16(float out[16][16], int64_t mb, float *y, int64_t N, int64_t b) {
    const int64_t width = N - 16 * b < 16 ? N - 16 * b : 16;
    for (int64_t m = 0; m < mb; m++) store_row16(y + m * N + 16 * b, out[m], width);
}

/* Where block n0's 16 weight rows start (row-chunked nibbles: row n, run r: 16 bytes, byte i =
 * q[i] | q[16 + i] << 4), each lane's byte offset to its row and which rows exist (n0 + i < N). */
typedef struct {
    const uint8_t *base;
    __m512i row_offsets;
    __mmask16 present;
    const uint8_t *next; /* the next block's rows (16 * K / 2 bytes right after these), or NULL */
    int tiled;           /* mode 4: the block's bytes in tile order (int4_cpu.c), read with plain loads */
} Int4BlockRows;

static inline Int4BlockRows int4_block_rows(const uint8_t *packed, int64_t n0, int64_t N, int64_t K, int tiled) {
    const int64_t row_bytes = K / 2;
    Int4BlockRows rows;
    rows.tiled = tiled;
    rows.base = packed + n0 * row_bytes;
    rows.next = N - n0 > 16 ? rows.base + 16 * row_bytes : NULL;
    rows.row_offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32((int)row_bytes));
    rows.present = N - n0 >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    return rows;
}

/* Run r's 8 B rows (rows past N: zero codes): with dword j of each row's run gathered across the 16
 * rows, its low nibbles are B row j and its high nibbles B row j + 4. Row-major (mode 3), the gathers
 * read 16 rows at once, a stride the hardware prefetchers do not follow (docs/performance.md, eighth
 * session): run r's share of the next block's rows (contiguous after these, 256 bytes a run) is
 * fetched first. In tile order (mode 4) those 16 dwords are the 64 bytes at 256 r + 64 j: one load. */
static inline __attribute__((always_inline)) void int4_b_run(Int4BlockRows rows, int64_t r, __m512i b[8]) {
    if (rows.next && !rows.tiled)
        for (int i = 0; i < 256; i += 64) _mm_prefetch((const char *)rows.next + 256 * r + i, _MM_HINT_T0);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m512i dwords =
            rows.tiled ? _mm512_loadu_si512(rows.base + 256 * r + 64 * j)
                       : _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows.present, rows.row_offsets,
                                                     rows.base + 16 * r + 4 * j, 1);
        b[j] = _mm512_and_si512(dwords, nibble);
        b[j + 4] = _mm512_and_si512(_mm512_srli_epi32(dwords, 4), nibble);
    }
}

/* Every run's B rows of one block, [runs][8][64] bytes. */
static void int4_b_rows(Int4BlockRows rows, int64_t runs, uint8_t *tiles) {
    for (int64_t r = 0; r < runs; r++) {
        __m512i b[8];
        int4_b_run(rows, r, b);
        for (int j = 0; j < 8; j++) _mm512_storeu_si512(tiles + 512 * r + 64 * j, b[j]);
    }
}

/* One run's 16 (scale, -offset) pairs from each row's codes c (dword lanes: s in byte 0, o in byte 1)
 * and its super-block's b (float16 D in the low half, M in the high half). */
static inline void block_params_store(__m512i c, __m512i b, float *scales, float *offsets) {
    const __m512 code_s = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(c, 24), 24));
    const __m512 code_o = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(c, 16), 24));
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(b));
    const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
    _mm512_storeu_ps(scales, _mm512_mul_ps(code_s, d));
    _mm512_storeu_ps(offsets, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(code_o, m)));
}

/* The (scale, -offset) pairs of 16 weight rows from n0 as row_params gives them (rows past N:
 * zero), as scales [runs][16] and offsets [runs][16]: per run, each row's int8 codes (s, o) and its
 * super-block's float16 (D, M) gathered across the 16 rows, scale = s * D and -offset = -(o * M)
 * (exact float32 products, as row_params). A row's codes are 2 bytes: the last run's are read as the
 * upper half of the dword before them, so no read passes the row's end. */
static void int4_block_params(int tiled, const void *params, const uint16_t *superblock_scales,
                              int64_t groups_per_superblock, int64_t n0, int64_t N, int64_t runs, float *scales,
                              float *offsets) {
    const int64_t superblocks = runs / groups_per_superblock;
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i code_rows = _mm512_mullo_epi32(lanes, _mm512_set1_epi32((int)(2 * runs)));
    const __m512i block_rows = _mm512_mullo_epi32(lanes, _mm512_set1_epi32((int)(4 * superblocks)));
    const __mmask16 present = N - n0 >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    const int8_t *codes = (const int8_t *)params + n0 * 2 * runs;
    const uint8_t *blocks = (const uint8_t *)(superblock_scales + n0 * 2 * superblocks);
    const __m512i zero = _mm512_setzero_si512();
    if (tiled) { /* mode 4: run r's 16 code pairs, then super-block's 16 (D, M) pairs, contiguous */
        for (int64_t r = 0; r < runs; r++) {
            const __m512i c = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(codes + 32 * r)));
            const __m512i b = _mm512_loadu_si512(blocks + 64 * (r / groups_per_superblock));
            block_params_store(c, b, scales + 16 * r, offsets + 16 * r);
        }
        return;
    }
    if (runs == 1) { /* K = 32: a row's codes are its only 2 bytes */
        for (int64_t i = 0; i < 16; i++) {
            float pair[2] = {0.0f, 0.0f};
            if (n0 + i < N) row_params(3, params, superblock_scales, groups_per_superblock, n0 + i, 1, pair);
            scales[i] = pair[0];
            offsets[i] = pair[1];
        }
        return;
    }
    for (int64_t r = 0; r < runs; r++) {
        const int last = r == runs - 1 && r > 0; /* read the dword ending at the row's last byte */
        __m512i c = _mm512_mask_i32gather_epi32(zero, present, code_rows, codes + 2 * r - 2 * last, 1);
        if (last) c = _mm512_srli_epi32(c, 16);
        const __m512i b = _mm512_mask_i32gather_epi32(zero, present, block_rows,
                                                      blocks + 4 * (r / groups_per_superblock), 1);
        block_params_store(c, b, scales + 16 * r, offsets + 16 * r);
    }
}

/* MB (at most 8) activation rows and one block of 16 outputs (its B rows, scales and offsets) into
 * out[0..MB): the file's arithmetic with vpdpbusd. Each run's B rows are loaded once (from tiles, or
 * where GATHER gathered straight from the weight: a call of a few rows, where storing them first
 * costs more than it saves) and feed the MB rows, whose dot products are independent chains.
 * Inlined with MB and GATHER known, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void vnni_int4_row_group(
    int GATHER, Int4BlockRows rows, const uint8_t *tiles, const float *scales, const float *offsets, const int8_t *hi,
    const uint8_t *lo, const float *xscale, const float *xsum, int MB, int64_t K, int64_t runs, float out[][16]) {
    __m512 acc[8], bias[8];
    for (int m = 0; m < MB; m++) acc[m] = bias[m] = _mm512_setzero_ps();
    for (int64_t r = 0; r < runs; r++) {
        __m512i b[8];
        if (GATHER)
            int4_b_run(rows, r, b);
        else
            for (int j = 0; j < 8; j++) b[j] = _mm512_loadu_si512(tiles + 512 * r + 64 * j);
        const __m512 ws = _mm512_loadu_ps(scales + 16 * r), wo = _mm512_loadu_ps(offsets + 16 * r);
        for (int m = 0; m < MB; m++) {
            const int32_t *h = (const int32_t *)(hi + m * K) + 8 * r, *l = (const int32_t *)(lo + m * K) + 8 * r;
            __m512i dot_hi = _mm512_setzero_si512(), dot_lo = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                dot_hi = _mm512_dpbusd_epi32(dot_hi, b[j], _mm512_set1_epi32(h[j]));
                dot_lo = _mm512_dpbusd_epi32(dot_lo, _mm512_set1_epi32(l[j]), b[j]);
            }
            const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dot_hi, 8), dot_lo);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, _mm512_set1_ps(xscale[m * runs + r])),
                                     acc[m]);
            bias[m] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xsum[m * runs + r]), bias[m]);
        }
    }
    for (int m = 0; m < MB; m++) _mm512_storeu_ps(out[m], _mm512_add_ps(acc[m], bias[m]));
}

/* mb (at most 16) activation rows and one block of 16 outputs into out[0..mb), 4 rows at a time,
 * from the block's B rows in tiles. */
static void vnni_int4_rows(const uint8_t *tiles, const float *scales, const float *offsets, const int8_t *hi,
                           const uint8_t *lo, const float *xscale, const float *xsum, int64_t mb, int64_t K,
                           int64_t runs, float out[16][16]) {
    const Int4BlockRows none = {0};
    int64_t m = 0;
#define VNNI_GROUP(MB)                                                                                      \
    vnni_int4_row_group(0, none, tiles, scales, offsets, hi + m * K, lo + m * K, xscale + m * runs, xsum + m * runs, \
                        MB, K, runs, out + m)
    for (; m + 4 <= mb; m += 4) VNNI_GROUP(4);
    switch (mb - m) {
        case 3: VNNI_GROUP(3); break;
        case 2: VNNI_GROUP(2); break;
        case 1: VNNI_GROUP(1); break;
        default: break;
    }
#undef VNNI_GROUP
}

/* A call of at most VNNI_GATHER_MAX_ROWS rows (a decode step): its mb rows and block b of 16 outputs,
 * B rows gathered straight from the weight, into y [mb, N]. */
#define VNNI_GATHER_MAX_ROWS 8
static __attribute__((noinline)) void vnni_int4_few_rows(Int4BlockRows rows, const float *scales,
                                                         const float *offsets, const int8_t *hi, const uint8_t *lo,
                                                         const float *xscale, const float *xsum, int64_t mb, int64_t K,
                                                         int64_t runs, float *y, int64_t N, int64_t b) {
    float out[16][16];
#define VNNI_GATHER(MB) vnni_int4_row_group(1, rows, NULL, scales, offsets, hi, lo, xscale, xsum, MB, K, runs, out)
    switch (mb) {
        case 8: VNNI_GATHER(8); break;
        case 7: VNNI_GATHER(7); break;
        case 6: VNNI_GATHER(6); break;
        case 5: VNNI_GATHER(5); break;
        case 4: VNNI_GATHER(4); break;
        case 3: VNNI_GATHER(3); break;
        case 2: VNNI_GATHER(2); break;
        default: VNNI_GATHER(1); break;
    }
#undef VNNI_GATHER
    store_block16(out, mb, y, N, b);
}
#else
#define TANDEM_HAVE_VNNI_INT4 0
#endif

#include "amx_cpu.c"

#if TANDEM_HAVE_VNNI_INT4
/* tandem_int4_mm's modes 3 and 4 (`tiled`: the tile order, N % 16 == 0) with this file's arithmetic: y [M, N]; xq, xscale, xsum as
 * round_activations gives them with group size 32. Blocks of 16 outputs split over the threads; a
 * block's B rows (but for a few rows' call) and parameters are built once and serve every row: 16-row blocks from
 * AMX_INT4_MIN_ROWS real rows on the tile unit where it runs, the others with vpdpbusd. Returns 0,
 * -1 when scratch cannot be allocated. */
static int gguf_blocks_mm(int tiled, const int16_t *xq, const float *xscale, const float *xsum,
                          const uint8_t *packed, const void *params, const uint16_t *superblock_scales,
                          int64_t groups_per_superblock, int64_t M, int64_t N, int64_t K, float *y, int num_threads) {
    const int64_t runs = K / 32, blocks = (N + 15) / 16;
    const int tiles_on = TANDEM_HAVE_AMX && M >= AMX_INT4_MIN_ROWS && amx_usable();
    const int64_t Mp = tiles_on ? (M + 15) / 16 * 16 : M; /* the tile unit reads whole 16-row blocks */
    /* 4-byte words a thread holds for its block of 16 outputs: B rows and params */
    const int64_t per_thread = 4 * K + 2 * 16 * runs;
    BlocksScratch scratch;
    if (blocks_scratch(xq, M, K, Mp, per_thread, num_threads, &scratch) != 0) return -1;
    const int8_t *hi = scratch.hi;
    const uint8_t *lo = scratch.lo;
    if (tiles_on) amx_tile_calls++;
#pragma omp parallel num_threads(num_threads)
    {
        if (tiles_on) amx_configure();
        float *own = scratch.words + omp_get_thread_num() * per_thread;
        const uint8_t *tiles = (const uint8_t *)own;
        float *scales = own + 4 * K, *offsets = scales + 16 * runs;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const Int4BlockRows rows = int4_block_rows(packed, 16 * b, N, K, tiled);
            int4_block_params(tiled, params, superblock_scales, groups_per_superblock, 16 * b, N, runs, scales,
                              offsets);
            if (M <= VNNI_GATHER_MAX_ROWS) {
                vnni_int4_few_rows(rows, scales, offsets, hi, lo, xscale, xsum, M, K, runs, y, N, b);
                continue;
            }
            int4_b_rows(rows, runs, (uint8_t *)own);
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                float out[16][16];
                const int64_t mb = M - m0 < 16 ? M - m0 : 16;
                if (tiles_on && mb >= AMX_INT4_MIN_ROWS)
                    amx_int4_block(tiles, scales, offsets, hi + m0 * K, lo + m0 * K, xscale + m0 * runs,
                                   xsum + m0 * runs, mb, K, runs, out);
                else
                    vnni_int4_rows(tiles, scales, offsets, hi + m0 * K, lo + m0 * K, xscale + m0 * runs,
                                   xsum + m0 * runs, mb, K, runs, out);
                store_block16(out, mb, y + m0 * N, N, b);
            }
        }
        if (tiles_on) amx_release();
    }
    blocks_scratch_free(&scratch);
    return 0;
}
#else
#include "blocks_avx2.c" /* the same arithmetic with AVX2 */
#endif

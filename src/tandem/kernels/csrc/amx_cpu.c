/* Intel AMX (tile matrix multiply, int8) paths of the native matmuls, for CPUs with AMX-INT8
 * (Sapphire Rapids and later). Included by vnni_cpu.c; compiled only where the build target has
 * AMX (-march=native on such a CPU), and used only when Linux grants this process the tile data
 * state (arch_prctl ARCH_REQ_XCOMP_PERM, inherited by forked children) and `tandem_set_amx` has
 * not turned it off.
 *
 * Exact integers from the tile unit: each run of 32 int16 activations (round_activations) is split
 * exactly into a signed high byte and an unsigned low byte (x = 256 * hi + lo); the tile unit
 * gives the integer dot products of both with the codes (exact int32), and 256 * hi_dot + lo_dot
 * is the run's exact integer dot product, the integer the vector kernels compute with vpmaddwd.
 * - Q8_0 (tandem_q8_mm): the float32 scaling after it is the vector kernel's, so an AMX call
 *   returns the vector kernel's bits and the choice between them may depend on the call's size.
 * - GGUF 4-bit blocks as stored (tandem_int4_mm mode 3): vnni_cpu.c's arithmetic, here for 16-row
 *   blocks from AMX_INT4_MIN_ROWS real rows (that file's vpdpbusd rows below: the same bits).
 * Either way a row's result never depends on the rows around it (batch invariance holds).
 *
 * Tiles (one configuration per thread, loaded inside each parallel region and released at its end),
 * for one block of 16 outputs at a time:
 *   tmm0, tmm1  C: 16 rows x 16 int32, the high and the low byte's dot products of an even run
 *   tmm2, tmm3  A: 16 activation rows x 32 bytes (one run; high bytes signed, low bytes unsigned)
 *   tmm4        B: 8 rows x 64 bytes, one run of 16 outputs' codes in the tile unit's 4-byte
 *               groups, B[j][4n + i] = code[n][4j + i]
 *   tmm6, tmm7  C of an odd run: the tile unit computes run r + 1 while run r's C tiles are stored
 *               and scaled (two blocks sharing the A tiles, with one C pair each, were slower:
 *               each run's stores then waited for the next run's products)
 *   tmm5        unused */

/* Fewest real rows of a 16-row block that go through the tile unit in a 4-bit call (fewer:
 * vnni_int4_rows). */
#define AMX_INT4_MIN_ROWS 12

static int64_t amx_tile_calls = 0; /* calls that put rows on the tile unit (tandem_amx_tile_calls) */

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && TANDEM_HAVE_VNNI_INT4
#define TANDEM_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define TANDEM_ARCH_REQ_XCOMP_PERM 0x1023
#define TANDEM_XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TandemTileConfig;

static int amx_state = -1; /* -1 not asked yet, 0 unavailable or turned off, 1 granted */

/* Whether the AMX paths may run in this process (asks Linux once). */
static int amx_usable(void) {
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, TANDEM_ARCH_REQ_XCOMP_PERM, TANDEM_XFEATURE_XTILEDATA) == 0;
    return amx_state;
}

/* The tiles' shapes (file comment). A constant object: a configuration built on the stack can lose
 * its stores to the optimiser, which does not see ldtilecfg read them. */
static const TandemTileConfig amx_config = {
    .palette_id = 1,
    .colsb = {64, 64, 32, 32, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 8, 8, 16, 16},
};

static void amx_configure(void) { _tile_loadconfig(&amx_config); }
static void amx_release(void) { _tile_release(); }

/* B tiles of every run of one block of 16 outputs (tandem_q8_mm's output-interleaved codes) into
 * tiles [runs][8][64]: row j of run r from pairs 16r + 2j and 16r + 2j + 1 (64 contiguous bytes:
 * the 16 outputs' 2-byte pairs, twice), output n's words n and 16 + n side by side. */
static void amx_q8_b_tiles(const int8_t *wb, int64_t runs, int8_t *tiles) {
    const __m512i spread = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                            22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t i = 0; i < 8 * runs; i++)
        _mm512_storeu_si512(tiles + 64 * i, _mm512_permutexvar_epi16(spread, _mm512_loadu_si512(wb + 64 * i)));
}

/* The high and low bytes' products of A (tmm2 / tmm3) with B (tmm4) into the C pair (C_HI, C_LO),
 * zeroed first. Tile numbers are immediates: a macro, so each pair is written once. */
#define AMX_RUN_PRODUCTS(SIGNED_CODES, C_HI, C_LO) \
    do {                                          \
        _tile_zero(C_HI);                         \
        _tile_zero(C_LO);                         \
        if (SIGNED_CODES) {                       \
            _tile_dpbssd(C_HI, 2, 4);             \
            _tile_dpbusd(C_LO, 3, 4);             \
        } else {                                  \
            _tile_dpbsud(C_HI, 2, 4);             \
            _tile_dpbuud(C_LO, 3, 4);             \
        }                                         \
    } while (0)

/* Run r of 16 activation rows and one block of 16 outputs: the high and low bytes' dot products
 * with the block's B tiles, into tmm0 / tmm1 (r even) or tmm6 / tmm7 (r odd), so that the tile unit
 * works on run r + 1 while run r's are stored and scaled. signed_codes: Q8_0's codes are signed
 * (TDPBSSD / TDPBUSD), GGUF 4-bit codes unsigned (TDPBSUD / TDPBUUD). */
static inline void amx_issue_run(int signed_codes, int odd, const int8_t *tiles, const int8_t *hi,
                                 const uint8_t *lo, int64_t K, int64_t r) {
    _tile_loadd(2, hi + 32 * r, K);
    _tile_loadd(3, lo + 32 * r, K);
    _tile_loadd(4, tiles + 512 * r, 64);
    if (odd)
        AMX_RUN_PRODUCTS(signed_codes, 6, 7);
    else
        AMX_RUN_PRODUCTS(signed_codes, 0, 1);
}

/* amx_issue_run's dot products of run r into d[0] (high) and d[1] (low): run r + 1's are issued
 * first. */
static inline void amx_store_run(int odd, int32_t d[2][16][16]) {
    if (odd) {
        _tile_stored(6, d[0], 64);
        _tile_stored(7, d[1], 64);
    } else {
        _tile_stored(0, d[0], 64);
        _tile_stored(1, d[1], 64);
    }
}

/* 16 activation rows from m0 (mb of them real) and one block of 16 outputs, every run in order,
 * with tandem_q8_mm's arithmetic: acc = fma((float)d_r, ws * xs, acc), d_r = 256 * hi + lo dot.
 * Inlined twice: with mb = 16 known, the accumulators stay in registers. */
static inline __attribute__((always_inline)) void amx_q8_block_rows(const int8_t *tiles, const float *sb,
                                                                    const int8_t *hi, const uint8_t *lo,
                                                                    const float *xscale, int64_t mb, int64_t K,
                                                                    int64_t runs, float out[16][16]) {
    __m512 acc[16];
    for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
    int32_t d[2][16][16];
    amx_issue_run(1, 0, tiles, hi, lo, K, 0);
    for (int64_t r = 0; r < runs; r++) {
        if (r + 1 < runs) amx_issue_run(1, (int)((r + 1) & 1), tiles, hi, lo, K, r + 1);
        amx_store_run((int)(r & 1), d);
        const __m512 ws = _mm512_loadu_ps(sb + 16 * r);
        for (int64_t m = 0; m < mb; m++) {
            const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(d[0][m]), 8),
                                                 _mm512_loadu_si512(d[1][m]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_mul_ps(ws, _mm512_set1_ps(xscale[m * runs + r])), acc[m]);
        }
    }
    for (int64_t m = 0; m < mb; m++) _mm512_storeu_ps(out[m], acc[m]);
}

static void amx_q8_block(const int8_t *tiles, const float *sb, const int8_t *hi, const uint8_t *lo,
                         const float *xscale, int64_t mb, int64_t K, int64_t runs, float out[16][16]) {
    if (mb == 16) amx_q8_block_rows(tiles, sb, hi, lo, xscale, 16, K, runs, out);
    else amx_q8_block_rows(tiles, sb, hi, lo, xscale, mb, K, runs, out);
}

/* How many of a call's M rows go through the tile unit (the first ones; the rest through the
 * vector kernel, whose bits are the same): whole 16-row blocks, and a last partial block from
 * AMX_Q8_MIN_ROWS rows (below, the vector kernel's one pass of up to 8 rows costs less than a padded
 * tile), or from one row behind whole blocks where the weight is larger than AMX_Q8_ONE_PASS_BYTES
 * (the vector kernel's pass would read it from memory a second time). Measured on Gemma 3's shapes,
 * docs/performance.md. */
#define AMX_Q8_MIN_ROWS 10
#define AMX_Q8_ONE_PASS_BYTES ((int64_t)4 << 20)
static int64_t amx_q8_tiled_rows(int64_t M, int64_t N, int64_t K) {
    const int64_t rest = M % 16, min_rest = M > 16 && N * K > AMX_Q8_ONE_PASS_BYTES ? 1 : AMX_Q8_MIN_ROWS;
    return rest >= min_rest ? M : M - rest;
}

/* tandem_q8_mm's AMX path (same inputs and result); xq, xscale as round_activations gives them.
 * Returns 0, -1 when scratch cannot be allocated. */
static int amx_q8_mm(const int16_t *xq, const float *xscale, const int8_t *codes_il, const float *scales_il,
                     int64_t M, int64_t N, int64_t K, float *y, int num_threads) {
    const int64_t runs = K / 32, blocks = (N + 15) / 16, Mp = (M + 15) / 16 * 16;
    BlocksScratch scratch; /* per thread: one block's B tiles, K * 16 bytes */
    if (blocks_scratch(xq, M, K, Mp, 4 * K, num_threads, &scratch) != 0) return -1;
    const int8_t *hi = scratch.hi;
    const uint8_t *lo = scratch.lo;
    amx_tile_calls++;
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure();
        int8_t *own = (int8_t *)(scratch.words + omp_get_thread_num() * 4 * K);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            amx_q8_b_tiles(codes_il + b * K * 16, runs, own);
            for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
                float out[16][16];
                const int64_t mb = M - m0 < 16 ? M - m0 : 16;
                amx_q8_block(own, scales_il + b * runs * 16, hi + m0 * K, lo + m0 * K, xscale + m0 * runs, mb, K,
                             runs, out);
                store_block16(out, mb, y + m0 * N, N, b);
            }
        }
        amx_release();
    }
    blocks_scratch_free(&scratch);
    return 0;
}
/* -- GGUF 4-bit blocks as stored (tandem_int4_mm mode 3): vnni_cpu.c's arithmetic on the tiles -- */

/* 16 activation rows (mb real) and one block of 16 outputs (its B tiles, scales [runs][16] and
 * offsets [runs][16]): vnni_cpu.c's arithmetic, the bias first (no tile work), then the dot products.
 * Inlined twice: with mb = 16 known, the accumulators stay in registers. */
static inline __attribute__((always_inline)) void amx_int4_block_rows(
    const uint8_t *tiles, const float *scales, const float *offsets, const int8_t *hi, const uint8_t *lo,
    const float *xscale, const float *xsum, int64_t mb, int64_t K, int64_t runs, float out[16][16]) {
    __m512 acc[16];
    for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t r = 0; r < runs; r++) {
        const __m512 wo = _mm512_loadu_ps(offsets + 16 * r);
        for (int64_t m = 0; m < mb; m++) acc[m] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xsum[m * runs + r]), acc[m]);
    }
    for (int64_t m = 0; m < mb; m++) _mm512_storeu_ps(out[m], acc[m]);
    for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
    int32_t d[2][16][16];
    amx_issue_run(0, 0, (const int8_t *)tiles, hi, lo, K, 0);
    for (int64_t r = 0; r < runs; r++) {
        if (r + 1 < runs) amx_issue_run(0, (int)((r + 1) & 1), (const int8_t *)tiles, hi, lo, K, r + 1);
        amx_store_run((int)(r & 1), d);
        const __m512 ws = _mm512_loadu_ps(scales + 16 * r);
        for (int64_t m = 0; m < mb; m++) {
            const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(d[0][m]), 8),
                                                 _mm512_loadu_si512(d[1][m]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_mul_ps(ws, _mm512_set1_ps(xscale[m * runs + r])), acc[m]);
        }
    }
    for (int64_t m = 0; m < mb; m++) _mm512_storeu_ps(out[m], _mm512_add_ps(acc[m], _mm512_loadu_ps(out[m])));
}

static void amx_int4_block(const uint8_t *tiles, const float *scales, const float *offsets, const int8_t *hi,
                           const uint8_t *lo, const float *xscale, const float *xsum, int64_t mb, int64_t K,
                           int64_t runs, float out[16][16]) {
    if (mb == 16) amx_int4_block_rows(tiles, scales, offsets, hi, lo, xscale, xsum, 16, K, runs, out);
    else amx_int4_block_rows(tiles, scales, offsets, hi, lo, xscale, xsum, mb, K, runs, out);
}

#else
#define TANDEM_HAVE_AMX 0
static int amx_usable(void) { return 0; }
static int amx_state = 0;
/* Never called where amx_usable() is 0: declared so that every build sees the same calls. */
static int64_t amx_q8_tiled_rows(int64_t M, int64_t N, int64_t K) {
    (void)M, (void)N, (void)K;
    return 0;
}
static int amx_q8_mm(const int16_t *xq, const float *xscale, const int8_t *codes_il, const float *scales_il,
                     int64_t M, int64_t N, int64_t K, float *y, int num_threads) {
    (void)xq, (void)xscale, (void)codes_il, (void)scales_il, (void)M, (void)N, (void)K, (void)y, (void)num_threads;
    return -2;
}
#if TANDEM_HAVE_VNNI_INT4 /* gguf_blocks_mm calls these only where amx_usable() */
static void amx_configure(void) {}
static void amx_release(void) {}
static void amx_int4_block(const uint8_t *tiles, const float *scales, const float *offsets, const int8_t *hi,
                           const uint8_t *lo, const float *xscale, const float *xsum, int64_t mb, int64_t K,
                           int64_t runs, float out[16][16]) {
    (void)tiles, (void)scales, (void)offsets, (void)hi, (void)lo, (void)xscale, (void)xsum, (void)mb, (void)K;
    (void)runs, (void)out;
}
#endif
#endif

/* Turn the AMX paths off (0) or back on where the CPU and Linux allow them (1); returns whether
 * they are used now. For tests that compare them with the vector kernels, and TANDEM_NATIVE_AMX=0. */
int tandem_set_amx(int enabled) {
    if (!TANDEM_HAVE_AMX) return 0;
    if (!enabled) {
        amx_state = 0;
        return 0;
    }
    amx_state = -1;
    return amx_usable();
}

/* How many calls have put rows on the tile unit in this process (tests: that the AMX path ran). */
int64_t tandem_amx_tile_calls(void) { return amx_tile_calls; }

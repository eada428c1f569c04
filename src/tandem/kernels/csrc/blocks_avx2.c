/* GGUF 4-bit blocks as stored (tandem_int4_mm mode 3) on CPUs without AVX512-VNNI (AVX2, FMA):
 * vnni_cpu.c's arithmetic, the same integers and the same float32 steps per (row, output), so the
 * same bits as an AVX512-VNNI or AMX machine. Included by vnni_cpu.c where the build lacks
 * AVX512-VNNI.
 *
 * The B rows are vnni_cpu.c's (B row j of run r: each of 16 outputs' 4 codes of k = 4j..4j+3),
 * read as two halves of 8 outputs. vpmaddubsw of a half with 4 broadcast high bytes (codes
 * unsigned, bytes signed) and of 4 broadcast low bytes with it (bytes unsigned, codes 0..15 as
 * signed) give 16-bit sums of two products, at most 2 * 15 * 128 = 3,840 and 2 * 255 * 15 = 7,650
 * in size: 8 of the first and 4 of the second add up in int16 without overflow (vpmaddubsw's
 * saturation never engages), and vpmaddwd with ones widens each output's 4 to int32. So
 * hi_dot and lo_dot, and d_r = 256 * hi_dot + lo_dot, are exact, the integers the tile unit gives. */

/* Every run's B rows of the 16 weight rows from n0 (rows past N: zero codes), [runs][8][64]: per run
 * and 4 rows, their 4 dwords transposed so that dword j of the 4 rows sits side by side (its low
 * nibbles are B row j's 16 bytes for those rows, its high nibbles B row j + 4's). */
static void avx2_int4_b_rows(const uint8_t *packed, int64_t n0, int64_t N, int64_t K, int64_t runs, uint8_t *tiles) {
    const int64_t row_bytes = K / 2;
    const __m128i nibble = _mm_set1_epi8(0x0F);
    for (int64_t q = 0; q < 4; q++) {
        const uint8_t *rows[4];
        for (int i = 0; i < 4; i++) rows[i] = n0 + 4 * q + i < N ? packed + (n0 + 4 * q + i) * row_bytes : NULL;
        for (int64_t r = 0; r < runs; r++) {
            __m128i a[4];
            for (int i = 0; i < 4; i++)
                a[i] = rows[i] ? _mm_loadu_si128((const __m128i *)(rows[i] + 16 * r)) : _mm_setzero_si128();
            const __m128i t0 = _mm_unpacklo_epi32(a[0], a[1]), t1 = _mm_unpacklo_epi32(a[2], a[3]);
            const __m128i t2 = _mm_unpackhi_epi32(a[0], a[1]), t3 = _mm_unpackhi_epi32(a[2], a[3]);
            const __m128i c[4] = {_mm_unpacklo_epi64(t0, t1), _mm_unpackhi_epi64(t0, t1), _mm_unpacklo_epi64(t2, t3),
                                  _mm_unpackhi_epi64(t2, t3)};
            uint8_t *tile = tiles + 512 * r + 16 * q;
            for (int j = 0; j < 4; j++) {
                _mm_storeu_si128((__m128i *)(tile + 64 * j), _mm_and_si128(c[j], nibble));
                _mm_storeu_si128((__m128i *)(tile + 64 * (j + 4)), _mm_and_si128(_mm_srli_epi32(c[j], 4), nibble));
            }
        }
    }
}

/* 8 float16 values in the low (upper = 0) or high (upper = 1) halves of v's dwords, as float32. */
static inline __m256 avx2_halves_to_float(__m256i v, int upper) {
    const __m256i bits = upper ? _mm256_srli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

/* The (scale, -offset) pairs of the 16 weight rows from n0 as row_params gives them (rows past N:
 * zero), as scales [runs][16] and offsets [runs][16]: per run and 8 rows, their int8 codes (s, o)
 * and their super-blocks' float16 (D, M) gathered, scale = s * D and -offset = -(o * M) (exact
 * float32 products, as row_params). The last run's codes are read as the upper half of the dword
 * before them (K = 32: a row's 2 bytes with row_params), so no read passes a row's end. */
static void avx2_int4_block_params(const void *params, const uint16_t *superblock_scales,
                                   int64_t groups_per_superblock, int64_t n0, int64_t N, int64_t runs,
                                   float *scales, float *offsets) {
    if (runs == 1) { /* K = 32: a row's codes are its only 2 bytes */
        for (int64_t n = 0; n < 16; n++) {
            float pairs[2] = {0.0f, 0.0f};
            if (n0 + n < N) row_params(3, params, superblock_scales, groups_per_superblock, n0 + n, 1, pairs);
            scales[n] = n0 + n < N ? pairs[0] : 0.0f;
            offsets[n] = n0 + n < N ? pairs[1] : 0.0f;
        }
        return;
    }
    const int64_t superblocks = runs / groups_per_superblock;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i code_rows = _mm256_mullo_epi32(lanes, _mm256_set1_epi32((int)(2 * runs)));
    const __m256i block_rows = _mm256_mullo_epi32(lanes, _mm256_set1_epi32((int)(4 * superblocks)));
    for (int64_t half = 0; half < 2; half++) {
        const int64_t first = n0 + 8 * half, present = N - first < 8 ? (N - first > 0 ? N - first : 0) : 8;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)present), lanes);
        const int8_t *codes = (const int8_t *)params + first * 2 * runs;
        const uint8_t *blocks = (const uint8_t *)(superblock_scales + first * 2 * superblocks);
        for (int64_t r = 0; r < runs; r++) {
            const int last = r == runs - 1;
            __m256i c = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)(codes + 2 * r - 2 * last),
                                                    code_rows, mask, 1);
            if (last) c = _mm256_srli_epi32(c, 16);
            const __m256i blk = _mm256_mask_i32gather_epi32(
                _mm256_setzero_si256(), (const int *)(blocks + 4 * (r / groups_per_superblock)), block_rows, mask, 1);
            const __m256 code_s = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(c, 24), 24));
            const __m256 code_o = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(c, 16), 24));
            _mm256_storeu_ps(scales + 16 * r + 8 * half, _mm256_mul_ps(code_s, avx2_halves_to_float(blk, 0)));
            _mm256_storeu_ps(offsets + 16 * r + 8 * half,
                             _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(code_o, avx2_halves_to_float(blk, 1))));
        }
    }
}

/* One run of one activation row (its 8 high-byte and 8 low-byte dwords h, l) and half `half` of
 * the block's 16 outputs: the exact integer dot products d_r of the 8 outputs. */
static inline __m256i avx2_int4_run_dot(const uint8_t *tiles_run, int half, const int32_t *h, const int32_t *l) {
    __m256i sum_hi = _mm256_setzero_si256(), sum_lo0 = _mm256_setzero_si256(), sum_lo1 = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(tiles_run + 64 * j + 32 * half));
        sum_hi = _mm256_add_epi16(sum_hi, _mm256_maddubs_epi16(b, _mm256_set1_epi32(h[j])));
        const __m256i lo_part = _mm256_maddubs_epi16(_mm256_set1_epi32(l[j]), b);
        if (j < 4)
            sum_lo0 = _mm256_add_epi16(sum_lo0, lo_part);
        else
            sum_lo1 = _mm256_add_epi16(sum_lo1, lo_part);
    }
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i dot_hi = _mm256_madd_epi16(sum_hi, ones);
    const __m256i dot_lo = _mm256_add_epi32(_mm256_madd_epi16(sum_lo0, ones), _mm256_madd_epi16(sum_lo1, ones));
    return _mm256_add_epi32(_mm256_slli_epi32(dot_hi, 8), dot_lo);
}

/* mb activation rows and one block of 16 outputs into out[0..mb): vnni_cpu.c's float32 steps, per
 * lane (output) the same operations in the same order, 8 lanes at a time. */
static void avx2_int4_rows(const uint8_t *tiles, const float *scales, const float *offsets, const int8_t *hi,
                           const uint8_t *lo, const float *xscale, const float *xsum, int64_t mb, int64_t K,
                           int64_t runs, float out[16][16]) {
    for (int64_t m = 0; m < mb; m++) {
        for (int half = 0; half < 2; half++) {
            __m256 acc = _mm256_setzero_ps(), bias = _mm256_setzero_ps();
            for (int64_t r = 0; r < runs; r++) {
                const int32_t *h = (const int32_t *)(hi + m * K) + 8 * r, *l = (const int32_t *)(lo + m * K) + 8 * r;
                const __m256i dot = avx2_int4_run_dot(tiles + 512 * r, half, h, l);
                const __m256 ws = _mm256_loadu_ps(scales + 16 * r + 8 * half);
                const __m256 wo = _mm256_loadu_ps(offsets + 16 * r + 8 * half);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, _mm256_set1_ps(xscale[m * runs + r])),
                                      acc);
                bias = _mm256_fmadd_ps(wo, _mm256_set1_ps(xsum[m * runs + r]), bias);
            }
            _mm256_storeu_ps(out[m] + 8 * half, _mm256_add_ps(acc, bias));
        }
    }
}

/* tandem_int4_mm's mode 3 on AVX2: y [M, N] (vnni_cpu.c's arithmetic); xq, xscale, xsum as
 * round_activations gives them with group size 32. Returns 0, -1 when scratch cannot be allocated.
 * `tiled` is always 0 here: tandem_int4_mm refuses mode 4 in a build without AVX512-VNNI. */
static int gguf_blocks_mm(int tiled, const int16_t *xq, const float *xscale, const float *xsum,
                          const uint8_t *packed, const void *params, const uint16_t *superblock_scales,
                          int64_t groups_per_superblock, int64_t M, int64_t N, int64_t K, float *y, int num_threads) {
    (void)tiled;
    const int64_t runs = K / 32, blocks = (N + 15) / 16;
    /* 4-byte words a thread holds for its block of 16 outputs: B rows and params */
    const int64_t per_thread = 4 * K + 2 * 16 * runs;
    BlocksScratch scratch;
    if (blocks_scratch(xq, M, K, M, per_thread, num_threads, &scratch) != 0) return -1;
    const int8_t *hi = scratch.hi;
    const uint8_t *lo = scratch.lo;
#pragma omp parallel num_threads(num_threads)
    {
        float *own = scratch.words + omp_get_thread_num() * per_thread;
        uint8_t *tiles = (uint8_t *)own;
        float *scales = own + 4 * K, *offsets = scales + 16 * runs;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            avx2_int4_b_rows(packed, 16 * b, N, K, runs, tiles);
            avx2_int4_block_params(params, superblock_scales, groups_per_superblock, 16 * b, N, runs, scales, offsets);
            const int64_t width = N - 16 * b < 16 ? N - 16 * b : 16;
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                float out[16][16];
                const int64_t mb = M - m0 < 16 ? M - m0 : 16;
                avx2_int4_rows(tiles, scales, offsets, hi + m0 * K, lo + m0 * K, xscale + m0 * runs, xsum + m0 * runs,
                               mb, K, runs, out);
                for (int64_t m = 0; m < mb; m++) memcpy(y + (m0 + m) * N + 16 * b, out[m], sizeof(float) * width);
            }
        }
    }
    blocks_scratch_free(&scratch);
    return 0;
}

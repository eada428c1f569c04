/* The sampler's passes over a step's logits [rows, vocabulary] (tandem/kernels/sampling.py), on
 * every thread: torch reads them on one (at a 262k-token vocabulary and 32 rows, its argmax was
 * about an eighth of a decode step). Included by decoder_cpu.c.
 *
 * tandem_argmax_rows, torch.argmax(dim=-1)'s contract: each row's answer is the first index of its
 * largest value, or of its first NaN where it has one (NaN counts as the largest); a row of -inf
 * answers 0.
 * tandem_finite_rows: whether each row's float32 sum is finite (false where the row holds a NaN or
 * an infinity, or its sum overflows), as torch.isfinite(x.sum(dim=-1)) answers up to the order of
 * the sum. */
#include <math.h>

/* Smallest span a thread takes within one row (fewer rows than threads) */
#define ARGMAX_MIN_SPAN 16384

typedef struct {
    float value;
    int64_t index;
} TandemArgmax;

/* The answer for x[begin..end) (end - begin < 2^31): the first index of the largest value, or of
 * the first NaN. */
static TandemArgmax argmax_span(const float *x, int64_t begin, int64_t end) {
    TandemArgmax best = {-INFINITY, begin};
    int64_t i = begin;
    if (end - begin >= 16) {
        /* per lane: its largest value so far and where it first met it (strict >: first occurrence) */
        __m256 max0 = _mm256_set1_ps(-INFINITY), max1 = max0;
        __m256i at0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at1 = _mm256_add_epi32(at0, _mm256_set1_epi32(8));
        __m256i here0 = at0, here1 = at1;
        const __m256i step = _mm256_set1_epi32(16);
        __m256 unordered = _mm256_setzero_ps();
        for (; i + 16 <= end; i += 16) {
            const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
            const __m256 up0 = _mm256_cmp_ps(v0, max0, _CMP_GT_OQ), up1 = _mm256_cmp_ps(v1, max1, _CMP_GT_OQ);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
            max0 = _mm256_blendv_ps(max0, v0, up0);
            max1 = _mm256_blendv_ps(max1, v1, up1);
            at0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at0), _mm256_castsi256_ps(here0), up0));
            at1 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at1), _mm256_castsi256_ps(here1), up1));
            here0 = _mm256_add_epi32(here0, step);
            here1 = _mm256_add_epi32(here1, step);
        }
        if (_mm256_movemask_ps(unordered)) { /* a NaN in the vector part: the first one answers */
            for (int64_t j = begin; j < i; j++)
                if (isnan(x[j])) return (TandemArgmax){x[j], j};
        }
        float values[16];
        int32_t where[16];
        _mm256_storeu_ps(values, max0);
        _mm256_storeu_ps(values + 8, max1);
        _mm256_storeu_si256((__m256i *)where, at0);
        _mm256_storeu_si256((__m256i *)(where + 8), at1);
        for (int lane = 0; lane < 16; lane++) {
            const int64_t index = begin + where[lane];
            if (values[lane] > best.value || (values[lane] == best.value && index < best.index))
                best = (TandemArgmax){values[lane], index};
        }
    }
    for (; i < end; i++) {
        if (isnan(x[i])) return (TandemArgmax){x[i], i};
        if (x[i] > best.value) best = (TandemArgmax){x[i], i};
    }
    return best;
}

/* x [M, N] float32 (row stride N) -> out [M] int64, the contract above. Returns 0, -1 when scratch
 * cannot be allocated. */
int tandem_argmax_rows(const float *x, int64_t M, int64_t N, int64_t *out, int num_threads) {
    int64_t spans = 1; /* per row */
    if (M < num_threads && N >= 2 * ARGMAX_MIN_SPAN) {
        spans = (num_threads + M - 1) / M;
        if (spans > N / ARGMAX_MIN_SPAN) spans = N / ARGMAX_MIN_SPAN;
    }
    const int64_t span = (N + spans - 1) / spans;
    TandemArgmax *parts = malloc((size_t)(M * spans) * sizeof(TandemArgmax));
    if (!parts) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * N >= 2 * ARGMAX_MIN_SPAN)
    for (int64_t p = 0; p < M * spans; p++) {
        const int64_t row = p / spans, begin = (p % spans) * span;
        const int64_t end = begin + span < N ? begin + span : N;
        TandemArgmax part = argmax_span(x + row * N, begin, end);
        parts[p] = part;
    }
    for (int64_t row = 0; row < M; row++) {
        TandemArgmax best = parts[row * spans];
        for (int64_t s = 1; s < spans && !isnan(best.value); s++) {
            const TandemArgmax part = parts[row * spans + s];
            if (isnan(part.value) || part.value > best.value) best = part;
        }
        out[row] = best.index;
    }
    free(parts);
    return 0;
}

/* x [M, N] float32 -> finite [M] (1 or 0), the contract above: 16 partial sums per row, then their
 * total (a NaN or an infinity propagates; a partial sum that overflows counts as an overflow
 * whatever the rest: logits that large are broken in any order). */
void tandem_finite_rows(const float *x, int64_t M, int64_t N, uint8_t *finite, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * N >= 2 * ARGMAX_MIN_SPAN)
    for (int64_t row = 0; row < M; row++) {
        const float *r = x + row * N;
        __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= N; i += 16) {
            sum0 = _mm256_add_ps(sum0, _mm256_loadu_ps(r + i));
            sum1 = _mm256_add_ps(sum1, _mm256_loadu_ps(r + i + 8));
        }
        float parts[16], total = 0.0f;
        _mm256_storeu_ps(parts, sum0);
        _mm256_storeu_ps(parts + 8, sum1);
        int ok = 1;
        for (int lane = 0; lane < 16; lane++) ok &= isfinite(parts[lane]) != 0, total += parts[lane];
        for (; i < N; i++) total += r[i];
        finite[row] = (uint8_t)(ok && isfinite(total));
    }
}

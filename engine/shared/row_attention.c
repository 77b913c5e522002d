/* Causal attention of query rows over their own slot's keys and values, fp32, for CPUs with AVX2
 * and FMA (card.engine.shared.row_attention).
 *
 * Why: on the CPU the exact attention through torch (card.engine.shared.exact_attention) is ~20
 * small ops a layer whose fixed costs, not their arithmetic, made up ~20% of a lone session's
 * decoding step (a query tile of four rows for one, a softmax over a padded span, index copies
 * in and out). Here one call attends every exact row of a forward, decoding, verifying and
 * prefilling alike.
 *
 * Exactness: one thread computes one (row, head) pair from start to end, in an order fixed by
 * the row's own position alone: the scores key by key (each an in-order chain of FMAs over the
 * head's 8-float chunks, then one fixed tree over the 8 lanes), their maximum, exp(score - max)
 * in key order with the sum kept in 8 lanes by key index and one fixed tree at the end, and each
 * output feature one in-order chain of FMAs over the keys, divided by the sum. No other row,
 * session, row count, chunking or thread count enters a row's arithmetic, so a verified chain's
 * rows are the bits of the same rows decoded one by one, and a prompt's rows the bits of decoding
 * rows (what the prefix cache needs).
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <omp.h>

#define CHUNK 64 /* output features a pass over the values keeps in registers (8 vectors) */

/* exp of 8 floats: Cephes' expf (as avx_mathfun's exp256_ps), ~1 ulp; the same code for every
 * lane and call, so deterministic */
static inline __m256 exp8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, one);
    __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}

/* lane i of the result: the sum of a[i]'s eight lanes, by the same tree for every i */
static inline __m256 sum8x8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float sum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float max8(__m256 a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* lanes [0, valid) all ones */
static inline __m256 first_lanes(long valid) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), idx));
}

/* one (row, head): q [dim] over keys/values [n, dim] (n = the row's position + 1); s: n rounded
 * up to 8 floats of scratch; writes o [dim] */
static void attend_one(const float *q, const float *k, const float *v, long n, long dim, float scale,
                       float *s, float *o) {
    const long groups = (n + 7) / 8, chunks = dim / 8;
    const __m256 vscale = _mm256_set1_ps(scale);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (long g = 0; g < groups; g++) {
        /* keys past n (up to the group's end, inside the slot) are read and their scores
         * dropped: a lane of sum8x8 holds one key's sum only */
        const float *kg = k + g * 8 * dim;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (long c = 0; c < chunks; c++) {
            const __m256 qc = _mm256_loadu_ps(q + c * 8);
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kg + i * dim + c * 8), acc[i]);
        }
        __m256 dots = _mm256_mul_ps(sum8x8(acc), vscale);
        if (g == groups - 1 && n % 8)
            dots = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), dots, first_lanes(n - g * 8));
        _mm256_storeu_ps(s + g * 8, dots);
        vmax = _mm256_max_ps(vmax, dots);
    }
    const __m256 m = _mm256_set1_ps(max8(vmax));
    __m256 lsum = _mm256_setzero_ps();
    for (long g = 0; g < groups; g++) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + g * 8), m));
        if (g == groups - 1 && n % 8) e = _mm256_and_ps(e, first_lanes(n - g * 8));
        _mm256_storeu_ps(s + g * 8, e);
        lsum = _mm256_add_ps(lsum, e);
    }
    const __m256 l = _mm256_set1_ps(sum8(lsum));
    for (long c0 = 0; c0 < dim; c0 += CHUNK) {
        const int w = (int)((dim - c0 < CHUNK ? dim - c0 : CHUNK) / 8);
        __m256 acc[CHUNK / 8];
        for (int i = 0; i < w; i++) acc[i] = _mm256_setzero_ps();
        for (long j = 0; j < n; j++) {
            const __m256 p = _mm256_broadcast_ss(s + j);
            const float *vj = v + j * dim + c0;
            for (int i = 0; i < w; i++) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + i * 8), acc[i]);
        }
        for (int i = 0; i < w; i++) _mm256_storeu_ps(o + c0 + i * 8, _mm256_div_ps(acc[i], l));
    }
}

/* Row r (of ``rows``) is query row ``index[r]`` at ``q + index[r] * q_row + h * q_head`` for head h;
 * it attends keys/values 0 .. last[r] of slot ``slots[r]`` (kv head h / (heads / kv_heads), rows of
 * dim floats at ``keys + slot * slot_stride + kvh * head_stride``), and writes ``out + index[r] *
 * heads * dim + h * dim``. ``scratch``: ``threads`` x ``width`` floats, width >= every last + 8. */
void card_row_attention(const float *q, long q_row, long q_head, const float *keys, const float *values,
                        long slot_stride, long head_stride, const long *index, const long *slots,
                        const long *last, long rows, long heads, long kv_heads, long dim, float scale,
                        float *out, float *scratch, long width, int threads) {
    const long pairs = rows * heads, group = heads / kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && pairs > 1)
    for (long p = 0; p < pairs; p++) {
        const long r = p / heads, h = p % heads, t = index[r];
        const long base = slots[r] * slot_stride + (h / group) * head_stride;
        float *s = scratch + (long)omp_get_thread_num() * width;
        attend_one(q + t * q_row + h * q_head, keys + base, values + base, last[r] + 1, dim, scale, s,
                   out + (t * heads + h) * dim);
    }
}

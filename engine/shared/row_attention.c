/* Causal attention of query rows over their own slot's keys and values (fp32, bf16 or fp16 rows,
 * computed in fp32), for CPUs with AVX2, FMA and F16C (card.engine.shared.row_attention).
 *
 * Why: on the CPU the exact attention through torch (card.engine.shared.exact_attention) is ~20
 * small ops a layer whose fixed costs, not their arithmetic, made up ~20% of a lone session's
 * decoding step (a query tile of four rows for one, a softmax over a padded span, index copies
 * in and out). Here one call attends every exact row of a forward, decoding, verifying and
 * prefilling alike.
 *
 * Exactness: one thread computes one (row, head) pair from start to end, in an order fixed by
 * the row's own position alone: the scores key by key (each an in-order chain of FMAs over the
 * head's 8-float chunks, then one fixed tree over the 8 lanes: neighbours, pairs, halves), their maximum, exp(score - max)
 * in key order with the sum kept in 8 lanes by key index and one fixed tree at the end, and each
 * output feature one in-order chain of FMAs over the keys, divided by the sum. No other row,
 * session, row count, chunking or thread count enters a row's arithmetic, so a verified chain's
 * rows are the bits of the same rows decoded one by one, and a prompt's rows the bits of decoding
 * rows (what the prefix cache needs).
 *
 * Two neighbouring rows of one prompt (causal, one slot, positions p and p + 1) go through one work
 * item (attend_pair): each key and value is loaded once for both rows' heads, half the traffic of
 * a long prompt's keys, while every (row, head) keeps the chain above: the pair's scores take two
 * keys at a time through the same lane tree (sum4x8 of the two keys twice), a row sums and weights
 * only its own keys, and each output feature's chain over the keys is in order. So pairing, like
 * grouping heads, is a matter of speed only (the probe and tests/engine/test_row_attention.py
 * compare paired rows with the same rows alone).
 *
 * A draft's tree rows (a mask of the keys each sees: the committed prefix, its ancestors, itself)
 * go through the same code for speed: a key a row does not see scores -inf and its value is
 * skipped. The mask decides which keys enter a row, never the order, so a causal row is unchanged.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <omp.h>

#define AHEAD 32 /* key and value rows prefetched ahead of the one read (a layer's come cold from memory) */
#define CHUNK 32 /* output features a pass over the values keeps in registers (4 vectors a head) */

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

/* lane i of the result: the sum of a[i]'s eight lanes, by the same tree for every i (pairs of
 * neighbours, then pairs of pairs, then the two halves) */
static inline __m128 sum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

static inline float sum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float max4(__m128 s) {
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* lane i all ones where seen[i] (i < valid; the bytes past valid are not read) */
static inline __m128 visible4(const unsigned char *seen, long valid) {
    int bytes = 0;
    for (int i = 0; i < 4 && i < valid; i++) bytes |= (int)(seen[i] != 0) << (8 * i);
    const __m128i lanes = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(bytes));
    return _mm_castsi128_ps(_mm_cmpgt_epi32(lanes, _mm_setzero_si128()));
}

/* 8 elements of a row of kind E (0 fp32, 1 bf16, 2 fp16) as fp32: exact widenings */
static inline __attribute__((always_inline)) __m256 load8(const char *p, const int E) {
    if (E == 0) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (E == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* 8 fp32 results stored as kind E, rounded to nearest even (the one rounding of an output) */
static inline __attribute__((always_inline)) void store8(char *p, __m256 x, const int E) {
    if (E == 0) {
        _mm256_storeu_ps((float *)p, x);
    } else if (E == 1) {
        __m256i u = _mm256_castps_si256(x);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
        _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
    } else {
        _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
}

/* lanes [0, valid) all ones */
static inline __m256 first_lanes(long valid) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), idx));
}

/* A row's n scores s[0 .. n-1] (max4(vmax) their maximum) replaced by exp(score - max) in key
 * order, lanes past n zeroed; returns their sum (8 lanes by key index, one fixed tree) in every
 * lane: the one softmax arithmetic of every row, alone or paired */
static inline __m256 exp_sum(float *s, long n, __m128 vmax) {
    const __m256 m = _mm256_set1_ps(max4(vmax));
    __m256 lsum = _mm256_setzero_ps();
    const long groups = (n + 7) / 8;
    for (long g = 0; g < groups; g++) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + g * 8), m));
        if (g == groups - 1 && n % 8) e = _mm256_and_ps(e, first_lanes(n - g * 8));
        _mm256_storeu_ps(s + g * 8, e);
        lsum = _mm256_add_ps(lsum, e);
    }
    return _mm256_set1_ps(sum8(lsum));
}

/* R heads (1 to MAXR) of one row that share a kv head, each q[r] [dim], over keys/values [n, dim]
 * (n = the row's position + 1); s[r]: n rounded up to 8 floats of scratch; writes o[r] [dim].
 * Every key and value is loaded once for the R heads; each head's arithmetic is the same for any R
 * (the file's comment), so R is a matter of speed only. */
#define MAXR 3
static inline __attribute__((always_inline)) void attend_heads(
        const int R, const int E, const char *const *q, const char *k, const char *v, long n, long dim,
        float scale, const unsigned char *seen, float *const *s, char *const *o) {
    const long quads = (n + 3) / 4, chunks = dim / 8, es = E == 0 ? 4 : 2, row = dim * es;
    const __m128 vscale = _mm_set1_ps(scale);
    __m128 vmax[MAXR];
    for (int r = 0; r < R; r++) vmax[r] = _mm_set1_ps(-INFINITY);
    for (long g = 0; g < quads; g++) {
        /* keys past n (up to the quad's end, inside the slot) are read and their scores dropped:
         * a lane of sum4x8 holds one key's sum only */
        const char *kg = k + g * 4 * row;
        for (long b = 0; b < 4 * row; b += 64) _mm_prefetch(kg + AHEAD * row + b, _MM_HINT_T0);
        __m256 acc[MAXR][4];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
        for (long c = 0; c < chunks; c++) {
            __m256 qc[MAXR];
            for (int r = 0; r < R; r++) qc[r] = load8(q[r] + c * 8 * es, E);
            for (int i = 0; i < 4; i++) {
                const __m256 kc = load8(kg + i * row + c * 8 * es, E);
                for (int r = 0; r < R; r++) acc[r][i] = _mm256_fmadd_ps(qc[r], kc, acc[r][i]);
            }
        }
        for (int r = 0; r < R; r++) {
            __m128 dots = _mm_mul_ps(sum4x8(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), vscale);
            if (g == quads - 1 && n % 4)
                dots = _mm_blendv_ps(_mm_set1_ps(-INFINITY), dots,
                                     _mm256_castps256_ps128(first_lanes(n - g * 4)));
            if (seen) /* a tree row: keys it does not see score -inf (their weight is exactly 0) */
                dots = _mm_blendv_ps(_mm_set1_ps(-INFINITY), dots, visible4(seen + g * 4, n - g * 4));
            _mm_storeu_ps(s[r] + g * 4, dots);
            vmax[r] = _mm_max_ps(vmax[r], dots);
        }
    }
    __m256 l[MAXR];
    for (int r = 0; r < R; r++) l[r] = exp_sum(s[r], n, vmax[r]);
    for (long c0 = 0; c0 < dim; c0 += CHUNK) {
        const int w = (int)((dim - c0 < CHUNK ? dim - c0 : CHUNK) / 8);
        __m256 acc[MAXR][CHUNK / 8];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < w; i++) acc[r][i] = _mm256_setzero_ps();
        for (long j = 0; j < n; j++) {
            if (seen && !seen[j]) continue; /* weight 0: adding it would add exact zeros */
            __m256 p[MAXR];
            for (int r = 0; r < R; r++) p[r] = _mm256_broadcast_ss(s[r] + j);
            const char *vj = v + j * row + c0 * es;
            for (long b = 0; b < CHUNK * es; b += 64) _mm_prefetch(vj + AHEAD * row + b, _MM_HINT_T0);
            for (int i = 0; i < w; i++) {
                const __m256 vc = load8(vj + i * 8 * es, E);
                for (int r = 0; r < R; r++) acc[r][i] = _mm256_fmadd_ps(p[r], vc, acc[r][i]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < w; i++) store8(o[r] + (c0 + i * 8) * es, _mm256_div_ps(acc[r][i], l[r]), E);
    }
}

#define HEADS(E)                                                                                \
    do {                                                                                        \
        if (R == 3) attend_heads(3, E, q, k, v, n, dim, scale, seen, s, o);                     \
        else if (R == 2) attend_heads(2, E, q, k, v, n, dim, scale, seen, s, o);                \
        else attend_heads(1, E, q, k, v, n, dim, scale, seen, s, o);                            \
    } while (0)

static void attend_any(int R, int E, const char *const *q, const char *k, const char *v, long n, long dim,
                       float scale, const unsigned char *seen, float *const *s, char *const *o) {
    if (E == 0) HEADS(0);
    else if (E == 1) HEADS(1);
    else HEADS(2);
}

/* Two rows of one slot, row 0 seeing keys 0 .. n-1 and row 1 keys 0 .. n, R heads each (2R query
 * vectors: q[0..R-1] row 0's, q[R..2R-1] row 1's), each key and value loaded once for all of them.
 * Every (row, head) gets the bits attend_heads gives it: the same FMA chain per key over the
 * head's chunks, the same lane tree (sum4x8 of the pair twice: lanes 0 and 1 are the two keys'
 * sums by the tree a quad gives each key), its own keys only in its maximum, exponentials and sum,
 * and each output feature's in-order chain over its own keys. s[i]: scratch of >= n + 9 floats. */
static inline __attribute__((always_inline)) void attend_pair(
        const int R, const int E, const char *const *q, const char *k, const char *v, long n, long dim,
        float scale, float *const *s, char *const *o) {
    const int Q = 2 * R;
    const long n1 = n + 1, pairs = (n1 + 1) / 2, chunks = dim / 8, es = E == 0 ? 4 : 2, row = dim * es;
    const __m128 vscale = _mm_set1_ps(scale);
    __m128 vmax[2 * MAXR];
    for (int i = 0; i < Q; i++) vmax[i] = _mm_set1_ps(-INFINITY);
    for (long g = 0; g < pairs; g++) {
        const char *kg = k + g * 2 * row;
        for (long b = 0; b < 2 * row; b += 64) _mm_prefetch(kg + AHEAD * row + b, _MM_HINT_T0);
        __m256 acc[2 * MAXR][2];
        for (int i = 0; i < Q; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (long c = 0; c < chunks; c++) {
            const __m256 k0 = load8(kg + c * 8 * es, E), k1 = load8(kg + row + c * 8 * es, E);
            for (int i = 0; i < Q; i++) {
                const __m256 qc = load8(q[i] + c * 8 * es, E);
                acc[i][0] = _mm256_fmadd_ps(qc, k0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(qc, k1, acc[i][1]);
            }
        }
        /* lanes 0, 1: keys 2g, 2g + 1 (lanes 2, 3 repeat them); a row's keys past its own end -inf */
        const long seen0 = n - g * 2, seen1 = n1 - g * 2;
        const __m128 keep0 = seen0 >= 2 ? _mm_castsi128_ps(_mm_set1_epi32(-1))
                                        : _mm_castsi128_ps(_mm_setr_epi32(seen0 > 0 ? -1 : 0, 0,
                                                                          seen0 > 0 ? -1 : 0, 0));
        const __m128 keep1 = seen1 >= 2 ? _mm_castsi128_ps(_mm_set1_epi32(-1))
                                        : _mm_castsi128_ps(_mm_setr_epi32(-1, 0, -1, 0));
        for (int i = 0; i < Q; i++) {
            __m128 dots = _mm_mul_ps(sum4x8(acc[i][0], acc[i][1], acc[i][0], acc[i][1]), vscale);
            dots = _mm_blendv_ps(_mm_set1_ps(-INFINITY), dots, i < R ? keep0 : keep1);
            _mm_storel_pi((__m64 *)(s[i] + g * 2), dots);
            vmax[i] = _mm_max_ps(vmax[i], dots);
        }
    }
    __m256 l[2 * MAXR];
    for (int i = 0; i < Q; i++) l[i] = exp_sum(s[i], i < R ? n : n1, vmax[i]);
#define PAIR_CHUNK 16 /* output features a pass over the values keeps: 2 vectors x 2R query vectors */
    for (long c0 = 0; c0 < dim; c0 += PAIR_CHUNK) {
        const int w = (int)((dim - c0 < PAIR_CHUNK ? dim - c0 : PAIR_CHUNK) / 8);
        __m256 acc[2 * MAXR][PAIR_CHUNK / 8];
        for (int i = 0; i < Q; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (long j = 0; j < n; j++) {
            const char *vj = v + j * row + c0 * es;
            for (long b = 0; b < PAIR_CHUNK * es; b += 64) _mm_prefetch(vj + AHEAD * row + b, _MM_HINT_T0);
            const __m256 v0 = load8(vj, E), v1 = w > 1 ? load8(vj + 8 * es, E) : v0;
            for (int i = 0; i < Q; i++) {
                const __m256 p = _mm256_broadcast_ss(s[i] + j);
                acc[i][0] = _mm256_fmadd_ps(p, v0, acc[i][0]);
                if (w > 1) acc[i][1] = _mm256_fmadd_ps(p, v1, acc[i][1]);
            }
        }
        { /* key n: row 1's own, beyond row 0 */
            const char *vj = v + n * row + c0 * es;
            const __m256 v0 = load8(vj, E), v1 = w > 1 ? load8(vj + 8 * es, E) : v0;
            for (int i = R; i < Q; i++) {
                const __m256 p = _mm256_broadcast_ss(s[i] + n);
                acc[i][0] = _mm256_fmadd_ps(p, v0, acc[i][0]);
                if (w > 1) acc[i][1] = _mm256_fmadd_ps(p, v1, acc[i][1]);
            }
        }
        for (int i = 0; i < Q; i++)
            for (int u = 0; u < w; u++) store8(o[i] + (c0 + u * 8) * es, _mm256_div_ps(acc[i][u], l[i]), E);
    }
}

#define PAIRS(E)                                                                                \
    do {                                                                                        \
        if (R == 3) attend_pair(3, E, q, k, v, n, dim, scale, s, o);                            \
        else if (R == 2) attend_pair(2, E, q, k, v, n, dim, scale, s, o);                       \
        else attend_pair(1, E, q, k, v, n, dim, scale, s, o);                                   \
    } while (0)

static void attend_pair_any(int R, int E, const char *const *q, const char *k, const char *v, long n, long dim,
                            float scale, float *const *s, char *const *o) {
    if (E == 0) PAIRS(0);
    else if (E == 1) PAIRS(1);
    else PAIRS(2);
}

/* Row r (of ``rows``) is query row ``index[r]`` at ``q + index[r] * q_row + h * q_head`` for head h;
 * it attends keys/values 0 .. last[r] of slot ``slots[r]`` (kv head h / (heads / kv_heads), rows of
 * dim floats at ``keys + slot * slot_stride + kvh * head_stride``), all of them (a causal row) or,
 * where ``masks`` is given and ``mask_rows[r] >= 0``, those whose byte of ``masks + mask_rows[r] *
 * mask_stride`` is non-zero (a draft's tree row: its ancestors, itself and the committed prefix;
 * last[r] its last visible key), and writes ``out + index[r] *
 * heads * dim + h * dim``. ``per_item``: heads a work item takes together (1 to MAXR; speed only).
 * ``scratch``: ``threads`` x 2 x ``per_item`` x ``width`` floats, width >= every last + 9. Causal
 * rows that follow each other in one slot (r, r + 1: same slot, unmasked, last[r + 1] = last[r] + 1)
 * are taken two at a time (attend_pair; speed only). Work items are ordered kv head first, so the
 * threads walk one kv head's keys row after row together. */
void card_row_attention(const void *q, long q_row, long q_head, const void *keys, const void *values,
                        long slot_stride, long head_stride, const long *index, const long *slots,
                        const long *last, const unsigned char *masks, long mask_stride, const long *mask_rows,
                        long rows, long heads, long kv_heads, long dim, float scale,
                        void *out, float *scratch, long width, int per_item, int kind, int threads) {
    const long group = heads / kv_heads, es = kind == 0 ? 4 : 2;
    const char *qb = (const char *)q, *kb = (const char *)keys, *vb = (const char *)values;
    char *ob = (char *)out;
    const int R = per_item < 1 ? 1 : per_item > MAXR ? MAXR : per_item;
    const long blocks = (group + R - 1) / R; /* items per (row unit, kv head) */
    /* row units: a pair of neighbouring causal rows of one slot, or a row alone */
    long *start = malloc(sizeof(long) * (size_t)(rows + 1));
    long units = 0;
    for (long r = 0; r < rows; units++) {
        start[units] = r;
        const int causal = !(masks && mask_rows[r] >= 0);
        if (causal && r + 1 < rows && slots[r + 1] == slots[r] && !(masks && mask_rows[r + 1] >= 0) &&
            last[r + 1] == last[r] + 1)
            r += 2;
        else
            r += 1;
    }
    start[units] = rows;
    const long items = kv_heads * units * blocks;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && items > 1)
    for (long it = 0; it < items; it++) {
        const long kvh = it / (units * blocks), u = it / blocks % units, b = it % blocks;
        const long r = start[u], pair = start[u + 1] - r == 2;
        const long h0 = kvh * group + b * R;
        const int count = (int)(group - b * R < R ? group - b * R : R);
        const long base = slots[r] * slot_stride + kvh * head_stride;
        float *mine = scratch + (long)omp_get_thread_num() * 2 * R * width;
        const char *qs[2 * MAXR];
        float *ss[2 * MAXR];
        char *os[2 * MAXR];
        for (long p = 0; p <= pair; p++) {
            const long t = index[r + p];
            for (int i = 0; i < count; i++) {
                qs[p * count + i] = qb + (t * q_row + (h0 + i) * q_head) * es;
                ss[p * count + i] = mine + (p * count + i) * width;
                os[p * count + i] = ob + (t * heads + h0 + i) * dim * es;
            }
        }
        if (pair) {
            attend_pair_any(count, kind, qs, kb + base * es, vb + base * es, last[r] + 1, dim, scale, ss, os);
        } else {
            const unsigned char *seen = masks && mask_rows[r] >= 0 ? masks + mask_rows[r] * mask_stride : 0;
            attend_any(count, kind, qs, kb + base * es, vb + base * es, last[r] + 1, dim, scale, seen, ss, os);
        }
    }
    free(start);
}

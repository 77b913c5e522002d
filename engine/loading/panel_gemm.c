/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), fp32, for CPUs with AVX2 and FMA.
 *
 * Why (card.engine.loading.panel_gemm): a decoding step's linears are matrix-vector products that
 * must stream the weights at the memory's speed; on AVX2 machines oneDNN's packed kernel reads
 * them at about half of it. Here the weight is packed once into panels of PANEL output columns
 * ([N / PANEL][K][PANEL], zero-padded), so one row's product reads each panel as one contiguous
 * stream.
 *
 * Exactness: every output is one chain of fused multiply-adds over k = 0 .. K-1 in order, started
 * from zero, then the bias added. Both kernels below (one or two rows against a whole panel; six
 * rows against 16 columns), KC panel rows at a time with the running sums kept in memory between
 * stretches (a float stored and loaded is the same float), compute exactly that chain per output,
 * and one thread computes each output, so a row's bits do not depend on how many rows came, how
 * they were grouped, or the thread count: a prefill chunk's rows are the bits of the same rows
 * decoded one by one.
 *
 * Built with -mavx512f (card.engine.loading.panel_gemm on AVX-512 machines), the same chains run
 * 16 outputs to a register: one or two rows against a whole panel in 3 registers a row, and eight
 * rows against a whole panel (24 accumulators, 3 loads and 8 broadcasts per 24 FMAs) for prefill
 * chunks. Vector width only decides how many outputs advance together, never an output's order
 * of operations, so both builds give the same bits (tests/engine/test_panel_gemm.py compares them).
 */
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#define PANEL 48
#define ROWS 128 /* rows of x a work item takes at once (their sums: 24 KB) */
#define KC 48    /* panel rows a work item takes at once: 9 KB of panel, 9 KB of x, 9 KB of sums in L1 */
#define KC_MANY 96 /* the same for blocks of SIXES rows or more: 18 KB of panel, 27 KB of x in L2 */
#define SIXES 12 /* from this many rows a block also takes six rows at a time (prefill chunks) */
#define AHEAD 8  /* panel rows prefetched ahead of the one read (the first pass streams from memory) */

long card_panel_floats(long n, long k) { return (n + PANEL - 1) / PANEL * PANEL * k; }

void card_panel_pack(const float *w, long n, long k, float *p) {
    memset(p, 0, sizeof(float) * (size_t)card_panel_floats(n, k));
    for (long i = 0; i < n; i++) {
        float *dst = p + (size_t)(i / PANEL) * k * PANEL + i % PANEL;
        const float *src = w + (size_t)i * k;
        for (long j = 0; j < k; j++) dst[(size_t)j * PANEL] = src[j];
    }
}

/* the panel row AHEAD rows past w (its 48 floats: three cache lines) into L1 */
static inline void prefetch_ahead(const float *w) {
    _mm_prefetch((const char *)(w + AHEAD * PANEL), _MM_HINT_T0);
    _mm_prefetch((const char *)(w + AHEAD * PANEL + 16), _MM_HINT_T0);
    _mm_prefetch((const char *)(w + AHEAD * PANEL + 32), _MM_HINT_T0);
}

static inline void put(float *y, const float *bias, long n0, long n, __m256 acc) {
    float v[8];
    _mm256_storeu_ps(v, acc);
    for (int j = 0; j < 8 && n0 + j < n; j++) y[n0 + j] = bias ? v[j] + bias[n0 + j] : v[j];
}

#ifndef __AVX512F__
/* rows x[0] (and x[ldx] when two) against rows k0 .. k1-1 of panel p, continuing the chains in
 * acc (6 vectors a row): 6 or 12 accumulators in registers */
static void rows_panel(const float *x, long ldx, int two, const float *p, long k0, long k1, float *acc) {
    __m256 a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8), a2 = _mm256_loadu_ps(acc + 16);
    __m256 a3 = _mm256_loadu_ps(acc + 24), a4 = _mm256_loadu_ps(acc + 32), a5 = _mm256_loadu_ps(acc + 40);
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
    float *bcc = acc + PANEL;
    if (two) {
        b0 = _mm256_loadu_ps(bcc), b1 = _mm256_loadu_ps(bcc + 8), b2 = _mm256_loadu_ps(bcc + 16);
        b3 = _mm256_loadu_ps(bcc + 24), b4 = _mm256_loadu_ps(bcc + 32), b5 = _mm256_loadu_ps(bcc + 40);
    }
    const float *x1 = x + ldx;
    for (long j = k0; j < k1; j++) {
        const float *w = p + (size_t)j * PANEL;
        prefetch_ahead(w);
        __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8), w2 = _mm256_loadu_ps(w + 16);
        __m256 w3 = _mm256_loadu_ps(w + 24), w4 = _mm256_loadu_ps(w + 32), w5 = _mm256_loadu_ps(w + 40);
        __m256 s = _mm256_broadcast_ss(x + j);
        a0 = _mm256_fmadd_ps(s, w0, a0); a1 = _mm256_fmadd_ps(s, w1, a1); a2 = _mm256_fmadd_ps(s, w2, a2);
        a3 = _mm256_fmadd_ps(s, w3, a3); a4 = _mm256_fmadd_ps(s, w4, a4); a5 = _mm256_fmadd_ps(s, w5, a5);
        if (two) {
            __m256 t = _mm256_broadcast_ss(x1 + j);
            b0 = _mm256_fmadd_ps(t, w0, b0); b1 = _mm256_fmadd_ps(t, w1, b1); b2 = _mm256_fmadd_ps(t, w2, b2);
            b3 = _mm256_fmadd_ps(t, w3, b3); b4 = _mm256_fmadd_ps(t, w4, b4); b5 = _mm256_fmadd_ps(t, w5, b5);
        }
    }
    _mm256_storeu_ps(acc, a0); _mm256_storeu_ps(acc + 8, a1); _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3); _mm256_storeu_ps(acc + 32, a4); _mm256_storeu_ps(acc + 40, a5);
    if (two) {
        _mm256_storeu_ps(bcc, b0); _mm256_storeu_ps(bcc + 8, b1); _mm256_storeu_ps(bcc + 16, b2);
        _mm256_storeu_ps(bcc + 24, b3); _mm256_storeu_ps(bcc + 32, b4); _mm256_storeu_ps(bcc + 40, b5);
    }
}

/* six rows of x against 16 columns (col .. col+15) of rows k0 .. k1-1 of panel p, continuing the
 * chains in acc (PANEL floats a row): 12 accumulators, 2 loads and 6 broadcasts per 12 FMAs */
static void six_by_16(const float *x, long ldx, const float *p, long k0, long k1, int col, float *acc) {
    float *r0 = acc + col, *r1 = r0 + PANEL, *r2 = r1 + PANEL, *r3 = r2 + PANEL, *r4 = r3 + PANEL,
          *r5 = r4 + PANEL;
    __m256 c00 = _mm256_loadu_ps(r0), c01 = _mm256_loadu_ps(r0 + 8), c10 = _mm256_loadu_ps(r1);
    __m256 c11 = _mm256_loadu_ps(r1 + 8), c20 = _mm256_loadu_ps(r2), c21 = _mm256_loadu_ps(r2 + 8);
    __m256 c30 = _mm256_loadu_ps(r3), c31 = _mm256_loadu_ps(r3 + 8), c40 = _mm256_loadu_ps(r4);
    __m256 c41 = _mm256_loadu_ps(r4 + 8), c50 = _mm256_loadu_ps(r5), c51 = _mm256_loadu_ps(r5 + 8);
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx,
                *x5 = x + 5 * ldx;
    for (long j = k0; j < k1; j++) {
        const float *w = p + (size_t)j * PANEL + col;
        __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8), s;
        s = _mm256_broadcast_ss(x0 + j); c00 = _mm256_fmadd_ps(s, w0, c00); c01 = _mm256_fmadd_ps(s, w1, c01);
        s = _mm256_broadcast_ss(x1 + j); c10 = _mm256_fmadd_ps(s, w0, c10); c11 = _mm256_fmadd_ps(s, w1, c11);
        s = _mm256_broadcast_ss(x2 + j); c20 = _mm256_fmadd_ps(s, w0, c20); c21 = _mm256_fmadd_ps(s, w1, c21);
        s = _mm256_broadcast_ss(x3 + j); c30 = _mm256_fmadd_ps(s, w0, c30); c31 = _mm256_fmadd_ps(s, w1, c31);
        s = _mm256_broadcast_ss(x4 + j); c40 = _mm256_fmadd_ps(s, w0, c40); c41 = _mm256_fmadd_ps(s, w1, c41);
        s = _mm256_broadcast_ss(x5 + j); c50 = _mm256_fmadd_ps(s, w0, c50); c51 = _mm256_fmadd_ps(s, w1, c51);
    }
    _mm256_storeu_ps(r0, c00); _mm256_storeu_ps(r0 + 8, c01); _mm256_storeu_ps(r1, c10);
    _mm256_storeu_ps(r1 + 8, c11); _mm256_storeu_ps(r2, c20); _mm256_storeu_ps(r2 + 8, c21);
    _mm256_storeu_ps(r3, c30); _mm256_storeu_ps(r3 + 8, c31); _mm256_storeu_ps(r4, c40);
    _mm256_storeu_ps(r4 + 8, c41); _mm256_storeu_ps(r5, c50); _mm256_storeu_ps(r5 + 8, c51);
}
#endif

#ifdef __AVX512F__
/* rows_panel with 16 outputs a register: one row (or two) against rows k0 .. k1-1 of panel p */
static void rows_panel_512(const float *x, long ldx, int two, const float *p, long k0, long k1, float *acc) {
    __m512 a0 = _mm512_loadu_ps(acc), a1 = _mm512_loadu_ps(acc + 16), a2 = _mm512_loadu_ps(acc + 32);
    __m512 b0 = a0, b1 = a1, b2 = a2;
    float *bcc = acc + PANEL;
    if (two) b0 = _mm512_loadu_ps(bcc), b1 = _mm512_loadu_ps(bcc + 16), b2 = _mm512_loadu_ps(bcc + 32);
    const float *x1 = x + ldx;
    for (long j = k0; j < k1; j++) {
        const float *w = p + (size_t)j * PANEL;
        prefetch_ahead(w);
        __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32);
        __m512 s = _mm512_set1_ps(x[j]);
        a0 = _mm512_fmadd_ps(s, w0, a0); a1 = _mm512_fmadd_ps(s, w1, a1); a2 = _mm512_fmadd_ps(s, w2, a2);
        if (two) {
            __m512 t = _mm512_set1_ps(x1[j]);
            b0 = _mm512_fmadd_ps(t, w0, b0); b1 = _mm512_fmadd_ps(t, w1, b1); b2 = _mm512_fmadd_ps(t, w2, b2);
        }
    }
    _mm512_storeu_ps(acc, a0); _mm512_storeu_ps(acc + 16, a1); _mm512_storeu_ps(acc + 32, a2);
    if (two) _mm512_storeu_ps(bcc, b0), _mm512_storeu_ps(bcc + 16, b1), _mm512_storeu_ps(bcc + 32, b2);
}

/* eight rows of x against a whole panel: 24 accumulators, each panel row loaded once for them */
static void eight_by_48(const float *x, long ldx, const float *p, long k0, long k1, float *acc) {
#define ROW_LOAD(r) __m512 c##r##0 = _mm512_loadu_ps(acc + r * PANEL), \
    c##r##1 = _mm512_loadu_ps(acc + r * PANEL + 16), c##r##2 = _mm512_loadu_ps(acc + r * PANEL + 32);
    ROW_LOAD(0) ROW_LOAD(1) ROW_LOAD(2) ROW_LOAD(3) ROW_LOAD(4) ROW_LOAD(5) ROW_LOAD(6) ROW_LOAD(7)
    for (long j = k0; j < k1; j++) {
        const float *w = p + (size_t)j * PANEL;
        prefetch_ahead(w);
        __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32), s;
#define ROW_FMA(r) s = _mm512_set1_ps(x[(size_t)r * ldx + j]); c##r##0 = _mm512_fmadd_ps(s, w0, c##r##0); \
    c##r##1 = _mm512_fmadd_ps(s, w1, c##r##1); c##r##2 = _mm512_fmadd_ps(s, w2, c##r##2);
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5) ROW_FMA(6) ROW_FMA(7)
    }
#define ROW_STORE(r) _mm512_storeu_ps(acc + r * PANEL, c##r##0); \
    _mm512_storeu_ps(acc + r * PANEL + 16, c##r##1); _mm512_storeu_ps(acc + r * PANEL + 32, c##r##2);
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5) ROW_STORE(6) ROW_STORE(7)
#undef ROW_LOAD
#undef ROW_FMA
#undef ROW_STORE
}
#endif

/* up to ROWS rows against a whole panel, KC panel rows at a time: each stretch of the panel comes
 * from memory once and stays in L1 while every pair of rows reads it; the sums wait in acc */
static void rows_block(const float *x, long m, long k, const float *p, float *y, long ldy,
                       const float *bias, long n0, long n) {
    float acc[ROWS * PANEL];
    memset(acc, 0, sizeof(float) * (size_t)m * PANEL);
    long kc = m >= SIXES ? KC_MANY : KC;
    for (long k0 = 0; k0 < k; k0 += kc) {
        long k1 = k0 + kc < k ? k0 + kc : k;
        long r = 0;
#ifdef __AVX512F__
        for (; r + 8 <= m; r += 8) eight_by_48(x + (size_t)r * k, k, p, k0, k1, acc + r * PANEL);
        for (; r + 2 <= m; r += 2) rows_panel_512(x + (size_t)r * k, k, 1, p, k0, k1, acc + r * PANEL);
        if (r < m) rows_panel_512(x + (size_t)r * k, k, 0, p, k0, k1, acc + r * PANEL);
#else
        if (m >= SIXES)  /* many rows (a prefill chunk): six at a time, fewer loads per FMA */
            for (; r + 6 <= m; r += 6)
                for (int col = 0; col < PANEL; col += 16)
                    six_by_16(x + (size_t)r * k, k, p, k0, k1, col, acc + r * PANEL);
        for (; r + 2 <= m; r += 2) rows_panel(x + (size_t)r * k, k, 1, p, k0, k1, acc + r * PANEL);
        if (r < m) rows_panel(x + (size_t)r * k, k, 0, p, k0, k1, acc + r * PANEL);
#endif
    }
    for (long r = 0; r < m; r++)
        for (int c = 0; c < PANEL; c += 8)
            put(y + (size_t)r * ldy, bias, n0 + c, n, _mm256_loadu_ps(acc + r * PANEL + c));
}

/* x: [m, k] contiguous; p: card_panel_pack's panels of an [n, k] weight; y: [m, n] contiguous */
void card_panel_linear(const float *x, long m, long k, const float *p, long n, const float *bias,
                       float *y, int threads) {
    long panels = (n + PANEL - 1) / PANEL, blocks = (m + ROWS - 1) / ROWS;
    long items = panels * blocks;
    /* work items: (row block, panel), row blocks outermost, so the threads share a block's rows;
     * handed out in shrinking chunks (guided): on quiet cores each thread streams a long run of
     * panels, as a static split would, while a thread another thread preempts holds up only its
     * current chunk, not a fixed half of the layer (whichever thread takes an item, its bits are
     * the same) */
#pragma omp parallel for num_threads(threads) schedule(guided) if (threads > 1)
    for (long it = 0; it < items; it++) {
        long b = it / panels, pi = it % panels;
        long m0 = b * ROWS, rows = m - m0 < ROWS ? m - m0 : ROWS;
        rows_block(x + (size_t)m0 * k, rows, k, p + (size_t)pi * k * PANEL, y + (size_t)m0 * n, n, bias,
                   pi * PANEL, n);
    }
}

/* Decode attention over a paged bf16 cache on the AMX tiles, for rows of long contexts (past
 * RTP_DECODE_AMX_MIN_LEN keys; cpu_kernels.c's AVX-512 kernel takes the others): one query token per
 * row, the G = H / Hkv query heads of each kv head together, the context cut in parts of PART keys.
 *
 * Why: at one row and a 2,048-token context the vector kernel has three (row, kv head) tasks for two
 * threads, and spends about 45 cycles a key and kv head on the products (split bf16 rows, their
 * horizontal sums, the values' broadcast multiply-adds). Here the parts make tasks enough for every
 * thread, merged after, and both products are a few tile instructions per 16 keys:
 *   S^T = K Q^T   A = 16 keys' K rows of one 32-dim step, loaded where they lie (a tile's rows are
 *                 16 consecutive slots of one block, the cache's token stride apart: block_size a
 *                 multiple of 16); B = the kv head's G query rows in pairs (row r, column n =
 *                 q_n[32 s + 2r, +1]), built once per task. Column g of the 16 x 16 result is
 *                 head g's 16 scores: gathered out.
 *   O += P V      A = P, rows g < G of 32 keys' probabilities (rows G.. zero); B = 32 keys' V rows
 *                 interleaved in pairs of keys, built per step with unpacklo/hi_epi16, which pair
 *                 the dims within 128-bit lanes: accumulator column n of the lo tile of dim step s
 *                 is dim 32 s + 8 (n / 4) + n % 4, of the hi tile that + 4. The order is undone
 *                 once, when the output is written.
 * The parts (RTP_ATTN_PART, cpu_kernels.h) are merged by cpu_kernels.c's merge, which the AVX-512
 * kernel's long rows share. The online softmax runs per span of SPAN keys, in base 2 as
 * prefill_attention.c's. Measured
 * (tools/bench_decode_step.py --rows 1 --context 2048): the step's attention 2.75-2.82 -> 2.27-2.57
 * ms. From memory at 64 rows of 256 keys the two kernels took the same time (about 20 ms for 30
 * layers, bound by the bytes): short rows stay on the vector kernel.
 *
 * Numerics: products exact, sums in fp32, the scale on the fp32 scores, softmax in fp32; P enters P V
 * as two bf16 tiles, P_hi = bf16(P) and P_lo = bf16(P - P_hi), so the probabilities keep about 16
 * bits (bf16 P alone lost greedy fidelity: tools/bench_fidelity.py with every row on this kernel,
 * 23/32 prompts identical to fp32 transformers; with P_hi + P_lo 27/32; the vector kernel, fp32 P,
 * 28/32); the output divided by the fp32 sum and rounded to bf16 once. Parts are set by positions
 * alone and a row's kernel by its length, so a row's output does not depend on its batch.
 */
#include "cpu_kernels.h"
#include "amx_tiles.h"
#include "prefetch.h"
#include "vec_math.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define AVX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

#define SPAN 128  /* keys per online-softmax update: 8 key tiles, 4 value steps */
#define PART RTP_ATTN_PART /* keys per task of a long context (a multiple of SPAN), merged after */
#define MAXG 16   /* query heads per kv head: the 16 columns of S^T */
#define MAXD 256

/* Tiles (amx_tiles.h, 8 configured): 0-3 accumulators, 4-5 A operands, 6-7 B operands. */

/* Per-thread buffers, kept from call to call (OpenMP's threads live as long as the process). */
typedef struct {
    uint16_t p[SPAN / 32][16 * 32];     /* P as A tiles, per 32-key step; rows G.. stay zero */
    uint16_t plo[SPAN / 32][16 * 32];   /* what bf16 P leaves of the fp32 probabilities, alike */
    uint32_t vb[4][256];                /* a value step's B tiles: (lo, hi) of two dim steps */
    float c[4][256];                    /* accumulators read out */
    float s[MAXG][SPAN];                /* one span's scores (base 2), then probabilities */
} step_scratch;

/* What a task keeps per kv head across its spans (heads [h0, h1) of a row). */
typedef struct {
    uint32_t *qt;    /* [heads][D / 32][256]: each head's queries as B tiles, per 32-dim step */
    float *o;        /* [heads][G][D]: output accumulators, in the tiles' dim order */
    float *m, *l;    /* [heads][G]: running max (base 2) and sum */
} head_state;

static __thread step_scratch *scratch;
static __thread void *state_buf;
static __thread size_t state_bytes;

/* The kv head's G query rows (bf16, D each, rows of stride D) as the B operand of S^T = K Q^T. */
AMX_TARGET static void queries_as_b(const uint16_t *q, int64_t G, int64_t D, uint32_t *qt) {
    memset(qt, 0, (size_t)(D / 32) * 1024);
    for (int64_t s = 0; s < D / 32; s++)
        for (int64_t r = 0; r < 16; r++)
            for (int64_t n = 0; n < G; n++) {
                uint32_t pair;
                memcpy(&pair, q + n * D + 32 * s + 2 * r, 4);
                qt[s * 256 + r * 16 + n] = pair;
            }
}

/* V rows of keys k and k + 1 (NULL: zeros) of dim steps [s0, s0 + ns) (ns <= 2) into row r of the
 * value step's B tiles: tile 2 i is the lo half of step s0 + i, tile 2 i + 1 the hi half. */
AMX_TARGET static inline void value_pair(const uint16_t *a, const uint16_t *b, int64_t s0, int64_t ns, int64_t r,
                                         step_scratch *w) {
    for (int64_t i = 0; i < ns; i++) {
        __m512i x = a ? _mm512_loadu_si512((const void *)(a + 32 * (s0 + i))) : _mm512_setzero_si512();
        __m512i y = b ? _mm512_loadu_si512((const void *)(b + 32 * (s0 + i))) : _mm512_setzero_si512();
        _mm512_store_si512((void *)(w->vb[2 * i] + 16 * r), _mm512_unpacklo_epi16(x, y));
        _mm512_store_si512((void *)(w->vb[2 * i + 1] + 16 * r), _mm512_unpackhi_epi16(x, y));
    }
}

typedef struct {
    const uint16_t *k, *v;   /* the caches */
    int64_t tok_stride;      /* elements from a slot to the next */
    const int32_t *table;
    int64_t block_size;
} paged_kv;

static inline const uint16_t *slot_row(const paged_kv *kv, const uint16_t *cache, int64_t pos, int64_t h,
                                       int64_t D) {
    int64_t slot = (int64_t)kv->table[pos / kv->block_size] * kv->block_size + pos % kv->block_size;
    return cache + slot * kv->tok_stride + h * D;
}

/* Prefetch the D bf16 of `rows` rows `stride` elements apart. (Issued a few at a time among the
 * values' re-layout: bursts of a tile's rows stalled on the line-fill buffers; prefetching to L2
 * instead, or 32-256 keys ahead, measured no faster.) */
static inline void prefetch_rows(const uint16_t *row, int64_t rows, int64_t stride, int64_t D) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < D; c += 32) rtp_prefetch_l1(row + r * stride + c);
}

/* Keys [s0, s1) of one span for kv head h (the task's head hs): scores, the online softmax update,
 * P V; keys outside [first, len) are masked. The span's K and V rows of all the task's heads lie
 * together (a slot's heads are one run), so the heads go in turn within a span; (next_h, next_s0)
 * is the head and span the task attends next (next_h -1: none), whose keys are prefetched. */
AMX_TARGET static void attend_span(const paged_kv *kv, int64_t h, int64_t hs, int64_t s0, int64_t s1,
                                   int64_t next_h, int64_t next_s0, int64_t first, int64_t len, int64_t G,
                                   int64_t D, float scale, float softcap, const head_state *st, step_scratch *w) {
    const int64_t nd = D / 32;
    const float log2e = 1.44269504088896341f;
    const __m512 sc = _mm512_set1_ps(scale * log2e), capv = _mm512_set1_ps(softcap);
    const __m512 cap_in = _mm512_set1_ps(softcap > 0.0f ? scale / softcap : 0.0f), l2e = _mm512_set1_ps(log2e);
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    const uint32_t *qt = st->qt + hs * nd * 256;
    float *m = st->m + hs * G, *l = st->l + hs * G, *acc_o = st->o + hs * G * D;
    int64_t nt = (s1 - s0 + 15) / 16, nsteps = (s1 - s0 + 31) / 32;
    __mmask16 valid[SPAN / 16];
    /* scores, two key tiles at a time (accumulators 0 and 1) */
    for (int64_t j = 0; j < nt; j += 2) {
        int two = j + 1 < nt;
        const uint16_t *k0 = slot_row(kv, kv->k, s0 + 16 * j, h, D);
        const uint16_t *k1 = two ? slot_row(kv, kv->k, s0 + 16 * j + 16, h, D) : NULL;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t s = 0; s < nd; s++) {
            _tile_loadd(6, qt + s * 256, 64);
            _tile_loadd(4, k0 + 32 * s, kv->tok_stride * 2);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(5, k1 + 32 * s, kv->tok_stride * 2);
                _tile_dpbf16ps(1, 5, 6);
            }
        }
        _tile_stored(0, w->c[0], 64);
        if (two) _tile_stored(1, w->c[1], 64);
        for (int64_t t = 0; t <= two; t++) {
            int64_t p0 = s0 + 16 * (j + t);
            uint32_t bits = 0xffffu;
            if (p0 < first) bits &= 0xffffu << (first - p0);
            if (p0 + 16 > len) bits &= 0xffffu >> (p0 + 16 - len);
            valid[j + t] = (__mmask16)bits;
            for (int64_t g = 0; g < G; g++) {
                __m512 x = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32((int)g)), w->c[t], 4);
                /* Gemma 2: cap tanh(scale s / cap), then base 2 */
                x = softcap > 0.0f ? _mm512_mul_ps(softcap_ps(_mm512_mul_ps(x, cap_in), capv), l2e)
                                   : _mm512_mul_ps(x, sc);
                _mm512_store_ps(w->s[g] + 16 * (j + t), _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[j + t], x));
            }
        }
    }
    /* online softmax: probabilities into P's rows, bf16 (zero past the span's keys) */
    float corr[MAXG];
    for (int64_t g = 0; g < G; g++) {
        __m512 mx = _mm512_load_ps(w->s[g]);
        for (int64_t j = 1; j < nt; j++) mx = _mm512_max_ps(mx, _mm512_load_ps(w->s[g] + 16 * j));
        float mnew = fmaxf(m[g], _mm512_reduce_max_ps(mx));
        corr[g] = exp2f(m[g] - mnew); /* 0 on the first span */
        __m512 mv = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps(), lo = _mm512_set1_ps(-126.0f);
        for (int64_t j = 0; j < 2 * nsteps; j++) {
            __m512 p = j < nt ? _mm512_maskz_mov_ps(valid[j], exp2_ps(_mm512_max_ps(
                                    _mm512_sub_ps(_mm512_load_ps(w->s[g] + 16 * j), mv), lo)))
                              : _mm512_setzero_ps();
            sum = _mm512_add_ps(sum, p);
            _mm512_store_ps(w->s[g] + 16 * j, p);
        }
        l[g] = l[g] * corr[g] + _mm512_reduce_add_ps(sum);
        m[g] = mnew;
        for (int64_t t = 0; t < nsteps; t++) {
            __m512 a = _mm512_load_ps(w->s[g] + 32 * t), b = _mm512_load_ps(w->s[g] + 32 * t + 16);
            __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            /* the bf16 values back in fp32 (a bf16 is the top half of its fp32) */
            __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16));
            __m512 hb = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16));
            _mm512_store_si512((void *)(w->p[t] + 32 * g), hi);
            _mm512_store_si512((void *)(w->plo[t] + 32 * g),
                               (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha)));
        }
    }
    /* values: two dim steps a pass (accumulators 0-3), each value step's B tiles built once */
    for (int64_t d0 = 0; d0 < nd; d0 += 2) {
        int64_t ns = nd - d0 < 2 ? nd - d0 : 2;
        _tile_zero(0); /* tile numbers are immediates */
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < nsteps; t++) {
            /* each 16 keys of the step are consecutive slots of one block */
            int64_t k0 = s0 + 32 * t;
            const uint16_t *half[2] = {slot_row(kv, kv->v, k0, h, D),
                                       k0 + 16 < s1 ? slot_row(kv, kv->v, k0 + 16, h, D) : NULL};
            /* prefetches, spread over the re-layout: this head's next value step, and the keys of
             * the next (head, span) the task attends, at the same offsets */
            const uint16_t *nv[2] = {NULL, NULL}, *nk[2] = {NULL, NULL};
            if (d0 == 0) {
                for (int64_t i = 0; i < 2; i++) {
                    int64_t kv0 = k0 + 32 + 16 * i, kk0 = next_s0 + 32 * t + 16 * i;
                    if (kv0 < s1) nv[i] = slot_row(kv, kv->v, kv0, h, D);
                    if (next_h >= 0 && kk0 < len) nk[i] = slot_row(kv, kv->k, kk0, next_h, D);
                }
            }
            for (int64_t r = 0; r < 16; r++) {
                int64_t ka = k0 + 2 * r, off = (2 * r % 16) * kv->tok_stride;
                const uint16_t *row = half[r / 8] + off;
                if (nv[r / 8]) prefetch_rows(nv[r / 8] + off, 2, kv->tok_stride, D);
                if (nk[r / 8]) prefetch_rows(nk[r / 8] + off, 2, kv->tok_stride, D);
                /* keys past the context: zero rows (their slots may hold anything; P is 0 there) */
                value_pair(ka < s1 ? row : NULL, ka + 1 < s1 ? row + kv->tok_stride : NULL, d0, ns, r, w);
            }
            /* P V as (P_hi + P_lo) V: the probabilities to about 16 bits, as close to the fp32 P of
             * the vector kernel as the greedy fidelity needs (bf16 P alone: 23/32 prompts identical
             * to fp32 transformers against 28/32, tools/bench_fidelity.py) */
            _tile_loadd(4, w->p[t], 64);
            _tile_loadd(5, w->plo[t], 64);
            _tile_loadd(6, w->vb[0], 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(0, 5, 6);
            _tile_loadd(7, w->vb[1], 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(1, 5, 7);
            if (ns == 2) {
                _tile_loadd(6, w->vb[2], 64);
                _tile_dpbf16ps(2, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
                _tile_loadd(7, w->vb[3], 64);
                _tile_dpbf16ps(3, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, w->c[0], 64);
        _tile_stored(1, w->c[1], 64);
        if (ns == 2) {
            _tile_stored(2, w->c[2], 64);
            _tile_stored(3, w->c[3], 64);
        }
        for (int64_t g = 0; g < G; g++) {
            __m512 cv = _mm512_set1_ps(corr[g]);
            for (int64_t i = 0; i < 2 * ns; i++) {
                float *acc = acc_o + g * D + 32 * d0 + 16 * i;
                _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_load_ps(acc), cv, _mm512_load_ps(w->c[i] + 16 * g)));
            }
        }
    }
}

/* `rows` rows of accumulators (in the tiles' dim order) into dim order, fp32: dims 32 s + [0, 16) are
 * lo[0..3] hi[0..3] lo[4..7] hi[4..7] of step s's two tiles, the next 16 the same of lanes 8..15. */
AVX_TARGET static void dim_order(const float *o, int64_t rows, int64_t D, float *out) {
    const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i next16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t g = 0; g < rows; g++)
        for (int64_t s = 0; s < D / 32; s++) {
            __m512 lo = _mm512_load_ps(o + g * D + 32 * s), hi = _mm512_load_ps(o + g * D + 32 * s + 16);
            _mm512_storeu_ps(out + g * D + 32 * s, _mm512_permutex2var_ps(lo, first16, hi));
            _mm512_storeu_ps(out + g * D + 32 * s + 16, _mm512_permutex2var_ps(lo, next16, hi));
        }
}

/* One row's kv heads [h0, h1) over the keys of one part [k_lo, k_hi): q its query rows; each head's
 * state goes to parts + (h - h0) * head_stride floats (cpu_kernels.h, RTP_ATTN_PART). */
AMX_TARGET static void attend_row(const uint16_t *q, float *parts, int64_t head_stride,
                                  const paged_kv *kv, int64_t h0, int64_t h1, int64_t k_lo, int64_t k_hi,
                                  int64_t len, int64_t G, int64_t D, float scale, int64_t window, float softcap,
                                  const head_state *st, step_scratch *w) {
    const int64_t nd = D / 32, nh = h1 - h0;
    int64_t first = window > 0 && len > window ? len - window : 0;
    for (int64_t hs = 0; hs < nh; hs++) queries_as_b(q + hs * G * D, G, D, st->qt + hs * nd * 256);
    for (int64_t i = 0; i < nh * G; i++) {
        st->m[i] = -INFINITY;
        st->l[i] = 0.0f;
    }
    memset(st->o, 0, (size_t)(nh * G * D) * sizeof(float));
    int64_t start = first > k_lo ? first / 32 * 32 : k_lo;
    for (int64_t s0 = start; s0 < k_hi; s0 += SPAN) {
        int64_t s1 = k_hi - s0 < SPAN ? k_hi : s0 + SPAN;
        for (int64_t hs = 0; hs < nh; hs++) {
            /* what comes next: the next head of this span, else the first of the next span */
            int64_t next_h = hs + 1 < nh ? h0 + hs + 1 : (s0 + SPAN < k_hi ? h0 : -1);
            int64_t next_s0 = hs + 1 < nh ? s0 : s0 + SPAN;
            attend_span(kv, h0 + hs, hs, s0, s1, next_h, next_s0, first, len, G, D, scale, softcap, st, w);
        }
    }
    for (int64_t hs = 0; hs < nh; hs++) {
        float *p = parts + hs * head_stride;
        memcpy(p, st->m + hs * G, (size_t)G * sizeof(float));
        memcpy(p + G, st->l + hs * G, (size_t)G * sizeof(float));
        dim_order(st->o + hs * G * D, G, D, p + (2 * G + 15) / 16 * 16);
    }
}

int rtp_decode_attention_amx_applies(int64_t H, int64_t Hkv, int64_t D, int64_t block_size) {
    return rtp_amx_supported() && Hkv > 0 && H % Hkv == 0 && H / Hkv <= MAXG && D % 32 == 0 && D <= MAXD
           && block_size % 16 == 0;
}

/* rtp_paged_decode_attention_bf16's contract for a bf16 cache, where rtp_decode_attention_amx_applies(). */
AMX_TARGET int rtp_paged_decode_attention_amx(const uint16_t *q, const void *k_cache, const void *v_cache,
                                              int64_t tok_stride, const int32_t *block_tables, int64_t ldt,
                                              const int32_t *seq_lens, uint16_t *out, int64_t B, int64_t H,
                                              int64_t Hkv, int64_t D, int64_t block_size, float scale,
                                              int64_t window, float softcap) {
    int64_t G = H / Hkv, nd = D / 32;
    /* A task per row (its kv heads in turn: a token's K rows of all heads lie together), or per
     * (row, kv head) with fewer rows than two per thread, as the vector kernel splits them; and per
     * part of PART keys of a long context, merged after. The parts are set by positions alone, so a
     * row's output is what it is in any batch (speculative verification relies on it). */
    int64_t per_row = B < 2 * omp_get_max_threads() ? Hkv : 1;
    int64_t nh = per_row == 1 ? Hkv : 1; /* kv heads per task */
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    if (max_len <= RTP_DECODE_AMX_MIN_LEN) return 1; /* no row of this kernel's */
    int64_t nparts = (max_len + PART - 1) / PART;
    int64_t part_stride = RTP_ATTN_PART_FLOATS(G, D), row_stride = Hkv * nparts * part_stride;
    float *parts = rtp_attention_parts((size_t)(B * row_stride) * sizeof(float));
    if (!parts) return 0;
    size_t qt_bytes = (size_t)(nh * nd) * 1024, o_bytes = (size_t)(nh * G * D) * 4, ml_bytes = (size_t)(nh * G) * 4;
    int ok = 1;
#pragma omp parallel
    {
        unsigned csr = rtp_flush_denormals();
        if (!scratch) scratch = aligned_alloc(64, sizeof(step_scratch));
        size_t need = qt_bytes + o_bytes + 2 * ((ml_bytes + 63) / 64 * 64);
        if (need > state_bytes) {
            free(state_buf);
            state_buf = aligned_alloc(64, need);
            state_bytes = state_buf ? need : 0;
        }
        if (!scratch || !state_buf) {
#pragma omp atomic write
            ok = 0;
        }
#pragma omp barrier
        if (ok) { /* every thread or none: the loops below are shared out among all of them */
            step_scratch *w = scratch;
            char *at = state_buf;
            head_state st = {(uint32_t *)at, (float *)(at + qt_bytes), (float *)(at + qt_bytes + o_bytes),
                             (float *)(at + qt_bytes + o_bytes + (ml_bytes + 63) / 64 * 64)};
            rtp_configure_tiles(8);
            memset(w->p, 0, sizeof(w->p)); /* rows G.. of P stay zero */
            memset(w->plo, 0, sizeof(w->plo));
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < B * per_row * nparts; task++) {
                int64_t b = task / (per_row * nparts), rest = task % (per_row * nparts);
                int64_t h0 = per_row == 1 ? 0 : rest / nparts, part = rest % nparts, len = seq_lens[b];
                if (len <= RTP_DECODE_AMX_MIN_LEN) continue; /* the vector kernel's */
                int64_t first = window > 0 && len > window ? len - window : 0;
                int64_t row_parts = (len + PART - 1) / PART;
                int64_t k_lo = part * PART, k_hi = part + 1 < row_parts ? k_lo + PART : len;
                if (part >= row_parts || k_hi <= first) continue; /* no keys of the row there */
                paged_kv kv = {(const uint16_t *)k_cache, (const uint16_t *)v_cache, tok_stride,
                               block_tables + b * ldt, block_size};
                attend_row(q + (b * H + h0 * G) * D, parts + b * row_stride + (h0 * nparts + part) * part_stride,
                           nparts * part_stride, &kv, h0, h0 + nh, k_lo, k_hi, len, G, D, scale, window, softcap, &st,
                           w);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < B * Hkv; task++) {
                int64_t b = task / Hkv, h = task % Hkv, len = seq_lens[b];
                if (len <= RTP_DECODE_AMX_MIN_LEN) continue;
                int64_t first = window > 0 && len > window ? len - window : 0;
                rtp_merge_attention_parts(parts + b * row_stride + h * nparts * part_stride, part_stride, first / PART,
                            (len + PART - 1) / PART, G, D, st.o, out + (b * H + h * G) * D);
            }
            _tile_release();
        }
        rtp_restore_denormals(csr);
    }
    return ok;
}

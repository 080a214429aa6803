/* Decode attention over the paged KV cache: one query token per row.
 * q bf16 [B, H, D] contiguous, D a multiple of 32; k_cache / v_cache bf16 with token stride `tok_stride`
 * (elements between consecutive slots; slot = block * block_size + offset) and head
 * stride D; block_tables int32 [B, ldt]; seq_lens int32 [B]; out bf16 [B, H, D].
 * Each (row, kv head) task keeps its G = H / Hkv query heads' running max, sum and
 * output in fp32 (online softmax), one block of keys at a time. A row of length 0
 * (bucket padding) writes zeros. window > 0 limits each row to its last `window` keys.
 *
 * Prompt chunks attend in prefill_attention.c; this kernel serves every row that brings one query
 * token: decode steps and the decode rows of mixed steps.
 */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "prefetch.h"
#include "scratch.h"
#include "vec_math.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

#define MAX_GROUP 16
#define MAX_DIM RTP_MAX_HEAD_DIM
#define KEYS 16  /* keys scored at once (one vector of scores) */
#define SPAN 256 /* keys per online-softmax update */
#define AHEAD 2   /* chunks of keys ahead that attend_task prefetches into L2 (its `ahead`) */
/* attend_task's `ahead`: what it prefetches AHEAD chunks on */
#define AHEAD_NONE 0   /* nothing (its tokens are in L2 already, or the CPU is not one this was measured on) */
#define AHEAD_TOKENS 1 /* whole tokens, by the first of the task's kv heads, for the rest to find in L2 */
#define AHEAD_OWN 2    /* its own kv head's K and V rows: a task of one kv head */

/* Sixteen vectors in, one out: lane i = the sum of v[i]'s 16 lanes. A transposing tree
 * (31 shuffles for 16 sums) instead of 16 horizontal reductions (64 shuffles, each a
 * dependency chain): the scores of a block of keys come out as one vector. */
TARGET static inline __m512 sum16x16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)  /* 128-bit quarters: [v2i(q0+q2), v2i(q1+q3), v2i+1(q0+q2), v2i+1(q1+q3)] */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* quarter j holds four partial sums of key 4i + j */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    __m512d a = _mm512_castps_pd(y0), b = _mm512_castps_pd(y1);
    /* lane 4j + e now holds the sum of key 4e + j */
    __m512 z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, z);
}

/* 32 bf16 at p as two fp32 vectors without a shuffle: the even elements (2j -> lane j)
 * and the odd ones. Keys and values are read this way; the query and the output use
 * the same split layout, so nothing is reordered per key. */
TARGET static inline void bf16x32_split(const uint16_t *p, __m512 *even, __m512 *odd) {
    __m512i x = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* An int8 cache (rtp/engine/kv_cache.py, --kv-cache-dtype int8) holds each token's K and V rows of
 * every kv head as D int8 values q with one fp32 scale s per (token, kv head): the row is s * q
 * (symmetric absmax / 127, written by rtp_rope_store_kv). Decode attention multiplies the int8
 * values as they are and applies the scales once per key: a key's score is s_k * (q . k_int8),
 * and a value's probability p becomes p * s_v before the value row is accumulated. (Rounding the
 * query to int16 for vpmaddwd products was no faster in a noisy A/B here, so it stays out.) */
typedef struct {
    const char *k, *v;       /* K and V rows of slot s, kv head h: at s * tok_bytes + h * head_bytes */
    int64_t tok_bytes, head_bytes;
    const float *ks, *vs;    /* int8 caches: their scales, slot s, kv head h at s * hkv + h; else NULL */
    int64_t hkv, block_size;
} kv_view;

/* 16 int8 at p as 16 fp32 (exact). */
TARGET static inline __m512 i8x16_to_f32(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Addresses of the K and V rows of keys [t0, min(t0 + KEYS, len)) of kv head h, and with an int8
 * cache their scales (0 past the last key): one division per call, not one per key. Returns
 * their count. */
static inline __attribute__((always_inline)) int64_t key_rows(const kv_view *kv, const int32_t *table, int64_t h,
                                                              int64_t t0, int64_t len, const char **kp,
                                                              const char **vp, float *ks, float *vs, const int I8) {
    int64_t n = len - t0 < KEYS ? len - t0 : KEYS;
    if (n <= 0) return 0;
    int64_t blk = t0 / kv->block_size, off = t0 - blk * kv->block_size, head = h * kv->head_bytes;
    /* within a block the slots run on: a key's rows are the last key's plus a token, and the block
     * table is read (and the slot multiplied out) once a block rather than once a key. The same
     * addresses; on AMD Zen 4 (tools/bench_decode_attention.py, alternated three times) 64 rows x
     * 1,024 keys from memory 2.32-2.39 -> 2.12-2.23 ms a layer, 4 x 256 on one thread from L2
     * 0.053-0.054 -> 0.050-0.052 */
    int64_t slot = 0, at = 0; /* at: the key's rows' byte offset in the K and V caches */
    for (int64_t i = 0; i < n; i++, slot++, at += kv->tok_bytes) {
        if (i == 0 || off == 0) { /* the first key, or a block's first slot */
            slot = (int64_t)table[blk] * kv->block_size + off;
            at = slot * kv->tok_bytes + head;
        }
        kp[i] = kv->k + at;
        vp[i] = kv->v + at;
        if (I8) {
            ks[i] = kv->ks[slot * kv->hkv + h];
            vs[i] = kv->vs[slot * kv->hkv + h];
        }
        if (++off == kv->block_size) {
            off = 0;
            blk++;
        }
    }
    if (I8)
        for (int64_t i = n; i < KEYS; i++) ks[i] = vs[i] = 0.0f;
    return n;
}

/* Prefetch the `bytes` bytes of a K or V row. */
TARGET static inline void prefetch_row(const char *row, int64_t bytes, int hint_l2) {
    for (int64_t c = 0; c < bytes; c += 64) {
        if (hint_l2) rtp_prefetch_l2(row + c);
        else rtp_prefetch_l1(row + c);
    }
}

/* The 32 elements of chunk c of a K or V row as two fp32 vectors: for bf16 the even/odd split
 * below, for int8 (I8) elements 0-15 and 16-31 as they lie (a sign extension converts them in
 * order as cheaply). The query and the output use the same layout as the keys and values. */
TARGET static inline __attribute__((always_inline)) void row_chunk(const char *row, int64_t c, __m512 *lo,
                                                                   __m512 *hi, const int I8) {
    if (I8) {
        *lo = i8x16_to_f32((const int8_t *)row + 32 * c);
        *hi = i8x16_to_f32((const int8_t *)row + 32 * c + 16);
    } else {
        bf16x32_split((const uint16_t *)row + 32 * c, lo, hi);
    }
}

/* Long rows: a row past RTP_ATTN_PART keys is attended in parts of at most that many keys, as tasks of their
 * own so one long row keeps every thread busy, each part's state written as RTP_ATTN_PART_FLOATS(G, D)
 * floats per kv head (m and l of its G query heads, base 2, padded to 16 floats; then their G x D
 * unnormalized outputs in dim order), then merged. Parts are set by positions alone, so a row's
 * output does not depend on its batch (speculative verification relies on it). */
#define RTP_ATTN_PART 512
#define RTP_ATTN_PART_OUT(G) ((2 * (G) + 15) / 16 * 16)  /* where a part's outputs start */
#define RTP_ATTN_PART_FLOATS(G, D) (RTP_ATTN_PART_OUT(G) + (G) * (D))
/* The parts of a row of len keys past RTP_ATTN_PART: as many as it takes at most RTP_ATTN_PART keys each,
 * made even (so that the parts of a lone row split evenly over two threads) and of equal size: a row of
 * 700 keys goes 350 + 350 rather than 512 + 188, of 1,100 275 x 4. Set by the row's length alone. */
static inline int64_t attention_parts(int64_t len) {
    int64_t n = (len + RTP_ATTN_PART - 1) / RTP_ATTN_PART;
    return n > 1 ? n + n % 2 : n;
}
static inline int64_t attention_part_keys(int64_t len) {
    int64_t n = attention_parts(len);
    return n > 1 ? (len + n - 1) / n : RTP_ATTN_PART;
}

/* The first key a row of len keys attends (window 0: no sliding window). */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* The next task's keys, streamed into L2 while this task computes. A row's K and V rows of every kv head
 * (768 bytes a token for SmolLM2) are read from memory by its first kv head and from L2 by the others, so
 * with each task pulling its own tokens, memory sat idle through two thirds of every task and the first
 * head's loop waited on it. Each thread claims its next task before it starts the current one
 * (rtp_paged_decode_attention_bf16) and spreads the next task's tokens over the current task's score loops,
 * at the pace of its key visits, so the next task finds them in L2 and memory streams throughout. */
typedef struct {
    const int32_t *table;   /* the next task's block table */
    int64_t start, at, end; /* the next task's first token, the next to prefetch, one past its last */
    int64_t visits, done;   /* this task's key visits (kv heads x keys), and those made so far */
} key_stream;

/* Prefetch the next task's tokens [s->at, upto) into L2: every kv head's K and V rows (and an int8
 * cache's scales). */
TARGET static inline void stream_tokens(key_stream *s, const kv_view *kv, int64_t upto) {
    if (upto > s->end) upto = s->end;
    for (; s->at < upto; s->at++) {
        int64_t blk = s->at / kv->block_size;
        int64_t slot = (int64_t)s->table[blk] * kv->block_size + (s->at - blk * kv->block_size);
        for (int64_t c = 0; c < kv->tok_bytes; c += 64) {
            rtp_prefetch_l2(kv->k + slot * kv->tok_bytes + c);
            rtp_prefetch_l2(kv->v + slot * kv->tok_bytes + c);
        }
        if (kv->ks) {
            rtp_prefetch_l2(kv->ks + slot * kv->hkv);
            rtp_prefetch_l2(kv->vs + slot * kv->hkv);
        }
    }
}

/* One (row, kv head) task. Always inlined into call sites with constant G, NC and I8, so the
 * compiler unrolls the head and dimension loops and keeps the accumulators in registers
 * (with them as variables every accumulator lived on the stack: 3x slower).
 *
 * The K/V stream is prefetched a key at a time among the math, never in bursts: a burst of a
 * chunk's 32 lines outran the core's 16 line-fill buffers and stalled everything behind it
 * (40 % of the kernel's samples sat on prefetch instructions). The dot products, long on
 * math, carry the next chunk's K rows and this chunk's V rows; the values pass, short on math,
 * carries the next kv head's K rows of the same keys (next_head: the task goes on to it). */
TARGET static inline __attribute__((always_inline)) void attend_task(
        const uint16_t *q, const kv_view *kv, const int32_t *table, int64_t len, int64_t k_lo, int64_t k_hi,
        uint16_t *o, float *part, int64_t b, int64_t h, int64_t H, int64_t D, float scale, int64_t window, float softcap,
        const int64_t G, const int64_t NC, int next_head, int ahead, key_stream *stream, const int I8,
        __m512 *acc) {
    int64_t first = window_start(len, window);
    if (first < k_lo) first = k_lo; /* a part of a long row (RTP_ATTN_PART): its keys alone */
    int64_t row_bytes = kv->head_bytes;
    /* AHEAD_TOKENS: the task's first of several kv heads streams whole tokens (every head's K and V
     * rows) into L2, AHEAD chunks of keys on; the other heads then find them there. On AMD Zen 4,
     * where a chunk's math is shorter than a trip to DRAM, 64 rows at 256 keys: 1.13-1.19 -> 0.82-0.85
     * ms a layer (AHEAD 1: 0.89-0.92, 4: 0.93-0.98), 4 rows at 2,048: 0.67 -> 0.43 ms; 16 rows at
     * 2,048 unchanged. AHEAD_OWN: a task of one kv head (a lone short row, split by head) streams its
     * own rows so, where only the next chunk's were prefetched and every chunk waited on DRAM: one row
     * of 256 keys from memory (a /tmp driver over 300 layers' caches, two threads) 20.5-22.3 -> 11.2-11.5
     * us a layer, of 128 and 512 keys 1.5-1.9x alike (AHEAD 4: slower). Not measured on the Intel AMX
     * machine, where prefetch bursts outran the line fill buffers (above): off there
     * (rtp_paged_decode_attention_bf16) until they are. */
    int own = ahead == AHEAD_OWN;
    int prefetch_ahead = own || (ahead == AHEAD_TOKENS && next_head && h == 0);
    const __m512 capv = _mm512_set1_ps(softcap), inv_capv = _mm512_set1_ps(softcap > 0.0f ? 1.0f / softcap : 0.0f);
    /* The query: for a bf16 cache as it lies, 32 bf16 a chunk, whose dot products with a key's row take
     * vdpbf16ps (two exact products a lane, summed in fp32; the scale goes on the summed scores); for
     * an int8 cache (I8) scaled fp32 in the keys' layout (row_chunk), for fp32 FMAs. The output
     * accumulators are in the values' layout (row_chunk). */
    __m512bh qb[MAX_GROUP][MAX_DIM / 32];
    __m512 qe[MAX_GROUP][MAX_DIM / 32], qo[MAX_GROUP][MAX_DIM / 32];
    /* The output accumulators stay in registers only when GCC can split them into scalars: acc is the
     * caller's 2 G NC vectors, sized for the constant G and NC it inlines this with (arrays sized for
     * MAX_GROUP and MAX_DIM, 16 KiB, were past its limit), every loop over g that touches them is
     * unrolled (constant indices), and no libm call sits in the span loop (below). Before, every FMA
     * of the values pass loaded and stored its accumulator on the stack: from L2, one thread, 16 rows x
     * 512 keys 0.39-0.41 -> 0.27-0.28 ms; 64 rows x 256 keys from memory 1.29-1.32 -> 1.01 ms. */
#define AE(g, c) acc[(g) * NC + (c)]
#define AO(g, c) acc[(G + (g)) * NC + (c)]
    float m[MAX_GROUP], l[MAX_GROUP];
    const __m512 scalev = _mm512_set1_ps(scale);
    #pragma GCC unroll 16
    for (int64_t g = 0; g < G; g++) {
        const uint16_t *qr = q + (b * H + h * G + g) * D;
        for (int64_t c = 0; c < NC; c++) {
            if (I8) {
                qe[g][c] = _mm512_mul_ps(bf16x16_to_f32(qr + 32 * c), scalev);
                qo[g][c] = _mm512_mul_ps(bf16x16_to_f32(qr + 32 * c + 16), scalev);
            } else {
                qb[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(qr + 32 * c));
            }
            AE(g, c) = AO(g, c) = _mm512_setzero_ps();
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    /* Keys go in spans of SPAN: all scores of a span first (16 at a time), then one softmax
     * update per span (max, exp and sum as whole-vector passes), then the values. An update
     * per 16 keys spent more time in its reduction chains than in the dot products. */
    for (int64_t s0 = first; s0 < k_hi; s0 += SPAN) {
        int64_t ns = k_hi - s0 < SPAN ? k_hi - s0 : SPAN;
        int64_t nch = (ns + KEYS - 1) / KEYS;
        __m512 sc[MAX_GROUP][SPAN / KEYS]; /* scores, then probabilities; 0 past the end */
        const char *kp[KEYS], *vp[KEYS], *nkp[KEYS], *nvp[KEYS];
        float ks[KEYS], vs[KEYS], nks[KEYS], nvs[KEYS]; /* int8: the keys' K and V scales */
        key_rows(kv, table, h, s0, s0 + ns, kp, vp, ks, vs, I8);
        for (int64_t ch = 0; ch < nch; ch++) {
            int64_t nt = ns - ch * KEYS < KEYS ? ns - ch * KEYS : KEYS;
            int64_t nn = key_rows(kv, table, h, s0 + (ch + 1) * KEYS, s0 + ns, nkp, nvp, nks, nvs, I8);
            const char *fkp[KEYS], *fvp[KEYS];
            int64_t ahead_at = s0 + (ch + AHEAD) * KEYS;
            int64_t nf = prefetch_ahead ? key_rows(kv, table, own ? h : 0, ahead_at, k_hi, fkp, fvp, NULL, NULL, 0) : 0;
            /* the next task's tokens this chunk streams: its share of them by this task's key visits */
            int64_t from = 0, quota = 0;
            if (stream) {
                int64_t total = stream->end - stream->start;
                stream->done += nt;
                from = stream->at;
                quota = (stream->done * total + stream->visits - 1) / stream->visits - (from - stream->start);
            }
            /* per key and query head a vector of partial dot products, summed 16 at once */
            __m512 part[MAX_GROUP][KEYS];
            for (int64_t i = 0; i < KEYS; i++) {
                if (i < nn) prefetch_row(nkp[i], row_bytes, 0);
                if (i < nt) prefetch_row(vp[i], row_bytes, 0);
                if (i < nf) {
                    prefetch_row(fkp[i], own ? row_bytes : kv->tok_bytes, 1);
                    prefetch_row(fvp[i], own ? row_bytes : kv->tok_bytes, 1);
                }
                if (quota > 0) stream_tokens(stream, kv, from + quota * (i + 1) / KEYS);
                if (i >= nt) {
                    for (int64_t g = 0; g < G; g++) part[g][i] = _mm512_setzero_ps();
                    continue;
                }
                if (!I8) {
                    __m512bh kr[MAX_DIM / 32];
                    for (int64_t c = 0; c < NC; c++) kr[c] = (__m512bh)_mm512_loadu_si512((const void *)(kp[i] + 64 * c));
                    for (int64_t g = 0; g < G; g++) {
                        __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), kr[0], qb[g][0]);
                        for (int64_t c = 1; c < NC; c++) d = _mm512_dpbf16_ps(d, kr[c], qb[g][c]);
                        part[g][i] = d;
                    }
                    continue;
                }
                __m512 ke[MAX_DIM / 32], ko[MAX_DIM / 32];
                for (int64_t c = 0; c < NC; c++) row_chunk(kp[i], c, &ke[c], &ko[c], I8);
                for (int64_t g = 0; g < G; g++) {
                    __m512 d = _mm512_mul_ps(qe[g][0], ke[0]);
                    d = _mm512_fmadd_ps(qo[g][0], ko[0], d);
                    for (int64_t c = 1; c < NC; c++) {
                        d = _mm512_fmadd_ps(qe[g][c], ke[c], d);
                        d = _mm512_fmadd_ps(qo[g][c], ko[c], d);
                    }
                    part[g][i] = d;
                }
            }
            __mmask16 valid = (__mmask16)((1u << nt) - 1);
            for (int64_t g = 0; g < G; g++) {
                __m512 s = sum16x16(part[g]);
                /* int8: each key's scale, once per score; bf16: the softmax scale */
                s = _mm512_mul_ps(s, I8 ? _mm512_loadu_ps(ks) : scalev);
                if (softcap > 0.0f) /* Gemma 2: cap * tanh(s / cap), 16 scores at once, before the mask */
                    s = softcap_ps(_mm512_mul_ps(s, inv_capv), capv);
                sc[g][ch] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
            }
            memcpy(kp, nkp, sizeof(kp));
            memcpy(vp, nvp, sizeof(vp));
            if (I8) memcpy(ks, nks, sizeof(ks));
        }
        __mmask16 last = (__mmask16)((1u << (ns - (nch - 1) * KEYS)) - 1);
        #pragma GCC unroll 16
        for (int64_t g = 0; g < G; g++) {
            /* no call to libm here (expf, fmaxf): a call clobbers every vector register, and with one
             * in the span loop GCC kept the value accumulators on the stack, a load and a store
             * around every FMA of the values pass */
            __m512 mx = _mm512_set1_ps(m[g]);
            for (int64_t ch = 0; ch < nch; ch++) mx = _mm512_max_ps(mx, sc[g][ch]);
            float mnew = _mm512_reduce_max_ps(mx);
            /* the first span: exp_ps(-inf) is e^-87, and it scales zeros */
            __m512 cv = exp_ps(_mm512_set1_ps(m[g] - mnew)), mv = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
            float corr = _mm512_cvtss_f32(cv);
            for (int64_t ch = 0; ch < nch; ch++) {
                __m512 p = exp_ps(_mm512_sub_ps(sc[g][ch], mv));
                if (ch == nch - 1) p = _mm512_maskz_mov_ps(last, p);
                sc[g][ch] = p;
                sum = _mm512_add_ps(sum, p);
            }
            l[g] = l[g] * corr + _mm512_reduce_add_ps(sum);
            m[g] = mnew;
            for (int64_t c = 0; c < NC; c++) {
                AE(g, c) = _mm512_mul_ps(AE(g, c), cv);
                AO(g, c) = _mm512_mul_ps(AO(g, c), cv);
            }
        }
        /* values: each read once, accumulated into all G outputs */
        key_rows(kv, table, h, s0, s0 + ns, kp, vp, ks, vs, I8);
        for (int64_t ch = 0; ch < nch; ch++) {
            int64_t nt = ns - ch * KEYS < KEYS ? ns - ch * KEYS : KEYS;
            key_rows(kv, table, h, s0 + (ch + 1) * KEYS, s0 + ns, nkp, nvp, nks, nvs, I8);
            if (I8) /* p s_v: the value scales ride on the probabilities, 16 at once */
                for (int64_t g = 0; g < G; g++) sc[g][ch] = _mm512_mul_ps(sc[g][ch], _mm512_loadu_ps(vs));
            for (int64_t i = 0; i < nt; i++) {
                if (next_head) prefetch_row(kv->k + (vp[i] - kv->v) + row_bytes, row_bytes, 1);
                __m512 ve[MAX_DIM / 32], vo[MAX_DIM / 32];
                for (int64_t c = 0; c < NC; c++) row_chunk(vp[i], c, &ve[c], &vo[c], I8);
                #pragma GCC unroll 16
                for (int64_t g = 0; g < G; g++) {
                    __m512 pi = _mm512_set1_ps(((const float *)&sc[g][ch])[i]);
                    for (int64_t c = 0; c < NC; c++) {
                        AE(g, c) = _mm512_fmadd_ps(pi, ve[c], AE(g, c));
                        AO(g, c) = _mm512_fmadd_ps(pi, vo[c], AO(g, c));
                    }
                }
            }
            memcpy(vp, nvp, sizeof(vp));
            if (I8) memcpy(vs, nvs, sizeof(vs));
        }
    }
    /* back to element order (bf16: interleave even and odd lanes), round to bf16 */
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    if (part) { /* a part's state (RTP_ATTN_PART, above): m in base 2, the sums, the outputs unnormalized */
        int64_t at = RTP_ATTN_PART_OUT(G);
        #pragma GCC unroll 16
        for (int64_t g = 0; g < G; g++) {
            part[g] = m[g] * 1.44269504088896341f;
            part[G + g] = l[g];
            for (int64_t c = 0; c < NC; c++) {
                _mm512_storeu_ps(part + at + g * D + 32 * c,
                                 I8 ? AE(g, c) : _mm512_permutex2var_ps(AE(g, c), lo, AO(g, c)));
                _mm512_storeu_ps(part + at + g * D + 32 * c + 16,
                                 I8 ? AO(g, c) : _mm512_permutex2var_ps(AE(g, c), hi, AO(g, c)));
            }
        }
        return;
    }
    #pragma GCC unroll 16
    for (int64_t g = 0; g < G; g++) {
        __m512 inv = _mm512_set1_ps(1.0f / l[g]);
        for (int64_t c = 0; c < NC; c++) {
            __m512 e = _mm512_mul_ps(AE(g, c), inv), od = _mm512_mul_ps(AO(g, c), inv);
            __m256bh r0 = _mm512_cvtneps_pbh(I8 ? e : _mm512_permutex2var_ps(e, lo, od));
            __m256bh r1 = _mm512_cvtneps_pbh(I8 ? od : _mm512_permutex2var_ps(e, hi, od));
            _mm256_storeu_si256((__m256i *)(o + g * D + 32 * c), (__m256i)r0);
            _mm256_storeu_si256((__m256i *)(o + g * D + 32 * c + 16), (__m256i)r1);
        }
    }
#undef AE
#undef AO
}

/* The calling thread's buffer for long rows' parts (scratch.h). */
static __thread rtp_scratch parts_scratch;

/* The parts [p_lo, p_hi) of one (row, kv head) merged into its G output rows (bf16): every part's sums
 * and outputs rescaled to the largest running max. acc: D floats of scratch. */
TARGET static void merge_attention_parts(const float *parts, int64_t part_stride, int64_t p_lo, int64_t p_hi,
                                         int64_t G, int64_t D, float *acc, uint16_t *out) {
    int64_t at = RTP_ATTN_PART_OUT(G);
    for (int64_t g = 0; g < G; g++) {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t p = p_lo; p < p_hi; p++) mx = fmaxf(mx, parts[p * part_stride + g]);
        memset(acc, 0, (size_t)D * sizeof(float));
        for (int64_t p = p_lo; p < p_hi; p++) {
            const float *st = parts + p * part_stride;
            float f = exp2f(st[g] - mx);
            sum += st[G + g] * f;
            __m512 fv = _mm512_set1_ps(f);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(acc + d,
                                 _mm512_fmadd_ps(_mm512_loadu_ps(st + at + g * D + d), fv, _mm512_loadu_ps(acc + d)));
        }
        __m512 inv = _mm512_set1_ps(1.0f / sum);
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(out + g * D + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + d), inv)));
    }
}

/* Decode attention's tasks: the short rows' (row, or row and kv head) first, then the long rows' parts
 * (RTP_ATTN_PART), each row's kv heads split alike. */
typedef struct {
    const int32_t *seq_lens;
    int64_t B, per_row, Hkv, nparts, short_tasks, window;
} attention_tasks;

typedef struct {
    int run;           /* whether the task attends keys; if not and zero, its row is empty: zeros out */
    int zero;
    int64_t b, h0, h1; /* its row and kv heads [h0, h1) */
    int64_t p;         /* its part of a long row, or -1 */
    int64_t len, k_lo, k_hi;
    int64_t first;     /* its first key: k_lo, or later where a sliding window starts later */
} attention_task;

static inline attention_task attention_task_at(const attention_tasks *ts, int64_t task) {
    attention_task t = {0};
    int64_t long_part = task >= ts->short_tasks, u = long_part ? task - ts->short_tasks : task;
    int64_t p = long_part ? u % ts->nparts : -1, ru = long_part ? u / ts->nparts : u;
    t.b = ru / ts->per_row;
    t.h0 = ts->per_row == 1 ? 0 : ru % ts->per_row;
    t.h1 = ts->per_row == 1 ? ts->Hkv : t.h0 + 1;
    t.p = p;
    t.len = ts->seq_lens[t.b];
    int64_t keys = attention_part_keys(t.len);
    t.k_lo = long_part ? p * keys : 0;
    if (!long_part) {
        if (ts->nparts && t.len > RTP_ATTN_PART) return t;
        if (t.len <= 0) {
            t.zero = t.h0 == 0;
            return t;
        }
    } else if (t.len <= RTP_ATTN_PART || t.k_lo >= t.len || t.k_lo + keys <= window_start(t.len, ts->window)) {
        return t; /* no keys of the row in this part */
    }
    t.k_hi = p >= 0 && t.k_lo + keys < t.len ? t.k_lo + keys : t.len;
    t.first = window_start(t.len, ts->window);
    if (t.first < t.k_lo) t.first = t.k_lo;
    t.run = 1;
    return t;
}

/* k_scales / v_scales NULL: bf16 caches; else int8 caches (kv_view above), the scales fp32 [slots, Hkv]
 * (token stride Hkv). tok_stride counts the cache's elements either way. softcap > 0: each scaled
 * score becomes softcap * tanh(score / softcap) before the softmax (Gemma 2's attention logit
 * softcapping); 0: none, and the test on it sits outside the dot products' loops. */
TARGET void rtp_paged_decode_attention_bf16(
        const uint16_t *q, const void *k_cache, const void *v_cache, int64_t tok_stride,
        const int32_t *block_tables, int64_t ldt, const int32_t *seq_lens, uint16_t *out,
        int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window,
        const float *k_scales, const float *v_scales, float softcap) {
    int64_t G = H / Hkv;
    int64_t nc = D / 32; /* D is a multiple of 32, at most MAX_DIM */
    int i8 = k_scales != NULL;
    int64_t esize = i8 ? 1 : 2;
    const kv_view kv = {(const char *)k_cache, (const char *)v_cache, tok_stride * esize, D * esize,
                        k_scales, v_scales, Hkv, block_size};
    /* rows past RTP_ATTN_PART keys: a task per (row, part), or (row, kv head, part) as short rows
     * split, merged after. tools/bench_decode_step.py at context 2,048: one row's attention
     * 2.72-2.84 -> 2.20-2.28 ms, 16 rows' 43.5-44.7 -> 40.3-41.4 ms; an int8 cache's one row
     * 2.24-2.36 -> 1.98-2.05 ms. (Both products on AMX tiles, P as bf16 hi + lo for fidelity, measured
     * no faster with the same parts: 2.14-2.17 and 42.5-43.7 ms. The KV reads bound it.) */
    int64_t max_long = 0, max_len = 0, units = 0; /* units: the rows and long rows' parts, the tasks of whole rows */
    for (int64_t b = 0; b < B; b++) {
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
        if (seq_lens[b] > RTP_ATTN_PART && seq_lens[b] > max_long) max_long = seq_lens[b];
        units += seq_lens[b] > RTP_ATTN_PART ? attention_parts(seq_lens[b]) : 1;
    }
    int64_t nparts = attention_parts(max_long), part_stride = RTP_ATTN_PART_FLOATS(G, D);
    int64_t row_stride = Hkv * nparts * part_stride;
    float *parts = nparts ? rtp_scratch_get(&parts_scratch, (size_t)(B * row_stride) * sizeof(float)) : NULL;
    if (!parts) { /* no memory for the parts: whole rows, as short ones */
        nparts = 0;
        units = B;
    }
    int whole_tokens = !rtp_amx_supported(); /* attend_task's token prefetch: measured on AMD Zen 4 only */
    /* One task per row (or part of a long row), its kv heads in turn: a token's K (and V) row of all
     * heads is one contiguous run, so the row's blocks stream through whole (a task per head read a
     * third of each run and got 9 GB/s from DRAM; per row, more). With fewer such tasks than threads,
     * one task per (row, kv head) instead, or a lone row would leave threads idle. Where the tokens
     * are streamed (whole_tokens), a task per row wins as soon as every thread has one: on AMD Zen 4,
     * alternated in one process, 30 layers from memory, 1.31-1.78x at 1-3 rows of 256-4,096 keys (one
     * row of 2,048 keys 0.195 -> 0.121 ms a layer; 2 rows of 256 0.029 -> 0.021), the same bits; a
     * lone short row stays split by head (1.2-1.4x faster so). Since a task of one head streams its own
     * rows (AHEAD_OWN), split by head up to two tasks a thread too once rows reach 256 keys, where a whole-row
     * task could stream nothing ahead but its first head's tokens: (a /tmp driver, caches past L3) 2 rows
     * of 256 keys 20.2-20.3 -> 16.3-16.5 us a layer, of 512 40.6-42.5 -> 27.6-30.4, 3 rows 1.2x alike,
     * one row of 1,024 keys (two parts) 39.4-40.6 -> 32.9-34.2; at 128 keys level, at 64 slower (6.8 ->
     * 8.0), from three a thread slower or level. On the Intel AMX machine, where nothing is streamed and
     * this rule is not measured, a task per row from two rows per thread, as before. */
    int64_t threads = omp_get_max_threads();
    int by_head = whole_tokens ? units < threads || (units < 2 * threads && max_len >= 256) : B < 2 * threads;
    int64_t per_row = by_head ? Hkv : 1;
    int64_t short_tasks = B * per_row;
    /* a task streams the next one's tokens (key_stream) where tasks are whole rows, as whole_tokens */
    int stream_next = whole_tokens && per_row == 1;
    int64_t ntasks = short_tasks + B * per_row * nparts, next_task = 0;
    const attention_tasks tasks = {seq_lens, B, per_row, Hkv, nparts, short_tasks, window};
#pragma omp parallel
    {
        unsigned csr = rtp_flush_denormals();
        /* dynamic scheduling a task at a time, each thread one claim ahead, so that it knows its next task */
        int64_t cur = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
        int streamed = 0; /* whether cur's tokens were streamed by the task before */
        while (cur < ntasks) {
            int64_t nxt = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
            attention_task t = attention_task_at(&tasks, cur), following = {0};
            if (nxt < ntasks) following = attention_task_at(&tasks, nxt);
            key_stream ks = {0}, *stream = NULL;
            if (stream_next && t.run && following.run) {
                ks.start = ks.at = following.first;
                ks.end = following.k_hi;
                ks.visits = (t.h1 - t.h0) * (t.k_hi - t.first);
                ks.table = block_tables + following.b * ldt;
                if (ks.end > ks.start && ks.visits > 0) stream = &ks;
            }
            if (!t.run && t.zero) memset(out + t.b * H * D, 0, (size_t)(H * D) * sizeof(uint16_t));
            for (int64_t h = t.h0; t.run && h < t.h1; h++) {
                int64_t b = t.b, len = t.len, k_lo = t.k_lo, k_hi = t.k_hi, p = t.p;
                const int32_t *table = block_tables + b * ldt;
                uint16_t *o = out + (b * H + h * G) * D;
                float *part = p >= 0 ? parts + b * row_stride + (h * nparts + p) * part_stride : NULL;
                /* a streamed task's tokens are in L2 already */
                int ahead = !whole_tokens || streamed ? AHEAD_NONE : per_row == 1 ? AHEAD_TOKENS : AHEAD_OWN;
/* each call site holds its accumulators (attend_task's acc), sized for its constant G and NC */
#define ATTEND_WITH(g, n, ACC_VECTORS)                                                                          \
    do {                                                                                                        \
        __m512 acc[ACC_VECTORS];                                                                                \
        if (i8)                                                                                                 \
            attend_task(q, &kv, table, len, k_lo, k_hi, o, part, b, h, H, D, scale, window, softcap, g, n,      \
                        h + 1 < t.h1, ahead, stream, 1, acc);                                                   \
        else                                                                                                    \
            attend_task(q, &kv, table, len, k_lo, k_hi, o, part, b, h, H, D, scale, window, softcap, g, n,      \
                        h + 1 < t.h1, ahead, stream, 0, acc);                                                   \
    } while (0)
#define ATTEND(g, n) ATTEND_WITH(g, n, 2 * (g) * (n))
                /* head_dim 64 or 128 with the usual group sizes get their own unrolled copy */
                switch (G * 16 + nc) {
                case 1 * 16 + 2: ATTEND(1, 2); break;
                case 2 * 16 + 2: ATTEND(2, 2); break;
                case 3 * 16 + 2: ATTEND(3, 2); break;
                case 4 * 16 + 2: ATTEND(4, 2); break;
                case 5 * 16 + 2: ATTEND(5, 2); break;
                case 6 * 16 + 2: ATTEND(6, 2); break;
                case 8 * 16 + 2: ATTEND(8, 2); break;
                case 1 * 16 + 4: ATTEND(1, 4); break;
                case 2 * 16 + 4: ATTEND(2, 4); break;
                case 4 * 16 + 4: ATTEND(4, 4); break;
                case 6 * 16 + 4: ATTEND(6, 4); break;
                case 8 * 16 + 4: ATTEND(8, 4); break;
                default: ATTEND_WITH(G, nc, 2 * MAX_GROUP * (MAX_DIM / 32)); break;
                }
            }
#undef ATTEND
#undef ATTEND_WITH
            streamed = stream != NULL;
            cur = nxt;
        }
#pragma omp barrier
        if (nparts) {
            float acc[MAX_DIM] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < B * Hkv; task++) {
                int64_t b = task / Hkv, h = task % Hkv, len = seq_lens[b];
                if (len <= RTP_ATTN_PART) continue;
                /* the parts holding the row's keys: those the part loop above did not skip */
                int64_t keys = attention_part_keys(len);
                int64_t p_lo = window_start(len, window) / keys, p_hi = (len + keys - 1) / keys;
                merge_attention_parts(parts + b * row_stride + h * nparts * part_stride, part_stride, p_lo, p_hi, G, D,
                                      acc, out + (b * H + h * G) * D);
            }
        }
        rtp_restore_denormals(csr);
    }
}
#endif

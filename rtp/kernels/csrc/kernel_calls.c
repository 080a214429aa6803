/* Kernel calls as data: what lets a decode step run with no Python between its kernels.
 *
 * A call is RTP_CALL_WORDS int64 words: word 0 names the kernel (RTP_OP_*), the words after
 * it are the kernel's arguments in its own order (addresses and integers as int64, floats as
 * the bits of a double). rtp/kernels/_cpu_kernels.pyx builds one per call it makes and can record
 * them; rtp/kernels/cpu_graph.py captures a decode step's calls once and replays them through
 * rtp_run_calls, like a CUDA graph replays a stream's launches. Eager calls go through the
 * same rtp_run_call, so a replay runs exactly what the capture ran.
 */
#include "cpu_kernels.h"

#include <string.h>
#include <time.h>

static inline float arg_float(int64_t word) {
    double v;
    memcpy(&v, &word, sizeof v);
    return (float)v;
}

#define P(i) ((void *)(intptr_t)c[i])

/* A tile-order linear (words 1-13 rtp_gemm_avx's arguments): on AMX where word 14 says so, else
 * AVX-512. Word 15: the rows before it are multiplied in bf16 even where the kind takes int8 rows
 * (--activation-dtype int8-prefill: a step's decode rows come first, its prompt rows after; word 16
 * set: a step graph's replay puts the step's decode rows there). Rows are independent in every
 * tile kernel, so the two halves give each row the bits it would get in a call of its own kind. */
static int linear_tiles(const int64_t *c) {
    int kind = (int)c[4];
    int64_t M = c[10], bf16_rows = c[15] < M ? c[15] : M;
    if (c[14])
        return rtp_linear_amx(P(1), c[2], (int)c[3], kind, P(5), P(6), P(7), c[8], (int)c[9], M, c[11], c[12],
                              (int)c[13]);
    if (bf16_rows <= 0 || rtp_record_kind(kind) == kind)
        return rtp_gemm_avx(P(1), c[2], (int)c[3], kind, P(5), P(6), P(7), c[8], (int)c[9], M, c[11], c[12],
                            (int)c[13]);
    if (!rtp_gemm_avx(P(1), c[2], (int)c[3], rtp_record_kind(kind), P(5), P(6), P(7), c[8], (int)c[9], bf16_rows,
                      c[11], c[12], (int)c[13]))
        return 0;
    if (bf16_rows == M) return 1;
    const char *x = (const char *)P(1) + bf16_rows * c[2] * (c[3] ? 4 : 2);
    char *out = (char *)P(7) + bf16_rows * c[8] * (c[9] ? 2 : 4);
    return rtp_gemm_avx(x, c[2], (int)c[3], kind, P(5), P(6), out, c[8], (int)c[9], M - bf16_rows, c[11], c[12],
                        (int)c[13]);
}

int rtp_run_call(const int64_t *c) {
    switch (c[0]) {
    case RTP_OP_LINEAR_Q4_1:
        return rtp_linear_q4_1(P(1), c[2], P(3), P(4), P(5), P(6), P(7), c[8], (int)c[9], c[10], c[11], c[12]);
    case RTP_OP_LINEAR_Q8:
        rtp_linear_q8(P(1), c[2], P(3), P(4), P(5), (int)c[6], P(7), P(8), c[9], (int)c[10], c[11], c[12], c[13]);
        return 1;
    case RTP_OP_LINEAR_TILES:
        return linear_tiles(c);
    case RTP_OP_ADD_RMS_NORM:
        rtp_add_rms_norm(P(1), c[2], P(3), (int)c[4], c[5], P(6), (int)c[7], arg_float(c[8]), P(9), (int)c[10],
                         c[11], c[12], c[13]);
        return 1;
    case RTP_OP_ROPE_STORE_KV:
        return rtp_rope_store_kv(P(1), c[2], P(3), P(4), c[5], P(6), P(7), P(8), c[9], P(10), c[11], c[12], c[13],
                                 c[14], c[15], P(16), P(17));
    case RTP_OP_DECODE_ATTENTION:
        rtp_paged_decode_attention_bf16(P(1), P(2), P(3), c[4], P(5), c[6], P(7), P(8), c[9], c[10], c[11], c[12],
                                        c[13], arg_float(c[14]), c[15], P(16), P(17), arg_float(c[18]));
        return 1;
    case RTP_OP_EMBED_ROWS:
        rtp_embed_rows(P(1), (int)c[2], c[3], P(4), P(5), c[6], c[7], c[8], arg_float(c[9]));
        return 1;
    case RTP_OP_SILU_MUL:
        rtp_silu_mul(P(1), c[2], P(3), c[4], c[5], c[6]);
        return 1;
    case RTP_OP_PREFILL_ATTENTION:
        return rtp_prefill_attention_bf16(P(1), P(2), P(3), c[4], P(5), P(6), P(7), c[8], c[9], c[10], P(11), c[12],
                                          c[13], c[14], c[15], arg_float(c[16]), c[17], (int)c[18], P(19), P(20),
                                          arg_float(c[21]));
    case RTP_OP_GATHER_ROWS:
        rtp_gather_rows(P(1), c[2], P(3), c[4], P(5), c[6], c[7]);
        return 1;
    case RTP_OP_LINEAR_Q4_K:
        return rtp_linear_q4_k(P(1), c[2], P(3), P(4), P(5), P(6), P(7), c[8], (int)c[9], c[10], c[11], c[12]);
    case RTP_OP_LINEAR_BF16:
        rtp_linear_bf16(P(1), c[2], (int)c[3], P(4), c[5], P(6), P(7), c[8], (int)c[9], c[10], c[11], c[12]);
        return 1;
    case RTP_OP_LINEAR_U8:
        return rtp_linear_u8(P(1), c[2], (int)c[3], P(4), P(5), P(6), (int)c[7], (int)c[8], P(9), P(10), c[11],
                             (int)c[12], c[13], c[14], c[15]);
    case RTP_OP_RMS_NORM:
        rtp_rms_norm(P(1), c[2], (int)c[3], P(4), (int)c[5], arg_float(c[6]), P(7), c[8], (int)c[9], c[10], c[11]);
        return 1;
    case RTP_OP_QK_RMS_NORM:
        rtp_qk_rms_norm(P(1), c[2], P(3), P(4), (int)c[5], arg_float(c[6]), c[7], c[8], c[9], c[10]);
        return 1;
    case RTP_OP_GELU_TANH_MUL:
        rtp_gelu_tanh_mul(P(1), c[2], P(3), c[4], c[5], c[6]);
        return 1;
    case RTP_OP_SOFTCAP:
        rtp_softcap(P(1), c[2], arg_float(c[3]), c[4], c[5]);
        return 1;
    }
    return 0;
}

#undef P

/* The word of an op's calls that holds its row count (tokens, batch rows). */
int rtp_call_rows_word(int64_t op) {
    switch (op) {
    case RTP_OP_LINEAR_Q4_1: return 10;
    case RTP_OP_LINEAR_Q8: return 11;
    case RTP_OP_LINEAR_TILES: return 10;
    case RTP_OP_ADD_RMS_NORM: return 12;
    case RTP_OP_ROPE_STORE_KV: return 11;
    case RTP_OP_DECODE_ATTENTION: return 9;
    case RTP_OP_EMBED_ROWS: return 7;
    case RTP_OP_SILU_MUL: return 5;
    case RTP_OP_GATHER_ROWS: return 4;
    case RTP_OP_LINEAR_Q4_K: return 10;
    case RTP_OP_LINEAR_BF16: return 10;
    case RTP_OP_LINEAR_U8: return 13;
    case RTP_OP_RMS_NORM: return 10;
    case RTP_OP_QK_RMS_NORM: return 7;
    case RTP_OP_GELU_TANH_MUL: return 5;
    case RTP_OP_SOFTCAP: return 4;
    }
    return 0;
}

/* Runs n calls in order, each over `rows` rows (rows <= 0: as recorded). A step's rows are
 * independent in every kernel here, so calls captured over R rows serve any batch of up to R
 * rows whose inputs sit in the first rows of the same buffers. More rows than a call was
 * recorded with fail that call before it runs: its buffers (a graph's arena) hold only R rows,
 * and the kernel would write past them. ns, when not NULL, receives each call's wall time in
 * nanoseconds (tools/bench_decode_step.py). Returns n, or the index of the call that failed. */
int64_t rtp_run_calls(const int64_t *calls, int64_t n, int64_t rows, int64_t *ns) {
    int64_t c[RTP_CALL_WORDS];
    struct timespec start, end;
    for (int64_t i = 0; i < n; i++) {
        memcpy(c, calls + i * RTP_CALL_WORDS, sizeof c);
        int w = rtp_call_rows_word(c[0]);
        if (rows > 0 && w) {
            if (rows > c[w]) return i;
            c[w] = rows;
        }
        if (ns) clock_gettime(CLOCK_MONOTONIC, &start);
        if (!rtp_run_call(c)) return i;
        if (ns) {
            clock_gettime(CLOCK_MONOTONIC, &end);
            ns[i] = (int64_t)(end.tv_sec - start.tv_sec) * 1000000000 + (end.tv_nsec - start.tv_nsec);
        }
    }
    return n;
}

/* Runs n calls of a step graph (rtp/kernels/cpu_graph.py) over this step's counts: counts[class]
 * (tokens, samples, decode rows, prefill rows; indexed by RTP_COUNT_*) replaces the rows word of
 * every call whose class names one (classes[i]; RTP_COUNT_AS_RECORDED: none), decode attention takes
 * the decode rows as its batch, and prefill attention the prefill rows, which follow the decode rows
 * in the plan; a tile linear that multiplies prompt rows only as int8 takes the decode rows as its
 * bf16 rows; the sampling rows' calls of a graph captured both ways run for one sample or for several
 * (RTP_ONE_SAMPLE, RTP_SEVERAL_SAMPLES). Tokens and samples may not exceed what a call was recorded with (its buffers in the
 * graph's arena hold that many rows); decode and prefill rows index the plan's arrays, which the
 * caller checks against the plan. Returns n, or the index of the call that failed. */
int64_t rtp_run_step_calls(const int64_t *calls, int64_t n, const int8_t *classes, const int64_t *counts,
                           int64_t *ns) {
    int64_t c[RTP_CALL_WORDS];
    struct timespec start, end;
    for (int64_t i = 0; i < n; i++) {
        int k = classes[i];
        if (k == RTP_SEVERAL_SAMPLES || k == RTP_ONE_SAMPLE) {
            if ((counts[RTP_COUNT_SAMPLES] == 1) != (k == RTP_ONE_SAMPLE)) continue;
            k = k == RTP_ONE_SAMPLE ? RTP_COUNT_AS_RECORDED : RTP_COUNT_SAMPLES;
        }
        memcpy(c, calls + i * RTP_CALL_WORDS, sizeof c);
        if (c[0] == RTP_OP_DECODE_ATTENTION) {
            c[9] = counts[RTP_COUNT_DECODE_ROWS];
        } else if (c[0] == RTP_OP_PREFILL_ATTENTION) {
            c[9] = counts[RTP_COUNT_DECODE_ROWS];
            c[10] = counts[RTP_COUNT_PREFILL_ROWS];
        } else if (k != RTP_COUNT_AS_RECORDED) {
            int w = rtp_call_rows_word(c[0]);
            if (!w || counts[k] > c[w]) return i;
            c[w] = counts[k];
            if (c[0] == RTP_OP_LINEAR_TILES && c[16]) c[15] = counts[RTP_COUNT_DECODE_ROWS];
        }
        if (ns) clock_gettime(CLOCK_MONOTONIC, &start);
        if (!rtp_run_call(c)) return i;
        if (ns) {
            clock_gettime(CLOCK_MONOTONIC, &end);
            ns[i] = (int64_t)(end.tv_sec - start.tv_sec) * 1000000000 + (end.tv_nsec - start.tv_nsec);
        }
    }
    return n;
}

/* Bit i set: word i of the op's calls is an address (what a capture relocates). */
uint32_t rtp_call_address_words(int64_t op) {
    switch (op) {
    case RTP_OP_LINEAR_Q4_1: return 1u << 1 | 1u << 3 | 1u << 4 | 1u << 5 | 1u << 6 | 1u << 7;
    case RTP_OP_LINEAR_Q8: return 1u << 1 | 1u << 3 | 1u << 4 | 1u << 5 | 1u << 7 | 1u << 8;
    case RTP_OP_LINEAR_TILES: return 1u << 1 | 1u << 5 | 1u << 6 | 1u << 7;
    case RTP_OP_ADD_RMS_NORM: return 1u << 1 | 1u << 3 | 1u << 6 | 1u << 9;
    case RTP_OP_ROPE_STORE_KV: return 1u << 1 | 1u << 3 | 1u << 4 | 1u << 6 | 1u << 7 | 1u << 8 | 1u << 10 | 1u << 16
                                      | 1u << 17;
    case RTP_OP_DECODE_ATTENTION: return 1u << 1 | 1u << 2 | 1u << 3 | 1u << 5 | 1u << 7 | 1u << 8 | 1u << 16
                                         | 1u << 17;
    case RTP_OP_EMBED_ROWS: return 1u << 1 | 1u << 4 | 1u << 5;
    case RTP_OP_SILU_MUL: return 1u << 1 | 1u << 3;
    case RTP_OP_PREFILL_ATTENTION: return 1u << 1 | 1u << 2 | 1u << 3 | 1u << 5 | 1u << 6 | 1u << 7 | 1u << 11
                                          | 1u << 19 | 1u << 20;
    case RTP_OP_GATHER_ROWS: return 1u << 1 | 1u << 3 | 1u << 5;
    case RTP_OP_LINEAR_Q4_K: return 1u << 1 | 1u << 3 | 1u << 4 | 1u << 5 | 1u << 6 | 1u << 7;
    case RTP_OP_LINEAR_BF16: return 1u << 1 | 1u << 4 | 1u << 6 | 1u << 7;
    case RTP_OP_LINEAR_U8: return 1u << 1 | 1u << 4 | 1u << 5 | 1u << 6 | 1u << 9 | 1u << 10;
    case RTP_OP_RMS_NORM: return 1u << 1 | 1u << 4 | 1u << 7;
    case RTP_OP_QK_RMS_NORM: return 1u << 1 | 1u << 3 | 1u << 4;
    case RTP_OP_GELU_TANH_MUL: return 1u << 1 | 1u << 3;
    case RTP_OP_SOFTCAP: return 1u << 1;
    }
    return 0;
}

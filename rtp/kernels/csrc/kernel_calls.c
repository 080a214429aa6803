/* Kernel calls as data: what lets a decode step run with no Python between its kernels.
 *
 * A call is RTP_CALL_WORDS int64 words: word 0 names the op (RTP_OP_*), the words after it are
 * the op's fields in its kernel's order (addresses and integers as int64, floats as the bits of
 * a double). rtp/kernels/ops.py defines every op once; rtp_ops[] (kernel_ops.c, generated from it)
 * gives each its trampoline, which reads the call's named fields, and the words a replay patches.
 * rtp/kernels/_cpu_kernels.pyx builds one call per kernel it runs and can record them;
 * rtp/kernels/cpu_graph.py captures a decode step's calls once and replays them through
 * rtp_run_calls, like a CUDA graph replays a stream's launches. Eager calls go through the
 * same rtp_run_call, so a replay runs exactly what the capture ran.
 */
#include "cpu_kernels.h"

#include <string.h>
#include <time.h>

/* The op a call with word 0 `code` runs, NULL for none. */
static inline const rtp_op *op_of(int64_t code) {
    return code > 0 && code < RTP_OP_COUNT && rtp_ops[code].run ? &rtp_ops[code] : NULL;
}

static inline int run(const rtp_call *c) {
    const rtp_op *op = op_of(c->words[0]);
    return op ? op->run(c) : 0;
}

int rtp_run_call(const int64_t *words) {
    rtp_call c;
    memcpy(c.words, words, sizeof c.words);
    return run(&c);
}

/* The word of an op's calls that holds its row count (tokens, batch rows). */
int rtp_call_rows_word(int64_t op) {
    const rtp_op *o = op_of(op);
    return o ? o->rows : 0;
}

/* Bit i set: word i of the op's calls is an address (what a capture relocates). */
uint32_t rtp_call_address_words(int64_t op) {
    const rtp_op *o = op_of(op);
    return o ? o->addresses : 0;
}

/* What the replay knows of an op (its entry in rtp_ops[]), NULL for no such op. */
const rtp_op *rtp_call_op(int64_t op) { return op_of(op); }

/* Runs n calls in order, each over `rows` rows (rows <= 0: as recorded). A step's rows are
 * independent in every kernel here, so calls captured over R rows serve any batch of up to R
 * rows whose inputs sit in the first rows of the same buffers. More rows than a call was
 * recorded with fail that call before it runs: its buffers (a graph's arena) hold only R rows,
 * and the kernel would write past them. ns, when not NULL, receives each call's wall time in
 * nanoseconds (tools/bench_decode_step.py). Returns n, or the index of the call that failed. */
int64_t rtp_run_calls(const int64_t *calls, int64_t n, int64_t rows, int64_t *ns) {
    rtp_call c;
    struct timespec start, end;
    for (int64_t i = 0; i < n; i++) {
        memcpy(c.words, calls + i * RTP_CALL_WORDS, sizeof c.words);
        int w = rtp_call_rows_word(c.words[0]);
        if (rows > 0 && w) {
            if (rows > c.words[w]) return i;
            c.words[w] = rows;
        }
        if (ns) clock_gettime(CLOCK_MONOTONIC, &start);
        if (!run(&c)) return i;
        if (ns) {
            clock_gettime(CLOCK_MONOTONIC, &end);
            ns[i] = (int64_t)(end.tv_sec - start.tv_sec) * 1000000000 + (end.tv_nsec - start.tv_nsec);
        }
    }
    return n;
}

/* The step's decode and prefill rows into the words the op takes them in. */
static inline void set_plan_rows(const rtp_op *o, rtp_call *c, const int64_t *counts) {
    if (o->decode_rows) c->words[o->decode_rows] = counts[RTP_COUNT_DECODE_ROWS];
    if (o->prefill_rows) c->words[o->prefill_rows] = counts[RTP_COUNT_PREFILL_ROWS];
}

/* Runs n calls of a step graph (rtp/kernels/cpu_graph.py) over this step's counts: counts[class]
 * (tokens, samples, decode rows, prefill rows; indexed by RTP_COUNT_*) replaces the rows word of
 * every call whose class names one (classes[i]; RTP_COUNT_AS_RECORDED: none). An op whose rows are the
 * plan's (rtp_op.decode_rows / prefill_rows, always: decode attention takes the decode rows as its
 * batch, prefill attention the prefill rows, which follow the decode rows in the plan) takes those
 * instead of its class's count; one whose plan field holds only where a flag word is set (a tile
 * linear that multiplies prompt rows only as int8 takes the decode rows as its bf16 rows) takes it
 * after its class's count. The sampling rows' calls of a graph captured both ways run for one sample
 * or for several (RTP_ONE_SAMPLE, RTP_SEVERAL_SAMPLES). Tokens and samples may not exceed what a call
 * was recorded with (its buffers in the graph's arena hold that many rows); decode and prefill rows
 * index the plan's arrays, which the caller checks against the plan. Returns n, or the index of the
 * call that failed. */
int64_t rtp_run_step_calls(const int64_t *calls, int64_t n, const int8_t *classes, const int64_t *counts,
                           int64_t *ns) {
    rtp_call c;
    struct timespec start, end;
    for (int64_t i = 0; i < n; i++) {
        int k = classes[i];
        if (k == RTP_SEVERAL_SAMPLES || k == RTP_ONE_SAMPLE) {
            if ((counts[RTP_COUNT_SAMPLES] == 1) != (k == RTP_ONE_SAMPLE)) continue;
            k = k == RTP_ONE_SAMPLE ? RTP_COUNT_AS_RECORDED : RTP_COUNT_SAMPLES;
        }
        memcpy(c.words, calls + i * RTP_CALL_WORDS, sizeof c.words);
        const rtp_op *o = op_of(c.words[0]);
        if (!o) return i;
        if ((o->decode_rows || o->prefill_rows) && !o->plan_when) {
            set_plan_rows(o, &c, counts);
        } else if (k != RTP_COUNT_AS_RECORDED) {
            int w = o->rows;
            if (!w || counts[k] > c.words[w]) return i;
            c.words[w] = counts[k];
            if (o->plan_when && c.words[o->plan_when]) set_plan_rows(o, &c, counts);
        }
        if (ns) clock_gettime(CLOCK_MONOTONIC, &start);
        if (!o->run(&c)) return i;
        if (ns) {
            clock_gettime(CLOCK_MONOTONIC, &end);
            ns[i] = (int64_t)(end.tv_sec - start.tv_sec) * 1000000000 + (end.tv_nsec - start.tv_nsec);
        }
    }
    return n;
}

/* Runs one kernel op of the Arm64 NEON path on operands from a file, through the op table exactly as a
 * CPU graph's replay runs it (rtp_run_call: kernel_ops.c's trampoline dispatching on the selected ISA path
 * to the op's _neon variant), for tests/kernels/test_arm_kernels.py, which builds this with every C file of
 * rtp/kernels/csrc/ for AArch64 (as setup.py builds the extension there) and runs it under qemu-aarch64.
 *
 *     harness OP IN OUT
 *
 * IN holds the op's fields in its prototype's order (rtp/kernels/ops.py), little-endian:
 *     int64 count, then per argument int64 kind and
 *         kind 0: int64 value         (an integer parameter of any width)
 *         kind 1: double value        (a float parameter)
 *         kind 2: int64 bytes, bytes  (a pointer parameter: the harness's copy of the buffer)
 *         kind 3: nothing             (a NULL pointer)
 * OUT receives int64 result (the call's status: 1 when the kernel ran and did not fail), int64
 * guards_intact (1 when no byte around any buffer was written), then every buffer's bytes after the
 * call, in argument order.
 *
 * OP is an op of the table, or argmax_rows / apply_token_bitmask (the sampler's kernels, called
 * directly through their dispatching entries), or "features": the ISA path selected (RTP_HARNESS_ISA:
 * 1 neon, 2 dotprod; else the CPU's highest). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#define GUARD 64    /* bytes of a known pattern on each side of a buffer */
#define PATTERN 0xa5
#define MAX_ARGS 32

typedef struct {
    int64_t kind, i, bytes;
    double f;
    unsigned char *base; /* the allocation: GUARD, the buffer, GUARD */
    void *p;
} arg;

static arg a[MAX_ARGS];
static int64_t nargs;

static void fail(const char *what) {
    fprintf(stderr, "harness: %s\n", what);
    exit(2);
}

static void read_exact(FILE *f, void *p, size_t n) {
    if (n && fread(p, 1, n, f) != n) fail("short input file");
}

static void read_args(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) fail("cannot open the input file");
    read_exact(f, &nargs, 8);
    if (nargs < 0 || nargs > MAX_ARGS) fail("bad argument count");
    for (int64_t k = 0; k < nargs; k++) {
        arg *x = &a[k];
        read_exact(f, &x->kind, 8);
        if (x->kind == 0) {
            read_exact(f, &x->i, 8);
        } else if (x->kind == 1) {
            read_exact(f, &x->f, 8);
        } else if (x->kind == 2) {
            read_exact(f, &x->bytes, 8);
            /* 64-byte aligned buffer, as torch's allocations are, with the guards around it */
            x->base = aligned_alloc(64, (size_t)(x->bytes + 2 * GUARD + 63) / 64 * 64);
            if (!x->base) fail("out of memory");
            memset(x->base, PATTERN, (size_t)(x->bytes + 2 * GUARD));
            x->p = x->base + GUARD;
            read_exact(f, x->p, (size_t)x->bytes);
        } else if (x->kind == 3) {
            x->p = NULL;
        } else {
            fail("bad argument kind");
        }
    }
    fclose(f);
}

static int guards_intact(void) {
    for (int64_t k = 0; k < nargs; k++) {
        if (a[k].kind != 2) continue;
        for (int g = 0; g < GUARD; g++)
            if (a[k].base[g] != PATTERN || a[k].base[GUARD + a[k].bytes + g] != PATTERN) return 0;
    }
    return 1;
}

static void write_result(const char *path, int64_t result) {
    FILE *f = fopen(path, "wb");
    if (!f) fail("cannot open the output file");
    int64_t intact = guards_intact();
    fwrite(&result, 8, 1, f);
    fwrite(&intact, 8, 1, f);
    for (int64_t k = 0; k < nargs; k++)
        if (a[k].kind == 2 && fwrite(a[k].p, 1, (size_t)a[k].bytes, f) != (size_t)a[k].bytes) fail("write failed");
    fclose(f);
}

/* Argument k as the parameter's type, checked against the kind the file gave it (an integer, a float, a
 * buffer or NULL), so that a test passing its arguments out of order fails here, not in a kernel. */
static int64_t arg_int(int k) {
    if (a[k].kind != 0) fail("an integer argument expected");
    return a[k].i;
}
static void *arg_ptr(int k) {
    if (a[k].kind != 2 && a[k].kind != 3) fail("a buffer argument expected");
    return a[k].p;
}
#define I(k) arg_int(k)
#define P(k) arg_ptr(k)

static void need(int64_t n) {
    if (nargs != n) fail("wrong argument count for the op");
}

/* The op's call: word 0 its code, then a word per field (an address, an integer, a float's double bits). */
static int64_t run_op(const rtp_op *o, int64_t code) {
    int64_t words[RTP_CALL_WORDS] = {0};
    if (nargs + 1 > o->words) fail("more arguments than the op has fields");
    words[0] = code;
    for (int64_t k = 0; k < nargs; k++) {
        int is_address = (o->addresses >> (k + 1)) & 1;
        if (a[k].kind == 0 && !is_address) words[k + 1] = a[k].i;
        else if (a[k].kind == 1 && !is_address) memcpy(&words[k + 1], &a[k].f, 8);
        else if ((a[k].kind == 2 || a[k].kind == 3) && is_address) words[k + 1] = (int64_t)(intptr_t)a[k].p;
        else fail("an argument of the wrong kind for the op's field");
    }
    return rtp_run_call(words);
}

int main(int argc, char **argv) {
    if (argc != 4) fail("usage: harness OP IN OUT");
    const char *op = argv[1];
    read_args(argv[2]);
    /* the path to run: RTP_HARNESS_ISA (1 neon, 2 dotprod), else the CPU's highest */
    const char *want = getenv("RTP_HARNESS_ISA");
    int most = want ? atoi(want) : RTP_ISA_UNAVAILABLE;
    if (rtp_select_isa(most) != (want ? most : rtp_cpu_isa())) fail("the path asked for is not this CPU's");
    int64_t r = 0;
    if (!strcmp(op, "features")) {
        need(0);
        r = rtp_isa;
    } else if (!strcmp(op, "argmax_rows")) {
        need(5);
        rtp_argmax_rows(P(0), I(1), I(2), I(3), P(4));
    } else if (!strcmp(op, "apply_token_bitmask")) {
        need(7);
        rtp_apply_token_bitmask(P(0), I(1), P(2), I(3), P(4), I(5), I(6));
    } else {
        int64_t code = 1;
        while (code < RTP_OP_COUNT && strcmp(rtp_ops[code].name, op)) code++;
        if (code == RTP_OP_COUNT) fail("unknown op");
        if (rtp_ops[code].isa > rtp_isa) fail("the op has no variant on this path in the table");
        r = run_op(&rtp_ops[code], code);
    }
    write_result(argv[3], r);
    return 0;
}

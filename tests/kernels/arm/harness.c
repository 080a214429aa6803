/* Runs one kernel of the Arm64 NEON path (rtp/kernels/csrc/arm/) on operands from a file, for
 * tests/kernels/test_arm_kernels.py, which builds this with the kernels for AArch64 and runs it under
 * qemu-aarch64.
 *
 *     harness OP IN OUT
 *
 * IN holds the kernel's arguments in its prototype's order (arm/arm_kernels.h), little-endian:
 *     int64 count, then per argument int64 kind and
 *         kind 0: int64 value         (an integer parameter of any width)
 *         kind 1: double value        (a float parameter)
 *         kind 2: int64 bytes, bytes  (a pointer parameter: the harness's copy of the buffer)
 *         kind 3: nothing             (a NULL pointer)
 * OUT receives int64 result (the kernel's int return, 0 for void kernels), int64 guards_intact (1 when no
 * byte around any buffer was written), then every buffer's bytes after the call, in argument order.
 *
 * OP "features" takes no arguments and returns 1 where the kernels were built with the dot-product
 * instructions (__ARM_FEATURE_DOTPROD), 0 where with plain NEON. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arm/arm_kernels.h"

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
static float arg_float(int k) {
    if (a[k].kind != 1) fail("a float argument expected");
    return (float)a[k].f;
}
static void *arg_ptr(int k) {
    if (a[k].kind != 2 && a[k].kind != 3) fail("a buffer argument expected");
    return a[k].p;
}
#define I(k) arg_int(k)
#define F(k) arg_float(k)
#define P(k) arg_ptr(k)

static void need(int64_t n) {
    if (nargs != n) fail("wrong argument count for the op");
}

int main(int argc, char **argv) {
    if (argc != 4) fail("usage: harness OP IN OUT");
    const char *op = argv[1];
    read_args(argv[2]);
    int64_t r = 0;
    if (!strcmp(op, "features")) {
        need(0);
#if defined(__ARM_FEATURE_DOTPROD)
        r = 1;
#endif
    } else if (!strcmp(op, "add_rms_norm")) {
        need(13);
        rtp_add_rms_norm_neon(P(0), I(1), P(2), I(3), I(4), P(5), I(6), F(7), P(8), I(9), I(10), I(11), I(12));
    } else if (!strcmp(op, "rms_norm")) {
        need(11);
        rtp_rms_norm_neon(P(0), I(1), I(2), P(3), I(4), F(5), P(6), I(7), I(8), I(9), I(10));
    } else if (!strcmp(op, "qk_rms_norm")) {
        need(10);
        rtp_qk_rms_norm_neon(P(0), I(1), P(2), P(3), I(4), F(5), I(6), I(7), I(8), I(9));
    } else if (!strcmp(op, "silu_mul")) {
        need(6);
        rtp_silu_mul_neon(P(0), I(1), P(2), I(3), I(4), I(5));
    } else if (!strcmp(op, "gelu_tanh_mul")) {
        need(6);
        rtp_gelu_tanh_mul_neon(P(0), I(1), P(2), I(3), I(4), I(5));
    } else if (!strcmp(op, "softcap")) {
        need(5);
        rtp_softcap_neon(P(0), I(1), F(2), I(3), I(4));
    } else if (!strcmp(op, "embed_rows")) {
        need(9);
        rtp_embed_rows_neon(P(0), I(1), I(2), P(3), P(4), I(5), I(6), I(7), F(8));
    } else if (!strcmp(op, "rope_store_kv")) {
        need(17);
        r = rtp_rope_store_kv_neon(P(0), I(1), P(2), P(3), I(4), P(5), P(6), P(7), I(8), P(9), I(10), I(11), I(12),
                                   I(13), I(14), P(15), P(16));
    } else if (!strcmp(op, "linear_bf16")) {
        need(12);
        rtp_linear_bf16_neon(P(0), I(1), I(2), P(3), I(4), P(5), P(6), I(7), I(8), I(9), I(10), I(11));
    } else if (!strcmp(op, "linear_q4_1")) {
        need(12);
        r = rtp_linear_q4_1_neon(P(0), I(1), P(2), P(3), P(4), P(5), P(6), I(7), I(8), I(9), I(10), I(11));
    } else if (!strcmp(op, "linear_q8")) {
        need(13);
        rtp_linear_q8_neon(P(0), I(1), P(2), P(3), P(4), I(5), P(6), P(7), I(8), I(9), I(10), I(11), I(12));
    } else if (!strcmp(op, "linear_u8")) {
        need(15);
        r = rtp_linear_u8_neon(P(0), I(1), I(2), P(3), P(4), P(5), I(6), I(7), P(8), P(9), I(10), I(11), I(12),
                               I(13), I(14));
    } else if (!strcmp(op, "argmax_rows")) {
        need(5);
        rtp_argmax_rows_neon(P(0), I(1), I(2), I(3), P(4));
    } else if (!strcmp(op, "apply_token_bitmask")) {
        need(7);
        rtp_apply_token_bitmask_neon(P(0), I(1), P(2), I(3), P(4), I(5), I(6));
    } else if (!strcmp(op, "decode_attention")) {
        need(18);
        rtp_paged_decode_attention_bf16_neon(P(0), P(1), P(2), I(3), P(4), I(5), P(6), P(7), I(8), I(9), I(10),
                                             I(11), I(12), F(13), I(14), P(15), P(16), F(17));
    } else if (!strcmp(op, "prefill_attention")) {
        need(21);
        r = rtp_prefill_attention_bf16_neon(P(0), P(1), P(2), I(3), P(4), P(5), P(6), I(7), I(8), I(9), P(10),
                                            I(11), I(12), I(13), I(14), F(15), I(16), I(17), P(18), P(19), F(20));
    } else {
        fail("unknown op");
    }
    write_result(argv[3], r);
    return 0;
}

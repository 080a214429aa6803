/* The integer-block form every int8 linear multiplies (avx2/linear_int8.c, avx512/linear_lanes.c,
 * arm/linear_int8.h): x's rows as blocks of 32 values, each with a scale d (its largest magnitude / X_STEPS) and
 * its values rounded (nearest even) to 15-bit q = 128 h + l, kept as two int8 halves h in [-127, 127] and l in
 * [-64, 63]; the weights as GGUF-style blocks of one of three kinds. Plain C: each path's quantizer and loops
 * are its own (avx2/int8_rows.h, the NEON one in arm/linear_int8.h). */
#ifndef RTP_INT8_BLOCKS_H
#define RTP_INT8_BLOCKS_H

#include <stdint.h>

#define X_STEPS 16256.0f /* 127 * 128: h = round(q / 128) stays in int8 */

/* Q_SIGNED16: int8 with a scale per 16 (q8_16); a kind per copy of the tiles, so no branch on it in their loop */
enum { Q_NIBBLES, Q_SIGNED, Q_SIGNED16 };

typedef struct {
    int kind;
    const uint8_t *q; /* Q_NIBBLES: [N, K / 2] (byte t of a block: weight t low, t + 16 high); else [N, K] */
    const float *d;   /* [N, K / 32], or [N, K / 16] for Q_SIGNED16 */
    const float *m;   /* [N, K / 32] or NULL */
    int64_t K;
} int8_weights;

/* x's rows as integer blocks: h and l [M, K] int8; d and s = d * sum(q) [M, K / 32]; qsum, where a kernel
 * needs it (the lane kernel's unsigned weights), the integer sums of q per 16 values [M, K / 16], else NULL. */
typedef struct {
    const int8_t *h, *l;
    const float *d, *s;
    const int32_t *qsum;
} int8_rows;

#endif

/* Decode attention on the avx2 path: one bf16 query token per row over the paged KV cache
 * (rtp_paged_decode_attention_bf16's contract: attention/decode_attention.c).
 *
 * q bf16 [B, H, D], out bf16 [B, H, D]; row b attends to its seq_lens[b] keys (its last `window` with
 * window > 0) through block_tables[b * ldt ...]; a row of length 0 (bucket padding) writes zeros. The
 * cache and the per-query math are paged_attention.h's.
 *
 * Threading: one task per (row, kv head), its G = H / Hkv query heads together so each K and V row is
 * read once for all of them; tasks go to threads dynamically. A row's keys are never split between
 * threads (the AVX-512 kernel's long-row parts are left out: their merge would tie a row's bits to how
 * its keys were parted), so a row's output is the same bits alone, in any batch, on any thread count,
 * and the same as prefill_attention.c gives its query at that position. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <omp.h>

#include "paged_attention.h"

AVX2_TARGET void rtp_paged_decode_attention_bf16_avx2(
        const uint16_t *q, const void *k_cache, const void *v_cache, int64_t tok_stride,
        const int32_t *block_tables, int64_t ldt, const int32_t *seq_lens, uint16_t *out,
        int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window,
        const float *k_scales, const float *v_scales, float softcap) {
    int64_t G = H / Hkv, esize = k_scales ? 1 : 2;
    const paged_kv kv = {(const char *)k_cache, (const char *)v_cache, tok_stride * esize, D * esize,
                         k_scales, v_scales, Hkv, block_size, D, scale, softcap, window};
#pragma omp parallel
    {
        unsigned csr = rtp_flush_denormals();
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * Hkv; task++) {
            int64_t b = task / Hkv, h = task % Hkv, len = seq_lens[b];
            uint16_t *o = out + (b * H + h * G) * D;
            if (len <= 0) {
                memset(o, 0, (size_t)(G * D) * sizeof(uint16_t));
                continue;
            }
            const query_run run = {q + (b * H + h * G) * D, o, H * D, len - 1, 1, G};
            attend_query_run(&kv, block_tables + b * ldt, h, &run);
        }
        rtp_restore_denormals(csr);
    }
}
#endif

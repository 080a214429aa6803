/* The AMX tile configuration rtp's kernels share (amx_linear.c, prefill_attention.c):
 * every tile they use is 16 rows of 64 bytes. */
#ifndef RTP_AMX_TILES_H
#define RTP_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) rtp_tile_config;

/* Tiles 0..n-1 as 16 rows of 64 bytes, the rest unused; per thread, before its first tile op. */
__attribute__((target("amx-tile"))) static inline void rtp_configure_tiles(int n) {
    rtp_tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < n; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    /* ldtilecfg with the whole 64-byte struct as its operand: GCC 12's _tile_loadconfig names
     * only its first 8 bytes, so the optimiser may drop the stores of rows and colsb (seen: a
     * config of garbage, then SIGSEGV or SIGILL at the first tile instruction). */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

#endif

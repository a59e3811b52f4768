/* The repack cache's checksum: crc32c (Castagnoli) in 4 lanes, computed as the file is read.
 *
 * The data is taken in chunks of KILN_SUM_CHUNK bytes (the last one shorter). A chunk of n bytes is cut
 * into 4 pieces: pieces 0..2 of L = (n/4 rounded down to 8) bytes, piece 3 the rest. Lane j is the
 * standard crc32c of piece j of every chunk, concatenated; the checksum is the 4 lanes in hex. Four
 * independent lanes keep the crc32 instruction's pipeline full, so checking costs a fraction of the read. */
#pragma once
#include <stddef.h>
#include <stdint.h>

#define KILN_SUM_CHUNK ((size_t)1 << 20)

typedef struct {
    uint32_t lane[4];
} kiln_sum;

void kiln_sum_init(kiln_sum *s);
void kiln_sum_chunk(kiln_sum *s, const uint8_t *p, size_t n); /* n: KILN_SUM_CHUNK, or less for the last */
void kiln_sum_hex(const kiln_sum *s, char out[33]);           /* 32 hex digits and a NUL */

/* Read n bytes of fd, summing each chunk while it is still in cache. With `keep`, into dst[0..n); without,
 * through dst as a KILN_SUM_CHUNK-byte scratch. Returns 0, an errno, or -1 when the file ends first. */
int kiln_read_summed(int fd, uint8_t *dst, size_t n, int keep, kiln_sum *s);

/* The repack cache's checksum (checksum.h): crc32c with the SSE4.2 instruction where the CPU has it, a
 * table otherwise; both give the same lanes (the generic one is the reference the tests compare with). */
#include "checksum.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kernels.h"

static uint32_t table[256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void make_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[i] = c;
    }
}

static uint32_t crc_bytes(uint32_t c, const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
    return c;
}

static void lanes_generic(uint32_t lane[4], const uint8_t *p, size_t piece, size_t n) {
    for (int j = 0; j < 3; j++) lane[j] = crc_bytes(lane[j], p + j * piece, piece);
    lane[3] = crc_bytes(lane[3], p + 3 * piece, n - 3 * piece);
}

#if KILN_X86
#include <nmmintrin.h>

__attribute__((target("sse4.2"))) static void lanes_sse42(uint32_t lane[4], const uint8_t *p, size_t piece,
                                                          size_t n) {
    const uint8_t *q[4] = {p, p + piece, p + 2 * piece, p + 3 * piece};
    uint64_t c0 = lane[0], c1 = lane[1], c2 = lane[2], c3 = lane[3];
    for (size_t i = 0; i < piece; i += 8) {
        uint64_t v0, v1, v2, v3;
        memcpy(&v0, q[0] + i, 8);
        memcpy(&v1, q[1] + i, 8);
        memcpy(&v2, q[2] + i, 8);
        memcpy(&v3, q[3] + i, 8);
        c0 = _mm_crc32_u64(c0, v0);
        c1 = _mm_crc32_u64(c1, v1);
        c2 = _mm_crc32_u64(c2, v2);
        c3 = _mm_crc32_u64(c3, v3);
    }
    for (size_t i = 4 * piece; i < n; i++) c3 = _mm_crc32_u8((uint32_t)c3, p[i]);
    lane[0] = (uint32_t)c0, lane[1] = (uint32_t)c1, lane[2] = (uint32_t)c2, lane[3] = (uint32_t)c3;
}
#endif

void kiln_sum_init(kiln_sum *s) {
    pthread_once(&table_once, make_table);
    for (int j = 0; j < 4; j++) s->lane[j] = 0xffffffffu;
}

void kiln_sum_chunk(kiln_sum *s, const uint8_t *p, size_t n) {
    size_t piece = n / 4 / 8 * 8;
#if KILN_X86
    /* every CPU with the AVX2 kernels has SSE4.2; KILN_ISA=generic runs the table */
    if (kiln_active_isa() != ISA_GENERIC) {
        lanes_sse42(s->lane, p, piece, n);
        return;
    }
#endif
    lanes_generic(s->lane, p, piece, n);
}

void kiln_sum_hex(const kiln_sum *s, char out[33]) {
    for (int j = 0; j < 4; j++) snprintf(out + 8 * j, 9, "%08x", s->lane[j] ^ 0xffffffffu);
}

int kiln_read_summed(int fd, uint8_t *dst, size_t n, int keep, kiln_sum *s) {
    for (size_t at = 0; at < n;) {
        size_t len = n - at < KILN_SUM_CHUNK ? n - at : KILN_SUM_CHUNK;
        uint8_t *chunk = keep ? dst + at : dst;
        for (size_t got = 0; got < len;) { /* a whole chunk, whatever each read returns */
            ssize_t r = read(fd, chunk + got, len - got);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) return errno;
            if (r == 0) return -1;
            got += (size_t)r;
        }
        kiln_sum_chunk(s, chunk, len);
        at += len;
    }
    return 0;
}

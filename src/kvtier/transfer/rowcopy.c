/* Scattered row copy for kvtier's CPU backend (see native.py).
 *
 * Each row is copied with non-temporal (streaming) stores when source, destination and width
 * are 64-byte aligned: a KV block written to the host pool is not read again soon, and
 * ordinary stores would first read every destination cache line (read-for-ownership), which
 * costs about a third of the bandwidth at 64-256 KiB rows. Other rows use memcpy.
 */
#include <emmintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

void kvtier_copy_rows(const uint64_t *dst, const uint64_t *src, size_t n, size_t width) {
    for (size_t i = 0; i < n; i++) {
        char *d = (char *)(uintptr_t)dst[i];
        const char *s = (const char *)(uintptr_t)src[i];
        if (((uintptr_t)d | (uintptr_t)s | width) & 63) {
            memcpy(d, s, width);
            continue;
        }
        for (size_t off = 0; off < width; off += 64) {
            __m128i a = _mm_load_si128((const __m128i *)(s + off));
            __m128i b = _mm_load_si128((const __m128i *)(s + off + 16));
            __m128i c = _mm_load_si128((const __m128i *)(s + off + 32));
            __m128i e = _mm_load_si128((const __m128i *)(s + off + 48));
            _mm_stream_si128((__m128i *)(d + off), a);
            _mm_stream_si128((__m128i *)(d + off + 16), b);
            _mm_stream_si128((__m128i *)(d + off + 32), c);
            _mm_stream_si128((__m128i *)(d + off + 48), e);
        }
    }
    /* Streaming stores are weakly ordered: make them visible before the job is reported. */
    _mm_sfence();
}

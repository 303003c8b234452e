/* Linux kernel AIO (io_submit/io_getevents) driver for O_DIRECT transfers, and the block checksum.
 *
 * One call moves a list of (buffer, length, offset) transfers on one file with at most `depth` requests in flight,
 * which is what keeps an NVMe queue busy without one thread per request. Called through ctypes, which releases the
 * GIL for the whole call. Raw syscalls: no libaio package needed, only the kernel headers.
 *
 * The checksum (swp_hash) guards swap files against changes made behind the engine's back (truncation, another
 * writer, a bad sector returned as data). It is not cryptographic. It must keep up with several GB/s of I/O on one
 * core, so it is an eight-lane multiply-accumulate: each 64-bit word is xored with a key that depends on its lane
 * and its place in a 1 KiB round, and the product of its two 32-bit halves is added to its lane, the word itself
 * to the neighbouring lane; the lanes are scrambled after each round (the construction of xxHash3's long loop).
 * Only 32x32->64 multiplies, adds and shifts, so it vectorizes (pmuludq): the rounds are written with SSE2 and
 * AVX2 intrinsics, the widest the CPU runs is taken at first use, and all variants give the same hash (gcc left
 * the plain C loop scalar, 6-8 GB/s; AVX2 hashes 32 GB/s from cache and is memory-bound beyond it). The lanes are
 * then folded with a full 64-bit avalanche together with the length, so trailing zeros count.
 * swp_run hashes each transfer as its I/O completes, while the other requests stay in flight.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/aio_abi.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_DEPTH 256
#define LANES 8
#define STRIPE (LANES * 8)
#define ROUND 16 /* stripes between scrambles */

/* splitmix64 outputs; lane i of stripe j of a round uses KEYS[i + j] (a sliding window, so where a word sits
 * within a round changes what it adds) */
static const uint64_t KEYS[LANES + ROUND] = {
    0x40d68dea0c3e39b3ULL, 0xf6069bcb4e650071ULL, 0xf4a91fdc907de039ULL, 0x856e8bb9e2118d5eULL,
    0xcba2113022300068ULL, 0xb0d8c24a75bc7adeULL, 0x11acd26bf8662e5dULL, 0xd78807ba63a2a004ULL,
    0x12598145f5dd65fdULL, 0x067c72245c3de249ULL, 0x8dd646b953495095ULL, 0x79f38251848589bcULL,
    0x907f6d4cf1b77b5dULL, 0x460e2e87e2076c82ULL, 0x727f5d3d83e6b8edULL, 0x088ffaa84ca13e1eULL,
    0x0522330b5c893202ULL, 0xa6150904fc034975ULL, 0xea013e1b185ed6a8ULL, 0x495593ef97e28dfcULL,
    0xf99498b7703aae40ULL, 0x75bad36ebcfb3491ULL, 0xd6eeb32ea3760f7cULL, 0xe6c00031cec46577ULL,
};

static inline uint64_t mix64(uint64_t h) { /* MurmurHash3's finalizer: every input bit moves every output bit */
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static inline void accumulate(uint64_t *restrict acc, const unsigned char *restrict p, const uint64_t *restrict key) {
    uint64_t w[LANES];
    memcpy(w, p, sizeof(w));
    for (int i = 0; i < LANES; ++i) {
        uint64_t k = w[i] ^ key[i];
        acc[i ^ 1] += w[i];
        acc[i] += (k & 0xffffffffULL) * (k >> 32);
    }
}

/* after each round: fold the high bits down and multiply, so which round a word was in changes the result */
static inline void scramble(uint64_t *acc) {
    for (int i = 0; i < LANES; ++i) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= KEYS[ROUND + i];
        acc[i] = a * 0x9e3779b1ULL;
    }
}

/* The whole rounds of swp_hash, ROUND stripes each, vectorized by hand: the same arithmetic as accumulate() and
 * scramble() on 2 (SSE2) or 4 (AVX2) lanes at once, so every version gives the same result. acc[i ^ 1] += w[i]
 * is a swap of the two 64-bit halves of each 128-bit pair. */
typedef void (*rounds_fn)(uint64_t *acc, const unsigned char *p, uint64_t rounds);

static void rounds_scalar(uint64_t *acc, const unsigned char *p, uint64_t rounds) {
    for (uint64_t r = 0; r < rounds; ++r, p += ROUND * STRIPE) {
        for (int j = 0; j < ROUND; ++j) accumulate(acc, p + j * STRIPE, KEYS + j);
        scramble(acc);
    }
}

#if defined(__x86_64__)
#include <immintrin.h>

static void rounds_sse2(uint64_t *acc, const unsigned char *p, uint64_t rounds) {
    __m128i a[LANES / 2];
    for (int i = 0; i < LANES / 2; ++i) a[i] = _mm_loadu_si128((const __m128i *)(acc + 2 * i));
    const __m128i prime = _mm_set1_epi64x(0x9e3779b1ULL);
    for (uint64_t r = 0; r < rounds; ++r, p += ROUND * STRIPE) {
        for (int j = 0; j < ROUND; ++j) {
            for (int i = 0; i < LANES / 2; ++i) {
                __m128i w = _mm_loadu_si128((const __m128i *)(p + j * STRIPE + 16 * i));
                __m128i k = _mm_xor_si128(w, _mm_loadu_si128((const __m128i *)(KEYS + j + 2 * i)));
                __m128i prod = _mm_mul_epu32(k, _mm_srli_epi64(k, 32));
                __m128i swapped = _mm_shuffle_epi32(w, _MM_SHUFFLE(1, 0, 3, 2));
                a[i] = _mm_add_epi64(a[i], _mm_add_epi64(prod, swapped));
            }
        }
        for (int i = 0; i < LANES / 2; ++i) {
            __m128i x = _mm_xor_si128(a[i], _mm_srli_epi64(a[i], 47));
            x = _mm_xor_si128(x, _mm_loadu_si128((const __m128i *)(KEYS + ROUND + 2 * i)));
            /* x * prime mod 2^64, prime < 2^32: lo(x) * prime + (hi(x) * prime << 32) */
            a[i] = _mm_add_epi64(_mm_mul_epu32(x, prime),
                                 _mm_slli_epi64(_mm_mul_epu32(_mm_srli_epi64(x, 32), prime), 32));
        }
    }
    for (int i = 0; i < LANES / 2; ++i) _mm_storeu_si128((__m128i *)(acc + 2 * i), a[i]);
}

__attribute__((target("avx2"))) static void rounds_avx2(uint64_t *acc, const unsigned char *p, uint64_t rounds) {
    __m256i a[LANES / 4];
    for (int i = 0; i < LANES / 4; ++i) a[i] = _mm256_loadu_si256((const __m256i *)(acc + 4 * i));
    const __m256i prime = _mm256_set1_epi64x(0x9e3779b1ULL);
    for (uint64_t r = 0; r < rounds; ++r, p += ROUND * STRIPE) {
        for (int j = 0; j < ROUND; ++j) {
            for (int i = 0; i < LANES / 4; ++i) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(p + j * STRIPE + 32 * i));
                __m256i k = _mm256_xor_si256(w, _mm256_loadu_si256((const __m256i *)(KEYS + j + 4 * i)));
                __m256i prod = _mm256_mul_epu32(k, _mm256_srli_epi64(k, 32));
                __m256i swapped = _mm256_shuffle_epi32(w, _MM_SHUFFLE(1, 0, 3, 2));
                a[i] = _mm256_add_epi64(a[i], _mm256_add_epi64(prod, swapped));
            }
        }
        for (int i = 0; i < LANES / 4; ++i) {
            __m256i x = _mm256_xor_si256(a[i], _mm256_srli_epi64(a[i], 47));
            x = _mm256_xor_si256(x, _mm256_loadu_si256((const __m256i *)(KEYS + ROUND + 4 * i)));
            a[i] = _mm256_add_epi64(_mm256_mul_epu32(x, prime),
                                    _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime), 32));
        }
    }
    for (int i = 0; i < LANES / 4; ++i) _mm256_storeu_si256((__m256i *)(acc + 4 * i), a[i]);
}
#endif

enum { HASH_SCALAR, HASH_SSE2, HASH_AVX2, HASH_VARIANTS };
static const char *const HASH_NAMES[HASH_VARIANTS] = {"scalar", "sse2", "avx2"};

static rounds_fn rounds_of(int variant) { /* NULL where this build or CPU lacks the variant */
#if defined(__x86_64__)
    if (variant == HASH_AVX2) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") ? rounds_avx2 : NULL;
    }
    if (variant == HASH_SSE2) return rounds_sse2;
#endif
    return variant == HASH_SCALAR ? rounds_scalar : NULL;
}

static int BEST = -1; /* the widest variant this CPU runs; every variant gives the same hash */

static int best(void) {
    if (BEST < 0) {
        int v = HASH_VARIANTS - 1;
        while (!rounds_of(v)) --v;
        BEST = v;
    }
    return BEST;
}

const char *swp_hash_isa(void) { return HASH_NAMES[best()]; }

static uint64_t hash_with(rounds_fn rounds_fn, const void *data, uint64_t n);

uint64_t swp_hash(const void *data, uint64_t n) { return hash_with(rounds_of(best()), data, n); }

/* tests: the hash by one variant (0 scalar, 1 SSE2, 2 AVX2) into *out; -1 where this CPU lacks it */
int swp_hash_variant(int variant, const void *data, uint64_t n, uint64_t *out) {
    rounds_fn f = variant >= 0 && variant < HASH_VARIANTS ? rounds_of(variant) : NULL;
    if (!f) return -1;
    *out = hash_with(f, data, n);
    return 0;
}

static uint64_t hash_with(rounds_fn rounds_fn, const void *data, uint64_t n) {
    const unsigned char *p = (const unsigned char *)data;
    uint64_t acc[LANES];
    for (int i = 0; i < LANES; ++i) acc[i] = KEYS[(i + 3) % LANES];
    uint64_t whole = n / STRIPE, rounds = whole / ROUND, s = rounds * ROUND;
    rounds_fn(acc, p, rounds);
    for (int j = 0; s < whole; ++s, ++j) accumulate(acc, p + s * STRIPE, KEYS + j);
    uint64_t rest = n - whole * STRIPE;
    if (rest) {
        unsigned char last[STRIPE] = {0};
        memcpy(last, p + whole * STRIPE, rest);
        accumulate(acc, last, KEYS + whole % ROUND);
    }
    uint64_t h = mix64(n ^ 0x9e3779b97f4a7c15ULL);
    for (int i = 0; i < LANES; ++i) h = mix64(h ^ acc[i]) + (uint64_t)i;
    return h;
}

long swp_setup(long depth, uint64_t *ctx_out) {
    aio_context_t ctx = 0;
    if (depth < 1 || depth > MAX_DEPTH) return -EINVAL;
    if (syscall(SYS_io_setup, depth, &ctx) < 0) return -errno;
    *ctx_out = (uint64_t)ctx;
    return 0;
}

long swp_destroy(uint64_t ctx) {
    if (syscall(SYS_io_destroy, (aio_context_t)ctx) < 0) return -errno;
    return 0;
}

static void hash_done(uint64_t *sums, const uint64_t *bufs, const uint64_t *lens, const long *idx, long *count) {
    for (long k = 0; k < *count; ++k) sums[idx[k]] = swp_hash((const void *)(uintptr_t)bufs[idx[k]], lens[idx[k]]);
    *count = 0;
}

/* Runs n transfers. When sums is not NULL, sums[i] receives swp_hash of transfer i's buffer: for a write, while
 * the write is in flight (the caller leaves the buffer alone); for a read, once it completed in full. Hashing is
 * spread over the loop, one block between two looks at the completion queue, so it overlaps the I/O in flight.
 * Only the sums of transfers before *bad_index are meaningful after a failure. Returns 0 when every transfer moved
 * its full length. Otherwise returns -1, stores the index of the first failed transfer in *bad_index and its result
 * (negative errno, or the short byte count) in *bad_result; transfers already in flight are drained first, and no
 * new ones are submitted after a failure.
 * single_submit: one iocb per io_submit call. overlap: refill as soon as one completes (else wait for all in flight).
 */
long swp_run(uint64_t ctx_id, long depth, int fd, int is_write, long n, const uint64_t *bufs, const uint64_t *lens,
             const int64_t *offs, int single_submit, int overlap, long *bad_index, long *bad_result,
             uint64_t *sums) {
    aio_context_t ctx = (aio_context_t)ctx_id;
    struct iocb cbs[MAX_DEPTH];
    struct iocb *ready[MAX_DEPTH];
    struct io_event events[MAX_DEPTH];
    long free_slots[MAX_DEPTH];
    long to_hash[2 * MAX_DEPTH]; /* transfers whose checksum is still to compute */
    long n_free = 0, next = 0, inflight = 0, failed = 0, n_hash = 0;

    if (depth < 1 || depth > MAX_DEPTH) return -EINVAL;
    for (long s = depth - 1; s >= 0; --s) free_slots[n_free++] = s;
    *bad_index = -1;
    *bad_result = 0;

    while (inflight > 0 || (next < n && !failed)) {
        long batch = 0;
        while (!failed && next < n && n_free > 0 && (overlap || inflight == 0 || batch > 0)) {
            long slot = free_slots[--n_free];
            struct iocb *cb = &cbs[slot];
            memset(cb, 0, sizeof(*cb));
            cb->aio_lio_opcode = is_write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
            cb->aio_fildes = (uint32_t)fd;
            cb->aio_buf = bufs[next];
            cb->aio_nbytes = lens[next];
            cb->aio_offset = offs[next];
            /* the slot in the high word, the transfer's index in the low word */
            cb->aio_data = ((uint64_t)slot << 32) | (uint32_t)next;
            ready[batch++] = cb;
            ++next;
            if (single_submit) break;
        }
        long submitted = 0;
        while (submitted < batch) {
            long r = syscall(SYS_io_submit, ctx, batch - submitted, ready + submitted);
            if (r < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN && inflight + submitted > 0) break; /* reap, then resubmit the rest */
                /* submission refused: report it on the first unsubmitted transfer */
                long first = (long)(ready[submitted]->aio_data & 0xffffffff);
                if (!failed) { failed = 1; *bad_index = first; *bad_result = -errno; }
                for (long k = submitted; k < batch; ++k) free_slots[n_free++] = (long)(ready[k]->aio_data >> 32);
                batch = submitted;
                break;
            }
            submitted += r;
        }
        if (submitted < batch) { /* EAGAIN: give the unsubmitted ones back and retry them later */
            for (long k = submitted; k < batch; ++k) free_slots[n_free++] = (long)(ready[k]->aio_data >> 32);
            next -= batch - submitted;
        }
        inflight += submitted;
        /* a write's bytes are final once submitted: hash them while they are in flight */
        if (sums != NULL && is_write) {
            if (n_hash + submitted > 2 * MAX_DEPTH) hash_done(sums, bufs, lens, to_hash, &n_hash);
            for (long k = 0; k < submitted; ++k) to_hash[n_hash++] = (long)(ready[k]->aio_data & 0xffffffff);
        }
        if (inflight == 0) continue;
        long min_nr = overlap ? 1 : inflight;
        if (n_hash > 0) {
            /* one block per pass, with the queue full; then reap without waiting, so a completion is refilled
             * after at most one block's hashing rather than after all of them */
            --n_hash;
            sums[to_hash[n_hash]] = swp_hash((const void *)(uintptr_t)bufs[to_hash[n_hash]], lens[to_hash[n_hash]]);
            min_nr = 0;
        }
        long got = syscall(SYS_io_getevents, ctx, min_nr, inflight, events, NULL);
        if (got < 0) {
            if (errno == EINTR) continue;
            if (!failed) { failed = 1; *bad_index = next > 0 ? next - 1 : 0; *bad_result = -errno; }
            return -1; /* the context is unusable; the caller destroys it */
        }
        for (long e = 0; e < got; ++e) {
            uint64_t data = events[e].data;
            long slot = (long)(data >> 32);
            long idx = (long)(data & 0xffffffff);
            int64_t res = events[e].res;
            if (res != (int64_t)lens[idx] && (!failed || idx < *bad_index)) {
                failed = 1;
                *bad_index = idx;
                *bad_result = res;
            }
            free_slots[n_free++] = slot;
            if (sums != NULL && !is_write && res == (int64_t)lens[idx]) {
                if (n_hash == 2 * MAX_DEPTH) hash_done(sums, bufs, lens, to_hash, &n_hash);
                to_hash[n_hash++] = idx;
            }
        }
        inflight -= got;
    }
    hash_done(sums, bufs, lens, to_hash, &n_hash);
    return failed ? -1 : 0;
}

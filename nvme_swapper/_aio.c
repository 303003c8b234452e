/* Linux kernel AIO (io_submit/io_getevents) driver for O_DIRECT transfers.
 *
 * One call moves a list of (buffer, length, offset) transfers on one file with at most `depth` requests in flight,
 * which is what keeps an NVMe queue busy without one thread per request. Called through ctypes, which releases the
 * GIL for the whole call. Raw syscalls: no libaio package needed, only the kernel headers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/aio_abi.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_DEPTH 256

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

/* Runs n transfers. Returns 0 when every transfer moved its full length. Otherwise returns -1, stores the index of
 * the first failed transfer in *bad_index and its result (negative errno, or the short byte count) in *bad_result;
 * transfers already in flight are drained first, and no new ones are submitted after a failure.
 * single_submit: one iocb per io_submit call. overlap: refill as soon as one completes (else wait for all in flight).
 */
long swp_run(uint64_t ctx_id, long depth, int fd, int is_write, long n, const uint64_t *bufs, const uint64_t *lens,
             const int64_t *offs, int single_submit, int overlap, long *bad_index, long *bad_result) {
    aio_context_t ctx = (aio_context_t)ctx_id;
    struct iocb cbs[MAX_DEPTH];
    struct iocb *ready[MAX_DEPTH];
    struct io_event events[MAX_DEPTH];
    long free_slots[MAX_DEPTH];
    long n_free = 0, next = 0, inflight = 0, failed = 0;

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
        if (inflight == 0) continue;
        long min_nr = overlap ? 1 : inflight;
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
        }
        inflight -= got;
    }
    return failed ? -1 : 0;
}

/* The weight matmuls' threads (matmul.h): a matmul's work units split between the threads of torch's OpenMP
 * team, each thread taking what is left of the others' parts once its own is done. */
#include "matmul.h"

static void part_range(int64_t part, int64_t parts, int64_t unit, int64_t n, int64_t *begin, int64_t *end) {
    const int64_t units = (n + unit - 1) / unit;
    *begin = units * part / parts * unit;
    *end = units * (part + 1) / parts * unit;
    if (*end > n) *end = n;
    if (*begin > n) *begin = n;
}

/* What is left of one thread's part: [front, back) of its work units, both ends in one word, so that its
 * owner (from the front) and a thief (from the back) never take the same unit. */
typedef struct {
    _Alignas(64) _Atomic uint64_t span; /* front in the low 32 bits, back in the high 32 */
} part_t;
#define MAX_PARTS 64
/* About this many bytes of weights a take (8 to 64 KiB measured the same: docs/benchmarks.md,
 * "Figures behind the code": Steal chunk size). */
#define STEAL_BYTES 32768

/* Takes up to `chunk` units from the front (from_back 0) or the back of *p into [*b, *e); 0 when empty. */
static int take(part_t *p, int64_t chunk, int from_back, int64_t *b, int64_t *e) {
    uint64_t s = atomic_load_explicit(&p->span, memory_order_relaxed);
    for (;;) {
        const int64_t front = (int64_t)(uint32_t)s, back = (int64_t)(s >> 32);
        if (front >= back) return 0;
        const int64_t n = back - front < chunk ? back - front : chunk;
        const int64_t nf = from_back ? front : front + n, nb = from_back ? back - n : back;
        if (atomic_compare_exchange_weak_explicit(&p->span, &s, (uint64_t)nb << 32 | (uint64_t)nf,
                                                  memory_order_relaxed, memory_order_relaxed)) {
            *b = from_back ? nb : front;
            *e = from_back ? back : nf;
            return 1;
        }
    }
}

/* n units of work (groups or quads; `unit` of them the split's granularity, `chunk` a take) on an OpenMP team:
 * the library is linked against the libgomp torch has loaded (same soname), so these are torch's own intra-op
 * threads, already spinning after torch's last op (a pool of our own beside them made the two fight for the
 * cores, even with torch's threads told not to spin: docs/benchmarks.md, "Figures behind the code": Matmul
 * threads: torch's OpenMP team). Each thread streams its own contiguous part, `chunk` units at a time from the
 * front; one that runs out takes what is left of the others' from their back, a chunk at a time. With the parts
 * fixed, the faster of two threads (two vCPUs that get uneven time) had waited for the other at the end of each
 * of a step's 120 matmuls; taking each other's tails, a step ran a little faster at every batch size
 * (docs/benchmarks.md, "Figures behind the code": Matmul threads take each other's tails). Which thread
 * computes a unit never changes its bits. */
int run_parts(range_fn fn, const job_t *j, int64_t n, int64_t unit, int64_t chunk, int64_t threads) {
    const int64_t units = (n + unit - 1) / unit;
    if (threads > units) threads = units;
    if (threads > MAX_PARTS) threads = MAX_PARTS;
    if (threads <= 1) return fn(j, 0, n);
    part_t parts[MAX_PARTS];
    for (int64_t p = 0; p < threads; p++) {
        int64_t begin, end;
        part_range(p, threads, unit, n, &begin, &end);
        atomic_init(&parts[p].span, (uint64_t)end << 32 | (uint64_t)begin);
    }
    int err = 0;
#pragma omp parallel num_threads((int)threads) reduction(| : err)
    {
        const int64_t me = omp_get_thread_num();
        int64_t b, e;
        while (!err && take(&parts[me], chunk, 0, &b, &e)) err |= fn(j, b, e);
        /* then the others' (a team smaller than asked leaves parts with no owner: these take them too) */
        for (int64_t k = 1; k < threads && !err; k++)
            while (!err && take(&parts[(me + k) % threads], chunk, 1, &b, &e)) err |= fn(j, b, e);
    }
    return err;
}

int64_t steal_chunk(int64_t unit_bytes, int64_t unit) {
    const int64_t units = STEAL_BYTES / (unit_bytes * unit);
    return (units > 1 ? units : 1) * unit;
}

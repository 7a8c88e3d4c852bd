/* Units of work shared out with stealing, for both fused steps (decode.c, ffn.h, batch.h). Included by decode.c. */
#ifndef TANDEM_UNITS_H
#define TANDEM_UNITS_H

#include <stdint.h>

/* Work shared out with stealing: a phase of the step (a layer's q/k/v heads, its attention, its output rows, ...)
 * is cut into units, and thread t takes the units of its own contiguous share first, in order (so it streams its
 * rows as with a static split), then those left in the other threads' shares. A thread the host slows or preempts
 * then holds up the unit it is in, not the rest of its share (under 8 streaming clients on 2 cores, py-spy put the
 * server's step thread at a barrier for a third of the step with static shares). Which thread computes a unit
 * never changes its result. Each share counts its taken units on its own cache line, zeroed before the step. */
#define UNIT_PHASES 5  /* a layer's phases: q/k/v heads, attention, output rows, dense down rows, FFN slices */
#define UNIT_STRIDE 8  /* int64 between two shares' counters (a cache line) */
#define ROW_UNIT 64    /* rows of a matrix per unit (whole groups of eight, see row_chunk) */
#define HEAD_UNIT 2048 /* rows of the output layer per unit */
#define FFN_UNIT 128   /* FFN neurons per unit (whole FFN_SLICEs) */

typedef struct {
    int64_t *counters;      /* [nt * UNIT_STRIDE] the phase's shares */
    int64_t n;              /* units */
    int t, nt, s;           /* this thread, the threads, the share it takes from now (t + s mod nt) */
    int64_t rows, per_unit; /* row_units: the rows [0, rows) in units of per_unit (next_rows) */
} unit_queue;

/* the counters of layer l of a call (from the first layer it runs; the output layer's after its last) */
static inline int64_t *layer_units(int64_t *units, int64_t l, int nt) {
    return units + l * UNIT_PHASES * nt * UNIT_STRIDE;
}

/* thread t's queue over the n units of phase `phase` of a layer whose counters start at `units` */
static inline unit_queue phase_units(int64_t *units, int64_t phase, int64_t n, int t, int nt) {
    unit_queue q = {units + phase * nt * UNIT_STRIDE, n, t, nt, 0, n, 1};
    return q;
}

/* the same over rows [0, rows) in units of per_unit rows (next_rows gives each unit's range) */
static inline unit_queue row_units(int64_t *units, int64_t phase, int64_t rows, int64_t per_unit, int t, int nt) {
    unit_queue q = phase_units(units, phase, (rows + per_unit - 1) / per_unit, t, nt);
    q.rows = rows, q.per_unit = per_unit;
    return q;
}

/* the next unit for this thread, -1 when the phase has none left */
static inline int64_t next_unit(unit_queue *q) {
    for (; q->s < q->nt; q->s++) {
        int share = (q->t + q->s) % q->nt;
        int64_t lo = q->n * share / q->nt, hi = q->n * (share + 1) / q->nt;
        int64_t u = lo + __atomic_fetch_add(q->counters + share * UNIT_STRIDE, 1, __ATOMIC_RELAXED);
        if (u < hi) return u;
    }
    return -1;
}

/* the next unit's rows [*lo, *hi) for this thread; 0 when the phase has none left */
static inline int next_rows(unit_queue *q, int64_t *lo, int64_t *hi) {
    int64_t u = next_unit(q);
    if (u < 0) return 0;
    *lo = u * q->per_unit;
    *hi = *lo + q->per_unit < q->rows ? *lo + q->per_unit : q->rows;
    return 1;
}

#endif

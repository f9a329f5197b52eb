/* The schedule search's three list schedulers, compiled (issue 22's 1 s search).
 *
 * The same algorithms as loom/schedule/search_reverse.py (``reverse_schedule``: backwards in
 * time), loom/schedule/search_priority.py (``priority_schedule``: forwards by priorities,
 * with search_loop.Asap's replay while it builds) and loom/schedule/search_greedy.py
 * (``list_schedule``: forwards by knobs), on the same event loop as
 * loom/schedule/search_loop.py's ``run``, decision for decision: the same float operations in
 * the same order on C doubles (Python's floats), the same tie-breaks, so the rows, the peak and
 * the times are identical to the bit (tests/unit/schedule/test_compiled_schedulers.py compares
 * them on random problems). The Python modules are the specification and the fallback where
 * this extension was not built; loom/schedule/compiled.py chooses. Only what the loops need
 * crosses the boundary: flat float lists of durations, per-rank limits in chunks, and back the
 * rows as lists of (stage, op, microbatch) tuples.
 *
 * Why hand-written C: the reverse and priority loops ran at 2.4-3.1 us per scheduled action in
 * Python, and the search's full-size rebuild of a forward-backward order (p = 32, m = 256, five
 * chunks: 123,000 actions) took 0.7 s of a 1 s target; no library runs a custom list-scheduling
 * policy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

enum { OP_F = 0, OP_I = 1, OP_W = 2, OP_B = 3, NOPS = 4 };

/* ---- the event heap: (time, rank), Python's heapq on tuples, step for step ----
 * search_loop.run starts from the list [(release[r], r) for each rank] without heapifying it:
 * with staggered releases (the reverse scheduler's, decreasing in r) that list is not a heap
 * and heapq pops rank 0 first. To give the same schedules, these are heapq's own push and pop
 * (its _siftdown and _siftup), on the same starting list. (A heapified start gave the same
 * schedules on 400 random problems, a one-off script not committed: each rank's first decision
 * depends on its own state only. Kept step for step all the same: that is the proof the tests
 * can check.) */

typedef struct { double t; int r; } Event;
typedef struct { Event *a; Py_ssize_t n, cap; } EventHeap;

static int ev_less(Event x, Event y) { return x.t < y.t || (x.t == y.t && x.r < y.r); }

static void ev_siftdown(Event *heap, Py_ssize_t start, Py_ssize_t pos) {
    Event item = heap[pos];
    while (pos > start) {
        Py_ssize_t parent = (pos - 1) >> 1;
        if (!ev_less(item, heap[parent])) break;
        heap[pos] = heap[parent];
        pos = parent;
    }
    heap[pos] = item;
}

static int ev_push(EventHeap *h, double t, int r) {
    if (h->n == h->cap) {
        Py_ssize_t cap = h->cap ? 2 * h->cap : 64;
        Event *a = realloc(h->a, (size_t)cap * sizeof(Event));
        if (!a) return -1;
        h->a = a; h->cap = cap;
    }
    h->a[h->n].t = t;
    h->a[h->n].r = r;
    h->n++;
    ev_siftdown(h->a, 0, h->n - 1);
    return 0;
}

static Event ev_pop(EventHeap *h) {
    Event last = h->a[--h->n];
    if (!h->n) return last;
    Event top = h->a[0];
    Event *heap = h->a;
    Py_ssize_t pos = 0, end = h->n, child = 1;
    while (child < end) {  /* heapq._siftup: down to a leaf by the smaller child, then back up */
        Py_ssize_t right = child + 1;
        if (right < end && !ev_less(heap[child], heap[right])) child = right;
        heap[pos] = heap[child];
        pos = child;
        child = 2 * pos + 1;
    }
    heap[pos] = last;
    ev_siftdown(heap, 0, pos);
    return top;
}

/* ---- what every policy shares: the problem and the rows being built ---- */

typedef struct {
    int n, m, pp;                 /* stages, microbatches, ranks */
    int *placement;               /* stage -> rank */
    double *dur;                  /* [stage * NOPS + op] */
    double send, eps;
    long long *limit_c;           /* per rank: the memory limit in chunks */
    int *v;                       /* per rank: its stage count */
    int **stages;                 /* per rank: its stages, ascending */
    int *row_start, *row_len;     /* per rank: offset (in actions) into act, and length */
    int *act;                     /* actions as (stage, op, microbatch) triples */
    double *act_end;              /* each action's end (the reverse scheduler's latest starts) */
    double *free_at;
} Problem;

typedef struct { int s, o, k; } Act;
/* a policy's decision: an action and its start, or (is_action 0) the time to look again */
typedef struct { int is_action; Act a; double t; } Choice;
typedef Choice (*DecideFn)(void *self, Problem *p, int r, double t);
typedef void (*CommitFn)(void *self, Problem *p, int r, Act a, double end);

/* search_loop.Asap: the replay's times of a forward schedule, kept while it is built */
typedef struct { double *f, *i, *first, *end; char *f_cross, *i_cross; } Asap;

static void problem_free(Problem *p) {
    free(p->placement); free(p->dur); free(p->limit_c); free(p->v);
    if (p->stages) for (int r = 0; r < p->pp; r++) free(p->stages[r]);
    free(p->stages); free(p->row_start); free(p->row_len); free(p->act); free(p->act_end);
    free(p->free_at);
}

/* search_loop.run: advance the clock until no rank can start anything; the started count */
static long long run_loop(Problem *p, void *self, DecideFn decide, CommitFn commit,
                          const double *release, int backwards, Asap *asap, int *error) {
    int n = p->n, m = p->m, pp = p->pp;
    double eps = p->eps, send = p->send, inf = Py_HUGE_VAL;
    EventHeap heap = {NULL, 0, 0};
    int *after_f = malloc(sizeof(int) * n), *after_i = malloc(sizeof(int) * n);
    long long started = 0;
    *error = 0;
    if (!after_f || !after_i) { *error = 1; goto done; }
    for (int s = 0; s < n; s++) {
        int up = s + 1 < n ? p->placement[s + 1] : -1, down = s > 0 ? p->placement[s - 1] : -1;
        after_f[s] = backwards ? down : up;
        after_i[s] = backwards ? up : down;
    }
    heap.cap = pp > 64 ? pp : 64;  /* the starting list as it is, not heapified (see above) */
    heap.a = malloc(sizeof(Event) * (size_t)heap.cap);
    if (!heap.a) { *error = 1; goto done; }
    for (int r = 0; r < pp; r++) { heap.a[r].t = release ? release[r] : 0.0; heap.a[r].r = r; }
    heap.n = pp;
    while (heap.n) {
        Event e = ev_pop(&heap);
        double t = e.t;
        int r = e.r;
        double free = p->free_at[r];
        if (free > t + eps) continue;
        if (free > t) t = free;
        if (release && release[r] > t) t = release[r];
        Choice c = decide(self, p, r, t);
        if (!c.is_action) {
            if (c.t != inf && ev_push(&heap, c.t, r)) { *error = 1; goto done; }
            continue;
        }
        int s = c.a.s, o = c.a.o;
        double end = c.t + p->dur[s * NOPS + o];
        int at = p->row_start[r] + p->row_len[r]++;
        p->act[3 * at] = s; p->act[3 * at + 1] = o; p->act[3 * at + 2] = c.a.k;
        p->act_end[at] = end;
        p->free_at[r] = end;
        started++;
        commit(self, p, r, c.a, end);
        if (asap) {  /* the replay's start: the rank's last end, then each input's */
            int idx = s * m + c.a.k, opening = p->row_len[r] == 1;
            double when = opening ? 0.0 : asap->end[r], dep;
            if (o == OP_F) {
                if (s) {
                    dep = asap->f[idx - m];
                    if (asap->f_cross[s]) dep += send;
                    if (dep > when) when = dep;
                }
            } else if (o == OP_I) {
                dep = asap->f[idx];
                if (dep > when) when = dep;
                if (s < n - 1) {
                    dep = asap->i[idx + m];
                    if (asap->i_cross[s]) dep += send;
                    if (dep > when) when = dep;
                }
            } else {
                dep = asap->i[idx];
                if (dep > when) when = dep;
            }
            if (opening) asap->first[r] = when;
            when += p->dur[s * NOPS + o];
            asap->end[r] = when;
            if (o == OP_F) asap->f[idx] = when;
            else if (o == OP_I) asap->i[idx] = when;
        }
        if (ev_push(&heap, end, r)) { *error = 1; goto done; }
        int to;
        if (o == OP_F) to = after_f[s];
        else if (o == OP_I) to = after_i[s];
        else continue;
        if (to >= 0 && to != r && p->free_at[to] <= end + send + eps)
            if (ev_push(&heap, end + send, to)) { *error = 1; goto done; }
    }
done:
    free(heap.a); free(after_f); free(after_i);
    return started;
}

/* ---- reading the arguments ---- */

/* ``seq`` as a fast sequence of ``want`` items (want < 0: any length), or NULL with the error
 * set; the length in ``*len``. */
static PyObject *sequence_of(PyObject *seq, Py_ssize_t want, const char *what, Py_ssize_t *len) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return NULL;
    *len = PySequence_Fast_GET_SIZE(fast);
    if (want >= 0 && *len != want) {
        PyErr_Format(PyExc_ValueError, "%s: %zd values, expected %zd", what, *len, want);
        Py_DECREF(fast);
        return NULL;
    }
    return fast;
}

static double *floats_of(PyObject *seq, Py_ssize_t want, const char *what) {
    Py_ssize_t len;
    PyObject *fast = sequence_of(seq, want, what, &len);
    if (!fast) return NULL;
    double *out = malloc(sizeof(double) * (len ? len : 1));
    for (Py_ssize_t i = 0; out && i < len; i++) {
        out[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1.0 && PyErr_Occurred()) { free(out); out = NULL; }
    }
    if (!out && !PyErr_Occurred()) PyErr_NoMemory();
    Py_DECREF(fast);
    return out;
}

static long long *ints_of(PyObject *seq, Py_ssize_t want, const char *what) {
    Py_ssize_t len;
    PyObject *fast = sequence_of(seq, want, what, &len);
    if (!fast) return NULL;
    long long *out = malloc(sizeof(long long) * (len ? len : 1));
    for (Py_ssize_t i = 0; out && i < len; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) { free(out); out = NULL; }
    }
    if (!out && !PyErr_Occurred()) PyErr_NoMemory();
    Py_DECREF(fast);
    return out;
}

/* The problem from (placement, microbatches, durations [stage*4 + op], send, eps, limit_c). */
static int problem_init(Problem *p, PyObject *placement, int m, PyObject *durations,
                        double send, double eps, PyObject *limit_c) {
    memset(p, 0, sizeof(*p));
    long long *place = ints_of(placement, -1, "placement");
    if (!place) return -1;
    Py_ssize_t n = PySequence_Size(placement);
    if (n < 1 || m < 1 || n > (1 << 20) || m > (1 << 24) || (long long)n * m > (1LL << 28)) {
        free(place);
        PyErr_SetString(PyExc_ValueError, "placement and microbatches out of range");
        return -1;
    }
    p->n = (int)n; p->m = m; p->send = send; p->eps = eps;
    p->placement = malloc(sizeof(int) * n);
    if (!p->placement) { free(place); PyErr_NoMemory(); return -1; }
    int pp = 0;
    for (Py_ssize_t s = 0; s < n; s++) {
        if (place[s] < 0 || place[s] >= n) {
            free(place);
            PyErr_SetString(PyExc_ValueError, "placement: a rank out of range");
            return -1;
        }
        p->placement[s] = (int)place[s];
        if (place[s] + 1 > pp) pp = (int)place[s] + 1;
    }
    free(place);
    p->pp = pp;
    p->dur = floats_of(durations, n * NOPS, "durations");
    if (!p->dur) return -1;
    p->limit_c = ints_of(limit_c, pp, "limit_c");
    if (!p->limit_c) return -1;
    p->v = calloc(pp, sizeof(int));
    p->stages = calloc(pp, sizeof(int *));
    p->row_start = calloc(pp, sizeof(int));
    p->row_len = calloc(pp, sizeof(int));
    p->free_at = calloc(pp, sizeof(double));
    if (!p->v || !p->stages || !p->row_start || !p->row_len || !p->free_at) {
        PyErr_NoMemory(); return -1;
    }
    for (int s = 0; s < n; s++) p->v[p->placement[s]]++;
    for (int r = 0; r < pp; r++) {
        p->stages[r] = malloc(sizeof(int) * (p->v[r] ? p->v[r] : 1));
        if (!p->stages[r]) { PyErr_NoMemory(); return -1; }
    }
    int *fill = calloc(pp, sizeof(int));
    if (!fill) { PyErr_NoMemory(); return -1; }
    for (int s = 0; s < n; s++) { int r = p->placement[s]; p->stages[r][fill[r]++] = s; }
    free(fill);
    int total = 0;
    for (int r = 0; r < pp; r++) { p->row_start[r] = total; total += 3 * p->v[r] * m; }
    p->act = malloc(sizeof(int) * 3 * (size_t)(total ? total : 1));
    p->act_end = malloc(sizeof(double) * (size_t)(total ? total : 1));
    if (!p->act || !p->act_end) { PyErr_NoMemory(); return -1; }
    return 0;
}

/* The rows as lists of (stage, op, microbatch) tuples, each rank's reversed if ``reverse``. */
static PyObject *rows_of(Problem *p, int reverse) {
    PyObject *rows = PyList_New(p->pp);
    if (!rows) return NULL;
    for (int r = 0; r < p->pp; r++) {
        int len = p->row_len[r];
        PyObject *row = PyList_New(len);
        if (!row) { Py_DECREF(rows); return NULL; }
        PyList_SET_ITEM(rows, r, row);
        for (int j = 0; j < len; j++) {
            int *a = p->act + 3 * (size_t)(p->row_start[r] + (reverse ? len - 1 - j : j));
            PyObject *item = Py_BuildValue("(iii)", a[0], a[1], a[2]);
            if (!item) { Py_DECREF(rows); return NULL; }
            PyList_SET_ITEM(row, j, item);
        }
    }
    return rows;
}

static PyObject *bytes_of(const double *values, Py_ssize_t count) {
    return PyBytes_FromStringAndSize((const char *)values, (Py_ssize_t)sizeof(double) * count);
}

/* ---- search_reverse.reverse_schedule ---- */

typedef struct {
    int i_first;
    double *fin_w, *fin_i, *fin_f;
    int *next_i, *next_f;
    long long *live, *pending_w;
    int *next_admit;
    int *adm_order, *adm_head, *adm_len;  /* per rank: admitted microbatches, oldest first */
    char *state;                          /* [r * m + k]: 0 not admitted, 1 W's left, 2 done */
    int *w_left;                          /* [r * m + k]: its stages on r without a W yet */
    char *w_done;                         /* [s * m + k]: W(s, k) ran */
    double peak;
} Reverse;

static int first_w_stage(Problem *p, Reverse *q, int r, int k) {
    for (int j = 0; j < p->v[r]; j++) {
        int s = p->stages[r][j];
        if (!q->w_done[(size_t)s * p->m + k]) return s;
    }
    return -1;
}

static int reverse_admit(Problem *p, Reverse *q, int r) {
    int m = p->m;
    if (q->next_admit[r] >= m) return -1;
    if (q->live[r] + q->pending_w[r] + p->v[r] > p->limit_c[r]) return -1;
    int k = m - 1 - q->next_admit[r];
    q->next_admit[r]++;
    q->adm_order[(size_t)r * m + q->adm_len[r]++] = k;
    q->state[(size_t)r * m + k] = 1;
    q->w_left[(size_t)r * m + k] = p->v[r];
    q->pending_w[r] += p->v[r];
    return k;
}

static Choice act_at(int s, int o, int k, double t) {
    Choice c = {1, {s, o, k}, t};
    return c;
}

static Choice wake_at(double t) {
    Choice c = {0, {0, 0, 0}, t};
    return c;
}

static Choice reverse_decide(void *self, Problem *p, int r, double t) {
    Reverse *q = self;
    int m = p->m, n = p->n, v = p->v[r];
    int *stages = p->stages[r];
    double wake = Py_HUGE_VAL, now = t + p->eps, send = p->send;
    int have_f = 0, f_s = 0, f_k = 0;
    for (int j = v - 1; j >= 0; j--) {  /* F's chain downwards: higher stage first */
        int s = stages[j], nf = q->next_f[s];
        if (nf >= m) continue;
        int k = m - 1 - nf;
        double at = q->fin_i[(size_t)s * m + k];
        if (at < 0) continue;
        if (s + 1 < n) {
            double above = q->fin_f[(size_t)(s + 1) * m + k];
            if (above < 0) continue;
            if (p->placement[s + 1] != p->placement[s]) above += send;
            if (above > at) at = above;
        }
        if (at <= now) {
            if (!q->i_first) return act_at(s, OP_F, k, t);
            have_f = 1; f_s = s; f_k = k;
            break;
        }
        if (at < wake) wake = at;
    }
    int have_waiting = 0, w_s = 0, w_k = 0;
    for (int j = 0; j < v; j++) {  /* I's chain upwards: lower stage first */
        int s = stages[j], ni = q->next_i[s];
        if (ni >= m) continue;
        int k = m - 1 - ni;
        double at;
        if (s > 0) {
            at = q->fin_i[(size_t)(s - 1) * m + k];
            if (at < 0) continue;
            if (p->placement[s - 1] != p->placement[s]) at += send;
        } else {
            at = 0.0;
        }
        double w_at = q->fin_w[(size_t)s * m + k];
        if (w_at < 0) {
            if (at <= now) {
                if (!have_waiting) { have_waiting = 1; w_s = s; w_k = k; }
            } else if (at < wake) {
                wake = at;
            }
            continue;
        }
        if (w_at > at) at = w_at;
        if (at <= now) return act_at(s, OP_I, k, t);
        if (at < wake) wake = at;
    }
    if (have_f) return act_at(f_s, OP_F, f_k, t);
    if (have_waiting) {
        if (q->state[(size_t)r * m + w_k] == 1 ||
            (w_k == m - 1 - q->next_admit[r] && reverse_admit(p, q, r) == w_k))
            return act_at(w_s, OP_W, w_k, t);
    }
    int *order = q->adm_order + (size_t)r * m;
    while (q->adm_head[r] < q->adm_len[r] && q->state[(size_t)r * m + order[q->adm_head[r]]] == 2)
        q->adm_head[r]++;
    if (q->adm_head[r] < q->adm_len[r]) {  /* reserved already: costs no extra room */
        int k = order[q->adm_head[r]];
        return act_at(first_w_stage(p, q, r, k), OP_W, k, t);
    }
    int k = reverse_admit(p, q, r);
    if (k >= 0) return act_at(first_w_stage(p, q, r, k), OP_W, k, t);
    return wake_at(wake);
}

static void reverse_commit(void *self, Problem *p, int r, Act a, double end) {
    Reverse *q = self;
    size_t idx = (size_t)a.s * p->m + a.k;
    if (a.o == OP_W) {
        q->live[r]++;
        double level = q->live[r] * 1.0 / p->v[r];
        if (level > q->peak) q->peak = level;
        q->w_done[idx] = 1;
        q->pending_w[r]--;
        if (--q->w_left[(size_t)r * p->m + a.k] == 0) q->state[(size_t)r * p->m + a.k] = 2;
        q->fin_w[idx] = end;
    } else if (a.o == OP_I) {
        q->fin_i[idx] = end;
        q->next_i[a.s]++;
    } else {
        q->fin_f[idx] = end;
        q->next_f[a.s]++;
        q->live[r]--;
    }
}

static void reverse_free(Reverse *q) {
    free(q->fin_w); free(q->fin_i); free(q->fin_f); free(q->next_i); free(q->next_f);
    free(q->live); free(q->pending_w); free(q->next_admit); free(q->adm_order);
    free(q->adm_head); free(q->adm_len); free(q->state); free(q->w_left); free(q->w_done);
}

static double *filled(size_t count, double value) {
    double *out = malloc(sizeof(double) * (count ? count : 1));
    if (out) for (size_t i = 0; i < count; i++) out[i] = value;
    return out;
}

/* reverse(placement, microbatches, durations, send, eps, limit_c, release, i_first)
 *   -> None on a stall, else (forward rows, peak units, latest F, latest I, latest W) with the
 *      latest forward starts as bytes of doubles indexed stage * microbatches + microbatch */
static PyObject *py_reverse(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *placement, *durations, *limit_c, *release_seq;
    int m, i_first;
    double send, eps;
    if (!PyArg_ParseTuple(args, "OiOddOOp", &placement, &m, &durations, &send, &eps, &limit_c,
                          &release_seq, &i_first))
        return NULL;
    Problem p;
    Reverse q;
    memset(&q, 0, sizeof(q));
    PyObject *result = NULL;
    double *release = NULL, *latest = NULL;
    if (problem_init(&p, placement, m, durations, send, eps, limit_c)) goto done;
    release = floats_of(release_seq, p.pp, "release");
    if (!release) goto done;
    size_t size = (size_t)p.n * m, per_rank = (size_t)p.pp * m;
    q.i_first = i_first;
    q.fin_w = filled(size, -1.0); q.fin_i = filled(size, -1.0); q.fin_f = filled(size, -1.0);
    q.next_i = calloc(p.n, sizeof(int)); q.next_f = calloc(p.n, sizeof(int));
    q.live = calloc(p.pp, sizeof(long long)); q.pending_w = calloc(p.pp, sizeof(long long));
    q.next_admit = calloc(p.pp, sizeof(int));
    q.adm_order = malloc(sizeof(int) * per_rank);
    q.adm_head = calloc(p.pp, sizeof(int)); q.adm_len = calloc(p.pp, sizeof(int));
    q.state = calloc(per_rank, 1); q.w_left = calloc(per_rank, sizeof(int));
    q.w_done = calloc(size, 1);
    q.peak = 0.0;
    if (!q.fin_w || !q.fin_i || !q.fin_f || !q.next_i || !q.next_f || !q.live || !q.pending_w
        || !q.next_admit || !q.adm_order || !q.adm_head || !q.adm_len || !q.state || !q.w_left
        || !q.w_done) { PyErr_NoMemory(); goto done; }
    int error;
    long long count = run_loop(&p, &q, reverse_decide, reverse_commit, release, 1, NULL, &error);
    if (error) { PyErr_NoMemory(); goto done; }
    if (count < 3LL * p.n * m) { result = Py_None; Py_INCREF(result); goto done; }
    double end = p.free_at[0];
    for (int r = 1; r < p.pp; r++) if (p.free_at[r] > end) end = p.free_at[r];
    latest = malloc(sizeof(double) * 3 * size);
    if (!latest) { PyErr_NoMemory(); goto done; }
    for (int r = 0; r < p.pp; r++)
        for (int j = 0; j < p.row_len[r]; j++) {
            int at = p.row_start[r] + j, *a = p.act + 3 * (size_t)at;
            latest[(size_t)a[1] * size + (size_t)a[0] * m + a[2]] = end - p.act_end[at];
        }
    PyObject *rows = rows_of(&p, 1);
    if (!rows) goto done;
    result = Py_BuildValue("(NdNNN)", rows, q.peak, bytes_of(latest, size),
                           bytes_of(latest + size, size), bytes_of(latest + 2 * size, size));
done:
    free(release); free(latest);
    reverse_free(&q);
    problem_free(&p);
    return result;
}

/* ---- search_priority.priority_schedule ---- */

typedef struct { double p; int s, o, k; } Key;

static int key_less(Key x, Key y) {
    if (x.p != y.p) return x.p < y.p;
    if (x.s != y.s) return x.s < y.s;
    if (x.o != y.o) return x.o < y.o;
    return x.k < y.k;
}

typedef struct {
    double *prio[3];                 /* by op code, [stage * m + microbatch] */
    double *wait;                    /* per rank: its patience */
    int reserve;                     /* -1: all */
    double *fin_f, *fin_i;
    int *next_f, *next_i;
    long long *live, *owed;
    int *left;                       /* [r * m + k]: forwards left of admitted k; 0 none, -1 done */
    int *adm_order, *adm_head, *adm_len;  /* per rank: admission order */
    Key *deferred;                   /* per rank a heap of (priority, s, W, k) */
    int *def_start, *def_len;
    double peak;
} Priority;

static void def_push(Key *h, int *len, Key e) {
    int i = (*len)++;
    while (i > 0) {
        int parent = (i - 1) / 2;
        if (!key_less(e, h[parent])) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = e;
}

static void def_pop(Key *h, int *len) {
    Key last = h[--*len];
    int i = 0, n = *len;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && key_less(h[c + 1], h[c])) c++;
        if (!key_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    if (n) h[i] = last;
}

static Choice priority_decide(void *self, Problem *p, int r, double t) {
    Priority *q = self;
    int m = p->m, n = p->n, v = p->v[r];
    int *stages = p->stages[r];
    double inf = Py_HUGE_VAL, wake = inf, now = t + p->eps, send = p->send;
    int have_best = 0, have_soon = 0;
    Key best = {0, 0, 0, 0}, soon_key = {0, 0, 0, 0};
    double soon = inf;
    int more = q->live[r] + 1 <= p->limit_c[r];
    int admit = -1;  /* decided when first needed */
    for (int j = 0; j < v; j++) {
        int s = stages[j];
        size_t base = (size_t)s * m;
        int k = q->next_i[s];
        if (k < m) {
            double ready = q->fin_f[base + k];
            if (ready >= 0) {
                if (s + 1 < n) {
                    double after = q->fin_i[base + m + k];
                    if (after < 0) {
                        ready = -1.0;
                    } else {
                        if (p->placement[s + 1] != p->placement[s]) after += send;
                        if (after > ready) ready = after;
                    }
                }
                if (ready >= 0) {
                    Key key = {q->prio[OP_I][base + k], s, OP_I, k};
                    if (ready <= now) {
                        if (!have_best || key_less(key, best)) { best = key; have_best = 1; }
                    } else {
                        if (ready < wake) wake = ready;
                        if (!have_soon || key_less(key, soon_key)) {
                            soon = ready; soon_key = key; have_soon = 1;
                        }
                    }
                }
            }
        }
        k = q->next_f[s];
        if (k >= m) continue;
        int left = q->left[(size_t)r * m + k];
        if (left > 0) {
            if (!more) continue;
        } else {
            if (admit < 0) {
                long long kept;
                if (q->reserve < 0) {
                    kept = q->owed[r];
                } else {
                    kept = 0;
                    int *order = q->adm_order + (size_t)r * m, taken = 0;
                    while (q->adm_head[r] < q->adm_len[r] &&
                           q->left[(size_t)r * m + order[q->adm_head[r]]] <= 0)
                        q->adm_head[r]++;
                    for (int a = q->adm_head[r]; a < q->adm_len[r] && taken < q->reserve; a++) {
                        int l = q->left[(size_t)r * m + order[a]];
                        if (l > 0) { kept += l; taken++; }
                    }
                }
                admit = q->live[r] + kept + v <= p->limit_c[r];
            }
            if (!admit) continue;
        }
        double ready;
        if (s == 0) {
            ready = 0.0;
        } else {
            ready = q->fin_f[base - m + k];
            if (ready < 0) continue;
            if (p->placement[s - 1] != p->placement[s]) ready += send;
        }
        Key key = {q->prio[OP_F][base + k], s, OP_F, k};
        if (ready <= now) {
            if (!have_best || key_less(key, best)) { best = key; have_best = 1; }
        } else {
            if (ready < wake) wake = ready;
            if (!have_soon || key_less(key, soon_key)) {
                soon = ready; soon_key = key; have_soon = 1;
            }
        }
    }
    if (q->def_len[r]) {
        Key top = q->deferred[q->def_start[r]];
        if (!have_best || key_less(top, best)) { best = top; have_best = 1; }
    }
    if (have_best && have_soon && key_less(soon_key, best) && soon - t <= q->wait[r] + p->eps
        && soon < t + p->dur[best.s * NOPS + best.o] - p->eps)
        return wake_at(soon);
    if (!have_best) return wake_at(wake);
    return act_at(best.s, best.o, best.k, t);
}

static void priority_commit(void *self, Problem *p, int r, Act a, double end) {
    Priority *q = self;
    int m = p->m;
    size_t idx = (size_t)a.s * m + a.k;
    if (a.o == OP_F) {
        q->fin_f[idx] = end;
        q->next_f[a.s]++;
        q->live[r]++;
        double level = (double)q->live[r] / p->v[r];
        if (level > q->peak) q->peak = level;
        int *left = q->left + (size_t)r * m + a.k;
        if (*left <= 0) {  /* its admission: not seen on this rank before */
            *left = p->v[r];
            q->owed[r] += p->v[r];
            q->adm_order[(size_t)r * m + q->adm_len[r]++] = a.k;
        }
        --*left;
        q->owed[r]--;
        if (*left == 0) *left = -1;
    } else if (a.o == OP_I) {
        q->fin_i[idx] = end;
        q->next_i[a.s]++;
        Key e = {q->prio[OP_W][idx], a.s, OP_W, a.k};
        def_push(q->deferred + q->def_start[r], &q->def_len[r], e);
    } else {
        def_pop(q->deferred + q->def_start[r], &q->def_len[r]);
        q->live[r]--;
    }
}

static double *table_of(PyObject *obj, Py_ssize_t want, const char *what) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE)) return NULL;
    if (view.len != (Py_ssize_t)sizeof(double) * want) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, view.len,
                     (Py_ssize_t)sizeof(double) * want);
        return NULL;
    }
    double *out = malloc(sizeof(double) * (want ? want : 1));
    if (out) memcpy(out, view.buf, sizeof(double) * want);
    else PyErr_NoMemory();
    PyBuffer_Release(&view);
    return out;
}

static int store_floats(PyObject *list, const double *values, int count) {
    for (int i = 0; i < count; i++) {
        PyObject *x = PyFloat_FromDouble(values[i]);
        if (!x || PyList_SetItem(list, i, x)) return -1;
    }
    return 0;
}

/* priority(placement, microbatches, durations, send, eps, limit_c, prio_f, prio_i, prio_w,
 *          reserve (-1: all), waits, asap_first, asap_end)
 *   -> None on a stall, else (rows, peak units); asap_first / asap_end (lists of pp floats, or
 *      None) get the replay's first start and last end of each rank (search_loop.Asap) */
static PyObject *py_priority(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *placement, *durations, *limit_c, *tables[3], *waits, *first_out, *end_out;
    int m, reserve;
    double send, eps;
    if (!PyArg_ParseTuple(args, "OiOddOOOOiOOO", &placement, &m, &durations, &send, &eps,
                          &limit_c, &tables[0], &tables[1], &tables[2], &reserve, &waits,
                          &first_out, &end_out))
        return NULL;
    Problem p;
    Priority q;
    Asap asap;
    memset(&q, 0, sizeof(q));
    memset(&asap, 0, sizeof(asap));
    PyObject *result = NULL;
    int want_asap = first_out != Py_None;
    if (problem_init(&p, placement, m, durations, send, eps, limit_c)) goto done;
    size_t size = (size_t)p.n * m, per_rank = (size_t)p.pp * m;
    for (int o = 0; o < 3; o++)
        if (!(q.prio[o] = table_of(tables[o], (Py_ssize_t)size, "priorities"))) goto done;
    if (!(q.wait = floats_of(waits, p.pp, "waits"))) goto done;
    q.reserve = reserve;
    q.fin_f = filled(size, -1.0); q.fin_i = filled(size, -1.0);
    q.next_f = calloc(p.n, sizeof(int)); q.next_i = calloc(p.n, sizeof(int));
    q.live = calloc(p.pp, sizeof(long long)); q.owed = calloc(p.pp, sizeof(long long));
    q.left = calloc(per_rank, sizeof(int));
    q.adm_order = malloc(sizeof(int) * per_rank);
    q.adm_head = calloc(p.pp, sizeof(int)); q.adm_len = calloc(p.pp, sizeof(int));
    q.def_start = calloc(p.pp, sizeof(int)); q.def_len = calloc(p.pp, sizeof(int));
    if (!q.fin_f || !q.fin_i || !q.next_f || !q.next_i || !q.live || !q.owed || !q.left ||
        !q.adm_order || !q.adm_head || !q.adm_len || !q.def_start || !q.def_len) {
        PyErr_NoMemory(); goto done;
    }
    int at = 0;
    for (int r = 0; r < p.pp; r++) { q.def_start[r] = at; at += p.v[r] * m; }
    q.deferred = malloc(sizeof(Key) * (size_t)(at ? at : 1));
    if (!q.deferred) { PyErr_NoMemory(); goto done; }
    if (want_asap) {
        asap.f = filled(size, 0.0); asap.i = filled(size, 0.0);
        asap.first = filled(p.pp, 0.0); asap.end = filled(p.pp, 0.0);
        asap.f_cross = calloc(p.n, 1); asap.i_cross = calloc(p.n, 1);
        if (!asap.f || !asap.i || !asap.first || !asap.end || !asap.f_cross || !asap.i_cross) {
            PyErr_NoMemory(); goto done;
        }
        for (int s = 0; s < p.n; s++) {
            asap.f_cross[s] = send != 0.0 && s > 0 && p.placement[s - 1] != p.placement[s];
            asap.i_cross[s] = send != 0.0 && s < p.n - 1 && p.placement[s + 1] != p.placement[s];
        }
    }
    int error;
    long long count = run_loop(&p, &q, priority_decide, priority_commit, NULL, 0,
                               want_asap ? &asap : NULL, &error);
    if (error) { PyErr_NoMemory(); goto done; }
    if (count < 3LL * p.n * m) { result = Py_None; Py_INCREF(result); goto done; }
    if (want_asap && (store_floats(first_out, asap.first, p.pp) ||
                      store_floats(end_out, asap.end, p.pp)))
        goto done;
    PyObject *rows = rows_of(&p, 0);
    if (!rows) goto done;
    result = Py_BuildValue("(Nd)", rows, q.peak);
done:
    for (int o = 0; o < 3; o++) free(q.prio[o]);
    free(q.wait); free(q.fin_f); free(q.fin_i); free(q.next_f); free(q.next_i); free(q.live);
    free(q.owed); free(q.left); free(q.adm_order); free(q.adm_head); free(q.adm_len);
    free(q.deferred); free(q.def_start); free(q.def_len);
    free(asap.f); free(asap.i); free(asap.first); free(asap.end); free(asap.f_cross);
    free(asap.i_cross);
    problem_free(&p);
    return result;
}

/* ---- search_greedy.list_schedule ---- */

typedef struct {
    int reserve, w_backlog;          /* -1: None */
    double patience, w_fill;
    int depth_first, forward_first;
    long long *admit_cap;            /* per rank: min(limit, warm-up cap) in chunks */
    double *fin_f, *fin_i;
    int *next_f, *next_i;
    long long *live, *pending_total;
    int *pending;                    /* [r * m + k]: forwards left of admitted k; 0: none */
    int *adm_order, *adm_head, *adm_len;  /* per rank: admission order */
    int *def_s, *def_k, *def_start, *def_head, *def_len;  /* per rank: FIFO of deferred W's */
    double peak;
} Greedy;

static long long greedy_reserve_after(Problem *p, Greedy *q, int r) {
    int v = p->v[r];
    if (q->reserve < 0) return q->pending_total[r] + v - 1;
    if (q->reserve == 0) return 0;
    int m = p->m, *order = q->adm_order + (size_t)r * m, taken = 0;
    long long kept = 0;
    while (q->adm_head[r] < q->adm_len[r] && q->pending[(size_t)r * m + order[q->adm_head[r]]] == 0)
        q->adm_head[r]++;
    for (int a = q->adm_head[r]; a < q->adm_len[r] && taken < q->reserve; a++) {
        int left = q->pending[(size_t)r * m + order[a]];
        if (left) { kept += left; taken++; }
    }
    if (taken < q->reserve) kept += v - 1;  /* (oldest + [v - 1])[:reserve] */
    return kept;
}

static Choice greedy_decide(void *self, Problem *p, int r, double t) {
    Greedy *q = self;
    int m = p->m, n = p->n, v = p->v[r];
    int *stages = p->stages[r];
    double wake = Py_HUGE_VAL, send = p->send, eps = p->eps;
    int best_s = -1, best_k = 0;
    double best_ready = 0.0;
    for (int j = v - 1; j >= 0; j--) {  /* I's: the later stage first */
        int s = stages[j], k = q->next_i[s];
        if (k >= m) continue;
        double ready = q->fin_f[(size_t)s * m + k];
        if (ready < 0) continue;
        if (s + 1 < n) {
            double after = q->fin_i[(size_t)(s + 1) * m + k];
            if (after < 0) continue;
            if (p->placement[s + 1] != p->placement[s]) after += send;
            if (after > ready) ready = after;
        }
        if (best_s < 0 || ready < best_ready - eps) { best_s = s; best_k = k; best_ready = ready; }
    }
    int head = q->def_head[r], backlog = q->def_len[r] - head, at = q->def_start[r] + head;
    if (backlog && q->w_backlog >= 0 && backlog > q->w_backlog)
        return act_at(q->def_s[at], OP_W, q->def_k[at], t);
    if (!q->forward_first && best_s >= 0 && best_ready <= t + q->patience + eps)
        return act_at(best_s, OP_I, best_k, best_ready > t ? best_ready : t);
    int have_forward = 0, f_s = 0, f_k = 0;
    double now = t + eps;
    long long level = q->live[r];
    int first = stages[0], admit = -1;
    if (level < p->limit_c[r]) {
        for (int j = 0; j < v; j++) {
            int s = stages[q->depth_first ? v - 1 - j : j], k = q->next_f[s];
            if (k >= m) continue;
            double ready;
            if (s == 0) {
                ready = 0.0;
            } else {
                ready = q->fin_f[(size_t)(s - 1) * m + k];
                if (ready < 0) continue;
                if (p->placement[s - 1] != p->placement[s]) ready += send;
            }
            if (s == first) {
                if (admit < 0)
                    admit = level + 1 + greedy_reserve_after(p, q, r) <= q->admit_cap[r];
                if (!admit) continue;
            }
            if (ready <= now) { have_forward = 1; f_s = s; f_k = k; break; }
            if (ready < wake) wake = ready;
        }
    }
    if (have_forward && q->forward_first) return act_at(f_s, OP_F, f_k, t);
    if (best_s >= 0) {
        if (best_ready <= t + q->patience + eps)
            return act_at(best_s, OP_I, best_k, best_ready > t ? best_ready : t);
        if (best_ready < wake) wake = best_ready;
    }
    if (have_forward) return act_at(f_s, OP_F, f_k, t);
    if (backlog) {
        int s = q->def_s[at];
        if (wake - t >= q->w_fill * p->dur[s * NOPS + OP_W] - eps)
            return act_at(s, OP_W, q->def_k[at], t);
    }
    return wake_at(wake);
}

static void greedy_commit(void *self, Problem *p, int r, Act a, double end) {
    Greedy *q = self;
    int m = p->m, v = p->v[r];
    size_t idx = (size_t)a.s * m + a.k;
    if (a.o == OP_F) {
        q->fin_f[idx] = end;
        q->next_f[a.s]++;
        q->live[r]++;
        double level = (double)q->live[r] / v;
        if (level > q->peak) q->peak = level;
        int *left = q->pending + (size_t)r * m + a.k;
        if (a.s == p->stages[r][0]) {
            if (v > 1) {
                *left = v - 1;
                q->pending_total[r] += v - 1;
                q->adm_order[(size_t)r * m + q->adm_len[r]++] = a.k;
            }
        } else {
            q->pending_total[r]--;
            --*left;
        }
    } else if (a.o == OP_I) {
        q->fin_i[idx] = end;
        q->next_i[a.s]++;
        int at = q->def_start[r] + q->def_len[r]++;
        q->def_s[at] = a.s;
        q->def_k[at] = a.k;
    } else {
        q->def_head[r]++;
        q->live[r]--;
    }
}

/* greedy(placement, microbatches, durations, send, eps, limit_c, admit_cap, reserve (-1: all),
 *        patience, w_backlog (-1: none), depth_first, forward_first, w_fill)
 *   -> None on a deadlock, else (rows, makespan, peak units) */
static PyObject *py_greedy(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *placement, *durations, *limit_c, *caps;
    int m;
    double send, eps;
    Greedy q;
    memset(&q, 0, sizeof(q));
    if (!PyArg_ParseTuple(args, "OiOddOOidippd", &placement, &m, &durations, &send, &eps,
                          &limit_c, &caps, &q.reserve, &q.patience, &q.w_backlog,
                          &q.depth_first, &q.forward_first, &q.w_fill))
        return NULL;
    Problem p;
    PyObject *result = NULL;
    if (problem_init(&p, placement, m, durations, send, eps, limit_c)) goto done;
    if (!(q.admit_cap = ints_of(caps, p.pp, "admit_cap"))) goto done;
    size_t size = (size_t)p.n * m, per_rank = (size_t)p.pp * m;
    q.fin_f = filled(size, -1.0); q.fin_i = filled(size, -1.0);
    q.next_f = calloc(p.n, sizeof(int)); q.next_i = calloc(p.n, sizeof(int));
    q.live = calloc(p.pp, sizeof(long long)); q.pending_total = calloc(p.pp, sizeof(long long));
    q.pending = calloc(per_rank, sizeof(int));
    q.adm_order = malloc(sizeof(int) * per_rank);
    q.adm_head = calloc(p.pp, sizeof(int)); q.adm_len = calloc(p.pp, sizeof(int));
    q.def_s = malloc(sizeof(int) * size); q.def_k = malloc(sizeof(int) * size);
    q.def_start = calloc(p.pp, sizeof(int)); q.def_head = calloc(p.pp, sizeof(int));
    q.def_len = calloc(p.pp, sizeof(int));
    if (!q.fin_f || !q.fin_i || !q.next_f || !q.next_i || !q.live || !q.pending_total ||
        !q.pending || !q.adm_order || !q.adm_head || !q.adm_len || !q.def_s || !q.def_k ||
        !q.def_start || !q.def_head || !q.def_len) {
        PyErr_NoMemory(); goto done;
    }
    int at = 0;
    for (int r = 0; r < p.pp; r++) { q.def_start[r] = at; at += p.v[r] * m; }
    int error;
    long long count = run_loop(&p, &q, greedy_decide, greedy_commit, NULL, 0, NULL, &error);
    if (error) { PyErr_NoMemory(); goto done; }
    if (count < 3LL * p.n * m) { result = Py_None; Py_INCREF(result); goto done; }
    double makespan = p.free_at[0];
    for (int r = 1; r < p.pp; r++) if (p.free_at[r] > makespan) makespan = p.free_at[r];
    PyObject *rows = rows_of(&p, 0);
    if (!rows) goto done;
    result = Py_BuildValue("(Ndd)", rows, makespan, q.peak);
done:
    free(q.admit_cap); free(q.fin_f); free(q.fin_i); free(q.next_f); free(q.next_i);
    free(q.live); free(q.pending_total); free(q.pending); free(q.adm_order); free(q.adm_head);
    free(q.adm_len); free(q.def_s); free(q.def_k); free(q.def_start); free(q.def_head);
    free(q.def_len);
    problem_free(&p);
    return result;
}

/* ---- replay.score's replay: one route, no vocabulary passes ---- */

/* replay(rows, placement, microbatches, durations, send)
 *   -> (first, ends): each rank's first start and last end when every list runs to its end
 *      (replay.replay's rules: an action starts when its rank is free and its inputs have
 *      finished, plus the send time across ranks); None when one stops (a deadlock); False
 *      when the rows hold an action twice, an op other than F, I, W, B, or a stage or
 *      microbatch outside the grid, which the Python replay handles (its first-replayed rule
 *      and widened grid). Without reordering: each start is a max of the same finishes, so
 *      the times do not depend on the order the ranks are visited in. */
static PyObject *py_replay(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *rows_obj, *placement_obj, *durations_obj;
    int m;
    double send;
    if (!PyArg_ParseTuple(args, "OOiOd", &rows_obj, &placement_obj, &m, &durations_obj, &send))
        return NULL;
    PyObject *result = NULL, *rows_fast = NULL;
    long long *placement = NULL;
    double *dur = NULL, *finish = NULL, *free_at = NULL, *first = NULL;
    int *act = NULL, *row_start = NULL, *row_len = NULL, *index = NULL, *wait_head = NULL;
    int *wait_next = NULL, *queue = NULL;
    char *split = NULL;
    Py_ssize_t n = PySequence_Size(placement_obj);
    if (n < 0) return NULL;
    if (!(placement = ints_of(placement_obj, n, "placement"))) goto done;
    if (!(dur = floats_of(durations_obj, n * NOPS, "durations"))) goto done;
    if (!(rows_fast = PySequence_Fast(rows_obj, "rows"))) goto done;
    int pp = (int)PySequence_Fast_GET_SIZE(rows_fast);
    if (m < 1 || n < 1 || (long long)n * m > (1LL << 28)) { result = Py_False; goto fallback; }
    size_t size = (size_t)n * m, total = 0;
    for (int r = 0; r < pp; r++) {
        Py_ssize_t len = PySequence_Size(PySequence_Fast_GET_ITEM(rows_fast, r));
        if (len < 0) goto done;
        total += (size_t)len;
    }
    if (total > (size_t)(INT_MAX / 3)) { result = Py_False; goto fallback; }  /* int offsets */
    act = malloc(sizeof(int) * 3 * (total ? total : 1));
    row_start = calloc(pp ? pp : 1, sizeof(int)); row_len = calloc(pp ? pp : 1, sizeof(int));
    if (!act || !row_start || !row_len) { PyErr_NoMemory(); goto done; }
    int has_i = 0, has_b = 0;
    size_t at = 0;
    for (int r = 0; r < pp; r++) {
        PyObject *row = PySequence_Fast(PySequence_Fast_GET_ITEM(rows_fast, r), "a row");
        if (!row) goto done;
        Py_ssize_t len = PySequence_Fast_GET_SIZE(row);
        row_start[r] = (int)at;
        row_len[r] = (int)len;
        for (Py_ssize_t j = 0; j < len; j++, at++) {
            PyObject *item = PySequence_Fast_GET_ITEM(row, j);
            if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
                Py_DECREF(row); result = Py_False; goto fallback;
            }
            long values[3];
            for (int c = 0; c < 3; c++) {
                values[c] = PyLong_AsLong(PyTuple_GET_ITEM(item, c));
                if (values[c] == -1 && PyErr_Occurred()) { Py_DECREF(row); goto done; }
            }
            if (values[0] < 0 || values[0] >= n || values[1] < 0 || values[1] > OP_B ||
                values[2] < 0 || values[2] >= m) {
                Py_DECREF(row); result = Py_False; goto fallback;
            }
            act[3 * at] = (int)values[0]; act[3 * at + 1] = (int)values[1];
            act[3 * at + 2] = (int)values[2];
            has_i |= values[1] == OP_I;
            has_b |= values[1] == OP_B;
        }
        Py_DECREF(row);
    }
    /* split[(stage, mb)]: its backward runs as I and W (else as one B): replay.replay's rule */
    split = malloc(size ? size : 1);
    if (!split) { PyErr_NoMemory(); goto done; }
    memset(split, !has_b ? 1 : 0, size);
    if (has_b && has_i)
        for (size_t a = 0; a < total; a++)
            if (act[3 * a + 1] == OP_I) split[(size_t)act[3 * a] * m + act[3 * a + 2]] = 1;
    finish = filled(4 * size, -1.0);
    wait_head = malloc(sizeof(int) * 4 * size);
    wait_next = malloc(sizeof(int) * (pp ? pp : 1));
    queue = malloc(sizeof(int) * (pp ? pp : 1));
    index = calloc(pp ? pp : 1, sizeof(int));
    free_at = calloc(pp ? pp : 1, sizeof(double));
    first = calloc(pp ? pp : 1, sizeof(double));
    if (!finish || !wait_head || !wait_next || !queue || !index || !free_at || !first) {
        PyErr_NoMemory(); goto done;
    }
    for (size_t key = 0; key < 4 * size; key++) wait_head[key] = -1;
    int q_head = 0, q_len = pp;  /* a ring of the runnable ranks: each is in it at most once */
    for (int r = 0; r < pp; r++) queue[r] = r;
    while (q_len) {
        int r = queue[q_head];
        q_head = (q_head + 1) % pp;
        q_len--;
        int j = index[r], len = row_len[r];
        double t_free = free_at[r];
        long long dep = -1;
        while (j < len) {
            int *a = act + 3 * (size_t)(row_start[r] + j), s = a[0], o = a[1], k = a[2];
            double start = t_free, t;
            if (o == OP_F) {
                if (s > 0) {
                    dep = (long long)(s - 1) * m + k;
                    if ((t = finish[dep]) < 0) break;
                    if (send != 0.0 && placement[s - 1] != placement[s]) t += send;
                    if (t > start) start = t;
                }
            } else if (o == OP_W) {
                dep = (long long)size + (long long)s * m + k;
                if ((t = finish[dep]) < 0) break;
                if (t > start) start = t;
            } else {
                dep = (long long)s * m + k;
                if ((t = finish[dep]) < 0) break;
                if (t > start) start = t;
                if (s + 1 < n) {
                    dep = (long long)(s + 1) * m + k;
                    dep += split[dep] ? (long long)size : 3LL * (long long)size;
                    if ((t = finish[dep]) < 0) break;
                    if (send != 0.0 && placement[s + 1] != placement[s]) t += send;
                    if (t > start) start = t;
                }
            }
            t_free = start + dur[s * NOPS + o];
            if (j == 0) first[r] = start;
            j++;
            size_t key = (size_t)o * size + (size_t)s * m + k;
            if (finish[key] >= 0) { result = Py_False; goto fallback; }  /* an action twice */
            finish[key] = t_free;
            for (int w = wait_head[key]; w >= 0; w = wait_next[w]) {
                queue[(q_head + q_len) % pp] = w;
                q_len++;
            }
            wait_head[key] = -1;
        }
        index[r] = j;
        free_at[r] = t_free;
        if (j < len) {  /* blocked on ``dep``: resumed when it finishes */
            wait_next[r] = wait_head[dep];
            wait_head[dep] = r;
        }
    }
    for (int r = 0; r < pp; r++)
        if (index[r] < row_len[r]) { result = Py_None; goto fallback; }
    PyObject *firsts = PyList_New(pp), *ends = PyList_New(pp);
    if (!firsts || !ends || store_floats(firsts, first, pp) || store_floats(ends, free_at, pp)) {
        Py_XDECREF(firsts); Py_XDECREF(ends); goto done;
    }
    result = Py_BuildValue("(NN)", firsts, ends);
    goto done;
fallback:
    Py_INCREF(result);
done:
    Py_XDECREF(rows_fast);
    free(placement); free(dur); free(finish); free(free_at); free(first); free(act);
    free(row_start); free(row_len); free(index); free(wait_head); free(wait_next); free(queue);
    free(split);
    return result;
}

static PyMethodDef methods[] = {
    {"reverse", py_reverse, METH_VARARGS, "search_reverse.reverse_schedule, compiled."},
    {"priority", py_priority, METH_VARARGS, "search_priority.priority_schedule, compiled."},
    {"greedy", py_greedy, METH_VARARGS, "search_greedy.list_schedule, compiled."},
    {"replay", py_replay, METH_VARARGS, "replay.score's replay of one route, compiled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "loom.schedule._listsched",
    .m_doc = "The search's list schedulers, compiled (see loom.schedule.compiled).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__listsched(void) { return PyModule_Create(&module_def); }

/* The CPU backend's persistent thread pool: workers created once at init
 * run fork-join jobs posted by the backend's caller thread, so no op creates
 * threads.  A job is published by bumping a generation counter. */
#include "cpu.h"

#include <pthread.h>
#include <stdlib.h>


/* Pauses a worker spins for the next job before sleeping (~0.5 ms): long
 * enough to bridge the gap between the ops of one decode step, short enough
 * that an idle backend soon costs nothing. */
#define POOL_SPINS 20000
/* Pauses the caller spins for workers still inside a job (~25 us) before
 * it sleeps.  Short on purpose: a worker that has not finished by then was
 * most likely preempted by another process, and a sleeping caller frees
 * its core for the scheduler to move that worker onto. */
#define POOL_DONE_SPINS 1000

struct pool_worker {
    struct cpu_pool *pool;
    int ith;
    pthread_t thread;
};

/* state packs the job generation (high 32 bits), a closed flag and the
 * number of workers inside the job (low bits).  A worker enters a job only
 * while it is open; the caller closes it once its own call has returned
 * and then waits only for the workers inside.  A worker that was not
 * scheduled in time (the cores are shared with other processes) never
 * delays the job: since every task claims its work from a shared counter,
 * the caller's call alone can finish it. */
#define POOL_CLOSED ((uint64_t)1 << 31)
#define POOL_ACTIVE ((uint64_t)0x7fffffff)

struct cpu_pool {
    int n_threads;
    struct pool_worker *workers; /* n_threads - 1 of them */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    cpu_task_fn fn;              /* the current job; written before state moves */
    void *arg;
    int nth;
    uint32_t gen;                /* the caller's copy of the generation */
    _Atomic uint64_t state;
    atomic_int stop;
};

static void *pool_main(void *p_) {
    struct pool_worker *w = p_;
    struct cpu_pool *p = w->pool;
    uint32_t seen = 0;
    for (;;) {
        uint64_t s = atomic_load_explicit(&p->state, memory_order_acquire);
        for (int i = 0; (uint32_t)(s >> 32) == seen && i < POOL_SPINS; i++) {
            CPU_RELAX();
            s = atomic_load_explicit(&p->state, memory_order_acquire);
        }
        if ((uint32_t)(s >> 32) == seen) {
            pthread_mutex_lock(&p->mu);
            while ((uint32_t)((s = atomic_load(&p->state)) >> 32) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv_work, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) return NULL;
        seen = (uint32_t)(s >> 32);
        int entered = 0;
        while ((uint32_t)(s >> 32) == seen && !(s & POOL_CLOSED)) {
            if (atomic_compare_exchange_weak_explicit(&p->state, &s, s + 1, memory_order_acq_rel,
                                                      memory_order_acquire)) {
                entered = 1;
                break;
            }
        }
        if (!entered) continue;
        if (w->ith < p->nth) p->fn(p->arg, w->ith, p->nth);
        uint64_t after = atomic_fetch_sub_explicit(&p->state, 1, memory_order_acq_rel) - 1;
        if ((after & POOL_CLOSED) && (after & POOL_ACTIVE) == 0) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

struct cpu_pool *cpu_pool_init(int n_threads) {
    struct cpu_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = n_threads < 1 ? 1 : n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    atomic_init(&p->state, 0);
    atomic_init(&p->stop, 0);
    if (p->n_threads > 1) {
        p->workers = calloc((size_t)p->n_threads - 1, sizeof *p->workers);
        if (!p->workers) {
            cpu_pool_free(p);
            return NULL;
        }
    }
    for (int i = 1; i < p->n_threads; i++) {
        struct pool_worker *w = &p->workers[i - 1];
        w->pool = p;
        w->ith = i;
        if (pthread_create(&w->thread, NULL, pool_main, w) != 0) {
            p->n_threads = i; /* cpu_pool_free joins the ones that started */
            cpu_pool_free(p);
            return NULL;
        }
    }
    return p;
}

void cpu_pool_free(struct cpu_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads && p->workers; i++) pthread_join(p->workers[i - 1].thread, NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    free(p->workers);
    free(p);
}

int cpu_pool_threads(const struct cpu_pool *p) { return p->n_threads; }

void cpu_pool_run(struct cpu_pool *p, cpu_task_fn fn, void *arg, int nth) {
    if (nth <= 0 || nth > p->n_threads) nth = p->n_threads;
    if (nth == 1) {
        fn(arg, 0, 1);
        return;
    }
    /* Every worker wakes for every job (those with ith >= nth return at
     * once): one generation counter is simpler than per-worker signalling. */
    p->fn = fn;
    p->arg = arg;
    p->nth = nth;
    p->gen++;
    pthread_mutex_lock(&p->mu);
    atomic_store_explicit(&p->state, (uint64_t)p->gen << 32, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);

    fn(arg, 0, nth);

    uint64_t s = atomic_fetch_or_explicit(&p->state, POOL_CLOSED, memory_order_acq_rel) | POOL_CLOSED;
    for (int i = 0; (s & POOL_ACTIVE) != 0 && i < POOL_DONE_SPINS; i++) {
        CPU_RELAX();
        s = atomic_load_explicit(&p->state, memory_order_acquire);
    }
    if ((s & POOL_ACTIVE) != 0) {
        pthread_mutex_lock(&p->mu);
        while ((atomic_load(&p->state) & POOL_ACTIVE) != 0) pthread_cond_wait(&p->cv_done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}

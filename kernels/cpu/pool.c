/* The CPU backend's persistent thread pool: workers created once at init
 * run fork-join jobs posted by the backend's caller thread, so no op creates
 * threads.  A job is published by bumping a generation counter. */
#include "cpu.h"

#include <pthread.h>
#include <stdlib.h>


/* Spins before sleeping: long enough to bridge the gap between the ops of
 * one decode step (a few microseconds), short enough that an idle backend
 * sleeps at once on a machine shared with other processes. */
#define POOL_SPINS 20000

struct pool_worker {
    struct cpu_pool *pool;
    int ith;
    pthread_t thread;
};

struct cpu_pool {
    int n_threads;
    struct pool_worker *workers; /* n_threads - 1 of them */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    cpu_task_fn fn;              /* the current job; written before gen moves */
    void *arg;
    int nth;
    atomic_uint gen;             /* bumped once per job */
    atomic_int pending;          /* workers still inside the current job */
    atomic_int stop;
};

static void *pool_main(void *p_) {
    struct pool_worker *w = p_;
    struct cpu_pool *p = w->pool;
    unsigned seen = 0;
    for (;;) {
        unsigned g = atomic_load_explicit(&p->gen, memory_order_acquire);
        for (int i = 0; g == seen && i < POOL_SPINS; i++) {
            CPU_RELAX();
            g = atomic_load_explicit(&p->gen, memory_order_acquire);
        }
        if (g == seen) {
            pthread_mutex_lock(&p->mu);
            while ((g = atomic_load(&p->gen)) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv_work, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) return NULL;
        seen = g;
        if (w->ith < p->nth) p->fn(p->arg, w->ith, p->nth);
        if (atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel) == 1) {
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
    atomic_init(&p->gen, 0);
    atomic_init(&p->pending, 0);
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
     * once): one counter is simpler than per-worker signalling. */
    p->fn = fn;
    p->arg = arg;
    p->nth = nth;
    atomic_store_explicit(&p->pending, p->n_threads - 1, memory_order_relaxed);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);

    fn(arg, 0, nth);

    for (int i = 0; atomic_load_explicit(&p->pending, memory_order_acquire) > 0 && i < POOL_SPINS; i++)
        CPU_RELAX();
    if (atomic_load_explicit(&p->pending, memory_order_acquire) > 0) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->pending) > 0) pthread_cond_wait(&p->cv_done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}

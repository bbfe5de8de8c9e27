/* The tensor cores' rate through mma.sync, the instruction every matmul
 * and attention kernel of the backend uses (no wgmma: the T4 decision of
 * docs/cuda-backend.md): the ceiling that "FLOPs / tensor rate" in a
 * roofline means for these kernels.  Each warp issues chains of
 * independent mma.sync on register operands, enough of them and enough
 * warps to keep the pipe full; no memory is read in the loop.
 *
 *   bench_mma [device] [iterations]
 *
 * Shapes: F16 in, F32 accumulate, m16n8k16 (sm_80 and later) and m16n8k8
 * (sm_75's); s8 in, s32 accumulate, m16n8k32 (sm_80 and later) and m8n8k16
 * (sm_75's); and m16n8k32 followed, as in matmul_mmq.cu, by the four
 * integer multiply-adds that scale each product by its row's sub-block
 * scale (the K-quants' cost of an int8 product).  A shape the build's
 * architecture lacks prints "n/a".  The rate is dense multiply-adds x 2
 * a second, the mean of the timed launches after a warm-up. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define MMA_CHAINS 8 /* independent accumulators a warp */
#define MMA_WARPS 4  /* a block */

enum { MMA_F16_K16, MMA_F16_K8, MMA_S8_K32, MMA_S8_M8, MMA_S8_K32_SCALED, MMA_N };
static const char *const mma_names[MMA_N] = {
    "f16 m16n8k16 (f32 acc)", "f16 m16n8k8 (f32 acc, sm_75's)", "s8 m16n8k32 (s32 acc)",
    "s8 m8n8k16 (s32 acc, sm_75's)", "s8 m16n8k32 + 4 scale imad (matmul_mmq)"};
/* Multiply-adds of one instruction. */
static const double mma_macs[MMA_N] = {16 * 8 * 16, 16 * 8 * 8, 16 * 8 * 32, 8 * 8 * 16, 16 * 8 * 32};

template <int V> __device__ __forceinline__ bool mma_has() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return true;
#else
    return V == MMA_F16_K8 || V == MMA_S8_M8;
#endif
}

template <int V> __global__ void __launch_bounds__(MMA_WARPS * 32) mma_kernel(int iters, int *out, int *ok) {
    if (!mma_has<V>()) {
        if (threadIdx.x == 0 && blockIdx.x == 0) *ok = 0;
        return;
    }
    const uint32_t a0 = 0x3c003c00u ^ threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, b0 = a0 * 3u, b1 = b0 + 5;
    (void)a2, (void)a3, (void)b1; /* sm_80 shapes only */
    uint32_t c[MMA_CHAINS][4];
    int s[MMA_CHAINS][4];
    for (int k = 0; k < MMA_CHAINS; k++)
        for (int e = 0; e < 4; e++) c[k][e] = 0, s[k][e] = 0;
    const int sc = (int)(threadIdx.x & 63);
    (void)sc;
    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int k = 0; k < MMA_CHAINS; k++) {
            if constexpr (V == MMA_F16_K16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                             "{%8,%9}, {%0,%1,%2,%3};\n"
                             : "+r"(c[k][0]), "+r"(c[k][1]), "+r"(c[k][2]), "+r"(c[k][3])
                             : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
            } else if constexpr (V == MMA_F16_K8) {
                asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
                             "{%0,%1,%2,%3};\n"
                             : "+r"(c[k][0]), "+r"(c[k][1]), "+r"(c[k][2]), "+r"(c[k][3])
                             : "r"(a0), "r"(a1), "r"(b0));
            } else if constexpr (V == MMA_S8_K32 || V == MMA_S8_K32_SCALED) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
                if constexpr (V == MMA_S8_K32) {
                    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                                 "{%8,%9}, {%0,%1,%2,%3};\n"
                                 : "+r"(c[k][0]), "+r"(c[k][1]), "+r"(c[k][2]), "+r"(c[k][3])
                                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
                } else {
                    /* A fresh product each time, scaled into the sums. */
                    int d[4];
                    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                                 "{%8,%9}, {%10,%10,%10,%10};\n"
                                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0 + (uint32_t)i), "r"(b1), "r"(0));
#pragma unroll
                    for (int e = 0; e < 4; e++) s[k][e] += (sc + k) * d[e];
                }
#endif
            } else {
                asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                             : "+r"(c[k][0]), "+r"(c[k][1])
                             : "r"(a0), "r"(b0));
            }
        }
    }
    int acc = 0;
    for (int k = 0; k < MMA_CHAINS; k++)
        for (int e = 0; e < 4; e++) acc += (int)c[k][e] + s[k][e];
    if (acc == 0x7fffffff) out[threadIdx.x] = acc; /* never, but the compiler cannot know */
}

template <int V> static double mma_run(int dev_sms, int iters, int *d_out, int *d_ok, float *ms_out) {
    const int blocks = dev_sms * 8;
    int one = 1;
    cudaMemcpy(d_ok, &one, sizeof one, cudaMemcpyHostToDevice);
    mma_kernel<V><<<blocks, MMA_WARPS * 32>>>(iters / 4, d_out, d_ok); /* warm-up: clocks up */
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    const int reps = 5;
    cudaEventRecord(e0);
    for (int r = 0; r < reps; r++) mma_kernel<V><<<blocks, MMA_WARPS * 32>>>(iters, d_out, d_ok);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    int ok = 0;
    cudaMemcpy(&ok, d_ok, sizeof ok, cudaMemcpyDeviceToHost);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        fprintf(stderr, "bench_mma: %s: %s\n", mma_names[V], cudaGetErrorString(err));
        exit(1);
    }
    *ms_out = ms / reps;
    if (!ok) return -1.0;
    const double macs = (double)blocks * MMA_WARPS * iters * MMA_CHAINS * mma_macs[V];
    return 2.0 * macs / (ms / reps * 1e-3) / 1e12;
}

int main(int argc, char **argv) {
    const int dev = argc > 1 ? atoi(argv[1]) : 0;
    const int iters = argc > 2 ? atoi(argv[2]) : 4096;
    if (iters < 4) {
        fprintf(stderr, "bench_mma: iterations: '%s' is fewer than 4\n", argv[2]);
        return 2;
    }
    cudaDeviceProp p;
    if (cudaSetDevice(dev) != cudaSuccess || cudaGetDeviceProperties(&p, dev) != cudaSuccess) {
        fprintf(stderr, "bench_mma: device %d: no such CUDA device\n", dev);
        return 1;
    }
    int *d_out = NULL, *d_ok = NULL;
    cudaMalloc(&d_out, 4096);
    cudaMalloc(&d_ok, sizeof(int));
    int clock_khz = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev);
    printf("bench_mma: %s, sm_%d%d, %d multiprocessors, %.0f MHz, %d warps x %d chains a multiprocessor, %d "
           "iterations\n",
           p.name, p.major, p.minor, p.multiProcessorCount, clock_khz / 1e3, 8 * MMA_WARPS, MMA_CHAINS, iters);
    printf("%-44s %12s %10s %16s\n", "instruction", "TFLOP/s", "ms", "cycles / instr");
    double (*runs[MMA_N])(int, int, int *, int *, float *) = {mma_run<0>, mma_run<1>, mma_run<2>, mma_run<3>,
                                                             mma_run<4>};
    for (int v = 0; v < MMA_N; v++) {
        float ms = 0;
        const double t = runs[v](p.multiProcessorCount, iters, d_out, d_ok, &ms);
        if (t < 0) {
            printf("%-44s %12s\n", mma_names[v], "n/a");
            continue;
        }
        /* Cycles between a scheduler's instructions of this kind, at the
         * clock the device reports (its boost clock). */
        const double per_sched = (double)8 * MMA_WARPS * iters * MMA_CHAINS / 4.0;
        const double cyc = ms * 1e-3 * clock_khz * 1e3 / per_sched;
        printf("%-44s %12.1f %10.3f %16.2f\n", mma_names[v], t, ms, cyc);
    }
    cudaFree(d_out);
    cudaFree(d_ok);
    return 0;
}

/* Element conversion between F32, F16 and BF16 buffers (stage-to-stage
 * activations, BF16 weights becoming F16 at load).  BF16 to F16 saturates
 * at the F16 range rather than producing infinities. */
#include "common.cuh"

template <int S> __device__ __forceinline__ float cv_load(const void *p, int64_t i) {
    return S == DTYPE_F32 ? ((const float *)p)[i] : S == DTYPE_F16 ? h2f(((const fp16_t *)p)[i])
                                                                    : bf2f(((const bf16_t *)p)[i]);
}

template <int S, int D> __global__ void convert_kernel(void *dst, const void *src, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        if (S == DTYPE_BF16 && D == DTYPE_F16) {
            ((fp16_t *)dst)[i] = bf2h_sat(((const bf16_t *)src)[i]);
            continue;
        }
        float f = cv_load<S>(src, i);
        if (D == DTYPE_F32) ((float *)dst)[i] = f;
        else if (D == DTYPE_F16) ((fp16_t *)dst)[i] = f2h(f);
        else ((bf16_t *)dst)[i] = f2bf(f);
    }
}

template <int S, int D> static int convert_launch(struct cuda_ctx *ctx, void *dst, const void *src, int64_t n) {
    convert_kernel<S, D><<<cuda_blocks(n, 256), 256, 0, CUDA_STREAM(ctx)>>>(dst, src, n);
    CUDA_CHECK(ctx, cudaGetLastError());
    return STATUS_OK;
}

extern "C" int cuda_convert(struct cuda_ctx *ctx, void *dst, enum dtype dst_type, const void *src,
                            enum dtype src_type, int64_t n) {
    if (n < 0) return cuda_fail(ctx, STATUS_BAD_INPUT, "convert: %lld elements", (long long)n);
    if (n == 0) return STATUS_OK;
    if (src_type == dst_type && (src_type == DTYPE_F32 || src_type == DTYPE_F16 || src_type == DTYPE_BF16))
        return cuda_copy(ctx, dst, src, (size_t)n * (src_type == DTYPE_F32 ? 4 : 2));
#define CV_PAIR(s, d) (((int)(s) << 8) | (int)(d))
    switch (CV_PAIR(src_type, dst_type)) {
    case CV_PAIR(DTYPE_F32, DTYPE_F16): return convert_launch<DTYPE_F32, DTYPE_F16>(ctx, dst, src, n);
    case CV_PAIR(DTYPE_F32, DTYPE_BF16): return convert_launch<DTYPE_F32, DTYPE_BF16>(ctx, dst, src, n);
    case CV_PAIR(DTYPE_F16, DTYPE_F32): return convert_launch<DTYPE_F16, DTYPE_F32>(ctx, dst, src, n);
    case CV_PAIR(DTYPE_F16, DTYPE_BF16): return convert_launch<DTYPE_F16, DTYPE_BF16>(ctx, dst, src, n);
    case CV_PAIR(DTYPE_BF16, DTYPE_F32): return convert_launch<DTYPE_BF16, DTYPE_F32>(ctx, dst, src, n);
    case CV_PAIR(DTYPE_BF16, DTYPE_F16): return convert_launch<DTYPE_BF16, DTYPE_F16>(ctx, dst, src, n);
    }
#undef CV_PAIR
    return cuda_fail(ctx, STATUS_UNSUPPORTED, "convert: %s to %s (F32, F16 and BF16 only)", dtype_name(src_type),
                     dtype_name(dst_type));
}

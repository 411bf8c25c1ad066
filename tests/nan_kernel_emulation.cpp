// Host emulation of kernels/nan_check.cu for tests/test_nan_check.py: the CUDA
// builtins the source uses, defined for the CPU, and a grid run one thread after
// another (the kernels share nothing between threads but the atomicMin slot, so
// this order is one of the GPU's legal ones). Checks the source's logic (head,
// 16-byte body, tail, indices) on machines without a GPU, not NVRTC's code.
#include <cstdint>
struct dim3 { unsigned x; };
static dim3 blockIdx, blockDim, threadIdx, gridDim;
struct ulonglong2 { unsigned long long x, y; };
static inline ulonglong2 make_ulonglong2(unsigned long long x, unsigned long long y) { return {x, y}; }
static int misaligned;  // a 16-byte load from an address the GPU would fault on
static inline ulonglong2 __ldg(const ulonglong2* p) {
    if (reinterpret_cast<uintptr_t>(p) % 16) { misaligned = 1; return {0, 0}; }
    return *p;
}
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
    unsigned long long old = *p; if (v < old) *p = v; return old;
}
static int trapped;
static inline void __trap() { trapped = 1; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#include KERNEL_SOURCE

typedef void (*Kernel)(const u8*, u64, u64*, u64, int);
static Kernel kernels[] = {nan_check_f16, nan_check_bf16, nan_check_f32, nan_check_f64, nan_check_e4m3, nan_check_e5m2};

// Returns 1 if a thread trapped, 2 (added) if a 16-byte load was misaligned.
extern "C" int run(int kernel, const u8* data, u64 n, u64* first, u64 base, int trap, unsigned grid, unsigned block) {
    trapped = misaligned = 0;
    gridDim.x = grid; blockDim.x = block;
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned t = 0; t < block; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            kernels[kernel](data, n, first, base, trap);
        }
    return trapped | (misaligned << 1);
}

// NaN checks for nccl_pg: one read-only scan per floating dtype.
//
// Compiled with NVRTC at first use (nccl_pg/kernels.py); needs no header.
// Each entry point scans `n` elements at `data` and, when it finds a NaN,
// lowers `*first` (initialised to ~0 by the caller) to `base + index` of the
// first NaN with atomicMin, so that several arrays can share one result slot
// (`base` is the array's offset in their concatenation). With `trap != 0` a
// NaN executes __trap() instead, as PyTorch's check does.
//
// NaN is tested on bit patterns, several lanes per 64-bit word at once: with
// M the lane's magnitude mask (all bits but the sign) and T its largest
// non-NaN magnitude, a lane holds a NaN iff (lane & M) > T, iff
// (lane & M) + (M - T) carries into the lane's top (sign) bit. No sum can
// reach the next lane, so one add tests every lane of a word.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define THREADS 256
#define UNROLL 4  // 16-byte loads in flight per thread before any is tested

template <typename Lane, u64 M, u64 T>
struct Rule {
    static constexpr int BITS = 8 * sizeof(Lane);
    // 1 in the lowest bit of every lane of a 64-bit word.
    static constexpr u64 ONES = BITS == 64 ? 1ull : ~0ull / ((1ull << (BITS % 64)) - 1);
    static constexpr u64 MASK = M * ONES;
    static constexpr u64 ADD = (M - T) * ONES;
    static constexpr u64 TOP = (M + 1) * ONES;
    static constexpr u64 PER_VEC = 16 / sizeof(Lane);

    // The top bit of each lane of `w` that holds a NaN (0: none).
    static __device__ __forceinline__ u64 hits(u64 w) { return ((w & MASK) + ADD) & TOP; }
    // Index of the first NaN lane of `w` (hits(w) != 0).
    static __device__ __forceinline__ u64 lane(u64 h) { return (u64)(__ffsll((long long)h) - 1) / BITS; }
};

// One element. A base not aligned to the element size (a byte view cast to a
// wider type) is read byte by byte; little-endian, as the GPU is.
template <typename Lane>
__device__ __forceinline__ u64 load_lane(const u8* base, u64 i, bool aligned) {
    if (aligned) return (u64)((const Lane*)base)[i];
    u64 v = 0;
    for (int b = 0; b < (int)sizeof(Lane); ++b) v |= (u64)base[i * sizeof(Lane) + b] << (8 * b);
    return v;
}

template <typename R, typename Lane>
__device__ __forceinline__ void scan(const u8* data, u64 n, u64* first, u64 base, int trap) {
    const u64 addr = (u64)data;
    const bool aligned = addr % sizeof(Lane) == 0;
    // Head: elements before the first 16-byte boundary (all of them if unaligned to the element).
    u64 head = aligned ? ((16 - addr % 16) % 16) / sizeof(Lane) : n;
    if (head > n) head = n;
    const u64 nvec = (n - head) / R::PER_VEC;
    const u64 body_end = head + nvec * R::PER_VEC;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 nthreads = (u64)gridDim.x * blockDim.x;
    u64 best = ~0ull;

    for (u64 i = tid; i < head && best == ~0ull; i += nthreads)
        if (R::hits(load_lane<Lane>(data, i, aligned))) best = i;

    // Body: grid-stride over 16-byte vectors. A thread's indices only grow, so
    // its first hit is its smallest and it can stop there.
    const ulonglong2* vec = (const ulonglong2*)(data + head * sizeof(Lane));
    for (u64 i = tid; i < nvec && best == ~0ull; i += nthreads * UNROLL) {
        ulonglong2 r[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const u64 j = i + k * nthreads;
            r[k] = j < nvec ? __ldg(vec + j) : make_ulonglong2(0, 0);
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const u64 lo = R::hits(r[k].x), hi = R::hits(r[k].y);
            if ((lo | hi) && best == ~0ull) {
                const u64 at = lo ? R::lane(lo) : R::PER_VEC / 2 + R::lane(hi);
                best = head + (i + k * nthreads) * R::PER_VEC + at;
            }
        }
    }

    for (u64 i = body_end + tid; i < n; i += nthreads)
        if (R::hits(load_lane<Lane>(data, i, aligned))) {
            if (i < best) best = i;
            break;
        }

    if (best != ~0ull) {
        if (trap) __trap();
        atomicMin(first, base + best);
    }
}

#define NAN_CHECK(name, Lane, M, T)                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS)                                   \
        name(const u8* data, u64 n, u64* first, u64 base, int trap) {                       \
        scan<Rule<Lane, M, T>, Lane>(data, n, first, base, trap);                           \
    }

// Complex arrays are checked as their float parts (nccl_pg halves the index).
NAN_CHECK(nan_check_f16, u16, 0x7fffull, 0x7c00ull)   // exponent all ones, mantissa != 0
NAN_CHECK(nan_check_bf16, u16, 0x7fffull, 0x7f80ull)
NAN_CHECK(nan_check_f32, u32, 0x7fffffffull, 0x7f800000ull)
NAN_CHECK(nan_check_f64, u64, 0x7fffffffffffffffull, 0x7ff0000000000000ull)
NAN_CHECK(nan_check_e4m3, u8, 0x7full, 0x7eull)       // float8_e4m3fn: only S.1111.111 is NaN
NAN_CHECK(nan_check_e5m2, u8, 0x7full, 0x7cull)

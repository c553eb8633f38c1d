/* The CUDA backend's copy kernel, compiled at run time with NVRTC (nvrtc.py) and launched by
 * cudaengine.c: one launch copies up to 480 of a job's rows for every segment, in one pass,
 * reading one side and writing the other wherever each lies (device memory, or the pinned
 * host pool through its device mapping). No staging, no index upload: the row numbers travel
 * in the launch's parameters.
 *
 * Grid: x = piece of a row's segment (`chunk` bytes each), y = row, z = segment.
 */
#define KVT_THREADS 256

typedef unsigned long long u64;
typedef unsigned int u32;

struct Segment { /* kvtier_segment in copyengine.c */
    u64 dst_base, dst_stride, src_base, src_stride, width;
};

template <int R>
struct Rows { /* kvt_rows in cudaengine.c; R = 480 fills the 4 KiB parameter limit */
    u64 segments; /* device address of the table of Segment */
    u32 n, chunk;
    u32 dst[R], src[R];
};

struct alignas(2) V2 { unsigned char b[2]; };

template <typename V, int R>
__device__ __forceinline__ void copy_piece(const Rows<R> &r) {
    const Segment s = reinterpret_cast<const Segment *>(r.segments)[blockIdx.z];
    const u64 off = (u64)blockIdx.x * r.chunk;
    if (off >= s.width)
        return; /* a narrower segment than the widest */
    const u64 len = s.width - off < r.chunk ? s.width - off : r.chunk;
    const V *src = reinterpret_cast<const V *>(s.src_base + r.src[blockIdx.y] * s.src_stride + off);
    V *dst = reinterpret_cast<V *>(s.dst_base + r.dst[blockIdx.y] * s.dst_stride + off);
    const u32 count = (u32)(len / sizeof(V)), step = blockDim.x;
    u32 i = threadIdx.x;
    /* Four loads in flight per thread before their stores: reads of host memory cross PCIe,
     * and one outstanding read per thread leaves the link idle most of the time. */
    for (; i + 3 * step < count; i += 4 * step) {
        const V a = src[i], b = src[i + step], c = src[i + 2 * step], d = src[i + 3 * step];
        dst[i] = a;
        dst[i + step] = b;
        dst[i + 2 * step] = c;
        dst[i + 3 * step] = d;
    }
    for (; i < count; i += step)
        dst[i] = src[i];
}

/* One kernel per access width, the engine picking the widest that every base, stride and
 * width of the job's segment table allows; each in two sizes of row arrays, because the
 * driver copies the whole parameter block at every launch and most jobs are a few rows.
 * __grid_constant__ keeps the row arrays in the parameter bank (indexed by blockIdx.y)
 * instead of a per-thread copy. */
#define KVT_KERNEL(name, V, R)                                                                  \
    extern "C" __global__ void __launch_bounds__(KVT_THREADS)                                  \
        name(const __grid_constant__ Rows<R> r) {                                               \
        copy_piece<V, R>(r);                                                                    \
    }
#define KVT_KERNELS(suffix, V)                                                                  \
    KVT_KERNEL(kvt_copy##suffix, V, 480)                                                        \
    KVT_KERNEL(kvt_copy##suffix##_32, V, 32)

KVT_KERNELS(16, uint4)
KVT_KERNELS(8, uint2)
KVT_KERNELS(4, u32)
KVT_KERNELS(2, V2)
KVT_KERNELS(1, unsigned char)

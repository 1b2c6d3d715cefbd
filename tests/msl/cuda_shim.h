// A small CUDA shim over the Metal harness's runtime: lets the source MLX would generate for an
// mx.fast.cuda_kernel compile with g++ and run on the CPU, one fiber per GPU thread. A warp is a
// simdgroup of 32 lanes (warp shuffles are simd rendezvous points, strict about divergence);
// __syncthreads is a threadgroup barrier; __shared__ arrays are rewritten (cuda_harness.py) into the
// runtime's checked threadgroup arrays (bounds, uninitialised reads, races, poisoned memory).
#pragma once
#include "metal_shim.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__

typedef half __half;
typedef bfloat16_t __nv_bfloat16;
inline float __half2float(__half x) { return float(x); }
inline __half __float2half(float x) { return __half(x); }
inline float __bfloat162float(__nv_bfloat16 x) { return float(x); }
inline __nv_bfloat16 __float2bfloat16(float x) { return __nv_bfloat16(x); }

namespace cooperative_groups {}

namespace cudashim {
struct dim3 {
  unsigned int x, y, z;
};
inline dim3 of(const uint3& v) { return dim3{v.x, v.y, v.z}; }
inline dim3 thread_idx() { return of(mslrt::current_attrs().thread_position_in_threadgroup); }
inline dim3 block_idx() { return of(mslrt::current_attrs().threadgroup_position_in_grid); }
inline dim3 block_dim() { return of(mslrt::current_attrs().threads_per_threadgroup); }
inline dim3 grid_dim() { return of(mslrt::current_attrs().threadgroups_per_grid); }

// CUDA's warp shuffles need every lane named in the mask; the kernels here always use the full warp.
inline void full_mask(unsigned mask, const char* op) {
  if (mask != 0xffffffffu) mslrt::fail("%s with lane mask %#x: the shim runs full warps only", op, mask);
}
}  // namespace cudashim

#define threadIdx (cudashim::thread_idx())
#define blockIdx (cudashim::block_idx())
#define blockDim (cudashim::block_dim())
#define gridDim (cudashim::grid_dim())
#define __syncthreads() mslrt::barrier("__syncthreads", __LINE__)

template <class T> T __shfl_xor_sync(unsigned mask, T x, int lane_mask, int line = __builtin_LINE()) {
  cudashim::full_mask(mask, "__shfl_xor_sync");
  return metal::simd_shuffle_xor(x, ushort(lane_mask), line);
}
template <class T> T __shfl_down_sync(unsigned mask, T x, unsigned delta, int line = __builtin_LINE()) {
  cudashim::full_mask(mask, "__shfl_down_sync");
  return metal::simd_shuffle_down(x, ushort(delta), line);
}
template <class T> T __shfl_sync(unsigned mask, T x, int src_lane, int line = __builtin_LINE()) {
  cudashim::full_mask(mask, "__shfl_sync");
  return metal::simd_shuffle(x, ushort(src_lane), line);
}

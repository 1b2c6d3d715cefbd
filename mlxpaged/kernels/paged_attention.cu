// Paged-attention decode for mx.fast.cuda_kernel: the CUDA twin of paged_attention.metal (bodies only:
// MLX writes the signatures). paged_attention.py splits this file at the "// ==== name ====" markers.
//
// The same design, inputs, grid and outputs as the Metal kernel (read its header for the layout, params,
// sinks and quantized pages); only the GPU's spellings differ: a Metal simdgroup is a CUDA warp (32 lanes,
// threadIdx.x / 32), simd_sum / simd_max are xor-butterfly shuffles, threadgroup memory is __shared__,
// threadgroup_barrier is __syncthreads. MLX's cuda_kernel counts the grid in threads, as Metal's does, and
// launches ceil(grid / threadgroup) blocks, so the wrapper's grid and threadgroup serve both.
//
// It runs only where MLX runs on an NVIDIA GPU (MLXPAGED_ATTENTION=kernel there), self-checked against the
// reference before its first use like the Metal kernel. On Linux without a GPU the tests compile this
// exact text with g++ against a CUDA shim (tests/msl/cuda_harness.py), one fiber per GPU thread.

// ==== header ====
// Conversions through cuda_fp16.h / cuda_bf16.h's own functions (MLX's device header includes both), so
// no implicit __half <-> float conversion is relied on.
__device__ __forceinline__ float pa_float(float x) { return x; }
__device__ __forceinline__ float pa_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float pa_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T pa_from_float(float x);
template <> __device__ __forceinline__ float pa_from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half pa_from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 pa_from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
// Every lane of the warp must call these (all lanes end with the same value).
__device__ __forceinline__ float pa_warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}
__device__ __forceinline__ float pa_warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}
#define PA_DEQUANT(pool, scales, biases, WIDTH, slot, e)                                              \
  (float((pool[(slot) * ((WIDTH) * QBITS / 32) + (e) * QBITS / 32] >> (((e) % (32 / QBITS)) * QBITS)) & \
         ((1u << QBITS) - 1u)) *                                                                       \
       pa_float(scales[(slot) * ((WIDTH) / QGROUP) + (e) / QGROUP]) +                                  \
   pa_float(biases[(slot) * ((WIDTH) / QGROUP) + (e) / QGROUP]))

// ==== paged_attention_decode ====
// Template: T, D, DV, BS, G, NSG, SINKS. PA_PARTITIONED is defined by the wrapper (0: one pass
// writing `out`; 1: pass one of two, writing unnormalised partial sums o_part / m_part / l_part).
// Grid (NSG * 32, num_kv_heads, batch * num_partitions) threads; block (NSG * 32, 1, 1).
constexpr int EPL = D / 32;  // key head-dim elements per lane
constexpr int EPL_V = DV / 32;  // value head-dim elements per lane
#if PA_QUANTIZED
#define PA_LOAD_K(slot, e) PA_DEQUANT(k_pool, k_scales, k_biases, D, slot, e)
#define PA_LOAD_V(slot, e) PA_DEQUANT(v_pool, v_scales, v_biases, DV, slot, e)
#else
#define PA_LOAD_K(slot, e) pa_float(k_pool[(slot) * D + (e)])
#define PA_LOAD_V(slot, e) pa_float(v_pool[(slot) * DV + (e)])
#endif
__shared__ float tg_max[NSG * G];
__shared__ float tg_sum[NSG * G];
__shared__ float tg_out[NSG * DV];
const float min_score = -3.0e38f;
const int max_blocks = params[0];
const int window = params[1];
const int num_partitions = params[3];
const int num_kv_heads = params[4];
const int num_heads = params[5];
const int kv_head = int(blockIdx.y);
const int seq = int(blockIdx.z) / num_partitions;
const int part = int(blockIdx.z) % num_partitions;
const int tid = int(threadIdx.x);
const int sg = tid / 32;
const int lane = tid % 32;

// Tokens attended: the last `window` of the sequence (or all), never past the table.
const int seq_len = context_lens[seq];
const int length = min(seq_len, max_blocks * BS);
int first = (window > 0 && length > window) ? length - window : 0;
int last = length;
#if PA_PARTITIONED
first += part * params[2];
last = min(last, first + params[2]);
#endif

float q[G * EPL];
float o[G * EPL_V];
float m[G];
float l[G];
for (int g = 0; g < G; g++) {
  const int64_t q_row = (int64_t(seq) * num_heads + kv_head * G + g) * D + lane * EPL;
  for (int i = 0; i < EPL; i++) {
    q[g * EPL + i] = scale[0] * pa_float(queries[q_row + i]);
  }
  for (int i = 0; i < EPL_V; i++) {
    o[g * EPL_V + i] = 0.0f;
  }
  m[g] = min_score;
  l[g] = 0.0f;
}

// All lanes of a warp share t, so every pa_warp_sum below is reached by the whole warp.
for (int t = first + sg; t < last; t += NSG) {
  const int block = block_tables[int64_t(seq) * max_blocks + t / BS];
  const int64_t slot = (int64_t(block) * num_kv_heads + kv_head) * BS + t % BS;
  float k[EPL];
  float v[EPL_V];
  for (int i = 0; i < EPL; i++) {
    k[i] = PA_LOAD_K(slot, lane * EPL + i);
  }
  for (int i = 0; i < EPL_V; i++) {
    v[i] = PA_LOAD_V(slot, lane * EPL_V + i);
  }
  for (int g = 0; g < G; g++) {
    float partial = 0.0f;
    for (int i = 0; i < EPL; i++) {
      partial += q[g * EPL + i] * k[i];
    }
    const float score = pa_warp_sum(partial);
    const float new_max = fmaxf(m[g], score);
    const float rescale = expf(m[g] - new_max);
    const float p = expf(score - new_max);
    m[g] = new_max;
    l[g] = l[g] * rescale + p;
    for (int i = 0; i < EPL_V; i++) {
      o[g * EPL_V + i] = o[g * EPL_V + i] * rescale + p * v[i];
    }
  }
}

// Merge the NSG warp states: maxima and sums first, then one head at a time through tg_out (the
// barrier after the reads lets the next head reuse it).
if (lane == 0) {
  for (int g = 0; g < G; g++) {
    tg_max[sg * G + g] = m[g];
    tg_sum[sg * G + g] = l[g];
  }
}
__syncthreads();
for (int g = 0; g < G; g++) {
  float group_max = min_score;
  for (int s = 0; s < NSG; s++) {
    group_max = fmaxf(group_max, float(tg_max[s * G + g]));
  }
  float total = 0.0f;
  for (int s = 0; s < NSG; s++) {
    total += tg_sum[s * G + g] * expf(tg_max[s * G + g] - group_max);
  }
  const int64_t head_row = int64_t(seq) * num_heads + kv_head * G + g;
#if !PA_PARTITIONED
  if (SINKS) {
    const float sink = sinks[kv_head * G + g];
    const float top = fmaxf(group_max, sink);
    total = total * expf(group_max - top) + expf(sink - top);
    group_max = top;
  }
#endif
  const float mine = expf(m[g] - group_max);
  for (int i = 0; i < EPL_V; i++) {
    tg_out[sg * DV + lane * EPL_V + i] = o[g * EPL_V + i] * mine;
  }
  __syncthreads();
  for (int d = tid; d < DV; d += NSG * 32) {
    float acc = 0.0f;
    for (int s = 0; s < NSG; s++) {
      acc += tg_out[s * DV + d];
    }
#if PA_PARTITIONED
    o_part[(head_row * num_partitions + part) * DV + d] = acc;
#else
    out[head_row * DV + d] = pa_from_float<T>(total > 0.0f ? acc / total : 0.0f);
#endif
  }
#if PA_PARTITIONED
  if (tid == 0) {
    m_part[head_row * num_partitions + part] = group_max;
    l_part[head_row * num_partitions + part] = total;
  }
#endif
  __syncthreads();
}

// ==== paged_attention_reduce ====
// Pass two: one warp merges a head's partitions, and adds the head's sink. Template: T, DV, SINKS.
// Grid (32, num_heads, batch) threads; block (32, 1, 1).
constexpr int EPL_V = DV / 32;
const float min_score = -3.0e38f;
const int num_partitions = params[3];
const int num_heads = params[5];
const int head = int(blockIdx.y);
const int seq = int(blockIdx.z);
const int lane = int(threadIdx.x) % 32;
const int64_t head_row = int64_t(seq) * num_heads + head;
const int64_t base = head_row * num_partitions;

float group_max = min_score;
for (int p = lane; p < num_partitions; p += 32) {
  group_max = fmaxf(group_max, m_part[base + p]);
}
group_max = pa_warp_max(group_max);
float total = 0.0f;
for (int p = lane; p < num_partitions; p += 32) {
  total += l_part[base + p] * expf(m_part[base + p] - group_max);
}
total = pa_warp_sum(total);
if (SINKS) {
  const float sink = sinks[head];
  const float top = fmaxf(group_max, sink);
  total = total * expf(group_max - top) + expf(sink - top);
  group_max = top;
}

float acc[EPL_V];
for (int i = 0; i < EPL_V; i++) {
  acc[i] = 0.0f;
}
for (int p = 0; p < num_partitions; p++) {
  const float w = expf(m_part[base + p] - group_max);
  for (int i = 0; i < EPL_V; i++) {
    acc[i] += w * o_part[(base + p) * DV + lane * EPL_V + i];
  }
}
for (int i = 0; i < EPL_V; i++) {
  out[head_row * DV + lane * EPL_V + i] = pa_from_float<T>(total > 0.0f ? acc[i] / total : 0.0f);
}

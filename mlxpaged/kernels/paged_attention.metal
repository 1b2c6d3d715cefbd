// Paged-attention decode for mx.fast.metal_kernel (bodies only: MLX writes the signatures).
// paged_attention.py splits this file at the "// ==== name ====" markers.
//
// Design (after MLX's sdpa_vector): one threadgroup per (sequence, KV head[, partition]) so
// each K/V row is read once for all G query heads of its GQA group; NSG simdgroups stride over
// tokens; each lane owns D/32 contiguous head-dim elements; dot products finish with simd_sum;
// fp32 online softmax from a finite minimum; simdgroup partials merge in threadgroup memory.
//
// Pool layout K [num_blocks, num_kv_heads, BS, D], V [num_blocks, num_kv_heads, BS, DV] (DV may
// differ from D: latent caches); token t of a sequence lives at
// pool[block_tables[seq, t / BS], kv_head, t % BS, :]. Only table entries below
// ceil(length / BS) are read, so padding entries may hold anything.
//
// params (int32): [max_blocks, window (0 = full), partition_tokens, num_partitions,
//                  num_kv_heads, num_heads]; scale (float32): [softmax scale];
// sinks (float32): [num_heads] sink logits, read only when SINKS is 1. A sink joins the softmax
// as a key with no value: M = max(max score, sink), denominator += exp(sink - M). It enters
// once per head: in the one-pass merge, or in the reduce, never per partition.
//
// Quantized pages (kv_bits): the decode kernel's quantized variant (template QBITS 8 or 4, QGROUP 32 or 64)
// takes k_pool / v_pool as mx.quantize's packed uint32 rows [.., D * QBITS / 32] with k_scales / k_biases
// (v_...) [.., D / QGROUP] in T, and dequantizes each element as it reads it (PA_LOAD_K / PA_LOAD_V; the
// wrapper defines PA_QUANTIZED 1 for that kernel): element e of a row is bits [e % (32 / QBITS) * QBITS, + QBITS) of word
// e * QBITS / 32, times its group's scale plus its bias. Everything after the loads is the same kernel.

// ==== header ====
// (no shared helpers: inputs with fewer than 8 elements are bound as `constant`, so all
// buffer reads stay in the kernel bodies; macros expand in them)
#define PA_DEQUANT(pool, scales, biases, WIDTH, slot, e)                                              \
  (float((pool[(slot) * ((WIDTH) * QBITS / 32) + (e) * QBITS / 32] >> (((e) % (32 / QBITS)) * QBITS)) & \
         ((1u << QBITS) - 1u)) *                                                                       \
       float(scales[(slot) * ((WIDTH) / QGROUP) + (e) / QGROUP]) +                                     \
   float(biases[(slot) * ((WIDTH) / QGROUP) + (e) / QGROUP]))

// ==== paged_attention_decode ====
// Template: T, D, DV, BS, G, NSG, SINKS. PA_PARTITIONED is defined by the wrapper (0: one pass
// writing `out`; 1: pass one of two, writing unnormalised partial sums o_part / m_part / l_part).
// Grid (NSG * 32, num_kv_heads, batch * num_partitions); threadgroup (NSG * 32, 1, 1).
constexpr int EPL = D / 32;  // key head-dim elements per lane
constexpr int EPL_V = DV / 32;  // value head-dim elements per lane
#if PA_QUANTIZED
#define PA_LOAD_K(slot, e) PA_DEQUANT(k_pool, k_scales, k_biases, D, slot, e)
#define PA_LOAD_V(slot, e) PA_DEQUANT(v_pool, v_scales, v_biases, DV, slot, e)
#else
#define PA_LOAD_K(slot, e) float(k_pool[(slot) * D + (e)])
#define PA_LOAD_V(slot, e) float(v_pool[(slot) * DV + (e)])
#endif
threadgroup float tg_max[NSG * G];
threadgroup float tg_sum[NSG * G];
threadgroup float tg_out[NSG * DV];
const float min_score = -3.0e38f;
const int max_blocks = params[0];
const int window = params[1];
const int num_partitions = params[3];
const int num_kv_heads = params[4];
const int num_heads = params[5];
const int kv_head = int(threadgroup_position_in_grid.y);
const int seq = int(threadgroup_position_in_grid.z) / num_partitions;
const int part = int(threadgroup_position_in_grid.z) % num_partitions;
const int sg = int(simdgroup_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int tid = sg * 32 + lane;

// Tokens attended: the last `window` of the sequence (or all), never past the table.
const int seq_len = context_lens[seq];
const int length = metal::min(seq_len, max_blocks * BS);
int first = (window > 0 && length > window) ? length - window : 0;
int last = length;
#if PA_PARTITIONED
first += part * params[2];
last = metal::min(last, first + params[2]);
#endif

float q[G * EPL];
float o[G * EPL_V];
float m[G];
float l[G];
for (int g = 0; g < G; g++) {
  const int64_t q_row = (int64_t(seq) * num_heads + kv_head * G + g) * D + lane * EPL;
  for (int i = 0; i < EPL; i++) {
    q[g * EPL + i] = scale[0] * float(queries[q_row + i]);
  }
  for (int i = 0; i < EPL_V; i++) {
    o[g * EPL_V + i] = 0.0f;
  }
  m[g] = min_score;
  l[g] = 0.0f;
}

// All lanes of a simdgroup share t, so every simd_sum below is reached by the whole simdgroup.
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
    const float score = metal::simd_sum(partial);
    const float new_max = metal::max(m[g], score);
    const float rescale = metal::exp(m[g] - new_max);
    const float p = metal::exp(score - new_max);
    m[g] = new_max;
    l[g] = l[g] * rescale + p;
    for (int i = 0; i < EPL_V; i++) {
      o[g * EPL_V + i] = o[g * EPL_V + i] * rescale + p * v[i];
    }
  }
}

// Merge the NSG simdgroup states: maxima and sums first, then one head at a time through
// tg_out (the barrier after the reads lets the next head reuse it).
if (lane == 0) {
  for (int g = 0; g < G; g++) {
    tg_max[sg * G + g] = m[g];
    tg_sum[sg * G + g] = l[g];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int g = 0; g < G; g++) {
  float group_max = min_score;
  for (int s = 0; s < NSG; s++) {
    group_max = metal::max(group_max, float(tg_max[s * G + g]));
  }
  float total = 0.0f;
  for (int s = 0; s < NSG; s++) {
    total += tg_sum[s * G + g] * metal::exp(tg_max[s * G + g] - group_max);
  }
  const int64_t head_row = int64_t(seq) * num_heads + kv_head * G + g;
#if !PA_PARTITIONED
  if (SINKS) {
    const float sink = sinks[kv_head * G + g];
    const float top = metal::max(group_max, sink);
    total = total * metal::exp(group_max - top) + metal::exp(sink - top);
    group_max = top;
  }
#endif
  const float mine = metal::exp(m[g] - group_max);
  for (int i = 0; i < EPL_V; i++) {
    tg_out[sg * DV + lane * EPL_V + i] = o[g * EPL_V + i] * mine;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int d = tid; d < DV; d += NSG * 32) {
    float acc = 0.0f;
    for (int s = 0; s < NSG; s++) {
      acc += tg_out[s * DV + d];
    }
#if PA_PARTITIONED
    o_part[(head_row * num_partitions + part) * DV + d] = acc;
#else
    out[head_row * DV + d] = static_cast<T>(total > 0.0f ? acc / total : 0.0f);
#endif
  }
#if PA_PARTITIONED
  if (tid == 0) {
    m_part[head_row * num_partitions + part] = group_max;
    l_part[head_row * num_partitions + part] = total;
  }
#endif
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// ==== paged_attention_reduce ====
// Pass two: one simdgroup merges a head's partitions, and adds the head's sink. Template: T, DV, SINKS.
// Grid (32, num_heads, batch); threadgroup (32, 1, 1).
constexpr int EPL_V = DV / 32;
const float min_score = -3.0e38f;
const int num_partitions = params[3];
const int num_heads = params[5];
const int head = int(threadgroup_position_in_grid.y);
const int seq = int(threadgroup_position_in_grid.z);
const int lane = int(thread_index_in_simdgroup);
const int64_t head_row = int64_t(seq) * num_heads + head;
const int64_t base = head_row * num_partitions;

float group_max = min_score;
for (int p = lane; p < num_partitions; p += 32) {
  group_max = metal::max(group_max, float(m_part[base + p]));
}
group_max = metal::simd_max(group_max);
float total = 0.0f;
for (int p = lane; p < num_partitions; p += 32) {
  total += l_part[base + p] * metal::exp(m_part[base + p] - group_max);
}
total = metal::simd_sum(total);
if (SINKS) {
  const float sink = sinks[head];
  const float top = metal::max(group_max, sink);
  total = total * metal::exp(group_max - top) + metal::exp(sink - top);
  group_max = top;
}

float acc[EPL_V];
for (int i = 0; i < EPL_V; i++) {
  acc[i] = 0.0f;
}
for (int p = 0; p < num_partitions; p++) {
  const float w = metal::exp(m_part[base + p] - group_max);
  for (int i = 0; i < EPL_V; i++) {
    acc[i] += w * o_part[(base + p) * DV + lane * EPL_V + i];
  }
}
for (int i = 0; i < EPL_V; i++) {
  out[head_row * DV + lane * EPL_V + i] = static_cast<T>(total > 0.0f ? acc[i] / total : 0.0f);
}

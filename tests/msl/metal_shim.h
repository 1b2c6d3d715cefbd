// A small Metal Shading Language shim: lets the exact source MLX generates for a
// mx.fast.metal_kernel compile with g++ and run on the CPU, one fiber per GPU thread.
// Address spaces are defined away; threadgroup arrays are rewritten (harness.py) into
// checked arrays; simd_* ops and barriers are rendezvous points in scheduler.cpp.
#pragma once
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define device
#define constant
#define thread
#define threadgroup
#define kernel

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef half float16_t;

// bfloat16 with round-to-nearest-even from float; arithmetic happens in float.
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) : bits(from_float(f)) {}
  bfloat16_t(double f) : bits(from_float(float(f))) {}
  bfloat16_t(int v) : bits(from_float(float(v))) {}
  bfloat16_t(half v) : bits(from_float(float(v))) {}
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
};
typedef bfloat16_t bfloat;

// ---- vector types ------------------------------------------------------------------
template <class T, int N> struct vec;
#define MSL_VEC_COMMON(N)                                                          \
  T& operator[](int i) { return (&x)[i]; }                                         \
  const T& operator[](int i) const { return (&x)[i]; }                             \
  template <class U> explicit vec(const vec<U, N>& o) {                            \
    for (int i = 0; i < N; i++) (*this)[i] = T(o[i]);                              \
  }
template <class T> struct vec<T, 2> {
  T x, y;
  vec() = default;
  vec(T s) : x(s), y(s) {}
  vec(T a, T b) : x(a), y(b) {}
  MSL_VEC_COMMON(2)
};
template <class T> struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  vec(T s) : x(s), y(s), z(s) {}
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  MSL_VEC_COMMON(3)
};
template <class T> struct vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  MSL_VEC_COMMON(4)
};
#define MSL_VEC_OP(op)                                                                    \
  template <class T, int N> vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) {      \
    for (int i = 0; i < N; i++) a[i] = T(a[i] op b[i]);                                   \
    return a;                                                                             \
  }                                                                                       \
  template <class T, int N> vec<T, N> operator op(vec<T, N> a, T b) {                     \
    for (int i = 0; i < N; i++) a[i] = T(a[i] op b);                                      \
    return a;                                                                             \
  }                                                                                       \
  template <class T, int N> vec<T, N> operator op(T a, vec<T, N> b) {                     \
    for (int i = 0; i < N; i++) b[i] = T(a op b[i]);                                      \
    return b;                                                                             \
  }                                                                                       \
  template <class T, int N> vec<T, N>& operator op##=(vec<T, N>& a, const vec<T, N>& b) { \
    return a = a op b;                                                                    \
  }
MSL_VEC_OP(+)
MSL_VEC_OP(-)
MSL_VEC_OP(*)
MSL_VEC_OP(/)
#define MSL_VEC_TYPES(T, name) \
  typedef vec<T, 2> name##2;   \
  typedef vec<T, 3> name##3;   \
  typedef vec<T, 4> name##4;
MSL_VEC_TYPES(float, float)
MSL_VEC_TYPES(half, half)
MSL_VEC_TYPES(int, int)
MSL_VEC_TYPES(uint, uint)
MSL_VEC_TYPES(short, short)
MSL_VEC_TYPES(ushort, ushort)
MSL_VEC_TYPES(bool, bool)

enum class mem_flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

// ---- runtime interface (scheduler.cpp, memory.cpp)--------------------------------------------
namespace mslrt {
struct Attrs {
  uint3 thread_position_in_grid, threadgroup_position_in_grid, thread_position_in_threadgroup;
  uint3 threads_per_threadgroup, dispatch_threads_per_threadgroup, threadgroups_per_grid;
  uint3 threads_per_grid, grid_size, grid_origin;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width;
  uint quadgroup_index_in_threadgroup, thread_index_in_quadgroup;
};
struct SimdSlot {
  alignas(16) unsigned char in[64];
  alignas(16) unsigned char out[64];
  int arg;
};
typedef void (*SimdCombine)(SimdSlot* const* lanes, int count);
SimdSlot& my_slot();
const Attrs& current_attrs();  // the running GPU thread's attributes (the CUDA shim's threadIdx, ...)
void simd_rendezvous(const char* op, int line, SimdCombine combine);
void barrier(const char* op, int line);
void* tg_alloc(int line, const char* name, size_t bytes, size_t align);
void tg_access(const void* p, size_t bytes, bool write, const char* name, long index);
[[noreturn]] void fail(const char* fmt, ...);

template <class T> T load(const unsigned char* b) {
  T v;
  std::memcpy(&v, b, sizeof(T));
  return v;
}
template <class T> void store(unsigned char* b, const T& v) { std::memcpy(b, &v, sizeof(T)); }

// Checked threadgroup memory: bounds, uninitialised reads and unsynchronised sharing.
template <class T> struct tg_ref {
  T* p;
  const char* name;
  long index;
  operator T() const {
    tg_access(p, sizeof(T), false, name, index);
    return load<T>(reinterpret_cast<const unsigned char*>(p));
  }
  const tg_ref& operator=(const T& v) const {
    tg_access(p, sizeof(T), true, name, index);
    store(reinterpret_cast<unsigned char*>(p), v);
    return *this;
  }
  const tg_ref& operator=(const tg_ref& o) const { return *this = T(o); }
  template <class U> const tg_ref& operator+=(const U& v) const { return *this = T(T(*this) + v); }
  template <class U> const tg_ref& operator-=(const U& v) const { return *this = T(T(*this) - v); }
  template <class U> const tg_ref& operator*=(const U& v) const { return *this = T(T(*this) * v); }
  template <class U> const tg_ref& operator/=(const U& v) const { return *this = T(T(*this) / v); }
};
template <class T> struct tg_ptr {
  T* base;
  long count, offset;
  const char* name;
  tg_ref<T> operator[](long i) const {
    long j = offset + i;
    if (j < 0 || j >= count)
      fail("threadgroup array '%s' index %ld out of bounds [0, %ld)", name, j, count);
    return tg_ref<T>{base + j, name, j};
  }
  tg_ref<T> operator*() const { return (*this)[0]; }
  tg_ptr operator+(long n) const { return tg_ptr{base, count, offset + n, name}; }
  tg_ptr operator-(long n) const { return tg_ptr{base, count, offset - n, name}; }
  tg_ptr& operator+=(long n) { offset += n; return *this; }
};
template <class T> struct tg_array : tg_ptr<T> {
  tg_array(int line, const char* name, long count)
      : tg_ptr<T>{static_cast<T*>(tg_alloc(line, name, sizeof(T) * count, alignof(T))), count, 0, name} {}
};
}  // namespace mslrt

#define MSL_TG_ARRAY(T, name, count) mslrt::tg_array<T> name(__LINE__, #name, (count))

// ---- the metal namespace ---------------------------------------------------------------
namespace metal {
template <class T> T max(T a, T b) { return a > b ? a : b; }
template <class T> T min(T a, T b) { return a < b ? a : b; }
template <class T> T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T> T select(T a, T b, bool c) { return c ? b : a; }
template <class T> T abs(T x) { return x < T(0) ? T(-x) : x; }
template <class T, class U> T as_type(const U& v) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs equal sizes");
  T r;
  std::memcpy(&r, &v, sizeof(T));
  return r;
}
#define MSL_UNARY(fn)                                            \
  inline float fn(float x) { return std::fn(x); }                \
  inline half fn(half x) { return half(std::fn(float(x))); }     \
  inline bfloat16_t fn(bfloat16_t x) { return std::fn(float(x)); }
MSL_UNARY(exp)
MSL_UNARY(exp2)
MSL_UNARY(log)
MSL_UNARY(log2)
MSL_UNARY(sqrt)
MSL_UNARY(tanh)
MSL_UNARY(floor)
MSL_UNARY(ceil)
MSL_UNARY(fabs)
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float pow(float a, float b) { return std::pow(a, b); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
namespace fast {
using metal::exp; using metal::exp2; using metal::log; using metal::sqrt; using metal::rsqrt;
using metal::tanh; using metal::max; using metal::min;
}
namespace precise {
using metal::exp; using metal::exp2; using metal::log; using metal::sqrt; using metal::rsqrt;
using metal::tanh;
}

inline void threadgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  mslrt::barrier("threadgroup_barrier", line);
}
inline void simdgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  mslrt::simd_rendezvous("simdgroup_barrier", line, [](mslrt::SimdSlot* const*, int) {});
}

// Reductions follow the GPU's butterfly order (offsets 16, 8, 4, 2, 1) for fidelity.
template <class T, class F> void simd_tree(mslrt::SimdSlot* const* lanes, int count, F op) {
  T v[32];
  for (int i = 0; i < 32; i++) v[i] = i < count ? mslrt::load<T>(lanes[i]->in) : T(0);
  int width = 1;
  while (width < count) width <<= 1;
  for (int off = width / 2; off > 0; off >>= 1)
    for (int i = 0; i < off; i++)
      if (i + off < count) v[i] = op(v[i], v[i + off]);
  for (int i = 0; i < count; i++) mslrt::store(lanes[i]->out, v[0]);
}
#define MSL_SIMD_REDUCE(fn, expr)                                                     \
  template <class T> T fn(T x, int line = __builtin_LINE()) {                         \
    static_assert(sizeof(T) <= 64, "simd value too large");                           \
    mslrt::store(mslrt::my_slot().in, x);                                             \
    mslrt::simd_rendezvous(#fn, line, [](mslrt::SimdSlot* const* l, int n) {          \
      simd_tree<T>(l, n, [](T a, T b) -> T { return expr; });                         \
    });                                                                               \
    return mslrt::load<T>(mslrt::my_slot().out);                                      \
  }
MSL_SIMD_REDUCE(simd_sum, T(a + b))
MSL_SIMD_REDUCE(simd_product, T(a * b))
MSL_SIMD_REDUCE(simd_max, (a > b ? a : b))
MSL_SIMD_REDUCE(simd_min, (a < b ? a : b))

// Lane-to-lane exchange: each lane names a source lane (computed from its own argument).
#define MSL_SIMD_SHUFFLE(fn, src_expr)                                                \
  template <class T> T fn(T x, ushort arg, int line = __builtin_LINE()) {             \
    mslrt::SimdSlot& s = mslrt::my_slot();                                            \
    mslrt::store(s.in, x);                                                            \
    s.arg = int(arg);                                                                 \
    mslrt::simd_rendezvous(#fn, line, [](mslrt::SimdSlot* const* l, int n) {          \
      for (int i = 0; i < n; i++) {                                                   \
        int a = l[i]->arg;                                                            \
        int src = (src_expr);                                                         \
        if (src < 0 || src >= n) src = i;                                             \
        std::memcpy(l[i]->out, l[src]->in, sizeof(T));                                \
      }                                                                               \
    });                                                                               \
    return mslrt::load<T>(s.out);                                                     \
  }
MSL_SIMD_SHUFFLE(simd_shuffle, a)
MSL_SIMD_SHUFFLE(simd_broadcast, a)
MSL_SIMD_SHUFFLE(simd_shuffle_down, i + a)
MSL_SIMD_SHUFFLE(simd_shuffle_up, i - a)
MSL_SIMD_SHUFFLE(simd_shuffle_xor, i ^ a)

template <class T> T simd_broadcast_first(T x, int line = __builtin_LINE()) {
  mslrt::store(mslrt::my_slot().in, x);
  mslrt::simd_rendezvous("simd_broadcast_first", line, [](mslrt::SimdSlot* const* l, int n) {
    for (int i = 0; i < n; i++) std::memcpy(l[i]->out, l[0]->in, sizeof(T));
  });
  return mslrt::load<T>(mslrt::my_slot().out);
}
inline bool simd_any(bool x, int line = __builtin_LINE()) { return simd_max(int(x), line) != 0; }
inline bool simd_all(bool x, int line = __builtin_LINE()) { return simd_min(int(x), line) != 0; }
}  // namespace metal

using namespace metal;

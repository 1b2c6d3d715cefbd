// Internal state shared by the emulator runtime (scheduler.cpp, memory.cpp).
#pragma once
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "metal_shim.h"

extern "C" void msl_launch(void** buffers, const mslrt::Attrs& attrs);

namespace mslrt {

constexpr int kSimdWidth = 32;
constexpr size_t kStrictThreadgroupBytes = 32768;
constexpr size_t kArenaBytes = 1 << 20;
constexpr size_t kStackBytes = 64 * 1024;
constexpr int kMultipleReaders = -2;

enum State { RUNNABLE, AT_SIMD, AT_BARRIER, DONE };

struct Buffer {
  std::string name;
  size_t nbytes = 0;
  uint32_t flags = 0;  // 1 = output, 2 = read-only
  char* map = nullptr;
  size_t map_len = 0;
  char* ptr = nullptr;
};

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;  // guard page at the bottom
  int tid = 0, sg = 0, lane = 0;
  State state = DONE;
  const char* op = "";
  int line = 0;
  long seq = 0;  // simd ops (in its simdgroup) or barriers executed so far
  long barrier_seq = 0;
  SimdSlot slot;
  SimdCombine combine = nullptr;
  Attrs attrs;
};

struct SimdGroup {
  int first = 0, size = 0, arrived = 0, exited = 0;
  uint32_t epoch = 0;  // simd rendezvous completed
};

struct TgAlloc {
  int line;
  const char* name;
  size_t offset, bytes;
};

struct Shadow {  // per threadgroup-memory byte
  uint32_t w_epoch, r_epoch, w_simd, r_simd;
  int16_t writer, reader;
  uint8_t init;
};

struct Runtime {
  uint32_t grid[3], group[3];
  uint64_t seed = 0;
  bool strict = true;
  std::vector<Buffer> buffers;
  std::vector<void*> buffer_ptrs;
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> sgs;
  std::vector<int> runnable;
  int live = 0, barrier_arrived = 0, exited = 0;
  uint32_t barrier_epoch = 0;
  Fiber* cur = nullptr;
  ucontext_t sched;
  std::mt19937_64 rng;
  uint32_t tg_pos[3] = {0, 0, 0};
  unsigned char* arena = nullptr;
  std::vector<Shadow> shadow;
  std::vector<TgAlloc> allocs;
  size_t arena_used = 0;
  size_t page = 4096;
  char* altstack = nullptr;
};

extern Runtime R;

void describe_thread(char* out, size_t n);
void reset_threadgroup_memory();
void run_threadgroup(const uint32_t gpos[3]);

}  // namespace mslrt

// Runs one Metal compute dispatch (dispatchThreads semantics) on the CPU.
// Every GPU thread of a threadgroup is a ucontext fiber; simd_* ops and barriers are
// rendezvous points; the fiber picked next is drawn from a seeded RNG. Strict mode turns
// divergent simd ops / barriers, threadgroup races and uninitialised reads into errors.
// Buffers sit right before a PROT_NONE guard page, so any access past the end faults and
// the SIGSEGV handler names the buffer.
//
// usage: runner <input file> <output file>   (format written by harness.py)
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
namespace {

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
Runtime R;

void describe_thread(char* out, size_t n) {
  if (!R.cur) {
    snprintf(out, n, "outside any GPU thread");
    return;
  }
  const Attrs& a = R.cur->attrs;
  snprintf(out, n, "threadgroup (%u,%u,%u) thread %d (simdgroup %d lane %d)", a.threadgroup_position_in_grid.x,
           a.threadgroup_position_in_grid.y, a.threadgroup_position_in_grid.z, R.cur->tid, R.cur->sg,
           R.cur->lane);
}

}  // namespace

[[noreturn]] void fail(const char* fmt, ...) {
  char msg[1024], who[160];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  describe_thread(who, sizeof who);
  fprintf(stderr, "MSL-ERROR: %s [%s]\n", msg, who);
  fflush(stderr);
  _exit(3);
}

namespace {

std::string lane_list(const std::vector<int>& lanes) {
  std::string s;
  for (size_t i = 0; i < lanes.size();) {
    size_t j = i;
    while (j + 1 < lanes.size() && lanes[j + 1] == lanes[j] + 1) j++;
    if (!s.empty()) s += ",";
    s += std::to_string(lanes[i]);
    if (j > i) s += "-" + std::to_string(lanes[j]);
    i = j + 1;
  }
  return s;
}

void switch_to_scheduler() { swapcontext(&R.cur->ctx, &R.sched); }

void resolve_simd(SimdGroup& g) {
  int lead = g.first;
  while (R.fibers[lead].state != AT_SIMD) lead++;
  Fiber& f0 = R.fibers[lead];
  std::vector<int> same, other;
  for (int i = 0; i < g.size; i++) {
    Fiber& f = R.fibers[g.first + i];
    if (f.state == DONE) continue;  // only in non-strict mode
    bool match = f.state == AT_SIMD && f.line == f0.line && f.seq == f0.seq && strcmp(f.op, f0.op) == 0;
    (match ? same : other).push_back(f.lane);
  }
  if (!other.empty()) {
    Fiber& f = R.fibers[g.first + other[0]];
    R.cur = &f0;
    fail("divergent simd ops in simdgroup %d: lanes %s at %s (line %d, #%ld), lanes %s at %s (line %d, #%ld)",
         f0.sg, lane_list(same).c_str(), f0.op, f0.line, f0.seq, lane_list(other).c_str(),
         f.state == AT_SIMD ? f.op : "a barrier", f.line, f.seq);
  }
  SimdSlot* slots[kSimdWidth];
  int count = 0;
  for (int i = 0; i < g.size; i++)
    if (R.fibers[g.first + i].state == AT_SIMD) slots[count++] = &R.fibers[g.first + i].slot;
  f0.combine(slots, count);
  g.arrived = 0;
  g.epoch++;
  for (int i = 0; i < g.size; i++) {
    Fiber& f = R.fibers[g.first + i];
    if (f.state != AT_SIMD) continue;
    f.state = RUNNABLE;
    R.runnable.push_back(g.first + i);
  }
}

void release_barrier() {
  Fiber* first = nullptr;
  for (Fiber& f : R.fibers) {
    if (f.state != AT_BARRIER) continue;
    if (!first) first = &f;
    if (f.line != first->line || f.barrier_seq != first->barrier_seq) {
      R.cur = &f;
      fail("threads wait at different barriers: thread %d at line %d (#%ld), thread %d at line %d (#%ld)",
           first->tid, first->line, first->barrier_seq, f.tid, f.line, f.barrier_seq);
    }
  }
  R.barrier_arrived = 0;
  R.barrier_epoch++;
  for (Fiber& f : R.fibers)
    if (f.state == AT_BARRIER) {
      f.state = RUNNABLE;
      R.runnable.push_back(f.tid);
    }
}

void exited_lanes(const SimdGroup& g, std::vector<int>& exited, std::vector<int>& waiting) {
  for (int i = 0; i < g.size; i++) {
    const Fiber& f = R.fibers[g.first + i];
    (f.state == DONE ? exited : waiting).push_back(f.lane);
  }
}

// A simdgroup rendezvous in strict mode needs every lane of the simdgroup.
void check_simd_complete(SimdGroup& g) {
  int expected = R.strict ? g.size : g.size - g.exited;
  if (R.strict && g.exited > 0 && g.arrived > 0) {
    std::vector<int> exited, waiting;
    exited_lanes(g, exited, waiting);
    Fiber& f = R.fibers[g.first + waiting[0]];
    R.cur = &f;
    fail("%s at line %d reached by only some lanes of simdgroup %d: lanes %s exited", f.op, f.line, g.first / kSimdWidth,
         lane_list(exited).c_str());
  }
  if (g.arrived > 0 && g.arrived == expected) resolve_simd(g);
}

void check_barrier_complete() {
  int expected = R.strict ? int(R.fibers.size()) : R.live;
  if (R.strict && R.exited > 0 && R.barrier_arrived > 0) {
    for (Fiber& f : R.fibers)
      if (f.state == AT_BARRIER) {
        R.cur = &f;
        fail("threadgroup_barrier at line %d reached by only some threads: %d of %zu threads exited", f.line,
             R.exited, R.fibers.size());
      }
  }
  if (R.barrier_arrived > 0 && R.barrier_arrived == expected) release_barrier();
}

void report_deadlock() {
  for (SimdGroup& g : R.sgs) {
    for (int i = 0; i < g.size; i++) {
      Fiber& f = R.fibers[g.first + i];
      if (f.state != AT_SIMD) continue;
      std::vector<int> at, elsewhere;
      for (int j = 0; j < g.size; j++) {
        Fiber& o = R.fibers[g.first + j];
        (o.state == AT_SIMD && o.line == f.line && o.seq == f.seq ? at : elsewhere).push_back(o.lane);
      }
      R.cur = &f;
      fail("%s at line %d reached by only some lanes of simdgroup %d: lanes %s wait, lanes %s are elsewhere", f.op,
           f.line, f.sg, lane_list(at).c_str(), lane_list(elsewhere).c_str());
    }
  }
  for (Fiber& f : R.fibers)
    if (f.state == AT_BARRIER) {
      R.cur = &f;
      fail("threadgroup_barrier at line %d reached by only some threads (%d of %d live threads arrived)", f.line,
           R.barrier_arrived, R.live);
    }
  fail("deadlock: no runnable thread");
}

void fiber_entry() {
  msl_launch(R.buffer_ptrs.data(), R.cur->attrs);
  R.cur->state = DONE;
}  // returns to the scheduler through uc_link

void init_fibers(int count) {
  if (int(R.fibers.size()) == count) return;
  for (Fiber& f : R.fibers) munmap(f.stack, kStackBytes + R.page);
  R.fibers.assign(count, Fiber());
  for (int i = 0; i < count; i++) {
    char* s = static_cast<char*>(mmap(nullptr, kStackBytes + R.page, PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (s == MAP_FAILED) fail("cannot map fiber stacks");
    mprotect(s, R.page, PROT_NONE);
    R.fibers[i].stack = s;
  }
}

Attrs make_attrs(const uint32_t gpos[3], const uint32_t size[3], int tid) {
  Attrs a{};
  uint32_t lx = tid % size[0], ly = (tid / size[0]) % size[1], lz = tid / (size[0] * size[1]);
  uint32_t groups[3];
  for (int d = 0; d < 3; d++) groups[d] = (R.grid[d] + R.group[d] - 1) / R.group[d];
  a.threadgroup_position_in_grid = uint3(gpos[0], gpos[1], gpos[2]);
  a.thread_position_in_threadgroup = uint3(lx, ly, lz);
  a.thread_position_in_grid =
      uint3(gpos[0] * R.group[0] + lx, gpos[1] * R.group[1] + ly, gpos[2] * R.group[2] + lz);
  a.threads_per_threadgroup = uint3(size[0], size[1], size[2]);
  a.dispatch_threads_per_threadgroup = uint3(R.group[0], R.group[1], R.group[2]);
  a.threadgroups_per_grid = uint3(groups[0], groups[1], groups[2]);
  a.threads_per_grid = a.grid_size = uint3(R.grid[0], R.grid[1], R.grid[2]);
  a.grid_origin = uint3(0u);
  uint32_t total = size[0] * size[1] * size[2];
  a.thread_index_in_threadgroup = tid;
  a.thread_index_in_simdgroup = tid % kSimdWidth;
  a.simdgroup_index_in_threadgroup = tid / kSimdWidth;
  a.simdgroups_per_threadgroup = (total + kSimdWidth - 1) / kSimdWidth;
  a.threads_per_simdgroup = a.thread_execution_width = kSimdWidth;
  a.quadgroup_index_in_threadgroup = tid / 4;
  a.thread_index_in_quadgroup = tid % 4;
  return a;
}

void reset_threadgroup_memory() {
  size_t used = std::max<size_t>(R.arena_used, 1);
  memset(R.arena, 0xff, used);  // poison: NaN in every float format
  memset(R.shadow.data(), 0, sizeof(Shadow) * used);
  R.allocs.clear();
  R.arena_used = 0;
}

void run_threadgroup(const uint32_t gpos[3]) {
  uint32_t size[3];
  for (int d = 0; d < 3; d++) size[d] = std::min(R.group[d], R.grid[d] - gpos[d] * R.group[d]);
  int count = int(size[0] * size[1] * size[2]);
  init_fibers(count);
  reset_threadgroup_memory();
  R.sgs.assign((count + kSimdWidth - 1) / kSimdWidth, SimdGroup());
  for (size_t s = 0; s < R.sgs.size(); s++) {
    R.sgs[s].first = int(s) * kSimdWidth;
    R.sgs[s].size = std::min(kSimdWidth, count - int(s) * kSimdWidth);
  }
  R.runnable.clear();
  R.live = count;
  R.exited = R.barrier_arrived = 0;
  R.barrier_epoch = 0;
  for (int d = 0; d < 3; d++) R.tg_pos[d] = gpos[d];
  for (int i = 0; i < count; i++) {
    Fiber& f = R.fibers[i];
    f.tid = i;
    f.sg = i / kSimdWidth;
    f.lane = i % kSimdWidth;
    f.state = RUNNABLE;
    f.seq = f.barrier_seq = 0;
    f.attrs = make_attrs(gpos, size, i);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack + R.page;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &R.sched;
    makecontext(&f.ctx, fiber_entry, 0);
    R.runnable.push_back(i);
  }
  while (!R.runnable.empty()) {
    size_t k = R.rng() % R.runnable.size();
    std::swap(R.runnable[k], R.runnable.back());
    Fiber& f = R.fibers[R.runnable.back()];
    R.runnable.pop_back();
    R.cur = &f;
    swapcontext(&R.sched, &f.ctx);
    SimdGroup& g = R.sgs[f.sg];
    if (f.state == AT_SIMD) {
      g.arrived++;
      check_simd_complete(g);
    } else if (f.state == AT_BARRIER) {
      R.barrier_arrived++;
      check_barrier_complete();
    } else if (f.state == DONE) {
      R.live--;
      R.exited++;
      g.exited++;
      check_simd_complete(g);
      check_barrier_complete();
    }
    R.cur = nullptr;
  }
  if (R.live > 0) report_deadlock();
}

// ---- buffers, guard pages, faults -------------------------------------------------------

void on_fault(int sig, siginfo_t* info, void* uctx) {
  char* addr = static_cast<char*>(info->si_addr);
  bool write = (static_cast<ucontext_t*>(uctx)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
  const char* what = write ? "write" : "read";
  for (Buffer& b : R.buffers) {
    char* end = b.ptr + b.nbytes;
    if (addr >= end && addr < end + R.page)
      fail("out-of-bounds %s %ld bytes past the end of buffer '%s' (%zu bytes)", what, long(addr - end), b.name.c_str(),
           b.nbytes);
    if (addr >= b.map && addr < b.ptr)
      fail("out-of-bounds %s %ld bytes before the start of buffer '%s'", what, long(b.ptr - addr), b.name.c_str());
    if (addr >= b.ptr && addr < end && write)
      fail("write to read-only input buffer '%s' at byte %ld", b.name.c_str(), long(addr - b.ptr));
  }
  for (Fiber& f : R.fibers)
    if (addr >= f.stack && addr < f.stack + R.page) fail("GPU thread stack overflow (fiber stack %zu KB)", kStackBytes / 1024);
  fail("%s at address %p (signal %d): not inside any buffer", write ? "invalid write" : "invalid read", (void*)addr, sig);
}

void install_fault_handler() {
  R.altstack = static_cast<char*>(malloc(1 << 16));
  stack_t ss{};
  ss.ss_sp = R.altstack;
  ss.ss_size = 1 << 16;
  sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
}

void place_buffer(Buffer& b, const char* data) {
  size_t body = (b.nbytes + R.page - 1) / R.page * R.page;
  b.map_len = body + 2 * R.page;
  b.map = static_cast<char*>(mmap(nullptr, b.map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (b.map == MAP_FAILED) fail("cannot map buffer '%s' (%zu bytes)", b.name.c_str(), b.nbytes);
  if (body) mprotect(b.map + R.page, body, PROT_READ | PROT_WRITE);
  b.ptr = b.map + R.page + (body - b.nbytes);  // the end touches the trailing guard page
  memcpy(b.ptr, data, b.nbytes);
  if ((b.flags & 2) && body) mprotect(b.map + R.page, body, PROT_READ);
}

template <class T> T read_value(FILE* f) {
  T v;
  if (fread(&v, sizeof v, 1, f) != 1) fail("truncated input file");
  return v;
}

void read_input(const char* path) {
  FILE* f = fopen(path, "rb");
  if (!f) fail("cannot open %s", path);
  char magic[8];
  if (fread(magic, 1, 8, f) != 8 || memcmp(magic, "MSLRUN1", 8) != 0) fail("bad input file %s", path);
  for (int d = 0; d < 3; d++) R.grid[d] = read_value<uint32_t>(f);
  for (int d = 0; d < 3; d++) R.group[d] = read_value<uint32_t>(f);
  R.seed = read_value<uint64_t>(f);
  R.strict = read_value<uint32_t>(f) != 0;
  uint32_t count = read_value<uint32_t>(f);
  R.buffers.resize(count);
  std::vector<char> data;
  for (Buffer& b : R.buffers) {
    uint32_t len = read_value<uint32_t>(f);
    b.name.resize(len);
    if (len && fread(&b.name[0], 1, len, f) != len) fail("truncated input file");
    b.nbytes = read_value<uint64_t>(f);
    b.flags = read_value<uint32_t>(f);
    data.resize(b.nbytes + 1);
    if (b.nbytes && fread(data.data(), 1, b.nbytes, f) != b.nbytes) fail("truncated input file");
    place_buffer(b, data.data());
    R.buffer_ptrs.push_back(b.ptr);
  }
  fclose(f);
}

void write_outputs(const char* path) {
  FILE* f = fopen(path, "wb");
  if (!f) fail("cannot write %s", path);
  for (Buffer& b : R.buffers)
    if ((b.flags & 1) && b.nbytes) fwrite(b.ptr, 1, b.nbytes, f);
  fclose(f);
}

}  // namespace

// ---- interface used by the shim -------------------------------------------------------

SimdSlot& my_slot() { return R.cur->slot; }

void simd_rendezvous(const char* op, int line, SimdCombine combine) {
  Fiber* f = R.cur;
  f->state = AT_SIMD;
  f->op = op;
  f->line = line;
  f->combine = combine;
  f->seq++;
  switch_to_scheduler();
}

void barrier(const char* op, int line) {
  Fiber* f = R.cur;
  f->state = AT_BARRIER;
  f->op = op;
  f->line = line;
  f->barrier_seq++;
  switch_to_scheduler();
}

void* tg_alloc(int line, const char* name, size_t bytes, size_t align) {
  for (TgAlloc& a : R.allocs)
    if (a.line == line && strcmp(a.name, name) == 0) return R.arena + a.offset;
  size_t offset = (R.arena_used + align - 1) / align * align;
  size_t limit = R.strict ? kStrictThreadgroupBytes : kArenaBytes;
  if (offset + bytes > limit)
    fail("threadgroup memory exceeds %zu bytes: '%s' (%zu bytes, line %d) would end at byte %zu", limit, name, bytes,
         line, offset + bytes);
  R.allocs.push_back(TgAlloc{line, name, offset, bytes});
  R.arena_used = offset + bytes;
  return R.arena + offset;
}

void tg_access(const void* p, size_t bytes, bool write, const char* name, long index) {
  size_t at = static_cast<const unsigned char*>(p) - R.arena;
  Fiber* f = R.cur;
  uint32_t simd_epoch = R.sgs[f->sg].epoch;
  for (size_t i = at; i < at + bytes; i++) {
    Shadow& s = R.shadow[i];
    bool writer_same_epoch = s.init && s.w_epoch == R.barrier_epoch && s.writer != f->tid;
    bool writer_synced = writer_same_epoch && R.fibers[s.writer].sg == f->sg && s.w_simd < simd_epoch;
    if (!write) {
      if (!s.init && R.strict) fail("read of uninitialised threadgroup memory '%s'[%ld]", name, index);
      if (R.strict && writer_same_epoch && !writer_synced)
        fail("threadgroup race on '%s'[%ld]: read of a value thread %d wrote since the last barrier", name, index,
             s.writer);
      if (s.r_epoch != R.barrier_epoch + 1) {
        s.r_epoch = R.barrier_epoch + 1;  // +1 so that 0 means "never read"
        s.reader = int16_t(f->tid);
        s.r_simd = simd_epoch;
      } else if (s.reader != f->tid) {
        s.reader = kMultipleReaders;
      }
      continue;
    }
    if (R.strict && writer_same_epoch && !writer_synced)
      fail("threadgroup race on '%s'[%ld]: thread %d also wrote it since the last barrier", name, index, s.writer);
    if (R.strict && s.r_epoch == R.barrier_epoch + 1 && s.reader != f->tid) {
      bool synced = s.reader >= 0 && R.fibers[s.reader].sg == f->sg && s.r_simd < simd_epoch;
      if (!synced)
        fail("threadgroup race on '%s'[%ld]: overwritten while %s read it since the last barrier", name, index,
             s.reader == kMultipleReaders ? "other threads" : ("thread " + std::to_string(s.reader)).c_str());
    }
    s.init = 1;
    s.writer = int16_t(f->tid);
    s.w_epoch = R.barrier_epoch;
    s.w_simd = simd_epoch;
  }
}

}  // namespace mslrt

int main(int argc, char** argv) {
  using namespace mslrt;
  if (argc != 3) {
    fprintf(stderr, "usage: %s <input> <output>\n", argv[0]);
    return 2;
  }
  R.page = size_t(sysconf(_SC_PAGESIZE));
  install_fault_handler();
  read_input(argv[1]);
  R.rng.seed(R.seed);
  R.arena = static_cast<unsigned char*>(malloc(kArenaBytes));
  R.shadow.resize(kArenaBytes);
  R.arena_used = kArenaBytes;
  uint32_t groups[3];
  for (int d = 0; d < 3; d++) groups[d] = (R.grid[d] + R.group[d] - 1) / R.group[d];
  std::vector<uint32_t> order(size_t(groups[0]) * groups[1] * groups[2]);
  for (size_t i = 0; i < order.size(); i++) order[i] = uint32_t(i);
  std::shuffle(order.begin(), order.end(), R.rng);  // no ordering between threadgroups either
  for (uint32_t id : order) {
    uint32_t gpos[3] = {id % groups[0], (id / groups[0]) % groups[1], id / (groups[0] * groups[1])};
    run_threadgroup(gpos);
  }
  write_outputs(argv[2]);
  return 0;
}

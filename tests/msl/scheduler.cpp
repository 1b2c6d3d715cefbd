// Runs one Metal compute dispatch (dispatchThreads semantics) on the CPU: every GPU thread of
// a threadgroup is a ucontext fiber; simd_* ops and barriers are rendezvous points; the fiber
// run next is drawn from a seeded RNG. Strict mode turns divergent simd ops and barriers into
// errors (threadgroup-memory and buffer checks live in memory.cpp).
#include "runtime.h"

namespace mslrt {

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

}  // namespace

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

SimdSlot& my_slot() { return R.cur->slot; }

const Attrs& current_attrs() { return R.cur->attrs; }

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

}  // namespace mslrt

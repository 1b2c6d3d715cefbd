// Memory side of the emulator: checked threadgroup memory (poisoned, bounds, uninitialised
// reads, unsynchronised sharing, 32 KB limit), buffers placed right before a PROT_NONE guard
// page so any access past the end faults and the SIGSEGV handler names the buffer, and main().
//
// usage: runner <input file> <output file>   (format written by harness.py)
#include "runtime.h"

namespace mslrt {
namespace {

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

void reset_threadgroup_memory() {
  size_t used = std::max<size_t>(R.arena_used, 1);
  memset(R.arena, 0xff, used);  // poison: NaN in every float format
  memset(R.shadow.data(), 0, sizeof(Shadow) * used);
  R.allocs.clear();
  R.arena_used = 0;
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

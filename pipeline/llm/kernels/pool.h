// Helper threads for the kernels' loops (products over blocks of output features, attention over
// rows and heads) that the calling thread never waits on to start.
//
// Why not OpenMP (at::parallel_for built with -fopenmp): a decoding step opens ~150 parallel
// regions, and each OpenMP region hands every thread its share up front, then waits for all of them.
// On a machine whose cores other processes share, a region whose second thread is not scheduled
// waits a scheduler slice for it: measured 2026-12-02 under load ~4, a one-token step took 396 ms
// on two threads against 28 ms on one (docs/benchmarks/history.md, "Lean step and llama.cpp").
//
// Here a loop's range is claimed a chunk at a time from one atomic cursor by whoever runs: the
// caller claims chunks too, so a helper that is late or asleep only leaves it more to do, and the
// caller waits for nothing but the chunks a helper has claimed and not finished (asleep on a futex,
// so that its core is free for that helper). Which thread computes a chunk changes no bit of it.
//
// Sharing still loses where the cores are oversubscribed: with one busy process beside a decoding
// step on 2 cores, the caller, its helper and that process share two cores, a spinning helper
// takes time the caller needs, and a preempted one keeps it waiting (measured 2026-12-05: 54 tok/s
// on two threads against 78 on one; 107 against 87 on an idle machine). Which of the two wins is
// the machine's state, so the pool measures it (`Chooser`): it times its loops in epochs of
// kEpochLoops, shared or on the caller alone, keeps the faster way for some epochs (8, doubling
// while the other keeps losing), then times the other way for one epoch again.
//
// A helper spins a short while for the next loop (a step's loops come microseconds apart), then
// sleeps on a futex until the caller posts one. Linux only (futex); elsewhere threads() stays 1.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#define SPECVOX_POOL 1
#else
#define SPECVOX_POOL 0
#endif

namespace specvox {

class Pool {
 public:
  using Body = void (*)(const void* context, int64_t begin, int64_t end);

  // One pool a process, never destroyed: at exit its helpers may still be asleep in the kernel.
  static Pool& instance() {
    static Pool* pool = new Pool();
    return *pool;
  }

  int threads() const { return 1 + helpers_.load(std::memory_order_relaxed); }

  // 1: the caller alone. Takes effect between loops; returns the count now in force.
  int set_threads(int count) {
#if SPECVOX_POOL
    count = std::max(1, std::min(count, 64));
    while (busy_.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
    const int wanted = count - 1;
    helpers_.store(wanted, std::memory_order_relaxed);  // helpers numbered >= wanted leave
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    futex(&epoch_, FUTEX_WAKE_PRIVATE, INT_MAX);
    while (alive_.load(std::memory_order_acquire) > wanted) std::this_thread::yield();
    for (int i = alive_.load(std::memory_order_relaxed); i < wanted; ++i) {
      alive_.fetch_add(1, std::memory_order_acq_rel);
      std::thread([this, i] { serve(i); }).detach();
    }
    for (Chooser& chooser : choosers_) chooser.reset();
    busy_.store(false, std::memory_order_release);
#endif
    return threads();
  }

  // f(b, e) over [begin, end) in chunks of `chunk` (the last may be shorter), on the caller and
  // the helpers. A loop posted while another runs (another caller, or a nested one) runs on its
  // caller alone. `kind`: the loop's class (kinds(): one-row products, products of several rows,
  // attention, ...), each timed by a chooser of its own; `work`: what the loop does, in a unit its
  // kind shares (a product's rows × inputs × blocks); 0: its item count.
  template <class F>
  void run(int64_t begin, int64_t end, int64_t chunk, const F& f, double work = 0.0, int kind = 0) {
    chunk = std::max<int64_t>(chunk, 1);
    if (end - begin <= chunk || helpers_.load(std::memory_order_relaxed) == 0 ||
        busy_.exchange(true, std::memory_order_acquire)) {
      f(begin, end);
      return;
    }
    Chooser& chooser = choosers_[std::clamp(kind, 0, kKinds - 1)];
    const bool shared = chooser.shared();
    const auto started = Clock::now();
    if (shared) {
      post(begin, end, chunk, [](const void* context, int64_t b, int64_t e) { (*static_cast<const F*>(context))(b, e); }, &f);
    } else {
      f(begin, end);
    }
    chooser.timed(work > 0.0 ? work : static_cast<double>(end - begin), Clock::now() - started);
    last_kind_.store(static_cast<int>(&chooser - choosers_), std::memory_order_relaxed);
    busy_.store(false, std::memory_order_release);
  }

  // Loops run shared and on the caller alone since the pool started (all kinds), and the latest
  // epoch's work a second each way of the kind timed last (0: not timed yet).
  struct Counts {
    int64_t shared_loops, solo_loops;
    double shared_rate, solo_rate;
  };
  Counts counts() const {
    Counts c{0, 0, 0.0, 0.0};
    for (const Chooser& chooser : choosers_) {
      c.shared_loops += chooser.loops[1].load();
      c.solo_loops += chooser.loops[0].load();
    }
    const Chooser& last = choosers_[last_kind_.load(std::memory_order_relaxed)];
    c.shared_rate = last.rate[1].load();
    c.solo_rate = last.rate[0].load();
    return c;
  }

  // Loop kinds with a chooser each: whether sharing pays depends on the loop (a one-row product is
  // bound by memory, one of several rows by arithmetic), and an epoch that mixed kinds compared
  // mixes. Measured 2026-12-05: with one chooser for all, epochs of one-row loops shared against
  // epochs of 12-row loops alone left every loop alone, a prompt's products at 0.69 ms a row on 2
  // threads against 0.73 on one.
  static constexpr int kKinds = 6;
  static int product_kind(int64_t rows) { return rows <= 1 ? 0 : rows <= 4 ? 1 : rows <= 12 ? 2 : 3; }
  static constexpr int kAttention = 4, kOther = 5;

 private:
  // A loop's description, written before the cursor names its generation; slots turn over so that
  // a helper reading a stale generation's slot reads one that is not being written (its claim then
  // fails on the generation in the cursor).
  struct Loop {
    std::atomic<Body> body{nullptr};
    std::atomic<const void*> context{nullptr};
    std::atomic<int64_t> begin{0}, count{0}, chunk{1};
  };
  static constexpr int kSlots = 4;
  static constexpr auto kSpin = std::chrono::microseconds(200);  // a helper's wait before it sleeps
  using Clock = std::chrono::steady_clock;

  // Shared or alone, whichever did more work a second of loop time in its latest epoch, for one
  // kind of loop (kinds above): speculative decoding mixes one-token steps with passes of several
  // rows and a draft head's small products, whose costs differ, so each kind is timed apart.
  struct Chooser {
    static constexpr int64_t kEpochLoops = 512;  // about four one-token steps of the bundled target
    // epochs the faster way keeps before the other is timed again: 8, doubled each time the other
    // loses again (up to 128: about 500 steps), back to 8 when it wins
    static constexpr int64_t kFirstKeep = 8, kLastKeep = 128;
    bool sharing = true;
    int64_t epoch_loops = 0, epochs_kept = 0, keep = kFirstKeep;
    double epoch_work = 0.0;
    bool probing = false;  // this epoch times the way that lost
    Clock::duration epoch_time{};
    std::atomic<int64_t> loops[2] = {0, 0};          // [alone, shared]
    std::atomic<double> rate[2] = {0.0, 0.0};

    bool shared() const { return sharing; }
    void timed(double work, Clock::duration took) {
      loops[sharing].fetch_add(1, std::memory_order_relaxed);
      epoch_work += work;
      epoch_time += took;
      if (++epoch_loops < kEpochLoops) return;
      const double seconds = std::chrono::duration<double>(epoch_time).count();
      rate[sharing].store(seconds > 0 ? epoch_work / seconds : 0.0, std::memory_order_relaxed);
      epoch_loops = 0;
      epoch_work = 0.0;
      epoch_time = Clock::duration::zero();
      const double mine = rate[sharing].load(), other = rate[!sharing].load();
      if (other == 0.0) {  // the first epochs: time each way once
        sharing = !sharing;
      } else if (probing) {  // the losing way timed again: keep it if it now wins
        probing = false;
        keep = mine > other ? kFirstKeep : std::min(2 * keep, kLastKeep);
        if (mine <= other) sharing = !sharing;
        epochs_kept = 0;
      } else if (other > mine) {  // the other way was faster when last timed
        sharing = !sharing;
        keep = kFirstKeep;
        epochs_kept = 0;
      } else if (++epochs_kept >= keep) {
        sharing = !sharing;
        probing = true;
      }
    }
    void reset() {
      sharing = true;
      probing = false;
      keep = kFirstKeep;
      epoch_loops = epochs_kept = 0;
      epoch_work = 0.0;
      epoch_time = Clock::duration::zero();
      rate[0] = rate[1] = 0.0;
    }
  };

  Pool() {
#if SPECVOX_POOL
    // A forked child has the caller's thread alone: start it with no helpers.
    pthread_atfork(nullptr, nullptr, [] {
      Pool& p = instance();
      p.helpers_.store(0);
      p.alive_.store(0);
      p.sleepers_.store(0);
      p.busy_.store(false);
    });
#endif
  }

#if SPECVOX_POOL
  static long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout = nullptr) {
    static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex is a 32-bit word");
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
  }

  void post(int64_t begin, int64_t end, int64_t chunk, Body body, const void* context) {
    const uint32_t generation = ++generation_;
    Loop& loop = loops_[generation % kSlots];
    loop.body.store(body, std::memory_order_relaxed);
    loop.context.store(context, std::memory_order_relaxed);
    loop.begin.store(begin, std::memory_order_relaxed);
    loop.count.store(end - begin, std::memory_order_relaxed);
    loop.chunk.store(chunk, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    cursor_.store(static_cast<uint64_t>(generation) << 32, std::memory_order_release);
    epoch_.store(generation, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(&epoch_, FUTEX_WAKE_PRIVATE, INT_MAX);
    work(generation);
    finish(static_cast<uint32_t>(end - begin));
  }

  // Claim and run chunks of `generation` until none is left (or the cursor has moved on).
  void work(uint32_t generation) {
    const Loop& loop = loops_[generation % kSlots];
    const Body body = loop.body.load(std::memory_order_relaxed);
    const void* context = loop.context.load(std::memory_order_relaxed);
    const int64_t begin = loop.begin.load(std::memory_order_relaxed);
    const int64_t count = loop.count.load(std::memory_order_relaxed);
    const int64_t chunk = loop.chunk.load(std::memory_order_relaxed);
    uint64_t cursor = cursor_.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(cursor >> 32) != generation) return;
      const int64_t at = static_cast<int64_t>(cursor & 0xffffffffu);
      if (at >= count) return;
      const int64_t n = std::min(chunk, count - at);
      if (!cursor_.compare_exchange_weak(cursor, cursor + n, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      body(context, begin + at, begin + at + n);
      done_.fetch_add(static_cast<uint32_t>(n), std::memory_order_seq_cst);
      if (caller_asleep_.load(std::memory_order_seq_cst)) futex(&done_, FUTEX_WAKE_PRIVATE, 1);
      cursor = cursor_.load(std::memory_order_acquire);
    }
  }

  // The caller: wait for the chunks helpers still hold, spinning 20 µs, then asleep (so that a
  // helper can have the caller's core; 1 ms at most a sleep).
  void finish(uint32_t count) {
    const auto until = Clock::now() + std::chrono::microseconds(20);
    for (int spins = 0; done_.load(std::memory_order_acquire) < count; ++spins) {
      if ((spins & 63) != 63 || Clock::now() < until) {
        _mm_pause();
        continue;
      }
      caller_asleep_.store(true, std::memory_order_seq_cst);
      const uint32_t seen = done_.load(std::memory_order_seq_cst);
      if (seen < count) {
        const timespec millisecond{0, 1000000};
        futex(&done_, FUTEX_WAIT_PRIVATE, seen, &millisecond);
      }
      caller_asleep_.store(false, std::memory_order_relaxed);
    }
  }

  // A helper's life: run each new loop's chunks; between loops spin kSpin, then sleep.
  void serve(int index) {
    uint32_t seen = static_cast<uint32_t>(cursor_.load(std::memory_order_acquire) >> 32);
    auto idle_since = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      if (index >= helpers_.load(std::memory_order_acquire)) break;
      const uint32_t generation = static_cast<uint32_t>(cursor_.load(std::memory_order_acquire) >> 32);
      if (generation != seen) {
        seen = generation;
        work(generation);
        idle_since = std::chrono::steady_clock::now();
        spins = 0;
        continue;
      }
      if (spins < 64 || std::chrono::steady_clock::now() - idle_since < kSpin) {
        _mm_pause();
        continue;
      }
      const uint32_t epoch = epoch_.load(std::memory_order_seq_cst);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (static_cast<uint32_t>(cursor_.load(std::memory_order_seq_cst) >> 32) == seen &&
          index < helpers_.load(std::memory_order_seq_cst)) {
        futex(&epoch_, FUTEX_WAIT_PRIVATE, epoch);
      }
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      idle_since = std::chrono::steady_clock::now();
      spins = 0;
    }
    alive_.fetch_sub(1, std::memory_order_acq_rel);
  }
#else
  void post(int64_t begin, int64_t end, int64_t, Body body, const void* context) { body(context, begin, end); }
#endif

  Loop loops_[kSlots];
  uint32_t generation_ = 0;                   // the caller's (under busy_), as is the choosers' state
  Chooser choosers_[kKinds];
  std::atomic<int> last_kind_{0};
  std::atomic<uint64_t> cursor_{0};           // generation << 32 | next unclaimed offset
  std::atomic<uint32_t> done_{0};             // items finished in the current loop
  std::atomic<uint32_t> epoch_{0};            // futex word the helpers sleep on
  std::atomic<int> sleepers_{0}, helpers_{0}, alive_{0};
  std::atomic<bool> busy_{false}, caller_asleep_{false};
};

// at::parallel_for's shape, on the pool: f(b, e) over [begin, end) in chunks of `grain`; `work` and
// `kind` as in run().
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f, double work = 0.0,
                         int kind = Pool::kOther) {
  Pool::instance().run(begin, end, grain, f, work, kind);
}

}  // namespace specvox

// The kernels' own thread pool: how every parallel kernel in this library splits its work.
//
// A kernel hands the pool a count of independent items (weight panels, row blocks, attention
// blocks); every item's result depends only on the item, never on which thread computed it, so the
// bits of an output do not depend on the thread count or on how the work fell out.
//
// Why not OpenMP's static split: each thread then owns a fixed share and the call ends at a barrier.
// On a machine where something else is running, the OS takes a thread off its core for a whole time
// slice, and every other thread waits at the next barrier, dozens of times per layer; waiters that
// spin take CPU from the thread they are waiting for. Here:
//  - each thread starts on a contiguous share of the items (the locality of a static split: one
//    slice of the weights streamed per thread), claimed a few items at a time through an atomic
//    counter; a thread that runs out takes items from the others' shares, so the share of a thread
//    that is off its core is done by those that are running;
//  - the caller computes too and waits only for items that a running thread has claimed, never for a
//    thread that has not arrived: a late thread finds no work and leaves;
//  - waiting spins for a short time (a kernel follows another within microseconds) and then sleeps
//    on a futex, so an idle pool costs no CPU and a descheduled thread's core is given back to it.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace minisgl::cpu {

// The items [0, n) shared out among the `slots` threads of one call. claim() returns the next run of
// items for the thread in `slot`: from its own share first, then from the others'.
class WorkShare {
   public:
    WorkShare(int64_t n, int slots, int64_t grain);
    bool claim(int slot, int64_t& begin, int64_t& end);
    int slots() const { return slots_; }

   private:
    static constexpr int kMaxSlots = 64;
    struct alignas(64) Share {
        int64_t next;  // atomically incremented by claim()
        int64_t end;
    };
    int slots_;
    int64_t grain_;
    Share shares_[kMaxSlots];
    bool delayed_[kMaxSlots] = {};  // the test delay, once per slot and call
};

// Runs body(share, slot) on the calling thread (slot 0) and on up to threads - 1 pool threads; each
// call of body claims items from `share` until none is left. Returns when every item has been
// computed. Called from a pool thread, or while another caller holds the pool, it runs on the caller
// alone (same items, same bits).
void run_parallel(int threads, int64_t n, int64_t grain, const std::function<void(WorkShare&, int)>& body);

// The common form: body(begin, end) over runs of items. grain 0 picks one.
void parallel_for(int threads, int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

// Test hook: the pool thread in `slot` sleeps `micros` microseconds after claiming its first items in
// every call (0: off), so tests can show that a late thread changes no bits and blocks no call.
void pool_set_test_delay(int slot, int64_t micros);

// Test hook: runs n empty items over `threads` and returns the slot that claimed each one.
std::vector<int> pool_claims(int threads, int64_t n, int64_t grain);

// Where the threads come from. By default the pool's own. With OpenMP on, every call runs on the
// OpenMP team instead (the libgomp torch loads): for a process where torch's own parallel ops do much
// of the work, whose OpenMP threads would otherwise spin beside the pool's and take their cores.
void pool_use_openmp(bool on);

// Whether the threads of a call pin themselves, slot s to the s-th CPU of the process's affinity mask:
// 0 while the pool reads contended (the default, MINISGL_PIN_THREADS=auto), 1 always (on), 2 never
// (off). pool.cpp says why.
void pool_set_pinning(int mode);

// The CPUs of the calling thread's affinity mask, or the process's where the pool pinned the thread:
// what the process may use, whichever thread asks.
std::vector<int> pool_affinity();

// Whether the threads running kernels have been kept waiting for a core over the last windows
// (another busy process on the machine): waiting is then passive, and the engine may use fewer threads.
bool pool_contended();

}  // namespace minisgl::cpu

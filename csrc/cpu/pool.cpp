// The kernels' thread pool (pool.h says why it exists and what it promises).
//
// One job at a time: the caller publishes it by bumping `gen_`; a pool thread that sees the new
// generation registers in `active_`, checks that the job is still open, runs the body, and leaves.
// The caller runs the body too, then closes the job and waits until `active_` is zero. A thread that
// registers after the close leaves without touching the job, so the caller never waits for a thread
// that has not started on the job: only for the items that running threads have claimed.

#include "pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <immintrin.h>
#include <omp.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace minisgl::cpu {
namespace {

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word, int count) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

int64_t spin_from_env() {
    const char* v = std::getenv("MINISGL_SPIN_US");
    return v && *v ? std::max<int64_t>(0, std::atoll(v)) * 1000 : 200'000;
}

const int64_t g_spin_ns = spin_from_env();  // MINISGL_SPIN_US, read once at load
std::atomic<int> g_delay_slot{0};
std::atomic<int64_t> g_delay_us{0};
thread_local bool t_in_pool = false;  // a pool thread, or a caller inside run_parallel

// Set while the pool's threads are kept waiting for a core (Contention below): waiting threads
// then sleep at once instead of spinning, since a spinning thread takes the core from the one it waits
// for, or from the other process.
std::atomic<bool> g_contended{false};

// Spins until done() holds or the spin time is over; true if done() held.
template <typename Done>
bool spin_until(const Done& done) {
    const int64_t budget = g_contended.load(std::memory_order_relaxed) ? 0 : g_spin_ns;
    if (budget <= 0) return done();
    const int64_t until = now_ns() + budget;
    for (;;) {
        for (int i = 0; i < 32; ++i) {
            if (done()) return true;
            _mm_pause();
        }
        if (now_ns() >= until) return done();
    }
}

// The time a thread has spent runnable but waiting for a core (the kernel's schedstat run_delay),
// in nanoseconds; -1 where the kernel does not say.
int64_t run_delay_ns(pid_t tid) {
    char path[64];
    std::snprintf(path, sizeof path, "/proc/self/task/%d/schedstat", static_cast<int>(tid));
    FILE* f = std::fopen(path, "r");
    if (!f) return -1;
    long long on_cpu = 0, waiting = -1;
    const int got = std::fscanf(f, "%lld %lld", &on_cpu, &waiting);
    std::fclose(f);
    return got == 2 ? waiting : -1;
}

// Whether the threads running kernels wait for a core: once a window, the run-queue wait each of
// them (pool threads and callers) accumulated over the window, as a share of it; the largest share
// against kContendedShare. On an idle machine it stays near zero; beside another busy process the
// threads spend a large part of every window waiting, far above the threshold.
class Contention {
   public:
    static constexpr int64_t kWindowNs = 20'000'000;
    static constexpr double kContendedShare = 0.05;

    void add_thread(pid_t tid) {
        std::lock_guard<std::mutex> lock(mu_);
        for (const Seen& t : threads_)
            if (t.tid == tid) return;
        threads_.push_back({tid, -1});
    }

    void clear() {
        std::lock_guard<std::mutex> lock(mu_);
        threads_.clear();
        last_ns_ = 0;
        over_ = 0;
    }

    // Called at the start of each parallel call; reads the counters once a window.
    void update() {
        const int64_t now = now_ns();
        if (now - __atomic_load_n(&last_ns_, __ATOMIC_RELAXED) < kWindowNs) return;
        std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
        if (!lock.owns_lock()) return;
        const int64_t window = now - last_ns_;
        double worst = 0.0;
        bool measured = false;
        for (Seen& t : threads_) {
            const int64_t d = run_delay_ns(t.tid);
            if (d >= 0 && t.delay >= 0 && last_ns_ > 0) {
                worst = std::max(worst, static_cast<double>(d - t.delay) / window);
                measured = true;
            }
            t.delay = d;
        }
        // A caller thread that has ended reads -1: forget it (an engine's compute thread ends with it).
        threads_.erase(std::remove_if(threads_.begin(), threads_.end(), [](const Seen& t) { return t.delay < 0; }),
                       threads_.end());
        if (measured) {
            // Two windows in a row over the share before waiting turns passive: one can be a start-up
            // or a burst of the engine's own threads.
            over_ = worst > kContendedShare ? over_ + 1 : 0;
            g_contended.store(over_ >= 2, std::memory_order_relaxed);
            if (debug_) std::fprintf(stderr, "minisgl pool: run-queue share %.3f\n", worst);
        }
        __atomic_store_n(&last_ns_, now, __ATOMIC_RELAXED);
    }

   private:
    struct Seen {
        pid_t tid;
        int64_t delay;  // run_delay at the last window, -1 before the first
    };
    std::mutex mu_;
    std::vector<Seen> threads_;
    int64_t last_ns_ = 0;
    int over_ = 0;  // windows in a row over the share
    const bool debug_ = std::getenv("MINISGL_POOL_DEBUG") != nullptr;
};

thread_local bool t_registered = false;  // this thread's run-queue wait is watched

// Where the threads running a call sit. On a contended machine the OS, left free, can stack two of
// the pool's threads on one core and leave the other process alone on the next: one thread then runs
// at half speed, the other waits for its items, and the process gets about one core of the two it
// may use. A thread pinned to a core of its own (slot s to the s-th CPU of the process's affinity
// mask) shares that core with the other process at worst, while the threads on the other cores take
// its items: the process keeps its share of every core. An idle machine gains nothing from pinning
// and every thread stays free to move; so by default (MINISGL_PIN_THREADS=auto) the threads pin
// while the pool reads contended and return to the process's mask when it no longer does; `on` pins
// whenever a call runs on more than one thread, `off` never.
enum PinMode : int { PIN_AUTO = 0, PIN_ON = 1, PIN_OFF = 2 };

int pin_mode_from_env() {
    const char* v = std::getenv("MINISGL_PIN_THREADS");
    if (!v || !*v || std::strcmp(v, "auto") == 0) return PIN_AUTO;
    if (std::strcmp(v, "on") == 0) return PIN_ON;
    if (std::strcmp(v, "off") == 0) return PIN_OFF;
    std::fprintf(stderr, "minisgl pool: MINISGL_PIN_THREADS=%s is not one of auto, on, off; using auto\n", v);
    return PIN_AUTO;
}

std::atomic<int> g_pin_mode{pin_mode_from_env()};

// The process's affinity mask when the pool started: the CPUs slots are pinned to, and the mask an
// unpinned thread returns to.
struct Cpus {
    cpu_set_t mask;
    std::vector<int> list;
    Cpus() {
        CPU_ZERO(&mask);
        if (sched_getaffinity(0, sizeof mask, &mask) != 0) return;
        for (int c = 0; c < CPU_SETSIZE; ++c)
            if (CPU_ISSET(c, &mask)) list.push_back(c);
    }
};

const Cpus& process_cpus() {
    static const Cpus* cpus = new Cpus();  // read once, before any thread pins itself
    return *cpus;
}

thread_local int t_pinned_cpu = -1;  // the CPU this thread pinned itself to; -1: the process's mask

// Called by each thread taking part in a call of `threads` threads, as `slot`: pins it or returns it
// to the process's mask as the mode and the contention say, with one system call per change.
void place_self(int slot, int threads) {
    const Cpus& cpus = process_cpus();
    const int mode = g_pin_mode.load(std::memory_order_relaxed);
    const bool pin = threads > 1 && slot < threads && threads <= static_cast<int>(cpus.list.size()) &&
                     (mode == PIN_ON || (mode == PIN_AUTO && g_contended.load(std::memory_order_relaxed)));
    const int want = pin ? cpus.list[static_cast<size_t>(slot)] : -1;
    if (want == t_pinned_cpu || cpus.list.empty()) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    if (want >= 0) CPU_SET(want, &one);
    if (sched_setaffinity(0, sizeof(cpu_set_t), want >= 0 ? &one : &cpus.mask) == 0) t_pinned_cpu = want;
}

class Pool {
   public:
    static Pool& get() {
        // Never destroyed: its threads sleep in the kernel at exit and are ended with the process.
        static Pool* pool = [] {
            auto* p = new Pool();
            pthread_atfork(nullptr, nullptr, [] { Pool::get().after_fork(); });
            return p;
        }();
        return *pool;
    }

    void watch_caller() {
        if (!t_registered) {
            t_registered = true;
            contention_.add_thread(static_cast<pid_t>(syscall(SYS_gettid)));
        }
        contention_.update();
    }

    void run(int threads, WorkShare& share, const std::function<void(WorkShare&, int)>& body) {
        grow(threads - 1);
        place_self(0, threads);
        job_share_ = &share;
        job_body_ = &body;
        job_slots_ = threads;
        error_ = nullptr;
        closed_.store(false);
        gen_.fetch_add(1);
        if (sleepers_.load() > 0) futex_wake(&gen_, INT_MAX);
        body(share, 0);
        closed_.store(true);
        if (!spin_until([&] { return active_.load() == 0; })) {
            caller_waiting_.store(1);
            for (uint32_t a; (a = active_.load()) != 0;) futex_wait(&active_, a);
            caller_waiting_.store(0);
        }
        if (error_) std::rethrow_exception(error_);
    }

    std::mutex call_mu;  // one caller at a time; others run alone

   private:
    void grow(int want) {
        std::lock_guard<std::mutex> lock(grow_mu_);
        for (; started_ < want; ++started_) std::thread([this, slot = started_ + 1] { worker(slot); }).detach();
    }

    void after_fork() {  // the child has the caller's thread only
        started_ = 0;
        t_registered = false;
        contention_.clear();
        g_contended.store(false);
        active_.store(0);
        sleepers_.store(0);
        closed_.store(true);
    }

    void worker(int slot) {
        t_in_pool = true;
        char name[16];
        std::snprintf(name, sizeof name, "minisgl-pool-%d", slot);
        pthread_setname_np(pthread_self(), name);  // so top -H and /proc name the pool's threads
        contention_.add_thread(static_cast<pid_t>(syscall(SYS_gettid)));
        uint32_t seen = gen_.load();
        for (;;) {
            if (!spin_until([&] { return gen_.load() != seen; })) {
                sleepers_.fetch_add(1);
                while (gen_.load() == seen) futex_wait(&gen_, seen);
                sleepers_.fetch_sub(1);
            }
            const uint32_t g = gen_.load();
            seen = g;
            place_self(slot, job_slots_);  // before the job: a thread that comes late is placed too
            active_.fetch_add(1);
            if (!closed_.load() && gen_.load() == g && slot < job_slots_) {
                try {
                    (*job_body_)(*job_share_, slot);
                } catch (...) {
                    std::lock_guard<std::mutex> lock(error_mu_);
                    if (!error_) error_ = std::current_exception();
                }
            }
            if (active_.fetch_sub(1) == 1 && caller_waiting_.load()) futex_wake(&active_, 1);
        }
    }

    std::mutex grow_mu_, error_mu_;
    int started_ = 0;
    alignas(64) std::atomic<uint32_t> gen_{0};
    alignas(64) std::atomic<uint32_t> active_{0};
    alignas(64) std::atomic<int> sleepers_{0};
    std::atomic<int> caller_waiting_{0};
    std::atomic<bool> closed_{true};
    // The open job: written by the caller before it bumps gen_, read by pool threads after.
    WorkShare* job_share_ = nullptr;
    const std::function<void(WorkShare&, int)>* job_body_ = nullptr;
    int job_slots_ = 0;
    std::exception_ptr error_;
    Contention contention_;
};

}  // namespace

WorkShare::WorkShare(int64_t n, int slots, int64_t grain) : slots_(std::clamp(slots, 1, kMaxSlots)) {
    grain_ = grain > 0 ? grain : std::max<int64_t>(1, n / (8 * slots_));
    for (int s = 0; s < slots_; ++s) {
        shares_[s].next = n * s / slots_;
        shares_[s].end = n * (s + 1) / slots_;
    }
}

bool WorkShare::claim(int slot, int64_t& begin, int64_t& end) {
    for (int i = 0; i < slots_; ++i) {
        Share& sh = shares_[(slot + i) % slots_];
        if (__atomic_load_n(&sh.next, __ATOMIC_RELAXED) >= sh.end) continue;
        const int64_t b = __atomic_fetch_add(&sh.next, grain_, __ATOMIC_RELAXED);
        if (b >= sh.end) continue;
        begin = b;
        end = std::min(sh.end, b + grain_);
        if (slot != 0 && slot == g_delay_slot.load(std::memory_order_relaxed) && !delayed_[slot]) {
            delayed_[slot] = true;  // only this slot's thread touches its flag
            const int64_t us = g_delay_us.load(std::memory_order_relaxed);
            if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
        }
        return true;
    }
    return false;
}

std::atomic<bool> g_openmp{false};

void run_parallel(int threads, int64_t n, int64_t grain, const std::function<void(WorkShare&, int)>& body) {
    threads = static_cast<int>(std::min<int64_t>({threads, n, 64}));
    Pool& pool = Pool::get();
    if (!t_in_pool) pool.watch_caller();
    if (threads > 1 && g_openmp.load(std::memory_order_relaxed) && !omp_in_parallel()) {
        WorkShare share(n, threads, grain);
        std::exception_ptr error;
#pragma omp parallel num_threads(threads)
        {
            try {
                body(share, omp_get_thread_num());
            } catch (...) {
#pragma omp critical
                if (!error) error = std::current_exception();
            }
        }
        if (error) std::rethrow_exception(error);
        return;
    }
    std::unique_lock<std::mutex> lock(pool.call_mu, std::defer_lock);
    if (threads <= 1 || t_in_pool || !lock.try_lock()) {
        if (threads <= 1 && !t_in_pool) place_self(0, 1);  // one thread: free to move again
        WorkShare share(n, 1, grain);
        body(share, 0);
        return;
    }
    WorkShare share(n, threads, grain);
    t_in_pool = true;
    try {
        pool.run(threads, share, body);
    } catch (...) {
        t_in_pool = false;
        throw;
    }
    t_in_pool = false;
}

void parallel_for(int threads, int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
    if (n <= 0) return;
    run_parallel(threads, n, grain, [&](WorkShare& share, int slot) {
        for (int64_t b, e; share.claim(slot, b, e);) body(b, e);
    });
}

std::vector<int> pool_claims(int threads, int64_t n, int64_t grain) {
    std::vector<int> by(static_cast<size_t>(n), -1);
    run_parallel(threads, n, grain, [&](WorkShare& share, int slot) {
        for (int64_t b, e; share.claim(slot, b, e);)
            for (int64_t i = b; i < e; ++i) by[i] = slot;
    });
    return by;
}

void pool_set_test_delay(int slot, int64_t micros) {
    g_delay_slot.store(slot);
    g_delay_us.store(micros);
}

void pool_use_openmp(bool on) { g_openmp.store(on); }
void pool_set_pinning(int mode) { g_pin_mode.store(mode); }

std::vector<int> pool_affinity() {
    if (t_pinned_cpu >= 0) return process_cpus().list;
    cpu_set_t mask;
    CPU_ZERO(&mask);
    std::vector<int> cpus;
    if (sched_getaffinity(0, sizeof mask, &mask) == 0)
        for (int c = 0; c < CPU_SETSIZE; ++c)
            if (CPU_ISSET(c, &mask)) cpus.push_back(c);
    return cpus;
}
bool pool_contended() { return g_contended.load(); }

}  // namespace minisgl::cpu

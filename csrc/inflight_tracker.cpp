// minisgl_backend.native._native: the completion-callback core of the executor.
//
// Backpressure: at most `max_inflight` submitted-but-unfinished iterations; the completion callback
// only decrements a counter and pushes an id. That callback lives in native code, so a CUDA host
// function never touches the GIL or a Python object (a Python callback would contend for the GIL
// with every other thread of the pipeline on every iteration), and Python drains finished ids in bulk.
//
// Built without torch or CUDA headers: the CUDA runtime is looked up at run time (dlopen/dlsym), so one
// build serves CPU-only and GPU machines.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// Shared by the Python object and every pending CUDA host callback (shared ownership keeps it alive
// until the last callback has fired, even if Python dropped the tracker).
struct TrackerState {
    explicit TrackerState(int64_t max) : max_inflight(max) {}

    const int64_t max_inflight;
    std::atomic<int64_t> inflight{0};  // atomic, not locked: an atomic costs far less than a mutex

    std::mutex mu;  // guards `done` and `woken`
    std::condition_variable cv;
    std::vector<int64_t> done;  // completion order
    bool woken = false;

    std::atomic<int64_t> spurious{0};  // completions refused because nothing was in flight

    // The completion path (any thread, including the CUDA runtime's callback thread): count + push,
    // nothing else, so the callback thread is never held up. Notifying after unlocking keeps the waiter from waking
    // into a held mutex. Returns false (and changes nothing) when no iteration is in flight: the count never goes
    // negative, which would silently disable backpressure.
    bool complete(int64_t id) noexcept {
        int64_t cur = inflight.load(std::memory_order_relaxed);
        do {
            if (cur <= 0) {
                spurious.fetch_add(1, std::memory_order_relaxed);
                return false;
            }
        } while (!inflight.compare_exchange_weak(cur, cur - 1, std::memory_order_acq_rel));
        {
            std::lock_guard<std::mutex> lk(mu);
            done.push_back(id);
        }
        cv.notify_all();
        return true;
    }
};

// ---- CUDA runtime, resolved at run time -------------------------------------------------------------

using HostFn = void (*)(void*);
using LaunchHostFunc = int (*)(void* stream, HostFn fn, void* user_data);  // cudaError_t is an int enum
using GetErrorString = const char* (*)(int);

struct CudaRuntime {
    LaunchHostFunc launch_host_func = nullptr;
    GetErrorString get_error_string = nullptr;
};

std::mutex g_cuda_mu;
CudaRuntime g_cuda;  // cached only once found: a later call may succeed after torch loads CUDA

bool try_handle(void* handle) {
    if (handle == nullptr) return false;
    auto launch = reinterpret_cast<LaunchHostFunc>(dlsym(handle, "cudaLaunchHostFunc"));
    if (launch == nullptr) return false;
    g_cuda.launch_host_func = launch;
    g_cuda.get_error_string = reinterpret_cast<GetErrorString>(dlsym(handle, "cudaGetErrorString"));
    return true;
}

// Prefer the runtime the process already has (torch's): same context, same version.
const CudaRuntime* cuda_runtime() {
    std::lock_guard<std::mutex> lk(g_cuda_mu);
    if (g_cuda.launch_host_func != nullptr) return &g_cuda;
    if (try_handle(dlopen(nullptr, RTLD_NOW))) return &g_cuda;
    static const char* const kSonames[] = {"libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so"};
    for (const char* name : kSonames) {  // already loaded, e.g. RTLD_LOCAL by torch
        if (try_handle(dlopen(name, RTLD_NOW | RTLD_NOLOAD))) return &g_cuda;
    }
    for (const char* name : kSonames) {
        if (try_handle(dlopen(name, RTLD_NOW | RTLD_LOCAL))) return &g_cuda;  // LOCAL: never interpose torch's
    }
    return nullptr;
}

struct HostPayload {
    std::shared_ptr<TrackerState> state;
    int64_t id;
};

// Runs on the CUDA runtime's thread when the stream reaches it. Must not call CUDA or Python.
extern "C" void minisgl_host_complete(void* raw) {
    std::unique_ptr<HostPayload> payload(static_cast<HostPayload*>(raw));
    payload->state->complete(payload->id);
}

// ---- Python-facing class ----------------------------------------------------------------------------

class InflightTracker {
   public:
    explicit InflightTracker(int64_t max_inflight) {
        if (max_inflight < 1) throw py::value_error("max_inflight must be >= 1");
        state_ = std::make_shared<TrackerState>(max_inflight);
    }

    void begin() {
        auto& s = *state_;
        int64_t cur = s.inflight.load(std::memory_order_relaxed);
        do {
            if (cur >= s.max_inflight) {
                throw std::runtime_error("InflightTracker.begin: " + std::to_string(cur) +
                                         " iterations in flight, max_inflight=" + std::to_string(s.max_inflight));
            }
        } while (!s.inflight.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel));
    }

    void complete(int64_t id) {
        if (!state_->complete(id)) {
            throw std::runtime_error("InflightTracker.complete(" + std::to_string(id) + "): no iteration is in flight");
        }
    }

    std::vector<int64_t> wait(double timeout_s) {
        if (std::isnan(timeout_s)) throw py::value_error("timeout_s must be a number");
        std::vector<int64_t> out;
        {
            py::gil_scoped_release nogil;  // other Python threads run while we block
            auto& s = *state_;
            std::unique_lock<std::mutex> lk(s.mu);
            auto ready = [&s] { return !s.done.empty() || s.woken; };
            if (timeout_s >= 1e9) {  // effectively forever; avoids overflowing the clock's duration
                s.cv.wait(lk, ready);
            } else if (timeout_s > 0) {
                s.cv.wait_for(lk, std::chrono::duration<double>(timeout_s), ready);
            }
            s.woken = false;
            out.swap(s.done);  // one swap hands the whole batch over
        }
        return out;
    }

    std::vector<int64_t> drain() {
        std::vector<int64_t> out;
        std::lock_guard<std::mutex> lk(state_->mu);
        out.swap(state_->done);
        return out;
    }

    void wake() {
        {
            std::lock_guard<std::mutex> lk(state_->mu);
            state_->woken = true;
        }
        state_->cv.notify_all();
    }

    int64_t inflight() const { return state_->inflight.load(std::memory_order_acquire); }
    int64_t max_inflight() const { return state_->max_inflight; }

    void cuda_host_complete(uintptr_t stream_handle, int64_t id) {
        const CudaRuntime* rt = cuda_runtime();
        if (rt == nullptr) {
            throw std::runtime_error(
                "cuda_host_complete: no CUDA runtime found (looked in the process, then libcudart.so.12/.13/"
                ".so); use a CUDA build of torch or callback_impl='python'");
        }
        auto* payload = new HostPayload{state_, id};
        int err = rt->launch_host_func(reinterpret_cast<void*>(stream_handle), &minisgl_host_complete, payload);
        if (err != 0) {
            delete payload;
            std::string msg = rt->get_error_string ? rt->get_error_string(err) : "unknown error";
            throw std::runtime_error("cudaLaunchHostFunc failed (" + std::to_string(err) + "): " + msg);
        }
    }

   private:
    std::shared_ptr<TrackerState> state_;
};

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "Native in-flight counter and completion queue for the minisgl executor.";

    py::class_<InflightTracker>(m, "InflightTracker")
        .def(py::init<int64_t>(), py::arg("max_inflight"))
        .def("begin", &InflightTracker::begin, "Count one submitted iteration; RuntimeError beyond max_inflight.")
        .def("complete", &InflightTracker::complete, py::arg("iteration_id"),
             "Decrement the counter and queue the id; callable from any thread. RuntimeError when "
             "no iteration is in flight (the count never goes negative).")
        .def("wait", &InflightTracker::wait, py::arg("timeout_s"),
             "Release the GIL, block until an id is queued, wake() or timeout; drain all queued ids.")
        .def("drain", &InflightTracker::drain, "Return all queued ids without blocking.")
        .def("wake", &InflightTracker::wake, "Make a current or the next wait() return early.")
        .def_property_readonly("inflight", &InflightTracker::inflight)
        .def_property_readonly("max_inflight", &InflightTracker::max_inflight)
        .def("cuda_host_complete", &InflightTracker::cuda_host_complete, py::arg("stream_handle"),
             py::arg("iteration_id"), "Enqueue complete(iteration_id) on a CUDA stream (cudaLaunchHostFunc).")
        .def("__repr__", [](const InflightTracker& t) {
            return "<InflightTracker native inflight=" + std::to_string(t.inflight()) +
                   " max_inflight=" + std::to_string(t.max_inflight()) + ">";
        });

    m.def(
        "cuda_runtime_available", [] { return cuda_runtime() != nullptr; },
        "True if a CUDA runtime with cudaLaunchHostFunc can be found in or loaded into the process.");
}

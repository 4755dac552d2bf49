// Tensors handed to the bindings (bindings.cpp), read and checked here, without torch's headers.
//
// A binding takes torch tensors as Python objects and reads each through its DLPack capsule
// (torch.utils.dlpack.to_dlpack): data pointer, device, dtype, shape and strides in one C struct
// whose layout is the DLPack ABI, stable across torch releases. The module links no libtorch, so
// one build runs under every torch the package supports. Every check a kernel relies on (device,
// dtype, rank, shape, contiguity, the sizes the arguments share) happens here, before any pointer
// reaches a kernel, and a failed one raises ValueError naming the op, the argument, what it
// expects and what it got: a swapped or mis-shaped argument is an error, never a stray write.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace minisgl::cpu {

// The DLPack structs (dlpack.h, v0.x "dltensor" capsules), declared here rather than vendored.
namespace dl {
struct Device {
    int32_t device_type;  // 1: CPU
    int32_t device_id;
};
struct DataType {
    uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat
    uint8_t bits;
    uint16_t lanes;
};
struct Tensor {
    void* data;
    Device device;
    int32_t ndim;
    DataType dtype;
    int64_t* shape;
    int64_t* strides;  // in elements; null: compact row-major
    uint64_t byte_offset;
};
struct ManagedTensor {
    Tensor dl_tensor;
    void* manager_ctx;
    void (*deleter)(ManagedTensor*);
};
constexpr int32_t kCPU = 1;
}  // namespace dl

enum class DType { BF16, F32, I64, I8, OTHER };

inline const char* dtype_name(DType t) {
    switch (t) {
        case DType::BF16:
            return "bfloat16";
        case DType::F32:
            return "float32";
        case DType::I64:
            return "int64";
        case DType::I8:
            return "int8";
        case DType::OTHER:
            break;
    }
    return "?";
}

// A dimension an argument may have of any size.
constexpr int64_t ANY = -1;

// One tensor argument of one op, checked. Holds the capsule, and with it the tensor, until the
// view goes away: a binding keeps its views until the kernel has returned.
class TensorArg {
   public:
    TensorArg(const char* op, const char* name, pybind11::handle obj) : op_(op), name_(name) {
        if (obj.is_none()) return;
        // Looked up once and never released: a static py::object would be destroyed at exit,
        // after the interpreter has gone.
        static pybind11::handle to_dlpack =
            pybind11::object(pybind11::module_::import("torch.utils.dlpack").attr("to_dlpack")).release();
        try {
            capsule_ = to_dlpack(obj);
        } catch (pybind11::error_already_set& e) {
            fail("a CPU tensor", std::string(pybind11::str(pybind11::type::handle_of(obj).attr("__name__"))) +
                                     describe_device(obj) + " (" + e.what() + ")");
        }
        auto* managed = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(capsule_.ptr(), "dltensor"));
        if (managed == nullptr) throw pybind11::error_already_set();
        t_ = &managed->dl_tensor;
        if (t_->device.device_type != dl::kCPU)
            fail("a CPU tensor", "a tensor on device type " + std::to_string(t_->device.device_type));
    }

    bool present() const { return t_ != nullptr; }
    int64_t dim() const { return t_->ndim; }
    int64_t size(int64_t i) const { return t_->shape[i < 0 ? i + t_->ndim : i]; }
    int64_t stride(int64_t i) const {
        i = i < 0 ? i + t_->ndim : i;
        if (t_->strides) return t_->strides[i];
        int64_t s = 1;
        for (int64_t j = t_->ndim - 1; j > i; --j) s *= t_->shape[j];
        return s;
    }
    int64_t numel() const {
        int64_t n = 1;
        for (int32_t i = 0; i < t_->ndim; ++i) n *= t_->shape[i];
        return n;
    }
    bool is(DType t) const { return code() == t; }
    int64_t nbytes() const { return numel() * t_->dtype.bits / 8; }
    // The data pointer (0 for an absent optional argument), as the kernels take it.
    uintptr_t ptr() const {
        return t_ ? reinterpret_cast<uintptr_t>(static_cast<char*>(t_->data) + t_->byte_offset) : 0;
    }

    // The argument must be there (not None).
    TensorArg& required() {
        if (!t_) fail("a tensor", "None");
        return *this;
    }
    TensorArg& dtype(DType want) {
        if (t_ && code() != want) fail(std::string("dtype ") + dtype_name(want), "dtype " + got_dtype());
        return *this;
    }
    // bfloat16 or float32, as the row-wise kernels and the attention take.
    TensorArg& floating() {
        if (t_ && code() != DType::BF16 && code() != DType::F32)
            fail("dtype bfloat16 or float32", "dtype " + got_dtype());
        return *this;
    }
    TensorArg& same_dtype(const TensorArg& other) {
        if (t_ && other.t_ && code() != other.code())
            fail(std::string("dtype ") + other.got_dtype() + " (as '" + other.name_ + "')", "dtype " + got_dtype());
        return *this;
    }
    // Exactly these sizes (ANY: whatever that dimension holds).
    TensorArg& shape(std::initializer_list<int64_t> want) {
        if (!t_) return *this;
        bool ok = static_cast<size_t>(t_->ndim) == want.size();
        int64_t i = 0;
        for (int64_t w : want) ok = ok && (w == ANY || (i < t_->ndim && t_->shape[i] == w)), ++i;
        if (!ok) {
            std::string s = "shape [";
            i = 0;
            for (int64_t w : want) s += (i++ ? ", " : "") + (w == ANY ? std::string("*") : std::to_string(w));
            fail(s + "]", "shape " + got_shape());
        }
        return *this;
    }
    // At least one dimension, the last of size `last` (ANY: any).
    TensorArg& rows_of(int64_t last) {
        if (t_ && (t_->ndim < 1 || (last != ANY && size(-1) != last)))
            fail("shape [..., " + (last == ANY ? std::string("*") : std::to_string(last)) + "]",
                 "shape " + got_shape());
        return *this;
    }
    TensorArg& same_shape(const TensorArg& other) {
        if (!t_ || !other.t_) return *this;
        bool ok = t_->ndim == other.t_->ndim;
        for (int32_t i = 0; ok && i < t_->ndim; ++i) ok = t_->shape[i] == other.t_->shape[i];
        if (!ok) fail("shape " + other.got_shape() + " (as '" + other.name_ + "')", "shape " + got_shape());
        return *this;
    }
    TensorArg& min_numel(int64_t n) {
        if (t_ && numel() < n) fail("at least " + std::to_string(n) + " elements", std::to_string(numel()));
        return *this;
    }
    // Row-major without gaps (dimensions of size 1 may carry any stride, as torch's is_contiguous).
    TensorArg& contiguous() {
        if (!t_ || !t_->strides) return *this;
        int64_t expect = 1;
        for (int64_t i = t_->ndim - 1; i >= 0; --i) {
            if (t_->shape[i] != 1 && t_->strides[i] != expect)
                fail("a contiguous tensor", "shape " + got_shape() + " with strides " + got_strides());
            expect *= t_->shape[i];
        }
        return *this;
    }
    // The last dimension contiguous and the others at non-negative strides (a view the kernel walks
    // by its strides, such as q or k inside a fused qkv output).
    TensorArg& inner_contiguous() {
        if (!t_ || !t_->strides || t_->ndim == 0) return *this;
        bool ok = t_->shape[t_->ndim - 1] == 1 || t_->strides[t_->ndim - 1] == 1;
        for (int32_t i = 0; ok && i < t_->ndim; ++i) ok = t_->strides[i] >= 0;
        if (!ok) fail("unit stride in the last dimension", "strides " + got_strides());
        return *this;
    }

    [[noreturn]] void fail(const std::string& want, const std::string& got) const {
        throw pybind11::value_error(std::string("minisgl.") + op_ + ": argument '" + name_ + "' must be " + want +
                                    ", got " + got);
    }

   private:
    DType code() const {
        const auto& d = t_->dtype;
        if (d.lanes == 1 && d.code == 4 && d.bits == 16) return DType::BF16;
        if (d.lanes == 1 && d.code == 2 && d.bits == 32) return DType::F32;
        if (d.lanes == 1 && d.code == 0 && d.bits == 64) return DType::I64;
        if (d.lanes == 1 && d.code == 0 && d.bits == 8) return DType::I8;
        return DType::OTHER;
    }
    std::string got_dtype() const {
        const auto& d = t_->dtype;
        static const char* codes[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
        return std::string(d.code < 7 ? codes[d.code] : "code") + std::to_string(d.bits);
    }
    std::string got_shape() const {
        std::string s = "[";
        for (int32_t i = 0; i < t_->ndim; ++i) s += (i ? ", " : "") + std::to_string(t_->shape[i]);
        return s + "]";
    }
    std::string got_strides() const {
        std::string s = "[";
        for (int32_t i = 0; i < t_->ndim; ++i) s += (i ? ", " : "") + std::to_string(stride(i));
        return s + "]";
    }
    static std::string describe_device(pybind11::handle obj) {
        if (!pybind11::hasattr(obj, "device")) return "";
        return " on " + std::string(pybind11::str(obj.attr("device")));
    }

    const char* op_;
    const char* name_;
    pybind11::object capsule_;
    const dl::Tensor* t_ = nullptr;
};

}  // namespace minisgl::cpu

// The Python module minisgl_backend.native._kernels: pybind11 bindings of every family's entry points
// (kernels.h). Each takes torch tensors, checks them in C++ (tensor_arg.h: device, dtype, shape,
// contiguity and the sizes the arguments share, with a ValueError naming the op and the argument)
// and only then hands their pointers to the kernel, with the GIL released; the pointer arithmetic
// stays on this side. minisgl_backend.model.cpu_kernels decides where a kernel runs and falls back to
// torch elsewhere, and registers these same functions as the torch ops torch.ops.minisgl.*. Built
// without torch headers; every kernel runs on the library's own thread pool (pool.h) with the thread
// count the caller passes.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "tensor_arg.h"

namespace py = pybind11;
using namespace minisgl::cpu;

namespace {

// A bf16 [N, K] weight in a packed layout: a 1-D buffer of at least `elems` elements.
void check_pack(TensorArg& packed, int64_t elems) {
    packed.required().dtype(DType::BF16).contiguous().shape({ANY}).min_numel(elems);
}

// x [M, K] rows, bias [N] or None, y [M, N], all of one dtype (bf16 unless said): what every linear
// entry point shares.
void check_linear_rows(TensorArg& x, TensorArg& bias, TensorArg& y, int64_t n, DType dtype = DType::BF16) {
    x.required().dtype(dtype).shape({ANY, ANY}).contiguous();
    bias.dtype(dtype).shape({n}).contiguous();
    y.required().dtype(dtype).shape({x.size(0), n}).contiguous();
}

// linear_amx's arguments: bf16 x and bias, out bf16 or float32 (true: the bf16 outputs widened).
bool check_packed_linear(TensorArg& x, TensorArg& bias, TensorArg& y, int64_t n) {
    x.required().dtype(DType::BF16).shape({ANY, ANY}).contiguous();
    bias.dtype(DType::BF16).shape({n}).contiguous();
    y.required().floating().shape({x.size(0), n}).contiguous();
    return y.is(DType::F32);
}

void check_ids(const char* op, TensorArg& ids, TensorArg& out, int64_t n, int64_t k) {
    ids.required().dtype(DType::I64).shape({ANY}).contiguous();
    out.required().dtype(DType::BF16).shape({ids.size(0), k}).contiguous();
    const auto* p = reinterpret_cast<const int64_t*>(ids.ptr());
    for (int64_t i = 0; i < ids.size(0); ++i)
        if (p[i] < 0 || p[i] >= n)
            throw py::index_error(std::string("minisgl.") + op + ": row ids out of range for a weight of " +
                                  std::to_string(n) + " rows");
}

// A gated pack ([gate | up], N = 2I) needs whole gate panels: I a multiple of 32.
void check_gated(const char* op, int64_t n, bool gated) {
    if (gated && n % 64)
        throw py::value_error(std::string("minisgl.") + op + ": a gated weight's rows must be a multiple of 64, got " +
                              std::to_string(n));
}

int64_t dpbf16_elems(int64_t n, int64_t k, bool gated) {
    check_gated("pack_dpbf16", n, gated);
    return packed_dpbf16_elems(n, k);
}

int64_t amx_elems(int64_t n, int64_t k, bool gated) {
    check_gated("pack_amx", n, gated);
    return packed_amx_elems(n, k);
}

// One linear of the layer stack, with its tensors (the views keep them alive).
struct BoundLinear {
    StackLinear lin;
    std::vector<TensorArg> keep;
};

// The layer stack and every tensor it points into, which it keeps alive.
class BoundStack {
   public:
    BoundStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps,
               double scale, double softcap, int64_t block_size, int64_t num_blocks, int scorer, int pack_kind, int isa,
               int64_t mlp_rows, bool f32)
        : stack_(heads, kv_heads, head_dim, hidden, intermediate, eps, scale, softcap, block_size, num_blocks, scorer,
                 pack_kind, isa, mlp_rows, f32),
          h_(heads),
          kvh_(kv_heads),
          d_(head_dim),
          hidden_(hidden),
          inter_(intermediate),
          bs_(block_size),
          blocks_(num_blocks),
          pack_kind_(pack_kind),
          dtype_(f32 ? DType::F32 : DType::BF16) {}

    void add_layer(const BoundLinear& qkv, const BoundLinear& o, const BoundLinear& gate_up, const BoundLinear& down,
                   py::handle input_norm_, py::handle post_norm_, py::handle q_norm_, py::handle k_norm_,
                   py::handle kpool_, py::handle vpool_, int64_t window, int64_t rope, bool gated) {
        const char* op = "LayerStack.add_layer";
        expect(op, "qkv", qkv, (h_ + 2 * kvh_) * d_, hidden_);
        expect(op, "o", o, hidden_, h_ * d_);
        expect(op, "gate_up", gate_up, 2 * inter_, hidden_);
        expect(op, "down", down, hidden_, inter_);
        if (gated && (!gate_up.lin.packed || pack_kind_ == 0))
            throw py::value_error("minisgl.LayerStack.add_layer: a gated gate_up needs its AMX or AVX512-BF16 pack");
        TensorArg input_norm(op, "input_norm", input_norm_), post_norm(op, "post_norm", post_norm_),
            q_norm(op, "q_norm", q_norm_), k_norm(op, "k_norm", k_norm_), kpool(op, "kpool", kpool_),
            vpool(op, "vpool", vpool_);
        for (TensorArg* norm : {&input_norm, &post_norm}) norm->required().dtype(dtype_).shape({hidden_}).contiguous();
        if (q_norm.present() != k_norm.present())
            q_norm.fail("given exactly when 'k_norm' is", q_norm.present() ? "a tensor" : "None");
        for (TensorArg* norm : {&q_norm, &k_norm}) norm->dtype(dtype_).shape({d_}).contiguous();
        for (TensorArg* pool : {&kpool, &vpool})
            pool->required().dtype(dtype_).shape({blocks_, bs_, kvh_, d_}).contiguous();
        stack_.add_layer(qkv.lin, o.lin, gate_up.lin, down.lin, input_norm.ptr(), post_norm.ptr(), q_norm.ptr(),
                         k_norm.ptr(), kpool.ptr(), vpool.ptr(), window, rope, gated);
        for (const BoundLinear* l : {&qkv, &o, &gate_up, &down})
            keep_.insert(keep_.end(), l->keep.begin(), l->keep.end());
        for (TensorArg* t : {&input_norm, &post_norm, &q_norm, &k_norm, &kpool, &vpool}) keep_.push_back(*t);
    }

    void run(py::handle x_, py::handle mlp_out_, py::handle positions_, py::handle slots_, py::handle tables_,
             py::handle row_table_, py::handle keep_, const std::vector<py::handle>& cos_,
             const std::vector<py::handle>& sin_, int threads) const {
        const char* op = "LayerStack.run";
        TensorArg x(op, "x", x_), mlp_out(op, "mlp_out", mlp_out_), positions(op, "positions", positions_),
            slots(op, "slots", slots_), tables(op, "tables", tables_), row_table(op, "row_table", row_table_),
            keep(op, "keep", keep_);
        x.required().dtype(dtype_).shape({ANY, hidden_}).contiguous();
        const int64_t n = x.size(0);
        mlp_out.required().dtype(dtype_).shape({n, hidden_}).contiguous();
        for (TensorArg* t : {&positions, &slots, &row_table}) t->required().dtype(DType::I64).shape({n}).contiguous();
        tables.required().dtype(DType::I64).shape({ANY, ANY}).contiguous();
        keep.dtype(DType::I64).shape({ANY}).contiguous();
        if (cos_.size() != sin_.size())
            throw py::value_error("minisgl.LayerStack.run: one 'sin' per 'cos', got " + std::to_string(cos_.size()) +
                                  " and " + std::to_string(sin_.size()));
        std::vector<TensorArg> cos, sin;
        std::vector<uintptr_t> cos_p, sin_p;
        std::vector<int64_t> rot;
        for (size_t i = 0; i < cos_.size(); ++i) {
            cos.emplace_back(op, "cos", cos_[i]);
            sin.emplace_back(op, "sin", sin_[i]);
            cos.back().required().dtype(dtype_).shape({n, ANY}).contiguous();
            const int64_t r = cos.back().size(1);
            if (r % 2 || r > d_) cos.back().fail("an even rotary width of at most the head dim", std::to_string(r));
            sin.back().required().dtype(dtype_).shape({n, r}).contiguous();
            cos_p.push_back(cos.back().ptr()), sin_p.push_back(sin.back().ptr()), rot.push_back(r);
        }
        py::gil_scoped_release nogil;
        stack_.run(x.ptr(), mlp_out.ptr(), n, positions.ptr(), slots.ptr(), tables.ptr(), tables.size(0),
                   tables.size(1), row_table.ptr(), keep.ptr(), keep.present() ? keep.size(0) : -1, cos_p, sin_p, rot,
                   threads);
    }

   private:
    void expect(const char* op, const char* name, const BoundLinear& l, int64_t n, int64_t k) const {
        if (l.lin.n != n || l.lin.k != k)
            throw py::value_error(std::string("minisgl.") + op + ": linear '" + name + "' must be shape [" +
                                  std::to_string(n) + ", " + std::to_string(k) + "], got shape [" +
                                  std::to_string(l.lin.n) + ", " + std::to_string(l.lin.k) + "]");
        if (!l.lin.weight && !l.lin.packed)
            throw py::value_error(std::string("minisgl.") + op + ": linear '" + name + "' has neither weight nor pack");
        for (TensorArg t : {l.keep[0], l.keep[2]}) t.dtype(dtype_);  // weight and bias in the stack's dtype
        if (dtype_ == DType::F32 && (l.lin.packed || l.lin.qweight))
            throw py::value_error(std::string("minisgl.") + op + ": linear '" + name +
                                  "' of a float32 stack reads its float32 weight (no pack, no int8)");
        if (l.lin.packed && pack_kind_ == 0)
            throw py::value_error(std::string("minisgl.") + op + ": linear '" + name +
                                  "' is packed but the stack's family packs nothing");
        if (l.lin.packed) {
            const int64_t elems = pack_kind_ == 1 ? packed_amx_elems(n, k) : packed_dpbf16_elems(n, k);
            const TensorArg& p = l.keep[1];
            if (p.numel() < elems) p.fail("at least " + std::to_string(elems) + " elements", std::to_string(p.numel()));
        }
    }

    LayerStack stack_;
    int64_t h_, kvh_, d_, hidden_, inter_, bs_, blocks_;
    int pack_kind_;
    DType dtype_;  // the model's: bf16 or float32
    std::vector<TensorArg> keep_;
};

}  // namespace

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "CPU decode kernels for minisgl over checked torch tensors (use minisgl_backend.model.cpu_kernels).";
    m.def("has_avx512", &cpu_has_avx512, "True if this CPU runs the AVX-512 kernels (isa=2).");
    m.def("has_avx2", &cpu_has_avx2, "True if this CPU runs the AVX2 + FMA kernels (isa=1).");
    m.def("has_amx", &cpu_has_amx, "True if this CPU runs linear_amx (and the process may use its tiles).");
    m.def("has_avx512_bf16", &cpu_has_avx512_bf16, "True if this CPU runs linear_dpbf16 (AVX512-BF16).");
    // linear_bf16 and linear_f32: the few-row FMA linear over weights of one dtype.
    const auto fma_linear = [&m](const char* op, DType dtype,
                                 void (*fn)(uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t, int64_t, int,
                                            int),
                                 const char* doc) {
        m.def(
            op,
            [op, dtype, fn](py::handle x_, py::handle w_, py::handle bias_, py::handle y_, int threads, int isa) {
                TensorArg x(op, "x", x_), w(op, "weight", w_), bias(op, "bias", bias_), y(op, "out", y_);
                w.required().dtype(dtype).shape({ANY, ANY}).contiguous();
                check_linear_rows(x, bias, y, w.size(0), dtype);
                x.shape({ANY, w.size(1)});
                py::gil_scoped_release nogil;
                fn(x.ptr(), w.ptr(), bias.ptr(), y.ptr(), x.size(0), w.size(0), w.size(1), threads, isa);
            },
            py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("threads"), py::arg("isa"), doc);
    };
    // linear_amx_silu and linear_dpbf16_silu: a packed family's gate/up GEMM with SiLU x up on the way
    // out, over its gated pack (elems: the family's pack size, checking the gated shape).
    const auto silu_linear = [&m](const char* op, int64_t (*elems)(int64_t, int64_t, bool),
                                  void (*fn)(uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t, int64_t, int),
                                  const char* doc) {
        m.def(
            op,
            [op, elems, fn](py::handle x_, py::handle packed_, int64_t n, py::handle y_, int threads) {
                TensorArg x(op, "x", x_), packed(op, "packed", packed_), none(op, "bias", py::none()), y(op, "out", y_);
                check_linear_rows(x, none, y, n / 2);
                check_pack(packed, elems(n, x.size(1), true));
                py::gil_scoped_release nogil;
                fn(x.ptr(), packed.ptr(), y.ptr(), x.size(0), n / 2, x.size(1), threads);
            },
            py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("out"), py::arg("threads"), doc);
    };
    fma_linear("linear_bf16", DType::BF16, &linear_bf16,
               "out[M,N] = x[M,K] @ weight[N,K]^T (+ bias[N], or None); bfloat16; isa 1 AVX2, 2 AVX-512, 3 AVX-512 + "
               "BF16.");
    fma_linear("linear_f32", DType::F32, &linear_f32,
               "out[M,N] = x[M,K] @ weight[N,K]^T (+ bias[N], or None); float32; isa as linear_bf16.");
    m.def("packed_amx_elems", &packed_amx_elems, py::arg("n"), py::arg("k"), "bf16 elements of pack_amx's output.");
    m.def(
        "pack_amx",
        [](py::handle w_, py::handle out_, bool gated, int threads) {
            const char* op = "pack_amx";
            TensorArg w(op, "weight", w_), out(op, "out", out_);
            w.required().dtype(DType::BF16).shape({ANY, ANY}).contiguous();
            check_pack(out, amx_elems(w.size(0), w.size(1), gated));
            py::gil_scoped_release nogil;
            pack_amx(w.ptr(), out.ptr(), w.size(0), w.size(1), gated, threads);
        },
        py::arg("weight"), py::arg("out"), py::arg("gated"), py::arg("threads"),
        "weight [N,K] bf16 into linear_amx's tile layout (out: packed_amx_elems(N, K) long; gated: a "
        "[gate | up] weight for linear_amx_silu).");
    m.def(
        "packed_rows_amx",
        [](py::handle packed_, int64_t n, int64_t k, bool gated, py::handle ids_, py::handle out_, int threads) {
            const char* op = "packed_rows_amx";
            TensorArg packed(op, "packed", packed_), ids(op, "ids", ids_), out(op, "out", out_);
            check_pack(packed, amx_elems(n, k, gated));
            check_ids(op, ids, out, n, k);
            py::gil_scoped_release nogil;
            packed_rows_amx(packed.ptr(), n, k, gated, ids.ptr(), ids.size(0), out.ptr(), threads);
        },
        py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("gated"), py::arg("ids"), py::arg("out"),
        py::arg("threads"), "out[count,K] = rows ids (int64 [count]) of the [N,K] weight pack_amx packed; bfloat16.");
    m.def(
        "linear_amx",
        [](py::handle x_, py::handle packed_, int64_t n, py::handle bias_, py::handle y_, int threads) {
            const char* op = "linear_amx";
            TensorArg x(op, "x", x_), packed(op, "packed", packed_), bias(op, "bias", bias_), y(op, "out", y_);
            const bool widen = check_packed_linear(x, bias, y, n);
            check_pack(packed, packed_amx_elems(n, x.size(1)));
            py::gil_scoped_release nogil;
            linear_amx(x.ptr(), packed.ptr(), bias.ptr(), y.ptr(), x.size(0), n, x.size(1), threads, widen);
        },
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"), py::arg("out"), py::arg("threads"),
        "out[M,N] = x[M,K] @ w[N,K]^T (+ bias[N], or None) for any M over pack_amx(w); bfloat16 (out float32: the "
        "bfloat16 outputs widened).");
    silu_linear("linear_amx_silu", &amx_elems, &linear_amx_silu,
                "out[M,N/2] = silu(x @ gate^T) * (x @ up^T) over pack_amx([gate | up] [N,K], gated=True).");
    m.def(
        "mlp_amx",
        [](py::handle x_, py::handle gate_up_, py::handle down_, py::handle bias_, py::handle y_, int64_t inter,
           int threads) {
            const char* op = "mlp_amx";
            TensorArg x(op, "x", x_), gate_up(op, "gate_up", gate_up_), down(op, "down", down_),
                bias(op, "bias", bias_), y(op, "out", y_);
            x.required().shape({ANY, ANY});
            check_linear_rows(x, bias, y, x.size(1));
            check_pack(gate_up, amx_elems(2 * inter, x.size(1), true));
            check_pack(down, packed_amx_elems(x.size(1), inter));
            py::gil_scoped_release nogil;
            mlp_amx(x.ptr(), gate_up.ptr(), down.ptr(), bias.ptr(), y.ptr(), x.size(0), inter, x.size(1), threads);
        },
        py::arg("x"), py::arg("gate_up"), py::arg("down"), py::arg("bias"), py::arg("out"), py::arg("inter"),
        py::arg("threads"),
        "out[M,H] = (silu(x @ gate^T) * (x @ up^T)) @ down^T (+ bias[H], or None) over pack_amx([gate | up] "
        "[2 inter,H], gated=True) and pack_amx(down [H,inter]): linear_amx_silu then linear_amx's bits.");
    m.def("packed_dpbf16_elems", &packed_dpbf16_elems, py::arg("n"), py::arg("k"),
          "bf16 elements of pack_dpbf16's output.");
    m.def(
        "pack_dpbf16",
        [](py::handle w_, py::handle out_, bool gated, int threads) {
            const char* op = "pack_dpbf16";
            TensorArg w(op, "weight", w_), out(op, "out", out_);
            w.required().dtype(DType::BF16).shape({ANY, ANY}).contiguous();
            check_pack(out, dpbf16_elems(w.size(0), w.size(1), gated));
            py::gil_scoped_release nogil;
            pack_dpbf16(w.ptr(), out.ptr(), w.size(0), w.size(1), gated, threads);
        },
        py::arg("weight"), py::arg("out"), py::arg("gated"), py::arg("threads"),
        "weight [N,K] bf16 into linear_dpbf16's panel layout (gated: a [gate | up] weight for "
        "linear_dpbf16_silu).");
    m.def(
        "packed_rows_dpbf16",
        [](py::handle packed_, int64_t n, int64_t k, bool gated, py::handle ids_, py::handle out_, int threads) {
            const char* op = "packed_rows_dpbf16";
            TensorArg packed(op, "packed", packed_), ids(op, "ids", ids_), out(op, "out", out_);
            check_pack(packed, dpbf16_elems(n, k, gated));
            check_ids(op, ids, out, n, k);
            py::gil_scoped_release nogil;
            packed_rows_dpbf16(packed.ptr(), n, k, gated, ids.ptr(), ids.size(0), out.ptr(), threads);
        },
        py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("gated"), py::arg("ids"), py::arg("out"),
        py::arg("threads"), "out[count,K] = rows ids (int64 [count]) of the [N,K] weight pack_dpbf16 packed.");
    m.def(
        "linear_dpbf16",
        [](py::handle x_, py::handle packed_, int64_t n, py::handle bias_, py::handle y_, int threads) {
            const char* op = "linear_dpbf16";
            TensorArg x(op, "x", x_), packed(op, "packed", packed_), bias(op, "bias", bias_), y(op, "out", y_);
            check_linear_rows(x, bias, y, n);
            check_pack(packed, dpbf16_elems(n, x.size(1), false));
            py::gil_scoped_release nogil;
            linear_dpbf16(x.ptr(), packed.ptr(), bias.ptr(), y.ptr(), x.size(0), n, x.size(1), threads);
        },
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"), py::arg("out"), py::arg("threads"),
        "out[M,N] = x[M,K] @ w[N,K]^T (+ bias[N], or None) for any M over pack_dpbf16(w); bfloat16.");
    silu_linear("linear_dpbf16_silu", &dpbf16_elems, &linear_dpbf16_silu,
                "out[M,N/2] = silu(x @ gate^T) * (x @ up^T) over pack_dpbf16([gate | up] [N,K], gated=True).");
    m.def(
        "linear_int8",
        [](py::handle x_, py::handle w_, py::handle scale_, py::handle bias_, py::handle y_, int threads) {
            const char* op = "linear_int8";
            TensorArg x(op, "x", x_), w(op, "weight", w_), scale(op, "scale", scale_), bias(op, "bias", bias_),
                y(op, "out", y_);
            w.required().dtype(DType::I8).shape({ANY, ANY}).contiguous();
            scale.required().dtype(DType::F32).shape({w.size(0)}).contiguous();
            check_linear_rows(x, bias, y, w.size(0));
            x.shape({ANY, w.size(1)});
            py::gil_scoped_release nogil;
            linear_int8(x.ptr(), w.ptr(), scale.ptr(), bias.ptr(), y.ptr(), x.size(0), w.size(0), w.size(1), threads);
        },
        py::arg("x"), py::arg("weight"), py::arg("scale"), py::arg("bias"), py::arg("out"), py::arg("threads"),
        "out[M,N] = (x[M,K] @ weight[N,K]^T) * scale[N] (+ bias[N]); x, bias, out bf16, weight int8, scale f32.");
    m.def(
        "paged_attention",
        [](py::handle q_, py::handle k_, py::handle v_, py::handle tables_, py::handle row_table_,
           py::handle positions_, py::handle out_, double scale, double softcap, int64_t window, int scorer,
           int threads, int isa) {
            const char* op = "paged_attention";
            TensorArg q(op, "q", q_), k(op, "k_pool", k_), v(op, "v_pool", v_), tables(op, "tables", tables_),
                row_table(op, "row_table", row_table_), positions(op, "positions", positions_), out(op, "out", out_);
            q.required().floating().shape({ANY, ANY, ANY}).inner_contiguous();
            const int64_t n = q.size(0), h = q.size(1), d = q.size(2);
            if (h > 1 && q.stride(1) != d)
                q.fail("its heads packed in a row (head stride " + std::to_string(d) + ")",
                       "head stride " + std::to_string(q.stride(1)));
            k.required().same_dtype(q).shape({ANY, ANY, ANY, d}).contiguous();
            v.required().same_dtype(q).same_shape(k).contiguous();
            tables.required().dtype(DType::I64).shape({ANY, ANY}).contiguous();
            row_table.required().dtype(DType::I64).shape({n}).contiguous();
            positions.required().dtype(DType::I64).shape({n}).contiguous();
            out.required().same_dtype(q).shape({n, h, d}).contiguous();
            const bool bf16 = q.is(DType::BF16);
            py::gil_scoped_release nogil;
            paged_attention(q.ptr(), n > 1 ? q.stride(0) : h * d, k.ptr(), v.ptr(), tables.ptr(), row_table.ptr(),
                            positions.ptr(), out.ptr(), n, h, k.size(2), d, k.size(1), k.size(0), tables.size(0),
                            tables.size(1), scale, softcap, window, bf16, scorer, threads, isa);
        },
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("tables"), py::arg("row_table"),
        py::arg("positions"), py::arg("out"), py::arg("scale"), py::arg("softcap"), py::arg("window"),
        py::arg("scorer"), py::arg("threads"), py::arg("isa"),
        "Each query row over its paged K/V: q [rows,h,d] (rows at any stride), out [rows,h,d], pools "
        "[num_blocks,block_size,kvh,d], tables int64 [num_tables,nb], row_table int64 [rows] (the row's table), "
        "positions int64 [rows] (keys 0..pos, or the last `window`; 0: all); softcap 0: none.");
    m.def(
        "rms_norm",
        [](py::handle x_, py::handle residual_, py::handle sum_out_, py::handle weight_, py::handle out_, double eps,
           bool gemma, int threads, int isa) {
            const char* op = "rms_norm";
            TensorArg x(op, "x", x_), residual(op, "residual", residual_), sum_out(op, "sum_out", sum_out_),
                weight(op, "weight", weight_), out(op, "out", out_);
            x.required().floating().rows_of(ANY).contiguous();
            const int64_t dim = x.size(-1);
            weight.required().same_dtype(x).shape({dim}).contiguous();
            out.required().same_dtype(x).same_shape(x).contiguous();
            if (residual.present() != sum_out.present())
                residual.fail("given exactly when 'sum_out' is", residual.present() ? "a tensor" : "None");
            residual.same_dtype(x).same_shape(x).contiguous();
            sum_out.same_dtype(x).same_shape(x).contiguous();
            const bool bf16 = x.is(DType::BF16);
            const int64_t rows = dim ? x.numel() / dim : 0;
            py::gil_scoped_release nogil;
            rms_norm(x.ptr(), residual.ptr(), sum_out.ptr(), weight.ptr(), out.ptr(), rows, dim, eps, gemma, bf16,
                     threads, isa);
        },
        py::arg("x"), py::arg("residual"), py::arg("sum_out"), py::arg("weight"), py::arg("out"), py::arg("eps"),
        py::arg("gemma"), py::arg("threads"), py::arg("isa"),
        "out = RMSNorm(x [+ residual]) over the last dim; with residual (or None), sum_out receives x + residual.");
    m.def(
        "rope",
        [](py::handle x_, py::handle cos_, py::handle sin_, int threads, int isa) {
            const char* op = "rope";
            TensorArg x(op, "x", x_), cos(op, "cos", cos_), sin(op, "sin", sin_);
            x.required().floating().shape({ANY, ANY, ANY}).inner_contiguous();
            cos.required().same_dtype(x).shape({x.size(0), 1, ANY}).contiguous();
            const int64_t rot = cos.size(2);
            if (rot % 2 || rot > x.size(2))
                cos.fail("an even rotary width of at most " + std::to_string(x.size(2)), std::to_string(rot));
            sin.required().same_dtype(x).same_shape(cos).contiguous();
            const bool bf16 = x.is(DType::BF16);
            py::gil_scoped_release nogil;
            rope(x.ptr(), cos.ptr(), sin.ptr(), x.size(0), x.size(1), rot, x.stride(0), x.stride(1), bf16, threads,
                 isa);
        },
        py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("threads"), py::arg("isa"),
        "Rotate the first `rot` features of every head of x [rows, heads, d] in place by cos/sin [rows, 1, rot].");
    m.def(
        "silu_and_mul",
        [](py::handle gate_up_, py::handle out_, int threads, int isa) {
            const char* op = "silu_and_mul";
            TensorArg gate_up(op, "gate_up", gate_up_), out(op, "out", out_);
            gate_up.required().floating().rows_of(ANY).contiguous();
            const int64_t two = gate_up.size(-1);
            if (two % 2) gate_up.fail("an even last dimension ([gate | up])", std::to_string(two));
            out.required().same_dtype(gate_up).rows_of(two / 2).contiguous();
            if (out.numel() * 2 != gate_up.numel() || out.dim() != gate_up.dim())
                out.fail("gate_up's shape with the last dimension halved", std::to_string(out.numel()) + " elements");
            const bool bf16 = gate_up.is(DType::BF16);
            const int64_t rows = two ? gate_up.numel() / two : 0;
            py::gil_scoped_release nogil;
            silu_and_mul(gate_up.ptr(), out.ptr(), rows, two / 2, bf16, threads, isa);
        },
        py::arg("gate_up"), py::arg("out"), py::arg("threads"), py::arg("isa"),
        "out [..., dim] = silu(gate) * up for gate_up [..., 2 * dim] = [gate | up].");
    m.def(
        "kv_write",
        [](py::handle k_, py::handle v_, py::handle kpool_, py::handle vpool_, py::handle slots_, int threads) {
            const char* op = "kv_write";
            TensorArg k(op, "k", k_), v(op, "v", v_), kpool(op, "k_pool", kpool_), vpool(op, "v_pool", vpool_),
                slots(op, "slots", slots_);
            k.required().floating().shape({ANY, ANY, ANY}).inner_contiguous();
            v.required().same_dtype(k).same_shape(k).inner_contiguous();
            for (TensorArg* t : {&k, &v})  // a row's heads back to back, v's rows as far apart as k's
                if ((t->size(1) > 1 && t->stride(1) != t->size(2)) || (t->size(0) > 1 && t->stride(0) != k.stride(0)))
                    t->fail(
                        "rows of kv_heads x head_dim elements without gaps, " + std::to_string(k.stride(0)) + " apart",
                        "strides (" + std::to_string(t->stride(0)) + ", " + std::to_string(t->stride(1)) + ", 1)");
            const int64_t row = k.size(1) * k.size(2);
            kpool.required().same_dtype(k).rows_of(k.size(2)).contiguous();
            if (row == 0 || kpool.numel() % row)
                kpool.fail("whole slots of " + std::to_string(row) + " elements", std::to_string(kpool.numel()));
            vpool.required().same_dtype(k).same_shape(kpool).contiguous();
            slots.required().dtype(DType::I64).shape({k.size(0)}).contiguous();
            const int64_t pool_slots = kpool.numel() / row;
            const auto* sp = reinterpret_cast<const int64_t*>(slots.ptr());
            for (int64_t i = 0; i < slots.size(0); ++i)
                if (sp[i] < 0 || sp[i] >= pool_slots)
                    throw py::index_error("minisgl.kv_write: slot " + std::to_string(sp[i]) +
                                          " out of range for a pool of " + std::to_string(pool_slots) + " slots");
            const int64_t elem = k.is(DType::BF16) ? 2 : 4;
            py::gil_scoped_release nogil;
            kv_write(k.ptr(), v.ptr(), k.stride(0) * elem, kpool.ptr(), vpool.ptr(), slots.ptr(), k.size(0), row * elem,
                     threads);
        },
        py::arg("k"), py::arg("v"), py::arg("k_pool"), py::arg("v_pool"), py::arg("slots"), py::arg("threads"),
        "Slot slots[i] of k_pool / v_pool (kv_heads x head_dim elements a slot) = k[i] / v[i] ([N, kv_heads, "
        "head_dim]).");
    m.def(
        "keyed_draw_screen",
        [](py::handle x_, double temperature, int64_t seed, int64_t position, int isa) {
            TensorArg x("keyed_draw_screen", "x", x_);
            x.required().dtype(DType::F32).shape({ANY}).contiguous();
            if (!(temperature > 0.0)) x.fail("a positive temperature", std::to_string(temperature));
            if (position < 0) x.fail("a position of at least 0", std::to_string(position));
            ScreenedDraw r;
            {
                py::gil_scoped_release nogil;
                r = keyed_draw_screen(x.ptr(), x.size(0), temperature, static_cast<uint64_t>(seed), position, isa);
            }
            return py::make_tuple(r.token, r.score, r.second, r.u, r.nan);  // with the GIL held again
        },
        py::arg("x"), py::arg("temperature"), py::arg("seed"), py::arg("position"), py::arg("isa"),
        "The keyed Gumbel-max draw's scores over one float32 logits row x [vocab] (seed: the uint64 key's "
        "bits as int64): (best token, its score, the best other score, its uniform noise, whether a logit was NaN).");
    m.def(
        "keyed_best_ids",
        [](py::handle x_, double temperature, int64_t width, py::handle out_, int isa) {
            const char* op = "keyed_best_ids";
            TensorArg x(op, "x", x_), out(op, "out", out_);
            x.required().dtype(DType::F32).shape({ANY}).contiguous();
            if (!(temperature > 0.0)) x.fail("a positive temperature", std::to_string(temperature));
            out.required().dtype(DType::I64).shape({width}).contiguous();
            py::gil_scoped_release nogil;
            return keyed_best_ids(x.ptr(), x.size(0), temperature, width, out.ptr(), isa);
        },
        py::arg("x"), py::arg("temperature"), py::arg("width"), py::arg("out"), py::arg("isa"),
        "out [width] = the ids of the width largest x / T of one float32 logits row x [vocab] (float64, by "
        "x / T descending then id ascending); returns width, or -1 where the caller must select itself.");
    m.def(
        "log_sum_exp",
        [](py::handle x_, double temperature, int isa) -> py::object {
            TensorArg x("log_sum_exp", "x", x_);
            x.required().dtype(DType::F32).shape({ANY}).contiguous();
            if (!(temperature > 0.0)) x.fail("a positive temperature", std::to_string(temperature));
            LogSumExp r;
            {
                py::gil_scoped_release nogil;
                r = log_sum_exp(x.ptr(), x.size(0), temperature, isa);
            }
            if (!r.ok) return py::none();
            return py::make_tuple(r.max, r.log_sum);
        },
        py::arg("x"), py::arg("temperature"), py::arg("isa"),
        "(max, log(sum(exp(x / T - max)))) of one float32 logits row x [vocab] in float64, the sum to ~1e-15; "
        "None for a NaN or no finite maximum.");
    m.def(
        "stream_read",
        [](py::handle buf_, int threads, int isa) {
            TensorArg buf("stream_read", "buf", buf_);
            buf.required().contiguous();
            py::gil_scoped_release nogil;
            return stream_read(buf.ptr(), buf.nbytes(), threads, isa);
        },
        py::arg("buf"), py::arg("threads"), py::arg("isa"),
        "Read buf's bytes once over `threads` (a memory bandwidth probe); returns their sum.");
    m.def(
        "tile_rate",
        [](py::handle operands_, bool load, int64_t rounds, int threads) {
            TensorArg operands("tile_rate", "operands", operands_);
            operands.required().dtype(DType::BF16).contiguous().min_numel(4 * 512);
            if (rounds < 8) throw py::value_error("tile_rate: rounds must be at least 8");
            const int64_t sets = load ? operands.numel() / 2048 : 0;
            py::gil_scoped_release nogil;
            return tile_rate(operands.ptr(), sets, rounds, threads);
        },
        py::arg("operands"), py::arg("load"), py::arg("rounds"), py::arg("threads"),
        "FLOP/s of the AMX tile unit running `rounds` rounds of four bf16 tile products per thread: on "
        "operands' first four tiles kept loaded, or (load) loading each round's four from operands' next "
        "4 KB set (2048 bf16: two A tiles, then two B tiles).");
    m.def("pool_set_test_delay", &pool_set_test_delay, py::arg("slot"), py::arg("micros"),
          "Test hook: pool thread `slot` sleeps `micros` after its first claim in every call (0 = off).");
    m.def("pool_claims", &pool_claims, py::call_guard<py::gil_scoped_release>(), py::arg("threads"), py::arg("n"),
          py::arg("grain"), "Test hook: n empty items over `threads`; the slot that claimed each item.");
    m.def("pool_use_openmp", &pool_use_openmp, py::arg("on"),
          "Run kernels on the OpenMP team torch uses (True) or on the kernels' own pool (False, the default).");
    m.def("pool_set_pinning", &pool_set_pinning, py::arg("mode"),
          "Pin each thread of a call to a CPU of its own: 0 while contended (auto), 1 always (on), 2 never (off).");
    m.def("pool_affinity", &pool_affinity,
          "The CPUs this thread may run on, or the process's where the pool pinned this thread.");
    m.def("pool_contended", &pool_contended,
          "Whether the kernels' threads have been kept waiting for a core lately (another busy process).");
    py::class_<BoundLinear>(m, "StackLinear")
        .def(py::init([](py::handle weight_, py::handle packed_, py::handle bias_, py::handle qweight_,
                         py::handle qscale_, int64_t n, int64_t k) {
                 const char* op = "StackLinear";
                 BoundLinear l{{}, {}};
                 l.keep = {TensorArg(op, "weight", weight_), TensorArg(op, "packed", packed_),
                           TensorArg(op, "bias", bias_), TensorArg(op, "qweight", qweight_),
                           TensorArg(op, "qscale", qscale_)};
                 TensorArg &w = l.keep[0], &p = l.keep[1], &b = l.keep[2], &qw = l.keep[3], &qs = l.keep[4];
                 // bf16, or a float32 model's weight and bias (the stack checks they are its dtype)
                 w.floating().shape({n, k}).contiguous();
                 p.dtype(DType::BF16).shape({ANY}).contiguous();
                 b.dtype(w.present() && w.is(DType::F32) ? DType::F32 : DType::BF16).shape({n}).contiguous();
                 qw.dtype(DType::I8).shape({n, k}).contiguous();
                 qs.dtype(DType::F32).shape({n}).contiguous();
                 if (qw.present() != qs.present())
                     qw.fail("given exactly when 'qscale' is", qw.present() ? "a tensor" : "None");
                 l.lin = {w.ptr(), p.ptr(), b.ptr(), qw.ptr(), qs.ptr(), n, k};
                 return l;
             }),
             py::arg("weight"), py::arg("packed"), py::arg("bias"), py::arg("qweight"), py::arg("qscale"), py::arg("n"),
             py::arg("k"));
    py::class_<BoundStack>(m, "LayerStack")
        .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, double, int64_t, int64_t, int, int,
                      int, int64_t, bool>(),
             py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("hidden"), py::arg("intermediate"),
             py::arg("eps"), py::arg("scale"), py::arg("softcap"), py::arg("block_size"), py::arg("num_blocks"),
             py::arg("scorer"), py::arg("pack_kind"), py::arg("isa"), py::arg("mlp_rows"), py::arg("f32") = false)
        .def("add_layer", &BoundStack::add_layer, py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
             py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("kpool"),
             py::arg("vpool"), py::arg("window"), py::arg("rope"), py::arg("gated"),
             "One layer: its four StackLinears, norms [hidden] (q/k norms [head_dim] or None) and K/V pools "
             "[num_blocks, block_size, kv_heads, head_dim]; the stack keeps every tensor alive.")
        .def("run", &BoundStack::run, py::arg("x"), py::arg("mlp_out"), py::arg("positions"), py::arg("slots"),
             py::arg("tables"), py::arg("row_table"), py::arg("keep"), py::arg("cos"), py::arg("sin"),
             py::arg("threads"),
             "Every layer over a batch's rows: x [rows, hidden] in (embeddings) and out (residual stream), "
             "mlp_out [rows, hidden] the last layer's MLP output, both at the rows `keep` (int64 [m], in rows "
             "0..m-1; None: every row); positions, slots, row_table int64 [rows], tables int64 [tables, nb] "
             "(row r reads tables[row_table[r]]); cos/sin [rows, rot] per RoPE; tensors in the stack's dtype.");
}

// The Python module minisgl_backend.native._kernels: pybind11 bindings of every family's entry points
// (kernels.h). Pointer-level: use minisgl_backend.model.cpu_kernels, which checks shapes and dtypes
// and falls back to torch where a kernel cannot run. Built without torch headers; every kernel runs
// on the library's own thread pool (pool.h) with the thread count the caller passes, and with the
// GIL released.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common.h"
#include "kernels.h"

namespace py = pybind11;
using namespace minisgl::cpu;

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "CPU decode kernels for minisgl (pointer-level; use minisgl_backend.model.cpu_kernels).";
    m.def("has_avx512", &cpu_has_avx512, "True if this CPU runs the AVX-512 kernels (isa=2).");
    m.def("has_avx2", &cpu_has_avx2, "True if this CPU runs the AVX2 + FMA kernels (isa=1).");
    m.def("linear_bf16", &linear_bf16, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("w"),
          py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads"), py::arg("isa"),
          "y[m,n] = x[m,k] @ w[n,k]^T (+ bias[n]) for m <= 4; contiguous bfloat16; bias 0 = none; isa 1 AVX2, "
          "2 AVX-512.");
    m.def("has_amx", &cpu_has_amx, "True if this CPU runs linear_amx (and the process may use its tiles).");
    m.def("packed_amx_elems", &packed_amx_elems, py::arg("n"), py::arg("k"), "bf16 elements of pack_amx's output.");
    m.def("pack_amx", &pack_amx, py::call_guard<py::gil_scoped_release>(), py::arg("w"), py::arg("out"), py::arg("n"),
          py::arg("k"), py::arg("threads"), "w [n,k] bf16 into linear_amx's tile layout (packed_amx_elems long).");
    m.def("packed_rows_amx", &packed_rows_amx, py::call_guard<py::gil_scoped_release>(), py::arg("packed"),
          py::arg("n"), py::arg("k"), py::arg("ids"), py::arg("count"), py::arg("out"), py::arg("threads"),
          "out[count,k] = rows ids (int64) of the [n,k] weight pack_amx packed; bfloat16.");
    m.def("linear_amx", &linear_amx, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"),
          py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads"),
          "y[m,n] = x[m,k] @ w[n,k]^T (+ bias[n]) for any m over pack_amx(w); contiguous bfloat16; bias 0 = none.");
    m.def("has_avx512_bf16", &cpu_has_avx512_bf16, "True if this CPU runs linear_dpbf16 (AVX512-BF16).");
    m.def("packed_dpbf16_elems", &packed_dpbf16_elems, py::arg("n"), py::arg("k"),
          "bf16 elements of pack_dpbf16's output (0: K odd, not packable).");
    m.def("pack_dpbf16", &pack_dpbf16, py::call_guard<py::gil_scoped_release>(), py::arg("w"), py::arg("out"),
          py::arg("n"), py::arg("k"), py::arg("gated"), py::arg("threads"),
          "w [n,k] bf16 into linear_dpbf16's panel layout (gated: a [gate | up] weight for linear_dpbf16_silu).");
    m.def("packed_rows_dpbf16", &packed_rows_dpbf16, py::call_guard<py::gil_scoped_release>(), py::arg("packed"),
          py::arg("n"), py::arg("k"), py::arg("gated"), py::arg("ids"), py::arg("count"), py::arg("out"),
          py::arg("threads"), "out[count,k] = rows ids (int64) of the [n,k] weight pack_dpbf16 packed; bfloat16.");
    m.def("linear_dpbf16_silu", &linear_dpbf16_silu, py::call_guard<py::gil_scoped_release>(), py::arg("x"),
          py::arg("packed"), py::arg("y"), py::arg("m"), py::arg("i"), py::arg("k"), py::arg("threads"),
          "y[m,i] = silu(x @ gate^T) * (x @ up^T) over pack_dpbf16([gate | up], gated=True); bfloat16.");
    m.def("linear_dpbf16", &linear_dpbf16, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"),
          py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads"),
          "y[m,n] = x[m,k] @ w[n,k]^T (+ bias[n]) for any m over pack_dpbf16(w); contiguous bfloat16.");
    m.def("stream_read", &stream_read, py::call_guard<py::gil_scoped_release>(), py::arg("buf"), py::arg("bytes"),
          py::arg("threads"), py::arg("isa"),
          "Read `bytes` of buf once over `threads` (a memory bandwidth probe); returns their sum.");
    m.def("pool_set_test_delay", &pool_set_test_delay, py::arg("slot"), py::arg("micros"),
          "Test hook: pool thread `slot` sleeps `micros` after its first claim in every call (0 = off).");
    m.def("pool_claims", &pool_claims, py::call_guard<py::gil_scoped_release>(), py::arg("threads"), py::arg("n"),
          py::arg("grain"), "Test hook: n empty items over `threads`; the slot that claimed each item.");
    m.def("pool_use_openmp", &pool_use_openmp, py::arg("on"),
          "Run kernels on the OpenMP team torch uses (True) or on the kernels' own pool (False, the default).");
    m.def("pool_contended", &pool_contended,
          "Whether the kernels' threads have been kept waiting for a core lately (another busy process).");
    m.def("linear_int8", &linear_int8, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("w"),
          py::arg("scale"), py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads"),
          "y[m,n] = (x[m,k] @ w[n,k]^T) * scale[n] (+ bias[n]); x, bias, y bfloat16, w int8, scale float32.");
    m.def("paged_attention", &paged_attention, py::call_guard<py::gil_scoped_release>(), py::arg("q"),
          py::arg("q_row_stride"), py::arg("k"), py::arg("v"), py::arg("tables"), py::arg("row_table"),
          py::arg("positions"), py::arg("out"), py::arg("rows"), py::arg("heads"), py::arg("kv_heads"),
          py::arg("head_dim"), py::arg("block_size"), py::arg("num_blocks"), py::arg("num_tables"),
          py::arg("table_stride"), py::arg("scale"), py::arg("softcap"), py::arg("window"), py::arg("bf16"),
          py::arg("scorer"), py::arg("threads"), py::arg("isa"),
          "Each query row over its paged K/V: q [rows,h,d] (rows q_row_stride apart), out [rows,h,d], pools "
          "[slots,kvh,d], tables int64 [num_tables,stride], row_table int64 [rows] (the row's table), positions "
          "int64 [rows] (the query's position; keys 0..pos, or the last `window`).");
    m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("residual"),
          py::arg("sum_out"), py::arg("weight"), py::arg("out"), py::arg("rows"), py::arg("dim"), py::arg("eps"),
          py::arg("gemma"), py::arg("bf16"), py::arg("threads"), py::arg("isa"),
          "out = RMSNorm(x [+ residual]) row by row; with residual, sum_out receives x + residual.");
    m.def("rope", &rope, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("cos"), py::arg("sin"),
          py::arg("rows"), py::arg("heads"), py::arg("rot"), py::arg("row_stride"), py::arg("head_stride"),
          py::arg("bf16"), py::arg("threads"), py::arg("isa"),
          "Rotate the first `rot` features of every head of x in place.");
    m.def("silu_and_mul", &silu_and_mul, py::call_guard<py::gil_scoped_release>(), py::arg("gate_up"), py::arg("out"),
          py::arg("rows"), py::arg("dim"), py::arg("bf16"), py::arg("threads"), py::arg("isa"),
          "out [rows, dim] = silu(gate) * up for gate_up [rows, 2 * dim] = [gate | up].");
    py::class_<StackLinear>(m, "StackLinear")
        .def(py::init<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t>(), py::arg("weight"),
             py::arg("packed"), py::arg("bias"), py::arg("qweight"), py::arg("qscale"), py::arg("n"), py::arg("k"));
    py::class_<DecodeStack>(m, "DecodeStack")
        .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, double, int64_t, int64_t, int, int,
                      int>(),
             py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("hidden"), py::arg("intermediate"),
             py::arg("eps"), py::arg("scale"), py::arg("softcap"), py::arg("block_size"), py::arg("num_blocks"),
             py::arg("scorer"), py::arg("pack_kind"), py::arg("isa"))
        .def("add_layer", &DecodeStack::add_layer, py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
             py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("kpool"),
             py::arg("vpool"), py::arg("window"), py::arg("rope"), py::arg("gated"))
        .def("run", &DecodeStack::run, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("mlp_out"),
             py::arg("rows"), py::arg("positions"), py::arg("slots"), py::arg("tables"), py::arg("table_stride"),
             py::arg("cos"), py::arg("sin"), py::arg("rot"), py::arg("threads"),
             "Every layer over decode rows: x [rows, hidden] in (embeddings) and out (residual stream), "
             "mlp_out [rows, hidden] the last layer's MLP output; positions, slots int64 [rows], tables int64 "
             "[rows, table_stride]; cos/sin [rows, rot] bf16 per RoPE.");
}

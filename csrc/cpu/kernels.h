// What crosses files in minisgl_backend.native._kernels: each family's entry points (bound in bindings.cpp,
// called by layer_stack.cpp) and the typed forms the layer stack calls without Python's wrappers.
//
// Pointer-level: tensors arrive as data pointers (uintptr_t) with shapes the Python side has checked
// (minisgl_backend/model/cpu_kernels.py); bf16 is uint16_t. Each kernel's bit-exactness contract is
// at the top of the file that defines it.
#pragma once

#include <cstdint>
#include <mutex>
#include <new>
#include <type_traits>
#include <vector>

#include "pool.h"

namespace minisgl::cpu {

// Scratch vectors that start on a cache line (malloc's own alignment is 16 bytes). The tile unit
// loads and stores a tile as 16 rows of 64 bytes, and a tile that does not start on a line touches
// two lines per row, which costs a tile load about as much again; a 64-byte vector load or store
// that straddles two lines likewise costs two. The attention's tiles lie at multiples of 64 bytes
// from their buffer's start, and so do the layer stack's rows wherever a row is a multiple of 64
// bytes (a hidden size a multiple of 32, as common models' are), so they start on lines once the
// buffer does.
template <typename T>
struct LineAllocator {
    using value_type = T;
    LineAllocator() = default;
    template <typename U>
    LineAllocator(const LineAllocator<U>&) {}
    T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
    void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
    template <typename U>
    bool operator==(const LineAllocator<U>&) const {
        return true;
    }
    template <typename U>
    bool operator!=(const LineAllocator<U>&) const {
        return false;
    }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

// ---- linear_fma.cpp: rows on float32 FMAs over bf16 or float32 weights, AVX-512 or AVX2 (isa: common.h Isa) ----
void linear_bf16(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t M, int64_t N, int64_t K, int threads,
                 int isa);
void linear_f32(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t M, int64_t N, int64_t K, int threads,
                int isa);

// ---- linear_amx.cpp: any row count on the AMX tile unit, over weights packed at load ----
int64_t packed_amx_elems(int64_t N, int64_t K);
void pack_amx(uintptr_t w, uintptr_t out, int64_t N, int64_t K, bool gated, int threads);
void packed_rows_amx(uintptr_t packed, int64_t N, int64_t K, bool gated, uintptr_t ids, int64_t count, uintptr_t out,
                     int threads);
// widen: y is float32, each output rounded to bf16 and widened back (the bf16 output's .float()).
void linear_amx(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t M, int64_t N, int64_t K,
                int threads, bool widen = false);
void linear_amx_silu(uintptr_t x, uintptr_t packed, uintptr_t y, int64_t M, int64_t I, int64_t K, int threads);
void mlp_amx(uintptr_t x, uintptr_t gate_up, uintptr_t down, uintptr_t bias, uintptr_t y, int64_t M, int64_t I,
             int64_t H, int threads);
// linear_amx and mlp_amx over rows already in pack_rows' layout (ap; K or H a multiple of 32): the
// layer stack's RMSNorm writes them so (rms_norm_t's packed_out). Any row count, the same bits.
void linear_amx_packed(const uint16_t* ap, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t M, int64_t N,
                       int64_t K, int threads);
void mlp_amx_packed(const uint16_t* ap, uintptr_t gate_up, uintptr_t down, uintptr_t bias, uintptr_t y, int64_t M,
                    int64_t I, int64_t H, int threads);

// ---- linear_dpbf16.cpp: any row count on vdpbf16ps (AVX512-BF16), over weights packed at load ----
int64_t packed_dpbf16_elems(int64_t N, int64_t K);
void pack_dpbf16(uintptr_t w, uintptr_t out, int64_t N, int64_t K, bool gated, int threads);
void packed_rows_dpbf16(uintptr_t packed, int64_t N, int64_t K, bool gated, uintptr_t ids, int64_t count, uintptr_t out,
                        int threads);
void linear_dpbf16(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t M, int64_t N, int64_t K,
                   int threads);
void linear_dpbf16_silu(uintptr_t x, uintptr_t packed, uintptr_t y, int64_t M, int64_t I, int64_t K, int threads);

// ---- linear_int8.cpp: 1-4 rows over int8 weights with per-channel scales ----
void linear_int8(uintptr_t x, uintptr_t w, uintptr_t scale, uintptr_t bias, uintptr_t y, int64_t M, int64_t N,
                 int64_t K, int threads);

// ---- attention.cpp (AVX-512, and the block splitting), attention_avx2.cpp (the avx2 family's blocks):
// every query row over its paged K/V, read in place ----
struct AttnShape {
    int64_t heads, kv_heads, head_dim, block_size, table_stride;
    float scale, softcap;  // softcap 0: none
    int64_t window;        // 0: full attention
};

bool tables_in_bounds(const int64_t* tables, const int64_t* row_table, const int64_t* positions, int64_t n,
                      int64_t num_tables, int64_t stride, int64_t block_size, int64_t num_blocks);
// The checked entry point (bf16 or float32) and, for the layer stack, the unchecked typed one
// (instantiated for bf16, uint16_t, and float32).
void paged_attention(uintptr_t q, int64_t q_stride, uintptr_t k, uintptr_t v, uintptr_t tables, uintptr_t row_table,
                     uintptr_t positions, uintptr_t out, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t block_size, int64_t num_blocks, int64_t num_tables, int64_t table_stride, double scale,
                     double softcap, int64_t window, bool bf16, int scorer, int threads, int isa);
template <typename T>
void paged_attention_t(uintptr_t q, int64_t q_stride, uintptr_t k, uintptr_t v, uintptr_t tables,
                       const int64_t* row_table, const int64_t* positions, uintptr_t out, int64_t n, const AttnShape& s,
                       int scorer, int threads, int isa);

// ---- rowwise.cpp: RMSNorm (+ residual add), RoPE, SiLU x up, AVX-512 or AVX2 (isa), the K/V write; the typed forms
// for the layer stack (instantiated for bf16, uint16_t, and float32) ----
void rms_norm(uintptr_t x, uintptr_t residual, uintptr_t sum_out, uintptr_t weight, uintptr_t out, int64_t rows,
              int64_t dim, double eps, bool gemma, bool bf16, int threads, int isa);
void rope(uintptr_t x, uintptr_t cos, uintptr_t sin, int64_t rows, int64_t heads, int64_t rot, int64_t sr, int64_t sh,
          bool bf16, int threads, int isa);
void silu_and_mul(uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t dim, bool bf16, int threads, int isa);
void kv_write(uintptr_t k, uintptr_t v, int64_t src_stride, uintptr_t kpool, uintptr_t vpool, uintptr_t slots,
              int64_t rows, int64_t row_bytes, int threads);
// packed_out: out in pack_rows' tile layout (linear_amx.cpp), for linear_amx_packed / mlp_amx_packed
// (bf16, dim a multiple of 32, not gemma).
template <typename T>
void rms_norm_t(T* x, const T* residual, T* sum_out, const T* weight, T* out, int64_t rows, int64_t dim, float eps,
                bool gemma, int threads, int isa, bool packed_out = false);
template <typename T>
void rope_t(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t rot, int64_t sr, int64_t sh,
            int threads, int isa);
template <typename T>
void silu_and_mul_t(const T* gate_up, T* out, int64_t rows, int64_t dim, int threads, int isa);

// ---- sampling.cpp: the keyed draw's scores over a vocabulary row, screened for its best two; the prefilter's ids ----
struct ScreenedDraw {
    int64_t token;  // the best score's token (-1: none, see keyed_draw_screen)
    double score;   // its score, and the best of every other token's (-inf: none)
    double second;
    double u;  // the token's uniform noise, bit for bit sampler.hash_uniform's
    bool nan;  // some logit was NaN: the caller draws in full
};
ScreenedDraw keyed_draw_screen(uintptr_t x, int64_t vocab, double temperature, uint64_t seed, int64_t position,
                               int isa);
// The `width` tokens of largest x / T (float64, as numpy divides) by x / T descending then id ascending,
// into out [width]; returns width, or -1 where the caller selects in numpy (see sampling.cpp).
int64_t keyed_best_ids(uintptr_t x, int64_t vocab, double temperature, int64_t width, uintptr_t out, int isa);
// The whole row's softmax normaliser in float64: max of x / T and log(sum exp(x / T - max)); ok false
// for a NaN or no finite maximum (the caller takes numpy's log-softmax).
struct LogSumExp {
    double max, log_sum;
    bool ok;
};
LogSumExp log_sum_exp(uintptr_t x, int64_t vocab, double temperature, int isa);

// ---- probes.cpp ----
double stream_read(uintptr_t buf, int64_t bytes, int threads, int isa);
double tile_rate(uintptr_t operands, int64_t sets, int64_t rounds, int threads);

// ---- layer_stack.cpp: every layer of a batch in one call ----
struct StackLinear {
    uintptr_t weight, packed, bias, qweight, qscale;  // 0: absent
    int64_t n, k;
};

struct StackLayer {
    StackLinear qkv, o, gate_up, down;
    uintptr_t input_norm, post_norm, q_norm, k_norm, kpool, vpool;  // q/k norm 0: none
    int64_t window, rope;  // window 0: full attention; rope: which of run()'s cos/sin pairs
    bool gated;            // gate_up packed for linear_dpbf16_silu (Linear.gated)
};

class LayerStack {
   public:
    LayerStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps,
               double scale, double softcap, int64_t block_size, int64_t num_blocks, int scorer, int pack_kind, int isa,
               int64_t mlp_rows, bool f32);
    void add_layer(StackLinear qkv, StackLinear o, StackLinear gate_up, StackLinear down, uintptr_t input_norm,
                   uintptr_t post_norm, uintptr_t q_norm, uintptr_t k_norm, uintptr_t kpool, uintptr_t vpool,
                   int64_t window, int64_t rope, bool gated);
    void run(uintptr_t x, uintptr_t mlp_out, int64_t n, uintptr_t positions, uintptr_t slots, uintptr_t tables,
             int64_t num_tables, int64_t table_stride, uintptr_t row_table, uintptr_t keep, int64_t kept,
             std::vector<uintptr_t> cos, std::vector<uintptr_t> sin, std::vector<int64_t> rot, int threads) const;

   private:
    // The activations of one run, in the model's dtype, kept from run to run (a prefill forward's
    // are tens of megabytes, which fresh buffers would fault in and zero every time); one run at a time.
    template <typename T>
    struct Scratch {
        LineVector<T> normed, qkv, attn, attn_out, gate_up, act, kept_x, kept_q;
        LineVector<int64_t> kept_table, kept_pos;
    };
    template <typename T>
    void run_t(uintptr_t x, uintptr_t mlp_out, int64_t n, uintptr_t positions, uintptr_t slots, uintptr_t tables,
               int64_t num_tables, int64_t table_stride, uintptr_t row_table, uintptr_t keep, int64_t kept,
               const std::vector<uintptr_t>& cos, const std::vector<uintptr_t>& sin, const std::vector<int64_t>& rot,
               int threads) const;
    template <typename T>
    Scratch<T>& scratch() const {
        if constexpr (std::is_same_v<T, float>)
            return scratch_f32_;
        else
            return scratch_bf16_;
    }
    mutable std::mutex mu_;
    mutable Scratch<uint16_t> scratch_bf16_;
    mutable Scratch<float> scratch_f32_;
    int64_t h_, kvh_, d_, hidden_, inter_;
    float eps_, scale_, softcap_;
    int64_t bs_, blocks_;
    int scorer_;
    int pack_kind_;
    int isa_;
    int64_t mlp_rows_;  // the most rows one MLP call takes (model/layers.py mlp_piece_rows)
    bool f32_;          // a float32 model (else bf16)
    std::vector<StackLayer> layers_;
};

}  // namespace minisgl::cpu

// Skinny float32 products for specnb's "skinny" kernels (see specnb/skinny.py).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a handful of rows m (a decode step: 1; a verify
// forward: k+1). With so few rows the product is bound by reading w from memory, so each block of
// NB weight rows is read once, multiplied with every row of x while it is in L1, and the next block
// is prefetched meanwhile. Several weights that share an input (q/k/v, gate/up) run in one call
// and one parallel region, writing side by side into one output, without a concatenated copy.
//
// Built at first use by torch.utils.cpp_extension with -march=native: AVX-512 where the CPU has it,
// else AVX2 with FMA; a CPU with neither gets no build (skinny.py says so).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;  // floats per vector
constexpr int MB = 5;  // rows of x per tile: NB * MB accumulators + NB weight vectors + 1 in 32 registers
constexpr int NB = 4;  // weight rows per block
using vec = __m512;
inline vec zero() { return _mm512_setzero_ps(); }
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline vec load_tail(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum(vec v) { return _mm512_reduce_add_ps(v); }
const char* kIsa = "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
constexpr int MB = 2;  // 16 registers: 8 accumulators + 4 weight vectors + 1
constexpr int NB = 4;
using vec = __m256;
inline vec zero() { return _mm256_setzero_ps(); }
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline vec load_tail(const float* p, int n) {
  alignas(32) static const int ones[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i*)(ones + 8 - n)));
}
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
const char* kIsa = "AVX2";
#else
#error "specnb skinny kernels need AVX-512 or AVX2 with FMA"
#endif

// R rows of x (R <= MB) against C weight rows (C <= NB) starting at w; prefetch the rows at w + pf.
template <int R, int C>
inline void tile(const float* __restrict x, int64_t K, const float* __restrict w, float* __restrict y,
                 int64_t ldy, const float* pf) {
  vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load(w + c * K + k);
    if (pf)
      for (int c = 0; c < C; ++c) _mm_prefetch((const char*)(pf + c * K + k), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      vec xv = load(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
    }
  }
  if (k < K) {
    int n = (int)(K - k);
    vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_tail(w + c * K + k, n);
    for (int r = 0; r < R; ++r) {
      vec xv = load_tail(x + r * K + k, n);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = sum(acc[r][c]);
}

template <int C>
inline void block(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t ldy, const float* pf) {
  int64_t m = 0;
  for (; m + MB <= M; m += MB) {
    tile<MB, C>(x + m * K, K, w, y + m * ldy, ldy, m == 0 ? pf : nullptr);
  }
  const float* p = m == 0 ? pf : nullptr;
  switch (M - m) {
#if defined(__AVX512F__)
    case 4: tile<4, C>(x + m * K, K, w, y + m * ldy, ldy, p); break;
    case 3: tile<3, C>(x + m * K, K, w, y + m * ldy, ldy, p); break;
    case 2: tile<2, C>(x + m * K, K, w, y + m * ldy, ldy, p); break;
#endif
    case 1: tile<1, C>(x + m * K, K, w, y + m * ldy, ldy, p); break;
    default: break;
  }
}

}  // namespace

// x: (M, K) float32; weights: list of (N_i, K) float32, contiguous; biases: empty or one per weight
// (each (N_i,) or undefined). Returns y: (M, sum N_i), weight i's products in its own columns.
torch::Tensor linear(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                     const std::vector<c10::optional<torch::Tensor>>& biases, int64_t prefetch_blocks) {
  TORCH_CHECK(!weights.empty(), "skinny linear: no weights");
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat, "skinny linear: float32 input only, got ", x_in.scalar_type());
  const int64_t K = weights[0].size(1);
  TORCH_CHECK(x_in.size(-1) == K, "skinny linear: input has ", x_in.size(-1), " features, weight ", K);
  auto x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<const float*> wp;
  std::vector<int64_t> rows, first_block, col;
  int64_t total_blocks = 0, N = 0;
  for (const auto& w : weights) {
    TORCH_CHECK(w.scalar_type() == torch::kFloat && w.dim() == 2 && w.size(1) == K && w.is_contiguous(),
                "skinny linear: weights must be contiguous float32 (N, ", K, ") tensors");
    wp.push_back(w.data_ptr<float>());
    rows.push_back(w.size(0));
    first_block.push_back(total_blocks);
    col.push_back(N);
    total_blocks += (w.size(0) + NB - 1) / NB;
    N += w.size(0);
  }
  first_block.push_back(total_blocks);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, (total_blocks + threads - 1) / threads);  // one run per thread
  at::parallel_for(0, total_blocks, grain, [&](int64_t b0, int64_t b1) {
    size_t i = 0;
    for (int64_t b = b0; b < b1; ++b) {
      while (b >= first_block[i + 1]) ++i;
      const int64_t n = (b - first_block[i]) * NB;
      const float* w = wp[i] + n * K;
      float* out = yp + col[i] + n;
      const int64_t ahead = n + NB * (prefetch_blocks + 1);
      const float* pf = (prefetch_blocks > 0 && ahead <= rows[i]) ? w + prefetch_blocks * NB * K : nullptr;
      if (n + NB <= rows[i]) {
        block<NB>(xp, M, K, w, out, N, pf);
      } else {
        for (int64_t j = n; j < rows[i]; ++j) block<1>(xp, M, K, wp[i] + j * K, yp + col[i] + j, N, nullptr);
      }
    }
  });
  for (size_t i = 0; i < weights.size() && i < biases.size(); ++i) {
    if (biases[i].has_value() && biases[i]->defined()) y.narrow(1, col[i], rows[i]).add_(*biases[i]);
  }
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

std::string isa() { return kIsa; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ [W_1; W_2; ...]^T (+ biases) for a few rows of x (float32)");
  m.def("isa", &isa, "the instruction set this build uses");
}

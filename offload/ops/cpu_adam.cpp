// One-pass Adam / AdamW update over flat, contiguous host buffers.
//
// The update is memory-bound: per element it reads param, grad, exp_avg and exp_avg_sq and writes param, exp_avg,
// exp_avg_sq (28 bytes at fp32 grads), plus optionally a bf16 / fp16 copy of the new parameter (2 more bytes).
// Everything is done in a single streaming pass so each byte crosses the memory bus once; the optional low-precision
// copy is written with full-cache-line non-temporal stores because nothing reads it back on this core (a regular
// store would first read the line: 2 more bytes per element). The same pass sums the squares of the gradient it
// used (after grad_scale), so the engine knows the gradient norm without reading the gradients again: per lane in
// fp32 over at most kSquaresSpan elements, then in double.
//
// The file is compiled once per instruction set (see _cpu_adam.py): -mavx512f selects the 16-wide path, -mavx2 the
// 8-wide one, neither the scalar one. All paths evaluate the same operations in the same order as torch's fused CPU
// AdamW (except that grad_scale is applied as a multiplication by its reciprocal, exact for powers of two), and
// -ffp-contract=off keeps the compiler from fusing multiplies and adds on its own, so the vector body and the scalar
// head/tail produce bit-identical results: the output does not depend on vector width, alignment or thread count.
//
// The Python side validates every argument and passes raw addresses; nothing here owns memory.

#include <pybind11/pybind11.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Element types of the gradient and of the optional low-precision output; values shared with _cpu_adam.py.
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kNone = -1 };

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "scalar";
#endif

// Elements per work unit handed to a thread. A multiple of every vector width and of a 64-byte line in every
// stream, so thread boundaries never split a vector or a cache line.
constexpr int64_t kBlock = 64;
// Below this many elements a call runs on the calling thread (waking the pool costs more than it saves).
constexpr int64_t kParallelGrain = int64_t{1} << 16;
// Vector iterations whose squares a lane sums in fp32 before they are added to the double total.
constexpr int64_t kSquaresSpan = 32;

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// fp32 -> bf16, round to nearest even. NaN becomes 0xFFFF, which is what torch's vectorized conversion writes.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if (f != f) return 0xFFFF;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// fp32 -> fp16, round to nearest even, subnormals kept; NaN keeps its sign and top payload bits and is made quiet
// (what F16C's vcvtps2ph, and therefore torch, produce).
inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to infinity
  if (a < 0x38800000u) {
    // Below the smallest normal half: adding 0.5 lines the half's subnormal step (2^-24) up with the float's last
    // mantissa bit, so the FPU's own round-to-nearest-even does the rounding.
    const float shifted = std::fabs(f) + 0.5f;
    return static_cast<uint16_t>(sign | (float_bits(shifted) - 0x3F000000u));
  }
  a += 0xC8000FFFu + ((a >> 13) & 1u);  // rebias the exponent (-112 << 23) and add the rounding bias
  return static_cast<uint16_t>(sign | (a >> 13));
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // mantissa * 2^-24, exact
    return bits_float(sign | float_bits(magnitude));
  }
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Width-1 "vector": the reference semantics, used on its own by the scalar build and for heads and tails.
struct Scalar {
  using F = float;
  static constexpr int64_t kWidth = 1;
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  using Half = uint16_t;
  static F load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static F load_fp16(const uint16_t* p) { return fp16_to_float(*p); }
  static void store(float* p, F x) { *p = x; }
  static Half to_bf16(F x) { return float_to_bf16(x); }
  static Half to_fp16(F x) { return float_to_fp16(x); }
  static void stream_pair(uint16_t* p, Half lo, Half hi) {
    p[0] = lo;
    p[1] = hi;
  }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F sqrt(F a) { return std::sqrt(a); }
  static void fence() {}
};

#if defined(__AVX512F__)
struct Vec {
  using F = __m512;
  static constexpr int64_t kWidth = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load_bf16(const uint16_t* p) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
  static F load_fp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  using Half = __m256i;
  static Half to_bf16(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi16(r);
  }
  static Half to_fp16(F x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // One full cache line; p must be 64-byte aligned (the kernel peels a scalar head until it is).
  static void stream_pair(uint16_t* p, Half lo, Half hi) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static void fence() { _mm_sfence(); }
};
#elif defined(__AVX2__)
struct Vec {
  using F = __m256;
  static constexpr int64_t kWidth = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
  static F load_fp16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  using Half = __m128i;
  static Half to_bf16(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan);
    // packus works per 128-bit lane: [a0..3 a0..3 | a4..7 a4..7] -> take quadwords 0 and 2.
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
  }
  static Half to_fp16(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p must be 32-byte aligned (the kernel peels a scalar head until it is).
  static void stream_pair(uint16_t* p, Half lo, Half hi) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm256_set_m128i(hi, lo));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static void fence() { _mm_sfence(); }
};
#else
using Vec = Scalar;
#endif

// The sum of a vector's lanes, in double (a running total of squares).
template <class V>
double lane_sum(typename V::F a) {
  float lanes[V::kWidth];
  V::store(lanes, a);
  double total = 0.0;
  for (const float x : lanes) total += x;
  return total;
}

// Per-call constants, already folded and rounded to fp32 exactly as torch's fused kernel does.
struct Coefficients {
  float inv_grad_scale;  // grad *= inv_grad_scale (1 when unscaled: exact)
  float l2;              // Adam (L2): grad += l2 * param, only when use_l2 (0 * inf would poison the gradient)
  bool use_l2;
  float decay;           // AdamW (decoupled): param *= decay; 1 otherwise
  float lerp_weight;     // 1 - beta1: exp_avg.lerp_(grad, lerp_weight)
  bool lerp_small;       // |lerp_weight| < 0.5 selects torch's lerp formula
  float beta2;
  float sq_weight;       // 1 - beta2
  float bc2_sqrt;        // sqrt(1 - beta2^step)
  float eps;
  float step_size;       // lr / (1 - beta1^step)
};

struct Buffers {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  uint16_t* out;
};

template <class V, int GradType>
inline typename V::F load_grad(const void* grad, int64_t i) {
  if constexpr (GradType == kFloat32) {
    return V::load(static_cast<const float*>(grad) + i);
  } else if constexpr (GradType == kBFloat16) {
    return V::load_bf16(static_cast<const uint16_t*>(grad) + i);
  } else {
    return V::load_fp16(static_cast<const uint16_t*>(grad) + i);
  }
}

// The per-call coefficients broadcast into vectors of V.
template <class V>
struct Broadcast {
  using F = typename V::F;
  explicit Broadcast(const Coefficients& c)
      : inv_grad_scale(V::set1(c.inv_grad_scale)),
        l2(V::set1(c.l2)),
        decay(V::set1(c.decay)),
        lerp_coeff(V::set1(c.lerp_small ? c.lerp_weight : c.lerp_weight - 1.0f)),
        beta2(V::set1(c.beta2)),
        sq_weight(V::set1(c.sq_weight)),
        bc2_sqrt(V::set1(c.bc2_sqrt)),
        eps(V::set1(c.eps)),
        step_size(V::set1(c.step_size)) {}
  F inv_grad_scale, l2, decay, lerp_coeff, beta2, sq_weight, bc2_sqrt, eps, step_size;
};

// Updates the V::kWidth elements at i in place, adds the squares of their gradients to ``squares`` and returns
// the new parameters.
template <class V, int GradType>
inline typename V::F adam_vector(const Buffers& b, const Coefficients& c, const Broadcast<V>& k, int64_t i,
                                 typename V::F& squares) {
  using F = typename V::F;
  F param = V::load(b.param + i);
  F grad = V::mul(load_grad<V, GradType>(b.grad, i), k.inv_grad_scale);
  squares = V::add(squares, V::mul(grad, grad));
  if (c.use_l2) grad = V::add(grad, V::mul(param, k.l2));
  param = V::mul(param, k.decay);
  // torch's lerp: start + w * (end - start) for small w, end - (1 - w) * (end - start) otherwise.
  F exp_avg = V::load(b.exp_avg + i);
  exp_avg = V::fma(k.lerp_coeff, V::sub(grad, exp_avg), c.lerp_small ? exp_avg : grad);
  const F exp_avg_sq = V::add(V::mul(V::load(b.exp_avg_sq + i), k.beta2), V::mul(V::mul(k.sq_weight, grad), grad));
  const F denom = V::add(V::div(V::sqrt(exp_avg_sq), k.bc2_sqrt), k.eps);
  param = V::sub(param, V::div(V::mul(k.step_size, exp_avg), denom));
  V::store(b.exp_avg + i, exp_avg);
  V::store(b.exp_avg_sq + i, exp_avg_sq);
  V::store(b.param + i, param);
  return param;
}

// Updates elements [begin, end) two vectors at a time, so that the low-precision copy of both goes out as one
// full-width non-temporal store (a whole cache line with AVX-512). end - begin must be a multiple of 2 * kWidth.
// Returns the sum of the squares of their gradients.
template <class V, int GradType, int OutType>
inline double update(const Buffers& b, const Coefficients& c, int64_t begin, int64_t end) {
  const Broadcast<V> k(c);
  double total = 0.0;
  for (int64_t span = begin; span < end; span += kSquaresSpan * 2 * V::kWidth) {
    auto squares = V::set1(0.0f);
    const int64_t span_end = std::min(end, span + kSquaresSpan * 2 * V::kWidth);
    for (int64_t i = span; i < span_end; i += 2 * V::kWidth) {
      const auto lo = adam_vector<V, GradType>(b, c, k, i, squares);
      const auto hi = adam_vector<V, GradType>(b, c, k, i + V::kWidth, squares);
      if constexpr (OutType == kBFloat16) {
        V::stream_pair(b.out + i, V::to_bf16(lo), V::to_bf16(hi));
      } else if constexpr (OutType == kFloat16) {
        V::stream_pair(b.out + i, V::to_fp16(lo), V::to_fp16(hi));
      }
    }
    total += lane_sum<V>(squares);
  }
  return total;
}

template <int GradType, int OutType>
double update_range(const Buffers& b, const Coefficients& c, int64_t begin, int64_t end) {
  constexpr int64_t kStep = 2 * Vec::kWidth;
  int64_t head = begin;
  if constexpr (OutType != kNone) {
    // Non-temporal stores need the output aligned to their width; do a few elements scalar first.
    constexpr uintptr_t kAlignBytes = kStep * sizeof(uint16_t);
    const auto address = reinterpret_cast<uintptr_t>(b.out + begin);
    const auto misaligned = static_cast<int64_t>((kAlignBytes - address % kAlignBytes) % kAlignBytes / 2);
    head = std::min(end, begin + misaligned);
  }
  const int64_t body_end = head + (end - head) / kStep * kStep;
  const Broadcast<Scalar> k(c);
  double total = 0.0;
  const auto one = [&](int64_t i) {
    float squares = 0.0f;
    const float param = adam_vector<Scalar, GradType>(b, c, k, i, squares);
    total += squares;
    if constexpr (OutType == kBFloat16) {
      b.out[i] = float_to_bf16(param);
    } else if constexpr (OutType == kFloat16) {
      b.out[i] = float_to_fp16(param);
    }
  };
  for (int64_t i = begin; i < head; ++i) one(i);
  total += update<Vec, GradType, OutType>(b, c, head, body_end);
  for (int64_t i = body_end; i < end; ++i) one(i);
  if constexpr (OutType != kNone) Vec::fence();
  return total;
}

template <int GradType, int OutType>
double run(const Buffers& b, const Coefficients& c, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  return at::parallel_reduce(
      0, blocks, kParallelGrain / kBlock, 0.0,
      [&](int64_t first, int64_t last, double partial) {
        return partial + update_range<GradType, OutType>(b, c, first * kBlock, std::min(n, last * kBlock));
      },
      [](double x, double y) { return x + y; });
}

template <int GradType>
double dispatch_out(const Buffers& b, const Coefficients& c, int64_t n, int out_type) {
  switch (out_type) {
    case kNone: return run<GradType, kNone>(b, c, n);
    case kBFloat16: return run<GradType, kBFloat16>(b, c, n);
    case kFloat16: return run<GradType, kFloat16>(b, c, n);
    default: throw std::invalid_argument("cpu_adam: unknown output type code");
  }
}

// Returns the sum of the squares of grad / grad_scale.
double adam_step(uintptr_t param, uintptr_t grad, int grad_type, uintptr_t exp_avg, uintptr_t exp_avg_sq,
                 uintptr_t out, int out_type, int64_t n, double lr, double beta1, double beta2, double eps,
                 double weight_decay, bool adamw_mode, double bias_correction1, double bias_correction2,
                 double grad_scale) {
  if (n <= 0) return 0.0;
  Coefficients c;
  c.inv_grad_scale = static_cast<float>(1.0 / grad_scale);
  c.l2 = adamw_mode ? 0.0f : static_cast<float>(weight_decay);
  c.use_l2 = c.l2 != 0.0f;
  c.decay = adamw_mode ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.lerp_weight = static_cast<float>(1.0 - beta1);
  c.lerp_small = std::fabs(c.lerp_weight) < 0.5f;
  c.beta2 = static_cast<float>(beta2);
  c.sq_weight = static_cast<float>(1.0 - beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(eps);
  c.step_size = static_cast<float>(lr / bias_correction1);
  const Buffers b{reinterpret_cast<float*>(param), reinterpret_cast<const void*>(grad),
                  reinterpret_cast<float*>(exp_avg), reinterpret_cast<float*>(exp_avg_sq),
                  reinterpret_cast<uint16_t*>(out)};
  switch (grad_type) {
    case kFloat32: return dispatch_out<kFloat32>(b, c, n, out_type);
    case kBFloat16: return dispatch_out<kBFloat16>(b, c, n, out_type);
    case kFloat16: return dispatch_out<kFloat16>(b, c, n, out_type);
    default: throw std::invalid_argument("cpu_adam: unknown gradient type code");
  }
}

// The sum of the squares of data[begin, end) * scale, summed as the update sums them (fp32 lanes, double totals).
template <int GradType>
double squares_range(const void* data, float scale, int64_t begin, int64_t end) {
  const auto k = Vec::set1(scale);
  const int64_t body_end = begin + (end - begin) / Vec::kWidth * Vec::kWidth;
  double total = 0.0;
  int64_t i = begin;
  while (i < body_end) {
    auto squares = Vec::set1(0.0f);
    const int64_t span_end = std::min(body_end, i + kSquaresSpan * 2 * Vec::kWidth);
    for (; i < span_end; i += Vec::kWidth) {
      const auto x = Vec::mul(load_grad<Vec, GradType>(data, i), k);
      squares = Vec::add(squares, Vec::mul(x, x));
    }
    total += lane_sum<Vec>(squares);
  }
  for (; i < end; ++i) {
    const float x = load_grad<Scalar, GradType>(data, i) * scale;
    total += x * x;
  }
  return total;
}

// A gradient norm's squares without an update (clipping and fp16 need the norm first): one read of the data, in
// its own dtype (no widened copy), on every thread.
double sum_squares(uintptr_t data, int type, int64_t n, double scale) {
  if (n <= 0) return 0.0;
  const auto* p = reinterpret_cast<const void*>(data);
  const auto f = static_cast<float>(scale);
  const auto reduce = [&](auto range) {
    return at::parallel_reduce(
        0, (n + kBlock - 1) / kBlock, kParallelGrain / kBlock, 0.0,
        [&](int64_t first, int64_t last, double partial) {
          return partial + range(p, f, first * kBlock, std::min(n, last * kBlock));
        },
        [](double x, double y) { return x + y; });
  };
  switch (type) {
    case kFloat32: return reduce(squares_range<kFloat32>);
    case kBFloat16: return reduce(squares_range<kBFloat16>);
    case kFloat16: return reduce(squares_range<kFloat16>);
    default: throw std::invalid_argument("cpu_adam: unknown data type code");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused single-pass CPU Adam/AdamW kernel (see offload/ops/_cpu_adam.py for the Python contract).";
  m.attr("isa") = kIsa;
  m.def("adam_step", &adam_step, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Update n elements in place; returns the sum of the squares of grad / grad_scale. Addresses are raw "
        "pointers validated by the caller.");
  m.def("sum_squares", &sum_squares, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "The sum of the squares of n elements times scale (fp32, bf16 or fp16 at a validated raw pointer).");
}

// W8A8 int8 on CPUs without int8 dot-product instructions (no AVX512-VNNI, no AMX): there
// ``torch._int_mm`` takes a reference path 10-35x slower than float32. Two ops (the first also
// runs before ``_int_mm`` on the CPUs that have them):
//
//   quantize_rows(x)  float32 or bfloat16 [T, in] -> (q int8 [T, in], scale float32 [T, 1]):
//                     scale = max|x_t| / 127 (at least 1e-30), q = round_half_even(x / scale)
//                     clamped to [-128, 127]: ``quantization.w8a8_int8.quantize_rows``' math,
//                     bit for bit, in one pass over each row instead of six torch ops.
//   w8a8_linear(q, scale, w, w_scale)
//                     q int8 [T, in], w int8 [out, in] -> float32 [T, out]:
//                     y[t, o] = float(sum_i q[t, i] * w[o, i]) * scale[t] * w_scale[o]
//                     with the sum exact in int32, then rounded and scaled in float32 in the
//                     order the torch path does (``_int_mm(...).float().mul_(s).mul_(ws)``).
//
// The AVX2 path sign-extends 16 int8 values to int16 (``vpmovsxbw``) and multiplies pairs into
// int32 (``vpmaddwd``): every product and pair sum fits, so the sums are exact for any int8
// inputs up to 2^17 wide (|sum| <= in * 2^14 < 2^31). ``vpmaddubsw`` does twice the
// multiply-adds per instruction but saturates its int16 pair sums (u8 x s8) and needs a second
// one to widen them: no faster. Tiles of 4 rows by 2 outputs (1 by 4 for a decode row) share
// each load. Elsewhere a plain loop, the reference.
//
// On CPUs with AVX512-VNNI, ``torch._int_mm`` (oneDNN) is fast for one row and for many, but
// between 2 and ~32 rows, the rows a decode step of a busy server has, it takes 2-4x the time
// of the bfloat16 product it replaces (a 2048 -> 8192 weight: 2.3 ms at 4 rows against 0.57 at
// one). Two more ops serve those rows from a weight packed once at load:
//
//   pack_vnni(w)      w int8 [out, in] -> (packed int8 [out / 16, in / 4, 16, 4] with both
//                     sizes padded by zeros, comp int32 [out] = 128 * sum_i w[o, i]).
//   w8a8_linear_vnni(q, scale, packed, comp, w_scale, out, dtype)
//                     w8a8_linear's y, rounded to ``dtype`` (float32 or bfloat16) as
//                     ``scale_int32`` rounds it: the same values bit for bit.
//
// ``vpdpbusd`` multiplies unsigned by signed bytes, four products summed into each int32 lane:
// the activations go in as q + 128 (a flipped sign bit) and ``comp`` takes the 128s back out.
// Neither the four-product sums nor the totals can overflow (|sum| <= in * 255 * 128 < 2^31 for
// in below 2^16). One 64-byte load holds 16 outputs by 4 inputs; a tile of up to 6 rows by 64
// outputs keeps 24 accumulators in registers.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr float kMinScale = 1e-30f;  // as w8a8_int8._MIN_SCALE: keeps 0 / 0 out
constexpr int64_t kRowBlock = 64;    // rows per parallel task: their activations stay in L2
constexpr int64_t kOutBlock = 64;    // outputs per parallel task
constexpr int64_t kMaxIn = 1 << 17;  // in * 128 * 128 must stay below 2^31
constexpr int64_t kLanes = 16;    // outputs per vector of pack_vnni's layout

struct Problem {
  const int8_t* q;        // [rows, in]
  const int16_t* q16;     // [rows, in]: q widened once per call (the AVX2 path reads it)
  const float* scale;     // [rows]
  const int8_t* w;        // [out, in]
  const float* w_scale;   // [out]
  float* y;               // [rows, out]
  int64_t rows, in, out;
};

inline void store(const Problem& p, int64_t t, int64_t o, int32_t sum) {
  // The torch path's rounding order: the int32 sum to float, times the row's scale, times the
  // output's.
  p.y[t * p.out + o] = static_cast<float>(sum) * p.scale[t] * p.w_scale[o];
}

int32_t dot_plain(const int8_t* a, const int8_t* b, int64_t from, int64_t to) {
  int32_t sum = 0;
  for (int64_t i = from; i < to; ++i) sum += static_cast<int32_t>(a[i]) * b[i];
  return sum;
}

void block_plain(const Problem& p, int64_t t0, int64_t t1, int64_t o0, int64_t o1) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t o = o0; o < o1; ++o)
      store(p, t, o, dot_plain(p.q + t * p.in, p.w + o * p.in, 0, p.in));
}

#if defined(__x86_64__) && defined(__GNUC__)
#define PAGODA_W8_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline __m256i widen(const int8_t* at) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// R rows from t by O outputs from o: R * O int32 accumulators over the inputs in steps of 16,
// each weight vector widened once for the R rows, the activations read already widened; the
// inputs past the last multiple of 16 are summed by the plain loop.
template <int R, int O>
void tile_avx2(const Problem& p, int64_t t, int64_t o) {
  static_assert(R * O + O + 2 <= 16, "the tile's accumulators and operands fit the registers");
  __m256i acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < O; ++c) acc[r][c] = _mm256_setzero_si256();
  const int64_t whole = p.in / 16 * 16;
  for (int64_t i = 0; i < whole; i += 16) {
    __m256i wv[O];
    for (int c = 0; c < O; ++c) wv[c] = widen(p.w + (o + c) * p.in + i);
    for (int r = 0; r < R; ++r) {
      const __m256i a =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.q16 + (t + r) * p.in + i));
      for (int c = 0; c < O; ++c)
        acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(a, wv[c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < O; ++c)
      store(p, t + r, o + c,
            hsum(acc[r][c]) +
                dot_plain(p.q + (t + r) * p.in, p.w + (o + c) * p.in, whole, p.in));
}

// Rows t0..t1 by outputs o0..o1: tiles of 4 rows by 2 outputs (12 of the 16 vector registers),
// a single row by 4 outputs for decode, and the edges by smaller tiles.
template <int R>
void rows_avx2(const Problem& p, int64_t t, int64_t o0, int64_t o1) {
  constexpr int O = R == 1 ? 4 : 2;
  int64_t o = o0;
  for (; o + O <= o1; o += O) tile_avx2<R, O>(p, t, o);
  for (; o < o1; ++o) tile_avx2<R, 1>(p, t, o);
}

void block_avx2(const Problem& p, int64_t t0, int64_t t1, int64_t o0, int64_t o1) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) rows_avx2<4>(p, t, o0, o1);
  switch (t1 - t) {
    case 3: rows_avx2<3>(p, t, o0, o1); break;
    case 2: rows_avx2<2>(p, t, o0, o1); break;
    case 1: rows_avx2<1>(p, t, o0, o1); break;
    default: break;
  }
}

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }

inline __m256 load8(const at::BFloat16* x) {
  // bfloat16 is float32's upper half.
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// quantize_row's math eight values at a time: the same IEEE division and round-half-to-even.
template <typename T>
void quantize_row_avx2(const T* x, int64_t n, int8_t* q, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top8 = _mm256_setzero_ps();
  const int64_t whole = n / 8 * 8;
  for (int64_t i = 0; i < whole; i += 8)
    top8 = _mm256_max_ps(top8, _mm256_andnot_ps(sign, load8(x + i)));
  float top = hmax(top8);
  for (int64_t i = whole; i < n; ++i) top = std::max(top, std::fabs(static_cast<float>(x[i])));
  const float s = std::max(top / 127.f, kMinScale);
  const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
  for (int64_t i = 0; i < whole; i += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(load8(x + i), vs),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i iv = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    const __m128i w16 =
        _mm_packs_epi32(_mm256_castsi256_si128(iv), _mm256_extracti128_si256(iv, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w16, w16));
  }
  for (int64_t i = whole; i < n; ++i) {
    const float v = std::nearbyint(static_cast<float>(x[i]) / s);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, v)));
  }
  *scale = s;
}

#pragma GCC pop_options
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define PAGODA_W8_VNNI 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

constexpr int64_t kDepth = 4;   // inputs per lane per vpdpbusd

struct VnniProblem {
  const uint8_t* a;       // [rows, in4]: q + 128, padded with 128 (q = 0) to in4
  const float* scale;     // [rows]
  const int8_t* w;        // [out16 / 16, in4 / 4, 16, 4]
  const int32_t* comp;    // [out]
  const float* w_scale;   // [out]
  void* y;                // [rows, out], float32 or bfloat16
  bool bf16;
  int64_t rows, in4, out;
};

// One row's 16 sums from output o0 to y, in scale_int32's rounding order: the int32 sum (less
// the 128s' share) to float, times the row's scale, times the outputs', rounded once to y's
// dtype (bfloat16: to nearest even, NaN to 0x7FC0, as c10::BFloat16 rounds). Masked past out.
inline void store_vnni(const VnniProblem& p, int64_t t, int64_t o0, __m512i sums) {
  const __mmask16 m = p.out - o0 >= kLanes ? 0xFFFF : (1u << (p.out - o0)) - 1;
  sums = _mm512_sub_epi32(sums, _mm512_maskz_loadu_epi32(m, p.comp + o0));
  __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(p.scale[t]));
  value = _mm512_mul_ps(value, _mm512_maskz_loadu_ps(m, p.w_scale + o0));
  const int64_t at = t * p.out + o0;
  if (!p.bf16) {
    _mm512_mask_storeu_ps(static_cast<float*>(p.y) + at, m, value);
    return;
  }
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(static_cast<at::BFloat16*>(p.y) + at, m,
                           _mm512_cvtepi32_epi16(rounded));
}

// The inputs in blocks of this many steps (128 inputs): a task's weights for one block (8 KB
// for 4 vectors) stay in L1 while each of its row tiles reads them, instead of coming from L2
// once per tile; the sums wait between blocks in the task's ``part``.
constexpr int64_t kStepBlock = 32;

// R rows from t by C vectors of 16 outputs from vector v, over the steps k0..k1 (four inputs a
// step): R * C int32 accumulators, each weight vector loaded once for the R rows. They start
// from ``part`` ([R][C], the earlier blocks' sums) unless k0 is 0 and end there; after the last
// block they go to y. The pointers are hoisted, every inner loop unrolled and the sums stored
// before the epilogue reads them: otherwise GCC 12 copied each accumulator through a spare
// register (and the stack) at every step, twice the products' instructions.
template <int R, int C>
void tile_vnni(const VnniProblem& p, int64_t t, int64_t v, int64_t k0, int64_t k1,
               __m512i* part) {
  static_assert(R * C + C + 1 <= 32, "the tile's accumulators and operands fit the registers");
  const int64_t steps = p.in4 / kDepth, stride = steps * kLanes * kDepth;
  const int8_t* __restrict w = p.w + v * stride;
  const uint8_t* __restrict a[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a[r] = p.a + (t + r) * p.in4;
  __m512i acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      acc[r][c] = k0 == 0 ? _mm512_setzero_si512() : _mm512_load_si512(&part[r * C + c]);
  for (int64_t k = k0; k < k1; ++k) {
    __m512i wk[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wk[c] = _mm512_loadu_si512(w + c * stride + k * kLanes * kDepth);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, a[r] + k * kDepth, sizeof four);
      const __m512i ak = _mm512_set1_epi32(four);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], ak, wk[c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_store_si512(&part[r * C + c], acc[r][c]);
  if (k1 < steps) return;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store_vnni(p, t + r, (v + c) * kLanes, part[r * C + c]);
}

// Rows t0..t1 by C vectors from v over the steps k0..k1: tiles of 6 rows (24 accumulators),
// the last rows by a smaller one.
template <int C>
void rows_vnni(const VnniProblem& p, int64_t t0, int64_t t1, int64_t v, int64_t k0,
               int64_t k1, __m512i* part) {
  int64_t t = t0;
  for (; t + 6 <= t1; t += 6) tile_vnni<6, C>(p, t, v, k0, k1, part + (t - t0) * C);
  __m512i* rest = part + (t - t0) * C;
  switch (t1 - t) {
    case 5: tile_vnni<5, C>(p, t, v, k0, k1, rest); break;
    case 4: tile_vnni<4, C>(p, t, v, k0, k1, rest); break;
    case 3: tile_vnni<3, C>(p, t, v, k0, k1, rest); break;
    case 2: tile_vnni<2, C>(p, t, v, k0, k1, rest); break;
    case 1: tile_vnni<1, C>(p, t, v, k0, k1, rest); break;
    default: break;
  }
}

// Rows t0..t1 (at most kRowBlock) by the output vectors v0..v1 (at most 4), block by block of
// the inputs.
void block_vnni(const VnniProblem& p, int64_t t0, int64_t t1, int64_t v0, int64_t v1) {
  alignas(64) __m512i part[kRowBlock * 4];
  const int64_t steps = p.in4 / kDepth;
  for (int64_t k0 = 0; k0 < steps; k0 += kStepBlock) {
    const int64_t k1 = std::min(steps, k0 + kStepBlock);
    switch (v1 - v0) {
      case 4: rows_vnni<4>(p, t0, t1, v0, k0, k1, part); break;
      case 3: rows_vnni<3>(p, t0, t1, v0, k0, k1, part); break;
      case 2: rows_vnni<2>(p, t0, t1, v0, k0, k1, part); break;
      case 1: rows_vnni<1>(p, t0, t1, v0, k0, k1, part); break;
      default: break;
    }
  }
}

#pragma GCC pop_options
#endif

bool have_vnni() {
#ifdef PAGODA_W8_VNNI
  static const bool yes = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni");
  return yes;
#else
  return false;
#endif
}

bool have_avx2() {
#ifdef PAGODA_W8_AVX2
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

void check(const torch::Tensor& t, at::ScalarType type, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == dim &&
                  t.is_contiguous(),
              name, " must be a contiguous CPU tensor of ", dim, " dims and type ", type);
}

template <typename T>
void quantize_row(const T* x, int64_t n, int8_t* q, float* scale) {
  float top = 0.f;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, std::fabs(static_cast<float>(x[i])));
  const float s = std::max(top / 127.f, kMinScale);
  for (int64_t i = 0; i < n; ++i) {
    // nearbyint rounds half to even in the default rounding mode, as torch.round does.
    const float v = std::nearbyint(static_cast<float>(x[i]) / s);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, v)));
  }
  *scale = s;
}

template <typename T>
void quantize_any(const T* x, int64_t n, int8_t* q, float* scale, bool avx2) {
#ifdef PAGODA_W8_AVX2
  if (avx2) return quantize_row_avx2(x, n, q, scale);
#endif
  quantize_row(x, n, q, scale);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> quantize_rows(const torch::Tensor& x, bool allow_avx2) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous 2-D float32 or bfloat16 CPU tensor");
  const int64_t rows = x.size(0), n = x.size(1);
  auto q = torch::empty({rows, n}, x.options().dtype(at::kChar));
  auto scale = torch::empty({rows, 1}, x.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  const bool avx2 = allow_avx2 && have_avx2();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (x.scalar_type() == at::kFloat)
        quantize_any(x.data_ptr<float>() + t * n, n, qp + t * n, sp + t, avx2);
      else
        quantize_any(x.data_ptr<at::BFloat16>() + t * n, n, qp + t * n, sp + t, avx2);
    }
  });
  return {q, scale};
}

torch::Tensor w8a8_linear(const torch::Tensor& q, const torch::Tensor& scale,
                          const torch::Tensor& w, const torch::Tensor& w_scale,
                          bool allow_avx2) {
  check(q, at::kChar, 2, "q");
  check(scale, at::kFloat, 2, "scale");
  check(w, at::kChar, 2, "w");
  check(w_scale, at::kFloat, 1, "w_scale");
  const int64_t rows = q.size(0), in = q.size(1), out = w.size(0);
  TORCH_CHECK(w.size(1) == in, "w must be [out, in] with q's in");
  TORCH_CHECK(in <= kMaxIn, "in must be at most ", kMaxIn, " for exact int32 sums");
  TORCH_CHECK(scale.size(0) == rows && scale.size(1) == 1, "scale must be [rows, 1]");
  TORCH_CHECK(w_scale.size(0) == out, "w_scale must be [out]");
  auto y = torch::empty({rows, out}, q.options().dtype(at::kFloat));
  if (rows == 0 || out == 0) return y;
  const bool avx2 = allow_avx2 && have_avx2();
  // The AVX2 tiles read each activation vector once per pair of outputs: widened once here.
  const torch::Tensor q16 = avx2 ? q.to(at::kShort) : q;
  const Problem p{q.data_ptr<int8_t>(),
                  avx2 ? q16.data_ptr<int16_t>() : nullptr,
                  scale.data_ptr<float>(), w.data_ptr<int8_t>(),
                  w_scale.data_ptr<float>(), y.data_ptr<float>(), rows, in, out};
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t out_blocks = (out + kOutBlock - 1) / kOutBlock;
  // Tasks are (row block, output block) pairs, the row blocks outermost: a thread's tasks
  // share their activations.
  at::parallel_for(0, row_blocks * out_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t0 = task / out_blocks * kRowBlock, o0 = task % out_blocks * kOutBlock;
      const int64_t t1 = std::min(rows, t0 + kRowBlock), o1 = std::min(out, o0 + kOutBlock);
#ifdef PAGODA_W8_AVX2
      if (avx2) {
        block_avx2(p, t0, t1, o0, o1);
        continue;
      }
#endif
      block_plain(p, t0, t1, o0, o1);
    }
  });
  return y;
}

// ``torch._int_mm``'s int32 sums scaled back in one pass: float(acc) * scale[t] * w_scale[o],
// in that order, rounded once to ``dtype`` (float32 or bfloat16): the same values as
// ``acc.float().mul_(scale).mul_(w_scale).to(dtype)``, which makes four passes over [T, out].
template <typename Out>
void scale_rows(const int32_t* acc, const float* scale, const float* w_scale, Out* y,
                int64_t rows, int64_t out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float s = scale[t];
      const int32_t* a = acc + t * out;
      Out* yt = y + t * out;
      for (int64_t o = 0; o < out; ++o) {
        float v = static_cast<float>(a[o]) * s;
        v = v * w_scale[o];
        yt[o] = static_cast<Out>(v);
      }
    }
  });
}

torch::Tensor scale_int32(const torch::Tensor& acc, const torch::Tensor& scale,
                          const torch::Tensor& w_scale, at::ScalarType dtype) {
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kInt && acc.dim() == 2 &&
                  acc.is_contiguous(),
              "acc must be a contiguous int32 [T, out] CPU tensor");
  const int64_t rows = acc.size(0), out = acc.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == rows,
              "scale must be float32 [T, 1]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
                  w_scale.numel() == out,
              "w_scale must be float32 [out]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  auto y = torch::empty({rows, out}, acc.options().dtype(dtype));
  const int32_t* a = acc.data_ptr<int32_t>();
  if (dtype == at::kFloat)
    scale_rows(a, scale.data_ptr<float>(), w_scale.data_ptr<float>(), y.data_ptr<float>(), rows,
               out);
  else
    scale_rows(a, scale.data_ptr<float>(), w_scale.data_ptr<float>(),
               y.data_ptr<at::BFloat16>(), rows, out);
  return y;
}

// Output vectors per task: 4 (a tile's widest) unless 3 or 2 leave the busiest thread fewer
// vectors to do. 576 outputs are 36 vectors: 9 tasks of 4 give one of two threads 20, 12
// tasks of 3 give each 18.
int64_t vectors_per_task(int64_t vectors, int64_t row_blocks, int64_t threads) {
  int64_t best = 4, least = INT64_MAX;
  for (const int64_t n : {4, 3, 2}) {
    const int64_t tasks = row_blocks * ((vectors + n - 1) / n);
    const int64_t busiest = (tasks + threads - 1) / threads * n;
    if (busiest < least) {
      least = busiest;
      best = n;
    }
  }
  return best;
}

std::tuple<torch::Tensor, torch::Tensor> pack_vnni(const torch::Tensor& w) {
  check(w, at::kChar, 2, "w");
  const int64_t out = w.size(0), in = w.size(1);
  TORCH_CHECK(in < (1 << 16), "in must be below 2^16 for exact int32 sums");
  const int64_t out16 = (out + kLanes - 1) / kLanes * kLanes, in4 = (in + 3) / 4 * 4;
  auto packed = torch::zeros({out16 / kLanes, in4 / 4, kLanes, 4}, w.options());
  auto comp = torch::empty({out}, w.options().dtype(at::kInt));
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* cp = comp.data_ptr<int32_t>();
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      int32_t sum = 0;
      int8_t* base = dst + (o / kLanes) * in4 * kLanes + (o % kLanes) * 4;
      for (int64_t i = 0; i < in; ++i) {
        base[(i / 4) * kLanes * 4 + i % 4] = src[o * in + i];
        sum += src[o * in + i];
      }
      cp[o] = 128 * sum;
    }
  });
  return {packed, comp};
}

torch::Tensor w8a8_linear_vnni(const torch::Tensor& q, const torch::Tensor& scale,
                               const torch::Tensor& packed, const torch::Tensor& comp,
                               const torch::Tensor& w_scale, int64_t out, at::ScalarType dtype) {
  TORCH_CHECK(have_vnni(), "this CPU has no AVX512-VNNI");
  check(q, at::kChar, 2, "q");
  check(scale, at::kFloat, 2, "scale");
  check(packed, at::kChar, 4, "packed");
  check(comp, at::kInt, 1, "comp");
  check(w_scale, at::kFloat, 1, "w_scale");
  const int64_t rows = q.size(0), in = q.size(1), in4 = packed.size(1) * 4;
  TORCH_CHECK(packed.size(2) == kLanes && packed.size(3) == 4 &&
                  packed.size(0) == (out + kLanes - 1) / kLanes && in4 == (in + 3) / 4 * 4,
              "packed must be pack_vnni's [out / 16, in / 4, 16, 4] for q's in and out");
  TORCH_CHECK(comp.size(0) == out && w_scale.size(0) == out, "comp and w_scale must be [out]");
  TORCH_CHECK(scale.size(0) == rows && scale.size(1) == 1, "scale must be [rows, 1]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  auto y = torch::empty({rows, out}, q.options().dtype(dtype));
  if (rows == 0 || out == 0) return y;
  // The activations as unsigned bytes (q + 128: the sign bit flipped), each row padded with
  // q = 0 to in4; written once.
  auto a = torch::empty({rows, in4}, q.options().dtype(at::kByte));
  uint8_t* ap = a.data_ptr<uint8_t>();
  const int8_t* qp = q.data_ptr<int8_t>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < in; ++i)
        ap[t * in4 + i] = static_cast<uint8_t>(qp[t * in + i]) ^ 0x80;
      for (int64_t i = in; i < in4; ++i) ap[t * in4 + i] = 0x80;
    }
  });
#ifdef PAGODA_W8_VNNI
  const VnniProblem p{ap, scale.data_ptr<float>(), packed.data_ptr<int8_t>(),
                      comp.data_ptr<int32_t>(), w_scale.data_ptr<float>(), y.data_ptr(),
                      dtype == at::kBFloat16, rows, in4, out};
  const int64_t vectors = packed.size(0);
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t per_task = vectors_per_task(vectors, row_blocks, at::get_num_threads());
  const int64_t out_blocks = (vectors + per_task - 1) / per_task;
  at::parallel_for(0, row_blocks * out_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t0 = task / out_blocks * kRowBlock, v0 = task % out_blocks * per_task;
      block_vnni(p, t0, std::min(rows, t0 + kRowBlock), v0, std::min(vectors, v0 + per_task));
    }
  });
#endif
  return y;
}

// Lets go of the GIL while it runs, as torch's own ops do (see cpu_ops.cpp).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("quantize_rows", &quantize_rows, release(),
        "x [T, in] float32/bfloat16 -> (q int8 [T, in], scale float32 [T, 1]), per-row "
        "symmetric int8",
        py::arg("x"), py::arg("allow_avx2") = true);
  m.def("w8a8_linear", &w8a8_linear, release(),
        "q int8 [T, in] (row scales [T, 1]) times w int8 [out, in] (scales [out]) -> [T, out] "
        "float32, the sums exact in int32",
        py::arg("q"), py::arg("scale"), py::arg("w"), py::arg("w_scale"),
        py::arg("allow_avx2") = true);
  m.def("has_vnni", &have_vnni, "whether this CPU runs w8a8_linear_vnni (AVX512-VNNI)");
  m.def("pack_vnni", &pack_vnni, release(),
        "w int8 [out, in] -> (packed int8 [out / 16, in / 4, 16, 4], comp int32 [out]) for "
        "w8a8_linear_vnni",
        py::arg("w"));
  m.def("w8a8_linear_vnni", &w8a8_linear_vnni, release(),
        "q int8 [T, in] (row scales [T, 1]) times pack_vnni's weight (scales [out]) -> [T, out] "
        "float32 or bfloat16, the same values as scale_int32(_int_mm(q, w.t()), ...)",
        py::arg("q"), py::arg("scale"), py::arg("packed"), py::arg("comp"), py::arg("w_scale"),
        py::arg("out"), py::arg("dtype"));
  m.def("scale_int32", &scale_int32, release(),
        "int32 sums [T, out] times row scales [T, 1] and output scales [out] -> [T, out] "
        "float32 or bfloat16, one pass",
        py::arg("acc"), py::arg("scale"), py::arg("w_scale"), py::arg("dtype"));
}

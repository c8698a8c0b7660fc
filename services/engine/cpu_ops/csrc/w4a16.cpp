// W4A16: a linear layer whose weight is 4-bit (GPTQ, AWQ), its product computed from the packed
// nibbles, dequantized in registers: the weight is read at half a byte per value, a quarter of
// bfloat16's bytes, which is what a decode step (one or a few rows) is bound by.
//
// Layout (``quantization.int4.pack_for_kernel``): ``q`` uint8 [out, in / 2], each output's
// inputs in chunks of 16, byte j of a chunk holding input j (low nibble) and input j + 8 (high
// nibble), so one 8-byte load widens to two vectors of eight consecutive inputs. ``scale`` and
// ``zs`` (zero point times scale) float32 [out, groups], one group per ``group`` consecutive
// inputs (act-order's scattered groups are made consecutive at load by permuting the inputs).
//
//     y[t, o] = sum_g scale[o, g] * dot(x[t, g], q[o, g]) - sum_g zs[o, g] * sum(x[t, g])
//
// which is sum_i x[t, i] * (q[o, i] - zero[o, g(i)]) * scale[o, g(i)] with the zero point
// taken out of the inner loop. Float32 throughout; the result is rounded once, by the caller.
//
// The AVX2+FMA path runs where the CPU has it (checked when called); elsewhere a plain loop.
//
// bfloat16 activations on a CPU with AVX-512-BF16 (``w4a16_linear_bf16``): ``vdpbf16ps`` takes
// 32 products an instruction, 64 inputs a step where the groups allow (else 32). The nibbles
// widen to 16-bit lanes and ``vpermw`` looks each up in a table of the bfloat16 values 0..15
// (exact); a bfloat16 input times such a value is exact in float32 and the sums are float32, as
// above. The activations are rearranged once per row into the order the widened nibbles come
// in (a step's low nibbles, then its high ones).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kChunk = 16;     // inputs per 8-byte run of the packed weight
constexpr int64_t kOutBlock = 8;   // outputs per parallel task (``out`` is a multiple)

struct Problem {
  const float* x;       // [rows, in]
  const uint8_t* q;     // [out, in / 2]
  const float* scale;   // [out, groups]
  const float* zs;      // [out, groups]
  const float* xsum;    // [rows, groups]
  float* y;             // [rows, out]
  int64_t rows, in, out, groups, group;
};

// The zero points' share of y[t, o]: sum_g zs[o, g] * xsum[t, g] (either path's problem).
template <typename P>
inline float zero_term(const P& p, int64_t t, int64_t o) {
  const float* z = p.zs + o * p.groups;
  const float* xs = p.xsum + t * p.groups;
  float acc = 0.f;
  for (int64_t g = 0; g < p.groups; ++g) acc += z[g] * xs[g];
  return acc;
}

void rows_plain(const Problem& p, int64_t o0, int64_t o1, int64_t t0, int64_t t1) {
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* qo = p.q + o * (p.in / 2);
    for (int64_t t = t0; t < t1; ++t) {
      const float* xt = p.x + t * p.in;
      float total = 0.f;
      for (int64_t g = 0; g < p.groups; ++g) {
        float dot = 0.f;
        for (int64_t i = g * p.group; i < (g + 1) * p.group; i += kChunk) {
          for (int64_t j = 0; j < 8; ++j) {
            const uint8_t b = qo[i / 2 + j];
            dot += xt[i + j] * static_cast<float>(b & 0xF) +
                   xt[i + j + 8] * static_cast<float>(b >> 4);
          }
        }
        total += p.scale[o * p.groups + g] * dot;
      }
      p.y[t * p.out + o] = total - zero_term(p, t, o);
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define PAGODA_W4_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// kTile outputs from o0, one row t: kTile independent accumulators, so the FMAs of one chunk
// do not wait on each other. Rows run one at a time, each widening the nibbles again: the kernel
// is for decode-sized batches (``w4a16_cpu.DENSE_ROWS``); tiles of several rows sharing one
// widening, as a GEMM's, are not written yet.
constexpr int kTile = 8;

void tile_avx2(const Problem& p, int64_t o0, int64_t t) {
  const __m256i low = _mm256_set1_epi32(0xF);
  const int64_t half = p.in / 2;
  const float* xt = p.x + t * p.in;
  __m256 total[kTile];
  for (int o = 0; o < kTile; ++o) total[o] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256 acc[kTile];
    for (int o = 0; o < kTile; ++o) acc[o] = _mm256_setzero_ps();
    for (int64_t i = g * p.group; i < (g + 1) * p.group; i += kChunk) {
      const __m256 xl = _mm256_loadu_ps(xt + i), xh = _mm256_loadu_ps(xt + i + 8);
      for (int o = 0; o < kTile; ++o) {
        const __m128i bytes =
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.q + (o0 + o) * half + i / 2));
        const __m256i v = _mm256_cvtepu8_epi32(bytes);
        acc[o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), xl, acc[o]);
        acc[o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), xh, acc[o]);
      }
    }
    for (int o = 0; o < kTile; ++o) {
      const __m256 s = _mm256_set1_ps(p.scale[(o0 + o) * p.groups + g]);
      total[o] = _mm256_fmadd_ps(acc[o], s, total[o]);
    }
  }
  for (int o = 0; o < kTile; ++o)
    p.y[t * p.out + o0 + o] = hsum(total[o]) - zero_term(p, t, o0 + o);
}

void block_avx2(const Problem& p, int64_t o0, int64_t o1) {
  for (int64_t t = 0; t < p.rows; ++t)
    for (int64_t o = o0; o < o1; o += kTile) tile_avx2(p, o, t);
}

#pragma GCC pop_options
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define PAGODA_W4_BF16 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

// Inputs per step: 64 (32 packed bytes, four chunks, two vdpbf16ps) where the groups hold whole
// steps of 64, else 32 (16 bytes, two chunks, one vdpbf16ps).
constexpr int64_t kWideStep = 64;
constexpr int64_t kNarrowStep = 32;

// Row t's inputs in the widened nibbles' order, per step: the low nibbles' inputs (chunk c,
// byte j: input 16c + j), then the high ones' (16c + 8 + j).
void arrange_row(const uint16_t* x, int64_t in, int64_t step, uint16_t* out) {
  const int64_t half = step / 2;
  for (int64_t s = 0; s < in; s += step)
    for (int64_t c = 0; c < step / kChunk; ++c)
      for (int64_t j = 0; j < 8; ++j) {
        out[s + 8 * c + j] = x[s + 16 * c + j];
        out[s + half + 8 * c + j] = x[s + 16 * c + 8 + j];
      }
}

struct ProblemBf16 {
  const uint16_t* xr;  // [rows, in]: arranged bfloat16 bits
  const uint8_t* q;
  const float* scale;
  const float* zs;
  const float* xsum;   // [rows, groups], float32 sums of the bfloat16 inputs
  float* y;
  int64_t rows, in, out, groups, group;
};

inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

// The bfloat16 bits of 0..15 in lanes 0..15 (vpermw reads an index's low 5 bits).
inline __m512i nibble_table() {
  alignas(64) uint16_t table[32] = {};
  for (int n = 0; n < 16; ++n) {
    const float v = static_cast<float>(n);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    table[n] = static_cast<uint16_t>(bits >> 16);  // exact: a small integer's low bits are 0
  }
  return _mm512_load_si512(table);
}

// One step of kTile outputs: its products added into acc (kWideStep or kNarrowStep inputs).
template <int64_t Step>
inline void step_bf16(const ProblemBf16& p, const uint16_t* xt, int64_t o0, int64_t i,
                      const __m512i& table, __m512* acc) {
  const int64_t half = p.in / 2;
  if constexpr (Step == kWideStep) {
    const __m512bh xl = (__m512bh)_mm512_loadu_si512(xt + i);
    const __m512bh xh = (__m512bh)_mm512_loadu_si512(xt + i + 32);
    const __m512i low = _mm512_set1_epi16(0xF);
    for (int o = 0; o < kTile; ++o) {
      const __m256i bytes =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.q + (o0 + o) * half + i / 2));
      const __m512i v = _mm512_cvtepu8_epi16(bytes);
      const __m512i wl = _mm512_permutexvar_epi16(_mm512_and_si512(v, low), table);
      const __m512i wh = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
      acc[o] = _mm512_dpbf16_ps(acc[o], (__m512bh)wl, xl);
      acc[o] = _mm512_dpbf16_ps(acc[o], (__m512bh)wh, xh);
    }
  } else {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xt + i);
    const __m256i low = _mm256_set1_epi16(0xF);
    for (int o = 0; o < kTile; ++o) {
      const __m128i bytes =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + (o0 + o) * half + i / 2));
      const __m256i v = _mm256_cvtepu8_epi16(bytes);
      const __m512i n = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_and_si256(v, low)), _mm256_srli_epi16(v, 4), 1);
      acc[o] = _mm512_dpbf16_ps(acc[o], (__m512bh)_mm512_permutexvar_epi16(n, table), xv);
    }
  }
}

template <int64_t Step>
void tile_bf16(const ProblemBf16& p, int64_t o0, int64_t t) {
  const __m512i table = nibble_table();
  const uint16_t* xt = p.xr + t * p.in;
  __m512 total[kTile];
  for (int o = 0; o < kTile; ++o) total[o] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 acc[kTile];
    for (int o = 0; o < kTile; ++o) acc[o] = _mm512_setzero_ps();
    for (int64_t i = g * p.group; i < (g + 1) * p.group; i += Step)
      step_bf16<Step>(p, xt, o0, i, table, acc);
    for (int o = 0; o < kTile; ++o) {
      const __m512 s = _mm512_set1_ps(p.scale[(o0 + o) * p.groups + g]);
      total[o] = _mm512_fmadd_ps(acc[o], s, total[o]);
    }
  }
  for (int o = 0; o < kTile; ++o)
    p.y[t * p.out + o0 + o] = hsum512(total[o]) - zero_term(p, t, o0 + o);
}

void block_bf16(const ProblemBf16& p, int64_t o0, int64_t o1) {
  const bool wide = p.group % kWideStep == 0;
  for (int64_t t = 0; t < p.rows; ++t)
    for (int64_t o = o0; o < o1; o += kTile)
      wide ? tile_bf16<kWideStep>(p, o, t) : tile_bf16<kNarrowStep>(p, o, t);
}

#pragma GCC pop_options
#endif

bool have_bf16_dot() {
#ifdef PAGODA_W4_BF16
  static const bool yes = __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

bool have_avx2() {
#ifdef PAGODA_W4_AVX2
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

inline float to_float(float v) { return v; }

inline float to_float(uint16_t bf16_bits) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// xsum[t, g]: float32 sums of each row's groups of inputs, in input order (float32 or
// bfloat16 bits).
template <typename T>
void group_sums(const T* x, int64_t rows, int64_t in, int64_t groups, float* xsum) {
  const int64_t group = in / groups;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const T* xg = x + t * in + g * group;
      float s = 0.f;
      for (int64_t i = 0; i < group; ++i) s += to_float(xg[i]);
      xsum[t * groups + g] = s;
    }
}

void check(const torch::Tensor& t, at::ScalarType type, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == dim &&
                  t.is_contiguous(),
              name, " must be a contiguous CPU tensor of ", dim, " dims and type ", type);
}

}  // namespace

// x [T, in] float32, q uint8 [out, in / 2], scale and zs float32 [out, groups] -> [T, out]
// float32.
torch::Tensor w4a16_linear(const torch::Tensor& x, const torch::Tensor& q,
                           const torch::Tensor& scale, const torch::Tensor& zs,
                           bool allow_avx2) {
  check(x, at::kFloat, 2, "x");
  check(q, at::kByte, 2, "q");
  check(scale, at::kFloat, 2, "scale");
  check(zs, at::kFloat, 2, "zs");
  const int64_t rows = x.size(0), in = x.size(1), out = q.size(0), groups = scale.size(1);
  TORCH_CHECK(q.size(1) * 2 == in && in % kChunk == 0, "q must be [out, in / 2], in a multiple of 16");
  TORCH_CHECK(scale.size(0) == out && zs.sizes() == scale.sizes() && groups > 0 &&
                  in % groups == 0 && (in / groups) % kChunk == 0 && out % kOutBlock == 0,
              "scale and zs must be [out, groups], groups of a multiple of 16 inputs, "
              "out a multiple of 8");
  auto y = torch::empty({rows, out}, x.options());
  std::vector<float> xsum(static_cast<size_t>(rows * groups));
  Problem p{x.data_ptr<float>(), q.data_ptr<uint8_t>(), scale.data_ptr<float>(),
            zs.data_ptr<float>(), xsum.data(), y.data_ptr<float>(),
            rows, in, out, groups, in / groups};
  if (rows == 0) return y;
  group_sums(p.x, rows, in, groups, xsum.data());
  const bool avx2 = allow_avx2 && have_avx2();
  at::parallel_for(0, out / kOutBlock, 1, [&](int64_t begin, int64_t end) {
    const int64_t o0 = begin * kOutBlock, o1 = end * kOutBlock;
#ifdef PAGODA_W4_AVX2
    if (avx2) return block_avx2(p, o0, o1);
#endif
    rows_plain(p, o0, o1, 0, rows);
  });
  return y;
}

bool bf16_available() { return have_bf16_dot(); }

// x [T, in] bfloat16, q/scale/zs as above -> [T, out] float32; ``bf16_available()`` and groups of
// a multiple of 32 inputs (``w4a16_cpu`` asks before calling).
torch::Tensor w4a16_linear_bf16(const torch::Tensor& x, const torch::Tensor& q,
                                const torch::Tensor& scale, const torch::Tensor& zs) {
  check(x, at::kBFloat16, 2, "x");
  check(q, at::kByte, 2, "q");
  check(scale, at::kFloat, 2, "scale");
  check(zs, at::kFloat, 2, "zs");
  TORCH_CHECK(have_bf16_dot(), "this CPU has no AVX-512-BF16");
  const int64_t rows = x.size(0), in = x.size(1), out = q.size(0), groups = scale.size(1);
  TORCH_CHECK(q.size(1) * 2 == in && scale.size(0) == out && zs.sizes() == scale.sizes() &&
                  groups > 0 && in % groups == 0 && (in / groups) % 32 == 0 &&
                  out % kOutBlock == 0,
              "q must be [out, in / 2], scale and zs [out, groups], groups of a multiple of 32 "
              "inputs, out a multiple of 8");
  auto y = torch::empty({rows, out}, x.options().dtype(at::kFloat));
  if (rows == 0) return y;
  const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<uint16_t> xr(static_cast<size_t>(rows * in));
  std::vector<float> xsum(static_cast<size_t>(rows * groups));
  const int64_t group = in / groups;
  group_sums(xb, rows, in, groups, xsum.data());
#ifdef PAGODA_W4_BF16
  for (int64_t t = 0; t < rows; ++t)
    arrange_row(xb + t * in, in, group % kWideStep == 0 ? kWideStep : kNarrowStep,
                xr.data() + t * in);
  ProblemBf16 p{xr.data(), q.data_ptr<uint8_t>(), scale.data_ptr<float>(), zs.data_ptr<float>(),
                xsum.data(), y.data_ptr<float>(), rows, in, out, groups, group};
  at::parallel_for(0, out / kOutBlock, 1, [&](int64_t begin, int64_t end) {
    block_bf16(p, begin * kOutBlock, end * kOutBlock);
  });
#endif
  return y;
}

// Lets go of the GIL while it runs, as torch's own ops do (see cpu_ops.cpp).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("w4a16_linear", &w4a16_linear, release(),
        "x [T, in] float32 times a 4-bit weight in the kernel's layout -> [T, out] float32",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("zs"),
        py::arg("allow_avx2") = true);
  m.def("w4a16_linear_bf16", &w4a16_linear_bf16, release(),
        "x [T, in] bfloat16 times a 4-bit weight in the kernel's layout -> [T, out] float32 "
        "(AVX-512-BF16)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("zs"));
  m.def("bf16_available", &bf16_available, "whether w4a16_linear_bf16 runs on this CPU");
}

// Pagoda's CPU kernels: paged decode attention, RMSNorm (with the fused residual add), RoPE
// and SiLU-and-mul, for float32 and bfloat16 tensors; top-k/top-p truncation and Gumbel-max
// sampling over float32 logits.
//
// Why by hand: on a small model the step is a few hundred small ops, each a pass over memory
// and a dispatch; these fuse the passes (a norm is one read and one write, not five) and read
// the paged KV cache in place (no gather into a padded copy). Every kernel has a torch
// reference in services/engine (the tests compare them), and rounds where that reference
// rounds: bfloat16 results are rounded at the same points as the torch ops they replace, and
// RoPE is compiled without fused multiply-adds, since the reference rounds both products.
//
// Vectorisation: the hot loops are plain loops the compiler vectorises; each kernel's row
// function is cloned for AVX-512 (x86-64-v4), AVX2+FMA (x86-64-v3) and baseline x86-64, and
// the loader picks the clone the CPU supports when the library is loaded. Threads: ATen's
// intra-op pool (at::parallel_for), so torch.set_num_threads governs these kernels too.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PAGODA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PAGODA_CLONES
#endif

// Helpers the cloned functions call must be inlined into each clone: a function compiled out
// of line is compiled once, for baseline x86-64 (SSE2), whichever clone calls it.
#define PAGODA_INLINE inline __attribute__((always_inline))

namespace {

using bf16_t = uint16_t;

PAGODA_INLINE float bf16_to_f(bf16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch does (NaN stays NaN: a quiet bit is kept).
PAGODA_INLINE bf16_t f_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>(bits >> 16);
}

PAGODA_INLINE float round_bf16(float f) { return bf16_to_f(f_to_bf16(f)); }

template <typename T>
PAGODA_INLINE float load(const T* p, int64_t i);
template <>
PAGODA_INLINE float load<float>(const float* p, int64_t i) { return p[i]; }
template <>
PAGODA_INLINE float load<bf16_t>(const bf16_t* p, int64_t i) { return bf16_to_f(p[i]); }

template <typename T>
PAGODA_INLINE void store(T* p, int64_t i, float v);
template <>
PAGODA_INLINE void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <>
PAGODA_INLINE void store<bf16_t>(bf16_t* p, int64_t i, float v) { p[i] = f_to_bf16(v); }

// The value a torch op in T's dtype produces from a float result: itself in float32, rounded
// in bfloat16.
template <typename T>
PAGODA_INLINE float as_t(float v);
template <>
PAGODA_INLINE float as_t<float>(float v) { return v; }
template <>
PAGODA_INLINE float as_t<bf16_t>(float v) { return round_bf16(v); }

// exp(x) for float32 in plain arithmetic, so loops that call it vectorise (std::exp does not
// without -ffast-math): x = n ln2 + r with |r| <= ln2 / 2, a degree-7 polynomial for e^r and
// 2^n through the exponent bits (Cephes' expf). Within 1 ulp of exp; inputs are clamped to
// [-87.3, 88.7], where float32 exp underflows and overflows.
#pragma omp declare simd
PAGODA_INLINE float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // Cody-Waite ln2 split
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

void check_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

void check_float_like(const torch::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat || is_bf16(t), name, " must be float32 or bfloat16");
}

// ---------------------------------------------------------------------------------- KV cache
//
// The layout these kernels read (``CpuAttentionBackend.allocate_kv_cache``): logically both
// caches are [num_blocks, block_size, kv_heads, head_dim], but the key cache is stored with each
// block's keys transposed per head, so the scores of a block's keys are one vector FMA per
// head_dim element, with no horizontal sums:
//
//     k storage [num_blocks, kv_heads, head_dim, block_size]   (the logical tensors are
//     v storage [num_blocks, kv_heads, block_size, head_dim]    permuted views of these)
//
// so one block of one head is one contiguous run of memory for keys and for values.

bool keys_block_transposed(const torch::Tensor& k) {
  if (k.dim() != 4) return false;
  const int64_t bs = k.size(1), heads = k.size(2), dim = k.size(3);
  return k.stride(1) == 1 && k.stride(3) == bs && k.stride(2) == dim * bs &&
         k.stride(0) == heads * dim * bs;
}

bool values_head_major(const torch::Tensor& v) {
  if (v.dim() != 4) return false;
  const int64_t bs = v.size(1), heads = v.size(2), dim = v.size(3);
  return v.stride(3) == 1 && v.stride(1) == dim && v.stride(2) == bs * dim &&
         v.stride(0) == heads * bs * dim;
}

bool kernel_layout(const torch::Tensor& k, const torch::Tensor& v) {
  return keys_block_transposed(k) && values_head_major(v) && k.sizes() == v.sizes();
}

template <typename T>
inline void store_token(const T* key, const T* value, T* kc, T* vc, int64_t slot, int64_t bs,
                        int64_t heads, int64_t dim) {
  const int64_t blk = slot / bs, off = slot % bs;
  T* kb = kc + blk * heads * dim * bs + off;
  T* vb = vc + blk * heads * bs * dim + off * dim;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < dim; ++d) kb[(h * dim + d) * bs] = key[h * dim + d];
    std::memcpy(vb + h * bs * dim, value + h * dim, static_cast<size_t>(dim) * sizeof(T));
  }
}

// key/value [T, kv_heads, head_dim] (any token stride, contiguous within a token); slots < 0
// (padding) are skipped.
void store_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor k_cache,
              torch::Tensor v_cache, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(kernel_layout(k_cache, v_cache), "caches must be in the CPU kernels' layout");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() &&
                  value.scalar_type() == k_cache.scalar_type(),
              "key/value must have the caches' dtype");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "key/value must be contiguous within a token");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  const int64_t tokens = key.size(0), bs = k_cache.size(1), heads = k_cache.size(2),
                dim = k_cache.size(3);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  const bool bf16 = is_bf16(k_cache);
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      if (bf16) {
        store_token(static_cast<const bf16_t*>(key.data_ptr()) + t * ks,
                    static_cast<const bf16_t*>(value.data_ptr()) + t * vs,
                    static_cast<bf16_t*>(k_cache.data_ptr()),
                    static_cast<bf16_t*>(v_cache.data_ptr()), slots[t], bs, heads, dim);
      } else {
        store_token(key.data_ptr<float>() + t * ks, value.data_ptr<float>() + t * vs,
                    k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots[t], bs, heads,
                    dim);
      }
    }
  });
}

// ---------------------------------------------------------------------------------- prefetch

// Asks for the next block of this head while the current one is computed: a block of one head
// is a few KB in a random place of a large cache, too short a run for the hardware prefetcher
// to find on its own.
template <typename C>
PAGODA_INLINE void prefetch_chunk(const C* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = elements * static_cast<int64_t>(sizeof(C));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// Into L2 only: the values are asked for during the keys' pass, to be there (not yet in L1,
// which the keys fill) when the values' pass starts; that pass then starts with no wait on
// memory. From DRAM (a 2.4 GB cache, 48 requests of 192-384 tokens, bf16, 2-core Xeon):
// 14.4 GB/s without, 16.1 with.
template <typename C>
PAGODA_INLINE void prefetch_chunk_l2(const C* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = elements * static_cast<int64_t>(sizeof(C));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

// ------------------------------------------------------------- AVX512-BF16: bf16 rows, decode
//
// On CPUs with AVX512-BF16 (Intel Xeons from Cooper Lake on, with AMX from Sapphire Rapids;
// AMD from Zen 4) one instruction rounds 16 floats to bfloat16, to nearest even as torch does,
// where the portable loops spend a dozen integer ops per vector on it, twice per element. The
// row functions below are those loops' bfloat16 cases in intrinsics, with the same rounding
// points, and the decode kernel is ``decode_task`` in intrinsics (float32 and bfloat16 caches);
// they are chosen at run time (``g_avx512_bf16``) and the tests run both. 512 rows, 2 threads,
// Xeon with AMX, portable loops against these: SiLU-and-mul (3072 wide) 357 -> 190 us, rms_norm
// with the residual (576) 95 -> 54 us, RoPE (15 heads of 64) 127 -> 79 us. The instruction
// treats float32 denormals as zero and flushes bfloat16 denormals, values below 1.2e-38 that
// activations never hold.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PAGODA_AVX512_BF16 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace bf16v {

inline __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load(const bf16_t* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load(const bf16_t* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }  // the decode's float32 cache
inline __m256i narrow(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
inline void store(bf16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(v));
}
inline void store(bf16_t* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, narrow(v)); }
inline __m512 round(__m512 v) { return widen(narrow(v)); }  // as_t<bf16_t>
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }  // n < 16

// fast_exp's steps, 16 lanes at a time.
inline __m512 exp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// silu_mul_row<bf16_t>: the division by 1 + e^-g as a reciprocal estimate and one Newton
// step (float32-accurate; the result is rounded to bfloat16 right after).
inline __m512 silu_mul(__m512 g, __m512 up) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 d = _mm512_add_ps(one, exp(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 inv = _mm512_rcp14_ps(d);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(round(_mm512_mul_ps(g, inv)), up);
}

void silu_mul_row(const bf16_t* gu, bf16_t* out, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) store(out + i, silu_mul(load(gu + i), load(gu + half + i)));
  if (i < half) {
    const __mmask16 m = first(half - i);
    store(out + i, silu_mul(load(gu + i, m), load(gu + half + i, m)), m);
  }
}

// norm_row<bf16_t>
void norm_row(const bf16_t* x, bf16_t* residual, const bf16_t* weight, bf16_t* out, int64_t n,
              float eps) {
  const int64_t full = n - n % 16;
  const __mmask16 m = first(n % 16);
  __m512 ss = _mm512_setzero_ps();
  const bf16_t* src = x;
  if (residual != nullptr) {
    for (int64_t i = 0; i < full; i += 16) {
      const __m512 r = round(_mm512_add_ps(load(residual + i), load(x + i)));
      store(residual + i, r);
      ss = _mm512_fmadd_ps(r, r, ss);
    }
    if (m) {
      const __m512 r = round(_mm512_add_ps(load(residual + full, m), load(x + full, m)));
      store(residual + full, r, m);
      ss = _mm512_fmadd_ps(r, r, ss);
    }
    src = residual;
  } else {
    for (int64_t i = 0; i < full; i += 16) {
      const __m512 v = load(x + i);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    if (m) {
      const __m512 v = load(x + full, m);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
  }
  const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t i = 0; i < full; i += 16)
    store(out + i, _mm512_mul_ps(load(weight + i), round(_mm512_mul_ps(load(src + i), rv))));
  if (m)
    store(out + full,
          _mm512_mul_ps(load(weight + full, m), round(_mm512_mul_ps(load(src + full, m), rv))), m);
}

// rope_row<bf16_t> for head sizes that are multiples of 32 (each half whole vectors); both
// products are rounded before the sum, as in the reference.
void rope_row(bf16_t* x, int64_t heads, int64_t head_stride, const bf16_t* cos,
              const bf16_t* ssin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    bf16_t* xh = x + h * head_stride;
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 lo = load(xh + i), hi = load(xh + half + i);
      const __m512 out_lo = _mm512_add_ps(round(_mm512_mul_ps(lo, load(cos + i))),
                                          round(_mm512_mul_ps(hi, load(ssin + i))));
      const __m512 out_hi = _mm512_add_ps(round(_mm512_mul_ps(hi, load(cos + half + i))),
                                          round(_mm512_mul_ps(lo, load(ssin + half + i))));
      store(xh + i, out_lo);
      store(xh + half + i, out_hi);
    }
  }
}


// decode_task<C, 16, D, G> (below) in intrinsics, for head sizes of 64 and 128 and groups of
// up to 8, float32 and bfloat16 caches: the same sums in the same order, its accumulators held
// in registers, where the compiler's version of the loops ran at a third of the vector units'
// rate (bf16 at 512 tokens of context: 1.4x single-threaded, 1.2x from DRAM in the mixed
// workload, 15.2 -> 18.0 GB/s). Prefetching as there.
template <typename C, int D, int G>
void decode(const float* q, const C* kc, const C* vc, const int32_t* table,
            int64_t len, int64_t /*bs*/, int64_t kv_heads, int64_t /*dim*/, int64_t head,
            int64_t /*group*/, float scale, float* scores, float* out) {
  constexpr int BS = 16;
  constexpr int PS = G <= 4 ? 4 : 2;  // independent score sums per query (see decode_task)
  constexpr int VC = G <= 4 ? 4 : 2;  // 16-wide vectors of the head dimension per value pass
  static_assert(D % PS == 0 && D % (16 * VC) == 0, "head size");
  const int64_t block = kv_heads * D * BS;
  alignas(64) float qs[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) qs[g][d] = q[g * D + d] * scale;
  for (int64_t start = 0, blk = 0; start < len; start += BS, ++blk) {
    const C* kb = kc + static_cast<int64_t>(table[blk]) * block + head * D * BS;
    if (start + 2 * BS < len) {
      const int64_t next = static_cast<int64_t>(table[blk + 2]) * block;
      prefetch_chunk(kc + next + head * D * BS, D * BS);
      prefetch_chunk_l2(vc + next + head * BS * D, D * BS);
    }
    __m512 acc[PS][G];
    for (int p = 0; p < PS; ++p)
      for (int g = 0; g < G; ++g) acc[p][g] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += PS) {
      for (int p = 0; p < PS; ++p) {
        const __m512 k = load(kb + (d + p) * BS);
        for (int g = 0; g < G; ++g)
          acc[p][g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g][d + p]), k, acc[p][g]);
      }
    }
    const int64_t n = std::min<int64_t>(BS, len - start);
    const __mmask16 m = n == BS ? static_cast<__mmask16>(0xFFFF) : first(n);
    for (int g = 0; g < G; ++g) {
      __m512 sum = acc[0][g];
      for (int p = 1; p < PS; ++p) sum = _mm512_add_ps(sum, acc[p][g]);
      _mm512_mask_storeu_ps(scores + g * len + start, m, sum);
    }
  }
  const int64_t full = len - len % 16;
  const __mmask16 tail = first(len % 16);
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* row = scores + g * len;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t p = 0; p < full; p += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + p));
    if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, row + full));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t p = 0; p < full; p += 16) {
      const __m512 e = exp(_mm512_sub_ps(_mm512_loadu_ps(row + p), top));
      _mm512_storeu_ps(row + p, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
      const __m512 e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + full), top));
      _mm512_mask_storeu_ps(row + full, tail, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(sum);
  }
  for (int c = 0; c < D; c += 16 * VC) {
    __m512 acc[G][VC];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < VC; ++j) acc[g][j] = _mm512_setzero_ps();
    for (int64_t start = 0, blk = 0; start < len; start += BS, ++blk) {
      const C* v = vc + static_cast<int64_t>(table[blk]) * block + head * BS * D + c;
      if (start + 2 * BS < len)
        prefetch_chunk(vc + static_cast<int64_t>(table[blk + 2]) * block + head * BS * D + c,
                       BS * D - c);
      const int64_t n = std::min<int64_t>(BS, len - start);
      for (int64_t i = 0; i < n; ++i) {
        __m512 vv[VC];
        for (int j = 0; j < VC; ++j) vv[j] = load(v + i * D + 16 * j);
        for (int g = 0; g < G; ++g) {
          const __m512 w = _mm512_set1_ps(scores[g * len + start + i]);
          for (int j = 0; j < VC; ++j) acc[g][j] = _mm512_fmadd_ps(w, vv[j], acc[g][j]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 scale_g = _mm512_set1_ps(inv[g]);
      for (int j = 0; j < VC; ++j)
        _mm512_storeu_ps(out + g * D + c + 16 * j, _mm512_mul_ps(acc[g][j], scale_g));
    }
  }
}

}  // namespace bf16v

#pragma GCC pop_options
#endif

// Whether the bf16 rows and the decode kernel take the AVX512-BF16 functions: the CPU has the
// instructions, and the tests have not turned them off to run the portable loops.
bool cpu_has_avx512_bf16() {
#ifdef PAGODA_AVX512_BF16
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool g_avx512_bf16 = cpu_has_avx512_bf16();

// Returns whether they were on; turns them on only where the CPU has them.
bool use_avx512_bf16(bool on) {
  const bool was = g_avx512_bf16;
  g_avx512_bf16 = on && cpu_has_avx512_bf16();
  return was;
}

// ---------------------------------------------------------------------------------- decode

// One (request, KV head): the scores of its query group against every context key, a softmax,
// then the probability-weighted sum of the values. BS (block size), DIM (head_dim) and G (query
// heads per KV head) are compile-time for the common shapes, so the accumulators of all G
// queries live in registers and each key and value row is loaded once for the whole group;
// 0 means the generic loops.
template <typename C, int BS, int DIM, int G>
PAGODA_INLINE void decode_task(const float* __restrict__ q, const C* __restrict__ kc,
                        const C* __restrict__ vc, const int32_t* __restrict__ table, int64_t len,
                        int64_t rt_bs, int64_t kv_heads, int64_t rt_dim, int64_t head,
                        int64_t rt_group, float scale, float* __restrict__ scores,
                        float* __restrict__ out) {
  constexpr int kMaxGroup = 16;
  // Independent accumulators: a single running sum per row is one long chain of dependent
  // FMAs (each waits ~4 cycles for the last), so the key dimension (scores) is split over 4
  // sums per query (2 for groups of 5-8, to stay in registers) and, for short heads, the keys
  // (values) over several, added at the end. The generic loops keep one. With a group of 3
  // (SmolLM2), 4 sums instead of 1 cut the kernel's time by 15% (2-core Xeon, in cache and
  // from DRAM).
  constexpr int PS = (G && DIM) ? (G <= 4 ? 4 : 2) : 1;
  constexpr int PV = (DIM && DIM < 64) ? 64 / DIM : 1;
  const int64_t bs = BS ? BS : rt_bs, dim = DIM ? DIM : rt_dim, group = G ? G : rt_group;
  const int64_t block = kv_heads * dim * bs;  // elements per cache block, keys or values
  float qs[kMaxGroup][DIM ? DIM : 512];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) qs[g][d] = q[g * dim + d] * scale;
  for (int64_t start = 0, blk = 0; start < len; start += bs, ++blk) {
    const int64_t n = std::min(bs, len - start);
    const C* kb = kc + static_cast<int64_t>(table[blk]) * block + head * dim * bs;
    if (start + 2 * bs < len) {  // this head's keys, and its values for the second pass
      prefetch_chunk(kc + static_cast<int64_t>(table[blk + 2]) * block + head * dim * bs, dim * bs);
      prefetch_chunk_l2(vc + static_cast<int64_t>(table[blk + 2]) * block + head * bs * dim,
                        dim * bs);
    }
    float acc[PS][G ? G : kMaxGroup][BS ? BS : 256];
    for (int p = 0; p < PS; ++p)
      for (int64_t g = 0; g < group; ++g)
#pragma omp simd
        for (int64_t i = 0; i < bs; ++i) acc[p][g][i] = 0.f;
    for (int64_t d = 0; d < dim; d += PS) {  // PS divides every head_dim it is set for
      for (int p = 0; p < PS; ++p) {
        const C* kd = kb + (d + p) * bs;
        for (int64_t g = 0; g < group; ++g) {
          const float qd = qs[g][d + p];
#pragma omp simd
          for (int64_t i = 0; i < bs; ++i) acc[p][g][i] += qd * load(kd, i);
        }
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < n; ++i) {
        float sum = acc[0][g][i];
        for (int p = 1; p < PS; ++p) sum += acc[p][g][i];
        scores[g * len + start + i] = sum;
      }
  }
  float inv[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * len;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t p = 0; p < len; ++p) m = std::max(m, row[p]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < len; ++p) {
      row[p] = fast_exp(row[p] - m);
      sum += row[p];
    }
    inv[g] = 1.f / sum;
  }
  float acc[PV][G ? G : kMaxGroup][DIM ? DIM : 512];
  for (int p = 0; p < PV; ++p)
    for (int64_t g = 0; g < group; ++g)
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) acc[p][g][d] = 0.f;
  for (int64_t start = 0, blk = 0; start < len; start += bs, ++blk) {
    const int64_t n = std::min(bs, len - start);
    const C* v = vc + static_cast<int64_t>(table[blk]) * block + head * bs * dim;
    if (start + 2 * bs < len)
      prefetch_chunk(vc + static_cast<int64_t>(table[blk + 2]) * block + head * bs * dim, dim * bs);
    int64_t i = 0;
    for (; i + PV <= n; i += PV) {  // PV keys in flight, each into its own accumulators
      for (int p = 0; p < PV; ++p) {
        const C* vp = v + (i + p) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * len + start + i + p];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) acc[p][g][d] += w * load(vp, d);
        }
      }
    }
    for (; i < n; ++i) {
      const C* vp = v + i * dim;
      for (int64_t g = 0; g < group; ++g) {
        const float w = scores[g * len + start + i];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) acc[0][g][d] += w * load(vp, d);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) {
      float sum = acc[0][g][d];
      for (int p = 1; p < PV; ++p) sum += acc[p][g][d];
      out[g * dim + d] = sum * inv[g];
    }
}

template <typename C>
using DecodeFn = void (*)(const float*, const C*, const C*, const int32_t*, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, float*, float*);

#define PAGODA_DECODE_CLONE(NAME, C, BS, DIM, G)                                                \
  PAGODA_CLONES void NAME(const float* q, const C* kc, const C* vc, const int32_t* table,     \
                          int64_t len, int64_t bs, int64_t kv_heads, int64_t dim, int64_t head, \
                          int64_t group, float scale, float* scores, float* out) {              \
    decode_task<C, BS, DIM, G>(q, kc, vc, table, len, bs, kv_heads, dim, head, group, scale,   \
                               scores, out);                                                    \
  }

// Block size 16 (the engine's default) with head_dim 16, 32, 64 or 128 and query groups of 1-8
// (every GQA layout of the supported families; 16 and 32 are the small test and draft models',
// whose runtime-bounded loops ran at a third of the speed); anything else takes the generic
// loops.
#define PAGODA_DECODE_GROUPS(C, TAG, DIM)                \
  PAGODA_DECODE_CLONE(decode_##TAG##_##DIM##_1, C, 16, DIM, 1) \
  PAGODA_DECODE_CLONE(decode_##TAG##_##DIM##_2, C, 16, DIM, 2) \
  PAGODA_DECODE_CLONE(decode_##TAG##_##DIM##_3, C, 16, DIM, 3) \
  PAGODA_DECODE_CLONE(decode_##TAG##_##DIM##_4, C, 16, DIM, 4) \
  PAGODA_DECODE_CLONE(decode_##TAG##_##DIM##_5, C, 16, DIM, 5) \
  PAGODA_DECODE_CLONE(decode_##TAG##_##DIM##_6, C, 16, DIM, 6) \
  PAGODA_DECODE_CLONE(decode_##TAG##_##DIM##_7, C, 16, DIM, 7) \
  PAGODA_DECODE_CLONE(decode_##TAG##_##DIM##_8, C, 16, DIM, 8)

PAGODA_DECODE_GROUPS(float, f32, 16)
PAGODA_DECODE_GROUPS(float, f32, 32)
PAGODA_DECODE_GROUPS(float, f32, 64)
PAGODA_DECODE_GROUPS(float, f32, 128)
PAGODA_DECODE_GROUPS(bf16_t, bf16, 16)
PAGODA_DECODE_GROUPS(bf16_t, bf16, 32)
PAGODA_DECODE_GROUPS(bf16_t, bf16, 64)
PAGODA_DECODE_GROUPS(bf16_t, bf16, 128)
PAGODA_DECODE_CLONE(decode_f32_any, float, 0, 0, 0)
PAGODA_DECODE_CLONE(decode_bf16_any, bf16_t, 0, 0, 0)

#define PAGODA_DECODE_TABLE(TAG, DIM)                                                     \
  {decode_##TAG##_##DIM##_1, decode_##TAG##_##DIM##_2, decode_##TAG##_##DIM##_3,           \
   decode_##TAG##_##DIM##_4, decode_##TAG##_##DIM##_5, decode_##TAG##_##DIM##_6,           \
   decode_##TAG##_##DIM##_7, decode_##TAG##_##DIM##_8}

// The intrinsics kernels (bf16v::decode) for groups 1-8 of one head size.
#define PAGODA_DECODE_VTABLE(C, D)                                                       \
  {bf16v::decode<C, D, 1>, bf16v::decode<C, D, 2>, bf16v::decode<C, D, 3>,               \
   bf16v::decode<C, D, 4>, bf16v::decode<C, D, 5>, bf16v::decode<C, D, 6>,               \
   bf16v::decode<C, D, 7>, bf16v::decode<C, D, 8>}

// The intrinsics kernel for the shape, on CPUs with AVX512-BF16 (``g_avx512_bf16``); else the
// portable loops' clone (``pick_decode``).
template <typename C>
DecodeFn<C> pick_decode(int64_t bs, int64_t dim, int64_t group);
template <typename C>
DecodeFn<C> pick_decode_fast(int64_t bs, int64_t dim, int64_t group) {
#ifdef PAGODA_AVX512_BF16
  static const DecodeFn<C> v64[] = PAGODA_DECODE_VTABLE(C, 64);
  static const DecodeFn<C> v128[] = PAGODA_DECODE_VTABLE(C, 128);
  if (g_avx512_bf16 && bs == 16 && group >= 1 && group <= 8 && (dim == 64 || dim == 128))
    return (dim == 64 ? v64 : v128)[group - 1];
#endif
  return pick_decode<C>(bs, dim, group);
}
template <>
DecodeFn<float> pick_decode<float>(int64_t bs, int64_t dim, int64_t group) {
  static const DecodeFn<float> d16[] = PAGODA_DECODE_TABLE(f32, 16);
  static const DecodeFn<float> d32[] = PAGODA_DECODE_TABLE(f32, 32);
  static const DecodeFn<float> d64[] = PAGODA_DECODE_TABLE(f32, 64);
  static const DecodeFn<float> d128[] = PAGODA_DECODE_TABLE(f32, 128);
  if (bs != 16 || group < 1 || group > 8) return decode_f32_any;
  switch (dim) {
    case 16: return d16[group - 1];
    case 32: return d32[group - 1];
    case 64: return d64[group - 1];
    case 128: return d128[group - 1];
    default: return decode_f32_any;
  }
}
template <>
DecodeFn<bf16_t> pick_decode<bf16_t>(int64_t bs, int64_t dim, int64_t group) {
  static const DecodeFn<bf16_t> d16[] = PAGODA_DECODE_TABLE(bf16, 16);
  static const DecodeFn<bf16_t> d32[] = PAGODA_DECODE_TABLE(bf16, 32);
  static const DecodeFn<bf16_t> d64[] = PAGODA_DECODE_TABLE(bf16, 64);
  static const DecodeFn<bf16_t> d128[] = PAGODA_DECODE_TABLE(bf16, 128);
  if (bs != 16 || group < 1 || group > 8) return decode_bf16_any;
  switch (dim) {
    case 16: return d16[group - 1];
    case 32: return d32[group - 1];
    case 64: return d64[group - 1];
    case 128: return d128[group - 1];
    default: return decode_bf16_any;
  }
}

// The (request, KV head) tasks cut into one contiguous run per thread, of about equal work:
// a task costs its context length plus a fixed part. Split by count, the runs of a step
// whose contexts differ (a mixed step's rows, requests of 32 and 700 tokens) left one thread
// idle for much of the call. Returns the runs' bounds, [0, ..., batch * kv_heads].
std::vector<int64_t> balanced_runs(const int32_t* lens, int64_t batch, int64_t kv_heads) {
  constexpr int64_t kFixed = 32;  // about a block's worth: the per-task setup and softmax
  const int64_t tasks = batch * kv_heads;
  const int64_t runs = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) total += (lens[b] + kFixed) * kv_heads;
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t task = 0; task < tasks && static_cast<int64_t>(bounds.size()) < runs; ++task) {
    done += lens[task / kv_heads] + kFixed;
    if (done * runs >= total * static_cast<int64_t>(bounds.size())) bounds.push_back(task + 1);
  }
  bounds.push_back(tasks);
  return bounds;
}

// Q: the query's and the output's type (float32, or the caches' bfloat16: the model's own
// dtype, read and written here so that no per-layer conversion copies are needed). The task
// function works in float32 on a few hundred query values, converted per task.
template <typename C, typename Q>
void decode_batch(const Q* q, const C* kc, const C* vc, const int32_t* tables,
                  int64_t table_stride, const int32_t* lens, Q* o, int64_t batch,
                  int64_t heads, int64_t kv_heads, int64_t dim, int64_t bs, float scale) {
  const int64_t group = heads / kv_heads;
  const DecodeFn<C> fn = pick_decode_fast<C>(bs, dim, group);
  const std::vector<int64_t> bounds = balanced_runs(lens, batch, kv_heads);
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t first,
                                                                      int64_t last) {
    std::vector<float> scores, qf, of;
    if constexpr (!std::is_same_v<Q, float>) {
      qf.resize(static_cast<size_t>(group * dim));
      of.resize(static_cast<size_t>(group * dim));
    }
    for (int64_t task = bounds[first]; task < bounds[last]; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t len = lens[b];
      scores.resize(static_cast<size_t>(group * len));
      const int64_t at = (b * heads + h * group) * dim;
      if constexpr (std::is_same_v<Q, float>) {
        fn(q + at, kc, vc, tables + b * table_stride, len, bs, kv_heads, dim, h, group, scale,
           scores.data(), o + at);
      } else {
        for (int64_t i = 0; i < group * dim; ++i) qf[i] = load(q + at, i);
        fn(qf.data(), kc, vc, tables + b * table_stride, len, bs, kv_heads, dim, h, group, scale,
           scores.data(), of.data());
        for (int64_t i = 0; i < group * dim; ++i) store(o + at, i, of[i]);
      }
    }
  });
}

// query [B, H, D] contiguous, float32 or the caches' dtype; caches in the layout above
// (float32 or bfloat16); block_tables [B, max_blocks] int32; seq_lens [B] int32. Returns
// [B, H, D] in the query's dtype. The runner checked the step's contract once
// (attention.contract); the checks here are per call (one per layer), not per request.
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.is_contiguous() && query.dim() == 3 &&
                  (query.scalar_type() == at::kFloat ||
                   query.scalar_type() == k_cache.scalar_type()),
              "query must be a contiguous [B, H, D] tensor, float32 or the caches' dtype");
  TORCH_CHECK(kernel_layout(k_cache, v_cache), "caches must be in the CPU kernels' layout");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches differ in dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables rows must be contiguous");
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t bs = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head layout mismatch");
  TORCH_CHECK(bs <= 256 && dim <= 512 && heads / kv_heads <= 16,
              "block_size <= 256, head_dim <= 512 and <= 16 query heads per KV head");
  auto out = torch::empty_like(query);
  const float s = static_cast<float>(scale);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t ts = block_tables.stride(0);
  if (is_bf16(k_cache)) {
    const auto* kc = static_cast<const bf16_t*>(k_cache.data_ptr());
    const auto* vc = static_cast<const bf16_t*>(v_cache.data_ptr());
    if (is_bf16(query)) {
      decode_batch(static_cast<const bf16_t*>(query.data_ptr()), kc, vc, tables, ts, lens,
                   static_cast<bf16_t*>(out.data_ptr()), batch, heads, kv_heads, dim, bs, s);
    } else {
      decode_batch(query.data_ptr<float>(), kc, vc, tables, ts, lens, out.data_ptr<float>(),
                   batch, heads, kv_heads, dim, bs, s);
    }
  } else {
    decode_batch(query.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                 tables, ts, lens, out.data_ptr<float>(), batch, heads, kv_heads, dim, bs, s);
  }
  return out;
}

// ---------------------------------------------------------------------------------- RMSNorm

// out = weight * round(x * rsqrt(mean(x^2) + eps)) with the statistics in float32; in
// bfloat16 the normalised row is rounded before the weight multiply (HF's order), in float32
// nothing rounds in between. With a residual: residual += x first (rounded to its dtype),
// and the norm is of the new residual.
template <typename T>
PAGODA_INLINE void norm_row(const T* x, T* residual, const T* weight, T* out, int64_t n, float eps) {
  const T* src = x;
  if (residual != nullptr) {
    for (int64_t i = 0; i < n; ++i) store(residual, i, load(residual, i) + load(x, i));
    src = residual;
  }
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(src, i);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) store(out, i, load(weight, i) * as_t<T>(load(src, i) * r));
}

PAGODA_CLONES void norm_row_f32(const float* x, float* res, const float* w, float* out, int64_t n,
                                float eps) {
  norm_row(x, res, w, out, n, eps);
}

PAGODA_CLONES void norm_row_bf16(const bf16_t* x, bf16_t* res, const bf16_t* w, bf16_t* out,
                                 int64_t n, float eps) {
  norm_row(x, res, w, out, n, eps);
}

// x [T, N] (rows contiguous); residual: same shape, updated in place, or None. Returns the
// normalised rows.
torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                       const torch::Tensor& weight, double eps) {
  check_float_like(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, N] with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "weight must be a contiguous [N] vector of x's dtype");
  const bool has_res = residual.has_value();
  if (has_res) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->sizes() == x.sizes() &&
                    residual->stride(1) == 1,
                "residual must match x");
  }
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows, n}, x.options());
  const int64_t xs = x.stride(0), rs = has_res ? residual->stride(0) : 0;
  const float e = static_cast<float>(eps);
  const bool bf16 = is_bf16(x);
  char* xp = static_cast<char*>(x.data_ptr());
  char* rp = has_res ? static_cast<char*>(residual->data_ptr()) : nullptr;
  char* op = static_cast<char*>(out.data_ptr());
  const void* wp = weight.data_ptr();
  const int64_t el = x.element_size();
  const bool fast = g_avx512_bf16;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      void* xr = xp + t * xs * el;
      void* rr = has_res ? rp + t * rs * el : nullptr;
      void* orow = op + t * n * el;
      if (bf16) {
#ifdef PAGODA_AVX512_BF16
        if (fast) {
          bf16v::norm_row(static_cast<bf16_t*>(xr), static_cast<bf16_t*>(rr),
                          static_cast<const bf16_t*>(wp), static_cast<bf16_t*>(orow), n, e);
          continue;
        }
#endif
        norm_row_bf16(static_cast<bf16_t*>(xr), static_cast<bf16_t*>(rr),
                      static_cast<const bf16_t*>(wp), static_cast<bf16_t*>(orow), n, e);
      } else {
        norm_row_f32(static_cast<float*>(xr), static_cast<float*>(rr),
                     static_cast<const float*>(wp), static_cast<float*>(orow), n, e);
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------- RoPE

// Rotate-half RoPE in place on one token's heads: x' = x * cos + roll(x, d/2) * signed_sin,
// each product and the sum rounded to the dtype (the torch reference's three ops).
template <typename T>
PAGODA_INLINE void rope_row(T* x, int64_t heads, int64_t head_stride, const T* cos, const T* ssin,
                     int64_t dim, float* tmp) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * head_stride;
    for (int64_t i = 0; i < dim; ++i) tmp[i] = load(xh, i);
    for (int64_t i = 0; i < dim; ++i) {
      const float rolled = tmp[i < half ? i + half : i - half];
      const float a = as_t<T>(tmp[i] * load(cos, i));
      const float b = as_t<T>(rolled * load(ssin, i));
      store(xh, i, a + b);
    }
  }
}

// No fused multiply-add here: the reference rounds both products before the sum.
__attribute__((optimize("fp-contract=off"))) PAGODA_CLONES void rope_row_f32(float* x, int64_t heads, int64_t hs, const float* c,
                                const float* s, int64_t dim, float* tmp) {
  rope_row(x, heads, hs, c, s, dim, tmp);
}

__attribute__((optimize("fp-contract=off"))) PAGODA_CLONES void rope_row_bf16(bf16_t* x, int64_t heads, int64_t hs, const bf16_t* c,
                                 const bf16_t* s, int64_t dim, float* tmp) {
  rope_row(x, heads, hs, c, s, dim, tmp);
}

// x [T, heads, D] (a view: heads and D contiguous within a token, any token stride), rotated
// in place; cos_sin [max_positions, 2, D] of x's dtype (cos, signed sin); positions [T] int64.
void rotary_(torch::Tensor x, const torch::Tensor& cos_sin, const torch::Tensor& positions) {
  check_float_like(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, heads, D] with contiguous D");
  TORCH_CHECK(cos_sin.scalar_type() == x.scalar_type() && cos_sin.is_contiguous() &&
                  cos_sin.dim() == 3 && cos_sin.size(2) == x.size(2),
              "cos_sin must be a contiguous [P, 2, D] table of x's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == x.size(0),
              "positions must be int64 [T]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  const int64_t ts = x.stride(0), hs = x.stride(1), max_pos = cos_sin.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const bool bf16 = is_bf16(x);
  const int64_t el = x.element_size();
  char* xp = static_cast<char*>(x.data_ptr());
  const char* cs = static_cast<const char*>(cos_sin.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of the RoPE table");
  }
  const bool fast = g_avx512_bf16 && dim % 32 == 0;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(static_cast<size_t>(dim));
    for (int64_t t = begin; t < end; ++t) {
      void* row = xp + t * ts * el;
      const char* c = cs + pos[t] * 2 * dim * el;
      const char* s = c + dim * el;
      if (bf16) {
#ifdef PAGODA_AVX512_BF16
        if (fast) {
          bf16v::rope_row(static_cast<bf16_t*>(row), heads, hs,
                          reinterpret_cast<const bf16_t*>(c), reinterpret_cast<const bf16_t*>(s),
                          dim);
          continue;
        }
#endif
        rope_row_bf16(static_cast<bf16_t*>(row), heads, hs, reinterpret_cast<const bf16_t*>(c),
                      reinterpret_cast<const bf16_t*>(s), dim, tmp.data());
      } else {
        rope_row_f32(static_cast<float*>(row), heads, hs, reinterpret_cast<const float*>(c),
                     reinterpret_cast<const float*>(s), dim, tmp.data());
      }
    }
  });
}

// ---------------------------------------------------------------------------------- SiLU-and-mul

// out = round(silu(gate)) * up, rounded: F.silu then a multiply, in the dtype.
template <typename T>
PAGODA_INLINE void silu_mul_row(const T* gu, T* out, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float g = load(gu, i);
    const float silu = as_t<T>(g / (1.f + fast_exp(-g)));
    store(out, i, silu * load(gu, half + i));
  }
}

PAGODA_CLONES void silu_mul_row_f32(const float* gu, float* out, int64_t half) {
  silu_mul_row(gu, out, half);
}

PAGODA_CLONES void silu_mul_row_bf16(const bf16_t* gu, bf16_t* out, int64_t half) {
  silu_mul_row(gu, out, half);
}

// gate_up [T, 2I] with contiguous rows -> [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_float_like(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I] with contiguous rows");
  const int64_t rows = gate_up.size(0), half = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = torch::empty({rows, half}, gate_up.options());
  const bool bf16 = is_bf16(gate_up);
  const int64_t el = gate_up.element_size();
  const char* gp = static_cast<const char*>(gate_up.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const bool fast = g_avx512_bf16;
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (bf16) {
#ifdef PAGODA_AVX512_BF16
        if (fast) {
          bf16v::silu_mul_row(reinterpret_cast<const bf16_t*>(gp + t * gs * el),
                              reinterpret_cast<bf16_t*>(op + t * half * el), half);
          continue;
        }
#endif
        silu_mul_row_bf16(reinterpret_cast<const bf16_t*>(gp + t * gs * el),
                          reinterpret_cast<bf16_t*>(op + t * half * el), half);
      } else {
        silu_mul_row_f32(reinterpret_cast<const float*>(gp + t * gs * el),
                         reinterpret_cast<float*>(op + t * half * el), half);
      }
    }
  });
  return out;
}


// ---------------------------------------------------------------------- Gumbel-max sampling
//
// argmax_v(logits[r, v] + G[r, v]) per row, G standard Gumbel noise: an exact draw from
// softmax(logits[r]). torch's CPU exponential_() draws the noise one number at a time on one
// thread (about 14 ns each: 5 ms for 8 rows of a 49k vocabulary, a quarter of a decode step);
// here the noise is counter-based, so it is computed in vector lanes on every thread and fused
// with the argmax: G[r, v] = -log(-log(U)), U from mix64(key[r] + (v + 1) * kGamma) (SplitMix64:
// a stream per key; the keys are 64-bit draws, so two rows' streams never meet in practice).
// The result depends on (logits, key) only, never on the threads or the chunking.

constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ULL;

#pragma omp declare simd
PAGODA_INLINE uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Natural log of a positive normal float (Cephes' logf: within 2 ulp), branch-free so it
// vectorises.
#pragma omp declare simd
PAGODA_INLINE float fast_log(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 126);  // x = m * 2^e
  bits = (bits & 0x007fffffu) | 0x3f000000u;                             // m in [0.5, 1)
  float m;
  std::memcpy(&m, &bits, sizeof m);
  const bool low = m < 0.707106781186547524f;
  e = low ? e - 1.f : e;
  m = low ? m + m - 1.f : m - 1.f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z - 2.12194440e-4f * e - 0.5f * z;
  return m + y + 0.693359375f * e;
}

// One token's Gumbel score, logit + G: the row scan and the candidate scoring (tensor
// parallelism's top-k merge) share it, so both round alike. ``position``: the token's id in the
// whole vocabulary, whichever rank holds it.
#pragma omp declare simd
PAGODA_INLINE float gumbel_score(float logit, uint64_t key, uint64_t position) {
  const uint64_t h = mix64(key + (position + 1) * kGamma);
  // The top 24 bits, centred in their interval: U in (0, 1), never 0 or 1.
  const float u = (static_cast<float>(static_cast<int32_t>(h >> 40)) + 0.5f) * 0x1p-24f;
  return logit - fast_log(-fast_log(u));
}

// The best (score, index) of tokens [begin, end) of one row; the first of equal scores. The
// row's token j is token ``offset + j`` of the whole vocabulary (its noise is that token's).
PAGODA_CLONES void gumbel_best(const float* logits, uint64_t key, uint64_t offset, int64_t begin,
                               int64_t end, float* best_score, int64_t* best_index) {
  constexpr int64_t kBlock = 512;
  float score[kBlock];
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = begin;
  for (int64_t start = begin; start < end; start += kBlock) {
    const int64_t n = std::min(kBlock, end - start);
    float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < n; ++j) {
      score[j] = gumbel_score(logits[start + j], key, offset + static_cast<uint64_t>(start + j));
      top = std::max(top, score[j]);
    }
    if (top > best) {  // rare after the first blocks: the scan for the index runs only then
      best = top;
      for (int64_t j = 0; j < n; ++j) {
        if (score[j] == top) {
          at = start + j;
          break;
        }
      }
    }
  }
  *best_score = best;
  *best_index = at;
}

void check_gumbel_inputs(const torch::Tensor& logits, const torch::Tensor& keys) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be float32 [N, V] with contiguous rows");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 1 &&
                  keys.size(0) == logits.size(0) && keys.is_contiguous() && keys.device().is_cpu(),
              "keys must be a contiguous int64 CPU tensor with one key per row");
}

// Per row, the best (score, index) over the whole row: ``scores`` and ``index`` [N].
void gumbel_rows(const torch::Tensor& logits, const torch::Tensor& keys, int64_t offset,
                 float* scores_out, int64_t* index_out) {
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  constexpr int64_t kChunk = 8192;  // tokens per task: a batch of one still uses every thread
  const int64_t chunks = std::max<int64_t>(1, (vocab + kChunk - 1) / kChunk);
  std::vector<float> scores(rows * chunks);
  std::vector<int64_t> index(rows * chunks);
  const float* lp = logits.data_ptr<float>();
  const uint64_t* kp = reinterpret_cast<const uint64_t*>(keys.data_ptr<int64_t>());
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / chunks, lo = (t % chunks) * kChunk;
      gumbel_best(lp + r * stride, kp[r], static_cast<uint64_t>(offset), lo,
                  std::min(vocab, lo + kChunk), &scores[t], &index[t]);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    int64_t t = r * chunks;
    for (int64_t c = 1; c < chunks; ++c) {
      if (scores[r * chunks + c] > scores[t]) t = r * chunks + c;  // ties: the earlier chunk
    }
    scores_out[r] = vocab ? scores[t] : -std::numeric_limits<float>::infinity();
    index_out[r] = vocab ? index[t] : 0;
  }
}

// logits [N, V] float32 with contiguous rows (temperature, top-k/top-p masks already applied:
// -inf never wins unless the whole row is -inf, then token 0, as torch's argmax), keys [N]
// int64 -> [N] int64 tokens.
torch::Tensor gumbel_argmax(const torch::Tensor& logits, const torch::Tensor& keys) {
  check_gumbel_inputs(logits, keys);
  auto out = torch::empty({logits.size(0)}, keys.options());
  std::vector<float> scores(logits.size(0));
  gumbel_rows(logits, keys, 0, scores.data(), out.data_ptr<int64_t>());
  return out;
}

// A vocabulary shard's half of gumbel_argmax (tensor parallelism): logits [N, V_shard] are
// tokens [offset, offset + V_shard) of the vocabulary. Returns (scores [N] float32, tokens [N]
// int64, ids in the whole vocabulary): the shards' best by score (ties: the lower id) is
// gumbel_argmax of the whole row.
std::tuple<torch::Tensor, torch::Tensor> gumbel_best_of_shard(const torch::Tensor& logits,
                                                               const torch::Tensor& keys,
                                                               int64_t offset) {
  check_gumbel_inputs(logits, keys);
  TORCH_CHECK(offset >= 0, "offset must be >= 0");
  auto scores = torch::empty({logits.size(0)}, logits.options());
  auto index = torch::empty({logits.size(0)}, keys.options());
  int64_t* ip = index.data_ptr<int64_t>();
  gumbel_rows(logits, keys, offset, scores.data_ptr<float>(), ip);
  for (int64_t r = 0; r < logits.size(0); ++r) ip[r] += offset;
  return {scores, index};
}

// gumbel_score of chosen tokens: values [N, K] float32 (their logits), ids [N, K] int64 (in the
// whole vocabulary), keys [N] -> [N, K] float32, the very numbers gumbel_argmax compares.
PAGODA_CLONES void gumbel_scores_row(const float* values, const int64_t* ids, uint64_t key,
                                     int64_t n, float* out) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    out[j] = gumbel_score(values[j], key, static_cast<uint64_t>(ids[j]));
  }
}

torch::Tensor gumbel_scores(const torch::Tensor& values, const torch::Tensor& ids,
                            const torch::Tensor& keys) {
  check_gumbel_inputs(values, keys);
  TORCH_CHECK(values.is_contiguous() && ids.is_contiguous() && ids.scalar_type() == at::kLong &&
                  ids.sizes() == values.sizes(),
              "values and ids must be contiguous, [N, K], float32 and int64");
  auto out = torch::empty_like(values);
  const int64_t rows = values.size(0), k = values.size(1);
  const uint64_t* kp = reinterpret_cast<const uint64_t*>(keys.data_ptr<int64_t>());
  for (int64_t r = 0; r < rows; ++r) {
    gumbel_scores_row(values.data_ptr<float>() + r * k, ids.data_ptr<int64_t>() + r * k, kp[r],
                      k, out.data_ptr<float>() + r * k);
  }
  return out;
}

// argmax per row, as torch's (the first of equal maxima; a NaN wins, the first one), spread
// over the threads by row chunks: torch's CPU argmax takes ~0.1 ms for 256 rows of 512, which
// is a greedy decode step's whole sampling. A row is read twice, vectorised: its maximum (and
// whether it holds a NaN), then the first chunk that holds the maximum, scanned for it. Equal
// compares -0.0 and 0.0 alike, so the first zero wins where zero is the maximum, as in torch.
PAGODA_CLONES int64_t argmax_row(const float* row, int64_t vocab) {
  float top = row[0];
  int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
  for (int64_t v = 0; v < vocab; ++v) {
    top = row[v] > top ? row[v] : top;
    nan |= row[v] != row[v];
  }
  if (nan) {
    for (int64_t v = 0; v < vocab; ++v) {
      if (std::isnan(row[v])) return v;
    }
  }
  constexpr int64_t kChunk = 64;
  for (int64_t c = 0; c < vocab; c += kChunk) {
    const int64_t end = std::min(vocab, c + kChunk);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t v = c; v < end; ++v) hit |= row[v] == top;
    if (hit) {
      for (int64_t v = c; v < end; ++v) {
        if (row[v] == top) return v;
      }
    }
  }
  return 0;  // not reached: the maximum is one of the row's values
}

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.size(1) > 0,
              "logits must be float32 [N, V>0] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, 32768 / vocab);  // rows per task: ~32k values
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(lp + r * stride, vocab);
  });
  return out;
}

// ------------------------------------------------------------------ top-k / top-p truncation
//
// Per row: keep the first tokens in sorted order (by logit, descending; ties: the lower id
// first) up to k, and while the mass of the strictly higher-ranked survivors (softmax over the
// top-k) is below p; the rest become -inf. That is what a stable sort and a cumulative sum
// give (torch's reference in sampler.py), found here by selection in O(V) instead of a sort of
// the vocabulary (13 ms for 8 rows of 49k on two cores; a flat distribution, as random-token
// prompts give, puts the cut thousands of tokens down, past any short list of candidates).

// Sum of exp(v[i] - top) over v[0, n), vectorised, summed in float64: a float32 sum over
// tens of thousands of tokens drifts by more than the weight of one of them.
PAGODA_CLONES double mass_of(const float* v, int64_t n, float top) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(fast_exp(v[i] - top));
  return sum;
}

// The number of the row's best tokens to keep, and the value of the last one kept.
struct Cut {
  int64_t keep;
  float value;
};

PAGODA_CLONES float row_max(const float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

// Selection over buf[0, n) (reordered in place), whose top_k are all of the row's top_k: keep
// the best tokens while the mass before each is below p * total (total < 0: buf's top-k mass).
Cut select_cut(std::vector<float>& buf, int64_t k, double p, float top, double total) {
  auto desc = std::greater<float>();
  int64_t n = static_cast<int64_t>(buf.size());
  if (k < n) {  // buf[0, k) becomes the top k
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), desc);
    n = k;
  }
  if (p >= 1.0) return {n, *std::min_element(buf.begin(), buf.begin() + n)};
  const double target = p * (total < 0 ? mass_of(buf.data(), n, top) : total);
  // Invariant: the tokens ranked before [lo, hi) are all kept and weigh acc < target.
  int64_t lo = 0, hi = n, kept = 0;
  double acc = 0.0;
  while (true) {
    if (hi - lo <= 32) {
      std::sort(buf.begin() + lo, buf.begin() + hi, desc);
      float last = buf[lo];
      for (int64_t j = lo; j < hi && acc < target; ++j, ++kept) {
        acc += fast_exp(buf[j] - top);
        last = buf[j];
      }
      return {kept, last};
    }
    const float a = buf[lo], b = buf[(lo + hi) / 2], c = buf[hi - 1];
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of 3
    float* first = buf.data() + lo;
    float* gt_end = std::partition(first, buf.data() + hi, [pivot](float v) { return v > pivot; });
    float* eq_end = std::partition(gt_end, buf.data() + hi, [pivot](float v) { return v == pivot; });
    const double above = mass_of(first, gt_end - first, top);
    if (acc + above >= target) {  // the cut lies among the tokens above the pivot
      hi = lo + (gt_end - first);
      continue;
    }
    acc += above;
    kept += gt_end - first;
    const double w = fast_exp(pivot - top);
    for (float* e = gt_end; e < eq_end; ++e) {  // each tie is kept while the mass is short
      if (acc >= target) return {kept, pivot};
      acc += w;
      ++kept;
    }
    lo = lo + (eq_end - first);
    if (acc >= target || lo == hi) return {kept, pivot};
  }
}

// The row x[0, vocab): k <= vocab; p in (0, 1], 1 is off. A small top_k is one pass with a
// min-heap of the best k (most tokens fail one compare against its least). Without one, the
// cut nearly always lies among the tokens within kSpan of the best (a few hundred in a
// peaked row), so the selection runs on those when they hold enough of the mass; a flat row
// (more than a quarter of the vocabulary that close) runs on the whole row.
Cut find_cut(const float* x, int64_t vocab, int64_t k, double p, std::vector<float>& buf) {
  constexpr float kSpan = 20.f;  // e^-20: below that a token weighs 2e-9 of the best one
  constexpr int64_t kHeapMax = 1024;
  const float top = row_max(x, vocab);
  if (top == -std::numeric_limits<float>::infinity()) return {vocab, top};  // nothing to rank
  if (k < vocab && k <= kHeapMax) {
    auto desc = std::greater<float>();  // with it the heap's front is its least
    buf.assign(x, x + k);
    std::make_heap(buf.begin(), buf.end(), desc);
    for (int64_t i = k; i < vocab; ++i) {
      if (x[i] > buf.front()) {
        std::pop_heap(buf.begin(), buf.end(), desc);
        buf.back() = x[i];
        std::push_heap(buf.begin(), buf.end(), desc);
      }
    }
    return select_cut(buf, k, p, top, -1.0);
  }
  double total = -1.0;  // the top-k's mass: buf's, unless the whole row is the top-k
  bool whole_row = true;
  if (k == vocab) {  // top-p alone (the caller copies rows with neither)
    total = mass_of(x, vocab, top);
    const float floor = top - kSpan;
    const int64_t most = vocab / 4;
    buf.clear();
    for (int64_t i = 0; i < vocab && static_cast<int64_t>(buf.size()) <= most; ++i) {
      if (x[i] >= floor) buf.push_back(x[i]);
    }
    whole_row = static_cast<int64_t>(buf.size()) > most ||
                mass_of(buf.data(), static_cast<int64_t>(buf.size()), top) < p * total;
  }
  if (whole_row) buf.assign(x, x + vocab);
  return select_cut(buf, k, p, top, total);
}

// y = x where kept, else -inf: the tokens above the cut, then those equal to it by id.
PAGODA_CLONES void write_kept(const float* x, float* y, int64_t n, Cut cut) {
  const float ninf = -std::numeric_limits<float>::infinity(), c = cut.value;
  int64_t above = 0, equal = 0;
#pragma omp simd reduction(+ : above, equal)
  for (int64_t i = 0; i < n; ++i) {
    above += x[i] > c;
    equal += x[i] == c;
  }
  if (above + equal == cut.keep) {  // no tie straddles the cut: the rule
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] >= c ? x[i] : ninf;
    return;
  }
  int64_t room = cut.keep - above;
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] > c || (x[i] == c && room-- > 0) ? x[i] : ninf;
}

// logits [N, V] float32 with contiguous rows, top_k [N] int64 (0 or >= V: off), top_p [N]
// float64 in (0, 1] -> a new [N, V] tensor.
torch::Tensor top_k_top_p(const torch::Tensor& logits, const torch::Tensor& top_k,
                          const torch::Tensor& top_p) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be float32 [N, V] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.numel() == rows && top_k.is_contiguous()
                  && top_p.scalar_type() == at::kDouble && top_p.numel() == rows &&
                  top_p.is_contiguous() && top_k.device().is_cpu() && top_p.device().is_cpu(),
              "top_k (int64) and top_p (float64) must be contiguous CPU tensors, one per row");
  auto out = torch::empty({rows, vocab}, logits.options());
  const float* lp = logits.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const double* pp = top_p.data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    buf.reserve(vocab);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * stride;
      float* y = op + r * vocab;
      const int64_t k = kp[r] > 0 && kp[r] < vocab ? kp[r] : vocab;
      if (vocab == 0 || (k == vocab && pp[r] >= 1.0)) {
        std::copy(x, x + vocab, y);
        continue;
      }
      write_kept(x, y, vocab, find_cut(x, vocab, k, pp[r], buf));
    }
  });
  return out;
}
}  // namespace

// Every kernel lets go of the GIL while it runs, as torch's own ops do: the engine's event loop
// (HTTP streams, heartbeats) shares the process with the thread that steps the model.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, release(),
        "Paged decode attention: one query token per request, GQA, out in the query's dtype");
  m.def("store_kv", &store_kv, release(),
        "Writes new K/V into the caches' slots (slots < 0 skipped)");
  m.def("use_avx512_bf16", &use_avx512_bf16,
        "Turns the AVX512-BF16 kernels (bf16 rows, decode attention) on (where the CPU has "
        "them) or off; returns whether they were on");
  m.def("rms_norm", &rms_norm, release(),
        "RMSNorm over rows, with an optional in-place residual add");
  m.def("rotary_", &rotary_, release(), "Rotate-half RoPE in place");
  m.def("silu_and_mul", &silu_and_mul, release(),
        "SiLU(gate) * up on a fused [gate | up] projection");
  m.def("top_k_top_p", &top_k_top_p, release(),
        "Per row, -inf past top_k and past the top_p mass, in sorted order (ties: lower id)");
  m.def("argmax_rows", &argmax_rows, release(),
        "Per row, the index of the largest value (the first of equals; NaN wins), as torch");
  m.def("gumbel_argmax", &gumbel_argmax, release(),
        "Per row, argmax(logits + counter-based Gumbel noise keyed by the row's key)");
  m.def("gumbel_best_of_shard", &gumbel_best_of_shard, release(),
        "A vocabulary shard's best (Gumbel score, token id) per row, its noise the whole "
        "vocabulary's");
  m.def("gumbel_scores", &gumbel_scores, release(),
        "The Gumbel scores gumbel_argmax compares, of the given tokens");
}

// A whole decoding pass of a Llama target's decoder layers in one call, the weights as 4-bit
// codes (codes.h): RMSNorm, the fused q/k/v product, rotary embedding, the KV cache write,
// attention, the output product and residual, RMSNorm, the fused gate/up product, SiLU·up,
// the down product and residual, layer after layer. Through torch's operations the same pass
// was ~40 operations a layer (~1,200 a step), whose dispatch cost more than the products.
//
// Every row is computed alone: RMSNorm, rotary and the products work row by row (the products
// sum each row in the same order whatever the number of rows, codes.h), and each query row
// attends, slot by slot in the cache's order, to exactly the slots it may see. So a row of a
// verification pass is bit for bit what a one-token pass computes for that token, and a batch
// row (its holes skipped) what that request computes alone: speculative decoding stays equal
// to plain decoding (pipeline/llm/lean_llama.py). Float32 throughout, but for the products'
// activations where the weights' records are int4-q8's (8 bits per group of 32, codes.h).
//
// The KV cache is pipeline/llm/kv_cache.py's: keys and values [layers, B, H_kv, capacity, D];
// this pass writes its rows' keys and values at slots start .. start + T - 1.
#include <torch/extension.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "codes.h"
#include "simd16.h"

namespace {

using specvox::simd::Vec;
namespace simd = specvox::simd;

using Clock = std::chrono::steady_clock;

// Seconds spent by kind, when the caller asks (bench/step_split.py).
enum Part { kProducts = 0, kAttention = 1, kCache = 2, kElementwise = 3, kParts = 4 };

struct Timer {
  double* seconds;  // null: not timing
  Clock::time_point last;
  explicit Timer(double* s) : seconds(s) { if (seconds) last = Clock::now(); }
  void lap(Part part) {
    if (!seconds) return;
    const auto now = Clock::now();
    seconds[part] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

// transformers' LlamaRMSNorm in float32: w · (x / sqrt(mean(x²) + eps)); E a multiple of 16.
inline void rms_norm(const float* x, const float* w, float* out, int64_t E, float eps) {
  Vec acc = simd::zero();
  for (int64_t i = 0; i < E; i += 16) {
    const Vec v = simd::loadu(x + i);
    acc = simd::fmadd(v, v, acc);
  }
  const float inv = 1.0f / std::sqrt(simd::sum(acc) / static_cast<float>(E) + eps);
  const Vec scale = simd::set1(inv);
  for (int64_t i = 0; i < E; i += 16) {
    simd::storeu(out + i, simd::mul(simd::loadu(w + i), simd::mul(simd::loadu(x + i), scale)));
  }
}

// Rotary embedding (Su et al. 2021) of one head in transformers' rotate-half layout:
// x·cos + rotate_half(x)·sin, rotate_half(x) = (−x[h:], x[:h]).
inline void rotate(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t h = D / 2;
  float rotated[512];
  for (int64_t j = 0; j < h; ++j) {
    rotated[j] = -x[j + h];
    rotated[j + h] = x[j];
  }
  for (int64_t j = 0; j < D; ++j) x[j] = x[j] * cos[j] + rotated[j] * sin[j];
}

inline float dot(const float* a, const float* b, int64_t D) {
  Vec acc = simd::zero();
  for (int64_t i = 0; i < D; i += 16) acc = simd::fmadd(simd::loadu(a + i), simd::loadu(b + i), acc);
  return simd::sum(acc);
}

// One query row of one head: softmax(q·Kᵀ / sqrt(D)) V over the slots listed, in their order.
void attend(const float* q, const float* keys, const float* values, const int64_t* slots, int64_t count,
            int64_t D, float* out, std::vector<float>& scores) {
  if (count == 0) {  // a padding row that sees nothing: its output is never read
    std::fill(out, out + D, 0.0f);
    return;
  }
  scores.resize(count + 16);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  float top = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    scores[i] = dot(q, keys + slots[i] * D, D) * scale;
    top = std::max(top, scores[i]);
  }
  Vec total = simd::zero();
  for (int64_t i = 0; i < count; i += 16) {
    const int64_t lanes = count - i;  // the last 16 may be fewer
    const Vec e = simd::exp(simd::sub(simd::load_first(scores.data() + i, lanes), simd::set1(top)));
    simd::store_first(scores.data() + i, e, lanes);
    total = simd::add(total, simd::keep_first(e, lanes));
  }
  const float inv = 1.0f / simd::sum(total);
  Vec acc[8];  // D ≤ 128
  for (int64_t j = 0; j < D / 16; ++j) acc[j] = simd::zero();
  for (int64_t i = 0; i < count; ++i) {
    const Vec p = simd::set1(scores[i]);
    const float* v = values + slots[i] * D;
    for (int64_t j = 0; j < D / 16; ++j) acc[j] = simd::fmadd(p, simd::loadu(v + 16 * j), acc[j]);
  }
  for (int64_t j = 0; j < D / 16; ++j) simd::storeu(out + 16 * j, simd::mul(acc[j], simd::set1(inv)));
}

const uint8_t* bytes(const torch::Tensor& t) { return t.data_ptr<uint8_t>(); }

class LeanStep {
 public:
  LeanStep(std::vector<torch::Tensor> input_norms, std::vector<torch::Tensor> qkv, std::vector<torch::Tensor> o,
           std::vector<torch::Tensor> post_norms, std::vector<torch::Tensor> gate_up,
           std::vector<torch::Tensor> down, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
           bool int8_activations)
      : input_norms_(std::move(input_norms)), qkv_(std::move(qkv)), o_(std::move(o)),
        post_norms_(std::move(post_norms)), gate_up_(std::move(gate_up)), down_(std::move(down)),
        heads_(heads), kv_heads_(kv_heads), D_(head_dim), eps_(static_cast<float>(eps)),
        int8_activations_(int8_activations) {
    layers_ = static_cast<int64_t>(qkv_.size());
    TORCH_CHECK(layers_ > 0 && input_norms_.size() == qkv_.size() && o_.size() == qkv_.size() &&
                post_norms_.size() == qkv_.size() && gate_up_.size() == qkv_.size() && down_.size() == qkv_.size(),
                "one tensor of each kind per layer");
    E_ = input_norms_[0].size(0);
    QKV_ = (heads_ + 2 * kv_heads_) * D_;
    I_ = gate_up_[0].size(0) * specvox::kLanes / 2;
    TORCH_CHECK(D_ % 16 == 0 && D_ <= 128 && E_ % specvox::kGroup == 0 && I_ % specvox::kGroup == 0 &&
                heads_ % kv_heads_ == 0 && heads_ * D_ == E_, "shapes the lean step does not take");
    for (int64_t l = 0; l < layers_; ++l) {
      check_records(qkv_[l], QKV_, E_);
      check_records(o_[l], E_, heads_ * D_);
      check_records(gate_up_[l], 2 * I_, E_);
      check_records(down_[l], E_, I_);
      TORCH_CHECK(input_norms_[l].is_contiguous() && post_norms_[l].is_contiguous() &&
                  input_norms_[l].scalar_type() == torch::kFloat32, "norm weights: contiguous float32");
    }
  }

  // x [B·T, E] (rows in (b, t) order, updated in place and returned); keys and values
  // [layers, B, H_kv, capacity, D]; cos and sin [positions, D]; positions [B, T] (none: start + t);
  // visible [B, T, start + T] bool (none: row t sees slots 0 .. start + t); timings float64 [4].
  torch::Tensor forward(torch::Tensor x, torch::Tensor keys, torch::Tensor values, int64_t start,
                        torch::Tensor cos, torch::Tensor sin, std::optional<torch::Tensor> positions,
                        std::optional<torch::Tensor> visible, std::optional<torch::Tensor> timings) {
    const int64_t B = keys.size(1), capacity = keys.size(3), N = x.size(0), T = N / B;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == E_ && x.is_contiguous() && x.scalar_type() == torch::kFloat32 &&
                N == B * T, "x: [B·T, hidden] contiguous float32");
    TORCH_CHECK(keys.dim() == 5 && keys.size(0) == layers_ && keys.size(2) == kv_heads_ && keys.size(4) == D_ &&
                keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes() &&
                keys.scalar_type() == torch::kFloat32 && start + T <= capacity, "keys/values: the cache's buffers");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D_, "cos/sin: [positions, head_dim]");
    std::vector<int64_t> pos(N);
    if (positions) {
      auto p = positions->contiguous();
      TORCH_CHECK(p.numel() == N && p.scalar_type() == torch::kLong, "positions: [B, T] int64");
      std::copy(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + N, pos.begin());
    } else {
      for (int64_t n = 0; n < N; ++n) pos[n] = start + n % T;
    }
    for (const int64_t p : pos) TORCH_CHECK(p >= 0 && p < cos.size(0), "a position past the rotary table");
    // each row's visible slots, in order
    std::vector<std::vector<int64_t>> seen(N);
    torch::Tensor mask;
    if (visible) {
      mask = visible->to(torch::kBool).contiguous();
      TORCH_CHECK(mask.numel() == N * (start + T), "visible: [B, T, start + T]");
    }
    for (int64_t n = 0; n < N; ++n) {
      const int64_t t = n % T;
      if (visible) {
        const bool* m = mask.data_ptr<bool>() + n * (start + T);
        for (int64_t s = 0; s < start + T; ++s) if (m[s]) seen[n].push_back(s);
      } else {
        for (int64_t s = 0; s <= start + t; ++s) seen[n].push_back(s);
      }
    }
    int64_t visible_slots = 0;  // over all rows: what attention reads
    for (const auto& slots : seen) visible_slots += static_cast<int64_t>(slots.size());
    double* seconds = nullptr;
    if (timings) {
      TORCH_CHECK(timings->scalar_type() == torch::kDouble && timings->numel() >= kParts, "timings: float64 [4]");
      seconds = timings->data_ptr<double>();
    }
    std::vector<float> h(N * E_), qkv(N * QKV_), attended(N * E_), delta(N * E_), gu(N * 2 * I_), act(N * I_);
    float* xs = x.data_ptr<float>();
    const float* cos_table = cos.data_ptr<float>();
    const float* sin_table = sin.data_ptr<float>();
    const int64_t group = heads_ / kv_heads_;
    Timer timer(seconds);
    for (int64_t l = 0; l < layers_; ++l) {
      for (int64_t n = 0; n < N; ++n) rms_norm(xs + n * E_, input_norms_[l].data_ptr<float>(), h.data() + n * E_, E_, eps_);
      timer.lap(kElementwise);
      product(h.data(), N, E_, qkv_[l], qkv.data(), QKV_);
      timer.lap(kProducts);
      for (int64_t n = 0; n < N; ++n) {
        float* row = qkv.data() + n * QKV_;
        for (int64_t hd = 0; hd < heads_ + kv_heads_; ++hd) rotate(row + hd * D_, cos_table + pos[n] * D_, sin_table + pos[n] * D_, D_);
      }
      timer.lap(kElementwise);
      float* layer_keys = keys.data_ptr<float>() + l * B * kv_heads_ * capacity * D_;
      float* layer_values = values.data_ptr<float>() + l * B * kv_heads_ * capacity * D_;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t b = n / T, slot = start + n % T;
        const float* row = qkv.data() + n * QKV_;
        for (int64_t kh = 0; kh < kv_heads_; ++kh) {
          const int64_t offset = ((b * kv_heads_ + kh) * capacity + slot) * D_;
          std::copy(row + (heads_ + kh) * D_, row + (heads_ + kh + 1) * D_, layer_keys + offset);
          std::copy(row + (heads_ + kv_heads_ + kh) * D_, row + (heads_ + kv_heads_ + kh + 1) * D_,
                    layer_values + offset);
        }
      }
      timer.lap(kCache);
      // weighed for the pool's chooser as the products are: rows × the inputs a row reads (D a slot)
      specvox::parallel_for(0, N * heads_, 2, [&](int64_t i0, int64_t i1) {
        thread_local std::vector<float> scores;
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t n = i / heads_, hd = i % heads_, b = n / T, kh = hd / group;
          const int64_t base = (b * kv_heads_ + kh) * capacity * D_;
          attend(qkv.data() + n * QKV_ + hd * D_, layer_keys + base, layer_values + base, seen[n].data(),
                 static_cast<int64_t>(seen[n].size()), D_, attended.data() + n * E_ + hd * D_, scores);
        }
      }, static_cast<double>(visible_slots) * static_cast<double>(heads_ * D_), specvox::Pool::kAttention);
      timer.lap(kAttention);
      product(attended.data(), N, E_, o_[l], delta.data(), E_);
      timer.lap(kProducts);
      for (int64_t i = 0; i < N * E_; ++i) xs[i] += delta[i];
      for (int64_t n = 0; n < N; ++n) rms_norm(xs + n * E_, post_norms_[l].data_ptr<float>(), h.data() + n * E_, E_, eps_);
      timer.lap(kElementwise);
      product(h.data(), N, E_, gate_up_[l], gu.data(), 2 * I_);
      timer.lap(kProducts);
      for (int64_t n = 0; n < N; ++n) {
        const float* gate = gu.data() + n * 2 * I_;
        const float* up = gate + I_;
        float* a = act.data() + n * I_;
        for (int64_t i = 0; i < I_; i += 16) {  // silu(g) · up = g / (1 + e^−g) · up
          const Vec g = simd::loadu(gate + i);
          const Vec s = simd::div(g, simd::add(simd::set1(1.0f), simd::exp(simd::sub(simd::zero(), g))));
          simd::storeu(a + i, simd::mul(s, simd::loadu(up + i)));
        }
      }
      timer.lap(kElementwise);
      product(act.data(), N, I_, down_[l], delta.data(), E_);
      timer.lap(kProducts);
      for (int64_t i = 0; i < N * E_; ++i) xs[i] += delta[i];
      timer.lap(kElementwise);
    }
    return x;
  }

 private:
  // a layer matrix's product: float32 activations (int4-exact) or 8-bit ones (int4-q8; codes.h), on its
  // 4-bit records (a target's layers) or 8-bit ones (a draft head's layer, draft_head.CodedEagle)
  void product(const float* x, int64_t rows, int64_t K, const torch::Tensor& records, float* out, int64_t N) const {
    specvox::coded_product(x, rows, K, bytes(records), out, N, records.size(2) == specvox::kInt4Record,
                           int8_activations_);
  }

  static void check_records(const torch::Tensor& r, int64_t out, int64_t in) {
    TORCH_CHECK(r.scalar_type() == torch::kUInt8 && r.is_contiguous() && r.dim() == 3 &&
                r.size(0) * specvox::kLanes == out && r.size(1) * specvox::kGroup == in &&
                (r.size(2) == specvox::kInt4Record || r.size(2) == specvox::kInt8Record),
                "a layer matrix that is not 4- or 8-bit records of its shape");
  }

  std::vector<torch::Tensor> input_norms_, qkv_, o_, post_norms_, gate_up_, down_;
  int64_t heads_, kv_heads_, D_, layers_ = 0, E_ = 0, QKV_ = 0, I_ = 0;
  float eps_;
  bool int8_activations_;
};

}  // namespace

void register_lean_step(pybind11::module& m) {
  pybind11::class_<LeanStep>(m, "LeanStep")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t,
                          int64_t, int64_t, double, bool>())
      .def("forward", &LeanStep::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "a decoding pass through every layer (see lean_step.cpp)");
}

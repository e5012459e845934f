// A mixture of experts' two kernels: the router's choice of experts per row (route_row, the
// semantics of model/moe.py's route), and the experts' products computed for the chosen experts
// only (grouped_expert_matmul).
//
// Layout: one projection of a layer's experts (gate, up or down) is every expert's [out, in]
// weight packed by pack_ints into ceil(out / 16) group rows, expert after expert, so an expert
// is one contiguous run of bytes and the ones no row chose are never read.
//
// Rows are grouped by expert before the product: the caller lays the (row, slot) pairs out
// expert by expert, so each chosen expert multiplies all its rows in one pass over its weights
// (a prefill chunk's 1,024 rows choosing 8 of 64 experts give each about 128 rows, enough for
// full tiles). All of a step's experts share one parallel region: per expert, a region would be
// 8 to 24 small products per layer, each starting both threads cold and ending at a barrier.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "activations.h"
#include "blocks.h"
#include "quant_matmul.h"

namespace tokios {

// How router logits become weights (model/moe.py SCORINGS, in that order).
enum class Scoring { kSoftmax = 0, kSigmoid = 1, kTopKSoftmax = 2 };

// One row's k experts (descending score; equal scores: the lower expert id first, as route's
// stable sort) and their weights. logits [E]; selection_bias [E] or null is added for choosing
// only; scores: E floats of scratch.
inline void route_row(const float* logits, int64_t num_experts, int64_t k, Scoring scoring, bool normalize,
                      float scale, const float* selection_bias, float* scores, int64_t* expert_ids, float* weights) {
  if (scoring == Scoring::kSoftmax) {
    float maximum = -INFINITY;
    for (int64_t e = 0; e < num_experts; ++e) maximum = std::max(maximum, logits[e]);
    float total = 0.f;
    for (int64_t e = 0; e < num_experts; ++e) total += scores[e] = std::exp(logits[e] - maximum);
    for (int64_t e = 0; e < num_experts; ++e) scores[e] /= total;
  } else if (scoring == Scoring::kSigmoid) {
    for (int64_t e = 0; e < num_experts; ++e) scores[e] = 1.f / (1.f + std::exp(-logits[e]));
  } else {
    std::copy(logits, logits + num_experts, scores);
  }
  // k passes of a strict maximum over ascending ids: the first of equal scores wins. k is at
  // most a few dozen and E a few hundred: no sort needed.
  for (int64_t slot = 0; slot < k; ++slot) {
    int64_t best = -1;
    float best_value = -INFINITY;
    for (int64_t e = 0; e < num_experts; ++e) {
      bool taken = false;
      for (int64_t s = 0; s < slot; ++s) taken |= expert_ids[s] == e;
      if (taken) continue;
      const float value = selection_bias ? scores[e] + selection_bias[e] : scores[e];
      if (best < 0 || value > best_value) {
        best = e;
        best_value = value;
      }
    }
    expert_ids[slot] = best;
    weights[slot] = scores[best];
  }
  if (scoring == Scoring::kTopKSoftmax) {
    const float maximum = *std::max_element(weights, weights + k);
    float total = 0.f;
    for (int64_t s = 0; s < k; ++s) total += weights[s] = std::exp(weights[s] - maximum);
    for (int64_t s = 0; s < k; ++s) weights[s] /= total;
  }
  if (normalize) {
    float total = 0.f;
    for (int64_t s = 0; s < k; ++s) total += weights[s];
    total = std::max(total, FLT_MIN);  // sigmoid scores may all underflow: 0 weights, not NaN
    for (int64_t s = 0; s < k; ++s) weights[s] /= total;
  }
  if (scale != 1.f) {
    for (int64_t s = 0; s < k; ++s) weights[s] *= scale;
  }
}

// One projection of every expert of a layer (layout above), written at `column` of the output rows.
struct ExpertProjection {
  const uint8_t* weights;
  int64_t format;
  int64_t out_features;
  const float* bias;  // [num_experts, out_features], or null
  int64_t column;
  int64_t groups_per_expert() const { return (out_features + kGroup - 1) / kGroup; }
};

// The experts a step uses and their rows: expert expert_ids[i] multiplies activation rows
// [row_starts[i], row_starts[i + 1]).
struct ExpertRows {
  std::vector<int64_t> expert_ids;
  std::vector<int64_t> row_starts{0};
};

// out rows (stride out_stride) = each used expert's rows of `activations` times its weights, for
// every projection. Work items are (used expert, projection, group) in that order, split into
// one consecutive share per thread, so a thread reads whole experts' bytes as one stream.
// Returns the weight bytes read.
inline int64_t grouped_expert_matmul(const QuantizedActivations& activations, const ExpertRows& rows,
                                     const std::vector<ExpertProjection>& projections, bool precise, float* out,
                                     int64_t out_stride) {
  const int64_t num_projections = static_cast<int64_t>(projections.size());
  const int64_t num_segments = static_cast<int64_t>(rows.expert_ids.size()) * num_projections;
  std::vector<GroupLayout> layouts;
  std::vector<const DotKernel*> kernels;
  for (const ExpertProjection& projection : projections) {
    layouts.emplace_back(projection.format, activations.in_features);
    kernels.push_back(&dot_kernel(projection.format, precise, false));  // experts are never split by input
  }
  // segment_starts[s]: the first item of segment s = (used expert s / P, projection s % P).
  std::vector<int64_t> segment_starts(num_segments + 1, 0);
  int64_t num_bytes = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t groups = projections[s % num_projections].groups_per_expert();
    segment_starts[s + 1] = segment_starts[s] + groups;
    num_bytes += groups * layouts[s % num_projections].row_bytes;
  }
  at::parallel_for(0, segment_starts[num_segments], 1, [&](int64_t begin, int64_t end) {
    int64_t s = std::upper_bound(segment_starts.begin(), segment_starts.end(), begin) - segment_starts.begin() - 1;
    for (; begin < end; ++s) {
      const int64_t segment_end = std::min(end, segment_starts[s + 1]);
      const int64_t used = s / num_projections, p = s % num_projections;
      const ExpertProjection& projection = projections[p];
      const int64_t expert = rows.expert_ids[used];
      const uint8_t* weight = projection.weights + expert * projection.groups_per_expert() * layouts[p].row_bytes;
      const float* bias = projection.bias ? projection.bias + expert * projection.out_features : nullptr;
      matmul_groups(activations, rows.row_starts[used], rows.row_starts[used + 1], weight, layouts[p], *kernels[p],
                    projection.out_features, begin - segment_starts[s], segment_end - segment_starts[s], bias,
                    ProductOut{out, nullptr, out_stride}.at(0, projection.column));
      begin = segment_end;
    }
  });
  return num_bytes;
}

}  // namespace tokios

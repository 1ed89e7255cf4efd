// RoutedPairs: the routed (row, expert, weight) triples one EP rank receives for one MoE
// layer, one per selected expert of a row: the unit of the dispatch wire (dataplane/dispatch/
// wire.h), as host vectors. The expert worker itself receives them into its backend's
// memory and unpacks them there (Backend::UnpackRoutedPairs, RoutedPairTensors); host
// pairs are for tests and benchmarks that build rounds by hand (UploadRoutedPairs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dxs {

struct RoutedPairs {
  std::vector<int32_t> rows;  // rows of x
  std::vector<int32_t> experts;
  std::vector<float> weights;
  // Rows of out, when they differ from `rows`; empty: out row == x row.
  std::vector<int32_t> out_rows;
  size_t size() const { return rows.size(); }
  int32_t out_row(size_t p) const { return out_rows.empty() ? rows[p] : out_rows[p]; }
  void Add(int32_t row, int32_t expert, float weight) {
    rows.push_back(row);
    experts.push_back(expert);
    weights.push_back(weight);
  }
};

}  // namespace dxs
